"""
What each script prints on a measured step: the numbers measured (tensors held, the clock, this rank's own
socket bytes), counted (the tensors handed to our collectives) and modelled (the papers' formulas in
formulas.py), side by side in one table (measure.print_measured), and one log.jsonl row per rank. The scripts
measure; this file only lays their numbers out, one function per script.
"""

import os

import torch
import torch.distributed as dist

from common.distributed import added_resident_bytes, is_master
from common.formulas import (activation_bytes_formula, bubble_fraction_formula, comm_bytes_formula,
                             cp_comm_bytes_formula, ep_all_to_all_bytes_formula, ep_model_state_bytes_formula,
                             model_state_bytes_formula, p2p_comm_bytes_formula, param_bytes_formula,
                             peak_microbatches_formula, saved_bytes_formula, tp_comm_bytes_formula,
                             tp_edge_comm_bytes_formula, zb1_output_grad_bytes_formula)
from common.formulas import fsdp_comm_bytes_formula, fsdp_held_bytes_formula
from common.measure import comm_report, nbytes, print_measured, storage_bytes
from common.timelines import print_schedule_report, schedule_measurements
from model import GPT, MoE
from common.training import log_rank_rows
from common.model_parallel import GRID_DIMS


# -----------------------------------------------------------------------------
# zero.py: the bytes each rank holds (sampled through the step) and sends

def held_bytes(held):
    """Bytes of what a rank holds, by kind ({'param': tensors, 'grad': ..., 'optim': ..., 'host': ...}, what a
    strategy's held() returns): each distinct storage once (views of one buffer count once), in the first kind
    that holds it (in fp32 ZeRO's master chunk is a view of its flat parameter buffer)."""
    out, seen = {}, set()
    for kind in ('param', 'grad', 'optim', 'host'):
        out[kind + '_bytes'], seen = storage_bytes(held.get(kind, ()), seen)
    return out


