"""README.md and README.zh-CN.md state the same facts: every command and every file named in one is named in the
other, so neither drifts when the code changes."""
import os
import re

from helpers import REPO

COMMAND = re.compile(r'^(?:[A-Z_]+=\S+ )*(?:python|torchrun|pip) ')
FILE = re.compile(r'^(?:[\w.-]+/)*[\w.*{}-]+\.(?:py|json|md|pt|png|jsonl)$|^(?:config|data|tests|docs)/[\w./*<>-]*$')


def normalize(command):
    command = re.sub(r'\s+#.*$', '', command)  # a trailing comment is prose, in either language
    return ' '.join(command.replace('\\\n', ' ').rstrip(' &').split())


def named(path):
    """(commands, files) that a README names: the commands in its code blocks and inline code, and the paths."""
    text = open(os.path.join(REPO, path), encoding='utf-8').read()
    commands, files = set(), set()
    for block in re.findall(r'```\w*\n(.*?)```', text, flags=re.S):
        for line in block.replace('\\\n', ' ').splitlines():
            if COMMAND.match(line.strip()):
                commands.add(normalize(line.strip()))
    inline = re.findall(r'(?<!`)`([^`\n]+)`(?!`)', re.sub(r'```.*?```', '', text, flags=re.S))
    for code in inline:
        if COMMAND.match(code):
            commands.add(normalize(code))
        elif FILE.match(code):
            files.add(code)
    return commands, files


def test_both_readmes_name_the_same_commands_and_files():
    en_commands, en_files = named('README.md')
    zh_commands, zh_files = named('README.zh-CN.md')
    assert len(en_commands) > 20 and len(en_files) > 10  # the extraction found them (not an empty comparison)
    assert en_commands - zh_commands == set(), 'commands only in README.md'
    assert zh_commands - en_commands == set(), 'commands only in README.zh-CN.md'
    assert en_files - zh_files == set(), 'files only in README.md'
    assert zh_files - en_files == set(), 'files only in README.zh-CN.md'


def test_every_file_a_readme_names_exists():
    for readme in ('README.md', 'README.zh-CN.md'):
        for f in named(readme)[1]:
            if not any(c in f for c in '*{}<>') and not f.startswith(('out', 'trace_rank', 'schedule_trace')) and \
                    f not in ('ckpt.pt', 'log.jsonl', 'ds_config.json', 'meta.pkl', 'train.bin', 'val.bin'):
                assert any(os.path.exists(os.path.join(REPO, d, f)) for d in ('', 'tests')), (readme, f)
