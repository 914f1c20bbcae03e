"""
Every sharded checkpoint back into one train.py checkpoint, offline, in one process. Each script saves what each
rank holds (nothing is gathered onto a rank to save); this file undoes the cut into out_dir/ckpt.pt: the whole model
and torch AdamW's state in configure_optimizers' order, which train.py, sample.py and every script resume from (at
any world size). The shards are memory-mapped and read a tensor at a time, so the process holds about one
consolidated checkpoint (what it writes), not every shard besides.

    python consolidate.py out              # whichever out/ holds -> out/ckpt.pt
    python consolidate.py out out_full     # -> out_full/ckpt.pt

zero.py            zero_rank{r}.pt      each rank's chunk of every flat bucket: the chunks laid end to end
tensor_parallel.py ckpt_rank{r}.pt      each tp rank's slices: joined along the dimension each layer was cut
pipeline.py        ckpt_stage{s}.pt     each stage's blocks, by their names in the whole model: merged
train_fsdp.py      ckpt_dcp/            torch.distributed.checkpoint's shards: each tensor read by itself
parallel_4d.py     ckpt_4d_rank{r}.pt   all of the above in turn: ZeRO-1 chunks, then tp slices, then stages
"""

import math
import os
import sys
from collections import defaultdict

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from model import GPTConfig
from training import progress
from checkpoints import adamw_state_dict, save_checkpoint, train_checkpoint
from tensor_parallel import join_slices, qkv_split


def load(path):
    return torch.load(path, map_location='cpu', weights_only=False, mmap=True)


def load_all(out_dir, pattern, count):
    """The files pattern.format(r) for r < count, memory-mapped: all of them must exist and be from one iteration (each
    file is written atomically, but a run stopped while saving can leave some ranks' files one save behind)."""
    paths = [os.path.join(out_dir, pattern.format(r)) for r in range(count)]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise SystemExit(f"error: consolidate: {out_dir} holds a world of {count} but not {', '.join(missing)}")
    files = [load(p) for p in paths]
    iters = sorted({f['iter_num'] for f in files})
    if len(iters) != 1:
        raise SystemExit(f"error: consolidate: the files {pattern.format('*')} in {out_dir} are from different "
                         f"iterations ({', '.join(map(str, iters))})")
    return files


def write(dest_dir, model_sd, state_by_name, first, rng_states, cfg, source):
    """dest_dir/ckpt.pt in train.py's format; a tied embedding is known to train.py by both its names."""
    if first['model_args'].get('tie_embeddings', True):
        model_sd['lm_head.weight'] = model_sd['transformer.wte.weight']
    # each parameter its own step tensor: one tensor shared by all would be advanced once per parameter per step
    state_by_name = {n: dict(s, step=torch.tensor(float(s['step']))) for n, s in state_by_name.items()}
    cfg = dict(cfg, out_dir=dest_dir, init_from='resume')
    cfg.pop('consolidate', None)  # (a key of the scripts before consolidate.py existed)
    path = os.path.join(dest_dir, 'ckpt.pt')
    os.makedirs(dest_dir, exist_ok=True)
    save_checkpoint(train_checkpoint(model_sd, adamw_state_dict(first['model_args'], state_by_name, cfg), rng_states,
                                     first['model_args'], first['iter_num'], first['best_val_loss'], cfg), path)
    print(f"wrote {path} (train.py's format) from {source} at iter {first['iter_num']}")
    return path


# -----------------------------------------------------------------------------
# zero.py: the chunks of ranks 0, 1, ... laid end to end are each flat bucket


