"""
Tiny Shakespeare as GPT-2 BPE tokens (tiktoken's 'gpt2' encoding), for fine-tuning GPT-2.

    python data/shakespeare/prepare.py
    python train.py config/finetune_gpt2.py

Downloads input.txt and tiktoken's GPT-2 vocabulary once (this needs the network; offline it stops with one
line saying so), then writes train.bin and val.bin (uint16 token ids, 90/10 split). No meta.pkl: a data set
without one is GPT-2 BPE to train.py and sample.py.
"""
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def gpt2_encoding():
    """tiktoken's GPT-2 encoding (downloaded and cached by tiktoken on first use)."""
    import tiktoken
    try:
        return tiktoken.get_encoding('gpt2')
    except Exception as e:  # tiktoken raises requests' errors, ValueError, ... when it cannot fetch the files
        raise SystemExit(f"error: could not load tiktoken's GPT-2 encoding ({type(e).__name__}); it is "
                         "downloaded "
                         f"on first use, so run this once with network access")


def write_bpe_dataset(text, out_dir, enc):
    """BPE-encode text with enc, split 90/10, write train.bin and val.bin (uint16) to out_dir."""
    n_chars = int(0.9 * len(text))
    splits = {'train': enc.encode_ordinary(text[:n_chars]), 'val': enc.encode_ordinary(text[n_chars:])}
    if enc.n_vocab > 2**16:
        raise SystemExit(f"error: vocabulary of {enc.n_vocab} does not fit uint16")
    os.makedirs(out_dir, exist_ok=True)
    for split, ids in splits.items():
        np.array(ids, dtype=np.uint16).tofile(os.path.join(out_dir, f'{split}.bin'))
    stale_meta = os.path.join(out_dir, 'meta.pkl')
    if os.path.exists(stale_meta):  # a char-level vocabulary left from an earlier run would be read instead
        os.remove(stale_meta)
    print(f"{len(text):,} characters, {enc.name} BPE: train {len(splits['train']):,} tokens, "
          f"val {len(splits['val']):,} tokens -> {out_dir}")


if __name__ == '__main__':
    import importlib.util
    spec = importlib.util.spec_from_file_location('shakespeare_char_prepare',
                                                  os.path.join(HERE, '..', 'shakespeare_char', 'prepare.py'))
    shakespeare_char = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shakespeare_char)
    text = shakespeare_char.download(shakespeare_char.URL, os.path.join(HERE, 'input.txt'))
    write_bpe_dataset(text, HERE, gpt2_encoding())
