"""
train.py plus context parallelism: the cp ranks of a group each hold 1/cp of every sequence (all the layers, all
the weights), and attention, the one place where tokens meet, is computed across the group. Two ways:

    torchrun --standalone --nproc_per_node=2 context_parallel.py --cp=2 --cp_attention=ring
    torchrun --standalone --nproc_per_node=2 context_parallel.py --cp=2 --cp_attention=ulysses
    torchrun --standalone --nproc_per_node=4 context_parallel.py --cp=2 --gradient_accumulation_steps=2  # dp=2 x cp=2

ring     (Liu et al. 2023, ring attention): the keys and values go around the ring of cp ranks in cp steps; each
         step's partial attention is merged into the result with the online softmax (running log-sum-exp, as
         FlashAttention does). Backward passes the keys and values around again, with their gradients.
ulysses  (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns sequence-sharded q, k, v into head-sharded
         whole sequences, ordinary attention runs on this rank's heads, and a second all-to-all turns it back.

The sequence is split "zig-zag": 2·cp chunks, rank i holding chunks i and 2·cp-1-i, so that under the causal mask
every rank has the same work at every ring step. Every token keeps its global position (learned positions and
RoPE), the weights are whole on every rank (their gradients are averaged over all dp x cp ranks), and the loss is
the mean over the whole global batch: the curve is train.py's. Checkpoints are train.py's format (ckpt.pt).
"""

import functools
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from formulas import activation_bytes_formula, cp_comm_bytes_formula
from model import GPT, apply_rope, rope_cos_sin
from training import (StepLogger, autocast_context, check_batch, config_defaults, configure, evaluate, get_lr,
                      load_dataset, log_rank_rows, micro_batches, outputs_line, print_sample, profiled,
                      run_main, run_shape, set_lr, should_evaluate, should_save)
from checkpoints import CheckpointWriter, gather_rng_states, init_model, restore_rng, train_checkpoint
from distributed import (Comm, average_gradients, finish_distributed, init_distributed, process_grid,
                         world_size_from_env)
from measure import StepProfiler, WireMeter, comm_report, saved_bytes_counter

# -----------------------------------------------------------------------------
# config: train.py's keys (training.TRAIN_DEFAULTS; `--help` lists them all), and these
init_from = 'scratch'           # 'scratch', 'resume' (out_dir/ckpt.pt, any script's) or a GPT-2 name: 'gpt2', ...
# context parallelism
dist_timeout = 60               # seconds a rank waits for the others before failing
cp = 2                          # context-parallel degree: ranks that split each sequence; world size = dp * cp
cp_attention = 'ring'           # 'ring' or 'ulysses'
config = config_defaults(globals())
# -----------------------------------------------------------------------------


@dataclass
class ContextParallel:
    """This rank's context-parallel group, the attention it runs, the global positions of the tokens it holds
    now (set by cp_forward for each batch), and the attention's time split while `timing` is on."""
    group: Comm
    attention: str = 'ring'
    positions: torch.Tensor = None
    timing: dict = None


def zigzag_positions(seq_len, cp_size, cp_rank, device='cpu'):
    """The global positions this rank holds: the sequence cut into 2·cp chunks, rank i taking chunks i and
    2·cp-1-i. Under the causal mask an early chunk sees few keys and a late one many: each rank gets one of each."""
    c = seq_len // (2 * cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)]).to(device)


# -----------------------------------------------------------------------------
# Ring attention, forward and backward written out (every send visible)


def block_attention(q, k, v, mask=None):
    """Attention of queries q (B, H, Lq, hd) on one block of keys and values (B, Hkv, Lk, hd), in fp32, keeping
    the softmax's log-sum-exp per query (B, H, Lq) so that blocks can be merged later. mask: True where allowed."""
    k, v = expand_kv(k, q.size(1)), expand_kv(v, q.size(1))
    with torch.autocast(q.device.type, enabled=False):  # fp32 even under bf16 autocast: these are statistics
        scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.size(-1))
        if mask is not None:
            scores = scores.masked_fill(~mask, float('-inf'))
        lse = torch.logsumexp(scores, dim=-1)
        return torch.softmax(scores, dim=-1) @ v.float(), lse


