"""
train.py plus expert parallelism (GShard; DeepSpeed-MoE and torchtitan lay it out this way): the experts of
every mixture-of-experts layer are split over the ep ranks of an ep group, rank r holding experts r·E/ep ..
(r+1)·E/ep - 1; everything else (attention, router, embeddings, norms, a shared expert) is replicated. Every
rank is a data-parallel rank of the batch. Per MoE layer: route (the model's own router), dispatch (each
token-slot to the rank of its expert: an all-to-all of variable sizes, the sizes exchanged first), compute
(each expert on the rows sent to it), combine (the reverse all-to-all, then the router's weighted sum in slot
order). Backward runs the two all-to-alls the other way. The dense gradients are averaged over all ranks; each
expert's are summed over the ranks that hold it (the world/ep replicas: the "expert data-parallel" group) and
divided by the world size, since each already sums the tokens its whole ep group sent it (sync_gradients).

    torchrun --standalone --nproc_per_node=4 expert_parallel.py --ep=4 --n_expert=4 --n_expert_active=2
    torchrun --standalone --nproc_per_node=4 expert_parallel.py --ep=2 --n_expert=4   # 2 replicas of ep 2
    torchrun --standalone --nproc_per_node=4 expert_parallel.py --ep=4 --n_expert=4 --init_from=resume
    python consolidate.py out-ep      # the rank files -> out-ep/ckpt.pt, train.py's checkpoint

The same model and loss curve in one process: python train.py --n_expert=4 --n_expert_active=2
--gradient_accumulation_steps=4 (this script's default: every rank takes whole micro-batches of the batch).
"""

from types import SimpleNamespace

import torch

from model import MoE, balance_routers, combine
from common.config import config_defaults, configure
from common.data import load_dataset, micro_batches
from common.training import (autocast_context, loss_function, make_out_dir, outputs_line, print_sample,
                             profiled, run_main, run_shape, training_loop)
from common.checkpoints import (CheckpointWriter, checkpoint_of, init_model, init_params, materialize,
                                rank_path, seed_dropout, set_rng_state)
from common.distributed import clip_grad_norm, finish_distributed, init_distributed, world_size_from_env
from common.model_parallel import (AllToAll, along, average_gradients, check_expert_parallel, expert_groups,
                                   group_comm, held_pieces, keep_own, process_grid)

# -----------------------------------------------------------------------------
# config: train.py's keys (common/config.py's TRAIN_DEFAULTS; `--help` lists them all), and these
out_dir = 'out-ep'              # each script its own folder: runs never overwrite one another
init_from = 'scratch'           # 'scratch' or 'resume' (out_dir/ckpt_ep_rank<r>.pt, the same ep and world)
dist_timeout = 60               # seconds a rank waits in a collective for the others before it fails
measure_every = 0               # measure and report every this many steps too; 0: the first step only
ep = 1                          # expert-parallel ranks per group: each holds n_expert/ep experts a layer
gradient_accumulation_steps = 4  # micro-batches per step, whole ones per rank (train.py's 2: 2 ranks at most)
config = config_defaults(globals())
# -----------------------------------------------------------------------------


def held_experts(n_expert, ep_rank, ep_size):
    """The experts of a layer that ep rank ep_rank holds: a contiguous run, so slots sorted by expert are
    sorted by rank too."""
    per_rank = n_expert // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def dispatch(rows, counts, ep):
    """Each token-slot's row (sorted by expert, so by the rank that holds it) to that rank. First the split
    sizes: an all-to-all of the counts, so that each rank learns how many rows each rank sends to each of its
    experts; then the rows, an all-to-all of those variable sizes. Returns (the rows received, by source rank
    then local expert; their counts [source rank][local expert]; the rows (sent, received) per rank)."""
    to_rank = counts.view(ep.size, -1)  # [r][j]: slots for rank r's j-th expert
    counts_in = torch.empty_like(to_rank)
    ep.all_to_all_v(counts_in, to_rank, [1] * ep.size, [1] * ep.size, 'split sizes')
    sizes = counts_in.tolist()  # (the sizes must be on the host: the one wait for the device)
    send, recv = [sum(r) for r in to_rank.tolist()], [sum(r) for r in sizes]
    return AllToAll.apply(rows, ep, send, recv, 'dispatch'), sizes, (send, recv)


def compute(experts, received, sizes):
    """Each expert this rank holds on every row sent to it: its rows from all the source ranks in one batch,
    the outputs put back in the order the rows came (source rank, then expert)."""
    n_src, n_local = len(sizes), len(experts)
    chunks, out = received.split([n for row in sizes for n in row]), [None] * (n_src * n_local)
    for j, expert in enumerate(experts):
        rows = torch.cat([chunks[s * n_local + j] for s in range(n_src)])
        y = rows if expert is None else expert(rows)  # (None: another tp rank's, sent no rows: parallel_4d)
        for s, part in enumerate(y.split([sizes[s][j] for s in range(n_src)])):
            out[s * n_local + j] = part
    return torch.cat(out)


