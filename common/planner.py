"""
The memory planner: per-GPU memory and communication of every strategy for a model too large to run here, from
the same formulas (formulas.py) the scripts print beside what they measure; the cheapest strategy that fits,
its DeepSpeed config and torchrun command; the strategies that fit ranked by a step time modelled from stated
GPU figures (cluster_time.cluster_step_ms); and --check: three strategies run here on a small shape, estimate
beside measured. What it prints: plan_tables.py.

    python bench.py --estimate config/tinyllama_1b.py --gpus=8 --gpu_mem_gb=80 --micro_batch=1 --tp=8 --pp=4
    python bench.py --estimate config/llama2_7b.py --gpus=16 --global_batch=256 --json   # as JSON
    python bench.py --estimate --params=7.5e9 --gpus=64   # the ZeRO paper's example (model states only)
"""

import json
import math
import os
import re

import torch

from common import cluster_time, formulas
from common.plan_tables import estimate_json, model_state_markdown, print_checked, print_estimate
from model import GPT
from common.config import config_defaults, configure, model_config
from common.model_parallel import GRID_DIMS

GB = 1e9  # decimal gigabytes, as the ZeRO paper counts (16 bytes x 7.5B = 120 GB)


# -----------------------------------------------------------------------------
# --estimate: per-GPU memory and communication of each strategy, from the formulas of the scripts

# A vocabulary size in a config file's comments: "# vocab_size: 32000", "vocab_size = 32000" or "(V = 32000;"
# (vocab_size is not a config key: a run takes it from its data set)
VOCAB_HINT = re.compile(r'^\s*#.*?\b(?:vocab_size\s*[:=]|V\s*=)\s*(\d+)', re.MULTILINE)


def config_vocab_size(config_path):
    """The vocabulary size a config file names in a comment (VOCAB_HINT), else None."""
    hint = VOCAB_HINT.search(open(config_path).read()) if config_path else None
    return int(hint.group(1)) if hint else None


def gpt_config_from(config_path, overrides, vocab_size):
    """The GPTConfig `python train.py config_path overrides...` would build, with vocab_size given (a real
    run's data set sets it), else the one the config file names (config_vocab_size), else 50304."""
    vocab_size = vocab_size or config_vocab_size(config_path) or 50304
    cfg = configure(config_defaults({}), ([config_path] if config_path else []) + list(overrides))
    return model_config(cfg, vocab_size)


def param_counts(gptconf, pp=1):
    """Parameters counted on the meta device (no memory): the whole model, and the largest pipeline stage (its
    n_layer/pp blocks, plus the embeddings on the first and the final norm and head on the last; a tied
    embedding is held by both, as Megatron does). A mixture of experts: its routed experts (all of them: what
    memory holds), and the active parameters (those one token multiplies: k of each MoE layer's experts, what
    FLOPs count)."""
    with torch.device('meta'):
        model = GPT(gptconf)
    total = sum(p.numel() for p in model.parameters())
    per_block = [sum(p.numel() for p in b.parameters()) for b in model.transformer.h]
    first = sum(p.numel() for m in (model.transformer.wte, model.transformer.wpe) if m is not None
                for p in m.parameters())
    last = sum(p.numel() for p in model.transformer.ln_f.parameters()) + model.lm_head.weight.numel()
    stages = [total] if pp == 1 else []
    if pp > 1 and gptconf.n_layer % pp == 0:
        k = gptconf.n_layer // pp
        stages = [sum(per_block[i * k:(i + 1) * k]) for i in range(pp)]
        stages[0] += first
        stages[-1] += last
    experts = sum(p.numel() for n, p in model.named_parameters() if '.mlp.experts.' in n)
    idle = experts * (1 - gptconf.n_expert_active / gptconf.n_expert) if gptconf.n_expert else 0
    return dict(total=total, active=total - round(idle), experts=experts, block_max=max(per_block),
                root=total - sum(per_block), pp_stage_max=max(stages) if stages else None)


model_states = formulas.model_state_bytes_formula  # bytes per rank of the model states: the ZeRO paper's


