"""
What the model-parallel scripts share (tensor, pipeline, context and expert parallelism, the 4-D grid), which
the data-parallel ones never import: the process grid torch.arange(world).view(dp, pp, cp, tp), its groups
(made in one place: group_comm) and its printout, and the all-to-all with a backward (expert parallelism's
dispatch and combine, Ulysses' sequence <-> heads); and a model cut by layers or slices: the values each rank
keeps (a tp rank's slices: slice_boxes), the pieces it declares for consolidate.py.
"""

import math
from itertools import accumulate

import torch
import torch.distributed as dist

from common.checkpoints import buffer_pieces, pieces_of
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


# The all-to-all with its backward: expert parallelism's dispatch and combine, Ulysses' sequence <-> heads

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
