"""
What the model-parallel scripts share (tensor, pipeline, context and expert parallelism, the 4-D grid), which
the data-parallel ones never import: the process grid torch.arange(world).view(dp, pp, cp, tp), its groups
(made in one place: group_comm) and its printout; sequence parallelism's collectives along the sequence and
the all-to-all with a backward (expert parallelism's dispatch and combine, Ulysses' sequence <-> heads); a
model cut by layers or slices: the values each rank keeps (a tp rank's slices: slice_boxes), the pieces it
declares for consolidate.py; and what each cut needs of the model and the world (check_tensor_parallel,
check_pipeline, ...: each model-parallel script's table of refusals).
"""

import math
import os
from itertools import accumulate

import torch
import torch.distributed as dist

from common.checkpoints import buffer_pieces, check_resume_grid, pieces_of, rank_path, resumed_config
from common.config import model_config, refuse, shared_refusals
from common.distributed import Comm
from common.training import log_rank_rows
from model import GPT, GPTConfig


GRID_DIMS = ('dp', 'pp', 'cp', 'tp')


def data_parallel_size(world_size, **degrees):
    """dp, what is left of the world once the model-parallel degrees (tp=, pp=, cp=) divide it; when they do
    not, one line that says which flag to change."""
    product = 1
    for degree in degrees.values():
        product *= degree
    if product < 1 or world_size % product:
        named = ' x '.join(f"{k}={v}" for k, v in degrees.items())
        named += f" = {product}" if len(degrees) > 1 else ''
        raise SystemExit(f"error: world size {world_size} is not divisible by {named}: start a "
                         f"multiple of {product} processes (torchrun --nproc_per_node={product}), or lower "
                         + ' / '.join(f"--{k}" for k in degrees))
    return world_size // product


def process_grid(world_size, rank, dp=1, pp=1, cp=1, tp=1):
    """The process grid of every parallel script: torch.arange(world).view(dp, pp, cp, tp), so a global rank
    is ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank. tp varies fastest: a tensor-parallel group,
    which talks the most, is neighbouring ranks (one node's GPUs). Returns (grid, {dim: this rank's
    coordinate}, {dim: the Comm of its group along dim}); a script adds the groups of its own (group_comm)."""
    if dp * pp * cp * tp != world_size:
        raise SystemExit(f"error: world size {world_size} is not dp x pp x cp x tp = {dp} x {pp} x {cp} x "
                         f"{tp}")
    grid = torch.arange(world_size).view(dp, pp, cp, tp)
    coords = dict(zip(GRID_DIMS, (int(i) for i in (grid == rank).nonzero()[0])))
    return grid, coords, {dim: group_comm(dim, along(grid, dim), rank) for dim in GRID_DIMS}


def along(grid, *dims):
    """The groups of ranks along dims: for each choice of the other coordinates, the ranks that differ only in
    dims, in grid order. along(grid, 'tp'): the tp groups; along(grid, 'dp', 'cp'): the ranks holding the
    same weights under data and context parallelism."""
    moved = grid.permute(*[i for i, d in enumerate(GRID_DIMS) if d not in dims],
                         *[GRID_DIMS.index(d) for d in dims])
    return moved.reshape(-1, math.prod(grid.size(GRID_DIMS.index(d)) for d in dims)).tolist()


def expert_groups(groups, ep):
    """Expert parallelism folded into data parallelism: each group of ranks holding the same dense weights
    (groups: the data-parallel ones, or data x context) cut into runs of ep neighbours, the ep groups (the
    all-to-alls, the chattiest, stay close); the ranks at the same place in every run of a group hold the same
    experts, the expert-data-parallel (edp) groups. Returns (ep groups, edp groups)."""
    runs = [[g[i:i + ep] for i in range(0, len(g), ep)] for g in groups]
    return [run for rs in runs for run in rs], [list(place) for rs in runs for place in zip(*rs)]