def strategies(gpus, tp, pp, cp, ep=1, n_expert=0):
    """(name, shape) of each strategy the estimate prices, from the least added cost to the most:
    communication volume first (DDP = ZeRO-1 = ZeRO-2 < ZeRO-3 < tensor parallelism's per-layer collectives),
    then the pipeline's bubble, then context parallelism's ring, then offload's traffic over PCIe."""
    def shape(**k):
        return dict(dict(dp=1, tp=1, pp=1, cp=1, ep=1, stage=0, sp=False, schedule=None, offload=False,
                         fsdp=False), **k)
    rows = [('DDP', shape(dp=gpus))] + [(f'ZeRO-{s}', shape(dp=gpus, stage=s)) for s in (1, 2, 3)]
    rows += [('FSDP2 (full shard = ZeRO-3)', shape(dp=gpus, stage=3, fsdp=True))]
    if ep > 1 and gpus % ep == 0:  # a mixture of experts: its experts split over ep of the dp ranks
        rows += [(f'dp={gpus} with EP={ep} (each expert on 1 of {ep} ranks)', shape(dp=gpus, ep=ep))]
    # parallel_4d.py --tp --ep: the largest ep dividing ep and dp, whole experts on each ep x tp rank
    grid_ep = max((d for d in range(1, ep + 1) if tp > 1 and gpus % tp == 0 and ep % d == 0
                   and (gpus // tp) % d == 0 and n_expert % (d * tp) == 0), default=1)
    if grid_ep > 1:
        rows += [(f'dp={gpus // tp} x TP={tp} + SP, EP={grid_ep} in dp, ZeRO-1',
                  shape(dp=gpus // tp, tp=tp, sp=True, ep=grid_ep, stage=1))]
    if tp > 1 and gpus % tp == 0 and gpus > tp:
        # (the grid rows: parallel_4d.py, whose dp is ZeRO-1)
        rows += [(f'dp={gpus // tp} x TP={tp} + SP, ZeRO-1', shape(dp=gpus // tp, tp=tp, sp=True, stage=1))]
    if tp > 1:
        rows += [(f'TP={tp}', shape(tp=tp)), (f'TP={tp} + SP', shape(tp=tp, sp=True))]
    if pp > 1 and gpus % pp == 0 and gpus > pp:
        rows += [(f'dp={gpus // pp} x PP={pp} 1F1B, ZeRO-1', shape(dp=gpus // pp, pp=pp, schedule='1f1b',
                                                                  stage=1))]
    if pp > 1:
        rows += [(f'PP={pp} 1F1B', shape(pp=pp, schedule='1f1b')),
                 (f'PP={pp} ZB-H1', shape(pp=pp, schedule='zb1')),  # 1F1B's first-stage memory, less bubble
                 (f'PP={pp} GPipe', shape(pp=pp, schedule='gpipe'))]
    if cp > 1:
        rows += [(f'CP={cp} ring', shape(dp=gpus // cp, cp=cp))]
    return rows + [('ZeRO-3 + offload', shape(dp=gpus, stage=3, offload=True))]


def model_states_of(gptconf, k, counts, mixed_precision, micro_steps=1):
    """(the parameters a rank holds, {param_bytes, grad_bytes, optim_bytes, ...}) for strategy shape k. With
    experts split over ep ranks: expert_parallel.py keeps DDP's states, the dense weights whole and 1/ep of
    the experts; parallel_4d.py (tp > 1) keeps 1/tp of the dense weights and n_expert/(ep·tp) whole experts,
    each part's AdamW state sharded (ZeRO-1) over the ranks that hold the same: dp x cp, and dp x cp / ep.
    FSDP2 keeps fp32 shards and fp32 gradients, and over micro_steps > 1 the whole gradients (its own split,
    formulas.fsdp_held_bytes_formula: the same 16 bytes a parameter over N, plus those)."""
    t, dp, c, ep, stage = k['tp'], k['dp'], k['cp'], k['ep'], k['stage']
    numel = (math.ceil(formulas.param_bytes_formula(gptconf, t, bytes_per_elem=1)) if t > 1 else
             counts['pp_stage_max'] if k['pp'] > 1 else counts['total'])
    if k['fsdp']:
        held = formulas.fsdp_held_bytes_formula(numel, dp, micro_steps)
        return numel, {'param_bytes': held['param_bytes'], 'grad_bytes': held['peak_grad_bytes'],
                       'optim_bytes': held['optim_bytes'], 'host_bytes': 0}
    if ep == 1:
        # zero.py holds bf16 weights and an fp32 master (2+2+12 bytes, the ZeRO paper's count); the stage-0
        # scripts keep fp32 weights and gradients under autocast (4+4+8): the same total, split differently
        return numel, formulas.model_state_bytes_formula(numel, dp * c, stage, mixed_precision and stage > 0,
                                                         k['offload'])
    experts = counts['experts'] // t  # a tp rank's routed experts (whole ones)
    dense = numel - experts if t > 1 else counts['total'] - counts['experts']
    if t == 1:
        return dense + experts // ep, formulas.ep_model_state_bytes_formula(dense, experts, ep)
    parts = [formulas.model_state_bytes_formula(n, w, 1, mixed_precision)
             for n, w in ((dense, dp * c), (experts // ep, dp * c // ep))]
    return dense + experts // ep, {key: sum(part[key] for part in parts) for key in parts[0]}


def estimate(gptconf, gpus, gpu_mem_gb, micro_batch, seq_len, tp, pp, cp, n_microbatches, mixed_precision,
             ep=1, global_batch=None):
    """One dict per strategy: model-state bytes, activation and logits bytes with and without activation
    checkpointing, bytes communicated per step, and whether it fits (activations_of, comm_per_step). Each
    replica runs n_microbatches micro-batches a step; with global_batch (sequences a step), each row as many
    as make that batch: global_batch / (dp x micro_batch)."""
    s, a, L = seq_len, gptconf.n_head, gptconf.n_layer
    rows = []
    for name, k in strategies(gpus, tp, pp, cp, ep, gptconf.n_expert):
        dp, t, p, c, stage = k['dp'], k['tp'], k['pp'], k['cp'], k['stage']
        row = dict(strategy=name, gpus_used=dp * t * p * c, zero_stage=stage, sequence_parallel=k['sp'],
                   schedule=k['schedule'], offload=k['offload'], notes=[], ep=k['ep'],
                   **{x: k[x] for x in GRID_DIMS})
        by_batch = global_batch is not None
        m = row['n_microbatches'] = global_batch // (dp * micro_batch) if by_batch else n_microbatches
        problems = [msg for bad, msg in [
            (by_batch and global_batch % (dp * micro_batch),
             f"global batch {global_batch} not divisible by dp={dp} x micro_batch={micro_batch}"),
            (p > 1 and k['schedule'] in ('1f1b', 'zb1') and m < p,  # (pipeline.py refuses it)
             f"{k['schedule']} needs n_microbatches {m} >= pp={p} to fill the pipeline"),
            (row['gpus_used'] > gpus, f"needs {row['gpus_used']} GPUs"),
            (a % t or gptconf.n_kv_head % t, f"heads ({a}, kv {gptconf.n_kv_head}) not divisible by tp={t}"),
            (L % p, f"n_layer {L} not divisible by pp={p}"),
            (s % (2 * c) if c > 1 else 0, f"seq_len {s} not divisible by 2 x cp={c} (the zig-zag split)"),
            (k['sp'] and s % t, f"seq_len {s} not divisible by tp={t} (sequence parallelism)"),
            (k['ep'] > 1 and gptconf.n_expert % (k['ep'] * t),
             f"n_expert {gptconf.n_expert} not divisible by ep={k['ep']} x tp={t}")] if bad]
        if problems:
            rows.append(dict(row, error=problems[0]))
            continue
        numel, states = model_states_of(gptconf, k, param_counts(gptconf, p), mixed_precision, m)
        row.update(states, params_per_rank=numel)
        if k['schedule'] == 'zb1':
            row['notes'].append("ZB-H1 also holds W's input (formulas.zb1_output_grad_bytes_formula), not "
                                "priced here; pipeline.py refuses it with activation checkpointing")
        if gptconf.n_expert:
            row['notes'].append("MoE activations are priced as the dense block's (one MLP a token): an MoE "
                                "layer keeps about k times the MLP's, and the k dispatched rows")
        row['model_state_bytes'] = row['param_bytes'] + row['grad_bytes'] + row['optim_bytes']
        if stage == 3 and ep == 1:  # ZeRO-3, FSDP2 at their peak (zero.py's Zero.held measures it): whole
            whole = param_counts(gptconf)  # the root (gathered all step), two blocks and their gradients
            # (FSDP2 accumulating over micro-steps: the blocks' gradients are its whole ones, in grad_bytes)
            blocks = 2 if k['fsdp'] and m > 1 else 4
            row['gathered_bytes'] = ((whole['root'] + blocks * whole['block_max'])
                                     * stream_bytes(mixed_precision, stage))
            row['notes'].append("ZeRO-3 and FSDP2 rows count, at their peak, the embeddings and head, the "
                                "block computing and the one prefetched, and their gradients, whole")
        row.update(activations_of(gptconf, k, s, micro_batch, m, mixed_precision))
        if p > 1:
            row['bubble_fraction'] = formulas.bubble_fraction_formula(p, m,
                                                                      schedule=k['schedule'])
        row['comm_parts'] = comm_per_step(gptconf, k, s, micro_batch, m, numel, mixed_precision)
        row['comm_bytes_per_step'] = sum(nbytes for nbytes, _ in row['comm_parts'].values())
        held = row['model_state_bytes'] + row.get('gathered_bytes', 0)
        row['total_bytes'] = held + row['activations_and_logits_bytes']
        row['total_bytes_ckpt'] = held + row['activations_and_logits_bytes_ckpt']
        row['fits'] = ('yes' if row['total_bytes'] <= gpu_mem_gb * GB else
                       'with ckpt' if row['total_bytes_ckpt'] <= gpu_mem_gb * GB else 'no')
        rows.append(row)
    return rows


def stream_bytes(mixed_precision, stage):
    """Bytes an element of the residual stream: fp32 under autocast over fp32 weights (stage 0: train.py, DDP,
    tp, pp), in the compute dtype where the weights are in it (zero.py's stages, FSDP2, the grid's ZeRO-1)."""
    return 2 if mixed_precision and stage > 0 else 4


def activations_of(gptconf, k, s, b, m, mixed_precision):
    """A rank's activations for strategy shape k: what this repo's blocks save for backward
    (formulas.saved_bytes_formula, read off model.py's code and tested equal to the bytes measured) for the
    micro-batches a rank holds at once (1 without a pipeline, else formulas.peak_microbatches_formula: the
    first stage holds the most, GPipe m, 1F1B min(p, m)); with checkpointing each block's input plus one block
    recomputed at a time. The logits (formulas.logits_bytes_formula) come on top where the head is: every rank
    without a pipeline, else the last stage, with its own blocks' activations (GPipe: m micro-batches', 1F1B:
    one's). activations_and_logits_bytes: the larger of the first and the last stage's."""
    t, p, c, stage, V = k['tp'], k['pp'], k['cp'], k['stage'], gptconf.vocab_size
    act_bytes = 2 if mixed_precision else 4
    tokens, h = s // c, gptconf.n_embd  # context parallelism: each rank holds 1/cp of the sequence
    # zero.py and FSDP2 compute with bf16 weights, so a bf16 stream; the others autocast fp32 weights (a bf16
    # copy per layer), and their stream stays fp32. FSDP2 runs without autocast: its LayerNorms stay bf16
    layer = formulas.saved_bytes_formula(gptconf, tokens, b, t, k['sp'], act_bytes, fp32_weights=stage == 0,
                                         autocast=not k['fsdp'])
    block_input = tokens * b * h * stream_bytes(mixed_precision, stage) // (t if k['sp'] else 1)
    first, last = ((1, 1) if p == 1 else
                   (formulas.peak_microbatches_formula(k['schedule'], p, m, stage=i) for i in (0, p - 1)))
    layers = gptconf.n_layer // p
    # a vocabulary-parallel head (tensor_parallel.py) holds ceil(V/t) of the vocabulary on each rank
    logits = formulas.logits_bytes_formula(b * tokens, -(-V // t), act_bytes, losses_held=last)
    row = dict(activation_bytes_per_layer=layer, layers_per_rank=layers, microbatches_in_flight=first,
               activation_bytes=layers * first * layer,
               activation_bytes_ckpt=layers * first * block_input + layer, logits_bytes=logits)
    row['activations_and_logits_bytes'] = max(row['activation_bytes'], layers * last * layer + logits)
    row['activations_and_logits_bytes_ckpt'] = max(row['activation_bytes_ckpt'],
                                                   layers * last * block_input + layer + logits)
    return row


def comm_per_step(gptconf, k, s, b, m, numel, mixed_precision):
    """{group: (bytes, calls)}: what the busiest rank of strategy shape k sends per optimizer step over each
    of its groups ('dp' the gradients, 'dp gather' ZeRO-1's and 2's updated parameters, 'ep', 'tp', 'pp',
    'cp'), m micro-batches of b sequences of s tokens, in
    the dtype each script sends: the stage-0 scripts all-reduce fp32 gradients, zero.py reduces bf16 ones
    under bf16 (and ZeRO-2/3 at every micro-batch); tensor parallelism's collectives carry bf16 activations;
    a pipeline sends the residual stream and its gradient, fp32 under autocast (pipeline.py), in the weights'
    dtype on the grid (parallel_4d.py's ZeRO-1); the ring sends bf16 kv blocks and fp32 dK, dV
    (formulas.cp_comm_bytes_formula). A few scalars (the loss, the gradient norm) are left out; the calls are
    counted roughly (25 MB gradient buckets)."""
    dp, t, p, c, stage = k['dp'], k['tp'], k['pp'], k['cp'], k['stage']
    h, a, L = gptconf.n_embd, gptconf.n_head, gptconf.n_layer
    act_bytes = 2 if mixed_precision else 4
    grad_bytes = stream_bytes(mixed_precision, stage)  # (the gradients are in the weights' dtype too)
    comm = formulas.comm_bytes_formula(numel, dp * c, stage, grad_bytes, m) if dp * c > 1 else 0
    if k['fsdp'] and dp > 1:  # FSDP2: both gathers at every micro-batch, one fp32 reduce-scatter a step
        comm = formulas.fsdp_comm_bytes_formula(numel, dp, m, act_bytes)
    # ZeRO-1 and 2: of that, the updated parameters' all-gather after the step (the rest reduces gradients)
    gather = lambda n, ranks: (ranks - 1) / ranks * n * grad_bytes if stage in (1, 2) else 0
    gathered = gather(numel, dp * c)
    parts = {}
    # experts split over ep ranks (numel = the dense weights + 1/ep of a tp rank's experts, model_states_of):
    # expert_parallel.py all-reduces fp32 dense gradients over all dp ranks, each expert's over its dp/ep
    # replicas; parallel_4d.py (tp > 1) reduces them as ZeRO-1 over dp x cp and dp x cp / ep ranks
    if k['ep'] > 1:
        # and per MoE layer and micro-batch the all-to-alls (formulas.ep_all_to_all_bytes_formula)
        e, experts = k['ep'], param_counts(gptconf)['experts'] // t // k['ep']
        kind = (0, 4) if t == 1 else (stage, grad_bytes)
        comm = formulas.comm_bytes_formula(numel - experts, dp * c, *kind, m) + formulas.comm_bytes_formula(
            experts, dp * c // e, *kind, m)
        gathered = gather(numel - experts, dp * c) + gather(experts, dp * c // e) if t > 1 else 0
        a2a = formulas.ep_all_to_all_bytes_formula(b * s, gptconf.n_expert_active, h, e, 4, act_bytes)
        moe_layers = sum(map(gptconf.is_moe, range(L)))
        parts['ep'] = (moe_layers * m * a2a['wire_bytes'], 4 * moe_layers * m)
    if comm:
        parts['dp'] = (comm - gathered, 3 * (L // p) * m if stage == 3 else math.ceil(comm / 25e6))
    if gathered:
        parts['dp gather'] = (gathered, math.ceil(gathered / 25e6))
    if t > 1:
        per_layer = formulas.tp_comm_bytes_formula(s, b, h, t, k['sp'], bytes_per_elem=act_bytes)
        edges = formulas.tp_edge_comm_bytes_formula(s, b, h, t, k['sp'], bytes_per_elem=act_bytes)
        parts['tp'] = ((per_layer * L + edges) * m, (4 * L + 5) * m * (2 if k['sp'] else 1))
    # the busiest stage: a middle one, or the first, which with tied embeddings also all-reduces the
    if p > 1:
        # tied weight's gradient with the last stage once a step (embed_comm, as Megatron does);
        # it and the stream are fp32 under autocast, bf16 where the grid's ZeRO-1 keeps bf16 weights
        stream = stream_bytes(mixed_precision, stage)
        tied = formulas.comm_bytes_formula(gptconf.vocab_size * h, 2, 0, stream) * gptconf.tie_embeddings
        sent = lambda i: formulas.p2p_comm_bytes_formula(s, b, h, p, m, bytes_per_elem=stream, stage=i)
        parts['pp'] = (max(sent(None), sent(0) + tied), 2 * m + 1)  # the busiest stage, or the first
    if c > 1:
        parts['cp'] = (L * m * formulas.cp_comm_bytes_formula(s, b, a, gptconf.n_kv_head, h // a, c, 'ring',
                                                              act_bytes), L * m * (3 * (c - 1) + 1))
    return parts


def cheapest(rows, gpus):
    """The first strategy, in the table's order of added cost, that fits on all the GPUs: without activation
    checkpointing if any does (recomputing costs a third more compute), else with it. None if nothing fits."""
    for fits in ('yes', 'with ckpt'):
        for r in rows:
            if r.get('fits') == fits and r['gpus_used'] == gpus:
                return r['strategy'] + (' + ckpt' if fits == 'with ckpt' else '')
    return None


def ds_config_for(row, config_path, overrides, micro_batch, n_microbatches, mixed_precision):
    """The DeepSpeed JSON config of a strategy's data-parallel part (ZeRO stage, offload, batch, precision),
    as zero.py writes it (deepspeed_config.deepspeed_config_of) and reads it back (--deepspeed_config)."""
    from common.deepspeed_config import deepspeed_config_of
    # (zero.py's own keys that it writes)
    zero_keys = dict(stage=0, offload_optimizer=False, overlap_comm=True, adam_eps=1e-8)
    cfg = configure(config_defaults(zero_keys), ([config_path] if config_path else []) + list(overrides))
    ranks = row['dp']  # (cp ranks split sequences: the batch is dp's)
    cfg.stage, cfg.offload_optimizer = row['zero_stage'], row['offload']
    cfg.batch_size, cfg.gradient_accumulation_steps = micro_batch, n_microbatches * ranks
    cfg.dtype = 'bfloat16' if mixed_precision else 'float32'
    return deepspeed_config_of(cfg, ranks)


def largest_divisor(limit, *numbers):
    return max(d for d in range(1, limit + 1) if all(n % d == 0 for n in numbers))


def launch_command(row, ckpt, args, overrides, seq_len, n_micro, ds_path):
    """The torchrun command that runs a planned strategy with this repo's scripts: the script of its idea, its
    degrees, the micro-batch; beyond 8 GPUs, nodes of 8 (one command on every node; they meet at HOST)."""
    shape = [f"--{d}={row[d]}" for d in ('tp', 'pp', 'cp', 'ep') if row.get(d, 1) > 1]
    if row['pp'] > 1:  # a pipeline's micro-step is n_micro microbatches of micro_batch sequences
        # (with dp: parallel_4d.py, whose ZeRO-1 the row prices; pipeline.py's replicas keep whole states)
        script, flags = ('pipeline.py' if row['tp'] == row['cp'] == 1 == row['dp'] else 'parallel_4d.py'), [
            f"--schedule={row['schedule']}", f"--n_microbatches={n_micro}",
            f"--batch_size={args.micro_batch * n_micro}", f"--gradient_accumulation_steps={row['dp']}"]
    else:
        script = ('train_fsdp.py' if row['strategy'].startswith('FSDP') else
                  'parallel_4d.py' if row['dp'] > 1 and row['tp'] > 1 else
                  'expert_parallel.py' if row.get('ep', 1) > 1 else
                  'tensor_parallel.py' if row['tp'] > 1 else 'context_parallel.py' if row['cp'] > 1 else
                  'zero.py' if row['zero_stage'] or row['offload'] else 'train_ddp.py')
        flags = [f"--batch_size={args.micro_batch}", f"--gradient_accumulation_steps={n_micro * row['dp']}"]
        flags += ['--n_microbatches=1'] * (script == 'parallel_4d.py')  # (no pipeline: one forward a step)
    if script == 'zero.py':
        flags += [f"--deepspeed_config={ds_path}"] if ds_path else [f"--stage={row['zero_stage']}"]
    flags += ['--sequence_parallel=True'] * row['sequence_parallel']
    # (said either way when the config file turns checkpointing on: the row was priced without it)
    flags += [f'--activation_checkpointing={ckpt}'] * (ckpt or getattr(args, 'config_ckpt', False))
    flags += [f"--dtype={args.dtype}"]
    flags += ([f"--block_size={seq_len}"] if args.seq_len else []) + list(overrides)
    gpus = row['gpus_used']
    launch = (f"torchrun --standalone --nproc_per_node={gpus}" if gpus <= 8 else
              f"torchrun --nnodes={gpus // 8} --nproc_per_node=8 --rdzv_backend=c10d "
              f"--rdzv_endpoint=HOST:29500")
    return ' '.join([launch, script, args.estimate] + shape + flags)


def planned_model_flags(argv):
    """The flags in argv that bench.py's own parser shares with train.py's config and that shape the model:
    under --estimate they are the planned model's, not the bench's (as --key=value, however written)."""
    flags = []
    for i, arg in enumerate(argv):
        key, equals, value = arg.partition('=')
        if key in ('--n_layer', '--n_head', '--n_embd', '--block_size'):
            flags.append(f"{key}={value if equals else (argv[i + 1:] or [''])[0]}")
    return flags


def add_estimate_arguments(p):
    """bench.py's --estimate and the flags of the planner, on the argparse parser p."""
    p.add_argument('--estimate', nargs='?', const='', default=None, metavar='CONFIG',
                   help='plan memory for the model of a config file (config keys may follow as --key=value)')
    p.add_argument('--params', default=None, help='--estimate with a parameter count only (model states)')
    p.add_argument('--gpus', type=int, default=8, help='--estimate: the GPUs the model is planned for, '
                   'every strategy on all of them; --check: the processes run here')
    p.add_argument('--gpu_mem_gb', type=float, default=80)
    p.add_argument('--micro_batch', type=int, default=1, help='sequences per micro-batch per GPU')
    p.add_argument('--seq_len', type=int, default=None, help="default: the config's block_size")
    p.add_argument('--tp', type=int, default=None,
                   help='tensor-parallel degree (default: the largest <= 8 that fits)')
    p.add_argument('--pp', type=int, default=None,
                   help='pipeline stages (default: the largest <= 4 that fits)')
    p.add_argument('--cp', type=int, default=None,
                   help='context-parallel degree (default: the largest <= 4 that fits)')
    p.add_argument('--json', action='store_true', help='--estimate: print the estimate as JSON')
    p.add_argument('--check', action='store_true',
                   help='--estimate: run three of the strategies here (--gpus processes) and compare with '
                        'the estimate')
    p.add_argument('--n_microbatches', type=int, default=None,
                   help='micro-batches per step (estimate default: 2 x pp; bench pipeline rows: 4)')
    p.add_argument('--global_batch', type=int, default=None,
                   help='--estimate: sequences a step, the same for every row: each row runs global_batch / '
                        '(dp x micro_batch) micro-batches (default: --n_microbatches for every row)')
    p.add_argument('--vocab_size', type=int, default=None,
                   help='default: a "# vocab_size: N" line, else 50304')
    cluster_time.add_device_arguments(p)  # the stated GPUs a step is priced on


def command_for(choice, rows, args, overrides, seq_len, mixed, file_name='ds_config.json'):
    """(the DeepSpeed config's path, the torchrun command) of a chosen strategy ('NAME' or 'NAME + ckpt'),
    its config written into --out/file_name."""
    row = next(r for r in rows if choice.removesuffix(' + ckpt') == r['strategy'])
    n_micro = row['n_microbatches']
    os.makedirs(args.out, exist_ok=True)
    ds_path = os.path.join(args.out, file_name)
    with open(ds_path, 'w') as f:
        json.dump(ds_config_for(row, args.estimate, overrides, args.micro_batch, n_micro, mixed), f, indent=2)
    return ds_path, launch_command(row, choice.endswith(' + ckpt'), args, overrides, seq_len, n_micro,
                                   ds_path if row['zero_stage'] else None)


def check_flags(args):
    """One line for a flag the estimate cannot use: a global batch below 1, or with --check; a stated GPU
    figure (cluster_time.FIGURES) that is not positive."""
    batch = f"--global_batch={args.global_batch}"
    for bad, message in ((args.global_batch is not None and args.global_batch < 1,
                          f"{batch} must be at least 1"),
                         (args.global_batch is not None and args.check, f"{batch} and --check: --check runs "
                          "the scripts with --n_microbatches"),
                         *((getattr(args, k) is not None and getattr(args, k) <= 0,
                            f"--{k}={getattr(args, k)} must be positive") for k in cluster_time.FIGURES)):
        if bad:
            raise SystemExit(f"error: {message}")


def run_estimate(args, overrides, check=None):
    mixed = args.dtype != 'float32'
    if args.params:
        print(model_state_markdown(int(float(args.params)), args.gpus, mixed))
        return
    if not args.estimate or not os.path.isfile(args.estimate):
        raise SystemExit(f"error: --estimate needs a config file (or --params=N), got {args.estimate!r}")
    check_flags(args)
    gptconf = gpt_config_from(args.estimate, overrides, args.vocab_size)
    args.config_ckpt = configure(config_defaults({}), [args.estimate, *overrides]).activation_checkpointing
    hinted = args.vocab_size or config_vocab_size(args.estimate)
    vocab_note = '' if hinted else ' (the default: pass --vocab_size=N for another vocabulary)'
    seq_len = args.seq_len or gptconf.block_size
    # default degrees: the largest that divide the shape (tp: heads and kv heads, at most 8; pp: layers, at
    # most 4; cp: the sequence in 2·cp zig-zag chunks, at most 4)
    args.tp = args.tp or largest_divisor(min(args.gpus, 8), gptconf.n_head, gptconf.n_kv_head)
    args.pp = args.pp or largest_divisor(min(args.gpus, 4), gptconf.n_layer)
    args.cp = args.cp or largest_divisor(min(args.gpus, 4), seq_len // 2, args.gpus)
    counts = param_counts(gptconf)
    n_micro = args.n_microbatches or max(1, 2 * args.pp)  # (each row's own with --global_batch)
    # a mixture of experts: ep, the largest that divides the experts and the GPUs (at most 8: one node)
    ep = getattr(args, 'ep', None) or largest_divisor(min(args.gpus, 8), gptconf.n_expert or 1, args.gpus)
    rows = estimate(gptconf, args.gpus, args.gpu_mem_gb, args.micro_batch, seq_len, args.tp, args.pp, args.cp,
                    n_micro, mixed, ep, args.global_batch)
    best = cheapest(rows, args.gpus)
    # (an H100 SXM's dense peak; fp32 as the scripts run it on a GPU: TF32 matmuls, training.py turns them on)
    args.gpu_tflops = args.gpu_tflops or (989 if mixed else 495)
    ranked = cluster_time.fastest_first(rows, args.gpus, gptconf, seq_len, args.micro_batch, args)
    fastest = ranked[0]['strategy'] if ranked else None
    fastest_command = (command_for(fastest, rows, args, overrides, seq_len, mixed,
                                   'ds_config_fastest.json')[1]
                       if fastest not in (None, best) else None)
    ds_path, command = command_for(best, rows, args, overrides, seq_len, mixed) if best else (None, None)
    checked = check(args, overrides, rows, best, ds_path, n_micro) if args.check and check else None
    if args.json:
        print(json.dumps({'config': args.estimate, 'params': counts['total'],
                          'active_params': counts['active'],
                          'expert_params': counts['experts'], 'gpus': args.gpus,
                          'gpu_mem_gb': args.gpu_mem_gb, 'dtype': args.dtype, 'micro_batch': args.micro_batch,
                          'seq_len': seq_len, 'n_microbatches': None if args.global_batch else n_micro,
                          'global_batch': args.global_batch,
                          'strategies': estimate_json(rows),
                          'cheapest': best, 'ds_config': ds_path, 'command': command, 'checked': checked,
                          'device': {k: getattr(args, k) for k in cluster_time.FIGURES}, 'ranking': ranked,
                          'fastest': fastest,
                          'fastest_command': fastest_command or command}, indent=1))
        return
    print_estimate(args, gptconf, counts, rows, n_micro, seq_len, mixed, vocab_note)
    print(f"\ncheapest that fits on all {args.gpus} GPUs (the first in the table's order of added cost; "
          f"without recomputation if possible): {best or 'none'}"
          + (f"; its DeepSpeed config: {ds_path}" if ds_path else ''))
    if best:
        print(f"run it with:\n  {command}")
    print('\n' + '\n'.join(cluster_time.ranking_lines(ranked, args.gpus, args)))
    if fastest:
        print(f"\nfastest that fits, by this model: {fastest}" + (
            f"; run it with:\n  {fastest_command}" if fastest_command else ': the cheapest above'))
    if checked:
        print_checked(checked, args.gpus)

