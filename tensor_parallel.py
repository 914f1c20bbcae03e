"""
train.py plus tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and, optionally, sequence parallelism
(Korthikanti et al. 2022), written by hand with torch.distributed. The tp ranks of a group split every layer:
attention by heads (and KV heads), the MLP column then row, the vocabulary of the embedding, the head and the
loss. Each transformer block then runs 2 all-reduces forward and 2 backward; with --sequence_parallel=True each
becomes an all-gather + a reduce-scatter and the norms work on 1/tp of the sequence each.

    torchrun --nproc_per_node=2 tensor_parallel.py --tp=2
    torchrun --nproc_per_node=4 tensor_parallel.py --tp=4 --sequence_parallel=True
    torchrun --nproc_per_node=4 tensor_parallel.py --tp=2 --gradient_accumulation_steps=2   # dp=2 x tp=2
    torchrun --nproc_per_node=2 tensor_parallel.py --tp=2 --consolidate=out_full  # + one train.py checkpoint
    torchrun --nproc_per_node=2 tensor_parallel.py --tp=2 --init_from=resume        # same tp and world size

Every rank builds the full GPT from the seed exactly as train.py does and keeps its slice, so for the same
config and seed the loss curve is train.py's. Each rank prints (and logs, one row per rank) what it measured
beside the formula: parameter bytes, activation bytes saved for backward by one layer, bytes sent per step.
(The comm formula counts every activation at bytes_per_elem; under bfloat16 autocast the residual stream and
the norms stay fp32, so the measured bytes are higher there.)
"""

import contextlib
import functools
import json
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

from model import (GPT, TRAIN_STREAM, CheckpointWriter, Comm, GPTConfig, StepProfiler, WireMeter, autocast_context,
                   comm_report, config_defaults, configure, estimate_loss, get_batch, get_lr, init_distributed,
                   load_dataset, log_row, mfu, micro_batch_rows, model_config, outputs_line, param_groups,
                   peak_flops_for, peak_memory_bytes, profiled, progress, rng_state, run_main, run_shape,
                   save_checkpoint, saved_bytes_counter, seed_dropout, set_rng_state, trim_log, world_size_from_env)

# -----------------------------------------------------------------------------
# config: the defaults train a small character-level GPT on a laptop CPU in about 3 minutes
out_dir = 'out'
eval_interval = 250
log_interval = 25
eval_iters = 20
eval_only = False
always_save_checkpoint = True   # save at every eval, not only when val loss improves
init_from = 'scratch'           # 'scratch', 'resume' (out_dir/ckpt_rank<r>.pt) or a GPT-2 name: 'gpt2', ...
sample_at_end = True            # print a short sample when training ends
# data
dataset = 'stdlib_char'
gradient_accumulation_steps = 2  # micro-steps per iteration, summed over all data-parallel ranks
batch_size = 8                   # sequences per micro-step per data-parallel rank
block_size = 128
# model (every GPTConfig field is a config key: norm, mlp, pos, n_kv_head, tie_embeddings, ...)
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
# AdamW
learning_rate = 2e-3
max_iters = 1250                # ~0.12 s per iteration on an idle 2-core CPU: under 3 minutes
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0                 # clip the global gradient norm to this; 0.0 turns clipping off
# learning rate schedule
decay_lr = True
warmup_iters = 50
lr_decay_iters = 1250           # usually equal to max_iters
min_lr = 2e-4
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float32'
compile = False
seed = 1337
peak_flops = None               # the device's peak FLOP/s for MFU; None: looked up by GPU name (unknown on CPU)
profile = 0                     # trace this many steps with torch.profiler: out_dir/trace_rank{r}.json
# tensor parallelism
dist_timeout = 60               # seconds a rank waits for the others before failing
tp = 1                          # tensor-parallel degree; world size = dp * tp
sequence_parallel = False       # shard norms and dropout along the sequence (all-gather + reduce-scatter)
consolidate = ''                # a directory: merge its rank checkpoints into one train.py-format ckpt.pt, then exit
config = config_defaults(globals())
# -----------------------------------------------------------------------------


# The formulas printed beside the measurements (bench.py --estimate imports them too).

