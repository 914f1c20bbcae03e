"""
All the dimensions at once: data x pipeline x context x tensor parallelism on one grid,
torch.arange(world).view(dp, pp, cp, tp), the capstone that follows the four single-idea files. Nothing here
is new: it imports each piece from its file and composes them.

    torchrun --standalone --nproc_per_node=8 parallel_4d.py --pp=2 --tp=2 --gradient_accumulation_steps=2
    torchrun --standalone --nproc_per_node=8 parallel_4d.py --cp=2 --tp=2 --gradient_accumulation_steps=2
    torchrun --standalone --nproc_per_node=8 parallel_4d.py --pp=2 --cp=2 --tp=2
    torchrun --standalone --nproc_per_node=8 parallel_4d.py --tp=2 --ep=2 --n_expert=4 --n_microbatches=1 \
        --gradient_accumulation_steps=4     # a mixture of experts: dp 4 x tp 2, ep 2 folded into dp

tp  tensor_parallel.py: every block's layers split over the tp ranks (Megatron's f and g; --sequence_parallel)
cp  context_parallel.py: every sequence split over the cp ranks; attention across them (ring or Ulysses)
pp  pipeline.py: the blocks in stages, microbatches scheduled through them (GPipe, 1F1B, interleaved, ZB-H1)
dp  zero.py stage 1 over the dp x cp ranks that hold the same weights: each keeps 1/(dp·cp) of the AdamW
    state (Megatron's distributed optimizer shards over the same group)
ep  expert_parallel.py, folded into dp x cp (Megatron-Core's MoE parallel folding, torchtitan's): runs of ep
    of those ranks share out every MoE layer's experts (all-to-all), which the tp ranks then spread between
    them; the experts' own ZeRO-1 engine over the ranks that hold the same ones (expert data parallelism)

For the same config and seed the loss curve is train.py's. Rank 0 prints the grid, every rank its groups;
after the first iteration, what each rank holds and sent along each dimension, beside the formulas.
"""

from functools import partial
from types import SimpleNamespace

import torch

from context_parallel import ContextParallel, shard_sequence, zigzag_positions
from common.checkpoints import (CheckpointWriter, buffer_pieces, checkpoint_of, init_model, init_params,
                                materialize, rank_path, seed_dropout, set_rng_state)
from common.distributed import finish_distributed, world_size_from_env
from pipeline import SCHEDULES, Stage, forward_loss, keep_stage, run_schedule
from tensor_parallel import (TensorParallel, give_tp_ranks_their_dropout, shard_gpt, sync_tp_grads, tp_embed,
                             tp_head)
from common.config import config_defaults, configure
from common.data import load_dataset, micro_batches
from common.training import (autocast_context, get_lr, outputs_line, profiled, run_main, run_shape, start_run,
                             training_loop)
from zero import Zero
from common.model_parallel import (along, check_parallel_4d, embed_comm, expert_groups, group_comm,
                                   keep_slices, print_grid, process_grid, slice_places)
from expert_parallel import cut_experts
from model import balance_routers

# -----------------------------------------------------------------------------
# config: train.py's keys (common/config.py's TRAIN_DEFAULTS; `--help` lists them all), and these
out_dir = 'out-4d'              # each script its own folder: runs never overwrite one another
init_from = 'scratch'           # 'scratch' or 'resume' (out_dir/ckpt_4d_rank{r}.pt, the same grid)
sample_at_end = False           # (no sampling here: the model is in pieces)
dist_timeout = 60               # seconds a rank waits for the others before failing
measure_every = 0               # measure and report every this many steps too; 0: the first step only
# the grid: world = dp x pp x cp x tp (dp is what is left)
pp = 1                          # pipeline stages
cp = 1                          # context-parallel ranks per sequence
tp = 1                          # tensor-parallel ranks per layer
ep = 1                          # expert-parallel ranks, taken from the dp x cp ranks: n_expert/(ep·tp) each
sequence_parallel = False       # tp: shard norms and dropout along the sequence (not with cp > 1)
cp_attention = 'ring'           # cp: 'ring' or 'ulysses'
schedule = '1f1b'               # pp: 'gpipe', '1f1b', 'interleaved' or 'zb1'
virtual_stages = 1              # pp, interleaved: chunks per stage
n_microbatches = 2              # pp: microbatches per micro-step
bucket_size = 100_000           # dp (ZeRO-1): elements per flat bucket
adam_eps = 1e-8                 # AdamW's epsilon
config = config_defaults(globals())
# -----------------------------------------------------------------------------


