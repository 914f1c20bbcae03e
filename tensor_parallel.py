"""
train.py plus tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and, optionally, sequence parallelism
(Korthikanti et al. 2022), by hand. The tp ranks split every layer: attention by heads, the MLP column then
row, the vocabulary (embedding, head, loss). Each block runs 2 all-reduces forward and 2 backward; with
--sequence_parallel=True an all-gather + a reduce-scatter each, the norms and dropouts on 1/tp of the
sequence. A mixture of experts spreads its whole experts over the tp ranks instead (spread_experts says
why). Each rank keeps its slice of train.py's seeded GPT: train.py's loss curve.

    torchrun --nproc_per_node=2 tensor_parallel.py --tp=2
    torchrun --nproc_per_node=4 tensor_parallel.py --tp=4 --sequence_parallel=True
    torchrun --nproc_per_node=4 tensor_parallel.py --tp=2 --gradient_accumulation_steps=2   # dp=2 x tp=2
    torchrun --nproc_per_node=2 tensor_parallel.py --tp=2 --n_expert=4 --n_expert_active=2   # MoE
    torchrun --nproc_per_node=2 tensor_parallel.py --tp=2 --init_from=resume        # same tp and world size
    python consolidate.py out-tp   # the rank checkpoints in out-tp/ -> out-tp/ckpt.pt, train.py's format
"""

import contextlib
import functools
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

from common.checkpoints import (CheckpointWriter, checkpoint_of, init_model, init_values, materialize,
                                rank_path, seed_dropout, set_rng_state)
from common.distributed import clip_grad_norm, finish_distributed, world_size_from_env
from common.config import config_defaults, configure
from common.data import load_dataset, micro_batches
from common.training import (autocast_context, outputs_line, profiled, run_main, run_shape, start_run,
                             training_loop)
from common.model_parallel import (all_gather_seq, average_gradients, check_tensor_parallel, configure_adamw,
                                   held_pieces, keep_slices, print_grid, process_grid, qkv_split,
                                   reduce_scatter_seq, slice_places, take_slice)
from model import MoE, balance_routers, moe_loss

# -----------------------------------------------------------------------------
# config: train.py's keys (common/config.py's TRAIN_DEFAULTS; `--help` lists them all), and these
out_dir = 'out-tp'              # each script its own folder: runs never overwrite one another
init_from = 'scratch'           # 'scratch', 'resume' (out_dir/ckpt_rank<r>.pt) or a GPT-2 name: 'gpt2', ...
dist_timeout = 60               # seconds a rank waits for the others before failing
tp = 1                          # tensor-parallel degree; world size = dp * tp
sequence_parallel = False       # shard norms and dropout along the sequence (all-gather + reduce-scatter)
measure_every = 0               # measure and report every this many steps too; 0: the first step only
config = config_defaults(globals())


# -----------------------------------------------------------------------------
# Megatron's communication operators, one autograd.Function each: each one's backward is its forward's dual
# (sequence parallelism's all-gather and reduce-scatter along the sequence: common/model_parallel.py)

class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward. It enters the tensor-parallel region: each rank
    feeds x to its slice of a column-parallel layer, so its dL/dx covers its outputs only; the full dL/dx is
    the sum."""
    @staticmethod
    def forward(ctx, x, tp_group):
        ctx.tp_group = tp_group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.tp_group.all_reduce(grad)  # in place, through the Comm (which counts the bytes)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward. It leaves the tensor-parallel region: the
    row-parallel layer's partial sums add up to the full output, whose gradient every rank has whole."""
    @staticmethod
    def forward(ctx, x, tp_group):
        x = x.clone(memory_format=torch.contiguous_format)
        tp_group.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSequence(torch.autograd.Function):
    """Sequence parallelism's g: all-gather along the sequence forward, reduce-scatter backward. Replaces f:
    the norm ran on this rank's chunk of the sequence, the column-parallel layer needs all of it."""
    @staticmethod
    def forward(ctx, x, tp_group):
        ctx.tp_group = tp_group
        return all_gather_seq(x, tp_group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.tp_group), None


