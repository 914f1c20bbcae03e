"""
The data: the token files (data/<dataset>/{train,val}.bin, prepared once by one rank on a fresh checkout), the
one batch rule (the global batch at iteration i is a pure function of seed and i, whatever the world size and
strategy; each data-parallel rank takes its contiguous slice) and the text codec sample.py uses.
"""

import os

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (data/ is beside common/)


def prepare_once(data_dir, prepare):
    """Run data_dir's prepare.py in one process: every rank of a fresh checkout arrives here at once, the
    first to lock data_dir/.prepare.lock prepares, the others wait on the lock and then find the files
    (written under temporary names and renamed, so nobody reads half a file)."""
    import fcntl
    import runpy
    with open(os.path.join(data_dir, '.prepare.lock'), 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(data_dir, 'train.bin')):
            print(f"{data_dir} is missing its data: preparing it now (python {os.path.relpath(prepare)})",
                  flush=True)
            runpy.run_path(prepare, run_name='__main__')


def load_dataset(dataset):
    """Memmaps of data/<dataset>/{train,val}.bin and the vocabulary size (from meta.pkl, else GPT-2's 50304).
    The default data set (stdlib_char) is built here on first use; any other missing one names its command."""
    import pickle
    data_dir = os.path.join(REPO, 'data', dataset)
    if not os.path.exists(os.path.join(data_dir, 'train.bin')):
        prepare = os.path.join(data_dir, 'prepare.py')
        if dataset == 'stdlib_char' and os.path.exists(prepare):
            prepare_once(data_dir, prepare)
        else:
            hint = (f"python data/{dataset}/prepare.py" if os.path.exists(prepare) else
                    "see data/ for the prepare scripts")
            raise SystemExit(f"error: data set '{dataset}' not found in {data_dir}; make it with: {hint}")
    data = {split: np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
            for split in ('train', 'val')}
    vocab_size = 50304
    meta_path = os.path.join(data_dir, 'meta.pkl')
    if os.path.exists(meta_path):
        with open(meta_path, 'rb') as f:
            vocab_size = pickle.load(f)['vocab_size']
    return data, vocab_size


TRAIN_STREAM, EVAL_STREAM = 0, 1


def get_batch(tokens, seed, stream, step, n_rows, block_size, rows=None, device='cpu'):
    """Rows `rows` (a slice; default all) of the batch of n_rows sequences for (seed, stream, step).
    The batch is a pure function of those numbers, so every strategy and world size sees the same global batch
    at iteration `step` and each data-parallel rank just takes its own contiguous slice of it; resume needs no
    data-loader state. x is the sequence, y the same shifted by one token."""
    if len(tokens) <= block_size + 1:
        raise SystemExit(f"error: block_size {block_size} is too large for a data split of {len(tokens)} "
                         "tokens")
    rng = np.random.default_rng([seed, stream, step])
    starts = rng.integers(0, len(tokens) - block_size - 1, size=n_rows)
    if rows is not None:
        starts = starts[rows]
    window = np.asarray(tokens[starts[:, None] + np.arange(block_size + 1)], dtype=np.int64)  # one gather
    xy = torch.from_numpy(window)
    x, y = xy[:, :-1], xy[:, 1:]
    if device.startswith('cuda'):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.contiguous(), y.contiguous()


def micro_batch_rows(cfg, dp_rank, dp_size, micro_step):
    """The one batch rule of this repo. The global batch is batch_size * gradient_accumulation_steps
    sequences, whatever the world size. Each of the dp_size data-parallel ranks owns a contiguous block of it
    and walks through that block batch_size sequences per micro-step, gradient_accumulation_steps // dp_size
    micro-steps."""
    rows_per_rank = cfg.batch_size * (cfg.gradient_accumulation_steps // dp_size)
    first = dp_rank * rows_per_rank + micro_step * cfg.batch_size
    return slice(first, first + cfg.batch_size)


def get_codec(dataset, vocab_size=None):
    """encode(str) -> list[int] and decode(list[int]) -> str: the char vocabulary of data/<dataset>/meta.pkl
    if it has one, else (also for dataset None) tiktoken's GPT-2 BPE, which a model of vocab_size tokens, if
    given, must have room for."""
    import pickle
    meta_path = os.path.join(REPO, 'data', dataset or '', 'meta.pkl')
    if dataset is not None and os.path.exists(meta_path):
        with open(meta_path, 'rb') as f:
            meta = pickle.load(f)
        stoi, itos = meta['stoi'], meta['itos']
        return (lambda s: [stoi[c] for c in s if c in stoi]), (lambda ids: ''.join(itos[i] for i in ids))
    if vocab_size is not None and vocab_size < 50257:  # (a char-level model without its meta.pkl here)
        raise SystemExit(f"error: the model's {vocab_size}-token vocabulary is not GPT-2's BPE, and " + (
            f"{meta_path} is not here: prepare its data set first (python data/{dataset}/prepare.py)"
            if dataset else "a Hugging Face model brings no other here: sample its checkpoint (--out_dir)"))
    import tiktoken
    try:
        enc = tiktoken.get_encoding('gpt2')
    except Exception as e:  # offline on first use: tiktoken cannot fetch its vocabulary files
        raise SystemExit(f"error: tiktoken's GPT-2 encoding is not available ({type(e).__name__}); it is "
                         f"downloaded on first use, so run once with network access")
    return (lambda s: enc.encode(s, allowed_special={'<|endoftext|>'})), enc.decode


def micro_batches(data, cfg, iter_num, dp_rank=0, dp_size=1):
    """This data-parallel rank's (x, y) for each of its micro-steps of iteration iter_num (the one batch
    rule)."""
    global_rows = cfg.batch_size * cfg.gradient_accumulation_steps
    return [get_batch(data['train'], cfg.seed, TRAIN_STREAM, iter_num, global_rows, cfg.block_size,
                      micro_batch_rows(cfg, dp_rank, dp_size, micro_step), cfg.device)
            for micro_step in range(cfg.gradient_accumulation_steps // dp_size)]
