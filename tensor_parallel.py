"""
train.py plus tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and, optionally, sequence parallelism
(Korthikanti et al. 2022), written by hand with torch.distributed. The tp ranks of a group split every layer:
attention by heads (and KV heads), the MLP column then row, the vocabulary of the embedding, the head and the
loss. Each transformer block then runs 2 all-reduces forward and 2 backward; with --sequence_parallel=True each
becomes an all-gather + a reduce-scatter and the norms work on 1/tp of the sequence each.

    torchrun --nproc_per_node=2 tensor_parallel.py --tp=2
    torchrun --nproc_per_node=4 tensor_parallel.py --tp=4 --sequence_parallel=True
    torchrun --nproc_per_node=4 tensor_parallel.py --tp=2 --gradient_accumulation_steps=2   # dp=2 x tp=2
    torchrun --nproc_per_node=2 tensor_parallel.py --tp=2 --init_from=resume        # same tp and world size
    python consolidate.py out      # the rank checkpoints in out/ -> out/ckpt.pt, a train.py checkpoint

Every rank builds the full GPT from the seed exactly as train.py does and keeps its slice, so for the same
config and seed the loss curve is train.py's. Each rank prints (and logs, one row per rank) what it measured
beside the formula: parameter bytes, activation bytes saved for backward by one layer, bytes sent per step.
(The comm formula counts every activation at bytes_per_elem; under bfloat16 autocast the residual stream and
the norms stay fp32, so the measured bytes are higher there.)
"""

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

from formulas import (activation_bytes_formula, param_bytes_formula, saved_bytes_formula, tp_comm_bytes_formula,
                      tp_edge_comm_bytes_formula)
from model import GPTConfig, init_values, materialize
from training import (StepLogger, autocast_context, check_batch, config_defaults, configure, evaluate, get_lr,
                      load_dataset, log_rank_rows, micro_batches, outputs_line, profiled, progress, run_main,
                      run_shape, set_lr, should_evaluate, should_save)
from checkpoints import (CheckpointWriter, adamw_state_dict, init_model, rng_state, seed_dropout, set_rng_state,
                         train_checkpoint)
from distributed import (Comm, average_gradients, finish_distributed, init_distributed, process_grid,
                         world_size_from_env)
from measure import StepProfiler, WireMeter, comm_report, saved_bytes_counter

# -----------------------------------------------------------------------------
# config: train.py's keys (training.TRAIN_DEFAULTS; `--help` lists them all), and these
init_from = 'scratch'           # 'scratch', 'resume' (out_dir/ckpt_rank<r>.pt) or a GPT-2 name: 'gpt2', ...
# tensor parallelism
dist_timeout = 60               # seconds a rank waits for the others before failing
tp = 1                          # tensor-parallel degree; world size = dp * tp
sequence_parallel = False       # shard norms and dropout along the sequence (all-gather + reduce-scatter)
config = config_defaults(globals())
# -----------------------------------------------------------------------------


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
    def forward(ctx, x, tp_group):
        ctx.tp_group = tp_group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.tp_group), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward. It leaves the tensor-parallel region: the
    row-parallel layer's partial sums (one per rank) add up to the full output, whose gradient every rank
    already has whole."""

    @staticmethod
    def forward(ctx, x, tp_group):
        return all_reduce(x.clone(memory_format=torch.contiguous_format), tp_group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSequence(torch.autograd.Function):
    """Sequence parallelism's g: all-gather along the sequence forward, reduce-scatter backward. Replaces f: the
    norm ran on this rank's chunk of the sequence, the column-parallel layer needs all of it."""

    @staticmethod
    def forward(ctx, x, tp_group):
        ctx.tp_group = tp_group
        return all_gather_seq(x, tp_group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.tp_group), None


class ScatterToSequence(torch.autograd.Function):
    """Sequence parallelism's g-bar: reduce-scatter along the sequence forward, all-gather backward. Replaces g:
    each rank keeps only its chunk of the summed output, for the dropout, residual and norm that follow."""

    @staticmethod
    def forward(ctx, x, tp_group):
        ctx.tp_group = tp_group
        return reduce_scatter_seq(x, tp_group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.tp_group), None