def activation_bytes_formula(s, b, h, a, t, sequence_parallel, recompute=False, bytes_per_elem=2):
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, table 2; their
    numbers are for 16-bit activations, scaled here by bytes_per_elem / 2). recompute: full activation
    checkpointing, only the layer input is kept (sharded along the sequence under sequence parallelism)."""
    scale = bytes_per_elem / 2
    if recompute:
        return 2 * s * b * h * scale / (t if sequence_parallel else 1)
    if sequence_parallel:
        return s * b * h * (34 + 5 * a * s / h) / t * scale
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * scale


def tp_comm_bytes_formula(s, b, h, t, sequence_parallel=False, bytes_per_elem=2):
    """Bytes one rank sends per transformer layer per micro-batch (forward + backward), ring algorithms:
    4 all-reduces of the b*s*h activations, each 2(t-1)/t of it. Sequence parallelism turns each into an
    all-gather + reduce-scatter of (t-1)/t each: the same total."""
    return 4 * 2 * (t - 1) / t * s * b * h * bytes_per_elem


def tp_edge_comm_bytes_formula(s, b, h, t, sequence_parallel=False, bytes_per_elem=2):
    """The rest of a micro-batch: the vocabulary-parallel embedding (1 all-reduce forward) and head (1 backward)
    of b*s*h each, and the vocabulary-parallel cross-entropy's 3 all-reduces of b*s fp32 numbers (max, sum of
    exponentials, target logit)."""
    return 2 * 2 * (t - 1) / t * s * b * h * bytes_per_elem + 3 * 2 * (t - 1) / t * s * b * 4


def param_bytes_formula(config, t, bytes_per_elem=4):
    """Parameter bytes on one tp rank: 1/t of the split layers (q/k/v, attention output, MLP, embedding, head)
    plus every replicated one (norms, the row-parallel biases, learned positions)."""
    h, L, hd, bias = config.n_embd, config.n_layer, config.n_embd // config.n_head, int(config.bias)
    qkv = (config.n_head + 2 * config.n_kv_head) * hd
    n_mlp_in = 2 if config.mlp == 'swiglu' else 1
    split_per_layer = qkv * (h + bias) + config.n_head * hd * h + config.n_hidden * (n_mlp_in * (h + bias) + h)
    split = L * split_per_layer + config.vocab_size * h * (1 if config.tie_embeddings else 2)
    norm = h * (1 + (bias if config.norm == 'layernorm' else 0))
    replicated = L * (2 * norm + 2 * h * bias) + norm + (config.block_size * h if config.pos == 'learned' else 0)
    return (split / t + replicated) * bytes_per_elem


# -----------------------------------------------------------------------------
# Collectives, each counting at the call the bytes this rank sends (ring algorithms).

def all_reduce(x, comm, kind='all_reduce', op=dist.ReduceOp.SUM):
    """x summed (or op) over comm's group, in place, counted by comm under kind; returns x."""
    comm.all_reduce(x, op=op, kind=kind)
    return x


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


# -----------------------------------------------------------------------------
# Megatron's communication operators, one autograd.Function each.

class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward. It enters the tensor-parallel region: every rank
    feeds the same x to its slice of a column-parallel layer, so each rank's dL/dx covers only its slice of
    the outputs, and the full gradient is their sum."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.g), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward. It leaves the tensor-parallel region: the
    row-parallel layer's partial sums (one per rank) add up to the full output, whose gradient every rank
    already has whole."""

    @staticmethod
    def forward(ctx, x, g):
        return all_reduce(x.clone(memory_format=torch.contiguous_format), g)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSequence(torch.autograd.Function):
    """Sequence parallelism's g: all-gather along the sequence forward, reduce-scatter backward. Replaces f: the
    norm ran on this rank's chunk of the sequence, the column-parallel layer needs all of it."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return all_gather_seq(x, g)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.g), None


class ScatterToSequence(torch.autograd.Function):
    """Sequence parallelism's g-bar: reduce-scatter along the sequence forward, all-gather backward. Replaces g:
    each rank keeps only its chunk of the summed output, for the dropout, residual and norm that follow."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return reduce_scatter_seq(x, g)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.g), None


@dataclass
class TensorParallel:
    """This rank's tensor-parallel group (a Comm) and mode."""
    g: Comm
    sequence_parallel: bool = False


def enter_tp_region(x, par):
    if par.g.size == 1:
        return x
    return GatherFromSequence.apply(x, par.g) if par.sequence_parallel else CopyToTP.apply(x, par.g)


def leave_tp_region(x, par):
    if par.g.size == 1:
        return x
    return ScatterToSequence.apply(x, par.g) if par.sequence_parallel else ReduceFromTP.apply(x, par.g)


# -----------------------------------------------------------------------------
# Dropout the Megatron way. Where the activations are replicated on the tp ranks (the residual stream without
# sequence parallelism) every rank must draw the same mask, or the replicas drift apart: they share the process's
# stream, seeded alike on the ranks of one data-parallel replica. Where each rank holds different activations
# (its attention heads; with sequence parallelism, its chunk of the sequence) each must draw its own.


@contextlib.contextmanager
def tp_rank_rng(tp_rank):
    """Draw inside under this tp rank's own stream (Megatron's model-parallel RNG tracker, without a tracker):
    its seed is drawn from the shared stream, so it is replayed exactly when activation checkpointing recomputes
    the block, and it differs per rank. The shared stream moves on by that one draw on every rank alike."""
    seed = int(torch.randint(0, 2 ** 62, ()).item())
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + tp_rank)
        yield


class TPRankDropout(nn.Module):
    """A dropout on activations that differ per tp rank (with sequence parallelism: this rank's tokens)."""

    def __init__(self, dropout, tp_rank):
        super().__init__()
        self.dropout, self.tp_rank = dropout, tp_rank

    def forward(self, x):
        if not self.training or self.dropout.p == 0:
            return x
        with tp_rank_rng(self.tp_rank):
            return self.dropout(x)


