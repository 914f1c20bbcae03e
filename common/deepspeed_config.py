"""
The DeepSpeed JSON bridge of zero.py: the common subset of a DeepSpeed config (ZeRO stage, offload, batch,
accumulation, clipping, bf16, AdamW) read onto zero.py's config (--deepspeed_config=ds.json), and a run's
config written as DeepSpeed JSON (--print_ds_config, planner.py's ds_config.json). A helper: it imports no
script.
"""

import json
import os
import sys

from common.config import keys_set_after

DS_KEYS = {'zero_optimization': {'stage', 'offload_optimizer', 'overlap_comm'},
           'train_micro_batch_size_per_gpu': None,
           'gradient_accumulation_steps': None, 'gradient_clipping': None, 'bf16': {'enabled'},
           'optimizer': {'type', 'params'}, 'train_batch_size': None, 'scheduler': {'type', 'params'}}
DS_OPTIMIZER_PARAMS = {'lr', 'betas', 'eps', 'weight_decay'}
DS_SCHEDULER_PARAMS = {'total_num_steps', 'warmup_num_steps', 'warmup_type', 'warmup_min_ratio',
                       'cos_min_ratio'}


def scheduler_of(cfg):
    """Our learning rate as DeepSpeed's WarmupCosineLR: a linear warm-up from 0 over warmup_iters, a cosine
    to min_lr at lr_decay_iters, then min_lr. One difference: our warm-up step i takes (i+1)/(warmup_iters+1)
    of the peak (nanoGPT's), DeepSpeed's i/warmup_iters. Without decay_lr: no scheduler (a constant rate)."""
    return {'type': 'WarmupCosineLR', 'params': {
        'total_num_steps': cfg.lr_decay_iters, 'warmup_num_steps': cfg.warmup_iters, 'warmup_type': 'linear',
        'warmup_min_ratio': 0.0, 'cos_min_ratio': cfg.min_lr / cfg.learning_rate}}


def deepspeed_config_of(cfg, world_size):
    """The DeepSpeed JSON config that runs what this run does: the inverse of apply_deepspeed_config
    (DeepSpeed's gradient_accumulation_steps is per rank, ours summed over ranks)."""
    return {'train_batch_size': cfg.batch_size * cfg.gradient_accumulation_steps,
            'train_micro_batch_size_per_gpu': cfg.batch_size,
            'gradient_accumulation_steps': cfg.gradient_accumulation_steps // world_size,
            'gradient_clipping': cfg.grad_clip,
            'bf16': {'enabled': cfg.dtype == 'bfloat16'},
            'zero_optimization': dict({'stage': cfg.stage, 'overlap_comm': cfg.overlap_comm},
                                      **({'offload_optimizer': {'device': 'cpu', 'pin_memory': True}}
                                         if cfg.offload_optimizer else {})),
            'optimizer': {'type': 'AdamW',
                          'params': {'lr': cfg.learning_rate, 'betas': [cfg.beta1, cfg.beta2],
                                     'eps': cfg.adam_eps, 'weight_decay': cfg.weight_decay}},
            **({'scheduler': scheduler_of(cfg)} if cfg.decay_lr else {})}


def checked_section(name, value, allowed):
    """A section of the JSON (name: its path in it): an object whose keys zero.py runs, else one line."""
    if not isinstance(value, dict):
        raise SystemExit(f"error: deepspeed_config {name or 'file'} must be a JSON object, got {value!r}")
    for key in value:
        if key not in allowed:
            path = f"{name}.{key}" if name else key
            raise SystemExit(f"error: deepspeed_config key '{path}' is not supported by zero.py; supported: "
                             f"{', '.join(sorted(allowed))}")
    return value