def expand_kv(x, n_head):
    """Grouped-query attention: each kv head serves n_head / n_kv_head query heads."""
    return x if x.size(1) == n_head else x.repeat_interleave(n_head // x.size(1), dim=1)


def merge(out, lse, block_out, block_lse, rows):
    """The online softmax: fold one block's normalized output and log-sum-exp into the running ones (rows of
    the local queries only), each weighted by its share of the new total."""
    new_lse = torch.logaddexp(lse[..., rows], block_lse)
    out[..., rows, :] = (out[..., rows, :] * torch.exp(lse[..., rows] - new_lse)[..., None]
                         + block_out * torch.exp(block_lse - new_lse)[..., None])
    lse[..., rows] = new_lse


def ring_step_blocks(step, src, cp_rank, positions):
    """Which of this rank's queries meet which of src's keys at this step, under the zig-zag split (L = 2c local
    tokens, two chunks of c). Step 0, its own keys: causal by position. An earlier rank's keys: only its first
    chunk is in the past, for all our queries. A later rank's keys: both its chunks are in the past of our second
    chunk only. Each step is c x 2c of work on every rank: none idles."""
    c = positions.numel() // 2
    if step == 0:
        return slice(None), slice(None), positions[:, None] >= positions[None, :]
    if src < cp_rank:
        return slice(None), slice(0, c), None
    return slice(c, 2 * c), slice(None), None


def ring_exchange(cp, tensors, kind):
    """Send tensors to the next rank of the ring and receive the previous rank's, posted together. Returns the
    received buffers and the works to wait for."""
    comm = cp.group
    next_rank, prev_rank = comm.global_rank((comm.rank + 1) % comm.size), comm.global_rank((comm.rank - 1) % comm.size)
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    sends, recvs = comm.send_recv([(t, next_rank) for t in tensors], [(r, prev_rank) for r in received], kind=kind)
    return received, sends + recvs


def wait_all(works, cp):
    start = timed(cp)
    for w in works:
        w.wait()
    add_time(cp, 'wait', start)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries on every rank's keys and values, which travel around the ring:
    at step s this rank holds the block of rank r-s, and sends it on to r+1 while it computes."""

    @staticmethod
    def forward(ctx, q, k, v, cp):
        B, H, L, hd = q.shape
        out, lse = torch.zeros(B, H, L, hd, device=q.device), torch.full((B, H, L), float('-inf'), device=q.device)
        kv = (k, v)
        for step in range(cp.group.size):
            works = []
            if step < cp.group.size - 1:  # post the next block's exchange first: it travels while we compute
                received, works = ring_exchange(cp, kv, 'kv')
            start = timed(cp)
            src = (cp.group.rank - step) % cp.group.size
            rows, cols, mask = ring_step_blocks(step, src, cp.group.rank, cp.positions)
            block_out, block_lse = block_attention(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], mask)
            merge(out, lse, block_out, block_lse, rows)
            add_time(cp, 'compute', start)
            if works:
                wait_all(works, cp)
                kv = tuple(received)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        """FlashAttention's backward, block by block: P = exp(S - lse) from the saved log-sum-exp, then dV = Pᵀ dO,
        dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)), dQ = dS K / √d, dK = dSᵀ Q / √d. A block's dK and dV travel with it
        and reach its owner after the last step."""
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        dout, scale = dout.float(), 1 / math.sqrt(q.size(-1))
        delta = (dout * out).sum(-1)
        dq = torch.zeros(q.shape, device=q.device)
        kv, dkv = (k, v), (torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device))
        n_head, group = q.size(1), q.size(1) // k.size(1)
        for step in range(cp.group.size):
            works = []
            if step < cp.group.size - 1:
                received, works = ring_exchange(cp, kv, 'kv')
            start = timed(cp)
            src = (cp.group.rank - step) % cp.group.size
            rows, cols, mask = ring_step_blocks(step, src, cp.group.rank, cp.positions)
            q_r, k_c, v_c = q[..., rows, :].float(), kv[0][..., cols, :].float(), kv[1][..., cols, :].float()
            k_e, v_e = expand_kv(k_c, n_head), expand_kv(v_c, n_head)
            with torch.autocast(q.device.type, enabled=False):
                scores = q_r @ k_e.transpose(-2, -1) * scale
                if mask is not None:
                    scores = scores.masked_fill(~mask, float('-inf'))
                p = torch.exp(scores - lse[..., rows, None])
                dv = p.transpose(-2, -1) @ dout[..., rows, :]
                ds = p * (dout[..., rows, :] @ v_e.transpose(-2, -1) - delta[..., rows, None])
                dq[..., rows, :] += ds @ k_e * scale
                dk = ds.transpose(-2, -1) @ q_r * scale
            B, _, Lk, hd = dk.shape  # fold the query heads that share a kv head back onto it
            dkv[0][..., cols, :] += dk.view(B, -1, group, Lk, hd).sum(2)
            dkv[1][..., cols, :] += dv.view(B, -1, group, Lk, hd).sum(2)
            add_time(cp, 'compute', start)
            if works:
                wait_all(works, cp)
                kv = tuple(received)
            dkv_received, works = ring_exchange(cp, dkv, 'dkv')  # the block's gradients follow it; the last
            wait_all(works, cp)                                    # exchange brings this rank's own home
            dkv = tuple(dkv_received)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


# -----------------------------------------------------------------------------
# Ulysses: two all-to-alls around ordinary attention


def seq_to_heads(x, cp):
    """(B, H, L, hd), this rank's tokens and every head -> (B, H/cp, cp·L, hd), every rank's tokens (in rank order)
    and this rank's heads."""
    B, H, L, hd = x.shape
    n = cp.group.size
    send = x.view(B, n, H // n, L, hd).transpose(0, 1).contiguous()  # the i-th slice goes to rank i
    out = torch.empty_like(send)
    start = timed(cp)
    cp.group.all_to_all(out, send)  # the i-th slice came from rank i: its tokens, our heads
    add_time(cp, 'wait', start)
    return out.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * L, hd)