def give_tp_ranks_their_dropout(model, par):
    """Each rank's heads get their own attention-dropout stream; with sequence parallelism, also the dropouts on
    the sequence chunks (embedding, and after each block's two row-parallel layers)."""
    if par.g.size == 1 or model.config.dropout == 0:
        return
    for block in model.transformer.h:
        block.attn.dropout_rng = functools.partial(tp_rank_rng, par.g.rank)
        if par.sequence_parallel:
            block.attn.resid_dropout = TPRankDropout(block.attn.resid_dropout, par.g.rank)
            block.mlp.dropout = TPRankDropout(block.mlp.dropout, par.g.rank)
    if par.sequence_parallel:
        model.transformer.drop = TPRankDropout(model.transformer.drop, par.g.rank)


# -----------------------------------------------------------------------------
# The parallel layers. Each holds this rank's slice of the dense layer's weights.

def take_slice(full, kind, g, qkv_sizes=None):
    """This rank's part of a dense tensor. 'col': rows (output features), 'row': columns (input features),
    'qkv': the rows of this rank's heads in each of q, k and v, 'replicated': all of it."""
    if kind == 'col':
        return torch.tensor_split(full, g.size, dim=0)[g.rank]
    if kind == 'row':
        return torch.tensor_split(full, g.size, dim=1)[g.rank]
    if kind == 'qkv':
        return torch.cat([torch.tensor_split(part, g.size, dim=0)[g.rank] for part in full.split(qkv_sizes)])
    return full


def join_slices(slices, kind, qkv_sizes=None):
    """The dense tensor from every rank's part (rank order): the inverse of take_slice."""
    if kind == 'col':
        return torch.cat(slices, dim=0)
    if kind == 'row':
        return torch.cat(slices, dim=1)
    if kind == 'qkv':
        local = [s // len(slices) for s in qkv_sizes]
        parts = [s.split(local) for s in slices]
        return torch.cat([parts[r][i] for i in range(3) for r in range(len(slices))])
    return slices[0]


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r^T + b_r: this rank's output features. Its input X must be whole on every rank: the f (or
    sequence all-gather) that puts it there sits once after the norm before it (NormThenEnter), so that the
    MLP's c_fc and c_gate share one."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r A_r^T + b: this rank's input features give a partial sum; g (or the sequence
    reduce-scatter) adds them up, then the replicated bias is added once."""

    def __init__(self, weight, bias, par):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = bias  # the dense layer's own Parameter: replicated
        self.par = par

    def forward(self, x):
        y = leave_tp_region(F.linear(x, self.weight), self.par)
        return y if self.bias is None else y + self.bias


class NormThenEnter(nn.Module):
    """The block's norm, then the entry into the tensor-parallel region: f in plain TP, the sequence all-gather
    with sequence parallelism (where the norm ran on this rank's chunk of the sequence)."""

    def __init__(self, norm, par):
        super().__init__()
        self.norm, self.par = norm, par

    def forward(self, x):
        return enter_tp_region(self.norm(x), self.par)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + n) of the token embedding: tokens outside it look up zeros, and g (or the
    reduce-scatter to sequence chunks) sums the ranks' lookups into the full embedding."""

    def __init__(self, weight, start, par):
        super().__init__()
        self.weight, self.start, self.par = weight, start, par

    def forward(self, idx):
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.size(0))
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return leave_tp_region(x.masked_fill(outside[..., None], 0.0), self.par)


def vocab_parallel_cross_entropy(logits, targets, vocab_start, par):
    """Mean cross-entropy from this rank's vocabulary slice of the logits (B, T, V/t), never gathering them:
    3 all-reduces of one number per token (the max, the sum of exponentials, the target's logit).
    Targets -1 are ignored, as F.cross_entropy(ignore_index=-1)."""
    logits, targets = logits.float().flatten(0, 1), targets.flatten()
    top = all_reduce(logits.max(dim=-1).values.detach(), par.g, op=dist.ReduceOp.MAX)  # for stability only
    shifted = logits - top[:, None]
    sum_exp = shifted.exp().sum(dim=-1)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.size(-1))
    target_logit = shifted.gather(1, local.clamp(0, logits.size(-1) - 1)[:, None]).squeeze(1) * mine
    if par.g.size > 1:  # g: all-reduce forward, identity backward gives each rank softmax - one_hot on its slice
        sum_exp, target_logit = ReduceFromTP.apply(sum_exp, par.g), ReduceFromTP.apply(target_logit, par.g)
    valid = targets != -1
    return ((sum_exp.log() - target_logit) * valid).sum() / valid.sum()


