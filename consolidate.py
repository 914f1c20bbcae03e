"""
Every sharded checkpoint back into one train.py checkpoint, offline, in one process. Each script saves what
each rank holds (nothing is gathered onto a rank to save), and beside it where each of its pieces sits in the
whole model (checkpoints.pieces_of: a box of the whole tensor, maybe a run of its flat elements). This file
reads those declarations, whichever script wrote them, lays every piece in place and writes out_dir/ckpt.pt:
the whole model and torch AdamW's state in configure_optimizers' order, which train.py, sample.py and the
data-parallel scripts (train_ddp, zero, train_fsdp, context_parallel) resume from, at any world size. The
rank files are memory-mapped and read a tensor at a time, so the process holds about one consolidated
checkpoint (what it writes), not every shard besides.

    python consolidate.py out-zero              # the sharded checkpoint in out-zero/ -> out-zero/ckpt.pt
    python consolidate.py out-tp out_full       # -> out_full/ckpt.pt

zero.py            zero_rank{r}.pt      each rank's chunk of every flat bucket: a run of each parameter
tensor_parallel.py ckpt_rank{r}.pt      each tp rank's slices: a box of each layer (its rows, or columns)
pipeline.py        ckpt_stage{s}.pt     each stage's blocks, whole
expert_parallel.py ckpt_ep_rank{r}.pt   each ep rank's experts, and the dense weights
parallel_4d.py     ckpt_4d_rank{r}.pt   ZeRO-1's run of a tp slice of a stage's layers
train_fsdp.py      ckpt_dcp/            torch.distributed.checkpoint's own format, read by torch's reader
"""

import glob
import os
import pickle
import sys
import tempfile
import warnings
from collections import defaultdict

import torch

from common.checkpoints import load_mmap, save_checkpoint, train_checkpoint
from common.training import first_sentence
from model import GPT, GPTConfig
from common.model_parallel import whole_shapes


def progress(done, total, what):
    """For a long step (consolidating, preparing data): 'what: done/total (pct)' each time it crosses a
    tenth."""
    if total and (done == total or int(10 * done / total) != int(10 * (done - 1) / total)):
        print(f"{what}: {done}/{total} ({100 * done / total:.0f}%)", flush=True)


DCP = 'ckpt_dcp'  # train_fsdp.py's folder of torch.distributed.checkpoint's shards


def read(path):
    """A .pt file memory-mapped, or one line naming it (truncated, not torch's, not a checkpoint's dict)."""
    try:
        checkpoint = load_mmap(path)
    except Exception as e:
        raise SystemExit(f"error: consolidate: {path} is not a file this can read ({type(e).__name__}: "
                         f"{first_sentence(e)[:120]}): move it out of the folder, or save it again")
    return checkpoint if isinstance(checkpoint, dict) else {}


# config keys that do not shape a run's state: a rank's own device, where and how often it writes, how it is
# started (a resume that re-saved its first iteration and stopped part way leaves files of two commands alike)
NOT_STATE = ('device', 'out_dir', 'init_from', 'max_iters', 'eval_interval', 'eval_iters', 'eval_only',
             'log_interval', 'always_save_checkpoint', 'measure_every', 'profile', 'sample_at_end', 'compile',
             'dist_timeout', 'memory_limit_mib')


def same_run(files, pattern, out_dir):
    """Refuse rank files of different runs (another seed, shape or flags; one iteration is not enough): every
    file's model and config alike but for NOT_STATE."""
    run = lambda f: dict({k: v for k, v in f['config'].items() if k not in NOT_STATE},
                         model_args=f['model_args'])
    keys = sorted({k for f in files for k in run(f) if len({repr(run(g).get(k)) for g in files}) > 1})
    if keys:
        raise SystemExit(f"error: consolidate: the files {pattern.format('*')} in {out_dir} are from "
                         f"different runs (they differ in {', '.join(keys)}): keep one run's in the folder")