@dataclass
class TensorParallel:
    """This rank's tensor-parallel group (a Comm) and whether sequence parallelism is on."""
    group: Comm
    sequence_parallel: bool = False


def enter_tp_region(x, tp):
    if tp.group.size == 1:
        return x
    return GatherFromSequence.apply(x, tp.group) if tp.sequence_parallel else CopyToTP.apply(x, tp.group)


def leave_tp_region(x, tp):
    if tp.group.size == 1:
        return x
    return ScatterToSequence.apply(x, tp.group) if tp.sequence_parallel else ReduceFromTP.apply(x, tp.group)


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


def give_tp_ranks_their_dropout(model, tp):
    """Each rank's heads get their own attention-dropout stream; with sequence parallelism, also the dropouts on
    the sequence chunks (embedding, and after each block's two row-parallel layers)."""
    if tp.group.size == 1 or model.config.dropout == 0:
        return
    for block in model.transformer.h:
        block.attn.dropout_rng = functools.partial(tp_rank_rng, tp.group.rank)
        if tp.sequence_parallel:
            block.attn.resid_dropout = TPRankDropout(block.attn.resid_dropout, tp.group.rank)
            block.mlp.dropout = TPRankDropout(block.mlp.dropout, tp.group.rank)
    if tp.sequence_parallel:
        model.transformer.drop = TPRankDropout(model.transformer.drop, tp.group.rank)


# -----------------------------------------------------------------------------
# The parallel layers. Each holds this rank's slice of the dense layer's weights.

def qkv_split(config):
    """The sizes of q, k and v along c_attn's output features (k and v have n_kv_head heads)."""
    hd = config.n_embd // config.n_head
    return [config.n_head * hd, config.n_kv_head * hd, config.n_kv_head * hd]


def take_slice(full, kind, tp_group, qkv_sizes=None):
    """This rank's part of a dense tensor. 'col': rows (output features), 'row': columns (input features),
    'qkv': the rows of this rank's heads in each of q, k and v, 'replicated': all of it."""
    n, r = tp_group.size, tp_group.rank
    if kind == 'col':
        return torch.tensor_split(full, n, dim=0)[r]
    if kind == 'row':
        return torch.tensor_split(full, n, dim=1)[r]
    if kind == 'qkv':
        return torch.cat([torch.tensor_split(part, n, dim=0)[r] for part in full.split(qkv_sizes)])
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

    def __init__(self, weight, bias, tp):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = bias  # the dense layer's own Parameter: replicated
        self.tp = tp

    def forward(self, x):
        y = leave_tp_region(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


class NormThenEnter(nn.Module):
    """The block's norm, then the entry into the tensor-parallel region: f in plain TP, the sequence all-gather
    with sequence parallelism (where the norm ran on this rank's chunk of the sequence)."""

    def __init__(self, norm, tp):
        super().__init__()
        self.norm, self.tp = norm, tp

    def forward(self, x):
        return enter_tp_region(self.norm(x), self.tp)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + n) of the token embedding: tokens outside it look up zeros, and g (or the
    reduce-scatter to sequence chunks) sums the ranks' lookups into the full embedding."""

    def __init__(self, weight, start, tp):
        super().__init__()
        self.weight, self.start, self.tp = weight, start, tp

    def forward(self, idx):
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.size(0))
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return leave_tp_region(x.masked_fill(outside[..., None], 0.0), self.tp)


def vocab_parallel_cross_entropy(logits, targets, vocab_start, tp):
    """Mean cross-entropy from this rank's vocabulary slice of the logits (B, T, V/t), never gathering them:
    3 all-reduces of one number per token (the max, the sum of exponentials, the target's logit).
    Targets -1 are ignored, as F.cross_entropy(ignore_index=-1)."""
    logits, targets = logits.float().flatten(0, 1), targets.flatten()
    top = all_reduce(logits.max(dim=-1).values.detach(), tp.group, op=dist.ReduceOp.MAX)  # for stability only
    shifted = logits - top[:, None]
    sum_exp = shifted.exp().sum(dim=-1)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.size(-1))
    target_logit = shifted.gather(1, local.clamp(0, logits.size(-1) - 1)[:, None]).squeeze(1) * mine
    if tp.group.size > 1:  # g: all-reduce forward, identity backward gives each rank softmax - one_hot on its slice
        sum_exp, target_logit = ReduceFromTP.apply(sum_exp, tp.group), ReduceFromTP.apply(target_logit, tp.group)
    valid = targets != -1
    return ((sum_exp.log() - target_logit) * valid).sum() / valid.sum()