def shard_gpt(model, par):
    """Turn the full GPT (built exactly as train.py builds it) into this rank's part, in place: reuses model.py's
    blocks with their Linear layers replaced by parallel ones holding this rank's slice.
    Returns {dense parameter name: (this rank's parameter, kind)} for consolidation and gradient sync."""
    cfg, g = model.config, par.g
    dense_named = list(model.named_parameters())
    names = {id(p): n for n, p in dense_named}
    specs = {}

    def keep(dense, local, kind):
        if dense is not None:
            specs[names[id(dense)]] = (local, kind)
        return local

    def column(linear, kind, qkv_sizes=None):
        layer = ColumnParallelLinear(take_slice(linear.weight.detach(), kind, g, qkv_sizes).clone(),
                                     None if linear.bias is None else
                                     take_slice(linear.bias.detach(), kind, g, qkv_sizes).clone())
        keep(linear.weight, layer.weight, kind)
        keep(linear.bias, layer.bias, kind)
        return layer

    def row(linear):
        layer = RowParallelLinear(take_slice(linear.weight.detach(), 'row', g).clone(), linear.bias, par)
        keep(linear.weight, layer.weight, 'row')
        return layer

    hd = cfg.n_embd // cfg.n_head
    qkv_sizes = [cfg.n_head * hd, cfg.n_kv_head * hd, cfg.n_kv_head * hd]
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        attn.c_attn, attn.c_proj = column(attn.c_attn, 'qkv', qkv_sizes), row(attn.c_proj)
        attn.n_head, attn.n_kv_head = cfg.n_head // g.size, cfg.n_kv_head // g.size  # the heads this rank holds
        mlp.c_fc = column(mlp.c_fc, 'col')
        if mlp.swiglu:
            mlp.c_gate = column(mlp.c_gate, 'col')
        mlp.c_proj = row(mlp.c_proj)
        block.ln_1, block.ln_2 = NormThenEnter(block.ln_1, par), NormThenEnter(block.ln_2, par)
    model.transformer.ln_f = NormThenEnter(model.transformer.ln_f, par)

    sizes = [len(part) for part in torch.tensor_split(torch.arange(cfg.vocab_size), g.size)]
    start = sum(sizes[:g.rank])
    wte, lm_head = model.transformer.wte, model.lm_head
    wte_slice = nn.Parameter(take_slice(wte.weight.detach(), 'col', g).clone())
    model.transformer.wte = VocabParallelEmbedding(keep(wte.weight, wte_slice, 'col'), start, par)
    if cfg.tie_embeddings:  # the head is the same vocabulary slice of the same tensor
        model.lm_head = ColumnParallelLinear(wte_slice, None)
    else:
        model.lm_head = column(lm_head, 'col')
    model.lm_head.vocab_start = start
    for name, p in dense_named:  # what is left (norms, row-parallel biases, wpe) is the dense model's own
        if name not in specs:
            specs[name] = (p, 'replicated')
    model.forward = forward_needs_tp_forward  # GPT.forward would compute a loss over one vocabulary slice
    return specs


def forward_needs_tp_forward(*args, **kwargs):
    raise RuntimeError("this GPT is one tensor-parallel rank's slice: run it with tensor_parallel.tp_forward (its "
                       "loss is vocabulary-parallel); to sample, consolidate it into a train.py checkpoint first")


def tp_forward(model, idx, targets, par):
    """GPT.forward with the vocabulary-parallel embedding, head and loss. Returns (this rank's vocabulary slice
    of the logits, the mean loss)."""
    x = model.transformer.wte(idx)  # summed over the ranks (and, with SP, this rank's chunk of the sequence)
    if model.transformer.wpe is not None:
        T = x.size(1)
        first = par.g.rank * T if par.sequence_parallel and par.g.size > 1 else 0
        x = x + model.transformer.wpe(torch.arange(first, first + T, dtype=torch.long, device=idx.device))
    x = model.transformer.drop(x)
    for block in model.transformer.h:
        x = model.run_block(block, x)
    logits = model.lm_head(model.transformer.ln_f(x))
    loss = None if targets is None else vocab_parallel_cross_entropy(logits, targets, model.lm_head.vocab_start, par)
    return logits, loss


def sync_tp_grads(specs, par):
    """Sequence parallelism only: the replicated parameters (norms, row-parallel biases, learned positions) saw
    only this rank's chunk of the sequence, so their full gradient is the sum over the tp ranks. (Without it
    every tp rank computed the same gradient from the same whole sequence.)"""
    grads = [p.grad for p, kind in specs.values() if kind == 'replicated' and p.grad is not None]
    if par.sequence_parallel and par.g.size > 1 and grads:
        flat = all_reduce(torch.cat([gr.flatten() for gr in grads]), par.g, 'grad_all_reduce')
        for gr, new in zip(grads, flat.split([gr.numel() for gr in grads])):
            gr.copy_(new.view_as(gr))


def sync_dp_grads(params, dp):
    """Data parallelism: average every gradient over the dp ranks (one flat all-reduce)."""
    grads = [p.grad for p in params if p.grad is not None]
    if dp.size > 1 and grads:
        flat = all_reduce(torch.cat([gr.flatten() for gr in grads]), dp) / dp.size
        for gr, new in zip(grads, flat.split([gr.numel() for gr in grads])):
            gr.copy_(new.view_as(gr))