def unflatten_shards(shards):
    """Every rank's Zero.state_dict(), in rank order -> {'master' | 'exp_avg' | 'exp_avg_sq': {name: tensor}}: the
    chunks laid end to end are each bucket (stage 0: every rank holds all of it), cut back into its parameters."""
    full, n_buckets = {}, len(shards[0]['layout'])
    for k, key in enumerate(('master', 'exp_avg', 'exp_avg_sq')):
        full[key] = {}
        for i, layout in enumerate(shards[0]['layout']):
            progress(k * n_buckets + i + 1, 3 * n_buckets, f"consolidating {len(shards)} shards (weights, m, v)")
            flat = shards[0][key][i] if shards[0]['stage'] == 0 else torch.cat([s[key][i] for s in shards])
            offset = 0
            for name, shape in zip(layout['names'], layout['shapes']):
                full[key][name] = flat[offset:offset + math.prod(shape)].view(shape).clone()
                offset += math.prod(shape)
    return full


def zero_shards(out_dir, dest_dir=None):
    first = load(os.path.join(out_dir, 'zero_rank0.pt'))
    shards = load_all(out_dir, 'zero_rank{}.pt', first['zero']['world_size'])
    full = unflatten_shards([s['zero'] for s in shards])
    step = first['zero']['step']
    states = {n: {'step': step, 'exp_avg': full['exp_avg'][n], 'exp_avg_sq': full['exp_avg_sq'][n]}
              for n in full['master']}
    rng_states = [s['rng'] for s in shards]  # every rank's dropout stream: the same world resumes exactly
    return write(dest_dir or out_dir, full['master'], states, first, rng_states, first['config'],
                 f"{len(shards)} ZeRO stage-{first['zero']['stage']} shards")


# -----------------------------------------------------------------------------
# tensor_parallel.py: the tp ranks' slices of data-parallel replica 0, joined


def tp_ranks(out_dir, dest_dir=None):
    first = load(os.path.join(out_dir, 'ckpt_rank0.pt'))
    ranks = load_all(out_dir, 'ckpt_rank{}.pt', first['tp'])
    qkv_sizes = qkv_split(GPTConfig(**first['model_args']))
    model_sd, states = {}, {}
    for i, (dense, (local, kind)) in enumerate(first['layout'].items()):
        progress(i + 1, len(first['layout']), f"consolidating {len(ranks)} tensor-parallel ranks (parameters)")
        model_sd[dense] = join_slices([r['model'][local] for r in ranks], kind, qkv_sizes).clone()
        saved = [r['optimizer']['state'].get(r['param_order'].index(local)) for r in ranks]
        if saved[0] is not None:
            states[dense] = {k: v if k == 'step' else join_slices([s[k] for s in saved], kind, qkv_sizes)
                             for k, v in saved[0].items()}
    return write(dest_dir or out_dir, model_sd, states, first, [first['rng']], first['config'],
                 f"{len(ranks)} tensor-parallel ranks")


# -----------------------------------------------------------------------------
# pipeline.py: each stage's parameters already carry the whole model's names


def pipeline_stages(out_dir, dest_dir=None):
    """A tied weight's two copies (first and last stage) are equal; the first stage's is taken."""
    first = load(os.path.join(out_dir, 'ckpt_stage0.pt'))
    stages = load_all(out_dir, 'ckpt_stage{}.pt', first['config']['pp'])
    model_sd, states = {}, {}
    for s, ck in enumerate(stages):
        progress(s + 1, len(stages), 'consolidating the stages')
        for name, values in ck['model'].items():
            model_sd.setdefault(name, values)
        for i, name in enumerate(ck['param_names']):
            if name not in states and i in ck['optimizer']['state']:
                states[name] = ck['optimizer']['state'][i]
    if 'lm_head.weight' in states:  # (tied: AdamW knows the weight by its first name)
        states.setdefault('transformer.wte.weight', states['lm_head.weight'])
    return write(dest_dir or out_dir, model_sd, states, first, first['rng_states'], first['config'],
                 f"{len(stages)} stages")


# -----------------------------------------------------------------------------
# train_fsdp.py: torch.distributed.checkpoint's files, one tensor loaded at a time