def shard_gpt(model, tp):
    """Turn the full GPT (built exactly as train.py builds it) into this rank's part, in place: reuses model.py's
    blocks with their Linear layers replaced by parallel ones holding this rank's slice.
    Returns {dense parameter name: (this rank's parameter, kind)} for consolidation and gradient sync."""
    cfg, tp_group = model.config, tp.group
    dense_named = list(model.named_parameters())
    names = {id(p): n for n, p in dense_named}
    layout = {}

    def keep(dense, local, kind):
        if dense is not None:
            layout[names[id(dense)]] = (local, kind)
        return local

    def column(linear, kind, qkv_sizes=None):
        layer = ColumnParallelLinear(take_slice(linear.weight.detach(), kind, tp_group, qkv_sizes).clone(),
                                     None if linear.bias is None else
                                     take_slice(linear.bias.detach(), kind, tp_group, qkv_sizes).clone())
        keep(linear.weight, layer.weight, kind)
        keep(linear.bias, layer.bias, kind)
        return layer

    def row(linear):
        layer = RowParallelLinear(take_slice(linear.weight.detach(), 'row', tp_group).clone(), linear.bias, tp)
        keep(linear.weight, layer.weight, 'row')
        return layer

    qkv_sizes = qkv_split(cfg)
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        attn.c_attn, attn.c_proj = column(attn.c_attn, 'qkv', qkv_sizes), row(attn.c_proj)
        attn.n_head, attn.n_kv_head = cfg.n_head // tp_group.size, cfg.n_kv_head // tp_group.size  # its heads
        mlp.c_fc = column(mlp.c_fc, 'col')
        if mlp.swiglu:
            mlp.c_gate = column(mlp.c_gate, 'col')
        mlp.c_proj = row(mlp.c_proj)
        block.ln_1, block.ln_2 = NormThenEnter(block.ln_1, tp), NormThenEnter(block.ln_2, tp)
    model.transformer.ln_f = NormThenEnter(model.transformer.ln_f, tp)

    sizes = [len(part) for part in torch.tensor_split(torch.arange(cfg.vocab_size), tp_group.size)]
    start = sum(sizes[:tp_group.rank])
    wte, lm_head = model.transformer.wte, model.lm_head
    wte_slice = nn.Parameter(take_slice(wte.weight.detach(), 'col', tp_group).clone())
    model.transformer.wte = VocabParallelEmbedding(keep(wte.weight, wte_slice, 'col'), start, tp)
    if cfg.tie_embeddings:  # the head is the same vocabulary slice of the same tensor
        model.lm_head = ColumnParallelLinear(wte_slice, None)
    else:
        model.lm_head = column(lm_head, 'col')
    model.lm_head.vocab_start = start
    for name, p in dense_named:  # what is left (norms, row-parallel biases, wpe) is the dense model's own
        if name not in layout:
            layout[name] = (p, 'replicated')
    model.forward = forward_needs_tp_forward  # GPT.forward would compute a loss over one vocabulary slice
    return layout


def keep_slices(layout, tp, config):
    """For init_params: copy this rank's slice of each dense parameter's values into its local parameter."""
    qkv_sizes = qkv_split(config)

    def keep(name, full):
        if name in layout:
            local, kind = layout[name]
            local.data.copy_(take_slice(full, kind, tp.group, qkv_sizes))
    return keep


def forward_needs_tp_forward(*args, **kwargs):
    raise RuntimeError("this GPT is one tensor-parallel rank's slice: run it with tensor_parallel.tp_forward (its "
                       "loss is vocabulary-parallel); to sample, python consolidate.py OUT_DIR makes a train.py "
                       "checkpoint first")