def combine_back(out, splits, ep, order, weights, dropped):
    """The experts' outputs back to the ranks their tokens came from (the reverse all-to-all: what came from
    rank i goes back to rank i, in the order it came), then model.combine: each token's k outputs summed by
    the router's weights in slot order, the same sum as one process (a slot past its expert's capacity, at
    the end of `order`, adds nothing: zeros)."""
    sent, received = splits
    back = AllToAll.apply(out, ep, received, sent, 'combine')
    return combine(torch.cat([back, back.new_zeros(dropped, back.size(1))]), order, weights)


def expert_parallel_forward(moe, experts, ep, x, index, weights):
    """MoE.experts_forward, expert-parallel: the token-slots sorted by expert exactly as one process sorts
    them (a stable argsort), dispatched, computed, combined back. Slots past an expert's capacity (index
    n_expert: a capacity factor) sort last and go nowhere."""
    order = index.flatten().argsort(stable=True)  # the token-slots (t*k + j) by expert, in token order
    counts = torch.bincount(index.flatten(), minlength=moe.n_expert + 1)
    kept = order[:order.numel() - counts[-1]]
    received, sizes, splits = dispatch(x[kept // moe.k], counts[:-1], ep)
    return combine_back(compute(experts, received, sizes), splits, ep, order, weights, int(counts[-1]))


def ep_comms(world_size, rank, ep_size):
    """The groups, from the data-parallel ranks (the whole world) cut into runs of ep (expert_groups): the ep
    group is this rank's run, the expert-data-parallel group the ranks at its place in every run (they hold
    the same experts). Returns (ep, edp, dp: the whole world, over which the dense gradients are averaged)."""
    grid, _, comms = process_grid(world_size, rank, dp=world_size)
    ep_groups, edp_groups = expert_groups(along(grid, 'dp'), ep_size)
    return group_comm('ep', ep_groups, rank), group_comm('edp', edp_groups, rank), comms['dp']


def cut_experts(model, ep):
    """train.py's GPT (on the meta device) cut to this rank's part: in every MoE layer the other ep ranks'
    experts become None (the names of the held ones stay transformer.h.{i}.mlp.experts.{e}), and its
    experts_forward the expert-parallel one. Returns (dense parameters, expert parameters)."""
    for moe in (block.mlp for block in model.transformer.h if isinstance(block.mlp, MoE)):
        held = held_experts(moe.n_expert, ep.rank, ep.size)
        for e in range(moe.n_expert):
            if e not in held:
                moe.experts[e] = None
        moe.experts_forward = lambda x, index, weights, moe=moe, held=held: expert_parallel_forward(
            moe, [moe.experts[e] for e in held], ep, x, index, weights)  # (as held when called: tp may cut)
    expert_ids = {id(p) for name, p in model.named_parameters() if '.mlp.experts.' in name}
    params = list(model.parameters())
    return [p for p in params if id(p) not in expert_ids], [p for p in params if id(p) in expert_ids]


def sync_gradients(dense, experts, dp, edp):
    """The dense gradients averaged over every rank (DDP). An expert's gradient on this rank already sums what
    the tokens of all its ep group sent it, each micro-batch's loss scaled by 1/micro-steps, so summed over
    the edp replicas it covers every rank's batch once: divided by the world size (not edp's) it is the mean
    over the global batch, as in one process."""
    average_gradients(dense, dp)
    average_gradients(experts, edp, divisor=dp.size, kind='expert all_reduce')


def train_step(model, optimizer, batches, ctx, grad_clip, params, comms):
    """train.py's iteration on this rank's micro-batches (the MoE layers dispatch and combine inside the
    forward and backward), then the two gradient syncs, the clip over the whole model, AdamW on what this
    rank holds. Returns the mean loss over the global batch."""
    (dense, experts), (ep, edp, dp) = params, comms
    loss_sum = torch.zeros((), device=dense[0].device)
    for x, y in batches:
        with ctx:
            _, loss = model(x, y)
            loss = loss / len(batches)  # the gradient is the mean over the batch (the ranks average below)
        loss_sum += loss.detach()
        loss.backward()
    sync_gradients(dense, experts, dp, edp)
    if grad_clip != 0.0:  # the whole model's norm: the ep group holds each expert once, the dense ep times
        counted = [(p.grad, 1 / ep.size) for p in dense if p.grad is not None] + \
            [(p.grad, 1.0) for p in experts if p.grad is not None]
        clip_grad_norm([g for g, _ in counted], grad_clip, [ep], counted)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    balance_routers(model, lambda loads: dp.summed(loads, 'router loads'))  # (every rank's tokens)
    dp.all_reduce(loss_sum, kind='scalars')
    return loss_sum.item() / dp.size


def build(cfg, vocab_size, ep, rank, world_size):
    """train.py's GPT on the meta device, cut to this rank's experts and the dense weights, which alone get
    storage and then train.py's values (init_params, one tensor at a time: the experts of the other ranks
    are drawn and dropped, so the stream is train.py's) or this rank's checkpoint; AdamW over them.
    Returns (model, (dense, experts), optimizer, iter_num, best_val_loss, flops_per_token)."""
    ckpt_path = rank_path(cfg.out_dir, RANK_FILE, rank)
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path, gpt2=False, meta=True)
    if rank == 0:
        print(run_shape(f"world {world_size} = dp {world_size} (ep {ep.size} x {world_size // ep.size} "
                        f"replicas of the experts)", cfg, model.get_num_params()))
    flops_per_token = model.flops_per_token(cfg.block_size)  # of the whole model (active experts), uncut
    params = cut_experts(model, ep)
    materialize(model, cfg.device)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                           'cuda' if cfg.device.startswith('cuda') else 'cpu')
    if checkpoint is not None:
        model.load_state_dict(checkpoint['model'])
        optimizer.load_state_dict(checkpoint['optimizer'])
        set_rng_state(checkpoint['rng'])  # this rank's own dropout stream
    else:
        init_params(model.config, cfg.seed, keep_own(model))
        seed_dropout(cfg.seed, rank)  # every rank its own masks; rank 0 keeps train.py's stream
    return model, params, optimizer, iter_num, best_val_loss, flops_per_token