def rank_files(out_dir):
    """The rank files in out_dir, memory-mapped: every file of the one world they declare ('files': their
    pattern and count), all there and from one iteration (each file is written atomically, but a run stopped
    while saving can leave some ranks' files a save behind). None for train_fsdp.py's folder."""
    worlds = defaultdict(list)  # (pattern, count) -> the files that declare it
    for path in sorted(glob.glob(os.path.join(out_dir, '*.pt'))):
        files = read(path).get('files') if os.path.basename(path) != 'ckpt.pt' else None
        if files is not None:
            worlds[tuple(files)].append(os.path.basename(path))
    if os.path.isdir(os.path.join(out_dir, DCP)):
        worlds[(DCP + '/', 1)].append(DCP + '/')
    if len(worlds) != 1:  # (two runs of one script on different world sizes: the same pattern, twice)
        what = 'none' if not worlds else 'several: ' + ', '.join(
            names[0] if p == DCP + '/' else f"{p.format('*')} of a {n}-file world ({', '.join(names)})"
            for (p, n), names in sorted(worlds.items()))
        raise SystemExit(f"error: consolidate: {out_dir} must hold one sharded checkpoint, holds {what}"
                         + ('; train it with a sharded script first' if not worlds else
                            '; move all but one to a folder of their own'))
    (pattern, count), = worlds
    if pattern == DCP + '/':
        return None
    paths = [os.path.join(out_dir, pattern.format(r)) for r in range(count)]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise SystemExit(f"error: consolidate: {out_dir} holds a world of {count} but not "
                         f"{', '.join(missing)}")
    files = [read(p) for p in paths]
    iters = sorted({f['iter_num'] for f in files})
    if len(iters) != 1:
        raise SystemExit(f"error: consolidate: the files {pattern.format('*')} in {out_dir} are from "
                         f"different iterations ({', '.join(map(str, iters))})")
    same_run(files, pattern, out_dir)
    return files


def tensor_at(checkpoint, path):
    """What a piece's path names in a rank file: checkpoint[path[0]][path[1]]..."""
    for key in path:
        checkpoint = checkpoint[key]
    return checkpoint


def join(files):
    """Every piece of every rank file laid in place: {'param' | 'exp_avg' | 'exp_avg_sq': {name: whole
    tensor}} and {name: AdamW's step}. A piece fills a box of the whole tensor, or a run of that box's flat
    elements; a box that is not one run of memory (a tp column slice under ZeRO) fills a buffer of its own,
    copied in at the end. A piece that ranks of several replicas hold is laid again, the same."""
    shapes = whole_shapes(files[0]['model_args'])
    whole, steps, buffers = defaultdict(dict), {}, {}
    pieces = [(f, piece) for f in files for piece in f['pieces']]
    for i, (f, (name, box, flat, rows, paths)) in enumerate(pieces):
        progress(i + 1, len(pieces), f"consolidating {len(files)} rank files")
        for key, path in paths.items():
            if key == 'step':
                steps[name] = float(tensor_at(f, path))
                continue
            source = tensor_at(f, path)[rows[0]:rows[1]]
            full = whole[key].setdefault(name, torch.empty(shapes[name], dtype=source.dtype))
            region = full[tuple(slice(start, stop) for start, stop in box)]
            if flat is None:
                region.copy_(source.view(region.shape))
            elif region.is_contiguous():
                region.view(-1)[flat[0]:flat[1]].copy_(source)
            else:
                buffer = buffers.setdefault((key, name, str(box)), (region, torch.empty_like(region)))[1]
                buffer.view(-1)[flat[0]:flat[1]].copy_(source)
    for region, buffer in buffers.values():
        region.copy_(buffer)
    return whole, steps