def tp_embed(model, idx, tp, positions=None):
    """The vocabulary-parallel embedding (summed over the tp ranks; with sequence parallelism, this rank's chunk
    of the sequence) plus the learned positions of the tokens it holds (positions: given by context parallelism)."""
    x = model.transformer.wte(idx)
    if model.transformer.wpe is not None:
        if positions is None:
            T = x.size(1)
            first = tp.group.rank * T if tp.sequence_parallel and tp.group.size > 1 else 0
            positions = torch.arange(first, first + T, dtype=torch.long, device=idx.device)
        x = x + model.transformer.wpe(positions)
    return model.transformer.drop(x)


def tp_head(model, x, targets, tp):
    """The final norm, the vocabulary-parallel head and loss: (this rank's vocabulary slice of the logits, loss)."""
    logits = model.lm_head(model.transformer.ln_f(x))
    loss = None if targets is None else vocab_parallel_cross_entropy(logits, targets, model.lm_head.vocab_start, tp)
    return logits, loss


def tp_forward(model, idx, targets, tp):
    """GPT.forward with the vocabulary-parallel embedding, head and loss. Returns (this rank's vocabulary slice
    of the logits, the mean loss)."""
    x = tp_embed(model, idx, tp)
    for block in model.transformer.h:
        x = model.run_block(block, x)
    return tp_head(model, x, targets, tp)


def sync_tp_grads(layout, tp):
    """Sequence parallelism only: the replicated parameters (norms, row-parallel biases, learned positions) saw
    only this rank's chunk of the sequence, so their full gradient is the sum over the tp ranks. (Without it
    every tp rank computed the same gradient from the same whole sequence.)"""
    grads = [p.grad for p, kind in layout.values() if kind == 'replicated' and p.grad is not None]
    if tp.sequence_parallel and tp.group.size > 1 and grads:
        flat = all_reduce(torch.cat([gr.flatten() for gr in grads]), tp.group, 'grad_all_reduce')
        for gr, new in zip(grads, flat.split([gr.numel() for gr in grads])):
            gr.copy_(new.view_as(gr))


def clip_grad_norm(layout, tp, max_norm):
    """torch.nn.utils.clip_grad_norm_ over the whole model: the split parameters' squares summed over the tp
    ranks, the replicated ones counted once."""
    split = [p.grad for p, kind in layout.values() if kind != 'replicated' and p.grad is not None]
    replicated = [p.grad for p, kind in layout.values() if kind == 'replicated' and p.grad is not None]
    split_sq = torch.stack([gr.float().pow(2).sum() for gr in split]).sum() if split else torch.zeros(())
    total_sq = all_reduce(split_sq, tp.group, 'scalars')
    if replicated:
        total_sq = total_sq + torch.stack([gr.float().pow(2).sum() for gr in replicated]).sum()
    coef = torch.clamp(max_norm / (total_sq.sqrt() + 1e-6), max=1.0)
    for gr in split + replicated:
        gr.mul_(coef.to(gr.dtype))
    return total_sq.sqrt()


def measure_activation_bytes(model, idx, tp):
    """Bytes one layer saves for backward, measured: run the embedding and the first block on idx and add up
    the distinct storages that autograd keeps (saved_tensors_hooks), parameters left out. saved_bytes_formula
    reads the same off the code; Korthikanti's activation_bytes_formula is Megatron's (dropout masks, an s x s
    attention matrix, the sequence chunk kept where this code keeps the all-gathered input)."""
    hooks, seen = saved_bytes_counter(model)
    with torch.enable_grad():
        # the block's input as it sees it in a run: with SP this rank's chunk, and it requires grad
        x = model.transformer.wte(idx).detach().requires_grad_()
        with hooks:
            model.run_block(model.transformer.h[0], x)
    return sum(seen.values())


# -----------------------------------------------------------------------------
# Measured, beside the formulas: the first iteration of the run