def build_stage(model, cfg, grid, coords, comms, checkpoint):
    """This rank's part of train.py's GPT (built on the meta device): its tp slice of every layer, then its
    pipeline stage's blocks, with context-parallel attention, as a pipeline Stage whose embedding and loss are
    the vocabulary-parallel ones on this rank's tokens; a MoE layer's experts first cut over the ep group,
    then spread over tp. Only that part gets storage, then train.py's values (init_params, one dense tensor at
    a time) or this rank's checkpoint. Returns (stage, tp, cp, layout)."""
    tp = TensorParallel(comms['tp'], cfg.sequence_parallel)
    cp = ContextParallel(comms['cp'], cfg.cp_attention)
    if comms['ep'] is not None:
        cut_experts(model, comms['ep'])
    layout = shard_gpt(model, tp)
    give_tp_ranks_their_dropout(model, tp)
    chunks = keep_stage(model, coords['pp'], cfg.pp, cfg.virtual_stages)
    if cp.group.size > 1:
        shard_sequence(model, cp)
        cp.positions = zigzag_positions(cfg.block_size, cp.group.size, cp.group.rank, cfg.device)
    tokens = cfg.block_size // cp.group.size // (tp.group.size if cfg.sequence_parallel else 1)
    stage = Stage(model, chunks, coords['pp'], cfg.pp, grid[coords['dp'], :, coords['cp'], coords['tp']],
                  (cfg.batch_size // cfg.n_microbatches, tokens, model.config.n_embd), cfg.device,
                  autocast_context(cfg.device.split(':')[0], cfg.dtype), comms['pp'],
                  act_dtype=weights_dtype(cfg))  # (the stream between stages: the parameters' dtype)
    mine = (lambda t: t) if cp.positions is None else (lambda t: t[:, cp.positions])  # this rank's tokens
    stage.embed = lambda idx: tp_embed(model, mine(idx), tp, cp.positions)
    stage.head = lambda h, targets: tp_head(model, h, mine(targets), tp)
    materialize(model, cfg.device)  # storage for this rank's part alone
    if checkpoint is not None:
        model.load_state_dict(checkpoint['model'])
    else:
        init_params(model.config, cfg.seed, keep_slices(layout, tp, model.config))
    return stage, tp, cp, layout


ENGINES = ('zero', 'expert_zero')  # the ZeRO-1 engines' keys in a rank's checkpoint


def build_zeros(model, cfg, comms, coords, checkpoint):
    """ZeRO-1 over the dp x cp ranks that hold the same weights: this rank's part of the model in its flat
    buckets, 1/(dp·cp) of the AdamW state. With ep > 1 its experts get an engine of their own over the edp
    ranks that hold the same ones; their gradients are divided by dp·cp all the same, not edp: an expert's
    sums what every rank of its ep group sent it (Megatron's expert gradient scaling). From the checkpoint on
    resume, with this rank's random stream. Returns the engines: [dense, experts (ep > 1)]."""
    experts = [p for n, p in model.named_parameters() if '.mlp.experts.' in n] if comms['ep'] else []
    dense = [p for p in model.parameters() if all(p is not q for q in experts)]
    zeros = [Zero(model, 1, comm.rank, comm.size, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.adam_eps,
                  cfg.bucket_size, weights_dtype(cfg), comm, params=params, divisor=comms['dp_cp'].size)
             for params, comm in ((dense, comms['dp_cp']), (experts, comms['edp'])) if params]
    if checkpoint is not None:
        for key, zero in zip(ENGINES, zeros):
            zero.load_state_dict(checkpoint[key])
        set_rng_state(checkpoint['rng'])
    else:
        seed_dropout(cfg.seed, coords['dp'], coords['pp'])  # each replica and stage its own masks
    return zeros


def clip_weights(model, layout, tp, embed, stage):
    """How many times the gradient norm must count each parameter this rank holds: a parameter replicated on
    the tp ranks 1/tp times on each; the last stage's copy of a tied embedding not at all (the first stage
    counts it)."""
    here = {id(p) for p in model.parameters()}
    weights = {id(p): 1 / tp.group.size for p, kind in layout.values()
               if kind in ('replicated', 'shared') and id(p) in here}  # (a MoE's router: 'shared')
    if embed is not None and stage.is_last:
        weights[id(model.lm_head.weight)] = 0.0
    return weights


def train_step(stage, zeros, batches, cfg, tp, layout, embed, weights, lr):
    """train.py's iteration on the grid: the pipeline schedule over each micro-step's microbatches (tensor-,
    context- and expert-parallel inside every block), then the gradient syncs each dimension adds. The mean
    loss."""
    stage.loss_sum = torch.zeros((), device=cfg.device)
    stage.act_shape = (cfg.batch_size // cfg.n_microbatches,) + tuple(stage.act_shape[1:])  # (eval: batches)
    # the gradients add up over every microbatch; ZeRO-1 reduces them once, below
    zero = zeros[0]
    for z in zeros:
        z.last_micro_step = False
    for x, y in batches:
        run_schedule(stage, cfg.schedule, cfg.n_microbatches, x, y, 1.0 / (cfg.n_microbatches * len(batches)))
    sync_tp_grads(layout, tp)  # tp, sequence parallel: the replicated parameters saw only this rank's tokens
    if embed is not None:  # pp: the tied embedding's two copies, on the first and the last stage
        model = stage.model
        embed.all_reduce(model.transformer.wte.weight.grad if stage.is_first else model.lm_head.weight.grad)
    for z in zeros:  # dp x cp (ZeRO-1): every bucket reduce-scattered, each rank its chunk's average
        z.last_micro_step = True  # (the experts': over edp)
        z.finish_backward()
    if cfg.grad_clip != 0.0:  # the norm of the whole model: the squares summed over dp x cp, then tp and pp
        zero.clip_grad_norm(cfg.grad_clip, weights, [tp.group, stage.comm], also=zeros[1:])
    for z in zeros:
        z.step(lr)  # AdamW on this rank's chunk, then all-gather the updated weights
    balance_routers(stage.model, lambda loads: zero.comm.summed(loads, 'router loads'))  # (x cp: sign())
    loss_sum = stage.loss_sum.clone()  # the head's loss and MoE aux: summed over the stages, then dp x cp
    stage.comm.all_reduce(loss_sum, kind='scalars')
    zero.comm.all_reduce(loss_sum, kind='scalars')
    return loss_sum.item() / zero.comm.size


def grid_loss(stage, cp, m, x, y):
    """The mean loss over the whole batch: through the stages (m microbatches), then over the cp ranks."""
    loss = forward_loss(stage, x, y, m)
    cp.group.all_reduce(loss, kind='scalars')
    return loss / cp.group.size


def weights_dtype(cfg):
    """The parameters' dtype under ZeRO-1 (build_zeros), and so the stream between stages (build_stage)."""
    return torch.bfloat16 if cfg.dtype == 'bfloat16' else torch.float32


def weight_groups(grid, rank, ep_size, tied):
    """The groups parallel_4d.py adds to the grid's: the ranks holding the same weights (every dp and cp rank
    of a pp and tp coordinate: their gradients are averaged together, and ZeRO-1 shards the optimizer state
    over them), cut into ep groups and their edp groups (expert_groups: ep > 1, a mixture of experts); and the
    tied embedding's two stages (embed_comm)."""
    same_weights = along(grid, 'dp', 'cp')
    ep_groups, edp_groups = expert_groups(same_weights, ep_size)
    ep, edp = ((group_comm('ep', ep_groups, rank), group_comm('edp', edp_groups, rank)) if ep_size > 1
               else (None, None))  # (None: no experts to share out)
    return dict(dp_cp=group_comm('dp_cp', same_weights, rank), ep=ep, edp=edp,
                embed=embed_comm(grid, rank, tied))


def main(argv):
    cfg = configure(config, argv)
    # what the grid refuses, and why (one line, before any work): common/model_parallel.py
    dp_size = check_parallel_4d(cfg, world_size_from_env(), RANK_FILE, run_grid, SCHEDULES)
    rank, world_size = start_run(cfg)
    grid, coords, comms = process_grid(world_size, rank, dp=dp_size, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp)
    data, vocab_size = load_dataset(cfg.dataset)
    # train.py's GPT on the meta device: build_stage cuts it along the grid and materializes this rank's part
    ckpt_path = rank_path(cfg.out_dir, RANK_FILE, rank)
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path, gpt2=False, meta=True)
    comms.update(weight_groups(grid, rank, cfg.ep, model.config.tie_embeddings))  # (resumed: checkpoint's)
    flops = model.flops_per_token(cfg.block_size)  # of the whole model, before it is cut
    print_grid(grid, coords, comms, rank, out_dir=cfg.out_dir)
    if rank == 0:
        dp, pp, cp, tp = grid.shape
        ep = f" (ep {cfg.ep}: runs of the dp x cp ranks)" if cfg.ep > 1 else ""
        print(run_shape(f"world {world_size} = dp {dp} x pp {pp} x cp {cp} x tp {tp}{ep}", cfg,
                        model.get_num_params(), model.config.n_expert))
    stage, tp, cp, layout = build_stage(model, cfg, grid, coords, comms, checkpoint)
    zeros, embed = build_zeros(model, cfg, comms, coords, checkpoint), comms['embed']
    weights, writer = clip_weights(model, layout, tp, embed, stage), CheckpointWriter(cfg.max_iters)
    step = lambda it: train_step(stage, zeros, micro_batches(data, cfg, it, coords['dp'], dp_size), cfg, tp,
                                 layout, embed, weights, get_lr(it, cfg))
    save = lambda it, best: writer.save(rank_checkpoint(model, zeros, layout, tp, coords, cfg, world_size, it,
                                                        best), rank_path(cfg.out_dir, RANK_FILE, rank), it)
    run = SimpleNamespace(model=model, optimizer=None, step=step,
                          loss_of=partial(grid_loss, stage, cp, cfg.n_microbatches),
                          save=save, dp=comms['dp'], data=data, flops_per_token=flops, n_devices=world_size,
                          rank=rank, kind='parallel_4d', stage=stage, zeros=zeros, coords=coords,
                          comms=[comms[d] for d in ('dp_cp', 'pp', 'cp', 'tp', 'ep', 'edp', 'embed')
                                 if comms[d]])
    training_loop(cfg, run, iter_num, best_val_loss)
    writer.wait()
    if rank == 0:
        print(outputs_line(cfg.out_dir, "ckpt_4d_rank*.pt (each rank's part: resume on the same grid; python "
                                        f"consolidate.py {cfg.out_dir} makes one ckpt.pt)", *profiled(cfg)))
    finish_distributed(cfg)


# -----------------------------------------------------------------------------
# Checkpoints: every rank its own file, and where its pieces sit in the whole model (consolidate.py)


RANK_FILE = 'ckpt_4d_rank{}.pt'


def run_grid(cfg, world_size):
    """How this run cuts the model and its AdamW state: a checkpoint resumes only on the same."""
    return dict(pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep, virtual_stages=cfg.virtual_stages,
                ranks=world_size)


def rank_checkpoint(model, zeros, layout, tp, coords, cfg, world_size, iter_num, best_val_loss):
    """This rank's file: its part of the model, its ZeRO-1 chunks (and its experts') and random stream, where
    it sits on the grid; its pieces for consolidate.py: ZeRO-1's run of each tp slice (model_parallel.
    slice_places) of its stage's parameters (both stages' copies of a tied embedding: the same values)."""
    where = slice_places(model, layout, tp)
    cut = lambda name, p: where(p)
    replica = coords['dp'] if coords['pp'] == coords['cp'] == coords['tp'] == 0 else None  # (its stream)
    buffers = buffer_pieces(model) if coords['dp'] == coords['cp'] == coords['tp'] == 0 else []  # (a stage's)
    engines = dict(zip(ENGINES, zeros))
    return checkpoint_of({'model': model.state_dict(), 'coords': coords,
                          **{key: zero.state_dict() for key, zero in engines.items()}},
                         [p for key, zero in engines.items() for p in zero.pieces(cut, key)] + buffers,
                         (RANK_FILE, world_size), run_grid(cfg, world_size),
                         replica, vars(model.config), iter_num, best_val_loss, vars(cfg))


if __name__ == '__main__':
    run_main(main)
