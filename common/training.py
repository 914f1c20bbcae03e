"""
What every training loop shares, named once so that each script's main() reads like train.py's: the config
(nanoGPT's override rule), the data (the token files and the one batch rule), the LR schedule, evaluation,
the log line and log.jsonl, the loop itself (training_loop, with its one seam for a measured step) and
run_main (a bad input is one line on every rank).
"""

import ast
import contextlib
import glob
import inspect
import json
import math
import os
import re
import sys
import threading
import time
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from common import distributed
from common.distributed import added_resident_bytes, is_master, peak_memory_bytes
from model import GPTConfig

# The config keys every training script shares, with nanoGPT's names. train.py spells them out in its own
# block (tests/test_train.py keeps the two equal); every other script declares only the keys of its idea (and
# any default it changes) and takes these. `python X.py --help` lists a script's keys with these comments.
TRAIN_DEFAULTS = dict(
    out_dir='out',                  # where the checkpoints and log.jsonl go
    eval_interval=250,              # evaluate (and checkpoint) every this many iterations
    log_interval=25,                # log the loss every this many iterations (a short run: ~10 lines)
    eval_iters=20,                  # global batches per evaluation of each split
    eval_only=False,                # evaluate once and exit
    always_save_checkpoint=True,    # save at every eval, not only when val loss improves
    init_from='scratch',            # 'scratch', 'resume' (out_dir's checkpoint) or a GPT-2 name: 'gpt2', ...
    sample_at_end=True,             # print a short sample when training ends
    dataset='stdlib_char',          # data/<dataset>/{train,val}.bin (stdlib_char: built offline on first use)
    gradient_accumulation_steps=2,  # micro-steps per iteration, summed over all data-parallel ranks
    batch_size=8,                   # sequences per micro-step per data-parallel rank
    block_size=128,                 # tokens per sequence
    n_layer=4,                      # (every GPTConfig field is a key: norm, mlp, pos, n_kv_head, ...)
    n_head=4,                       # attention heads
    n_embd=128,                     # the residual stream's width
    dropout=0.0,                    # dropout probability (0: every strategy equals train.py to 1e-5)
    bias=False,                     # biases in Linear and LayerNorm
    learning_rate=2e-3,             # AdamW's peak learning rate
    max_iters=1250,                 # iterations to train (~0.12 s each on an idle 2-core CPU)
    weight_decay=0.1,               # AdamW's weight decay on the 2-D weights
    beta1=0.9,                      # AdamW's beta1
    beta2=0.99,                     # AdamW's beta2
    grad_clip=1.0,                  # clip the global gradient norm to this; 0.0 turns clipping off
    decay_lr=True,                  # warm up, then cosine decay to min_lr; False: constant learning_rate
    warmup_iters=50,                # linear warm-up iterations
    lr_decay_iters=1250,            # cosine decay ends here (usually max_iters)
    min_lr=2e-4,                    # the learning rate after the decay
    device='cuda' if torch.cuda.is_available() else 'cpu',  # 'cpu', 'cuda' (each rank takes its LOCAL_RANK)
    dtype='bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float32',  # AMP
    compile=False,                  # torch.compile the model (train.py)
    seed=1337,                      # the seed of the initialization, the batches and the dropout streams
    peak_flops=None,                # the device's peak FLOP/s for MFU; None: looked up by GPU name
    profile=0,                      # trace this many steps with torch.profiler: out_dir/trace_rank{r}.json
    memory_limit_mib=0,             # cap each rank's memory in the kernel (a memory cgroup); 0: no cap
)


def config_defaults(script_globals):
    """The config of a script: every GPTConfig field, then TRAIN_DEFAULTS, then the script's own module-level
    ints, floats, bools, strings and Nones (the keys of its idea, and any default it changes)."""
    cfg = {f.name: f.default for f in fields(GPTConfig)}
    cfg.update(TRAIN_DEFAULTS)
    for k, v in script_globals.items():
        if not k.startswith('_') and not k.isupper() and isinstance(v, (int, float, bool, str, type(None))):
            cfg[k] = v
    cfg.pop('vocab_size')  # comes from the data set
    return cfg