class FirstStepReport:
    """Parameter bytes; the activation bytes one layer saves for backward (measure_activation_bytes on the first
    micro-batch); the bytes sent in the step: counted at the calls (collective_bytes), the ring formula for those
    calls (wire_bytes_formula) beside Megatron's count (tp_comm_bytes_formula), and on the wire (wire_bytes).
    One printed line and one log row per rank."""

    def __init__(self, model, layout, tp, dp, cfg, first_iter, ctx):
        self.model, self.layout, self.tp, self.dp, self.cfg, self.ctx = model, layout, tp, dp, cfg, ctx
        self.first_iter, self.wire = first_iter, WireMeter()

    def start(self, iter_num, x):
        if iter_num != self.first_iter:
            return
        devices = [torch.device(self.cfg.device).index or 0] if self.cfg.device.startswith('cuda') else []
        with self.ctx, torch.random.fork_rng(devices=devices):  # its dropout draws must not move the run's streams
            self.activation_bytes = measure_activation_bytes(self.model, x, self.tp)
        self.tp.group.clear(), self.dp.clear()
        self.wire.start()

    def finish(self, iter_num):
        if iter_num != self.first_iter:
            return
        wire_bytes = self.wire.stop()
        cfg, config, tp_group, dp = self.cfg, self.model.config, self.tp.group, self.dp
        s, b, h, t, L = cfg.block_size, cfg.batch_size, config.n_embd, tp_group.size, config.n_layer
        act_elem, micro_steps = (4 if cfg.dtype == 'float32' else 2), cfg.gradient_accumulation_steps // dp.size
        param_bytes = sum(p.numel() * p.element_size() for p, _ in self.layout.values())
        sent = comm_report([tp_group, dp])
        activations = {k: v for k, v in tp_group.wire_bytes_formula.items()
                       if k in ('all_reduce', 'all_gather', 'reduce_scatter')}  # not the gradient or norm sync
        rank = dist.get_rank() if dist.is_initialized() else 0
        row = {'rank': rank, 'iter': iter_num, 'tp_rank': tp_group.rank, 'dp_rank': dp.rank, 'tp': t, 'dp': dp.size,
               'sequence_parallel': cfg.sequence_parallel,
               'param_bytes': param_bytes, 'param_bytes_formula': param_bytes_formula(config, t),
               'activation_bytes': self.activation_bytes,
               'activation_bytes_formula': saved_bytes_formula(config, s, b, t, cfg.sequence_parallel, act_elem),
               'activation_bytes_korthikanti': activation_bytes_formula(
                   s, b, h, config.n_head, t, cfg.sequence_parallel, bytes_per_elem=act_elem),
               'collective_bytes': sum(sent['collective_bytes'].values()),
               'collective_bytes_by_kind': sent['collective_bytes'],
               'wire_bytes_formula': sum(sent['wire_bytes_formula'].values()),
               'wire_bytes_formula_by_kind': sent['wire_bytes_formula'],
               'wire_bytes': wire_bytes, 'wire_bytes_note': self.wire.why_not,
               'tp_activation_wire_bytes_formula': sum(activations.values()),
               'tp_comm_bytes_formula': micro_steps * (
                   L * tp_comm_bytes_formula(s, b, h, t, cfg.sequence_parallel, act_elem)
                   + tp_edge_comm_bytes_formula(s, b, h, t, cfg.sequence_parallel, act_elem)),
               'dp_grad_wire_bytes_formula': dp.wire_bytes_formula['all_reduce'],
               'dp_grad_bytes_formula': 2 * (dp.size - 1) / dp.size * param_bytes}
        wire = self.wire.why_not if wire_bytes is None else f"{wire_bytes:,.0f}"
        print(f"[rank {rank}] tp {tp_group.rank}/{t} dp {dp.rank}/{dp.size}: "
              f"param bytes {param_bytes:,} (formula {row['param_bytes_formula']:,.0f}); "
              f"activation bytes/layer {self.activation_bytes:,} (formula {row['activation_bytes_formula']:,.0f}; "
              f"Megatron's, Korthikanti et al. {row['activation_bytes_korthikanti']:,.0f}, "
              f"{'with' if cfg.sequence_parallel else 'no'} SP); sent per step: collective bytes "
              f"{row['collective_bytes']:,} (counted: "
              + ', '.join(f"{k} {v:,}" for k, v in sent['collective_bytes'].items())
              + f"), wire bytes {row['wire_bytes_formula']:,.0f} (ring formula; Megatron's count for the "
              f"activations {row['tp_comm_bytes_formula']:,.0f}), {wire} (measured, loopback)", flush=True)
        rows = log_rank_rows(cfg.out_dir, row)
        if rank == 0 and rows[0]['wire_bytes'] and rows[0]['wire_bytes'] > 1.2 * rows[0]['wire_bytes_formula']:
            print("(more on the wire than the ring formula: with sequence parallelism half the collectives are "
                  "reduce-scatters, and gloo's reduce-scatter is an all-reduce underneath)")