# -----------------------------------------------------------------------------
# The checkpoint: every rank its own file (the dense weights and its experts, by their train.py names);
# consolidate takes the dense weights from rank 0 and each expert from the rank of the first ep group that
# holds it

RANK_FILE = 'ckpt_ep_rank{}.pt'


def rank_checkpoint(model, optimizer, ep, rank, cfg, world_size, iter_num, best_val_loss):
    """This rank's dense weights and experts (by their train.py names), AdamW state and dropout stream (every
    rank a data-parallel rank); its pieces for consolidate.py: the first ep group (ranks 0 .. ep-1) holds
    every expert once, rank 0 the dense weights."""
    cut = lambda name, p: (name, p.shape, None) if rank == 0 or (rank < ep.size and '.mlp.experts.' in name) \
        else None
    return checkpoint_of(dict(model=model.state_dict(), optimizer=optimizer.state_dict()),
                         held_pieces(model, optimizer, cut, rank == 0), (RANK_FILE, world_size),
                         {'ep': cfg.ep, 'ranks': world_size}, rank, vars(model.config), iter_num,
                         best_val_loss, vars(cfg))


def main(argv):
    cfg = configure(config, argv)
    check_expert_parallel(cfg, world_size_from_env(), RANK_FILE)  # its refusals: common/model_parallel.py
    rank, _, world_size, device = init_distributed(cfg.dist_timeout)
    cfg.device = device if world_size > 1 else cfg.device
    comms = ep_comms(world_size, rank, cfg.ep)
    make_out_dir(cfg)  # (a new run: a log of its own)
    torch.manual_seed(cfg.seed)
    ctx = autocast_context('cuda' if cfg.device.startswith('cuda') else 'cpu', cfg.dtype)
    data, vocab_size = load_dataset(cfg.dataset)
    model, params, optimizer, iter_num, best_val_loss, flops = build(cfg, vocab_size, comms[0], rank,
                                                                     world_size)
    writer, dp = CheckpointWriter(cfg.max_iters), comms[2]
    step = lambda it: train_step(model, optimizer, micro_batches(data, cfg, it, dp.rank, dp.size), ctx,
                                 cfg.grad_clip, params, comms)

    def save(it, best):
        writer.save(rank_checkpoint(model, optimizer, comms[0], rank, cfg, world_size, it, best),
                    rank_path(cfg.out_dir, RANK_FILE, rank), it)
    run = SimpleNamespace(model=model, optimizer=optimizer, loss_of=loss_function(model, ctx), dp=dp,
                          data=data, step=step, save=save, flops_per_token=flops, n_devices=world_size,
                          rank=rank, kind='expert_parallel', comms=list(comms))
    training_loop(cfg, run, iter_num, best_val_loss)
    writer.wait()
    if cfg.sample_at_end and not cfg.eval_only:  # every rank generates: each forward dispatches to the others
        print_sample(model, cfg, ctx, show=rank == 0, hint=f"python consolidate.py {cfg.out_dir} && "
                     f"python sample.py --out_dir={cfg.out_dir}")
    if rank == 0:
        print(outputs_line(cfg.out_dir, f"ckpt_ep_rank*.pt (each rank's experts and the dense weights: "
                                        f"resume; python consolidate.py {cfg.out_dir} makes one ckpt.pt)",
                           *profiled(cfg)))
    finish_distributed(cfg)


if __name__ == '__main__':
    run_main(main)