def config_help(defaults, script):
    """`python script --help`: every key the script takes, its default and the comment where it is declared
    (the script's own block, else TRAIN_DEFAULTS, else GPTConfig): the keys of the script's idea first."""
    model_py = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'model.py')
    sources = [open(p).read() for p in (script, __file__, model_py)
               if os.path.isfile(p)]
    said = lambda text, key: re.search(rf'^\s*{key}\s*(?::[^=\n]*)?=[^\n]*?#\s*(.*)$', text, re.M)
    lines = [f"usage: python {os.path.basename(script)} [config/file.py ...] [--key=value ...]  (torchrun "
             "too)"]
    model_keys = [f.name for f in fields(GPTConfig)]
    own = [k for k in defaults if k not in TRAIN_DEFAULTS and k not in model_keys]
    shared = [k for k in TRAIN_DEFAULTS if k in defaults]
    for key in own + shared + [k for k in model_keys if k in defaults and k not in shared]:
        words = next((m.group(1) for m in (said(s, key) for s in sources) if m), '')
        lines.append(f"  --{key}={defaults[key]!r}".ljust(34) + f" {words}".rstrip())
    return '\n'.join(lines)


def _checked(key, value, default):
    """value, if it has the type of default (an int is a fine float, None fits a None default), else
    SystemExit."""
    if default is None or value is None and key in ('n_kv_head', 'n_hidden', 'peak_flops'):
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(default, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float))
        value = float(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise SystemExit(f"error: config key '{key}' must be {type(default).__name__}, got {value!r}")
    return value


# Keys that mean something only at 1 or more, or at 0 or more: anything else would divide by zero, reshape
# to nothing, or (a negative clip, learning rate) climb the loss without a word. configure refuses it in one
# line.
AT_LEAST_ONE = ('batch_size', 'gradient_accumulation_steps', 'block_size', 'n_layer', 'n_head', 'n_embd',
                'moe_every', 'eval_iters', 'eval_interval', 'log_interval', 'dist_timeout',
                'tp', 'pp', 'cp', 'ep', 'num_samples', 'max_new_tokens')
NOT_NEGATIVE = ('max_iters', 'learning_rate', 'min_lr', 'warmup_iters', 'lr_decay_iters', 'weight_decay',
                'grad_clip', 'seed', 'n_expert', 'profile', 'measure_every', 'bucket_size', 'prefetch_blocks',
                'temperature', 'top_k')


def value_refusals(cfg):
    """configure's rows of refusals (as refuse takes them) for the values no script can run: the keys above
    (those the script has), dropout outside [0, 1), experts with no MoE layer, an unknown dtype or device, a
    CUDA device this torch does not have, a seed past 2**63."""
    has = lambda key: cfg.get(key) is not None
    return ([(has(k) and cfg[k] < 1, f"--{k} must be at least 1, got {cfg.get(k)}")
             for k in AT_LEAST_ONE] +
            [(has(k) and cfg[k] < 0, f"--{k} must be 0 or more, got {cfg.get(k)}") for k in NOT_NEGATIVE] +
            [(has('dropout') and not 0 <= cfg['dropout'] < 1, f"--dropout must be in [0, 1), got "
              f"{cfg.get('dropout')}"),
             (cfg.get('n_expert') and cfg.get('moe_every', 1) > cfg.get('n_layer', 1),
              f"moe_every ({cfg.get('moe_every')}) > n_layer ({cfg.get('n_layer')}): no MoE layer; pass "
              "--moe_every of at most n_layer, or --n_expert=0 for a dense model"),
             (cfg.get('memory_limit_mib', 0) < 0, f"--memory_limit_mib must be a size in MiB, or 0 for none, "
              f"got {cfg.get('memory_limit_mib')}"),
             (cfg.get('dtype', 'float32') not in ('float32', 'bfloat16', 'float16'),
              f"--dtype must be float32, bfloat16 or float16, got {cfg.get('dtype')!r}"),
             (has('seed') and cfg['seed'] >= 2 ** 63, f"--seed must be below 2**63 (torch's generator takes "
              f"64 bits, and each rank adds its offset), got {cfg.get('seed')}"),
             (has('device') and not re.fullmatch(r'cpu|cuda(:\d+)?', str(cfg['device'])),
              f"--device must be 'cpu' or 'cuda' (or 'cuda:N'), got {cfg.get('device')!r}"),
             (str(cfg.get('device')).startswith('cuda') and not torch.cuda.is_available(),
              f"--device={cfg.get('device')}, but this torch ({torch.__version__}) sees no CUDA device: pass "
              "--device=cpu")])


def read_overrides(argv):
    """The (key, value, source) settings of `[config/file.py ...] [--key=value ...]`, in their order."""
    settings = []
    for arg in argv:
        if not arg.startswith('--'):
            if not os.path.isfile(arg):
                raise SystemExit(f"error: config file {arg} not found")
            namespace = {}
            exec(open(arg).read(), {}, namespace)
            settings += [(key, value, arg) for key, value in namespace.items()
                         if not key.startswith('_') and not inspect.ismodule(value)]
        else:
            key, eq, text = arg[2:].partition('=')
            if not eq:
                raise SystemExit(f"error: expected --key=value, got {arg}")
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                value = text  # a bare word is a string
            settings.append((key, value, arg))
    return settings


def keys_set_after(argv, key):
    """The keys that argv sets after its last setting of key: under nanoGPT's rule, they override what key
    brings (zero.py: the keys a --deepspeed_config JSON sets)."""
    settings = read_overrides(argv)
    last = max((i for i, (k, _, _) in enumerate(settings) if k == key), default=len(settings))
    return {k for k, _, _ in settings[last + 1:]}


def configure(defaults, argv):
    """nanoGPT's override rule: `script.py [config/file.py ...] [--key=value ...]`, applied in order. A config
    file is Python that assigns keys; values on the command line are Python literals (or plain strings). An
    unknown key or a value of the wrong type exits before any work, naming the key and the valid ones.
    --memory_limit_mib=M takes effect here, before any work: the process joins a memory cgroup of its own
    that the kernel holds to M MiB (common/memory_limit.py)."""
    cfg = dict(defaults)
    if '--help' in argv or '-h' in argv:
        print(config_help(defaults, os.path.abspath(sys.argv[0])))
        raise SystemExit(0)

    for key, value, source in read_overrides(argv):
        if key not in defaults:
            import difflib
            near = difflib.get_close_matches(key, defaults, n=1)
            raise SystemExit(f"error: unknown config key '{key}' (from {source}); " +
                             (f"did you mean {near[0]}? " if near else '') +
                             f"valid keys: {', '.join(sorted(defaults))}")
        cfg[key] = _checked(key, value, defaults[key])
    refuse(*value_refusals(cfg))
    if cfg.get('memory_limit_mib'):
        from common.memory_limit import limit_this_rank
        limit_this_rank(cfg['memory_limit_mib'], os.environ.get('RANK', '0'))
    return SimpleNamespace(**cfg)


def model_config(cfg, vocab_size):
    """The GPTConfig that the run's config describes."""
    args = {f.name: getattr(cfg, f.name) for f in fields(GPTConfig) if f.name != 'vocab_size'}
    args['vocab_size'] = vocab_size
    try:
        return GPTConfig(**args)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


# Dense (no sparsity) peak FLOP/s of common accelerators by dtype, for MFU; 'float32' is the TF32 tensor-core
# peak where the GPU has one (autocast_context turns TF32 on). A key matches the device name as a whole word,
# so 'L4' is not found inside 'L40S'.
PEAK_FLOPS = {
    # (dense peaks, float32 as TF32: the scripts allow it; the PCIe and NVL cards before the SXM's name)
    'H200 NVL': {'bfloat16': 835e12, 'float16': 835e12, 'float32': 418e12},
    'H200': {'bfloat16': 989e12, 'float16': 989e12, 'float32': 495e12},
    'H100 PCIe': {'bfloat16': 756e12, 'float16': 756e12, 'float32': 378e12},
    'H100 NVL': {'bfloat16': 835e12, 'float16': 835e12, 'float32': 418e12},
    'H100': {'bfloat16': 989e12, 'float16': 989e12, 'float32': 495e12},
    'A100': {'bfloat16': 312e12, 'float16': 312e12, 'float32': 156e12},
    'L40S': {'bfloat16': 362e12, 'float16': 362e12, 'float32': 183e12},
    'A10G': {'bfloat16': 70e12, 'float16': 70e12, 'float32': 35e12},
    'L4': {'bfloat16': 121e12, 'float16': 121e12, 'float32': 60e12},
    'RTX 4090': {'bfloat16': 165e12, 'float16': 165e12, 'float32': 83e12},
    'RTX 3090': {'bfloat16': 71e12, 'float16': 71e12, 'float32': 36e12},
    'V100': {'float16': 125e12, 'float32': 15.7e12},  # no bf16, no TF32
    'T4': {'float16': 65e12, 'float32': 8.1e12},
}


def peak_flops_for(device, dtype, override=None, device_name=None):
    """The peak FLOP/s of one device that MFU divides by: the peak_flops config key if set, else the table,
    else None (a CPU's peak is not known here: set --peak_flops to see MFU on one)."""
    if override:
        return override
    if device.startswith('cuda') or device_name:
        name = device_name or torch.cuda.get_device_name(device)
        for key, by_dtype in PEAK_FLOPS.items():
            if re.search(rf'(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])', name):
                return by_dtype.get(dtype)
    return None


def mfu(flops_per_token, tokens_per_sec, n_devices, peak_flops):
    """Model FLOPs utilisation per device: the whole model's training FLOPs per token times the tokens per
    second of the whole run (every rank together), over n_devices devices' peak. None where the peak is
    unknown."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_sec / (n_devices * peak_flops)


def measured_step(iter_num, first_iter, every=0):
    """Whether iteration iter_num is measured: the run's first, and every `every`-th (--measure_every; 0: none
    after the first)."""
    return iter_num == first_iter or (every > 0 and iter_num % every == 0)


# -----------------------------------------------------------------------------
# The data: the token files (data/<dataset>/{train,val}.bin, prepared once by one rank on a fresh checkout),
# the one batch rule (the global batch at iteration i is a pure function of seed and i; each data-parallel
# rank takes its contiguous slice) and the text codec sample.py uses

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


# -----------------------------------------------------------------------------
# The loop

def get_lr(it, cfg):
    """Linear warm-up for warmup_iters, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