def check_config(cfg, world_size):
    """Every bad combination, before any work: one line, the same on every rank."""
    if cfg.tp < 1 or world_size % cfg.tp:
        raise SystemExit(f"error: world size {world_size} is not divisible by tp={cfg.tp}")
    check_batch(cfg, world_size // cfg.tp, world_size)
    n_kv_head = cfg.n_head if cfg.n_kv_head is None else cfg.n_kv_head
    if cfg.n_head % cfg.tp or n_kv_head % cfg.tp:
        raise SystemExit(f"error: n_head ({cfg.n_head}) and n_kv_head ({n_kv_head}) must both be divisible by "
                         f"tp={cfg.tp}: each rank holds whole query and key/value heads")
    if cfg.sequence_parallel and cfg.block_size % cfg.tp:
        raise SystemExit(f"error: sequence_parallel needs block_size ({cfg.block_size}) divisible by tp={cfg.tp}")
    if cfg.dtype not in ('float32', 'bfloat16'):
        raise SystemExit(f"error: dtype must be float32 or bfloat16 for tensor_parallel.py, got {cfg.dtype!r} "
                         f"(float16's GradScaler would need its inf check shared by the tp ranks)")
    if cfg.compile:  # not wired in here: said rather than ignored
        raise SystemExit("error: --compile=True is not supported by tensor_parallel.py: pass --compile=False (a "
                         "config file that sets compile = True needs it after the file)")
    if cfg.init_from == 'resume':
        if os.path.exists(rank_ckpt_path(cfg.out_dir, 0)):  # its grid first (memory-mapped: little is read)
            check_rank_checkpoint(torch.load(rank_ckpt_path(cfg.out_dir, 0), map_location='cpu', weights_only=False,
                                             mmap=True), cfg, world_size)
        for r in range(world_size):
            if not os.path.exists(rank_ckpt_path(cfg.out_dir, r)):
                raise SystemExit(f"error: init_from=resume but there is no checkpoint at "
                                 f"{rank_ckpt_path(cfg.out_dir, r)} (resume needs the same world size)")


def check_rank_checkpoint(checkpoint, cfg, world_size):
    if checkpoint['tp'] != cfg.tp or checkpoint['world_size'] != world_size:
        raise SystemExit(f"error: init_from=resume: the checkpoint was written with --tp={checkpoint['tp']} on "
                         f"{checkpoint['world_size']} ranks, this run has --tp={cfg.tp} on {world_size}: resume with "
                         f"the saved ones, or python consolidate.py {cfg.out_dir} makes one ckpt.pt, which train.py, "
                         f"train_ddp.py, zero.py, train_fsdp.py and context_parallel.py continue from")


def rank_ckpt_path(out_dir, rank):
    return os.path.join(out_dir, f'ckpt_rank{rank}.pt')


def consolidate(out_dir):
    """The slices of data-parallel replica 0's tp ranks, joined (join_slices) into train.py's checkpoint dict: the
    whole model, and AdamW's state in train.py's order, each parameter with its own step."""
    def load(r):
        if not os.path.exists(rank_ckpt_path(out_dir, r)):
            raise SystemExit(f"error: consolidate: {out_dir} holds no {rank_ckpt_path(out_dir, r)}")
        return torch.load(rank_ckpt_path(out_dir, r), map_location='cpu', weights_only=False, mmap=True)
    first = load(0)
    ranks = [first] + [load(r) for r in range(1, first['tp'])]
    if len({r['iter_num'] for r in ranks}) != 1:  # a run stopped while saving can leave some ranks a save behind
        raise SystemExit(f"error: consolidate: the files ckpt_rank*.pt in {out_dir} are from different iterations")
    qkv_sizes, model_sd, states = qkv_split(GPTConfig(**first['model_args'])), {}, {}
    for i, (dense, (local, kind)) in enumerate(first['layout'].items()):
        progress(i + 1, len(first['layout']), f"consolidating {len(ranks)} tensor-parallel ranks (parameters)")
        model_sd[dense] = join_slices([r['model'][local] for r in ranks], kind, qkv_sizes).clone()
        saved = [r['optimizer']['state'].get(r['param_order'].index(local)) for r in ranks]
        if saved[0] is not None:  # (AdamW has no state for a parameter that never had a gradient)
            states[dense] = {k: torch.tensor(float(v)) if k == 'step' else
                             join_slices([s[k] for s in saved], kind, qkv_sizes) for k, v in saved[0].items()}
    if first['model_args'].get('tie_embeddings', True):  # train.py knows a tied embedding by both its names
        model_sd['lm_head.weight'] = model_sd['transformer.wte.weight']
    cfg = dict(first['config'], init_from='resume')
    return train_checkpoint(model_sd, adamw_state_dict(first['model_args'], states, cfg), [first['rng']],
                            first['model_args'], first['iter_num'], first['best_val_loss'], cfg)


def checkpoint_layout(model, layout, optimizer):
    """What consolidation needs to find each dense parameter in a rank's checkpoint: {dense name: (local name,
    kind)}, and the local names in the optimizer's order (the order its state_dict numbers them)."""
    local_name = {id(p): n for n, p in model.named_parameters()}
    layout = {dense: (local_name[id(p)], kind) for dense, (p, kind) in layout.items()}
    order = [local_name[id(p)] for group in optimizer.param_groups for p in group['params']]
    return layout, order


def train_step(model, optimizer, batches, ctx, grad_clip, tp, dp, layout):
    """train.py's iteration with the tensor-parallel forward, then the gradient syncs that tensor parallelism
    adds: the replicated parameters' over the tp ranks (sequence parallelism), every gradient over the dp replicas,
    and the clip over the whole model. Returns the mean loss over the global batch."""
    loss_sum = 0.0
    for x, y in batches:
        with ctx:
            _, loss = tp_forward(model, x, y, tp)
            loss = loss / len(batches)  # the gradient is the mean over the whole batch
        loss_sum += loss.detach()
        loss.backward()
    sync_tp_grads(layout, tp)
    average_gradients([p for p, _ in layout.values()], dp)  # data parallelism over the replicas
    if grad_clip != 0.0:
        clip_grad_norm(layout, tp, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return all_reduce(loss_sum, dp, 'scalars').item() / dp.size


def build_sharded(cfg, vocab_size, tp, dp_rank, world_size, ckpt_path):
    """train.py's GPT on the meta device (shapes only), cut to this rank's slices (shard_gpt), which alone get
    storage and then values: train.py's or GPT-2's (init_values, one dense tensor at a time) or this rank's
    checkpoint. Returns (model, layout, the checkpoint or None, iter_num, best_val_loss, the whole model's
    parameters and FLOPs per token)."""
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path, meta=True)
    dense_params, flops_per_token = model.get_num_params(), model.flops_per_token()  # of the whole model
    layout = shard_gpt(model, tp)  # on the meta device: this rank's slices, shapes only
    give_tp_ranks_their_dropout(model, tp)
    materialize(model, cfg.device)  # storage for the slices; their values come below
    if checkpoint is not None:
        check_rank_checkpoint(checkpoint, cfg, world_size)
        model.load_state_dict(checkpoint['model'])
        set_rng_state(checkpoint['rng'])  # this rank's own streams
    else:
        # train.py's (or GPT-2's) values, one dense tensor at a time, of which this rank keeps its slice
        init_values(cfg, model.config, keep_slices(layout, tp, model.config))
        seed_dropout(cfg.seed, dp_rank)  # the tp ranks of a replica share the stream; each replica its own
    return model, layout, checkpoint, iter_num, best_val_loss, dense_params, flops_per_token


def main(argv):
    cfg = configure(config, argv)
    check_config(cfg, world_size_from_env())
    rank, _, world_size, device = init_distributed(cfg.dist_timeout)
    cfg.device = device if world_size > 1 else cfg.device
    grid, coords, comms = process_grid(world_size, rank, dp=world_size // cfg.tp, tp=cfg.tp)
    tp, dp = TensorParallel(comms['tp'], cfg.sequence_parallel), comms['dp']
    print_grid(grid, coords, rank)

    # setup
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    ctx = autocast_context(device_type, cfg.dtype)

    # data
    data, vocab_size = load_dataset(cfg.dataset)

    # model: this rank's slices of train.py's GPT (build_sharded)
    ckpt_path = rank_ckpt_path(cfg.out_dir, rank)
    model, layout, checkpoint, iter_num, best_val_loss, dense_params, flops_per_token = build_sharded(
        cfg, vocab_size, tp, dp.rank, world_size, ckpt_path)
    if rank == 0:
        print(run_shape(f"world {world_size} = dp {dp.size} x tp {cfg.tp}"
                        f"{' with sequence parallelism' if cfg.sequence_parallel else ''}", cfg, dense_params))
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device_type)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint['optimizer'])
    checkpoint = None  # free it
    raw_model = model

    def loss_of(x, y):
        with ctx:
            return tp_forward(model, x, y, tp)[1]

    # training loop
    writer = CheckpointWriter()  # every rank writes its own checkpoint in the background
    profiler = StepProfiler(cfg.profile, cfg.out_dir, rank, cfg.device)  # --profile=N: a trace per rank
    logger = StepLogger(cfg, flops_per_token, n_devices=world_size)
    report = FirstStepReport(raw_model, layout, tp, dp, cfg, iter_num, ctx)  # measured beside the formulas
    while True:
        lr = get_lr(iter_num, cfg)
        set_lr(optimizer, lr)

        # evaluate, and checkpoint the state from which iteration iter_num starts
        if should_evaluate(iter_num, cfg):
            losses = evaluate(loss_of, model, data, cfg, iter_num, lr, dp)  # each replica its share of the batches
            if should_save(iter_num, losses['val'], best_val_loss, cfg):
                best_val_loss = min(best_val_loss, losses['val'])
                names, param_order = checkpoint_layout(raw_model, layout, optimizer)
                writer.save({'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), 'rng': rng_state(),
                             'layout': names, 'param_order': param_order, 'model_args': vars(raw_model.config),
                             'tp': cfg.tp, 'world_size': world_size, 'iter_num': iter_num,
                             'best_val_loss': best_val_loss, 'config': vars(cfg)}, ckpt_path)
            logger.restart()
        if iter_num == cfg.max_iters or cfg.eval_only:
            break

        # one iteration, then its log line
        batches = micro_batches(data, cfg, iter_num, dp.rank, dp.size)
        report.start(iter_num, batches[0][0])
        loss = train_step(model, optimizer, batches, ctx, cfg.grad_clip, tp, dp, layout)
        report.finish(iter_num)
        logger.step(iter_num, loss, lr)
        profiler.step()
        iter_num += 1
    profiler.stop()
    writer.wait()

    if rank == 0:
        if cfg.sample_at_end and not cfg.eval_only:
            print(f"sample with: python consolidate.py {cfg.out_dir} && "
                  f"python sample.py --out_dir={cfg.out_dir}")
        print(outputs_line(cfg.out_dir, "ckpt_rank*.pt (each rank's slices: resume; python consolidate.py "
                                        f"{cfg.out_dir} makes one ckpt.pt)", *profiled(cfg)))
    finish_distributed(cfg)


def print_grid(grid, coords, rank):
    """The process grid, and this rank's place in it: its tp group (a row) and dp group (a column)."""
    grid = grid.view(grid.size(0), -1)  # (dp, tp): pp and cp are 1 here
    if rank == 0:
        print(f"process grid (dp x tp) = torch.arange({grid.numel()}).view({grid.size(0)}, {grid.size(1)}):\n{grid}")
    print(f"[rank {rank}] tp group {grid[coords['dp']].tolist()} (tp rank {coords['tp']}), "
          f"dp group {grid[:, coords['tp']].tolist()} (dp rank {coords['dp']})", flush=True)


if __name__ == '__main__':
    run_main(main)