class ScatterToSequence(torch.autograd.Function):
    """Sequence parallelism's g-bar: reduce-scatter along the sequence forward, all-gather backward. Replaces
    g: each rank keeps only its chunk of the summed output, for the dropout, residual and norm that follow."""
    @staticmethod
    def forward(ctx, x, tp_group):
        ctx.tp_group = tp_group
        return reduce_scatter_seq(x, tp_group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.tp_group), None


class TensorParallel:
    """This rank's tp group (a Comm), and the way into and out of the tensor-parallel region: f and g, or
    with sequence parallelism the all-gather and the reduce-scatter."""
    def __init__(self, group, sequence_parallel=False):
        self.group, self.sequence_parallel = group, sequence_parallel

    def enter(self, x):
        op = GatherFromSequence if self.sequence_parallel else CopyToTP
        return x if self.group.size == 1 else op.apply(x, self.group)

    def leave(self, x):
        op = ScatterToSequence if self.sequence_parallel else ReduceFromTP
        return x if self.group.size == 1 else op.apply(x, self.group)


# -----------------------------------------------------------------------------
# Dropout the Megatron way. Where the activations are replicated on the tp ranks (the residual stream without
# sequence parallelism) every rank must draw the same mask, or the replicas drift apart: they share the
# process's stream, seeded alike on the ranks of one data-parallel replica. Where each rank holds different
# activations (its attention heads; with sequence parallelism, its chunk of the sequence) each draws its own.

@contextlib.contextmanager
def tp_rank_rng(tp_rank):
    """Draw inside under this tp rank's own stream (Megatron's model-parallel RNG tracker), seeded by a draw
    from the shared stream (so activation checkpointing's recompute replays it) plus the rank."""
    seed = int(torch.randint(0, 2 ** 62, ()).item())
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + tp_rank)
        yield


class TPRankDropout(nn.Module):
    """A dropout on activations that differ per tp rank (with sequence parallelism: this rank's tokens)."""
    def __init__(self, dropout, tp_rank):
        super().__init__()
        self.dropout, self.tp_rank = dropout, tp_rank

    def forward(self, x):
        if not self.training or self.dropout.p == 0:  # (no draw from the shared stream either)
            return x
        with tp_rank_rng(self.tp_rank):
            return self.dropout(x)


def heads_draw_their_own_dropout(attn, tp_rank):
    """The attention probabilities' dropout drawn from this rank's own stream (its heads are its own); the
    dropout after c_proj (attn.out_dropout) from the stream of the activations it drops, after it, in
    model.py's order."""
    attn.out_dropout, attn.resid_dropout, forward = attn.resid_dropout, nn.Identity(), attn.forward

    def run(x):
        if not attn.training:  # (no draw: model.py's attention draws nothing in eval either)
            return attn.out_dropout(forward(x))
        with tp_rank_rng(tp_rank):
            y = forward(x)
        return attn.out_dropout(y)
    attn.forward = run


def give_tp_ranks_their_dropout(model, tp):
    """Each rank's heads get their own dropout stream, and a MoE's experts on it (each rank its own experts);
    with sequence parallelism, its sequence chunks too."""
    if tp.group.size == 1 or model.config.dropout == 0:
        return
    for block in model.transformer.h:
        moe = block.mlp if isinstance(block.mlp, MoE) else None
        for expert in [e for e in moe.experts if e is not None] if moe else []:
            expert.dropout = TPRankDropout(expert.dropout, tp.group.rank)
        mlp = moe.shared_expert if moe else block.mlp  # (the dense MLP's output: replicated, or SP's chunk)
        if tp.sequence_parallel:
            block.attn.resid_dropout = TPRankDropout(block.attn.resid_dropout, tp.group.rank)
            if mlp is not None:
                mlp.dropout = TPRankDropout(mlp.dropout, tp.group.rank)
        heads_draw_their_own_dropout(block.attn, tp.group.rank)
    if tp.sequence_parallel:
        model.transformer.drop = TPRankDropout(model.transformer.drop, tp.group.rank)


# -----------------------------------------------------------------------------
# The parallel layers. Each holds this rank's slice of the dense layer's weights.