def fsdp_dcp(out_dir, dest_dir=None):
    path = os.path.join(out_dir, 'ckpt_dcp')
    extras = torch.load(os.path.join(path, 'extras.pt'), weights_only=False)
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    keys = [k for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)]
    model_sd, states = {}, defaultdict(dict)
    for i, key in enumerate(keys):  # 'model.<name>' or 'optimizer.state.<name>.<step | exp_avg | exp_avg_sq>'
        progress(i + 1, len(keys), f"consolidating {path}")
        meta = metadata[key]
        tensor = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
        dcp.load(tensor, checkpoint_id=path, no_dist=True)
        if key.startswith('model.'):
            model_sd[key[len('model.'):]] = tensor[key]
        else:
            name, moment = key[len('optimizer.state.'):].rsplit('.', 1)
            states[name][moment] = tensor[key]
    return write(dest_dir or out_dir, model_sd, states, extras, extras['rng_states'], extras['config'], path)


# -----------------------------------------------------------------------------
# parallel_4d.py: each cut undone in turn, one (pp, tp) group at a time


def grid_ranks(out_dir, dest_dir=None):
    """ZeRO-1's chunks are laid end to end within each (pp, tp) group (the data-parallel and context-parallel
    ranks), the tp slices joined, the stages merged by name."""
    first = load(os.path.join(out_dir, 'ckpt_4d_rank0.pt'))
    cfg = first['config']
    ranks = load_all(out_dir, 'ckpt_4d_rank{}.pt', first['zero']['world_size'] * cfg['pp'] * cfg['tp'])  # dp·cp·pp·tp
    qkv_sizes = qkv_split(GPTConfig(**first['model_args']))
    model_sd, states = {}, {}
    step = first['zero']['step']
    for pp_rank in range(cfg['pp']):
        parts = []  # per tp rank: {'master' | 'exp_avg' | 'exp_avg_sq': {local name: tensor}}, and its names
        for tp_rank in range(cfg['tp']):
            group = sorted((r for r in ranks if (r['coords']['pp'], r['coords']['tp']) == (pp_rank, tp_rank)),
                           key=lambda r: r['zero']['rank'])
            parts.append((unflatten_shards([r['zero'] for r in group]), group[0]['dense_names']))
        for dense, (_, kind) in parts[0][1].items():
            if dense in model_sd:  # a tied embedding's second copy, on the last stage: the first stage's counts
                continue
            join = lambda key: join_slices([full[key][names[dense][0]] for full, names in parts], kind, qkv_sizes)
            model_sd[dense] = join('master')
            states[dense] = {'step': step, 'exp_avg': join('exp_avg'), 'exp_avg_sq': join('exp_avg_sq')}
    return write(dest_dir or out_dir, model_sd, states, first, [first['rng']], cfg, f"{len(ranks)} ranks")


# -----------------------------------------------------------------------------

KINDS = {'zero_rank0.pt': zero_shards, 'ckpt_rank0.pt': tp_ranks, 'ckpt_stage0.pt': pipeline_stages,
         'ckpt_dcp': fsdp_dcp, 'ckpt_4d_rank0.pt': grid_ranks}


def consolidate(out_dir, dest_dir=None):
    """out_dir's sharded checkpoint, whichever script wrote it -> dest_dir/ckpt.pt (default out_dir). Returns the
    path written."""
    found = [name for name in KINDS if os.path.exists(os.path.join(out_dir, name))]
    if len(found) != 1:
        what = 'none' if not found else 'several: ' + ', '.join(found)
        raise SystemExit(f"error: consolidate: {out_dir} must hold one sharded checkpoint ({', '.join(KINDS)}), "
                         f"holds {what}")
    return KINDS[found[0]](out_dir, dest_dir)


if __name__ == '__main__':
    if len(sys.argv) not in (2, 3) or sys.argv[1].startswith('-'):
        raise SystemExit("usage: python consolidate.py OUT_DIR [DEST_DIR]   (writes DEST_DIR/ckpt.pt, default OUT_DIR)")
    consolidate(*sys.argv[1:])
