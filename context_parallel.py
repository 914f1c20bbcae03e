"""
train.py plus context parallelism: the cp ranks of a group each hold 1/cp of every sequence (all the layers,
all the weights), and attention, the one place where tokens meet, is computed across the group. Two ways:

    torchrun --standalone --nproc_per_node=2 context_parallel.py --cp=2 --cp_attention=ring
    torchrun --standalone --nproc_per_node=2 context_parallel.py --cp=2 --cp_attention=ulysses
    torchrun --standalone --nproc_per_node=4 context_parallel.py --cp=2 --gradient_accumulation_steps=2

ring     (Liu et al. 2023, ring attention): the keys and values go around the ring of cp ranks in cp steps;
         each step's partial attention is merged into the result with the online softmax (running log-sum-exp,
         as FlashAttention does). Backward passes the keys and values around again, with their gradients.
ulysses  (DeepSpeed-Ulysses, Jacobs et al. 2023): all-to-alls turn sequence-sharded q, k, v (one each) into
         whole sequences of this rank's heads; plain attention runs on them; one more turns the output back.

The sequence is split "zig-zag": 2·cp chunks, rank i holding chunks i and 2·cp-1-i, so that under the causal
mask every rank has the same work at every ring step. Every token keeps its global position (learned positions
and RoPE); the weights are whole on every rank, their gradients averaged over all dp x cp ranks (the third
command: dp=2 x cp=2); the loss is the mean over the global batch: train.py's curve and checkpoint (ckpt.pt).
"""

import functools
import math
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from model import GPT, apply_rope, balance_routers, moe_loss, rope_cos_sin
from common.config import config_defaults, configure
from common.data import load_dataset, micro_batches
from common.training import (autocast_context, outputs_line, print_sample, profiled, run_main, run_shape,
                             start_run, training_loop)
from common.checkpoints import CheckpointWriter, gather_rng_states, init_model, restore_rng, train_checkpoint
from common.distributed import Comm, finish_distributed, world_size_from_env
from common.model_parallel import (AllToAll, along, average_gradients, check_context_parallel,
                                   configure_adamw, group_comm, process_grid)

# -----------------------------------------------------------------------------
# config: train.py's keys (common/config.py's TRAIN_DEFAULTS; `--help` lists them all), and these
out_dir = 'out-cp'              # each script its own folder: runs never overwrite one another
dist_timeout = 60               # seconds a rank waits for the others before failing
cp = 2                          # context-parallel degree: ranks that split each sequence; world = dp * cp
cp_attention = 'ring'           # 'ring' or 'ulysses'
measure_every = 0               # measure and report every this many steps too; 0: the first step only
config = config_defaults(globals())
# -----------------------------------------------------------------------------


@dataclass
class ContextParallel:
    """This rank's context-parallel group, the attention it runs, the global positions of the tokens it holds
    now (set by cp_forward for each batch)."""
    group: Comm
    attention: str = 'ring'
    positions: torch.Tensor = None


def zigzag_positions(seq_len, cp_size, cp_rank, device='cpu'):
    """The global positions this rank holds: the sequence cut into 2·cp chunks, rank i taking chunks i and
    2·cp-1-i. Under the causal mask an early chunk sees few keys and a late one many: each rank gets both."""
    c = seq_len // (2 * cp_size)
    starts = (cp_rank * c, (2 * cp_size - 1 - cp_rank) * c)  # (made on the device: no host-to-GPU copy)
    return torch.cat([torch.arange(start, start + c, device=device) for start in starts])


# Ring attention, forward and backward written out (every send visible)


