"""
The default data set, made offline: the Python standard library's own .py sources as characters.

    python data/stdlib_char/prepare.py

Real text on every machine, written by none of us. The files are read in sorted order from
sysconfig.get_paths()['stdlib'], without test folders and site-packages, up to a fixed character budget, then
split 90/10 into train.bin and val.bin (uint16 character ids) with the vocabulary in meta.pkl.
"""
import os
import pickle
import sysconfig

import numpy as np

CHAR_BUDGET = 2_000_000
SKIP_DIRS = {'test', 'tests', 'idle_test', 'site-packages', 'dist-packages', '__pycache__'}


def stdlib_text(budget=CHAR_BUDGET):
    root = sysconfig.get_paths()['stdlib']
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith('.py')]
    parts, total = [], 0
    for path in sorted(paths):
        with open(path, encoding='utf-8', errors='replace') as f:
            text = f.read()
        parts.append(text)
        total += len(text)
        if total >= budget:
            break
    return ''.join(parts)[:budget]


def write_atomically(path, write):
    """write(f) into path.tmp.<pid>, then rename it to path (atomic on one file system)."""
    tmp = f'{path}.tmp.{os.getpid()}'
    with open(tmp, 'wb') as f:
        write(f)
    os.replace(tmp, path)


def write_char_dataset(text, out_dir):
    """Char-level encode text, split 90/10, write train.bin, val.bin (uint16) and meta.pkl to out_dir."""
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    os.makedirs(out_dir, exist_ok=True)
    # each file under a temporary name, then renamed: a reader never sees half a file, and train.bin, whose
    # presence says "the data set is here", comes last
    write_atomically(os.path.join(out_dir, 'meta.pkl'),
                     lambda f: pickle.dump({'vocab_size': len(chars), 'itos': itos, 'stoi': stoi}, f))
    write_atomically(os.path.join(out_dir, 'val.bin'), lambda f: ids[n:].tofile(f))
    write_atomically(os.path.join(out_dir, 'train.bin'), lambda f: ids[:n].tofile(f))
    print(f"{len(text):,} characters, vocabulary {len(chars)}: train {n:,} tokens, val {len(ids) - n:,} "
          "tokens "
          f"-> {out_dir}")


if __name__ == '__main__':
    write_char_dataset(stdlib_text(), os.path.dirname(os.path.abspath(__file__)))