def heads_to_seq(x, cp):
    """The inverse of seq_to_heads."""
    B, Hn, NL, hd = x.shape
    n = cp.group.size
    send = x.view(B, Hn, n, NL // n, hd).permute(2, 0, 1, 3, 4).contiguous()
    out = torch.empty_like(send)
    start = timed(cp)
    cp.group.all_to_all(out, send)
    add_time(cp, 'wait', start)
    return out.transpose(0, 1).reshape(B, n * Hn, NL // n, hd)


class SeqToHeads(torch.autograd.Function):
    """Ulysses' all-to-all; its backward is the inverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return seq_to_heads(x, cp)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad.contiguous(), ctx.cp), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return heads_to_seq(x, cp)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad.contiguous(), ctx.cp), None


def ulysses_attention(q, k, v, cp):
    """All-to-all to whole sequences of this rank's heads (kv heads too: n_kv_head divisible by cp), causal
    attention over them in global order (the gathered tokens come in zig-zag order: sorted by position, then put
    back), all-to-all back to this rank's tokens."""
    q, k, v = (SeqToHeads.apply(t, cp) for t in (q, k, v))
    n = cp.group.size
    seq_len = 2 * n * (cp.positions.numel() // 2)
    gathered = torch.cat([zigzag_positions(seq_len, n, r) for r in range(n)]).to(q.device)
    order = torch.argsort(gathered)
    q, k, v = (t[..., order, :] for t in (q, k, v))
    k, v = expand_kv(k, q.size(1)), expand_kv(v, q.size(1))
    start = timed(cp)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    add_time(cp, 'compute', start)
    y = y[..., torch.argsort(order), :]
    return HeadsToSeq.apply(y, cp)


# -----------------------------------------------------------------------------
# model.py's GPT with context-parallel attention


def cp_attention_forward(attn, cp, x):
    """CausalSelfAttention.forward for this rank's tokens: the same projections, RoPE at the tokens' global
    positions, and ring or Ulysses attention across the cp group in place of scaled_dot_product_attention."""
    B, L, _ = x.size()
    q, k, v = attn.c_attn(x).split([attn.n_head * attn.head_dim, attn.n_kv_head * attn.head_dim,
                                    attn.n_kv_head * attn.head_dim], dim=2)
    q, k, v = (t.view(B, L, -1, attn.head_dim).transpose(1, 2) for t in (q, k, v))
    if attn.rope:
        cos, sin = rope_cos_sin(int(cp.positions.max()) + 1, attn.head_dim, attn.rope_theta, x.device)
        cos, sin = cos[cp.positions], sin[cp.positions]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cp.attention == 'ring':
        y = RingAttention.apply(q, k, v, cp)
    else:
        y = ulysses_attention(q, k, v, cp)
    y = y.transpose(1, 2).contiguous().view(B, L, -1)
    return attn.resid_dropout(attn.c_proj(y))


def shard_sequence(model, cp):
    """Every block's attention runs across the cp group; the parameters (and their names) stay the dense model's,
    so checkpoints are train.py's. GPT.forward would treat this rank's tokens as a whole sequence: it raises."""
    for block in model.transformer.h:
        if hasattr(block, 'attn'):  # (a pipeline stage keeps only its own blocks)
            block.attn.forward = functools.partial(cp_attention_forward, block.attn, cp)
    model.forward = forward_needs_cp_forward


def forward_needs_cp_forward(*args, **kwargs):
    raise RuntimeError("this GPT's attention is context-parallel: run it with context_parallel.cp_forward on this "
                       "rank's part of each sequence; to sample, load the checkpoint into a plain GPT")


def cp_forward(model, idx, targets, cp):
    """GPT.forward on this rank's tokens of whole sequences idx (B, T): it keeps its zig-zag chunks, embeds them
    at their global positions, and returns (its logits, the mean loss over its tokens)."""
    cp.positions = zigzag_positions(idx.size(1), cp.group.size, cp.group.rank, idx.device)
    idx = idx[:, cp.positions]
    x = model.transformer.wte(idx)
    if model.transformer.wpe is not None:
        x = x + model.transformer.wpe(cp.positions)
    x = model.transformer.drop(x)
    for block in model.transformer.h:
        x = model.run_block(block, x)
    return model.head(x, None if targets is None else targets[:, cp.positions])


def timed(cp):
    """The start of a timed region when the attention's time is being split (one step): the host clock, after
    the device has caught up."""
    if cp.timing is None:
        return None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def add_time(cp, kind, start):
    if start is not None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        cp.timing[kind] = cp.timing.get(kind, 0.0) + time.perf_counter() - start


# -----------------------------------------------------------------------------
# The training loop


def train_step(model, optimizer, batches, ctx, grad_clip, cp, dp_cp):
    """train.py's iteration on this rank's tokens of its data-parallel rank's micro-batches; the weights are
    whole on every rank, so their gradients are averaged over all dp x cp ranks (every rank holds the same number
    of tokens: the mean of the ranks' means is the mean over the global batch). Returns that mean loss."""
    loss_sum = 0.0
    for x, y in batches:
        with ctx:
            _, loss = cp_forward(model, x, y, cp)
            loss = loss / len(batches)
        loss_sum += loss.detach()
        loss.backward()
    average_gradients(model.parameters(), dp_cp)
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # the same gradients on every rank
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dp_cp.all_reduce(loss_sum, kind='scalars')
    return loss_sum.item() / dp_cp.size


def build_cp(cfg, vocab_size, cp, dp, ckpt_path):
    """train.py's model and AdamW (from ckpt_path on resume, with this rank's dropout stream), its attention
    turned context-parallel (shard_sequence). Returns (model, optimizer, iter_num, best_val_loss)."""
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path)
    model.to(cfg.device)
    rank, world_size = dist.get_rank() if dist.is_initialized() else 0, dp.size * cp.group.size
    if rank == 0:
        print(run_shape(f"world {world_size} = dp {dp.size} x cp {cp.group.size} ({cfg.cp_attention} attention, "
                        f"{cfg.block_size // cp.group.size} tokens of each sequence per rank)", cfg,
                        model.get_num_params()))
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device_type)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint['optimizer'])
        restore_rng(checkpoint, rank, world_size, cfg.seed, dp.rank)
    shard_sequence(model, cp)
    return model, optimizer, iter_num, best_val_loss


