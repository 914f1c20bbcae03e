"""
Every strategy of this repo side by side on the same model and data, measured beside the papers' formulas; and a
memory planner for models too large to run here.

    python bench.py                                   # CPU: every row on 2 gloo processes, a few minutes
    python bench.py --rows=train,zero2,tp --world_size=4 --max_iters=20 --out=out_bench
    python bench.py --plot                            # and draw it: loss curves, memory, communication (matplotlib)
    python bench.py --estimate config/tinyllama_1b.py --gpus=8 --gpu_mem_gb=80 --micro_batch=1 --tp=8 --pp=4
    python bench.py --estimate config/llama2_7b.py --gpus=8 --json     # the same as JSON; the cheapest that fits
    python bench.py --estimate config/train_stdlib_char.py --gpus=2 --tp=2 --pp=2 --vocab_size=96 --check
    python bench.py --estimate --params=7.5e9 --gpus=64   # the ZeRO paper's worked example (model states only)

The bench runs each script the way a user does (torchrun) and reads the numbers the script itself wrote to its
log.jsonl: timing and loss from the training rows, measured bytes and their formulas from the per-rank rows.
bench.py measures nothing itself and writes no formula: the estimate calls formulas.py, the very functions the
scripts print beside what they measure; --check runs three of the strategies here and prints what they measured
beside the estimate.
"""

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import torch

import formulas
from model import GPT
from training import configure, load_dataset, model_config
from distributed import GRID_DIMS

REPO = os.path.dirname(os.path.abspath(__file__))
GB = 1e9  # decimal gigabytes, as the ZeRO paper counts (16 bytes x 7.5B = 120 GB)


def fmt_bytes(n):
    """1.23 GB / 4.56 MB / 7.8 kB / 12 B; '-' for a missing number."""
    if n is None:
        return '-'
    for unit, scale in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


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
    """The GPTConfig that `python train.py config_path overrides...` would build, with vocab_size given (it comes
    from the data set in a real run); else the one the config file names (config_vocab_size), else 50304."""
    import train
    vocab_size = vocab_size or config_vocab_size(config_path) or 50304
    cfg = configure(train.config, ([config_path] if config_path else []) + list(overrides))
    return model_config(cfg, vocab_size)


def param_counts(gptconf, pp=1):
    """Parameters counted on the meta device (no memory): the whole model, and the largest pipeline stage (its
    n_layer/pp blocks, plus the embeddings on the first and the final norm and head on the last; a tied embedding
    is held by both, as Megatron does)."""
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
    return dict(total=total, pp_stage_max=max(stages) if stages else None)


def model_states(numel, dp, stage, mixed_precision):
    """Bytes per rank of parameters, gradients and optimizer state (the ZeRO paper's formula)."""
    return formulas.model_state_bytes_formula(numel, dp, stage, mixed_precision)