class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r^T + b_r: this rank's output features, from X whole on every rank (put there once, after the
    norm before it, by NormThenEnter: the MLP's c_fc and c_gate share one f)."""
    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight, bias  # Parameters: this rank's slices

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r A_r^T + b: this rank's input features give a partial sum; g (or the sequence
    reduce-scatter) adds them up, then the replicated bias (the dense layer's own) is added once."""
    def __init__(self, weight, bias, tp):
        super().__init__()
        self.weight, self.bias, self.tp = weight, bias, tp

    def forward(self, x):
        y = self.tp.leave(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class NormThenEnter(nn.Module):
    """The block's norm, then f (with sequence parallelism: the norm on this rank's chunk, the all-gather)."""
    def __init__(self, norm, tp):
        super().__init__()
        self.norm, self.tp = norm, tp

    def forward(self, x):
        return self.tp.enter(self.norm(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + n) of the token embedding: tokens outside it look up zeros, and g (or
    the reduce-scatter to sequence chunks) sums the ranks' lookups into the full embedding."""
    def __init__(self, weight, start, tp):
        super().__init__()
        self.weight, self.start, self.tp = weight, start, tp

    def forward(self, idx):
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.size(0))
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.leave(x.masked_fill(outside[..., None], 0.0))


def vocab_parallel_cross_entropy(logits, targets, vocab_start, tp):
    """Mean cross-entropy from this rank's vocabulary slice of the logits (B, T, V/t), never gathering them: 3
    all-reduces of one number per token (max, sum of exponentials, target's logit). Targets -1 are ignored."""
    logits, targets = logits.float().flatten(0, 1), targets.flatten()
    top = logits.max(dim=-1).values.detach()  # for stability only
    tp.group.all_reduce(top, op=dist.ReduceOp.MAX)
    shifted = logits - top[:, None]
    sum_exp = shifted.exp().sum(dim=-1)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.size(-1))
    target_logit = shifted.gather(1, local.clamp(0, logits.size(-1) - 1)[:, None]).squeeze(1) * mine
    # g: all-reduce forward, identity backward: each slice's gradient is p - one_hot
    sum_exp, target_logit = ReduceFromTP.apply(sum_exp, tp.group), ReduceFromTP.apply(target_logit, tp.group)
    valid = targets != -1
    return ((sum_exp.log() - target_logit) * valid).sum() / valid.sum()


def shard_gpt(model, tp):
    """Turn the full GPT into this rank's part, in place: model.py's blocks, their Linear layers replaced by
    parallel ones holding this rank's slice. Returns {dense parameter name: (this rank's parameter, kind)}."""
    cfg, tp_group, dense_named = model.config, tp.group, list(model.named_parameters())
    names, layout = {id(p): n for n, p in dense_named}, {}

    def cut(dense, kind, qkv_sizes=None):  # this rank's slice of a dense parameter, noted in the layout
        if dense is None:
            return None
        local = nn.Parameter(take_slice(dense.detach(), kind, tp_group, qkv_sizes).clone())
        layout[names[id(dense)]] = (local, kind)
        return local

    def column(linear, kind='col', qkv_sizes=None):
        return ColumnParallelLinear(cut(linear.weight, kind, qkv_sizes), cut(linear.bias, kind, qkv_sizes))

    def parallel_mlp(mlp):  # the MLP column then row: its hidden units cut
        mlp.c_fc = column(mlp.c_fc)
        if mlp.swiglu:
            mlp.c_gate = column(mlp.c_gate)
        mlp.c_proj = RowParallelLinear(cut(mlp.c_proj.weight, 'row'), mlp.c_proj.bias, tp)

    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        attn.c_attn = column(attn.c_attn, 'qkv', qkv_split(cfg))
        attn.c_proj = RowParallelLinear(cut(attn.c_proj.weight, 'row'), attn.c_proj.bias, tp)
        attn.n_head, attn.n_kv_head = cfg.n_head // tp_group.size, cfg.n_kv_head // tp_group.size  # its heads
        if isinstance(mlp, MoE):
            spread_experts(mlp, tp, lambda p, kind: layout.__setitem__(names[id(p)], (p, kind)))
            if mlp.shared_expert is not None:
                parallel_mlp(mlp.shared_expert)
        else:
            parallel_mlp(mlp)
        block.ln_1, block.ln_2 = NormThenEnter(block.ln_1, tp), NormThenEnter(block.ln_2, tp)
    model.transformer.ln_f = NormThenEnter(model.transformer.ln_f, tp)
    sizes = [len(part) for part in torch.tensor_split(torch.arange(cfg.vocab_size), tp_group.size)]
    start, wte = sum(sizes[:tp_group.rank]), cut(model.transformer.wte.weight, 'col')
    model.transformer.wte = VocabParallelEmbedding(wte, start, tp)
    # tied: the head is the same vocabulary slice of the same tensor
    model.lm_head = ColumnParallelLinear(wte, None) if cfg.tie_embeddings else column(model.lm_head)
    model.lm_head.vocab_start = start
    held = {id(p) for p in model.parameters()}
    for name, p in dense_named:  # what is left (norms, row-parallel biases, wpe) is the dense model's own
        if id(p) in held:
            layout.setdefault(name, (p, 'replicated'))
    model.forward = forward_needs_tp_forward  # GPT.forward would compute a loss over one vocabulary slice
    return layout


def spread_experts(moe, tp, note):
    """A mixture of experts under tensor parallelism: its experts spread over the tp ranks, n_expert/tp whole
    experts on each (note(p, kind): into the layout). Megatron-Core's expert tensor parallelism cuts every
    expert instead. Why whole: today's experts are narrow already (fine-grained, DeepSeek-V3's 2048 wide for a
    7168 residual), and cutting each by tp again leaves tiny matmuls; whole experts cost the one reduction a
    dense MLP makes, and as the tokens are on every tp rank already (f, or sequence parallelism's all-gather,
    ran before the layer) no all-to-all is needed. The price: a rank's work follows the router's load on its
    experts. Every rank routes every token alike (the router is whole on each: 'shared', its gradient the
    same everywhere), runs its experts on their slots, and the partial sums meet in that reduction
    (tp_moe_forward). parallel_4d.py's expert parallelism cuts the experts first: the tp ranks spread what
    their ep rank holds."""
    n, r = tp.group.size, tp.group.rank
    run = sum(expert is not None for expert in moe.experts)  # n_expert (or n_expert/ep: a run, held here)
    here = [(e % run) * n // run == r for e in range(moe.n_expert)]  # (a run of run/tp experts per tp rank)
    for e, expert in enumerate(moe.experts):
        if expert is not None and not here[e]:
            moe.experts[e] = None
        for p in moe.experts[e].parameters() if moe.experts[e] is not None else []:
            note(p, 'expert')
    moe.on_this_tp_rank = torch.tensor(here + [False])  # (any ep rank's; False: the dropped slots' index)
    note(moe.router.weight, 'shared')
    moe.forward = functools.partial(tp_moe_forward, moe, tp)


def tp_moe_forward(moe, tp, x):
    """MoE.forward on every token, its experts spread over the tp ranks: this rank's experts' outputs on their
    slots (the others' add zeros), summed by the router's weights, reduced over tp (g, or the reduce-scatter).
    A rank's weights meet only its experts' outputs, so their gradient is summed over tp (f) before reaching
    the router: the router's gradients are then whole and alike on every rank, and so is what it sends back
    to x, which f (or the all-gather) before the layer sums over the ranks: each sends 1/tp of it
    (take_a_share). A shared expert is cut as the dense MLP, and reduces on its own."""
    flat = x.reshape(-1, x.size(-1))
    index, weights = moe.route(take_a_share(flat, tp.group.size))
    # the slots of the other tp ranks' experts go nowhere here (as the dropped ones: index n_expert)
    index = index.masked_fill(~moe.on_this_tp_rank.to(index.device)[index], moe.n_expert)
    weights = CopyToTP.apply(weights, tp.group) if tp.group.size > 1 else weights
    y = tp.leave(moe.experts_forward(flat, index, weights).view_as(x))
    return y if moe.shared_expert is None else y + moe.shared_expert(x)


def take_a_share(x, n):
    """x forward; 1/n of its gradient backward (a hook on a view): for a gradient that each of n ranks
    computes whole on its way into a sum over them."""
    x = x.view_as(x)
    if x.requires_grad and n > 1:
        x.register_hook(lambda grad: grad / n)
    return x


def forward_needs_tp_forward(*args, **kwargs):
    raise RuntimeError("this GPT is one tensor-parallel rank's slice: run it with tensor_parallel.tp_forward "
                       "(its loss is vocabulary-parallel); to sample, python consolidate.py OUT_DIR first")


def tp_embed(model, idx, tp, positions=None):
    """The vocabulary-parallel embedding (summed over the tp ranks; with sequence parallelism, this rank's
    chunk of the sequence) plus the learned positions of the tokens it holds (or context parallelism's)."""
    x = model.transformer.wte(idx)
    if model.transformer.wpe is not None:
        if positions is None:
            first = tp.group.rank * x.size(1) if tp.sequence_parallel and tp.group.size > 1 else 0
            positions = torch.arange(first, first + x.size(1), dtype=torch.long, device=idx.device)
        x = x + model.transformer.wpe(positions)
    return model.transformer.drop(x)


def tp_head(model, x, targets, tp):
    """The final norm, the vocabulary-parallel head and loss: (this rank's slice of the logits, loss)."""
    logits = model.lm_head(model.transformer.ln_f(x))
    if targets is None:
        return logits, None
    return logits, vocab_parallel_cross_entropy(logits, targets, model.lm_head.vocab_start, tp)


def tp_forward(model, idx, targets, tp):
    """GPT.forward with the vocabulary-parallel embedding, head and loss: (this rank's logits slice, loss).
    A mixture of experts adds its auxiliary loss, the same on every tp rank (each routes every token)."""
    x = tp_embed(model, idx, tp)
    for block in model.transformer.h:
        x = model.run_block(block, x)
    logits, loss = tp_head(model, x, targets, tp)
    if model.moe_layers() and loss is not None:
        loss = loss + moe_loss(model.moe_layers(), model.config)[0]
    return logits, loss


def sync_tp_grads(layout, tp):
    """SP only: a replicated parameter (norm, row bias, positions) saw 1/tp of the sequence: sum over tp."""
    if tp.sequence_parallel:
        average_gradients([p for p, kind in layout.values() if kind == 'replicated'], tp.group, divisor=1,
                          kind='grad_all_reduce')


def clip_grads(layout, tp, max_norm):
    """clip_grad_norm_ over the whole model: summed over tp, each rank's slices (and experts) + 1/tp of what
    every rank holds (the replicated, a MoE's shared router)."""
    counted = [(p.grad, 1 / tp.group.size if kind in ('replicated', 'shared') else 1.0)
               for p, kind in layout.values() if p.grad is not None]
    return clip_grad_norm([g for g, _ in counted], max_norm, [tp.group], counted)


def train_step(model, optimizer, batches, ctx, grad_clip, tp, dp, layout):
    """train.py's iteration with the tensor-parallel forward, then the syncs it adds: the replicated
    parameters' gradients over tp (SP), all over dp, the clip over the whole model. Returns the mean loss."""
    loss_sum = 0.0
    for x, y in batches:
        with ctx:
            loss = tp_forward(model, x, y, tp)[1] / len(batches)  # the gradient: the mean over the batch
        loss_sum += loss.detach()
        loss.backward()
    sync_tp_grads(layout, tp)
    average_gradients([p for p, _ in layout.values()], dp)  # data parallelism over the replicas
    if grad_clip != 0.0:
        clip_grads(layout, tp, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    balance_routers(model, lambda loads: dp.summed(loads, 'router loads'))  # (dp's: tp's are the same)
    dp.all_reduce(loss_sum, kind='scalars')
    return loss_sum.item() / dp.size


def build_sharded(cfg, vocab_size, tp, dp_rank, world_size, rank):
    """train.py's GPT on meta, this rank's slices alone given storage and values; its AdamW."""
    ckpt_path = rank_path(cfg.out_dir, RANK_FILE, rank)
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path, meta=True)
    if rank == 0:
        print(run_shape(f"world {world_size} = dp {world_size // cfg.tp} x tp {cfg.tp}"
                        + ' with sequence parallelism' * cfg.sequence_parallel, cfg, model.get_num_params()))
    flops_per_token = model.flops_per_token(cfg.block_size)  # the whole model's, at the run's sequence length
    layout = shard_gpt(model, tp)  # on the meta device: this rank's slices, shapes only
    give_tp_ranks_their_dropout(model, tp)
    materialize(model, cfg.device)  # storage for the slices; their values come below
    optimizer = configure_adamw(model, cfg, checkpoint)  # (its saved state when resuming)
    if checkpoint is not None:  # (check_tensor_parallel has checked its grid)
        model.load_state_dict(checkpoint['model'])
        set_rng_state(checkpoint['rng'])  # this rank's own streams
    else:  # train.py's (or GPT-2's) values, one dense tensor at a time, of which this rank keeps its slice
        init_values(cfg, model.config, keep_slices(layout, tp, model.config))
        seed_dropout(cfg.seed, dp_rank)  # the tp ranks of a replica share the stream; each replica its own
    return model, layout, optimizer, iter_num, best_val_loss, flops_per_token


# -----------------------------------------------------------------------------
# The checkpoint: each rank saves its own slices (out_dir/ckpt_rank<r>.pt) and where they sit in the dense
# model, which consolidate.py reads to lay them in place

RANK_FILE = 'ckpt_rank{}.pt'


def rank_checkpoint(model, layout, optimizer, tp, dp_rank, cfg, world_size, iter_num, best_val_loss):
    """This rank's slices, AdamW state and streams; the pieces of data-parallel replica 0's ranks (the others
    hold the same): each dense parameter's boxes (slice_places)."""
    where = slice_places(model, layout, tp)
    cut = lambda name, p: None if dp_rank else where(p)
    return checkpoint_of(dict(model=model.state_dict(), optimizer=optimizer.state_dict()),
                         held_pieces(model, optimizer, cut, dp_rank == tp.group.rank == 0),
                         (RANK_FILE, world_size),
                         {'tp': cfg.tp, 'ranks': world_size}, None if tp.group.rank else dp_rank,
                         vars(model.config), iter_num, best_val_loss, vars(cfg))


def main(argv):
    cfg = configure(config, argv)
    check_tensor_parallel(cfg, world_size_from_env(), RANK_FILE)  # its refusals: common/model_parallel.py
    rank, world_size = start_run(cfg)
    grid, coords, comms = process_grid(world_size, rank, dp=world_size // cfg.tp, tp=cfg.tp)
    tp, dp = TensorParallel(comms['tp'], cfg.sequence_parallel), comms['dp']
    print_grid(grid, coords, {'dp': dp, 'tp': tp.group}, rank, dims=('dp', 'tp'))
    ctx = autocast_context('cuda' if cfg.device.startswith('cuda') else 'cpu', cfg.dtype)
    data, vocab_size = load_dataset(cfg.dataset)
    model, layout, optimizer, iter_num, best_val_loss, flops = build_sharded(cfg, vocab_size, tp, dp.rank,
                                                                             world_size, rank)
    writer = CheckpointWriter(cfg.max_iters)  # each rank writes its own checkpoint in the background

    def loss_of(x, y):
        with ctx:
            return tp_forward(model, x, y, tp)[1]

    def save(it, best):
        writer.save(rank_checkpoint(model, layout, optimizer, tp, dp.rank, cfg, world_size, it, best),
                    rank_path(cfg.out_dir, RANK_FILE, rank), it)
    step = lambda it: train_step(model, optimizer, micro_batches(data, cfg, it, dp.rank, dp.size), ctx,
                                 cfg.grad_clip, tp, dp, layout)
    training_loop(cfg, SimpleNamespace(model=model, optimizer=optimizer, loss_of=loss_of, dp=dp, data=data,
                                       step=step, save=save, flops_per_token=flops, n_devices=world_size,
                                       rank=rank, kind='tensor_parallel', tp=tp, comms=[tp.group, dp]),
                  iter_num, best_val_loss)
    writer.wait()
    if rank == 0:
        print(outputs_line(cfg.out_dir, f"ckpt_rank*.pt (each rank's slices: resume; python consolidate.py "
                                        f"{cfg.out_dir} makes one ckpt.pt, for sample.py)", *profiled(cfg)))
    finish_distributed(cfg)


if __name__ == '__main__':
    run_main(main)
