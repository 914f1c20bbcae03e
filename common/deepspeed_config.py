"""
The DeepSpeed JSON bridge of zero.py: the common subset of a DeepSpeed config (ZeRO stage, offload, batch,
accumulation, clipping, bf16, AdamW) read onto zero.py's config (--deepspeed_config=ds.json), and a run's
config written as DeepSpeed JSON (--print_ds_config, planner.py's ds_config.json). A helper: it imports no
script.
"""

import json
import os

DS_KEYS = {'zero_optimization': {'stage', 'offload_optimizer'}, 'train_micro_batch_size_per_gpu': None,
           'gradient_accumulation_steps': None, 'gradient_clipping': None, 'bf16': {'enabled'},
           'optimizer': {'type', 'params'}, 'train_batch_size': None}
DS_OPTIMIZER_PARAMS = {'lr', 'betas', 'eps', 'weight_decay'}


def deepspeed_config_of(cfg, world_size):
    """The DeepSpeed JSON config that runs what this run does: the inverse of apply_deepspeed_config
    (DeepSpeed's gradient_accumulation_steps is per rank, ours summed over ranks)."""
    return {'train_batch_size': cfg.batch_size * cfg.gradient_accumulation_steps,
            'train_micro_batch_size_per_gpu': cfg.batch_size,
            'gradient_accumulation_steps': cfg.gradient_accumulation_steps // world_size,
            'gradient_clipping': cfg.grad_clip,
            'bf16': {'enabled': cfg.dtype == 'bfloat16'},
            'zero_optimization': dict({'stage': cfg.stage}, **({'offload_optimizer': {
                'device': 'cpu', 'pin_memory': True}} if cfg.offload_optimizer else {})),
            'optimizer': {'type': 'AdamW',
                          'params': {'lr': cfg.learning_rate, 'betas': [cfg.beta1, cfg.beta2],
                                                      'eps': cfg.adam_eps, 'weight_decay': cfg.weight_decay}}}


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
    zero_opt = ds.get('zero_optimization', {})
    offload = zero_opt.get('offload_optimizer', {}).get('device', 'none')
    if offload not in ('cpu', 'none'):
        raise SystemExit(f"error: deepspeed_config zero_optimization.offload_optimizer.device '{offload}' is "
                         "not "
                         f"supported by zero.py: 'cpu' or 'none'")
    updates = {'stage': zero_opt.get('stage'),
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



def print_deepspeed_config(cfg, world_size):
    """--print_ds_config: print this run's DeepSpeed JSON (to take the run to DeepSpeed) and say so (True: the
    caller stops there). The learning-rate schedule is DeepSpeed's 'scheduler' section: not written here."""
    if cfg.print_ds_config:
        print(json.dumps(deepspeed_config_of(cfg, world_size), indent=2))
    return cfg.print_ds_config