def main(argv):
    cfg = configure(config, argv)
    check_config(cfg, world_size_from_env())
    rank, _, world_size, device = init_distributed(cfg.dist_timeout)
    cfg.device = device if world_size > 1 else cfg.device
    grid, coords, comms = process_grid(world_size, rank, dp=world_size // cfg.cp, cp=cfg.cp)
    cp, dp = ContextParallel(comms['cp'], cfg.cp_attention), comms['dp']
    dp_cp = Comm(None, 'dp_cp')  # the ranks that share the weights: all of them
    if rank == 0:
        print(f"process grid (dp x cp) = torch.arange({world_size}).view({dp.size}, {cp.group.size}): each row "
              f"splits its sequences, each column holds the same chunks of different data\n"
              f"{grid.view(dp.size, cp.group.size)}")

    # setup
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    ctx = autocast_context(device_type, cfg.dtype)

    # data
    data, vocab_size = load_dataset(cfg.dataset)

    # model: train.py's, whole on every rank; only its attention changes (build_cp)
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    model, optimizer, iter_num, best_val_loss = build_cp(cfg, vocab_size, cp, dp, ckpt_path)
    raw_model = model

    def loss_of(x, y):  # the mean over the whole batch: the mean of the cp ranks' means
        with ctx:
            loss = cp_forward(model, x, y, cp)[1].float()
        cp.group.all_reduce(loss, kind='scalars')
        return loss / cp.group.size

    # training loop
    writer = CheckpointWriter()  # rank 0 writes train.py's checkpoint in the background
    profiler = StepProfiler(cfg.profile, cfg.out_dir, rank, cfg.device)  # --profile=N: a trace per rank
    logger = StepLogger(cfg, raw_model.flops_per_token(), n_devices=world_size)
    report = FirstStepReport(raw_model, cp, dp_cp, cfg, iter_num, ctx)  # measured beside the formulas
    while True:
        lr = get_lr(iter_num, cfg)
        set_lr(optimizer, lr)

        # evaluate, and checkpoint the state from which iteration iter_num starts
        if should_evaluate(iter_num, cfg):
            losses = evaluate(loss_of, model, data, cfg, iter_num, lr, dp)
            if should_save(iter_num, losses['val'], best_val_loss, cfg):
                best_val_loss = min(best_val_loss, losses['val'])
                rng_states = gather_rng_states(dp_cp)
                if rank == 0:
                    writer.save(train_checkpoint(raw_model.state_dict(), optimizer.state_dict(), rng_states,
                                                 vars(raw_model.config), iter_num, best_val_loss, vars(cfg)),
                                ckpt_path)
            logger.restart()
        if iter_num == cfg.max_iters or cfg.eval_only:
            break

        # one iteration, then its log line
        batches = micro_batches(data, cfg, iter_num, dp.rank, dp.size)
        report.start(iter_num, batches[0][0])
        loss = train_step(model, optimizer, batches, ctx, cfg.grad_clip, cp, dp_cp)
        report.finish(iter_num)
        logger.step(iter_num, loss, lr)
        profiler.step()
        iter_num += 1
    profiler.stop()
    writer.wait()
    finish_distributed(cfg)

    if cfg.sample_at_end and not cfg.eval_only and rank == 0:  # a plain GPT with the same weights
        dense = GPT(raw_model.config)
        dense.load_state_dict(raw_model.state_dict())
        print_sample(dense.to(cfg.device), cfg, ctx)
    if rank == 0:
        print(outputs_line(cfg.out_dir, "ckpt.pt (train.py's format: resume, sample.py)", *profiled(cfg)))


def check_config(cfg, world_size):
    """Every bad combination, before any work: one line, the same on every rank."""
    if cfg.cp < 1 or world_size % cfg.cp:
        raise SystemExit(f"error: world size {world_size} is not divisible by cp={cfg.cp}")
    check_batch(cfg, world_size // cfg.cp, world_size)
    if cfg.cp_attention not in ('ring', 'ulysses'):
        raise SystemExit(f"error: --cp_attention={cfg.cp_attention} is not one of ring, ulysses")
    if cfg.block_size % (2 * cfg.cp):
        raise SystemExit(f"error: block_size ({cfg.block_size}) must be divisible by 2 x cp = {2 * cfg.cp}: each "
                         f"rank holds two equal chunks of every sequence (the zig-zag split)")
    n_kv_head = cfg.n_head if cfg.n_kv_head is None else cfg.n_kv_head
    if cfg.cp_attention == 'ulysses' and (cfg.n_head % cfg.cp or n_kv_head % cfg.cp):
        raise SystemExit(f"error: ulysses needs n_head ({cfg.n_head}) and n_kv_head ({n_kv_head}) divisible by "
                         f"cp={cfg.cp}: its all-to-all gives each rank whole heads")
    if cfg.dropout != 0.0:
        raise SystemExit(f"error: context_parallel.py needs dropout=0.0, got {cfg.dropout}: the attention "
                         f"probabilities' dropout would have to be replayed block by block in the ring's backward")
    if cfg.dtype not in ('float32', 'bfloat16'):
        raise SystemExit(f"error: dtype must be float32 or bfloat16 for context_parallel.py, got {cfg.dtype!r}")
    if cfg.compile:  # not wired in here: said rather than ignored
        raise SystemExit("error: --compile=True is not supported by context_parallel.py: pass --compile=False (a "
                         "config file that sets compile = True needs it after the file)")


# -----------------------------------------------------------------------------
# Measured, beside the formulas: the first iteration of the run


class FirstStepReport:
    """Activation bytes one layer saves for backward, measured (on this rank's tokens of the first micro-batch)
    beside 1/cp of Korthikanti et al.'s count for the whole sequence; the bytes sent in the step by kind (counted
    at the calls, the formula, the wire); and the attention's time split into computing and waiting on
    communication. Ring: its block math forward and backward, and the waits for the ring's exchanges. Ulysses:
    its forward attention (the backward runs inside autograd, untimed) and the all-to-alls, forward and back."""

    def __init__(self, model, cp, dp_cp, cfg, first_iter, ctx):
        self.model, self.cp, self.dp_cp, self.cfg, self.ctx = model, cp, dp_cp, cfg, ctx
        self.first_iter, self.wire = first_iter, WireMeter()

    def start(self, iter_num, x):
        if iter_num != self.first_iter:
            return
        model, cp = self.model, self.cp
        hooks, seen = saved_bytes_counter(model)
        with self.ctx, torch.enable_grad():
            cp.positions = zigzag_positions(x.size(1), cp.group.size, cp.group.rank, x.device)
            h = model.transformer.wte(x[:, cp.positions]).detach()
            with hooks:
                model.run_block(model.transformer.h[0], h)
        self.activation_bytes = sum(seen.values())
        cp.group.clear(), self.dp_cp.clear()
        cp.timing = {}
        self.wire.start()

    def finish(self, iter_num):
        if iter_num != self.first_iter:
            return
        wire_bytes = self.wire.stop()
        cfg, config, cp = self.cfg, self.model.config, self.cp
        timing, cp.timing = cp.timing, None
        s, b, h, C = cfg.block_size, cfg.batch_size, config.n_embd, cp.group.size
        act_elem, micro_steps = (2 if cfg.dtype == 'bfloat16' else 4), cfg.gradient_accumulation_steps // (
            self.dp_cp.size // C)
        sent = comm_report([cp.group, self.dp_cp])
        formula = micro_steps * config.n_layer * cp_comm_bytes_formula(s, b, config.n_head, config.n_kv_head,
                                                                       h // config.n_head, C, cfg.cp_attention,
                                                                       act_elem)
        rank = dist.get_rank() if dist.is_initialized() else 0
        row = {'rank': rank, 'iter': iter_num, 'cp_rank': cp.group.rank, 'cp': C, 'cp_attention': cfg.cp_attention,
               'activation_bytes': self.activation_bytes,
               'activation_bytes_formula': activation_bytes_formula(s, b, h, config.n_head, 1, False,
                                                                    bytes_per_elem=act_elem) / C,
               'collective_bytes': sum(sent['collective_bytes'].values()),
               'collective_bytes_by_kind': sent['collective_bytes'],
               'wire_bytes_formula': sum(sent['wire_bytes_formula'].values()),
               'wire_bytes_formula_by_kind': sent['wire_bytes_formula'],
               'cp_attention_bytes': sum(v for k, v in sent['wire_bytes_formula'].items()
                                         if k in ('cp kv', 'cp dkv', 'cp all_to_all')),
               'cp_attention_bytes_formula': formula,
               'wire_bytes': wire_bytes, 'wire_bytes_note': self.wire.why_not,
               'attention_compute_s': timing.get('compute', 0.0), 'attention_wait_s': timing.get('wait', 0.0)}
        wire = self.wire.why_not if wire_bytes is None else f"{wire_bytes:,.0f}"
        kinds = ', '.join(f"{k} {v:,}" for k, v in sent['collective_bytes'].items())
        print(f"[rank {rank}] cp {cp.group.rank}/{C} ({cfg.cp_attention}): activation bytes/layer "
              f"{self.activation_bytes:,} (formula 1/cp of the whole sequence's: "
              f"{row['activation_bytes_formula']:,.0f}); attention sent {row['cp_attention_bytes']:,.0f} B (formula "
              f"{formula:,.0f}); all sent: collective bytes {row['collective_bytes']:,} ({kinds}), wire "
              f"{row['wire_bytes_formula']:,.0f} (formula), {wire} (measured, loopback); attention time: computing "
              f"{1000 * row['attention_compute_s']:.1f} ms, waiting on communication "
              f"{1000 * row['attention_wait_s']:.1f} ms\n", end='', flush=True)  # one write: lines stay whole
        log_rank_rows(cfg.out_dir, row)


if __name__ == '__main__':
    run_main(main)