def group_comm(name, groups, rank):
    """The one place where process groups are made: groups, lists of global ranks, each made a group (every
    rank makes every one, in the same order: new_group is collective); returns the Comm of the one this rank
    is in (None if none). A group of one rank is a Comm alone; the whole world is the default group."""
    comm = None
    world = dist.get_world_size() if dist.is_initialized() else 1
    for members in groups:
        group = dist.new_group(members) if 1 < len(members) < world else None
        if rank in members:
            comm = Comm(group, name, alone=len(members) == 1)
    return comm


def embed_comm(grid, rank, tied):
    """Tied embeddings, pp > 1: the group {first stage, last stage} of this rank's pipeline (else None), the
    two that hold the one weight (the embedding, the head)."""
    if not tied or grid.size(1) == 1:
        return None
    return group_comm('embed', [[pipe[0], pipe[-1]] for pipe in along(grid, 'pp')], rank)


def print_grid(grid, coords, comms, rank, dims=GRID_DIMS, out_dir=None):
    """The process grid along dims (the script's), printed once by rank 0, then each rank's coordinates and
    the global ranks of each of its groups (comms: name -> Comm, or None where the rank has no such group),
    the ranks it talks to; with out_dir, each rank's also a row of log.jsonl."""
    shape = {d: n for d, n in zip(GRID_DIMS, grid.shape) if d in dims}
    if rank == 0:
        print(f"process grid: torch.arange({grid.numel()}).view("
              + ', '.join(f"{d}={n}" for d, n in shape.items()) + f")\n{grid.view(*shape.values())}")
    groups = {k: [c.global_rank(r) for r in range(c.size)] for k, c in comms.items() if c is not None}
    print(f"[rank {rank}] " + ' '.join(f"{d}={coords[d]}" for d in dims) + '; groups: ' +
          ', '.join(f"{k} {v}" for k, v in groups.items()) + '\n', end='', flush=True)
    if out_dir is not None:
        log_rank_rows(out_dir, {'rank': rank, 'coords': coords, 'groups': groups})


# The collectives along the sequence of sequence parallelism (tensor_parallel.py), and the all-to-all with its
# backward: expert parallelism's dispatch and combine, Ulysses' sequence <-> heads

def all_gather_seq(x, comm):
    """(B, T/n, ...) on each rank -> (B, T, ...), the ranks' chunks in rank order along the sequence."""
    chunk = x.transpose(0, 1).contiguous()  # sequence first, so that each rank's chunk is contiguous
    out = chunk.new_empty((comm.size * chunk.size(0),) + chunk.shape[1:])
    comm.all_gather(out, chunk)
    return out.transpose(0, 1).contiguous()