def zero_step(z, comm, cfg, iter_num, at_rest, peak, wire_bytes, why_not):
    """One log.jsonl row per rank; rank 0 prints them all: held at rest beside the formula, the step's peak,
    bytes sent (this rank's own sockets, counted at the calls, the ring formula)."""
    formula = model_state_bytes_formula(z.numel, z.world_size, z.stage, cfg.dtype == 'bfloat16',
                                        cfg.offload_optimizer)
    kinds = ('param_bytes', 'grad_bytes', 'optim_bytes') + ('host_bytes',) * cfg.offload_optimizer
    row = {'iter': iter_num, 'rank': z.rank, 'stage': z.stage, 'world_size': z.world_size, 'numel': z.numel,
           'buckets': len(z.buckets), 'micro_steps': cfg.gradient_accumulation_steps // z.world_size,
           'offload_optimizer': cfg.offload_optimizer, 'wire_bytes': wire_bytes, 'wire_bytes_note': why_not,
           'collective_bytes': sum(comm.collective_bytes.values()),
           'collective_bytes_by_kind': dict(comm.collective_bytes),
           'wire_bytes_formula': sum(comm.wire_bytes_formula.values()),
           'wire_bytes_formula_by_kind': dict(comm.wire_bytes_formula),
           # the paper's count from Ψ alone (an independent model of the calls the ring formula prices)
           'comm_bytes_formula': comm_bytes_formula(z.numel, z.world_size, z.stage, z.dtype.itemsize,
                                                    cfg.gradient_accumulation_steps // z.world_size)}
    for k in ('param_bytes', 'grad_bytes', 'optim_bytes', 'host_bytes'):
        row.update({k: at_rest[k], f'{k}_formula': formula[k], f'peak_{k}': peak[k]})
    row['peak_saved_bytes'] = peak['saved_bytes']  # activations autograd keeps for backward (measured)
    # beside the tensors, the process: its resident set's peak so far, less torch (a CPU's; None on a GPU)
    row['mem_added_bytes'] = None if cfg.device.startswith('cuda') else added_resident_bytes()
    rows = log_rank_rows(cfg.out_dir, row)
    if z.rank != 0:
        return
    lines = [(f"rank {r['rank']} {k[:-6]}", r[k], None, r[k + '_formula']) for r in rows for k in kinds]
    lines += [(f"rank {r['rank']} bytes sent", r['wire_bytes'], r['collective_bytes'],
               r['wire_bytes_formula']) for r in rows]
    lines.append(("bytes sent per rank, the paper's (Ψ)", None, None, row['comm_bytes_formula']))
    resident = lambda r: '' if r['mem_added_bytes'] is None else \
        f"; its resident set, by the run, {r['mem_added_bytes']:,}"
    at_peak = lambda r: ', '.join(f"{k[:-6]} {r['peak_' + k]:,}" for k in kinds)
    notes = [f"rank {r['rank']} at its most in the step (each its own peak): {at_peak(r)}, activations saved "
             f"for backward {r['peak_saved_bytes']:,}" + resident(r) for r in rows]
    if z.stage == 3:
        notes.append("at its peak a ZeRO-3 rank holds, beyond its chunks, the blocks gathered whole (the one "
                     "computing, prefetch_blocks more) and the gradient buckets being filled and reduced; "
                     "its resident set holds more than tensors: torch's library pages as kernels are first "
                     "used, each gradient autograd makes before the hook copies it into its bucket "
                     "(docs/big_models.md)")
    by_kind = row['collective_bytes_by_kind']
    notes.append("counted by kind: " + ', '.join(f"{k} {v:,.0f}" for k, v in by_kind.items()))
    if wire_bytes is None:
        notes.append(f"wire bytes {why_not}")
    else:
        notes += gloo_reduce_scatter_note([row], "stages 2-3 run one in place, reduce_scatter_of")
    print_measured(f"iter {iter_num}: ZeRO stage {z.stage}, N = {z.world_size}, Ψ = {z.numel:,}: bytes "
                   f"each rank holds after the step (the paper's formula) and sends in it (its own sockets, "
                   f"counted at the calls, the ring formula)", lines, notes)


def gloo_reduce_scatter_note(rows, how):
    """The note for rows whose wire bytes are well above the ring formula's and that reduce-scattered: gloo's
    reduce-scatter is an all-reduce underneath (how: where this script's is made). [] for none."""
    if any(r['wire_bytes'] is not None and r['wire_bytes'] > 1.2 * r['wire_bytes_formula'] and
           any(k.endswith('reduce_scatter') for k in r['collective_bytes_by_kind']) for r in rows):
        return [f"more on the wire than the ring formula: on gloo a reduce-scatter is an all-reduce (gloo's "
                f"own is one underneath; {how}), 2(N-1)/N of the tensor, not (N-1)/N; NCCL's is a true ring "
                "reduce-scatter"]
    return []


# -----------------------------------------------------------------------------
# tensor_parallel.py: the grid, activations per layer, the tp and dp traffic

def tensor_parallel_step(iter_num, cfg, config, params, tp, dp, activation_bytes, wire_bytes, why_not):
    """tensor_parallel.py's measured step: a log.jsonl row per rank; rank 0 prints its numbers and each
    rank's own wire bytes (print_measured). params: this rank's parameter bytes; activation_bytes: one
    layer's, measured."""
    s, b, h, t, sp = cfg.block_size, cfg.batch_size, config.n_embd, tp.group.size, cfg.sequence_parallel
    elem, micro_steps = (4 if cfg.dtype == 'float32' else 2), cfg.gradient_accumulation_steps // dp.size
    sent, dense = comm_report([tp.group, dp]), not config.is_moe(0)  # (the layer measured: block 0)
    held_formula = param_bytes_formula(config, t)  # (the dp all-reduce is priced on these too)
    rows = log_rank_rows(cfg.out_dir, dict(
        rank=dist.get_rank() if dist.is_initialized() else 0, iter=iter_num, tp_rank=tp.group.rank,
        dp_rank=dp.rank, tp=t, dp=dp.size, sequence_parallel=sp, param_bytes=params,
        param_bytes_formula=held_formula, activation_bytes=activation_bytes,
        activation_bytes_formula=saved_bytes_formula(config, s, b, t, sp, elem) if dense else None,
        activation_bytes_korthikanti=activation_bytes_formula(s, b, h, config.n_head, t, sp,
                                                              bytes_per_elem=elem) if dense else None,
        collective_bytes=sum(sent['collective_bytes'].values()),
        collective_bytes_by_kind=sent['collective_bytes'],
        wire_bytes=wire_bytes, wire_bytes_formula=sum(sent['wire_bytes_formula'].values()),
        tp_activation_wire_bytes_formula=sum(v for k, v in tp.group.wire_bytes_formula.items()  # no grads
                                             if k in ('all_reduce', 'all_gather', 'reduce_scatter')),
        tp_comm_bytes_formula=micro_steps * (config.n_layer * tp_comm_bytes_formula(s, b, h, t, sp, elem)
                                             + tp_edge_comm_bytes_formula(s, b, h, t, sp, elem)),
        dp_grad_wire_bytes_formula=dp.wire_bytes_formula['all_reduce'],
        dp_grad_bytes_formula=2 * (dp.size - 1) / dp.size * held_formula))
    if not is_master():
        return
    r = rows[0]
    lines = [('parameter bytes', params, None, r['param_bytes_formula']),
             ('activation bytes, one layer', activation_bytes, None, r['activation_bytes_formula']),
             # saved_bytes_formula reads this code's saved tensors; Korthikanti's count is Megatron's (dropout
             # masks, an s x s attention matrix, the sequence chunk)
             ("  Megatron's count (Korthikanti)", None, None, r['activation_bytes_korthikanti']),
             # two models of the bytes sent: the ring formula priced at the calls we made, and the paper's
             # count from the shapes alone (what Megatron's layers would make)
             ('tp activations sent: the ring at our calls', None, None,
              r['tp_activation_wire_bytes_formula']),
             ("  the paper's count (2 all-reduces a layer each way)", None, None, r['tp_comm_bytes_formula']),
             ('dp gradients sent: the ring at our calls', None, None, r['dp_grad_wire_bytes_formula']),
             ("  the paper's count (an all-reduce of the slice)", None, None, r['dp_grad_bytes_formula'])]
    lines += [(f'handed to {kind}', None, n, None) for kind, n in r['collective_bytes_by_kind'].items()]
    lines += [(f"wire bytes, rank {q['rank']} (tp {q['tp_rank']}, dp {q['dp_rank']})", q['wire_bytes'],
               None, q['wire_bytes_formula']) for q in rows]
    notes = [f"wire bytes {why_not}"] if wire_bytes is None else []
    if wire_bytes is not None and wire_bytes > 1.2 * r['wire_bytes_formula']:  # (sequence parallelism's)
        notes.append("more on the wire than the ring formula: gloo's reduce-scatter (sequence parallelism's) "
                     "is an all-reduce underneath")
    if not dense:
        notes.append("block 0 is a mixture of experts: what its experts keep follows the router (the slots "
                     "it gives this rank's experts), so no formula; the paper's count of bytes sent is the "
                     "dense model's")
    if elem == 2:
        notes.append("activations modelled at 2 bytes: under bfloat16 autocast the residual stream and the "
                     "norms stay fp32")
    print_measured(f"iter {iter_num}: dp {dp.size} x tp {t}{' with sequence parallelism' if sp else ''}; "
                   "rank 0's numbers per step (measured: tensors held, this rank's sockets; counted: "
                   "handed to the calls; modelled: the formulas)",
                   lines, notes)


# -----------------------------------------------------------------------------
# pipeline.py: the grid, each stage's schedule timed, its bubble and its traffic

def report_pipeline(stage, clock, cfg, comms, wire, iter_num, rank, dp_rank):
    """Each rank's numbers beside the formulas (formulas.py: the bubble, the microbatches held, the bytes
    sent), a log row each; rank 0 prints dp replica 0's stages. clock: the stage's ScheduleClock."""
    m, p, v, s = cfg.n_microbatches, cfg.pp, cfg.virtual_stages, stage.index
    zb1 = cfg.schedule == 'zb1'
    held = peak_microbatches_formula(cfg.schedule, p, m, s, v)
    b, h = cfg.batch_size // m, stage.model.config.n_embd
    p2p = p2p_comm_bytes_formula(cfg.block_size, b, h, p, m, 4, s, v)
    # zb1: after B of microbatch k stage s holds p microbatches, s + 1 of them (k-s..k) with W's input too
    grads = zb1_output_grad_bytes_formula(stage.model.config, b, cfg.block_size, len(stage.chunks[0]),
                                          stage.is_first, stage.is_last, 2 if cfg.dtype != 'float32' else 4)
    grads = (s + 1) * grads if zb1 and grads is not None else (None if zb1 else 0)
    row = {'iter': iter_num, 'rank': rank, 'stage': s, 'dp_rank': dp_rank, 'schedule': cfg.schedule,
           **schedule_measurements(clock, comms, wire, stage.comm.collective_bytes['send']),
           'bubble_fraction_formula': bubble_fraction_formula(p, m, v, cfg.schedule),
           'peak_microbatches_held_formula': held,
           'peak_output_grad_bytes_formula': grads,
           'peak_activation_bytes_formula': None if grads is None else held * clock.microbatch_bytes + grads,
           'p2p_bytes_per_step_formula': cfg.gradient_accumulation_steps // comms[0].size * p2p}
    stages = [r for r in log_rank_rows(cfg.out_dir, row) if r['dp_rank'] == 0]
    if rank == 0:
        bubble = (f"(p-1)/(3m+p-1) (= (p-1)/(3m) = {(p - 1) / (3 * m):.3f} of the ideal compute, F = B = W)"
                  if zb1 else
                  f"(p-1)/(v·m+p-1) (= (p-1)/(v·m) = {(p - 1) / (v * m):.3f} of the ideal compute)")
        held = {'gpipe': 'm microbatches', '1f1b': 'p-r microbatches',
                'zb1': "p microbatches (r+1 of them with W's input, their output gradients)"}
        held = held.get(cfg.schedule, "2(p-r-1)+(v-1)p+1 chunk-microbatches (an upper bound: the embedding's "
                                      "and the loss's chunks hold more than the rest)")
        print_schedule_report(f"schedule {cfg.schedule}, p={p} stages, m={m} microbatches, v={v} chunks per "
                              f"stage, iter {iter_num}", stages, f"bubble {bubble}, held {held}",
                              os.path.join(cfg.out_dir, 'schedule_trace.json'), clock.name)


# -----------------------------------------------------------------------------
# parallel_4d.py: the grid and every dimension's traffic and state

def report_4d(clock, zeros, comms, wire, cfg, coords, iter_num, rank):
    """Each rank's model states (its ZeRO-1 engines' buffers: the dense part's, the experts') beside the ZeRO
    formula for its slices, the activations its stage held at a schedule's peak (clock: its ScheduleClock),
    and the bytes it sent (counted, the ring formula by dimension, its own sockets): one log row per rank, one
    table."""
    wire_bytes, sent = wire.sent, comm_report(comms)
    formulas = [model_state_bytes_formula(z.numel, z.world_size, 1, cfg.dtype == 'bfloat16') for z in zeros]
    held = {kind: [t for z in zeros for t in z.held().get(kind, ())] for kind in ('param', 'grad', 'optim')}
    row = {'rank': rank, 'iter': iter_num, **{f'{d}_rank': coords[d] for d in GRID_DIMS},
           'numel': sum(z.numel for z in zeros), **held_bytes(held),
           **{k + '_formula': sum(f[k] for f in formulas) for k in formulas[0]},
           'peak_activation_bytes': clock.peak_held_bytes,
           'collective_bytes_by_kind': sent['collective_bytes'],
           'collective_bytes': sum(sent['collective_bytes'].values()), 'wire_bytes': wire_bytes,
           'wire_bytes_formula': sum(sent['wire_bytes_formula'].values()), 'wire_bytes_note': wire.why_not}
    rows = log_rank_rows(cfg.out_dir, row)
    if rank == 0:
        print_measured(f"iter {iter_num}: what each rank holds (ZeRO-1's formula for its slice) and sends "
                       "per step (counted at the calls, the ring formula, its own sockets)",
                       [line for r in rows for line in (
                           *((f"rank {r['rank']} {k[:-6]}", r[k], None, r[k + '_formula'])
                             for k in ('param_bytes', 'grad_bytes', 'optim_bytes')),
                           (f"rank {r['rank']} activations at peak", r['peak_activation_bytes'], None, None),
                           (f"rank {r['rank']} bytes sent", r['wire_bytes'], r['collective_bytes'],
                            r['wire_bytes_formula']))],
                       [f"wire bytes {wire.why_not}"] if wire_bytes is None else
                       gloo_reduce_scatter_note(rows, "ZeRO-1's over dp x cp run one in place"))


# -----------------------------------------------------------------------------
# context_parallel.py: activations per layer, the attention's traffic and its time waiting on it

CP_REPORT = [  # what a measured step prints: (quantity, its row keys: measured, counted, modelled)
    ("activation bytes, one layer (1/cp)", 'activation_bytes', None, 'activation_bytes_formula'),
    ("  Megatron's count (Korthikanti), 1/cp", None, None, 'activation_bytes_korthikanti'),
    ('bytes sent by the attention', None, 'cp_attention_bytes', 'cp_attention_bytes_formula'),
    ('bytes sent, all groups', 'wire_bytes', 'collective_bytes', 'wire_bytes_formula'),
    ('attention layers: computing, s', 'attention_compute_s', None, None),
    ('attention layers: waiting on communication, s', 'attention_wait_s', None, None)]


def report_context_parallel(cfg, c, attention, comm, dp_cp, iter_num, activation_bytes, wire_bytes,
                            why_not, clock):
    """context_parallel.py's measured step: a log row per rank; rank 0 prints every rank's."""
    s, b, C, sent = cfg.block_size, cfg.batch_size, comm.size, comm_report([comm, dp_cp])
    elem, micro_steps = 2 if cfg.dtype == 'bfloat16' else 4, cfg.gradient_accumulation_steps * C // dp_cp.size
    moe = c.is_moe(0)
    rows = log_rank_rows(cfg.out_dir, {
        'rank': dp_cp.rank, 'iter': iter_num, 'cp_rank': comm.rank, 'cp': C, 'cp_attention': attention,
        # this repo's count for a block of s/cp tokens, and Megatron's; neither for an MoE block (the layer
        # measured: block 0)
        'activation_bytes': activation_bytes,
        'activation_bytes_formula': None if moe else saved_bytes_formula(c, s // C, b, 1, False, elem),
        'activation_bytes_korthikanti': None if moe else activation_bytes_formula(
            s, b, c.n_embd, c.n_head, 1, False, bytes_per_elem=elem) / C,
        'collective_bytes': sum(sent['collective_bytes'].values()),
        'collective_bytes_by_kind': sent['collective_bytes'],
        'wire_bytes_formula': sum(sent['wire_bytes_formula'].values()),
        'cp_attention_bytes': sum(v for k, v in comm.wire_bytes_formula.items()  # (not an MoE's routing)
                                  if k.split()[0] in ('kv', 'dkv', 'all_to_all')),
        'cp_attention_bytes_formula': micro_steps * c.n_layer * cp_comm_bytes_formula(
            s, b, c.n_head, c.n_kv_head, c.n_embd // c.n_head, C, attention, elem),
        'wire_bytes': wire_bytes, 'wire_bytes_note': why_not,
        'attention_compute_s': clock.layer_s - clock.wait_s, 'attention_wait_s': clock.wait_s})
    for r in rows if dp_cp.rank == 0 else []:
        print_measured(f"[rank {r['rank']}] cp {r['cp_rank']}/{C} ({attention}), iter {iter_num}:",
                       [(name, *(r.get(k) for k in keys)) for name, *keys in CP_REPORT],
                       ["activation bytes: this repo's count reads model.py's block, whose attention is "
                        "SDPA's; the difference is what the " + ("ring keeps in tensors of its own (q, k, "
                        "v, the output, the log-sum-exp)" if attention == 'ring' else
                        "all-to-alls' outputs keep")] * (not moe) +
                       ["bytes handed to the calls, by kind (of an all-to-all's, its own rank's block stays: "
                        f"{C - 1}/{C} is sent): " +
                        (', '.join(f"{k} {v:,}" for k, v in r['collective_bytes_by_kind'].items()) or 'none')]
                       + [r['wire_bytes_note']] * bool(r['wire_bytes_note']))


# -----------------------------------------------------------------------------
# expert_parallel.py: the load per expert and per rank, the all-to-all bytes, the model states

def report_expert_parallel(iter_num, cfg, model, optimizer, comms, measured, why_not):
    """A log.jsonl row per rank; rank 0 prints the load of the last micro-batch (tokens per expert and per
    rank), and each rank's all-to-all bytes, wire bytes and model states, beside the formulas."""
    (ep, edp, dp), c = comms, model.config
    a2a = {k: v for k, v in ep.collective_bytes.items() if k.startswith(('dispatch', 'combine'))}  # the rows'
    moe = [b.mlp for b in model.transformer.h if isinstance(b.mlp, MoE)]
    micro = cfg.gradient_accumulation_steps // dp.size
    uniform = ep_all_to_all_bytes_formula(cfg.batch_size * cfg.block_size, c.n_expert_active, c.n_embd,
                                          ep.size, 4, 2 if cfg.dtype == 'bfloat16' else 4)
    with torch.device('meta'):  # the whole model's counts (shapes only), not what this rank kept of it
        whole = GPT(c)
    experts = sum(p.numel() for n, p in whole.named_parameters() if '.mlp.experts.' in n)
    held = ep_model_state_bytes_formula(whole.get_num_params(False) - experts, experts, ep.size)
    moments = [s[k] for s in optimizer.state.values() for k in ('exp_avg', 'exp_avg_sq') if k in s]
    rows = log_rank_rows(cfg.out_dir, dict(
        rank=dist.get_rank() if dist.is_initialized() else 0, iter=iter_num, ep_rank=ep.rank,
        edp_rank=edp.rank, ep=ep.size, dp=dp.size, tokens_per_expert=model.tokens_per_expert.tolist(),
        all_to_all_bytes=sum(a2a.values()), all_to_all_bytes_by_kind=a2a,
        all_to_all_wire_bytes=sum(v for k, v in ep.wire_bytes_formula.items() if k in a2a),
        all_to_all_bytes_formula=len(moe) * micro * uniform['all_to_all_bytes'],
        all_to_all_wire_bytes_formula=len(moe) * micro * uniform['wire_bytes'],
        wire_bytes=measured['wire_bytes'],
        collective_bytes=sum(sum(m.collective_bytes.values()) for m in comms),  # counted at calls
        # what those calls put on the wire: the all-to-alls' off-rank rows exactly, all-reduces by the ring
        wire_bytes_formula=sum(sum(m.wire_bytes_formula.values()) for m in comms),
        param_bytes=nbytes(model.parameters()), grad_bytes=measured.get('grad_bytes'),
        optim_bytes=nbytes(moments),
        **{k + '_formula': v for k, v in held.items()}))
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    tokens = torch.tensor([r['tokens_per_expert'] for r in rows])  # (rank, MoE layer, expert)
    per_expert = tokens.sum(0)  # all ranks' slots per expert, each MoE layer
    per_rank = tokens.view(-1, ep.size, *tokens.shape[1:]).sum(1)  # (replica, layer, expert): an ep group's
    per_rank = per_rank.view(*per_rank.shape[:2], ep.size, -1).sum(-1)  # slots each ep rank computed
    load = lambda t: (t.max(-1).values / t.float().mean(-1)).max().item()
    lines = [(f"layer {i} tokens per expert", ', '.join(map(str, n.tolist())), None, None)
             for i, n in enumerate(per_expert)]
    lines += [('load max/mean: experts', load(per_expert), None, 1.0),
              ('load max/mean: ranks', load(per_rank), None, 1.0)]
    for r in rows:
        held_now = r['param_bytes'] + (r['grad_bytes'] or 0) + r['optim_bytes']
        lines += [(f"rank {r['rank']} all-to-all bytes", None, r['all_to_all_bytes'],
                   r['all_to_all_bytes_formula']),
                  (f"rank {r['rank']}   of them off-rank", None, r['all_to_all_wire_bytes'],
                   r['all_to_all_wire_bytes_formula']),
                  (f"rank {r['rank']} bytes sent", r['wire_bytes'], r['collective_bytes'],
                   r['wire_bytes_formula']),
                  (f"rank {r['rank']} model states", held_now, None, sum(held.values()))]
    print_measured(f"iter {iter_num}: dp {dp.size} = ep {ep.size} x {edp.size} replicas, {c.n_expert} "
                   f"experts (top-{c.n_expert_active}); tokens of the last micro-batch; bytes of the step "
                   f"(counted at the calls; modelled: the all-to-alls at uniform routing, and the bytes sent "
                   f"as the ring formula prices our calls, the all-to-alls' as routed)", lines,
                   ["all-to-all counted != modelled: the formula assumes the router spreads the slots "
                    "evenly; each rank's combine carries its experts' real load"] * (ep.size > 1)
                   + ([f"wire bytes {why_not}"] if why_not else []))


# -----------------------------------------------------------------------------
# train_fsdp.py: the bytes in each rank's shards

def report_fsdp(cfg, iter_num, model, optimizer, grads, micro_steps, wire):
    """Each rank's bytes (its shards after the step) and what its sockets sent, measured, and the formulas: a
    log row each, one table. grads: {'peak_grad_bytes', 'grad_bytes', 'activation_bytes' (the first block's)},
    measured by the observer; wire: its WireMeter (torch's FSDP2 makes the calls: none is counted at ours)."""
    numel = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the full parameter's
    moments = [s[k] for s in optimizer.state.values() for k in ('exp_avg', 'exp_avg_sq') if k in s]
    grads = dict(grads)
    activations = grads.pop('activation_bytes')
    measured = dict(grads, param_bytes=nbytes(model.parameters()), optim_bytes=nbytes(moments))
    formula = fsdp_held_bytes_formula(numel, dist.get_world_size(), micro_steps)
    row = {'iter': iter_num, 'rank': dist.get_rank(), 'numel': numel, 'micro_steps': micro_steps}
    for key, value in measured.items():
        row[key], row[key + '_formula'] = value, formula[key]
    gathered = 2 if cfg.dtype == 'bfloat16' else 4  # (the MixedPrecisionPolicy's param_dtype)
    row.update(wire_bytes=wire.sent, wire_bytes_note=wire.why_not, wire_bytes_formula=fsdp_comm_bytes_formula(
        numel, dist.get_world_size(), micro_steps, gathered))
    # one block's activations: the MixedPrecisionPolicy computes in bf16 without autocast (dropout 0, a block
    # kept whole; a mixture of experts follows its router: no formula)
    priced = cfg.dropout == 0 and not cfg.activation_checkpointing and not model.config.is_moe(0)
    row.update(activation_bytes=activations, activation_bytes_formula=saved_bytes_formula(
        model.config, cfg.block_size, cfg.batch_size, bytes_per_elem=gathered, fp32_weights=False,
        autocast=False, device_type=cfg.device.split(':')[0]) if priced else None)
    rows = log_rank_rows(cfg.out_dir, row)
    if dist.get_rank() == 0:
        print_measured(f"FSDP2, N = {len(rows)}, Ψ = {numel:,}: what each rank holds in its shards, sends in "
                       f"the step and keeps for backward",
                       [(f"rank {r['rank']} {k[:-6]}", r[k], None, r[k + '_formula'])
                        for r in rows for k in measured] +
                       [(f"rank {r['rank']} bytes sent", r['wire_bytes'], None, r['wire_bytes_formula'])
                        for r in rows] +
                       [("rank 0 activations", activations, None, row['activation_bytes_formula'])
                        ] * (not cfg.activation_checkpointing),  # (checkpointed: a block keeps none inside)
                       fsdp_notes(cfg, model, numel, micro_steps, len(rows), wire))


def fsdp_notes(cfg, model, numel, micro_steps, n, wire):
    """What report_fsdp's table needs said: the gradients' peak, how bytes sent are measured and modelled and
    why gloo's differ, what the activations are."""
    notes = [f"the gradients at their peak over {micro_steps} micro-step(s): " +
             ("4Ψ, unsharded, accumulated without a sync" if micro_steps > 1 else
              "4Ψ/N, one micro-step: each gradient reduce-scattered as it is made"),
             "bytes sent: the rank's own sockets, beside the ring formula (both gathers every micro-step, "
             "one reduce-scatter a step); none counted: torch makes FSDP2's calls"]
    if wire.sent is None:
        notes.append(f"wire bytes {wire.why_not}")
    elif n > 1:  # (gloo: a process's own sockets carry its bytes)
        extra = (n - 1) / n * 4 * numel
        notes.append(f"more on the wire than the ring formula: on gloo FSDP2's reduce-scatter is an "
                     f"all-reduce underneath, 2(N-1)/N of the gradients, not (N-1)/N: {extra:,.0f} "
                     f"more (measured a little less: in part, FSDP2 keeps the root's parameters gathered "
                     f"from forward to backward; and more where it pads a dim 0 that N does not divide)")
    if not cfg.activation_checkpointing:
        why = ('' if cfg.dropout == 0 and not model.config.is_moe(0) else
               ': no formula with dropout (its masks) or a mixture of experts (its router decides)')
        notes.append(f"activations: what block 0 saves for backward in the first micro-batch{why}")
    return notes