def block_attention(q, k, v, mask=None):
    """Attention of queries q (B, H, Lq, hd) on one block of keys and values (B, Hkv, Lk, hd), in fp32, with
    the softmax's log-sum-exp per query (B, H, Lq) so that blocks merge later. mask: True where allowed."""
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
    """Which of this rank's queries meet which of src's keys at this step, under the zig-zag split (L = 2c
    local tokens, two chunks of c). Step 0, its own keys: causal by position. An earlier rank's keys: only its
    first chunk is in the past, for all our queries. A later rank's keys: both its chunks are in the past of
    our second chunk only. Each step is c x 2c of useful work on every rank (step 0: the 2c x 2c block, half
    of it masked): none idles."""
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
    next_rank = comm.global_rank((comm.rank + 1) % comm.size)
    prev_rank = comm.global_rank((comm.rank - 1) % comm.size)
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    sends, recvs = comm.send_recv([(t, next_rank) for t in tensors], [(r, prev_rank) for r in received],
                                  kind=kind)
    return received, sends + recvs


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries on every rank's keys and values, which travel around the ring:
    at step s this rank holds the block of rank r-s, and sends it on to r+1 while it computes."""

    @staticmethod
    def forward(ctx, q, k, v, cp):
        B, H, L, hd = q.shape
        out = torch.zeros(B, H, L, hd, device=q.device)
        lse = torch.full((B, H, L), float('-inf'), device=q.device)
        kv = (k, v)
        for step in range(cp.group.size):
            works = []
            if step < cp.group.size - 1:  # post the next block's exchange first: it travels while we compute
                received, works = ring_exchange(cp, kv, 'kv')
            src = (cp.group.rank - step) % cp.group.size
            rows, cols, mask = ring_step_blocks(step, src, cp.group.rank, cp.positions)
            block_out, block_lse = block_attention(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                                   mask)
            merge(out, lse, block_out, block_lse, rows)
            for w in works:
                w.wait()
            kv = tuple(received) if works else kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        """FlashAttention's backward, block by block: P = exp(S - lse) from the saved log-sum-exp, then
        dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)), dQ = dS K / √d,
        dK = dSᵀ Q / √d. A block's dK and dV travel with it and reach its owner after the last step."""
        (q, k, v, out, lse), cp = ctx.saved_tensors, ctx.cp
        dout, scale = dout.float(), 1 / math.sqrt(q.size(-1))
        delta = (dout * out).sum(-1)
        dq = torch.zeros(q.shape, device=q.device)
        kv, dkv = (k, v), (torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device))
        n_head, group = q.size(1), q.size(1) // k.size(1)
        for step in range(cp.group.size):
            works = []
            if step < cp.group.size - 1:
                received, works = ring_exchange(cp, kv, 'kv')
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
            for w in works:
                w.wait()
            kv = tuple(received) if works else kv
            if cp.group.size > 1:  # the block's gradients follow it; the last exchange brings this rank's own
                dkv_received, works = ring_exchange(cp, dkv, 'dkv')
                for w in works:
                    w.wait()
                dkv = tuple(dkv_received)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


# Ulysses: all-to-alls around ordinary attention (q, k, v each to heads, the output back: four, and four in
# backward)


