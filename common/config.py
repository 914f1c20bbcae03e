"""
A run's config, nanoGPT's way: the keys every training script shares (TRAIN_DEFAULTS) and each script's own,
overridden by `python X.py [config/file.py ...] [--key=value ...]` in order (configure); `--help` lists them.
An unknown key, a wrong type or a value no script can run is one line before any work, and so is each
script's table of refusals (refuse, with the rows every parallel script's table starts with; the
model-parallel scripts' tables are in common/model_parallel.py).
"""

import ast
import inspect
import math
import os
import re
import sys
from dataclasses import fields
from types import SimpleNamespace

import torch

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


def refuse(*checks, resumed=None):
    """A config's checks, in order: each (bad, message); the first bad one stops the run with 'error:
    message' (run_main prints it as one line on every rank). Each condition is evaluated before any is
    tested: one that would divide by a key goes after the check of that key. resumed: where a resume's
    model differs from this command's flags, which values are the checkpoint's (resumed_config's words)."""
    for bad, message in checks:
        if bad:
            raise SystemExit(f"error: {message}" + (f" ({resumed})" if resumed else ''))