def clip_grad_norm(specs, par, max_norm):
    """torch.nn.utils.clip_grad_norm_ over the whole model: the split parameters' squares summed over the tp
    ranks, the replicated ones counted once."""
    split = [p.grad for p, kind in specs.values() if kind != 'replicated' and p.grad is not None]
    replicated = [p.grad for p, kind in specs.values() if kind == 'replicated' and p.grad is not None]
    split_sq = torch.stack([gr.float().pow(2).sum() for gr in split]).sum() if split else torch.zeros(())
    total_sq = all_reduce(split_sq, par.g, 'scalars')
    if replicated:
        total_sq = total_sq + torch.stack([gr.float().pow(2).sum() for gr in replicated]).sum()
    coef = torch.clamp(max_norm / (total_sq.sqrt() + 1e-6), max=1.0)
    for gr in split + replicated:
        gr.mul_(coef.to(gr.dtype))
    return total_sq.sqrt()


def measure_activation_bytes(model, idx, par):
    """Bytes one layer saves for backward, measured: run the embedding and the first block on idx and add up
    the distinct storages that autograd keeps (saved_tensors_hooks), parameters left out. Expect it below the
    formula's numbers without sequence parallelism (no dropout masks at p=0, and PyTorch's attention keeps no
    s x s matrix), and above its 1/t with it: the column-parallel layers here keep their all-gathered input,
    where Megatron keeps the sequence chunk and all-gathers it again in backward."""
    hooks, seen = saved_bytes_counter(model)
    with torch.enable_grad():
        x = model.transformer.wte(idx).detach()  # the block's input as it sees it (with SP: this rank's chunk)
        with hooks:
            model.run_block(model.transformer.h[0], x)
    return sum(seen.values())