@torch.no_grad()
def estimate_loss(loss_of, data, cfg, dp=None):
    """Mean loss over eval_iters global batches for each split, by training's one batch rule: evaluation batch
    k is the global batch (batch_size * gradient_accumulation_steps sequences) of (seed, EVAL_STREAM, k), each
    data-parallel rank (dp: their Comm) takes its contiguous slice in micro-batches of batch_size, and one
    all-reduce adds the sums up. So the losses are equal for every strategy, world size and split of the
    batch. loss_of(x, y) returns the mean loss of one micro-batch however the strategy computes it."""
    dp_rank, dp_size = (dp.rank, dp.size) if dp is not None else (0, 1)
    n_micro, global_rows = cfg.gradient_accumulation_steps, cfg.batch_size * cfg.gradient_accumulation_steps
    sums = torch.zeros(2, device=cfg.device)
    for i, split in enumerate(('train', 'val')):
        for k in range(cfg.eval_iters):
            for micro_step in range(n_micro // dp_size):
                x, y = get_batch(data[split], cfg.seed, EVAL_STREAM, k, global_rows, cfg.block_size,
                                 rows=micro_batch_rows(cfg, dp_rank, dp_size, micro_step), device=cfg.device)
                sums[i] += loss_of(x, y).float()
    if dp is not None:
        dp.all_reduce(sums)
    n = cfg.eval_iters * n_micro  # micro-batches of equal size: their mean is the global batch's
    return {'train': sums[0].item() / n, 'val': sums[1].item() / n}


def loss_function(model, ctx):
    """What evaluation calls, loss_of(x, y): the model's mean loss on a batch, under ctx (autocast)."""
    def loss_of(x, y):
        with ctx:
            return model(x, y)[1]
    return loss_of


def autocast_context(device_type, dtype):
    """torch.autocast for bfloat16/float16 on CPU or CUDA; a no-op context for float32. On CUDA, float32
    matmuls run on the TF32 tensor cores, as nanoGPT sets them (so MFU divides by the TF32 peak)."""
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if dtype == 'float32':
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type,
                          dtype={'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype])


def run_shape(shape, cfg, n_params, n_expert=0):
    """The line every training script prints when it starts: the run's shape, in one place. A mixture of
    experts cut into microbatches (pipeline.py, parallel_4d.py) gets a second line: a router sees one
    forward's tokens, so its auxiliary loss and capacity are those of a microbatch's rows (as in any
    pipeline), and the curve is train.py's with that many rows a micro-step (n_expert: the model's, which on a
    resume is the checkpoint's)."""
    rows, m = cfg.batch_size * cfg.gradient_accumulation_steps, getattr(cfg, 'n_microbatches', 1)
    routed = f"{cfg.batch_size // m} row{'s' * (cfg.batch_size // m != 1)}"
    moe = (f"\nnote: a mixture of experts routes each microbatch ({routed}) on its own, its "
           f"auxiliary loss and capacity too: train.py's curve with --batch_size={cfg.batch_size // m} "
           f"--gradient_accumulation_steps={cfg.gradient_accumulation_steps * m}"
           if n_expert and m > 1 else '')
    return (f"run: {shape}; global batch {rows} sequences x {cfg.block_size} tokens = "
            f"{rows * cfg.block_size:,} "
            f"tokens per step; {n_params / 1e6:.2f}M parameters; {cfg.dtype} on {cfg.device}; outputs in "
            f"{cfg.out_dir}/{moe}")


def profiled(cfg):
    """The trace files of --profile, for outputs_line."""
    return ['trace_rank*.json (--profile: open at ui.perfetto.dev)'] if cfg.profile else []


def cpu_busy_elsewhere(seconds=0.2):
    """The cores other processes kept busy over the next `seconds`, while this one sleeps (Linux's /proc/stat:
    the time every core spent running, summed), e.g. 1.9 of 2; None where /proc/stat is not there. The load
    average would lag by a minute and still count the run that just ended."""
    def busy_and_total():
        with open('/proc/stat') as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # (idle and iowait left out)
    try:
        (b0, t0), _, (b1, t1) = busy_and_total(), time.sleep(seconds), busy_and_total()
    except (OSError, ValueError, IndexError):
        return None
    return (os.cpu_count() or 1) * (b1 - b0) / max(t1 - t0, 1)


def busy_cpu_note(device):
    """One line when torch would share a busy CPU: its threads (one per core) wait for one another while other
    work holds the cores, and a step can take 10-20x longer than on an idle machine. torchrun gives each
    process one thread already; this is for a script run alone. None when the CPU is idle enough."""
    if not device.startswith('cpu') or torch.get_num_threads() == 1:
        return None
    busy, cores = cpu_busy_elsewhere(), os.cpu_count() or 1
    if busy is None or busy < 0.5 * cores:
        return None
    return (f"note: this CPU is busy ({busy:.1f} of its {cores} cores running other work) and torch runs "
            f"{torch.get_num_threads()} threads, which wait for one another behind it: expect a much slower "
            "run; OMP_NUM_THREADS=1 in front of the command is often several times faster\n")


def outputs_line(out_dir, *files):
    """The line every training script prints when it ends: where its outputs are. Each of files is a name (a
    pattern) and its words, 'ckpt.pt (the checkpoint)', named only where out_dir holds it: a new run of
    --max_iters=0 (iteration 0 is never saved) names no checkpoint."""
    there = [f for f in files if glob.glob(os.path.join(glob.escape(out_dir), f.split(' ')[0]))]
    return f"done; outputs in {out_dir}/: " + ', '.join(['log.jsonl (every logged row as JSON)', *there])


def log_row(out_dir, row):
    """Append one row to out_dir/log.jsonl and print it as one human line."""
    with open(os.path.join(out_dir, 'log.jsonl'), 'a') as f:
        f.write(json.dumps(row) + '\n')
    if 'val_loss' in row:
        print(f"step {row['iter']}: train loss {row['train_loss']:.4f}, val loss {row['val_loss']:.4f}",
              flush=True)
    elif 'loss' in row:
        mfu = f"{100 * row['mfu']:.2f}%" if row.get('mfu') is not None else 'n/a'
        print(f"iter {row['iter']}: loss {row['loss']:.4f}, lr {row['lr']:.2e}, {row['ms']:.1f} ms, "
              f"{row['tokens_per_sec']:.0f} tok/s, mfu {mfu}, peak mem {row['peak_mem_bytes'] / 2**20:.0f} "
              "MiB" + ('' if row.get('mem_added_bytes') is None else
                       f" ({row['mem_added_bytes'] / 2**20:+.0f} by the run)"),
              flush=True)


def log_rank_rows(out_dir, row):
    """Every rank's row (a collective: each rank passes its own), in rank order; rank 0 appends them to
    out_dir/log.jsonl. Returns the rows on every rank."""
    rows = [row]
    if dist.is_initialized():
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
    if is_master():
        with open(os.path.join(out_dir, 'log.jsonl'), 'a') as f:
            f.writelines(json.dumps(r) + '\n' for r in rows)
    return rows


def batch_refusal(cfg, dp_size, world_size):
    """The one batch rule's row: whole micro-batches on every data-parallel rank."""
    fits = math.ceil(cfg.gradient_accumulation_steps / dp_size) * dp_size
    return (cfg.gradient_accumulation_steps % dp_size,
            f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be divisible by the "
            f"data-parallel size dp={dp_size} (world size {world_size}): each data-parallel rank takes whole "
            f"micro-batches; use --gradient_accumulation_steps={fits} or fewer processes")


def shared_refusals(cfg, script, dp_size, world_size, compiles=False):
    """The rows every parallel script's table of refusals starts with, (bad, message) as refuse takes them:
    whole micro-batches on every data-parallel rank (the one batch rule), float32 or bfloat16 (float16's loss
    scale would need its inf check shared by the ranks: train.py has it), and --compile where the script
    does not wire it in (said rather than ignored)."""
    return [batch_refusal(cfg, dp_size, world_size),
            (cfg.dtype not in ('float32', 'bfloat16'), f"{script} trains in float32 or bfloat16, got "
             f"--dtype={cfg.dtype!r} (float16's loss scale would need its inf check shared by the ranks)"),
            (cfg.compile and not compiles, f"--compile=True is not supported by {script}: pass "
             "--compile=False (a config file that sets compile = True needs it after the file)")]


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group['lr'] = lr


def should_evaluate(iter_num, cfg):
    return iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters or cfg.eval_only


def evaluate(loss_of, model, data, cfg, iter_num, lr, dp=None):
    """estimate_loss with the model in eval mode (no dropout), logged by rank 0. Every rank must call it (the
    data-parallel ranks share the batches). A loss that is not finite stops the run, keeping the last
    checkpoint."""
    model.eval()
    losses = estimate_loss(loss_of, data, cfg, dp)
    model.train()
    if is_master():
        log_row(cfg.out_dir, {'iter': iter_num, 'train_loss': losses['train'], 'val_loss': losses['val'],
                              'lr': lr})
    if not math.isfinite(losses['val']):
        raise SystemExit(f"error: val loss is {losses['val']} at iter {iter_num}; kept the last checkpoint")
    return losses


def should_save(iter_num, val_loss, best_val_loss, cfg):
    """nanoGPT's rule (after iteration 0: a better val loss, or always_save_checkpoint), but an
    evaluation-only run writes nothing: the checkpoint it evaluated stays as it was (on another world size,
    rewritten, it would keep only this run's random streams, and a resume would not continue the run)."""
    return iter_num > 0 and not cfg.eval_only and (val_loss < best_val_loss or cfg.always_save_checkpoint)


class StepLogger:
    """The line logged every log_interval iterations: the time per iteration since the last line (host clock,
    after the loss's .item() has waited for the device), tokens per second of the whole run, MFU per device,
    peak memory. Every iteration it checks that the loss is finite."""

    def __init__(self, cfg, flops_per_token, n_devices):
        self.cfg, self.flops_per_token, self.n_devices = cfg, flops_per_token, n_devices
        self.peak = peak_flops_for(cfg.device, cfg.dtype, cfg.peak_flops)
        self.tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
        self.every = min(cfg.log_interval, max(1, cfg.max_iters // 10))  # a short run logs ~10 lines too
        self.restart()

    def restart(self):
        """Time afresh from now (after an evaluation: eval time is not training time)."""
        self.t_last, self.iters, self.observed = time.time(), 0, False

    def step(self, iter_num, loss, lr, observed=False):
        """observed: the step ran with a measuring observer, whose work is in its time (its row says so)."""
        if not math.isfinite(loss):
            raise SystemExit(f"error: loss is {loss} at iter {iter_num}; stopped, the last checkpoint kept")
        self.iters, self.observed = self.iters + 1, self.observed or observed
        if iter_num % self.every == 0 and is_master():
            flag = {'observed': True} if self.observed else {}  # (before restart clears it)
            dt = (time.time() - self.t_last) / self.iters
            self.restart()
            tokens_per_sec = self.tokens_per_iter / dt
            log_row(self.cfg.out_dir, {'iter': iter_num, 'loss': loss, 'lr': lr, 'ms': 1000 * dt,
                                       'tokens_per_sec': tokens_per_sec,
                                       'mfu': mfu(self.flops_per_token, tokens_per_sec, self.n_devices,
                                                  self.peak),
                                       'peak_mem_bytes': peak_memory_bytes(self.cfg.device),
                                       'mem_added_bytes': self.added_memory(), **flag})

    def added_memory(self):
        """On a CPU, what the run added to the process's resident set (distributed.added_resident_bytes):
        where ZeRO's saving shows. None on a GPU, whose peak (the allocator's) holds only the run's tensors
        already."""
        return None if self.cfg.device.startswith('cuda') else added_resident_bytes()


def observer_for(run, cfg, iter_num, first_iter):
    """The observer of a step that measured_step names (common/observe.py's measured_step, imported only
    then): it runs the step, reads what the strategy holds and sends (run.kind says which parts of run it
    reads) and prints the report. None for every other step, and for a measured one where the measuring files
    were not copied."""
    if getattr(run, 'kind', None) is None or not measured_step(iter_num, first_iter, cfg.measure_every):
        return None
    try:
        import common.observe
    except ModuleNotFoundError as e:  # a script copied without the measuring files trains on, unmeasured
        if not (e.name or '').startswith('common.'):
            raise
        if is_master():
            print(f"(iter {iter_num} not measured: {e.name.replace('.', '/')}.py is not here)")
        return None
    return common.observe.measured_step


def run_step(run, cfg, iter_num, first_iter):
    """One iteration, run.step(iter_num), observed where observer_for names an observer. Returns (the loss,
    whether it was observed: its time holds the observer's work)."""
    observe = observer_for(run, cfg, iter_num, first_iter)
    return (run.step(iter_num) if observe is None else observe(run, cfg, iter_num)), observe is not None


def step_profiler(cfg, rank):
    """--profile=N: N steps under torch.profiler, a trace per rank (common/measure.py's StepProfiler, imported
    only then); None without."""
    if not cfg.profile:
        return None
    from common.measure import StepProfiler
    return StepProfiler(cfg.profile, cfg.out_dir, rank, cfg.device)


def training_loop(cfg, run, iter_num, best_val_loss):
    """train.py's loop, for every other script: set the LR, evaluate and checkpoint every eval_interval, one
    train step, its log line, until max_iters. What differs from script to script comes in `run`, a namespace
    of: model, optimizer (a torch optimizer whose LR it sets, or None), loss_of(x, y) (evaluation), dp (the
    data-parallel Comm that shares the evaluation, or None), data, step(iter_num) -> the mean loss (one
    iteration), save(iter_num, best_val_loss), flops_per_token, n_devices, rank; and for the measured steps
    (run_step) kind and what that kind's observer reads. Returns (iter_num, best_val_loss) when it stops."""
    profiler = step_profiler(cfg, run.rank)  # --profile=N: a trace per rank
    logger, first_iter = StepLogger(cfg, run.flops_per_token, run.n_devices), iter_num
    while True:
        lr = get_lr(iter_num, cfg)
        if run.optimizer is not None:  # (a script with an optimizer of its own takes get_lr in its step)
            set_lr(run.optimizer, lr)
        # evaluate, and checkpoint the state from which iteration iter_num starts
        if should_evaluate(iter_num, cfg):
            losses = evaluate(run.loss_of, run.model, run.data, cfg, iter_num, lr, run.dp)
            if should_save(iter_num, losses['val'], best_val_loss, cfg):
                best_val_loss = min(best_val_loss, losses['val'])
                run.save(iter_num, best_val_loss)
            logger.restart()
        if iter_num == cfg.max_iters or cfg.eval_only:
            break
        loss, observed = run_step(run, cfg, iter_num, first_iter)  # (observed: its log row says so)
        logger.step(iter_num, loss, lr, observed)  # one iteration, its log line
        if profiler:
            profiler.step()
        iter_num += 1
    if profiler:
        profiler.stop()
    return iter_num, best_val_loss


def print_sample(model, cfg, ctx, show=True, hint='python sample.py --out_dir={out_dir}'):
    """200 characters sampled from the trained model (every rank of a sharded model must take part; the ones
    with show print it), and how to sample more. A short run (under 100 iterations) has learned too little to
    be worth the time: it only says how."""
    if cfg.max_iters < 100:
        if show:
            print(f"(no sample after {cfg.max_iters} iterations; to sample: "
                  f"{hint.format(out_dir=cfg.out_dir)})")
        return
    encode, decode = get_codec(cfg.dataset)
    model.eval()
    start = torch.tensor([encode('\n')], dtype=torch.long, device=cfg.device)
    with ctx:
        text = decode(model.generate(start, 200, temperature=0.8, top_k=200)[0].tolist())
    if show:
        print(f"---------- a sample ----------\n{text}\n------------------------------")
        print(f"sample more with: {hint.format(out_dir=cfg.out_dir)}")


def record_for_torchrun(message, callstack):
    """Leave the rank's error where torchrun's closing summary reads it (TORCHELASTIC_ERROR_FILE, the format
    of torch.distributed.elastic's @record), so the user's last screen says what went wrong, not only an exit
    code."""
    path = os.environ.get('TORCHELASTIC_ERROR_FILE')
    if path:
        with open(path, 'w') as f:
            json.dump({'message': {'message': message, 'extraInfo': {'py_callstack': callstack,
                                                                     'timestamp': str(int(time.time()))}}}, f)


def first_sentence(error):
    """An exception's first sentence, for a one-line error (a library's messages run to paragraphs)."""
    return (str(error).splitlines() or [''])[0].split('. ')[0]


def run_main(main):
    """Run main(argv) and turn a config error into one line on stderr and exit code 1 (on every rank); under
    torchrun that line, or an unexpected error's traceback, is also what torchrun's summary shows."""
    try:
        main(sys.argv[1:])
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        rank = os.environ.get('RANK')
        line = (f"[rank {rank}] " if rank is not None else '') + e.code + '\n'
        # the whole line in one write: the ranks share one stderr pipe, and print() writes the text and its
        # newline in two, which (unbuffered, as under PYTHONUNBUFFERED) lets two ranks' lines run together
        sys.stderr.write(line)
        sys.stderr.flush()
        record_for_torchrun(e.code, line)
        # an error found after joining (e.g. on resume): the group torn down here, with every rank still in it
        if dist.is_initialized() and distributed._GROUP_IS_OURS:
            dist.destroy_process_group()
        exit_run(1, main)
    except Exception as e:
        import traceback
        lost = lost_rank_line(e)
        record_for_torchrun(lost or f"{type(e).__name__}: {e}", lost or traceback.format_exc())
        if lost is None:
            raise
        sys.stderr.write((f"[rank {os.environ['RANK']}] " if 'RANK' in os.environ else '') + lost + '\n')
        exit_run(1, main)  # (no teardown of the group: its other end is gone)
    exit_run(0, main)


def lost_rank_line(error):
    """One line for a rank whose peer died (killed, out of memory) or never joined, where the collective's
    traceback would bury the first rank's own message (torchrun's summary names that rank); None for any
    other error, whose traceback is the message."""
    text = str(error)
    if 'Connection reset by peer' in text or 'Connection closed by peer' in text:
        return ("error: another rank of this run stopped (gloo: the connection to it was closed), so this "
                "one stops too: that rank's own message, or torchrun's summary, says why")
    if type(error).__name__ == 'DistStoreError' and 'Timed out' in text and not distributed.JOINED:
        return f"error: not every rank joined within --dist_timeout ({text.splitlines()[0]})"
    return None


def exit_run(code, main):
    """Exit a run with code. A script's run (main is its __main__'s) that joined a process group leaves
    without the interpreter's teardown (os._exit), once its other threads (a checkpoint being written) have
    ended and its output is flushed: that teardown destroys torch's C++ threads too, and one destroyed out of
    order can abort the finished process ('terminate called without an active exception', seen under a busy
    machine's load). Called from elsewhere (a test, a notebook), it raises SystemExit as usual."""
    if not distributed.JOINED or getattr(sys.modules['__main__'], 'main', None) is not main:
        sys.exit(code)
    for thread in threading.enumerate():  # (what the interpreter's own exit waits for)
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def refuse(*checks, resumed=None):
    """A config's checks, in order: each (bad, message); the first bad one stops the run with 'error:
    message' (run_main prints it as one line on every rank). Each condition is evaluated before any is
    tested: one that would divide by a key goes after the check of that key. resumed: where a resume's
    model differs from this command's flags, which values are the checkpoint's (resumed_config's words)."""
    for bad, message in checks:
        if bad:
            raise SystemExit(f"error: {message}" + (f" ({resumed})" if resumed else ''))


def make_out_dir(cfg):
    """out_dir, made if missing. A new run (not a resume) starts out_dir/log.jsonl afresh: its rows are this
    run's alone (rank 0 writes it)."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    if cfg.init_from != 'resume' and is_master():
        open(os.path.join(cfg.out_dir, 'log.jsonl'), 'w').close()


def start_run(cfg):
    """A parallel script's start, its config checked: join torchrun's process group (cfg.device becomes this
    rank's GPU under torchrun), make out_dir, seed torch (every rank builds the same weights). Returns (rank,
    world_size)."""
    rank, _, world_size, device = distributed.init_distributed(cfg.dist_timeout)
    cfg.device = device if world_size > 1 else cfg.device
    make_out_dir(cfg)
    torch.manual_seed(cfg.seed)
    return rank, world_size
