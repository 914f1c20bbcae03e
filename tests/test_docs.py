"""README.md and README.zh-CN.md state the same facts: every command and every file named in one is named in the
other, so neither drifts when the code changes; and the planner's tables in docs/big_models.md are what it prints."""
import ast
import os
import re
import shutil
import subprocess
import sys

from helpers import REPO, TINY, check, read_log, run_script, train_losses

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


def imported_files(script):
    """The repository's files that `script` reaches by its module-level imports, followed file by file: what
    a copy of it must take along (a function's own import, like the loop's of common/observe.py on a measured
    step, is left out: such a file is optional)."""
    seen, todo = set(), [script]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.parse(open(os.path.join(REPO, path)).read()).body:
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] + [f'{node.module}.{a.name}' for a in node.names] \
                if isinstance(node, ast.ImportFrom) and node.module else []
            todo += [m.replace('.', '/') + '.py' for m in modules
                     if os.path.isfile(os.path.join(REPO, m.replace('.', '/') + '.py'))]
    return seen


def test_zero_py_copied_with_the_files_the_readme_names_trains_the_same(tmp_path):
    """README: copying zero.py means copying it with zero3.py, model.py, common/config.py, data.py,
    training.py, checkpoints.py and distributed.py. Those are its imports, and a copy of just them (and the
    data) trains: the same losses as in the repository, and its measured first step says the measuring files
    are not there."""
    files = imported_files('zero.py')
    assert files == {'zero.py', 'zero3.py', 'model.py', 'common/config.py', 'common/data.py', 'common/training.py',
                     'common/checkpoints.py', 'common/distributed.py'}, files
    for path in files | {f'data/stdlib_char/{f}' for f in ('train.bin', 'val.bin', 'meta.pkl')}:
        os.makedirs(os.path.dirname(tmp_path / 'copy' / path), exist_ok=True)
        shutil.copy(os.path.join(REPO, path), tmp_path / 'copy' / path)
    args = TINY + ['--stage=3', '--max_iters=2', '--eval_interval=2', '--log_interval=1']
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH='')
    copied = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                             'zero.py', *args, f'--out_dir={tmp_path / "copied"}'], cwd=tmp_path / 'copy',
                            capture_output=True, text=True, timeout=240, env=env)
    check(copied)
    assert '(iter 0 not measured: common/observe.py is not here)' in copied.stdout, copied.stdout
    check(run_script('zero.py', args + [f'--out_dir={tmp_path / "here"}'], nproc=2))
    assert train_losses(tmp_path / 'copied') == train_losses(tmp_path / 'here') != {}
    # the log says which steps an observer ran in: none where the measuring files are not there
    observed = lambda out: [r['iter'] for r in read_log(out) if r.get('observed')]
    assert observed(tmp_path / 'copied') == [] and observed(tmp_path / 'here') == [0]


def test_the_planners_tables_in_big_models_md_are_what_it_prints(tmp_path):
    """docs/big_models.md shows bench.py --estimate's tables for TinyLlama on 8 x 80 GB (and that command's
    ranking), and for Llama 2 7B on 16 GPUs over a thin network: every row shown there is a row the planner
    prints today (they went stale once when the planner's bf16 pricing changed)."""
    doc = open(os.path.join(REPO, 'docs', 'big_models.md')).read()
    tiny, thin = 'config/tinyllama_1b.py --gpus=8 --gpu_mem_gb=80', 'config/llama2_7b.py --gpus=16 --ib_gbps=6.25'
    printed = {}
    for flags in (tiny, thin):
        proc = subprocess.run([sys.executable, 'bench.py', '--estimate', *flags.split(), f'--out={tmp_path}'],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        printed[flags] = proc.stdout.splitlines()
    for flags, where in ((tiny, 'The output of the command above, today'), (tiny, 'For TinyLlama on one node'),
                         (thin, 'falls to 25% MFU and ZeRO-1 leads')):
        block = doc[doc.index(where):].split('```')[1]
        shown = [line for line in block.splitlines() if line.startswith('| ') and
                 ('GB |' in line or line.split('|')[1].strip().isdigit())]
        assert len(shown) >= 4, (where, block[:300])
        assert [line for line in shown if line not in printed[flags]] == [], where