def make_grid(world_size, tp_size, rank):
    """The process grid as one reshape: grid[dp_rank, tp_rank] is a global rank. Each row is a tp group (the
    ranks that split one model), each column a dp group (the same slice, different data)."""
    grid = torch.arange(world_size).view(world_size // tp_size, tp_size)
    dp_rank, tp_rank = divmod(rank, tp_size)
    if world_size == 1:
        return grid, Comm(None, 'tp'), Comm(None, 'dp')
    tp_groups = [dist.new_group(row.tolist()) for row in grid]  # every rank creates every group, in one order
    dp_groups = [dist.new_group(col.tolist()) for col in grid.t()]
    return grid, Comm(tp_groups[dp_rank], 'tp'), Comm(dp_groups[tp_rank], 'dp')


def check_config(cfg, world_size):
    """Every bad combination, before any work: one line, the same on every rank."""
    if cfg.tp < 1 or world_size % cfg.tp:
        raise SystemExit(f"error: world size {world_size} is not divisible by tp={cfg.tp}")
    dp_size = world_size // cfg.tp
    if cfg.gradient_accumulation_steps % dp_size:
        raise SystemExit(f"error: gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be divisible "
                         f"by the data-parallel size dp={dp_size} (world size {world_size} / tp {cfg.tp}): "
                         f"the world is larger than the batch")
    n_kv_head = cfg.n_head if cfg.n_kv_head is None else cfg.n_kv_head
    if cfg.n_head % cfg.tp or n_kv_head % cfg.tp:
        raise SystemExit(f"error: n_head ({cfg.n_head}) and n_kv_head ({n_kv_head}) must both be divisible by "
                         f"tp={cfg.tp}: each rank holds whole query and key/value heads")
    if cfg.sequence_parallel and cfg.block_size % cfg.tp:
        raise SystemExit(f"error: sequence_parallel needs block_size ({cfg.block_size}) divisible by tp={cfg.tp}")
    if cfg.dtype not in ('float32', 'bfloat16'):
        raise SystemExit(f"error: dtype must be float32 or bfloat16 for tensor_parallel.py, got {cfg.dtype!r} "
                         f"(float16's GradScaler would need its inf check shared by the tp ranks)")
    if cfg.init_from == 'resume':
        for r in range(world_size):
            if not os.path.exists(rank_ckpt_path(cfg.out_dir, r)):
                raise SystemExit(f"error: init_from=resume but there is no checkpoint at "
                                 f"{rank_ckpt_path(cfg.out_dir, r)} (resume needs the same world size)")


def rank_ckpt_path(out_dir, rank):
    return os.path.join(out_dir, f'ckpt_rank{rank}.pt')


def rank_layout(model, specs, optimizer):
    """What consolidation needs to find each dense parameter in a rank's checkpoint: {dense name: (local name,
    kind)}, and the local names in the optimizer's order (the order its state_dict numbers them)."""
    local_name = {id(p): n for n, p in model.named_parameters()}
    layout = {dense: (local_name[id(p)], kind) for dense, (p, kind) in specs.items()}
    order = [local_name[id(p)] for group in optimizer.param_groups for p in group['params']]
    return layout, order


def consolidate_ranks(out_dir):
    """The tp ranks' checkpoints of out_dir (data-parallel replica 0, ranks 0..tp-1) -> out_dir/ckpt.pt in
    train.py's format: the full model and torch AdamW's state in configure_optimizers' order. Runs offline, one
    parameter at a time from memory-mapped files, so no rank ever gathers the whole model to save."""
    if not os.path.exists(rank_ckpt_path(out_dir, 0)):
        raise SystemExit(f"error: consolidate: no tensor-parallel checkpoint {rank_ckpt_path(out_dir, 0)}")
    load = lambda r: torch.load(rank_ckpt_path(out_dir, r), map_location='cpu', weights_only=False, mmap=True)
    first = load(0)
    ranks = [first] + [load(r) for r in range(1, first['tp'])]
    config = GPTConfig(**first['model_args'])
    hd = config.n_embd // config.n_head
    qkv_sizes = [config.n_head * hd, config.n_kv_head * hd, config.n_kv_head * hd]
    model_sd, optim_state = {}, {}
    for i, (dense, (local, kind)) in enumerate(first['layout'].items()):
        progress(i + 1, len(first['layout']), f"consolidating {len(ranks)} tensor-parallel ranks (parameters)")
        model_sd[dense] = join_slices([r['model'][local] for r in ranks], kind, qkv_sizes).clone()
        states = [r['optimizer']['state'].get(r['param_order'].index(local)) for r in ranks]
        if states[0] is not None:
            optim_state[dense] = {k: v.clone() if k == 'step' else join_slices([s[k] for s in states], kind, qkv_sizes)
                                  for k, v in states[0].items()}
    if config.tie_embeddings:
        model_sd['lm_head.weight'] = model_sd['transformer.wte.weight']
    with torch.device('meta'):  # the dense model's names and optimizer order, without its memory
        dense_model = GPT(config)
    name_of = {id(p): n for n, p in dense_model.named_parameters()}
    groups, state, index = [], {}, 0
    for saved, group in zip(first['optimizer']['param_groups'], param_groups(dense_model, 0.0)):
        names = [name_of[id(p)] for p in group['params']]
        groups.append(dict(saved, params=list(range(index, index + len(names)))))
        state.update({index + i: optim_state[n] for i, n in enumerate(names) if n in optim_state})
        index += len(names)
    path = os.path.join(out_dir, 'ckpt.pt')
    save_checkpoint({'model': model_sd, 'optimizer': {'state': state, 'param_groups': groups}, 'scaler': {},
                     'rng_state': first['rng']['cpu'], 'cuda_rng_state': first['rng']['cuda'],
                     'model_args': first['model_args'], 'iter_num': first['iter_num'],
                     'best_val_loss': first['best_val_loss'],
                     'config': dict(first['config'], init_from='resume', consolidate='')}, path)
    print(f"wrote {path} (train.py's format) from {first['tp']} tensor-parallel ranks at iter {first['iter_num']}")
    return path


def main(argv):
    cfg = configure(config, argv)
    if cfg.consolidate:
        consolidate_ranks(cfg.consolidate)
        return
    world_size = world_size_from_env()
    check_config(cfg, world_size)
    dp_size = world_size // cfg.tp
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size

    # setup
    rank, local_rank, world_size, device = init_distributed(cfg.dist_timeout)
    cfg.device = device if world_size > 1 else cfg.device
    grid, tpg, dp = make_grid(world_size, cfg.tp, rank)
    dp_rank = dp.rank
    par = TensorParallel(tpg, cfg.sequence_parallel)
    master = rank == 0
    if master:
        print(f"process grid (dp x tp) = torch.arange({world_size}).view({dp_size}, {cfg.tp}):\n{grid}")
    print(f"[rank {rank}] tp group {grid[dp_rank].tolist()} (tp rank {tpg.rank}), "
          f"dp group {grid[:, tpg.rank].tolist()} (dp rank {dp_rank})", flush=True)
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    ctx = autocast_context(device_type, cfg.dtype)

    # data
    data, vocab_size = load_dataset(cfg.dataset)

    # model: the full GPT, exactly as train.py builds it, then this rank's slice of it
    iter_num, best_val_loss, checkpoint = 0, 1e9, None
    if cfg.init_from == 'scratch':
        model = GPT(model_config(cfg, vocab_size))
    elif cfg.init_from == 'resume':
        checkpoint = torch.load(rank_ckpt_path(cfg.out_dir, rank), map_location='cpu', weights_only=False)
        if checkpoint['tp'] != cfg.tp or checkpoint['world_size'] != world_size:
            raise SystemExit(f"error: the checkpoint was written with tp={checkpoint['tp']} on "
                             f"{checkpoint['world_size']} ranks; resume with the same (or consolidate it)")
        model = GPT(GPTConfig(**checkpoint['model_args']))
        iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
        if master:
            trim_log(cfg.out_dir, iter_num)
    elif cfg.init_from.startswith('gpt2'):
        model = GPT.from_pretrained(cfg.init_from, dropout=cfg.dropout,
                                    activation_checkpointing=cfg.activation_checkpointing)
    else:
        raise SystemExit(f"error: init_from must be 'scratch', 'resume' or a GPT-2 name, got {cfg.init_from!r}")
    if cfg.block_size > model.config.block_size:
        raise SystemExit(f"error: block_size {cfg.block_size} is larger than the model's {model.config.block_size}")
    dense_params, flops_per_token = model.get_num_params(), model.flops_per_token()  # of the whole model
    specs = shard_gpt(model, par)
    give_tp_ranks_their_dropout(model, par)
    if checkpoint is not None:
        model.load_state_dict(checkpoint['model'])
        set_rng_state(checkpoint['rng'])  # this rank's own streams
    else:
        seed_dropout(cfg.seed, dp_rank)  # the tp ranks of a replica share the stream; each replica its own
    model.to(cfg.device)
    if master:
        print(run_shape(f"world {world_size} = dp {dp_size} x tp {cfg.tp}"
                        f"{' with sequence parallelism' if cfg.sequence_parallel else ''}", cfg, dense_params))
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device_type)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint['optimizer'])
    checkpoint = None  # free it
    raw_model = model
    params = [p for p, _ in specs.values()]

    def loss_of(x, y):
        with ctx:
            return tp_forward(model, x, y, par)[1]

    # measured: parameter bytes, activation bytes of one layer for one micro-batch
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    x0, _ = get_batch(data['train'], cfg.seed, TRAIN_STREAM, iter_num, cfg.batch_size, cfg.block_size, None,
                      cfg.device)
    devices = [torch.device(cfg.device).index or 0] if device_type == 'cuda' else []
    with ctx, torch.random.fork_rng(devices=devices):  # its dropout draws must not move the run's streams
        activation_bytes = measure_activation_bytes(model, x0, par)
    act_elem = 2 if cfg.dtype == 'bfloat16' else 4

    # training loop
    peak = peak_flops_for(cfg.device, cfg.dtype, cfg.peak_flops)
    writer, wire = CheckpointWriter(), WireMeter()  # every rank writes its own checkpoint in the background
    profiler = StepProfiler(cfg.profile, cfg.out_dir, rank, cfg.device)  # --profile=N: a trace per rank
    t_last, iters_since_log, first_iter = time.time(), 0, iter_num
    while True:
        lr = get_lr(iter_num, cfg)
        for group in optimizer.param_groups:
            group['lr'] = lr

        # evaluate, and checkpoint the state from which iteration iter_num starts
        if iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters:
            model.eval()
            losses = estimate_loss(loss_of, data, cfg, dp)  # each replica its share of the batches
            model.train()
            if master:
                log_row(cfg.out_dir, {'iter': iter_num, 'train_loss': losses['train'], 'val_loss': losses['val'],
                                      'lr': lr})
            if not math.isfinite(losses['val']):
                raise SystemExit(f"error: val loss is {losses['val']} at iter {iter_num}; kept the last checkpoint")
            if iter_num > 0 and (losses['val'] < best_val_loss or cfg.always_save_checkpoint):
                best_val_loss = min(best_val_loss, losses['val'])
                layout, param_order = rank_layout(raw_model, specs, optimizer)
                writer.save({'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), 'rng': rng_state(),
                             'layout': layout, 'param_order': param_order, 'model_args': vars(raw_model.config),
                             'tp': cfg.tp, 'world_size': world_size, 'iter_num': iter_num,
                             'best_val_loss': best_val_loss, 'config': vars(cfg)}, rank_ckpt_path(cfg.out_dir, rank))
            t_last, iters_since_log = time.time(), 0  # do not count eval time as training time
        if iter_num == cfg.max_iters or cfg.eval_only:
            break

        # one iteration: forward and backward over every micro-batch, then one optimizer step
        measuring = iter_num == first_iter  # the first iteration: the bytes sent, counted and measured
        if measuring:
            tpg.clear(), dp.clear()
            wire.start()
        micro_steps = cfg.gradient_accumulation_steps // dp_size
        global_rows = cfg.batch_size * cfg.gradient_accumulation_steps
        loss_sum = torch.zeros((), device=cfg.device)
        for micro_step in range(micro_steps):
            rows = micro_batch_rows(cfg, dp_rank, dp_size, micro_step)
            x, y = get_batch(data['train'], cfg.seed, TRAIN_STREAM, iter_num, global_rows, cfg.block_size, rows,
                             cfg.device)
            with ctx:
                _, loss = tp_forward(model, x, y, par)
                loss = loss / micro_steps  # the gradient is the mean over the whole batch
            loss_sum += loss.detach()
            loss.backward()
        sync_tp_grads(specs, par)
        sync_dp_grads(params, dp)
        if cfg.grad_clip != 0.0:
            clip_grad_norm(specs, par, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = all_reduce(loss_sum, dp, 'scalars').item() / dp.size  # the mean loss over the global batch
        wire_bytes = wire.stop() if measuring else None

        # log
        if not math.isfinite(loss_value):
            raise SystemExit(f"error: loss is {loss_value} at iter {iter_num}; stopped, the last checkpoint is kept")
        if measuring:  # once: what each rank measured, beside the formulas
            report_measurements(cfg, raw_model.config, iter_num, rank, tpg, dp, micro_steps, param_bytes,
                                activation_bytes, act_elem, wire_bytes, wire.why_not)
        iters_since_log += 1
        if iter_num % cfg.log_interval == 0 and master:
            dt = (time.time() - t_last) / iters_since_log
            t_last, iters_since_log = time.time(), 0
            tokens_per_sec = tokens_per_iter / dt
            log_row(cfg.out_dir, {'iter': iter_num, 'loss': loss_value, 'lr': lr, 'ms': 1000 * dt,
                                  'tokens_per_sec': tokens_per_sec,
                                  'mfu': mfu(flops_per_token, tokens_per_sec, world_size, peak),
                                  'peak_mem_bytes': peak_memory_bytes(cfg.device)})
        profiler.step()
        iter_num += 1
    profiler.stop()
    writer.wait()

    if cfg.sample_at_end and not cfg.eval_only and master:
        print(f"sample with: python tensor_parallel.py --consolidate={cfg.out_dir} && "
              f"python sample.py --out_dir={cfg.out_dir}")
    if master:
        print(outputs_line(cfg.out_dir, "ckpt_rank*.pt (each rank's slices: resume; python tensor_parallel.py "
                                        f"--consolidate={cfg.out_dir} makes one ckpt.pt)", *profiled(cfg)))
    if world_size > 1:
        dist.barrier()  # all leave together: tearing gloo down under a peer still inside a collective can abort
        dist.destroy_process_group()


def report_measurements(cfg, dense_config, iter_num, rank, tpg, dp, micro_steps, param_bytes, activation_bytes,
                        act_elem, wire_bytes, wire_why_not):
    """One row per rank in log.jsonl (gathered to rank 0) and one printed line each: measured beside formula.
    Bytes sent: counted at the calls (collective_bytes), the ring formula for those calls (wire_bytes_formula)
    beside Megatron's count for a layer (tp_comm_bytes_formula), and measured on the wire (wire_bytes)."""
    s, b, h, t, L = cfg.block_size, cfg.batch_size, dense_config.n_embd, tpg.size, dense_config.n_layer
    sent = comm_report([tpg, dp])
    activations = {k: v for k, v in tpg.wire_bytes_formula.items()
                   if k in ('all_reduce', 'all_gather', 'reduce_scatter')}  # not the gradient or norm sync
    row = {'rank': rank, 'iter': iter_num, 'tp_rank': tpg.rank, 'dp_rank': dp.rank, 'tp': t, 'dp': dp.size,
           'sequence_parallel': cfg.sequence_parallel,
           'param_bytes': param_bytes, 'param_bytes_formula': param_bytes_formula(dense_config, t),
           'activation_bytes': activation_bytes,
           'activation_bytes_formula': activation_bytes_formula(s, b, h, dense_config.n_head, t,
                                                                cfg.sequence_parallel, bytes_per_elem=act_elem),
           'collective_bytes': sum(sent['collective_bytes'].values()),
           'collective_bytes_by_kind': sent['collective_bytes'],
           'wire_bytes_formula': sum(sent['wire_bytes_formula'].values()),
           'wire_bytes_formula_by_kind': sent['wire_bytes_formula'],
           'wire_bytes': wire_bytes, 'wire_bytes_note': wire_why_not,
           'tp_activation_wire_bytes_formula': sum(activations.values()),
           'tp_comm_bytes_formula': micro_steps * (
               L * tp_comm_bytes_formula(s, b, h, t, cfg.sequence_parallel, act_elem)
               + tp_edge_comm_bytes_formula(s, b, h, t, cfg.sequence_parallel, act_elem)),
           'dp_grad_wire_bytes_formula': dp.wire_bytes_formula['all_reduce'],
           'dp_grad_bytes_formula': 2 * (dp.size - 1) / dp.size * param_bytes}
    wire = wire_why_not if wire_bytes is None else f"{wire_bytes:,.0f}"
    print(f"[rank {rank}] tp {tpg.rank}/{t} dp {dp.rank}/{dp.size}: "
          f"param bytes {row['param_bytes']:,} (formula {row['param_bytes_formula']:,.0f}); "
          f"activation bytes/layer {activation_bytes:,} (formula {row['activation_bytes_formula']:,.0f}, "
          f"{'with' if cfg.sequence_parallel else 'no'} SP); sent per step: collective bytes "
          f"{row['collective_bytes']:,} (counted: "
          + ', '.join(f"{k} {v:,}" for k, v in sent['collective_bytes'].items())
          + f"), wire bytes {row['wire_bytes_formula']:,.0f} (ring formula; Megatron's count for the activations "
          f"{row['tp_comm_bytes_formula']:,.0f}), {wire} (measured, loopback)", flush=True)
    rows = [row]
    if dist.is_initialized():
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
    if rank == 0:
        with open(os.path.join(cfg.out_dir, 'log.jsonl'), 'a') as f:
            f.writelines(json.dumps(r) + '\n' for r in rows)
        if rows[0]['wire_bytes'] and rows[0]['wire_bytes'] > 1.2 * rows[0]['wire_bytes_formula']:
            print("(more on the wire than the ring formula: with sequence parallelism half the collectives are "
                  "reduce-scatters, and gloo's reduce-scatter is an all-reduce underneath)")


if __name__ == '__main__':
    run_main(main)