def reduce_scatter_seq(x, comm):
    """(B, T, ...) partial sums on each rank -> (B, T/n, ...): this rank's chunk of the sum over ranks."""
    full = x.transpose(0, 1).contiguous()
    out = full.new_empty((full.size(0) // comm.size,) + full.shape[1:])
    comm.reduce_scatter(out, full)
    return out.transpose(0, 1).contiguous()


def all_to_all_rows(x, comm, send, recv, kind):
    """send[i] rows of x to rank i of comm; returns the recv[i] rows from each rank i, in rank order."""
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    comm.all_to_all_v(out, x.contiguous(), recv, send, kind)
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all_rows with a backward: the gradient of what came from rank i goes back to rank i (the same
    all-to-all with the sizes swapped)."""

    @staticmethod
    def forward(ctx, x, comm, send, recv, kind):
        ctx.comm, ctx.send, ctx.recv, ctx.kind = comm, send, recv, kind
        return all_to_all_rows(x, comm, send, recv, kind)

    @staticmethod
    def backward(ctx, grad):
        back = all_to_all_rows(grad, ctx.comm, ctx.recv, ctx.send, ctx.kind + ' backward')
        return back, None, None, None, None


# -----------------------------------------------------------------------------
# The optimizer of a rank's part of the model, and its gradients' average over the ranks holding the same part

def configure_adamw(model, cfg, checkpoint=None):
    """The model's AdamW from the config's keys (model.configure_optimizers: its two groups, fused on CUDA),
    its state loaded from checkpoint['optimizer'] when resuming."""
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                           'cuda' if cfg.device.startswith('cuda') else 'cpu')
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint['optimizer'])
    return optimizer


def average_gradients(params, comm, divisor=None, kind='all_reduce'):
    """Data parallelism by hand: every gradient summed over comm's ranks in one flat all-reduce, then divided
    by divisor (default comm's size: the mean; expert parallelism divides by the whole world's)."""
    grads = [p.grad for p in params if p.grad is not None]
    divisor = comm.size if divisor is None else divisor
    if grads and (comm.size > 1 or divisor != 1):
        flat = torch.cat([g.flatten() for g in grads])
        comm.all_reduce(flat, kind=kind)
        flat /= divisor
        for g, new in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(new.view_as(g))


# -----------------------------------------------------------------------------
# A model cut by layers or slices: its values kept by part, and its pieces declared for consolidate.py

def keep_own(model):
    """For init_params: the parameters the (cut) model still holds take their values; the rest is dropped."""
    params = dict(model.named_parameters(remove_duplicate=False))

    def keep(name, full):
        if name in params:
            params[name].data.copy_(full)
    return keep


def whole_shapes(model_args):
    """{name: shape} of every parameter and buffer of the whole model (built on the meta device)."""
    with torch.device('meta'):
        return {name: t.shape for name, t in GPT(GPTConfig(**model_args)).state_dict().items()}


def held_pieces(model, optimizer, cut, buffers):
    """pieces_of for each parameter this rank holds, in a file that keeps model.state_dict() as 'model' and
    optimizer.state_dict() as 'optimizer' (AdamW's state numbered in param_groups' order). cut(name, p): None
    (not declared here: another rank's copy is), or (its name in the whole model, its whole shape, boxes:
    where its rows sit, None when it is whole). buffers: this rank declares its buffers too (whole)."""
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group['params'])}
    pieces = []
    for name, p in model.named_parameters():
        where = cut(name, p)
        if where is not None:
            paths = {'param': ('model', name)}
            if p in optimizer.state:  # (AdamW keeps no state for a parameter that never had a gradient)
                paths.update({k: ('optimizer', 'state', index[id(p)], k)
                              for k in ('exp_avg', 'exp_avg_sq', 'step')})
            pieces += pieces_of(*where[:2], paths, boxes=where[2])
    return pieces + (buffer_pieces(model) if buffers else [])


# -----------------------------------------------------------------------------
# A tensor-parallel rank's slice of each dense tensor (tensor_parallel.py's layers, the 4-D grid's): where it
# sits in the whole tensor, the values it copies out at the start, the pieces it declares for consolidate.py

def qkv_split(config):
    """The sizes of q, k and v along c_attn's output features (k and v have n_kv_head heads)."""
    return [n * (config.n_embd // config.n_head) for n in (config.n_head, config.n_kv_head, config.n_kv_head)]


def slice_boxes(shape, kind, tp_group, qkv_sizes=None):
    """Where this rank's slice of a dense tensor of that shape sits in it: [(box, first, last)], the slice's
    rows first .. last-1 being the dense tensor's box (a (start, stop) per dimension). 'col': a run of its
    rows (output features), 'row': a run of its columns (input features), 'qkv': a run of rows in each of q,
    k and v (this rank's heads); all of it for the rest ('replicated', and a MoE's 'shared' router and its
    'expert's, whole on the rank that holds them). Runs as torch.tensor_split cuts them."""
    n, r, whole = tp_group.size, tp_group.rank, [(0, size) for size in shape]

    def run(length, offset=0):  # the r-th of tensor_split's n runs of length (the first ones one longer)
        short, longer = divmod(length, n)
        start = offset + r * short + min(r, longer)
        return start, start + short + (r < longer)
    if kind == 'row':
        return [(whole[:1] + [run(shape[1])] + whole[2:], 0, shape[0])]
    if kind in ('replicated', 'shared', 'expert'):
        return [(whole, 0, shape[0])]
    sizes, boxes, first = qkv_sizes if kind == 'qkv' else [shape[0]], [], 0
    for offset, size in zip(accumulate([0] + sizes), sizes):
        start, stop = run(size, offset)
        boxes.append(([(start, stop)] + whole[1:], first, first + stop - start))
        first += stop - start
    return boxes


def take_slice(full, kind, tp_group, qkv_sizes=None):
    """This rank's part of a dense tensor: its boxes (slice_boxes), their rows one after another."""
    parts = [full[tuple(slice(*b) for b in box)] for box, _, _ in
             slice_boxes(full.shape, kind, tp_group, qkv_sizes)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def keep_slices(layout, tp, config):
    """For init_values: copy this rank's slice of each dense parameter's values into its local parameter."""
    qkv_sizes = qkv_split(config)

    def keep(name, full):
        if name in layout:
            layout[name][0].data.copy_(take_slice(full, layout[name][1], tp.group, qkv_sizes))
    return keep


def slice_places(model, layout, tp):
    """For a rank file's pieces: where(p) = (its name in the whole model, its whole shape, the boxes its rows
    fill there: slice_boxes) for each parameter of a tp layout {dense name: (parameter, kind)}."""
    qkv, dense_of = qkv_split(model.config), {id(p): (dense, kind) for dense, (p, kind) in layout.items()}
    shapes = whole_shapes(vars(model.config))

    def where(p):
        dense, kind = dense_of[id(p)]
        return dense, shapes[dense], slice_boxes(shapes[dense], kind, tp.group, qkv)
    return where


# -----------------------------------------------------------------------------
# What each cut of the model needs: a model-parallel script's table of refusals, judged before any work, one
# line on every rank (refuse), on the model that would run (a resume's: the checkpoint's; resumed_config).
# The data-parallel scripts never cut the model, and keep their few rules in their own files.

def check_tensor_parallel(cfg, world_size, rank_file):
    """tensor_parallel.py: whole heads and whole experts on every tp rank, whole sequence chunks under
    sequence parallelism; a resume on its own grid (rank_file: the scripts' rank files, rank 0's read)."""
    dp = data_parallel_size(world_size, tp=cfg.tp)  # (names the flag to change)
    path = rank_path(cfg.out_dir, rank_file, 0)
    cfg, resumed = resumed_config(cfg, path)
    n_kv_head = cfg.n_kv_head or cfg.n_head
    refuse(*shared_refusals(cfg, 'tensor_parallel.py', dp, world_size),
           (cfg.n_expert % cfg.tp, f"n_expert ({cfg.n_expert}) must be divisible by tp={cfg.tp}: each tp "
            "rank holds n_expert/tp whole experts of every MoE layer"),
           (cfg.n_head % cfg.tp or n_kv_head % cfg.tp, f"n_head ({cfg.n_head}) and n_kv_head ({n_kv_head}) "
            f"must both be divisible by tp={cfg.tp}: each rank holds whole query and key/value heads"),
           (cfg.sequence_parallel and cfg.block_size % cfg.tp,
            f"sequence_parallel needs block_size ({cfg.block_size}) divisible by tp={cfg.tp}"),
           (cfg.init_from == 'resume' and not os.path.exists(path),  # (every rank's file: init_model checks)
            f"init_from=resume but there is no checkpoint at {path}"), resumed=resumed)
    check_resume_grid(cfg, {'tp': cfg.tp, 'ranks': world_size}, path)  # the saved one, or consolidate.py


def check_pipeline(cfg, world_size, stage_file, schedules):
    """pipeline.py: n_layer cut into pp stages (of virtual_stages chunks each), the batch into microbatches,
    enough of them to fill the schedule's pipeline (schedules: pipeline.py's, by name); a resume on its own
    grid."""
    path = rank_path(cfg.out_dir, stage_file, 0)
    cfg, resumed = resumed_config(cfg, path, gpt2=False)
    check_schedule(cfg, schedules, resumed)  # first: the checks below divide by its keys
    m, p, v = cfg.n_microbatches, cfg.pp, cfg.virtual_stages
    refuse(*shared_refusals(cfg, 'pipeline.py', data_parallel_size(world_size, pp=p), world_size),
           (cfg.n_layer % (p * v), f"n_layer ({cfg.n_layer}) must be divisible by pp ({p}) x virtual_stages "
                                   f"({v}): each stage gets n_layer/pp blocks, in virtual_stages chunks"),
           (cfg.batch_size % m, f"batch_size ({cfg.batch_size}) must be divisible into n_microbatches ({m})"),
           (cfg.schedule in ('1f1b', 'zb1') and m < p,
            f"{cfg.schedule} needs n_microbatches ({m}) >= pp ({p}) to fill the pipeline"),
           (cfg.schedule == 'interleaved' and m % p,
            f"interleaved needs n_microbatches ({m}) to be a multiple of pp ({p}): groups of pp per chunk"),
           resumed=resumed)
    check_resume_grid(cfg, {'pp': p, 'virtual_stages': v}, path)


def check_schedule(cfg, schedules, resumed=None):
    """The schedule's keys, checked first (the others divide by them), and what no pipeline can run:
    check_pipeline and check_parallel_4d run it first. schedules: pipeline.SCHEDULES (by name); resumed: as
    refuse takes it."""
    s, v, m = cfg.schedule, cfg.virtual_stages, cfg.n_microbatches
    refuse((cfg.n_expert and cfg.aux_loss_style == 'hf' and cfg.pp > 1, "aux_loss_style='hf' (a converted "
            "Mixtral's loss) pools the routing of every MoE layer, which the stages split: pass "
            "--aux_loss_style=switch"),
           (s not in schedules, f"--schedule={s} is not one of {', '.join(schedules)}"),
           (v < 1 or (v > 1 and s != 'interleaved'),
            f"--virtual_stages={v} must be 1, or more with --schedule=interleaved (got --schedule={s})"),
           (cfg.pp == 1 and (v > 1 or s == 'zb1'),  # (pp < 1: the world size's check)
            f"--schedule={s} --virtual_stages={v} needs pp >= 2 (with chunks a stage is its own neighbour; "
            "zb1 has no bubble to fill)"),
           (m < 1, f"--n_microbatches={m} must be at least 1"),
           (s == 'zb1' and cfg.activation_checkpointing, "zb1 with --activation_checkpointing=True "
            "would re-run each block's forward once per weight module (W is one short backward per module, "
            "and each recomputes the checkpointed block): drop one of them"), resumed=resumed)


def check_context_parallel(cfg, world_size):
    """context_parallel.py: every sequence in 2 x cp equal chunks, whole heads for Ulysses' all-to-all, no
    dropout (a resume: train.py's ckpt.pt, which every rank holds whole)."""
    dp = data_parallel_size(world_size, cp=cfg.cp)  # (names the flag to change)
    cfg, resumed = resumed_config(cfg, os.path.join(cfg.out_dir, 'ckpt.pt'))
    n_kv_head = cfg.n_head if cfg.n_kv_head is None else cfg.n_kv_head
    refuse(*shared_refusals(cfg, 'context_parallel.py', dp, world_size),
           (cfg.cp_attention not in ('ring', 'ulysses'),
            f"--cp_attention={cfg.cp_attention} is not one of ring, ulysses"),
           (cfg.block_size % (2 * cfg.cp), f"block_size ({cfg.block_size}) must be divisible by 2 x cp = "
            f"{2 * cfg.cp}: each rank holds two equal chunks of every sequence (zig-zag)"),
           (cfg.cp_attention == 'ulysses' and (cfg.n_head % cfg.cp or n_kv_head % cfg.cp),
            f"ulysses needs n_head ({cfg.n_head}) and n_kv_head ({n_kv_head}) divisible by cp={cfg.cp}: its "
            f"all-to-all gives each rank whole heads"),
           (cfg.dropout != 0.0, f"context_parallel.py needs dropout=0.0, got {cfg.dropout}: attention's "
            f"dropout would have to be replayed block by block in the ring's backward"), resumed=resumed)


def check_expert_parallel(cfg, world_size, rank_file):
    """expert_parallel.py: a mixture of experts, n_expert/ep whole experts on each ep rank; a resume on its
    own grid."""
    path = rank_path(cfg.out_dir, rank_file, 0)
    cfg, resumed = resumed_config(cfg, path, gpt2=False)  # (GPT-2: dense)
    model_config(cfg, 256)  # (the model's own checks; configure's: at least one MoE layer)
    refuse((cfg.n_expert == 0, "n_expert=0: a dense model has no experts to split over ep ranks; pass "
            "--n_expert=4 --n_expert_active=2 (a mixture of experts), or train a dense model with "
            "train_ddp.py"), resumed=resumed)
    data_parallel_size(world_size, ep=cfg.ep)  # ep divides the world (the next checks divide by it)
    refuse((cfg.n_expert % cfg.ep, f"n_expert ({cfg.n_expert}) must be divisible by ep={cfg.ep}: each ep "
            "rank holds n_expert/ep whole experts of every layer"),
           *shared_refusals(cfg, 'expert_parallel.py', world_size, world_size),  # (every rank is a dp rank)
           resumed=resumed)
    check_resume_grid(cfg, {'ep': cfg.ep, 'ranks': world_size}, path)


def check_parallel_4d(cfg, world_size, rank_file, grid_of, schedules):
    """parallel_4d.py: every cut above on one grid (grid_of(cfg, world_size): how this run cuts the model,
    which a resume must match). Returns dp."""
    path = rank_path(cfg.out_dir, rank_file, 0)
    cfg, resumed = resumed_config(cfg, path, gpt2=False)
    check_schedule(cfg, schedules, resumed)  # first: the checks below divide by its keys
    dp = data_parallel_size(world_size, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp)
    m, n_kv_head = cfg.n_microbatches, cfg.n_kv_head or cfg.n_head
    heads = cfg.tp * (cfg.cp if cfg.cp_attention == 'ulysses' else 1)
    refuse((cfg.cp_attention not in ('ring', 'ulysses'),
            f"--cp_attention={cfg.cp_attention} is not one of ring, ulysses"),
           *shared_refusals(cfg, 'parallel_4d.py', dp, world_size),
           (cfg.ep > 1 and not cfg.n_expert, f"--ep={cfg.ep} needs a mixture of experts: pass --n_expert=4 "
            "--n_expert_active=2"),
           (cfg.ep < 1 or (dp * cfg.cp) % cfg.ep, f"ep ({cfg.ep}) must divide dp x cp = {dp * cfg.cp}: the "
            "ep groups are taken from the ranks that hold the same weights"),
           (cfg.n_expert % (cfg.ep * cfg.tp), f"n_expert ({cfg.n_expert}) must be divisible by ep x tp = "
            f"{cfg.ep * cfg.tp}: each rank holds n_expert/(ep·tp) whole experts of every MoE layer"),
           (cfg.n_head % heads or n_kv_head % heads, f"n_head ({cfg.n_head}) and n_kv_head ({n_kv_head}) "
            f"must be divisible by tp{' x cp' if heads != cfg.tp else ''} = {heads}: each rank holds whole "
            "heads"),
           (cfg.n_layer % (cfg.pp * cfg.virtual_stages), f"n_layer ({cfg.n_layer}) must be divisible by pp x "
            f"virtual_stages = {cfg.pp * cfg.virtual_stages}"),
           (cfg.batch_size % m or (cfg.schedule != 'gpipe' and m < cfg.pp)
            or (cfg.schedule == 'interleaved' and m % cfg.pp),
            f"batch_size ({cfg.batch_size}) must split into n_microbatches ({m}), at least pp ({cfg.pp}) of "
            "them for 1f1b and zb1 (a multiple: interleaved)"),
           (cfg.block_size % (2 * cfg.cp * (cfg.tp if cfg.sequence_parallel else 1)),
            f"block_size ({cfg.block_size}) must be divisible by 2 x cp (x tp with sequence_parallel)"),
           (cfg.cp > 1 and (cfg.dropout != 0.0 or cfg.sequence_parallel), "with cp > 1, dropout must be 0.0 "
            "and sequence_parallel False (the ring cannot replay dropout; sequence parallelism inside a cp "
            "chunk is not composed here)"),
           (cfg.init_from == 'resume' and not os.path.exists(path),
            f"init_from=resume but there is no checkpoint at {path} (resume needs the same grid)"),
           resumed=resumed)
    check_resume_grid(cfg, grid_of(cfg, world_size), path)
    return dp
