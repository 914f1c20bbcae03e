"""
The DeepSpeed JSON bridge of zero.py: the common subset of a DeepSpeed config (ZeRO stage, offload, batch,
accumulation, clipping, bf16, AdamW) read onto zero.py's config (--deepspeed_config=ds.json), and a run's
config written as DeepSpeed JSON (--print_ds_config, planner.py's ds_config.json). A helper: it imports no
script.
"""

import json
import os

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


def apply_deepspeed_config(cfg, path, world_size):
    """The common subset of a DeepSpeed JSON config, onto cfg. DeepSpeed's gradient_accumulation_steps is per
    rank; ours counts micro-steps summed over ranks, so ours = DeepSpeed's × N. Anything else is an error. An
    empty path (no --deepspeed_config) leaves cfg as it is."""
    if not path:
        return cfg
    if not os.path.isfile(path):
        raise SystemExit(f"error: deepspeed_config {path} not found")
    try:
        ds = json.load(open(path))
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: deepspeed_config {path} is not valid JSON: {e}")
    for key, value in ds.items():
        if key not in DS_KEYS:
            raise SystemExit(f"error: deepspeed_config key '{key}' is not supported by zero.py; "
                             f"supported: {', '.join(sorted(DS_KEYS))}")
        allowed = DS_KEYS[key]
        for sub in (value if allowed is not None else {}):
            if sub not in allowed:
                raise SystemExit(f"error: deepspeed_config key '{key}.{sub}' is not supported by zero.py; "
                                 f"supported: {', '.join(sorted(allowed))}")
    opt = ds.get('optimizer', {})
    if opt.get('type', 'AdamW').lower() != 'adamw':
        raise SystemExit(f"error: deepspeed_config optimizer.type '{opt['type']}' is not supported: zero.py "
                         "is AdamW")
    for sub in opt.get('params', {}):
        if sub not in DS_OPTIMIZER_PARAMS:
            raise SystemExit(f"error: deepspeed_config key 'optimizer.params.{sub}' is not supported by "
                             "zero.py; "
                             f"supported: {', '.join(sorted(DS_OPTIMIZER_PARAMS))}")
    params = opt.get('params', {})
    apply_scheduler(cfg, ds.get('scheduler'), params.get('lr', cfg.learning_rate))
    zero_opt = ds.get('zero_optimization', {})
    offload = zero_opt.get('offload_optimizer', {}).get('device', 'none')
    if offload not in ('cpu', 'none'):
        raise SystemExit(f"error: deepspeed_config zero_optimization.offload_optimizer.device '{offload}' is "
                         "not "
                         f"supported by zero.py: 'cpu' or 'none'")
    updates = {'stage': zero_opt.get('stage'), 'overlap_comm': zero_opt.get('overlap_comm'),
               'offload_optimizer': offload == 'cpu' if 'offload_optimizer' in zero_opt else None,
               'batch_size': ds.get('train_micro_batch_size_per_gpu'),
               'gradient_accumulation_steps': (ds['gradient_accumulation_steps'] * world_size
                                               if 'gradient_accumulation_steps' in ds else None),
               'grad_clip': ds.get('gradient_clipping'),
               'dtype': {True: 'bfloat16', False: 'float32'}.get(ds.get('bf16', {}).get('enabled')),
               'learning_rate': params.get('lr'), 'beta1': params.get('betas', [None, None])[0],
               'beta2': params.get('betas', [None, None])[1], 'adam_eps': params.get('eps'),
               'weight_decay': params.get('weight_decay')}
    for key, value in updates.items():
        if value is not None:
            setattr(cfg, key, float(value) if isinstance(getattr(cfg, key), float) else value)
    global_batch = cfg.batch_size * cfg.gradient_accumulation_steps
    if 'train_batch_size' in ds and ds['train_batch_size'] != global_batch:
        raise SystemExit(f"error: deepspeed_config train_batch_size {ds['train_batch_size']} is not "
                         "micro batch × accumulation × world = "
                         f"{cfg.batch_size * cfg.gradient_accumulation_steps}")
    return cfg



def apply_scheduler(cfg, scheduler, lr):
    """A DeepSpeed WarmupCosineLR section onto cfg (scheduler_of read back); none: a constant rate."""
    if scheduler is None:
        cfg.decay_lr = False
        return
    params = scheduler.get('params', {})
    ours = scheduler.get('type') == 'WarmupCosineLR' and set(params) <= DS_SCHEDULER_PARAMS and \
        params.get('warmup_type', 'linear') == 'linear' and params.get('warmup_min_ratio', 0.0) == 0.0
    if not ours:
        raise SystemExit("error: deepspeed_config scheduler: zero.py runs a WarmupCosineLR with a linear "
                         f"warm-up from 0 ({', '.join(sorted(DS_SCHEDULER_PARAMS))}); got "
                         f"{json.dumps(scheduler)}")
    cfg.decay_lr = True
    cfg.lr_decay_iters = params.get('total_num_steps', cfg.lr_decay_iters)
    cfg.warmup_iters = params.get('warmup_num_steps', cfg.warmup_iters)
    cfg.min_lr = float(params.get('cos_min_ratio', cfg.min_lr / cfg.learning_rate) * lr)


def print_deepspeed_config(cfg, world_size):
    """--print_ds_config: print this run's DeepSpeed JSON (to take the run to DeepSpeed) and say so (True: the
    caller stops there). The learning-rate schedule is its 'scheduler' section (scheduler_of)."""
    if cfg.print_ds_config:
        print(json.dumps(deepspeed_config_of(cfg, world_size), indent=2))
    return cfg.print_ds_config
