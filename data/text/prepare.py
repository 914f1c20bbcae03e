"""
Your own text files as a data set, by characters or by GPT-2 BPE.

    python data/text/prepare.py --input 'notes/*.txt' --tokenizer char          # -> data/text
    python data/text/prepare.py --input 'src/**/*.md' --tokenizer gpt2 --out data/mydocs
    python train.py --dataset=mydocs

The files matching --input (a glob; ** recurses) are read in sorted order and joined, then written as
train.bin and val.bin (uint16, 90/10 split) into --out, with meta.pkl for the char vocabulary. --out must be
data/<name> for train.py's --dataset=<name> to find it.
"""
import argparse
import glob
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load_module(path):
    """Import a prepare.py by its path (data/ is not a package): each writer lives in one place."""
    spec = importlib.util.spec_from_file_location(os.path.basename(os.path.dirname(path)) + '_prepare', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_files(pattern):
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not paths:
        raise SystemExit(f"error: no files match --input {pattern!r}")
    parts = []
    for i, path in enumerate(paths):
        with open(path, encoding='utf-8', errors='replace') as f:
            parts.append(f.read())
        if len(paths) >= 10 and (i + 1) % max(1, len(paths) // 10) == 0:
            print(f"reading: {i + 1}/{len(paths)} files", flush=True)
    text = '\n'.join(parts)
    if len(text) < 100:
        raise SystemExit(f"error: the {len(paths)} file(s) matching {pattern!r} hold only {len(text)} "
                         "characters")
    print(f"{len(paths)} file(s) matching {pattern!r}")
    return text


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument('--input', required=True, help="glob of the text files, quoted: 'dir/*.txt'")
    parser.add_argument('--tokenizer', choices=('char', 'gpt2'), default='char')
    parser.add_argument('--out', default=HERE, help='output folder, data/<name> (default: data/text)')
    args = parser.parse_args(argv)
    text = read_files(args.input)
    if args.tokenizer == 'char':
        chars = load_module(os.path.join(HERE, '..', 'stdlib_char', 'prepare.py'))
        if len(set(text)) > 2**16:
            raise SystemExit("error: more than 65536 distinct characters do not fit uint16")
        chars.write_char_dataset(text, args.out)
    else:
        bpe = load_module(os.path.join(HERE, '..', 'shakespeare', 'prepare.py'))
        bpe.write_bpe_dataset(text, args.out, bpe.gpt2_encoding())


if __name__ == '__main__':
    main(sys.argv[1:])