def seq_to_heads(x, cp):
    """(B, H, L, hd), this rank's tokens and every head -> (B, H/cp, cp·L, hd), every rank's tokens (in rank
    order) and this rank's heads. An all-to-all with a backward (model_parallel.AllToAll: the gradient goes
    back by the same exchange), so autograd carries the layout changes around it."""
    B, H, L, hd = x.shape
    n = cp.group.size
    send = x.view(B, n, H // n, L, hd).transpose(0, 1).reshape(n, -1)  # the i-th row goes to rank i
    out = AllToAll.apply(send, cp.group, [1] * n, [1] * n, 'all_to_all')  # row i: rank i's tokens, our heads
    return out.view(n, B, H // n, L, hd).permute(1, 2, 0, 3, 4).reshape(B, H // n, n * L, hd)


def heads_to_seq(x, cp):
    """The inverse of seq_to_heads."""
    B, Hn, NL, hd = x.shape
    n = cp.group.size
    send = x.view(B, Hn, n, NL // n, hd).permute(2, 0, 1, 3, 4).reshape(n, -1)
    out = AllToAll.apply(send, cp.group, [1] * n, [1] * n, 'all_to_all')
    return out.view(n, B, Hn, NL // n, hd).transpose(0, 1).reshape(B, n * Hn, NL // n, hd)


def ulysses_attention(q, k, v, cp):
    """All-to-all to whole sequences of this rank's heads (kv heads too: n_kv_head divisible by cp), causal
    attention over them in global order (the gathered tokens come in zig-zag order: sorted by position, then
    put back), all-to-all back to this rank's tokens."""
    q, k, v = (seq_to_heads(t, cp) for t in (q, k, v))
    n = cp.group.size
    seq_len = 2 * n * (cp.positions.numel() // 2)
    gathered = torch.cat([zigzag_positions(seq_len, n, r, q.device) for r in range(n)])
    order = torch.argsort(gathered)
    q, k, v = (t[..., order, :] for t in (q, k, v))
    k, v = expand_kv(k, q.size(1)), expand_kv(v, q.size(1))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y[..., torch.argsort(order), :]
    return heads_to_seq(y, cp)


# model.py's GPT with context-parallel attention


def cp_attention_forward(attn, cp, x):
    """CausalSelfAttention.forward for this rank's tokens: the same projections, RoPE at the tokens' global
    positions, and ring or Ulysses attention across the cp group in place of scaled_dot_product_attention."""
    B, L, _ = x.size()
    q, k, v = attn.c_attn(x).split([attn.n_head * attn.head_dim, attn.n_kv_head * attn.head_dim,
                                    attn.n_kv_head * attn.head_dim], dim=2)
    q, k, v = (t.view(B, L, -1, attn.head_dim).transpose(1, 2) for t in (q, k, v))
    if attn.rope:
        # the whole sequence's table (cp ranks x L tokens), read at this rank's positions: no GPU sync
        cos, sin = rope_cos_sin(cp.group.size * L, attn.head_dim, attn.rope_theta, x.device)
        cos, sin = cos[cp.positions], sin[cp.positions]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    y = RingAttention.apply(q, k, v, cp) if cp.attention == 'ring' else ulysses_attention(q, k, v, cp)
    y = y.transpose(1, 2).contiguous().view(B, L, -1)
    return attn.resid_dropout(attn.c_proj(y))


def shard_sequence(model, cp):
    """Every block's attention runs across the cp group, and every MoE layer routes its tokens together with
    the other cp ranks' (route_across); the parameters (and their names) stay the dense model's: checkpoints
    are train.py's. GPT.forward would take this rank's tokens for a sequence: raises."""
    for block in model.transformer.h:
        if hasattr(block, 'attn'):  # (a pipeline stage keeps only its own blocks)
            block.attn.forward = functools.partial(cp_attention_forward, block.attn, cp)
    for moe in model.moe_layers():
        route_across(moe, cp)
    model.forward = forward_needs_cp_forward


# A mixture of experts across the cp ranks. One process routes a whole sequence's tokens together: the
# load-balancing loss counts the slots each expert got among all of them, and a capacity factor keeps an
# expert's first slots in token order. A cp rank holds some of each sequence's tokens, so it takes the
# others' counts: the loss's f_e from all the tokens (its P_e from its own: the cp ranks' means average to
# the whole), and the capacity counted over all the tokens, from where its chunks sit in the sequence.

def route_across(moe, cp):
    """The MoE layer's tokens per expert, summed over the cp group; with a capacity factor, the slots that
    the tokens before each of its own, on other ranks, gave each expert (earlier_slots)."""
    def together(counts):
        return cp.group.summed(counts.clone(), 'routing')
    moe.routed_together = together
    moe.earlier_slots = lambda index: earlier_slots(index, moe.n_expert, cp)


def earlier_slots(index, n_expert, cp):
    """For each of this rank's token-slots (N, k): the slots its expert took from tokens before its chunk in
    token order (every cp rank's, all gathered), less those this rank's own earlier chunks gave it (what
    model.within_capacity counts locally). A row's two chunks here are chunk r and 2cp-1-r of its 2cp."""
    n, L = cp.group.size, 2 * (cp.positions.numel() // 2)
    rows, c = index.size(0) // L, L // 2
    chunk_of_slot = (torch.arange(index.size(0), device=index.device) // c).repeat_interleave(index.size(1))
    mine = torch.zeros(rows * 2, n_expert, dtype=torch.long, device=index.device)
    mine.index_put_((chunk_of_slot, index.flatten()), torch.ones_like(chunk_of_slot), accumulate=True)
    every = mine.new_empty(n * mine.numel())
    cp.group.all_gather(every, mine.flatten())  # (rank, row, its chunk 0 | 1, expert)
    every = every.view(n, rows, 2, n_expert)
    ordered = torch.cat([every[:, :, 0], every[:, :, 1].flip(0)]).transpose(0, 1)  # (row, chunk 0..2n-1)
    before = ordered.flatten(0, 1).cumsum(0).view_as(ordered) - ordered  # slots of all chunks earlier
    here = torch.stack([before[:, cp.group.rank], before[:, 2 * n - 1 - cp.group.rank]], 1).flatten(0, 1)
    local_before = mine.cumsum(0) - mine
    return (here - local_before)[chunk_of_slot, index.flatten()]  # (one per slot, t*k + j)


def forward_needs_cp_forward(*args, **kwargs):
    raise RuntimeError("this GPT's attention is context-parallel: run it with context_parallel.cp_forward on "
                       "this rank's part of each sequence; to sample, load the checkpoint into a plain GPT")


def cp_forward(model, idx, targets, cp):
    """GPT.forward on this rank's tokens of whole sequences idx (B, T): it keeps its zig-zag chunks, embeds
    them at their global positions, and returns (its logits, the mean loss over its tokens)."""
    cp.positions = zigzag_positions(idx.size(1), cp.group.size, cp.group.rank, idx.device)
    idx = idx[:, cp.positions]
    x = model.transformer.wte(idx)
    if model.transformer.wpe is not None:
        x = x + model.transformer.wpe(cp.positions)
    x = model.transformer.drop(x)
    for block in model.transformer.h:
        x = model.run_block(block, x)
    logits, loss = model.head(x, None if targets is None else targets[:, cp.positions])
    if model.moe_layers() and loss is not None:  # a mixture of experts: its auxiliary loss, as GPT.forward
        loss = loss + moe_loss(model.moe_layers(), model.config)[0]
    return logits, loss


# The training step


def train_step(model, optimizer, batches, ctx, grad_clip, cp, dp_cp):
    """train.py's iteration on this rank's tokens of its data-parallel rank's micro-batches; the weights are
    whole on every rank, so their gradients are averaged over all dp x cp ranks (every rank holds the same
    number of tokens: the mean of the ranks' means is the mean over the global batch). Returns that mean."""
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
    balance_routers(model, lambda loads: dp_cp.summed(loads, 'router loads'))  # (x cp: sign() ignores it)
    dp_cp.all_reduce(loss_sum, kind='scalars')
    return loss_sum.item() / dp_cp.size


def mean_loss(model, ctx, cp, x, y):
    """The loss over whole sequences (evaluation): the mean of the cp ranks' means."""
    with ctx:
        loss = cp_forward(model, x, y, cp)[1].float()
    cp.group.all_reduce(loss, kind='scalars')
    return loss / cp.group.size


# Building it


def build_cp(cfg, vocab_size, rank, world_size, ckpt_path):
    """The dp x cp grid; train.py's model and AdamW (ckpt_path's on resume, with this rank's random streams),
    its attention made context-parallel. Returns model, optimizer, cp, dp, dp_cp, iter_num, best_val_loss."""
    grid, _, comms = process_grid(world_size, rank, dp=world_size // cfg.cp, cp=cfg.cp)
    cp, dp = ContextParallel(comms['cp'], cfg.cp_attention), comms['dp']
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path)
    model.to(cfg.device)
    if rank == 0:
        print(run_shape(f"world {world_size} = dp {dp.size} x cp {cfg.cp} ({cfg.cp_attention} attention, "
                        f"{cfg.block_size // cfg.cp} tokens of each sequence per rank)", cfg,
                        model.get_num_params()))
    optimizer = configure_adamw(model, cfg, checkpoint)
    if checkpoint is not None:
        restore_rng(checkpoint, rank, world_size, cfg.seed, dp.rank)
    shard_sequence(model, cp)
    dp_cp = group_comm('dp_cp', along(grid, 'dp', 'cp'), rank)  # every rank holds all the weights
    return model, optimizer, cp, dp, dp_cp, iter_num, best_val_loss


def save(writer, model, optimizer, dp_cp, cfg, iter_num, best_val_loss, ckpt_path):
    """The checkpoint: train.py's ckpt.pt, whole (every rank holds every weight: no layout of our own, nothing
    to consolidate), with every rank's random streams; rank 0 writes it in the background."""
    rng_states = gather_rng_states(dp_cp)
    if dp_cp.rank == 0:
        checkpoint = train_checkpoint(model.state_dict(), optimizer.state_dict(), rng_states,
                                      vars(model.config), iter_num, best_val_loss, vars(cfg))
        writer.save(checkpoint, ckpt_path, iter_num)


def main(argv):
    cfg = configure(config, argv)
    check_context_parallel(cfg, world_size_from_env())  # what it refuses, and why: common/model_parallel.py
    rank, world_size = start_run(cfg)
    ctx = autocast_context('cuda' if cfg.device.startswith('cuda') else 'cpu', cfg.dtype)
    data, vocab_size = load_dataset(cfg.dataset)
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')  # train.py's: the weights are whole on every rank
    model, optimizer, cp, dp, dp_cp, iter_num, best_val_loss = build_cp(cfg, vocab_size, rank, world_size,
                                                                        ckpt_path)
    writer = CheckpointWriter(cfg.max_iters)  # rank 0 writes the checkpoint in the background
    step = lambda it: train_step(model, optimizer, micro_batches(data, cfg, it, dp.rank, dp.size), ctx,
                                 cfg.grad_clip, cp, dp_cp)
    training_loop(cfg, SimpleNamespace(
        model=model, optimizer=optimizer, loss_of=functools.partial(mean_loss, model, ctx, cp), dp=dp,
        data=data, step=step, flops_per_token=model.flops_per_token(cfg.block_size), n_devices=world_size,
        rank=rank, save=lambda it, best: save(writer, model, optimizer, dp_cp, cfg, it, best, ckpt_path),
        kind='context_parallel', cp=cp, comms=[cp.group, dp_cp]), iter_num, best_val_loss)
    writer.wait()
    finish_distributed(cfg)
    if rank == 0 and cfg.sample_at_end and not cfg.eval_only:  # a plain GPT with the same weights
        dense = GPT(model.config)
        dense.load_state_dict(model.state_dict())
        print_sample(dense.to(cfg.device), cfg, ctx)
    if rank == 0:
        print(outputs_line(cfg.out_dir, "ckpt.pt (train.py's format: resume, sample.py)", *profiled(cfg)))


if __name__ == '__main__':
    run_main(main)