def join_dcp(out_dir):
    """train_fsdp.py's checkpoint, torch.distributed.checkpoint's shards: every tensor read from its files by
    itself, one at a time (torch's reader). Returns ({'param' | moment: {name: tensor}}, steps, extras)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    path = os.path.join(out_dir, DCP)
    try:
        extras = torch.load(os.path.join(path, 'extras.pt'), weights_only=False)
        saved = dcp.FileSystemReader(path).read_metadata()
        metadata = saved.state_dict_metadata
        files = {s.relative_path for s in saved.storage_data.values()}
        missing = sorted(f for f in files if not os.path.exists(os.path.join(path, f)))
        if missing:
            raise FileNotFoundError(f"no {', '.join(missing)}")
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:  # (a save stopped part way)
        raise SystemExit(f"error: consolidate: {path} is not a whole checkpoint ({e}): train_fsdp.py saves "
                         "it again at its next evaluation")
    keys = [k for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)]
    whole, steps = defaultdict(dict), {}
    for i, key in enumerate(keys):  # 'model.<name>' or 'optimizer.state.<name>.<step | exp_avg | exp_avg_sq>'
        progress(i + 1, len(keys), f"consolidating {path}")
        tensor = {key: torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype)}
        with warnings.catch_warnings():  # (torch's warning that no_dist means one process: it does, here)
            warnings.filterwarnings('ignore', message='torch.distributed is disabled')
            dcp.load(tensor, checkpoint_id=path, no_dist=True)
        if key.startswith('model.'):
            whole['param'][key[len('model.'):]] = tensor[key]
        else:
            name, moment = key[len('optimizer.state.'):].rsplit('.', 1)
            if moment == 'step':
                steps[name] = float(tensor[key])
            else:
                whole[moment][name] = tensor[key]
    return whole, steps, extras


def adamw_state_dict(model_args, whole, steps, cfg):
    """torch AdamW's state_dict for train.py's model (configure_optimizers' groups and parameter order), from
    the joined moments and steps, each parameter its own step tensor (one shared by all would be advanced
    once per parameter per step). The model is built on the meta device: its names and order only."""
    with torch.device('meta'):
        dense = GPT(GPTConfig(**model_args))
    optimizer = dense.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'],
                                           (cfg['beta1'], cfg['beta2']), 'cpu')
    name_of = {id(p): n for n, p in dense.named_parameters()}
    order = [name_of[id(p)] for group in optimizer.param_groups for p in group['params']]
    sd = optimizer.state_dict()
    sd['state'] = {i: {'step': torch.tensor(steps[n]), 'exp_avg': whole['exp_avg'][n],
                       'exp_avg_sq': whole['exp_avg_sq'][n]} for i, n in enumerate(order) if n in steps}
    for group in sd['param_groups']:
        group['eps'] = cfg.get('adam_eps', group['eps'])
    return sd


def writable(folder):
    """Refuse, before any work, a destination that is a file or where this process cannot write."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise SystemExit(f"error: consolidate: cannot write ckpt.pt in {folder} ({e.strerror})")


def consolidate(out_dir, dest_dir=None):
    """out_dir's sharded checkpoint, whichever script wrote it -> dest_dir/ckpt.pt (default out_dir),
    train.py's format: the first file's model_args, iteration and best loss, the data-parallel ranks' random
    streams in rank order. Returns the path written."""
    files = rank_files(out_dir)
    writable(dest_dir or out_dir)  # (before the work)
    if files is None:
        whole, steps, first = join_dcp(out_dir)
        rng_states, source = first['rng_states'], os.path.join(out_dir, DCP)
    else:
        (whole, steps), first = join(files), files[0]
        streams = sorted((f['dp_rank'], i) for i, f in enumerate(files) if f['dp_rank'] is not None)
        rng_states = first.get('rng_states') or [files[i]['rng'] for _, i in streams]
        source = os.path.join(out_dir, first['files'][0].format(0))
    model_sd = whole['param']
    if first['model_args'].get('tie_embeddings', True):  # train.py knows the tied weight by both names
        model_sd['lm_head.weight'] = model_sd['transformer.wte.weight']
    cfg = dict(first['config'], init_from='resume', out_dir=dest_dir or out_dir)
    optimizer = adamw_state_dict(first['model_args'], whole, steps, cfg)
    checkpoint = train_checkpoint(model_sd, optimizer, rng_states, first['model_args'], first['iter_num'],
                                  first['best_val_loss'], cfg)
    path = os.path.join(dest_dir or out_dir, 'ckpt.pt')
    save_checkpoint(checkpoint, path)
    print(f"wrote {path} (train.py's format) from {source} at iter {checkpoint['iter_num']}")
    return path


if __name__ == '__main__':
    usage = "usage: python consolidate.py OUT_DIR [DEST_DIR]   (writes DEST_DIR/ckpt.pt, default OUT_DIR)"
    if sys.argv[1:] in (['--help'], ['-h']):
        print(usage)  # (asked for: exits 0, as every script's --help does)
    elif len(sys.argv) not in (2, 3) or sys.argv[1].startswith('-'):
        raise SystemExit(usage)
    else:
        consolidate(*sys.argv[1:])