def read_deepspeed_json(path):
    """The JSON at path, every section checked: only the keys zero.py runs (DS_KEYS, optimizer.params and
    offload_optimizer's), an object wherever DeepSpeed has one, AdamW the optimizer, the CPU the only offload
    device."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: deepspeed_config {path} not found")
    try:
        ds = json.load(open(path))
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: deepspeed_config {path} is not valid JSON: {e}")
    for key, value in checked_section('', ds, DS_KEYS).items():
        if DS_KEYS[key] is not None:
            checked_section(key, value, DS_KEYS[key])
    opt = ds.get('optimizer', {})
    checked_section('optimizer.params', opt.get('params', {}), DS_OPTIMIZER_PARAMS)
    if str(opt.get('type', 'AdamW')).lower() != 'adamw':
        raise SystemExit(f"error: deepspeed_config optimizer.type '{opt['type']}' is not supported: zero.py "
                         "is AdamW")
    offload = checked_section('zero_optimization.offload_optimizer',
                              ds.get('zero_optimization', {}).get('offload_optimizer', {}),
                              {'device', 'pin_memory'}).get('device', 'none')
    if offload not in ('cpu', 'none'):
        raise SystemExit(f"error: deepspeed_config zero_optimization.offload_optimizer.device '{offload}' is "
                         "not supported by zero.py: 'cpu' or 'none'")
    return ds


def deepspeed_value(name, value, like, least=None):
    """A JSON value for one of zero.py's keys, of the type of that key's present value (like) and at least
    `least`, else one line naming the JSON key. DeepSpeed's "auto" is filled in by Hugging Face's Trainer:
    no value to run here."""
    if value == 'auto':
        raise SystemExit(f'error: deepspeed_config {name} is "auto", which Hugging Face\'s Trainer fills in: '
                         'give zero.py a value, or leave the key out')
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(like, bool):
        ok = isinstance(value, bool)
    elif isinstance(like, float):
        ok, value = number, float(value) if number else value
    else:
        ok = isinstance(value, type(like)) and not isinstance(value, bool)
    if not ok:
        raise SystemExit(f"error: deepspeed_config {name} must be {type(like).__name__}, got {value!r}")
    if least is not None and value < least:
        raise SystemExit(f"error: deepspeed_config {name} must be at least {least}, got {value}")
    return value


def apply_deepspeed_config(cfg, path, world_size, argv=()):
    """The common subset of a DeepSpeed JSON config, onto cfg. DeepSpeed's gradient_accumulation_steps is per
    rank; ours counts micro-steps summed over ranks, so ours = DeepSpeed's × N. The keys that argv (the
    command line) sets after --deepspeed_config keep their values (nanoGPT's rule: a later setting
    overrides), said in a note; then what follows from the values (the batch key the JSON leaves out, the
    final learning rate) follows from the final ones, and the JSON's train_batch_size must hold. Anything
    else is an error. An empty path (no --deepspeed_config) leaves cfg as it is."""
    if not path:
        return cfg
    ds, given, later = read_deepspeed_json(path), dict(vars(cfg)), keys_set_after(argv, 'deepspeed_config')
    zero_opt, params = ds.get('zero_optimization', {}), ds.get('optimizer', {}).get('params', {})
    betas = deepspeed_value('optimizer.params.betas', params.get('betas', [None, None]), [])
    if len(betas) != 2:
        raise SystemExit(f"error: deepspeed_config optimizer.params.betas must be two numbers, got {betas!r}")
    bf16 = ds.get('bf16', {}).get('enabled')
    dtype = None if bf16 is None else 'bfloat16' if deepspeed_value('bf16.enabled', bf16, True) else 'float32'
    offload = zero_opt.get('offload_optimizer')  # (a section: CPU offload unless its device is 'none')
    offload = None if offload is None else offload.get('device', 'none') == 'cpu'
    updates = [('stage', 'zero_optimization.stage', zero_opt.get('stage'), 0),
               ('overlap_comm', 'zero_optimization.overlap_comm', zero_opt.get('overlap_comm'), None),
               ('offload_optimizer', 'zero_optimization.offload_optimizer', offload, None),
               ('batch_size', 'train_micro_batch_size_per_gpu', ds.get('train_micro_batch_size_per_gpu'), 1),
               ('gradient_accumulation_steps', 'gradient_accumulation_steps',
                ds.get('gradient_accumulation_steps'), 1),
               ('grad_clip', 'gradient_clipping', ds.get('gradient_clipping'), 0),
               ('dtype', 'bf16.enabled', dtype, None),
               ('learning_rate', 'optimizer.params.lr', params.get('lr'), 0),
               ('beta1', 'optimizer.params.betas', betas[0], 0),
               ('beta2', 'optimizer.params.betas', betas[1], 0),
               ('adam_eps', 'optimizer.params.eps', params.get('eps'), 0),
               ('weight_decay', 'optimizer.params.weight_decay', params.get('weight_decay'), 0)]
    for key, name, value, least in updates:
        if value is not None:
            setattr(cfg, key, deepspeed_value(name, value, getattr(cfg, key), least))
    if 'gradient_accumulation_steps' in ds:
        cfg.gradient_accumulation_steps *= world_size  # DeepSpeed counts a rank's micro-steps, we all ranks'
    keep_later(cfg, given, later)
    apply_batch(cfg, ds, world_size, later)
    apply_scheduler(cfg, ds.get('scheduler'), later)
    return cfg


def apply_batch(cfg, ds, world_size, set_later):
    """DeepSpeed's rule for its three batch keys: train_batch_size = micro batch × accumulation × N. The one
    the JSON (and the command after it) leaves out follows from the other two; the JSON's train_batch_size
    must hold for the final values."""
    batch = ds.get('train_batch_size')
    if batch is None:
        return
    deepspeed_value('train_batch_size', batch, 1, least=1)
    has = lambda json_key, key: json_key in ds or key in set_later
    if not has('gradient_accumulation_steps', 'gradient_accumulation_steps'):
        cfg.gradient_accumulation_steps = batch // cfg.batch_size
    elif not has('train_micro_batch_size_per_gpu', 'batch_size'):
        cfg.batch_size = batch // cfg.gradient_accumulation_steps
    micro_steps = cfg.gradient_accumulation_steps
    if batch != cfg.batch_size * micro_steps or micro_steps % world_size:
        raise SystemExit(f"error: deepspeed_config train_batch_size {batch} must be micro batch × "
                         f"accumulation × {world_size} ranks: {micro_steps} micro-steps of {cfg.batch_size} "
                         "sequences do not make it, each rank taking whole micro-steps")


def keep_later(cfg, given, later):
    """The keys the command line sets after --deepspeed_config take back their values (given), with a note
    on rank 0 where the JSON said otherwise."""
    overridden = [key for key in sorted(later) if getattr(cfg, key) != given[key]]
    for key in later:
        setattr(cfg, key, given[key])
    if overridden and os.environ.get('RANK', '0') == '0':
        flags = ', '.join(f'--{key}={given[key]!r}' for key in overridden)
        verb = 'overrides' if len(overridden) == 1 else 'override'
        print(f"note: {flags} (after --deepspeed_config) {verb} the JSON's", file=sys.stderr)  # (stdout:
        # --print_ds_config's JSON)


def apply_scheduler(cfg, scheduler, set_later):
    """A DeepSpeed WarmupCosineLR section onto cfg (scheduler_of read back), but for the keys the command
    sets after it; none: a constant rate. The floor is cos_min_ratio of the final peak rate."""
    if scheduler is None:
        cfg.decay_lr = 'decay_lr' in set_later and cfg.decay_lr
        return
    params = scheduler.get('params', {})
    ours = scheduler.get('type') == 'WarmupCosineLR' and isinstance(params, dict) and \
        set(params) <= DS_SCHEDULER_PARAMS and params.get('warmup_type', 'linear') == 'linear' and \
        params.get('warmup_min_ratio', 0.0) == 0.0
    if not ours:
        raise SystemExit("error: deepspeed_config scheduler: zero.py runs a WarmupCosineLR with a linear "
                         f"warm-up from 0 ({', '.join(sorted(DS_SCHEDULER_PARAMS))}); got "
                         f"{json.dumps(scheduler)}")
    value = lambda name, like: deepspeed_value(f'scheduler.params.{name}', params.get(name, like), like, 0)
    ratio = value('cos_min_ratio', cfg.min_lr / cfg.learning_rate if cfg.learning_rate else 0.0)
    for key, json_key in (('lr_decay_iters', 'total_num_steps'), ('warmup_iters', 'warmup_num_steps')):
        if key not in set_later:
            setattr(cfg, key, value(json_key, getattr(cfg, key)))
    cfg.decay_lr = cfg.decay_lr if 'decay_lr' in set_later else True
    cfg.min_lr = cfg.min_lr if 'min_lr' in set_later else ratio * cfg.learning_rate


def print_deepspeed_config(cfg, world_size):
    """--print_ds_config: print this run's DeepSpeed JSON (to take the run to DeepSpeed) and say so (True: the
    caller stops there). The learning-rate schedule is its 'scheduler' section (scheduler_of)."""
    if cfg.print_ds_config:
        print(json.dumps(deepspeed_config_of(cfg, world_size), indent=2))
    return cfg.print_ds_config