def strategies(gpus, tp, pp, cp, zero_stage):
    """(name, shape) of each strategy the estimate prices, from the least added cost to the most: communication
    volume first (DDP = ZeRO-1 = ZeRO-2 < ZeRO-3 < tensor parallelism's per-layer collectives), then the
    pipeline's bubble, then context parallelism's ring, then offload's traffic over PCIe."""
    def shape(**k):
        return dict(dict(dp=1, tp=1, pp=1, cp=1, stage=0, sp=False, schedule=None, offload=False), **k)
    rows = [('DDP', shape(dp=gpus))] + [(f'ZeRO-{s}', shape(dp=gpus, stage=s)) for s in (1, 2, 3)]
    rows += [('FSDP2 (full shard = ZeRO-3)', shape(dp=gpus, stage=3))]
    if tp > 1 and gpus % tp == 0 and gpus > tp:
        rows += [(f'dp={gpus // tp} x TP={tp} + SP, ZeRO-{zero_stage}', shape(dp=gpus // tp, tp=tp, sp=True,
                                                                         stage=zero_stage))]
    if tp > 1:
        rows += [(f'TP={tp}', shape(tp=tp)), (f'TP={tp} + SP', shape(tp=tp, sp=True))]
    if pp > 1 and gpus % pp == 0 and gpus > pp:
        rows += [(f'dp={gpus // pp} x PP={pp} 1F1B, ZeRO-{zero_stage}', shape(dp=gpus // pp, pp=pp, schedule='1f1b',
                                                                          stage=zero_stage))]
    if pp > 1:
        rows += [(f'PP={pp} 1F1B', shape(pp=pp, schedule='1f1b')), (f'PP={pp} GPipe', shape(pp=pp, schedule='gpipe'))]
    if cp > 1:
        rows += [(f'CP={cp} ring', shape(dp=gpus // cp, cp=cp))]
    return rows + [('ZeRO-3 + offload', shape(dp=gpus, stage=3, offload=True))]


def estimate(gptconf, gpus, gpu_mem_gb, micro_batch, seq_len, tp, pp, cp, n_microbatches, zero_stage,
             mixed_precision):
    """One dict per strategy: model-state bytes, activation and logits bytes with and without activation
    checkpointing, bytes communicated per step, and whether it fits (activations_of, comm_per_step)."""
    s, a, L = seq_len, gptconf.n_head, gptconf.n_layer
    rows = []
    for name, k in strategies(gpus, tp, pp, cp, zero_stage):
        dp, t, p, c, stage = k['dp'], k['tp'], k['pp'], k['cp'], k['stage']
        row = dict(strategy=name, gpus_used=dp * t * p * c, zero_stage=stage, sequence_parallel=k['sp'],
                   schedule=k['schedule'], offload=k['offload'], notes=[], **{x: k[x] for x in GRID_DIMS})
        problems = [msg for bad, msg in [
            (row['gpus_used'] > gpus, f"needs {row['gpus_used']} GPUs"),
            (a % t or gptconf.n_kv_head % t, f"heads ({a}, kv {gptconf.n_kv_head}) not divisible by tp={t}"),
            (L % p, f"n_layer {L} not divisible by pp={p}"),
            (s % (2 * c) if c > 1 else 0, f"seq_len {s} not divisible by 2 x cp={c} (the zig-zag split)"),
            (k['sp'] and s % t, f"seq_len {s} not divisible by tp={t} (sequence parallelism)")] if bad]
        if problems:
            rows.append(dict(row, error=problems[0]))
            continue
        counts = param_counts(gptconf, p)
        numel = (math.ceil(formulas.param_bytes_formula(gptconf, t, bytes_per_elem=1)) if t > 1 else
                 counts['pp_stage_max'] if p > 1 else counts['total'])
        row['params_per_rank'] = numel
        # zero.py holds bf16 weights and an fp32 master (2+2+12 bytes, the ZeRO paper's count); the stage-0 scripts
        # keep fp32 weights and gradients under autocast (4+4+8): the same total, split differently
        row.update(formulas.model_state_bytes_formula(numel, dp * c, stage, mixed_precision and stage > 0,
                                                      k['offload']))
        row['model_state_bytes'] = row['param_bytes'] + row['grad_bytes'] + row['optim_bytes']
        row.update(activations_of(gptconf, k, s, micro_batch, n_microbatches, mixed_precision))
        if p > 1:
            row['bubble_fraction'] = formulas.bubble_fraction_formula(p, n_microbatches)
        row['comm_bytes_per_step'] = comm_per_step(gptconf, k, s, micro_batch, n_microbatches, numel,
                                                   mixed_precision)
        row['total_bytes'] = row['model_state_bytes'] + row['activations_and_logits_bytes']
        row['total_bytes_ckpt'] = row['model_state_bytes'] + row['activations_and_logits_bytes_ckpt']
        limit = gpu_mem_gb * GB
        row['fits'] = ('yes' if row['total_bytes'] <= limit else
                       'with ckpt' if row['total_bytes_ckpt'] <= limit else 'no')
        rows.append(row)
    return rows


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
    # zero.py and FSDP2 compute with bf16 weights; the others autocast fp32 weights (a bf16 copy per layer)
    layer = formulas.saved_bytes_formula(gptconf, tokens, b, t, k['sp'], act_bytes, fp32_weights=stage == 0)
    block_input = tokens * b * h * (4 if mixed_precision else act_bytes) // (t if k['sp'] else 1)
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
    """Bytes the busiest rank of strategy shape k sends per optimizer step: m micro-batches of b sequences of
    s tokens, then one gradient synchronisation, in the dtype each script sends: the stage-0 scripts
    all-reduce fp32 gradients, zero.py reduces bf16 ones under bf16 (and ZeRO-2/3 at every micro-batch);
    tensor parallelism's collectives carry bf16 activations; a pipeline sends the fp32 residual stream and its
    fp32 gradient (pipeline.py's buffers, whatever the dtype); the ring sends bf16 kv blocks and fp32 dK, dV
    (formulas.cp_comm_bytes_formula). A few scalars (the loss, the gradient norm) are left out."""
    dp, t, p, c, stage = k['dp'], k['tp'], k['pp'], k['cp'], k['stage']
    h, a, L = gptconf.n_embd, gptconf.n_head, gptconf.n_layer
    act_bytes = 2 if mixed_precision else 4
    grad_bytes = act_bytes if stage > 0 else 4
    comm = formulas.comm_bytes_formula(numel, dp * c, stage, grad_bytes, m) if dp * c > 1 else 0
    if t > 1:
        per_layer = formulas.tp_comm_bytes_formula(s, b, h, t, k['sp'], bytes_per_elem=act_bytes)
        edges = formulas.tp_edge_comm_bytes_formula(s, b, h, t, k['sp'], bytes_per_elem=act_bytes)
        comm += (per_layer * L + edges) * m
    if p > 1:  # the busiest stage: a middle one, or the first, which with tied embeddings also all-reduces the
        # tied weight's fp32 gradient with the last stage once a step (pipeline.py's embed_comm, as Megatron does)
        tied = formulas.comm_bytes_formula(gptconf.vocab_size * h, 2, 0, 4) if gptconf.tie_embeddings else 0
        comm += max(formulas.p2p_comm_bytes_formula(s, b, h, p, m, bytes_per_elem=4),
                    formulas.p2p_comm_bytes_formula(s, b, h, p, m, bytes_per_elem=4, stage=0) + tied)
    if c > 1:
        comm += L * m * formulas.cp_comm_bytes_formula(s, b, a, gptconf.n_kv_head, h // a, c, 'ring',
                                                       act_bytes)
    return comm


def cheapest(rows, gpus):
    """The first strategy, in the table's order of added cost, that fits on all the GPUs: without activation
    checkpointing if any does (recomputing costs a third more compute), else with it. None if nothing fits."""
    for fits in ('yes', 'with ckpt'):
        for r in rows:
            if r.get('fits') == fits and r['gpus_used'] == gpus:
                return r['strategy'] + (' + ckpt' if fits == 'with ckpt' else '')
    return None


def estimate_json(rows):
    """{name: {param_bytes, grad_bytes, optim_bytes, activation_bytes, logits_bytes, total_bytes, fits, ...}}:
    each strategy twice, as is and '+ ckpt' (full activation checkpointing). total_bytes = the model states +
    activations_and_logits_bytes (the blocks' activations plus the logits, on the stage where they peak)."""
    out = {}
    for r in rows:
        for ckpt in (False, True):
            name = r['strategy'] + (' + ckpt' if ckpt else '')
            entry = {k: r.get(k) for k in ('param_bytes', 'grad_bytes', 'optim_bytes')}
            entry.update({x: r[x] for x in GRID_DIMS + ('zero_stage', 'sequence_parallel', 'schedule', 'offload',
                                                        'gpus_used')})
            entry['activation_checkpointing'] = ckpt
            if 'error' in r:
                out[name] = dict(entry, activation_bytes=None, logits_bytes=None, total_bytes=None,
                                 fits=False, error=r['error'])
                continue
            suffix = '_ckpt' if ckpt else ''
            out[name] = dict(entry, activation_bytes=r['activation_bytes' + suffix],
                             logits_bytes=r['logits_bytes'],
                             activations_and_logits_bytes=r['activations_and_logits_bytes' + suffix],
                             total_bytes=r['total_bytes' + suffix],
                             fits=r['fits'] == 'yes' or (ckpt and r['fits'] == 'with ckpt'),
                             host_bytes=r.get('host_bytes', 0), comm_bytes_per_step=r['comm_bytes_per_step'],
                             activation_bytes_per_layer=r['activation_bytes_per_layer'],
                             layers_per_rank=r['layers_per_rank'],
                             microbatches_in_flight=r['microbatches_in_flight'],
                             params_per_rank=r['params_per_rank'])
    return out


def ds_config_for(row, config_path, overrides, micro_batch, n_microbatches, mixed_precision):
    """The DeepSpeed JSON config of a strategy's data-parallel part (ZeRO stage, offload, batch, precision), as
    zero.py writes it (zero.deepspeed_config_of) and reads it back (--deepspeed_config)."""
    import zero
    cfg = configure(zero.config, ([config_path] if config_path else []) + list(overrides))
    ranks = row['dp'] * row['cp']
    cfg.stage, cfg.offload_optimizer = row['zero_stage'], row['offload']
    cfg.batch_size, cfg.gradient_accumulation_steps = micro_batch, n_microbatches * ranks
    cfg.dtype = 'bfloat16' if mixed_precision else 'float32'
    return zero.deepspeed_config_of(cfg, ranks)


def estimate_markdown(rows, header, n_micro, mixed_precision):
    lines = [header, '',
             '| strategy | GPUs (dp x tp x pp x cp) | params | grads | optimizer | activations | '
             f'act. (ckpt) | logits | total | total (ckpt) | comm per step ({n_micro} micro-batches) '
             '| fits |',
             '|---|---|---|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        grid = f"{r['gpus_used']} ({r['dp']} x {r['tp']} x {r['pp']} x {r['cp']})"
        if 'error' in r:
            lines.append(f"| {r['strategy']} | {grid} | n/a: {r['error']} |" + ' |' * 9)
            continue
        extra = f" (bubble {100 * r['bubble_fraction']:.0f}%)" if 'bubble_fraction' in r else ''
        optim = fmt_bytes(r['optim_bytes']) + (f" (+ {fmt_bytes(r['host_bytes'])} host)" if r['offload'] else '')
        lines.append(f"| {r['strategy']}{extra} | {grid} | {fmt_bytes(r['param_bytes'])} | "
                     f"{fmt_bytes(r['grad_bytes'])} | {optim} | "
                     f"{fmt_bytes(r['activation_bytes'])} | {fmt_bytes(r['activation_bytes_ckpt'])} | "
                     f"{fmt_bytes(r['logits_bytes'])} | {fmt_bytes(r['total_bytes'])} | "
                     f"{fmt_bytes(r['total_bytes_ckpt'])} | {fmt_bytes(r['comm_bytes_per_step'])} | {r['fits']} |")
    notes = sorted({n for r in rows for n in r.get('notes', [])}) + [
        "activations: what this repo's blocks save for backward (formulas.saved_bytes_formula, equal to the "
        "bytes measured), for the micro-batches a rank holds at once (a pipeline's first stage: the most)",
        "act. (ckpt): full activation checkpointing, each block's input kept plus one block recomputed at a time",
        "logits: b x s x V per rank (s/cp, V/tp) in the compute dtype, plus the fp32 log-softmax the loss "
        "keeps for backward (formulas.logits_bytes_formula); a pipeline's on its last stage, one fp32 "
        "log-softmax per micro-batch it holds. total = states + activations + logits, but a pipeline's is "
        "its larger stage's: the first's activations, or the last's (fewer) activations plus the logits",
        f"comm per step: what the busiest rank sends per optimizer step of {n_micro} micro-batches, in the "
        f"dtype each script sends (fp32 gradients for DDP, the fp32 residual stream between pipeline stages, "
        f"fp32 dK/dV around the ring). The model-state table above gives the ZeRO paper's count, one "
        f"micro-batch per step in {'16' if mixed_precision else '32'}-bit gradients: "
        + ("DDP's row here is twice it (fp32 gradients), " if mixed_precision else '')
        + f"ZeRO-2's (m+1)/2 times and ZeRO-3's m times it (they reduce at every micro-batch), m = {n_micro}",
        "bf16: the rows without ZeRO keep fp32 weights and gradients under autocast (4+4+8 bytes per "
        "parameter, and a bf16 copy of each block's weights among its activations); the ZeRO rows hold bf16 "
        "weights and an fp32 master (2+2+12 bytes, the ZeRO paper's count)",
        "not counted: the loss's transients (a few more logits-sized tensors for a moment: the fp32 copy of "
        "bf16 logits, their gradients in backward), the embedding's output, ZeRO-3's and FSDP2's gathered "
        "parameters (the block computing and the one prefetched) and communication buffers, a pipeline's "
        "in-flight send and receive buffers, the optimizer step's temporaries, the framework's own memory "
        "(CUDA context, NCCL) and the allocator's caching and fragmentation: leave headroom",
        "GB = 1e9 bytes; fits: total <= --gpu_mem_gb (yes / with ckpt: only with activation checkpointing / no)"]
    return '\n'.join(lines + [''] + [f"- {n}" for n in notes])


def model_state_markdown(numel, gpus, mixed_precision):
    """The ZeRO paper's table: model states per GPU for DP and ZeRO stages 1-3 (no shape needed)."""
    lines = [f"Model states per GPU, Ψ = {numel / 1e9:.3g}B parameters, N = {gpus} GPUs, "
             f"{'mixed-precision Adam (2+2+12 bytes)' if mixed_precision else 'fp32 Adam (4+4+8 bytes)'}:", '',
             "| stage | params | grads | optimizer | total per GPU "
             "| comm per step (the paper's: 1 micro-batch) |",
             '|---|---|---|---|---|---|']
    for stage, name in enumerate(['DDP (ZeRO-0)', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3 / FSDP']):
        m = model_states(numel, gpus, stage, mixed_precision)
        comm = formulas.comm_bytes_formula(numel, gpus, stage, 2 if mixed_precision else 4)
        lines.append(f"| {name} | {fmt_bytes(m['param_bytes'])} | {fmt_bytes(m['grad_bytes'])} | "
                     f"{fmt_bytes(m['optim_bytes'])} | {fmt_bytes(sum(m.values()))} | {fmt_bytes(comm)} |")
    return '\n'.join(lines)


def largest_divisor(limit, *numbers):
    return max(d for d in range(1, limit + 1) if all(n % d == 0 for n in numbers))


def run_estimate(args, overrides):
    mixed = args.dtype != 'float32'
    if args.params:
        print(model_state_markdown(int(float(args.params)), args.gpus, mixed))
        return
    if not args.estimate or not os.path.isfile(args.estimate):
        raise SystemExit(f"error: --estimate needs a config file (or --params=N), got {args.estimate!r}")
    gptconf = gpt_config_from(args.estimate, overrides, args.vocab_size)
    hinted = args.vocab_size or config_vocab_size(args.estimate)
    vocab_note = '' if hinted else ' (the default: pass --vocab_size=N for another vocabulary)'
    seq_len = args.seq_len or gptconf.block_size
    # default degrees: the largest that divide the shape (tp: heads and kv heads, at most 8; pp: layers, at most 4;
    # cp: the sequence in 2·cp zig-zag chunks, at most 4)
    args.tp = args.tp or largest_divisor(min(args.gpus, 8), gptconf.n_head, gptconf.n_kv_head)
    args.pp = args.pp or largest_divisor(min(args.gpus, 4), gptconf.n_layer)
    args.cp = args.cp or largest_divisor(min(args.gpus, 4), seq_len // 2, args.gpus)
    numel = param_counts(gptconf)['total']
    n_micro = args.n_microbatches or max(1, 2 * args.pp)
    rows = estimate(gptconf, args.gpus, args.gpu_mem_gb, args.micro_batch, seq_len, args.tp, args.pp, args.cp,
                    n_micro, args.zero_stage, mixed)
    best = cheapest(rows, args.gpus)
    ds_path = None
    if best:
        best_row = next(r for r in rows if best.startswith(r['strategy']))
        os.makedirs(args.out, exist_ok=True)
        ds_path = os.path.join(args.out, 'ds_config.json')
        with open(ds_path, 'w') as f:
            json.dump(ds_config_for(best_row, args.estimate, overrides, args.micro_batch, n_micro, mixed), f, indent=2)
    checked = check_estimate(args, overrides, rows, best, ds_path, n_micro) if args.check else None
    if args.json:
        print(json.dumps({'config': args.estimate, 'params': numel, 'gpus': args.gpus, 'gpu_mem_gb': args.gpu_mem_gb,
                          'dtype': args.dtype, 'micro_batch': args.micro_batch, 'seq_len': seq_len,
                          'n_microbatches': n_micro, 'strategies': estimate_json(rows), 'cheapest': best,
                          'ds_config': ds_path, 'checked': checked}, indent=1))
        return
    header = (f"{args.estimate}: Ψ = {numel / 1e9:.3g}B parameters (L {gptconf.n_layer}, h {gptconf.n_embd}, "
              f"a {gptconf.n_head}, kv {gptconf.n_kv_head}, V {gptconf.vocab_size}{vocab_note}); {args.gpus} GPUs of "
              f"{args.gpu_mem_gb} GB; micro-batch {args.micro_batch} x {seq_len} tokens, {n_micro} micro-batches "
              f"per step; {'bf16 mixed precision' if mixed else 'fp32'}. Per GPU (the largest rank):")
    print(model_state_markdown(numel, args.gpus, mixed) + '\n')
    print(estimate_markdown(rows, header, n_micro, mixed))
    print(f"\ncheapest that fits on all {args.gpus} GPUs (the first in the table's order of added cost; without "
          f"recomputation if possible): {best or 'none'}" + (f"; its DeepSpeed config: {ds_path}" if ds_path else ''))
    if checked:
        print('\nThe estimate against what the scripts measured, run here on ' + f"{args.gpus} processes:\n")
        print('| strategy | script | what | estimate | measured | measured / estimate |\n|---|---|---|---|---|---|')
        for c in checked:
            print(f"| {c['strategy']} | {c['script']} | {c['what']} | {c['estimate']:,} | {c['measured']:,} | "
                  f"{c['measured'] / c['estimate']:.4f} |")


CHECK_FLAGS = ['--dropout=0.0', '--compile=False', '--eval_iters=1', '--eval_interval=1000', '--max_iters=2',
               '--log_interval=1', '--sample_at_end=False', '--always_save_checkpoint=False']


def check_estimate(args, overrides, rows, best, ds_path, n_micro):
    """--check: run three of the estimated strategies here, on --gpus processes with the estimate's shapes (so
    only for a model that fits this machine), and read back what each script measured: the cheapest ZeRO stage
    (zero.py with the ds_config.json just written; ZeRO-1 when the cheapest is not a ZeRO stage) its model states,
    TP + SP one block's saved activations and its parameters, PP 1F1B the first stage's peak of saved activations.
    Returns one dict per number."""
    by_name = {r['strategy']: r for r in rows}
    base = [args.estimate] + list(overrides) + CHECK_FLAGS + [f'--dtype={args.dtype}']
    if args.seq_len:
        base.append(f'--block_size={args.seq_len}')
    runs = []
    # zero.py run with the DeepSpeed config of the cheapest strategy when that is a ZeRO stage, else of ZeRO-1 (the
    # DDP row is priced as train_ddp.py holds it, which zero.py's stage 0 does not: it keeps bf16 weights)
    zero_row = by_name.get((best or '').replace(' + ckpt', ''))
    if not (zero_row and zero_row['zero_stage'] >= 1 and zero_row['tp'] == zero_row['pp'] == zero_row['cp'] == 1
            and 'FSDP' not in zero_row['strategy']):
        zero_row = by_name['ZeRO-1']
        ds_path = os.path.join(args.out, 'check_ds_config.json')
        with open(ds_path, 'w') as f:
            json.dump(ds_config_for(zero_row, args.estimate, overrides, args.micro_batch, n_micro,
                                    args.dtype != 'float32'), f, indent=2)
    runs.append((zero_row, 'zero.py', [f'--deepspeed_config={ds_path}'],
                 [('param_bytes', 'param_bytes'), ('grad_bytes', 'grad_bytes'), ('optim_bytes', 'optim_bytes')]))
    tp_row = by_name.get(f'TP={args.tp} + SP')
    if tp_row and 'error' not in tp_row and args.gpus % args.tp == 0:
        runs.append((tp_row, 'tensor_parallel.py', [f'--tp={args.tp}', '--sequence_parallel=True',
                                                    f'--batch_size={args.micro_batch}',
                                                    f'--gradient_accumulation_steps={args.gpus // args.tp}'],
                     [('activation_bytes_per_layer', 'activation_bytes'), ('param_bytes', 'param_bytes')]))
    pp_row = by_name.get(f'PP={args.pp} 1F1B')
    if pp_row and 'error' not in pp_row and args.gpus % args.pp == 0:
        runs.append((pp_row, 'pipeline.py', [f'--pp={args.pp}', '--schedule=1f1b', f'--n_microbatches={n_micro}',
                                             f'--batch_size={args.micro_batch * n_micro}',
                                             f'--gradient_accumulation_steps={args.gpus // args.pp}'],
                     [('activation_bytes', 'peak_activation_bytes')]))
    checked = []
    for row, script, flags, pairs in runs:
        out_dir = os.path.join(args.out, 'check_' + script[:-3])
        shutil.rmtree(out_dir, ignore_errors=True)
        cmd = command(script, base + flags + [f'--out_dir={out_dir}'], args.gpus)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.row_timeout,
                              env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
        if proc.returncode != 0:
            raise SystemExit(f"error: --check: {' '.join(cmd[1:])} failed:\n{proc.stderr[-2000:]}")
        ranks = [r for r in read_log(out_dir) if 'rank' in r and (script != 'pipeline.py' or r.get('stage') == 0)]
        for planned, measured in pairs:
            values = [r[measured] for r in ranks if r.get(measured) is not None]
            checked.append({'strategy': row['strategy'], 'script': script, 'what': measured,
                            'estimate': row[planned], 'measured': max(values)})
    return checked


# -----------------------------------------------------------------------------
# the bench: every script on the same small GPT, the same data and the same global batch

def bench_rows(world_size, n_microbatches):
    """name -> (script, its own flags, processes). The order is the table's."""
    w = world_size
    return {
        'train': ('train.py', [], 1),
        'ddp': ('train_ddp.py', [], w),
        'zero0': ('zero.py', ['--stage=0'], w),
        'zero1': ('zero.py', ['--stage=1'], w),
        'zero2': ('zero.py', ['--stage=2'], w),
        'zero3': ('zero.py', ['--stage=3'], w),
        'fsdp': ('train_fsdp.py', [], w),
        'tp': ('tensor_parallel.py', [f'--tp={w}'], w),
        'tp_sp': ('tensor_parallel.py', [f'--tp={w}', '--sequence_parallel=True'], w),
        'pp_gpipe': ('pipeline.py', [f'--pp={w}', '--schedule=gpipe', f'--n_microbatches={n_microbatches}'], w),
        'pp_1f1b': ('pipeline.py', [f'--pp={w}', '--schedule=1f1b', f'--n_microbatches={n_microbatches}'], w),
        'pp_interleaved': ('pipeline.py', [f'--pp={w}', '--schedule=interleaved', '--virtual_stages=2',
                                           f'--n_microbatches={n_microbatches}'], w),
        'cp_ring': ('context_parallel.py', [f'--cp={w}', '--cp_attention=ring'], w),
        'cp_ulysses': ('context_parallel.py', [f'--cp={w}', '--cp_attention=ulysses'], w),
        # the grid: dp = world_size again, times 2 x 2 more processes (8 for the default world_size of 2)
        'grid_dp_pp_tp': ('parallel_4d.py', ['--pp=2', '--tp=2'], 4 * w),
        'grid_dp_cp_tp': ('parallel_4d.py', ['--cp=2', '--tp=2'], 4 * w),
    }


def model_flags(args):
    """The small GPT and the batch every row trains: the same global batch (batch_size x world_size sequences)
    for every script; dp ranks split it, tp/pp ranks share it. fp32, dropout 0: every row must give one loss."""
    return [f'--n_layer={args.n_layer}', f'--n_head={args.n_head}', f'--n_embd={args.n_embd}',
            f'--block_size={args.block_size}', f'--batch_size={args.batch_size}',
            f'--gradient_accumulation_steps={args.world_size}', f'--max_iters={args.max_iters}',
            f'--lr_decay_iters={args.max_iters}', '--warmup_iters=2', f'--learning_rate={args.learning_rate}',
            '--log_interval=1',
            f'--eval_interval={args.max_iters}', '--eval_iters=1', '--dropout=0.0', f'--dtype={args.dtype}',
            '--compile=False', '--sample_at_end=False', '--always_save_checkpoint=False', f'--seed={args.seed}'] + (
        [f'--peak_flops={args.peak_flops}'] if args.peak_flops else [])


def command(script, flags, nproc):
    if nproc == 1:
        return [sys.executable, script] + flags
    return [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}', script] + flags


def read_log(out_dir):
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


MEASURED = ['param_bytes', 'grad_bytes', 'optim_bytes', 'activation_bytes', 'peak_activation_bytes',
            'collective_bytes', 'wire_bytes', 'p2p_bytes_per_step', 'bubble_fraction', 'compute_fraction',
            'send_recv_fraction', 'peak_microbatches_held']


def summarize(log, warmup):
    """What the script reported: median ms, tokens/s and MFU over the iterations after the warm-up, the loss
    curve, and the per-rank rows (all the rows of one rank merged), with the largest rank's value of each
    measured number and its formula."""
    train_rows = [r for r in log if 'loss' in r and 'rank' not in r and 'ms' in r]
    timed = [r for r in train_rows if r['iter'] >= warmup] or train_rows
    out = {'losses': {r['iter']: r['loss'] for r in train_rows}}
    for key in ('ms', 'tokens_per_sec', 'mfu', 'peak_mem_bytes'):
        values = [r[key] for r in timed if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out['final_loss'] = train_rows[-1]['loss'] if train_rows else None
    evals = [r for r in log if 'val_loss' in r and 'rank' not in r]
    out['final_val_loss'] = evals[-1]['val_loss'] if evals else None
    ranks = {}
    for r in log:
        if 'rank' in r:
            ranks.setdefault(r['rank'], {}).update(r)
    out['ranks'] = [ranks[k] for k in sorted(ranks)]
    for key in MEASURED:
        for k in (key, key + '_formula'):
            values = [r[k] for r in out['ranks'] if isinstance(r.get(k), (int, float))]
            out[k] = max(values) if values else None
    return out


def run_row(name, script, flags, nproc, args, runs_dir):
    """Run one row's script with torchrun; its log.jsonl is the row."""
    if not os.path.exists(os.path.join(REPO, script)):
        return {'status': f'not available: {script} is not in this checkout'}
    out_dir = os.path.join(runs_dir, name)
    shutil.rmtree(out_dir, ignore_errors=True)  # log.jsonl appends: start each row from nothing
    cmd = command(script, model_flags(args) + [f'--out_dir={out_dir}'] + flags, nproc)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED='1')
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.row_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {'status': f'failed: no result within {args.row_timeout} s', 'wall_s': time.time() - t0}
    row = {'wall_s': time.time() - t0, 'command': ' '.join(['python' if c == sys.executable else c for c in cmd])}
    if proc.returncode != 0:
        lines = [l for l in (proc.stderr + proc.stdout).splitlines() if l.strip()]
        error = next((l for l in reversed(lines) if 'error' in l.lower()), lines[-1] if lines else '')
        row['status'] = f'failed (exit {proc.returncode}): {error.strip()[:200]}'
        return row
    row.update(summarize(read_log(out_dir), args.warmup))
    row['status'] = 'ok' if row['final_loss'] is not None else 'failed: no training rows in log.jsonl'
    return row


def check_losses(results, rtol):
    """Compare every row's loss curve with the first ok row's (train.py's when it ran): the largest relative
    difference over the iterations both logged. Marks each row 'same' or 'DIFFERS'."""
    ok = [r for r in results.values() if r.get('status') == 'ok']
    if not ok:
        return None
    ref = ok[0]['losses']
    for r in ok:
        common = [i for i in r['losses'] if i in ref]
        r['loss_max_rel_diff'] = max(abs(r['losses'][i] - ref[i]) / abs(ref[i]) for i in common) if common else None
        r['loss_matches'] = r['loss_max_rel_diff'] is not None and r['loss_max_rel_diff'] <= rtol
    return all(r['loss_matches'] for r in ok)


def measured_cell(row, key, fmt=fmt_bytes):
    """'measured (formula)' from the script's own per-rank rows; '-' where the script does not report it."""
    value, formula = row.get(key), row.get(key + '_formula')
    if value is None:
        return '-' if formula is None else f"- ({fmt(formula)})"
    return fmt(value) + ('' if formula is None else f" ({fmt(formula)})")


def activation_cell(row):
    """tensor_parallel.py: one layer's saved activations; pipeline.py: the stage's peak of saved activations."""
    if row.get('activation_bytes') is None and row.get('peak_activation_bytes') is not None:
        return measured_cell(row, 'peak_activation_bytes') + ' peak'
    return measured_cell(row, 'activation_bytes')


def sent_cells(row):
    """Bytes one rank sent per step: handed to its collectives and sends (counted at the calls), and on the wire:
    measured from the OS's loopback counter (the ring formula for those calls in parentheses)."""
    counted = fmt_bytes(row.get('collective_bytes')) if row.get('collective_bytes') is not None else '-'
    if row.get('wire_bytes') is None and row.get('wire_bytes_formula') is None:
        return counted, '-'
    return counted, measured_cell(row, 'wire_bytes')


def bubble_cell(row, pct):
    """The pipeline's measured bubble (formula), the share of the step in send/recv, and the most micro-batches'
    activations a stage held."""
    cell = measured_cell(row, 'bubble_fraction', pct)
    if row.get('send_recv_fraction') is not None:
        cell += f", send/recv {pct(row['send_recv_fraction'])}"
    held = row.get('peak_microbatches_held')
    return cell if held is None else f"{cell}, held {held}"


def bench_markdown(results, rows, all_same, rtol):
    pct = lambda x: f"{100 * x:.1f}%"
    lines = ['| row | script | ms/step | tokens/s | MFU | params/rank | grads/rank | optimizer/rank | '
             'activations/rank | sent/step/rank: collective bytes | wire bytes | bubble | final loss | same loss |',
             '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
    for name, r in results.items():
        script = ' '.join([rows[name][0]] + rows[name][1])
        if r.get('status') != 'ok':
            lines.append(f"| {name} | {script} | {r.get('status').replace('|', '/')} |" + ' |' * 11)
            continue
        mfu = pct(r['mfu']) if r.get('mfu') is not None else 'n/a'
        same = ('other model' if name == GPT2_ROW else 'yes' if r['loss_matches'] else
                f"**DIFFERS** ({r['loss_max_rel_diff']:.1e})")
        lines.append(f"| {name} | {script} | {r['ms']:.1f} | {r['tokens_per_sec']:.0f} | {mfu} | "
                     f"{measured_cell(r, 'param_bytes')} | {measured_cell(r, 'grad_bytes')} | "
                     f"{measured_cell(r, 'optim_bytes')} | {activation_cell(r)} | "
                     f"{' | '.join(sent_cells(r))} | {bubble_cell(r, pct)} | "
                     f"{r['final_loss']:.6f} | {same} |")
    ok = [n for n, r in results.items() if r.get('status') == 'ok' and n != GPT2_ROW]
    if all_same:
        verdict = f"Final loss: the same in every row that ran ({len(ok)} rows, loss curves within {rtol:g} relative)."
    elif all_same is None:
        verdict = "No row ran."
    else:
        differ = [n for n in ok if not results[n]['loss_matches']]
        verdict = f"Final loss: DIFFERS in rows {', '.join(differ)} (more than {rtol:g} relative from {ok[0]})."
    missing = [f"{n} ({results[n]['status']})" for n in results if results[n].get('status') != 'ok']
    return '\n'.join(lines + ['', verdict] + ([f"Rows that did not run: {'; '.join(missing)}."] if missing else []))


def machine_description(args):
    if torch.cuda.is_available():
        name = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, NCCL"
    else:
        name = f"{os.cpu_count()}-core CPU, gloo"
    load = f", load average {os.getloadavg()[0]:.1f} at the start" if hasattr(os, 'getloadavg') else ''
    return (f"{name}, torch {torch.__version__}, {args.world_size} processes per distributed row, "
            f"{args.threads} thread(s) per process{load}")


GPT2_ROW = 'gpt2_124m_bf16_compile'  # a different model: left out of the same-loss comparison


def plot(results, out_dir):
    """Three pictures of a bench run (matplotlib, an optional install): every row's loss curve on one axis (they
    coincide: that is the point), per-rank memory by component measured beside formula, and the bytes sent per step
    counted, by the ring formula and measured on the wire. Returns the paths written."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib, an optional install: pip install matplotlib")
    ok = {n: r for n, r in results.items() if r.get('status') == 'ok' and n != GPT2_ROW}
    paths = [os.path.join(out_dir, f'bench_{name}.png') for name in ('loss', 'memory', 'comm')]

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, r) in enumerate(ok.items()):
        iters = sorted(int(k) for k in r['losses'])
        ax.plot(iters, [r['losses'][k] if k in r['losses'] else r['losses'][str(k)] for k in iters], label=name,
                linewidth=2.5 - 1.8 * i / max(1, len(ok) - 1), marker='o' if i == 0 else None)
    ax.set(xlabel='iteration', ylabel='training loss (global batch)', title='Every strategy, one loss curve')
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)

    components = [('param_bytes', 'parameters'), ('grad_bytes', 'gradients'), ('optim_bytes', 'optimizer state'),
                  ('activation_bytes', 'activations (one layer)'), ('peak_activation_bytes', 'activations (peak)')]
    names = [n for n, r in ok.items() if any(r.get(k) is not None for k, _ in components)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for side, suffix, hatch in ((-0.2, '', None), (0.2, '_formula', '//')):
        bottom = [0.0] * len(names)
        for c, (key, label) in enumerate(components):
            values = [(ok[n].get(key + suffix) or 0) / 1e6 for n in names]
            ax.bar([i + side for i in range(len(names))], values, 0.38, bottom=bottom, color=f'C{c}', hatch=hatch,
                   label=label if not suffix else None, edgecolor='white')
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(names)), names, rotation=30, ha='right')
    ax.set(ylabel='MB per rank (largest rank)', title='Memory per rank: measured (left) beside formula (hatched)')
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)

    names = [n for n, r in ok.items() if r.get('collective_bytes') is not None]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for j, (key, label) in enumerate((('collective_bytes', 'collective bytes (counted at the calls)'),
                                      ('wire_bytes_formula', 'wire bytes, ring formula'),
                                      ('wire_bytes', 'wire bytes, measured (loopback)'))):
        ax.bar([i + 0.27 * (j - 1) for i in range(len(names))], [(ok[n].get(key) or 0) / 1e6 for n in names], 0.26,
               label=label, color=f'C{j}')
    ax.set_xticks(range(len(names)), names, rotation=30, ha='right')
    ax.set(ylabel='MB per rank per step', title='Bytes sent per step: counted, modelled, measured')
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close('all')
    return paths


def run_bench(args):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus == 1:  # one GPU: the single-process rows only
        args.world_size = 1
    elif n_gpus > 1 and args.world_size > n_gpus:
        raise SystemExit(f"error: --world_size={args.world_size} but only {n_gpus} GPUs")
    rows = bench_rows(args.world_size, args.n_microbatches)
    if n_gpus == 1:
        rows = {'train': rows['train']}
    if n_gpus >= 1:  # and on a GPU, GPT-2 124M in bf16 with compile, for MFU: on GPT-2 BPE tokens when they are
        # there (python data/shakespeare/prepare.py), else the same shape on the default characters (vocab 96)
        bpe = os.path.exists(os.path.join(REPO, 'data', 'shakespeare', 'train.bin'))
        rows[GPT2_ROW] = ('train.py', ['--n_layer=12', '--n_head=12', '--n_embd=768', '--block_size=1024',
                                       '--batch_size=16', '--gradient_accumulation_steps=1', '--dtype=bfloat16',
                                       '--compile=True', '--bias=True',
                                       f"--dataset={'shakespeare' if bpe else 'stdlib_char'}"], 1)
    selected = list(rows) if args.rows == 'all' else args.rows.split(',')
    unknown = [n for n in selected if n not in rows]
    if unknown:
        raise SystemExit(f"error: unknown row(s) {', '.join(unknown)}; valid: {', '.join(rows)}")
    if args.world_size < 2 and any(rows[n][2] > 1 for n in selected):
        raise SystemExit("error: distributed rows need --world_size >= 2")
    if any(n.startswith(('tp', 'pp', 'cp', 'grid')) for n in selected) and (args.n_head % args.world_size or
                                                                   args.n_layer % args.world_size):
        raise SystemExit(f"error: n_head ({args.n_head}) and n_layer ({args.n_layer}) must be divisible by "
                         f"--world_size={args.world_size} for the tp, pp and cp rows")
    load_dataset('stdlib_char')  # prepare the data once, before the rows race to do it
    runs_dir = os.path.join(args.out, 'runs')
    os.makedirs(runs_dir, exist_ok=True)
    machine = machine_description(args)
    print(f"bench: {len(selected)} rows on {machine}; {args.max_iters} iterations each, "
          f"timing after {args.warmup}; logs in {runs_dir}", flush=True)
    results, t_start = {}, time.time()
    for i, name in enumerate(selected):
        script, flags, nproc = rows[name]
        print(f"[{i + 1}/{len(selected)}] {name}: {' '.join([script] + flags)} on {nproc} process(es) ...",
              end=' ', flush=True)
        results[name] = run_row(name, script, flags, nproc, args, runs_dir)  # its flags override the bench's
        r = results[name]
        detail = f"{r['ms']:.1f} ms/step, loss {r['final_loss']:.6f}" if r['status'] == 'ok' else r['status']
        print(f"{detail} ({r.get('wall_s', 0):.0f} s; {time.time() - t_start:.0f} s so far)", flush=True)
    compared = {n: r for n, r in results.items() if n != GPT2_ROW}
    rtol = args.loss_rtol if args.loss_rtol is not None else (1e-4 if args.dtype == 'float32' else 2e-2)
    all_same = check_losses(compared, rtol)
    cmd_line = 'python bench.py ' + ' '.join(sys.argv[1:])
    header = (f"`{cmd_line.strip()}` on {machine}. Model: {args.n_layer} layers, {args.n_head} "
              f"heads, {args.n_embd} wide, block {args.block_size}; global batch {args.batch_size * args.world_size} "
              f"sequences; {args.dtype}. Times: median of iterations {args.warmup}..{args.max_iters - 1}. "
              f"Bytes: the script's own per-rank report, largest rank, measured (formula).")
    table = bench_markdown(results, rows, all_same, rtol)
    print('\n' + header + '\n\n' + table, flush=True)
    with open(os.path.join(args.out, 'bench.md'), 'w') as f:
        f.write(header + '\n\n' + table + '\n')
    with open(os.path.join(args.out, 'bench.json'), 'w') as f:
        json.dump({'command': cmd_line.strip(), 'machine': machine, 'all_losses_equal': all_same,
                   'loss_rtol': rtol, 'rows': results}, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'bench.md')} and bench.json ({time.time() - t_start:.0f} s)")
    if args.plot:
        print(f"drew {', '.join(plot(results, args.out))}")
    failed = [n for n, r in results.items() if r['status'].startswith('failed')]
    if failed or all_same is False:
        sys.exit(1)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument('--estimate', nargs='?', const='', default=None, metavar='CONFIG',
                   help='plan memory for the model of a config file (config keys may follow as --key=value)')
    p.add_argument('--params', default=None, help='--estimate with a parameter count only (model states)')
    p.add_argument('--gpus', type=int, default=8)
    p.add_argument('--gpu_mem_gb', type=float, default=80)
    p.add_argument('--micro_batch', type=int, default=1, help='sequences per micro-batch per GPU')
    p.add_argument('--seq_len', type=int, default=None, help="default: the config's block_size")
    p.add_argument('--tp', type=int, default=None, help='tensor-parallel degree (default: the largest <= 8 that fits)')
    p.add_argument('--pp', type=int, default=None, help='pipeline stages (default: the largest <= 4 that fits)')
    p.add_argument('--cp', type=int, default=None, help='context-parallel degree (default: the largest <= 4 that fits)')
    p.add_argument('--json', action='store_true', help='--estimate: print the estimate as JSON')
    p.add_argument('--check', action='store_true',
                   help='--estimate: run three of the strategies here (--gpus processes) and compare with the estimate')
    p.add_argument('--n_microbatches', type=int, default=None,
                   help='micro-batches per step (estimate default: 2 x pp; bench pipeline rows: 4)')
    p.add_argument('--zero_stage', type=int, default=1, help='ZeRO stage of the dp x tp and dp x pp rows')
    p.add_argument('--vocab_size', type=int, default=None, help='default: a "# vocab_size: N" line, else 50304')
    p.add_argument('--rows', default='all', help='comma-separated rows of the bench (default all)')
    p.add_argument('--world_size', type=int, default=2)
    p.add_argument('--max_iters', type=int, default=12)
    p.add_argument('--warmup', type=int, default=2, help='iterations left out of the timing')
    p.add_argument('--n_layer', type=int, default=4)
    p.add_argument('--n_head', type=int, default=4)
    p.add_argument('--n_embd', type=int, default=512,
                   help='wide enough that compute dominates, so the pipeline rows measure a bubble near the formula')
    p.add_argument('--block_size', type=int, default=128)
    p.add_argument('--learning_rate', type=float, default=3e-4,
                   help='low enough that the 512-wide model trains without a loss spike: a spike amplifies the '
                        'rounding differences between strategies past the same-loss tolerance')
    p.add_argument('--batch_size', type=int, default=8, help='sequences per dp rank; global batch x world_size')
    p.add_argument('--dtype', default=None, help='bench default float32; estimate default bfloat16 (mixed precision)')
    p.add_argument('--seed', type=int, default=1337)
    p.add_argument('--peak_flops', type=float, default=None, help="the device's peak FLOP/s, for MFU on a CPU")
    p.add_argument('--loss_rtol', type=float, default=None, help='default 1e-4 (fp32), 2e-2 (16-bit)')
    p.add_argument('--threads', type=int, default=None,
                   help='threads per process in every row (default: cores / world_size, at least 1)')
    p.add_argument('--row_timeout', type=int, default=600)
    p.add_argument('--out', default='out_bench')
    p.add_argument('--plot', action='store_true',
                   help='also draw the loss curves, memory and communication as PNGs in --out (needs matplotlib)')
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith('--') or args.estimate is None]
    if bad:
        raise SystemExit(f"error: unrecognized arguments: {' '.join(bad)}")
    if (args.json or args.check) and (args.estimate is None or args.params):
        raise SystemExit("error: --json and --check go with --estimate CONFIG (a model's shape, not --params)")
    args.dtype = args.dtype or ('bfloat16' if args.estimate is not None else 'float32')
    if args.dtype not in ('float32', 'bfloat16', 'float16'):
        raise SystemExit(f"error: --dtype must be float32, bfloat16 or float16, got {args.dtype!r}")
    if args.estimate is None and args.max_iters <= args.warmup:
        raise SystemExit(f"error: --max_iters ({args.max_iters}) must be larger than --warmup ({args.warmup})")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.world_size)
    if args.gpus < 1 or args.world_size < 1 or args.micro_batch < 1:
        raise SystemExit("error: --gpus, --world_size and --micro_batch must be at least 1")
    return args, rest


def main(argv):
    args, overrides = parse_args(argv)
    if args.estimate is not None:
        run_estimate(args, overrides)
    else:
        args.n_microbatches = args.n_microbatches or 4
        run_bench(args)


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            sys.exit(1)
        raise
