"""
What bench.py --estimate prints of the memory planner's rows (planner.py): the ZeRO paper's model-state
table, every strategy's row with its notes, the same as JSON, and --check's estimate beside what the scripts
measured.
"""

from common import formulas
from common.model_parallel import GRID_DIMS


def fmt_bytes(n):
    """1.23 GB / 4.56 MB / 7.8 kB / 12 B; '-' for a missing number."""
    if n is None:
        return '-'
    for unit, scale in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def model_state_markdown(numel, gpus, mixed_precision):
    """The ZeRO paper's table: model states per GPU for DP and ZeRO stages 1-3 (no shape needed)."""
    lines = [f"Model states per GPU, Ψ = {numel / 1e9:.3g}B parameters, N = {gpus} GPUs, "
             f"{'mixed-precision Adam (2+2+12 bytes)' if mixed_precision else 'fp32 Adam (4+4+8 bytes)'}:",
             '',
             "| stage | params | grads | optimizer | total per GPU "
             "| comm per step (the paper's: 1 micro-batch) |",
             '|---|---|---|---|---|---|']
    for stage, name in enumerate(['DDP (ZeRO-0)', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3 / FSDP']):
        m = formulas.model_state_bytes_formula(numel, gpus, stage, mixed_precision)
        comm = formulas.comm_bytes_formula(numel, gpus, stage, 2 if mixed_precision else 4)
        lines.append(f"| {name} | {fmt_bytes(m['param_bytes'])} | {fmt_bytes(m['grad_bytes'])} | "
                     f"{fmt_bytes(m['optim_bytes'])} | {fmt_bytes(sum(m.values()))} | {fmt_bytes(comm)} |")
    return '\n'.join(lines)


def estimate_markdown(rows, header, n_micro, mixed_precision):
    """The strategies' table and its notes; n_micro None: each row its own micro-batches (--global_batch)."""
    lines = [header, '',
             '| strategy | GPUs (dp x tp x pp x cp) | params | grads | optimizer | activations | '
             f'act. (ckpt) | logits | total | total (ckpt) | comm per step ({n_micro or "m"} micro-batches) '
             '| fits |',
             '|---|---|---|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        grid = f"{r['gpus_used']} ({r['dp']} x {r['tp']} x {r['pp']} x {r['cp']})"
        if 'error' in r:
            lines.append(f"| {r['strategy']} | {grid} | n/a: {r['error']} |" + ' |' * 9)
            continue
        extra = f" (bubble {100 * r['bubble_fraction']:.0f}%)" if 'bubble_fraction' in r else ''
        extra += '' if n_micro else f" (m = {r['n_microbatches']})"
        host = f" (+ {fmt_bytes(r['host_bytes'])} host)" if r['offload'] else ''
        optim = fmt_bytes(r['optim_bytes']) + host
        lines.append(f"| {r['strategy']}{extra} | {grid} | {fmt_bytes(r['param_bytes'])} | "
                     f"{fmt_bytes(r['grad_bytes'])} | {optim} | "
                     f"{fmt_bytes(r['activation_bytes'])} | {fmt_bytes(r['activation_bytes_ckpt'])} | "
                     f"{fmt_bytes(r['logits_bytes'])} | {fmt_bytes(r['total_bytes'])} | "
                     f"{fmt_bytes(r['total_bytes_ckpt'])} | {fmt_bytes(r['comm_bytes_per_step'])} | "
                     f"{r['fits']} |")
    notes = sorted({n for r in rows for n in r.get('notes', [])}) + [
        "activations: what this repo's blocks save for backward (formulas.saved_bytes_formula, equal to the "
        "bytes measured), for the micro-batches a rank holds at once (a pipeline's first stage: the most)",
        "act. (ckpt): full activation checkpointing, each block's input kept plus one block recomputed at a "
        "time",
        "logits: b x s x V per rank (s/cp, V/tp) in the compute dtype, plus the fp32 log-softmax the loss "
        "keeps for backward (formulas.logits_bytes_formula); a pipeline's on its last stage, one fp32 "
        "log-softmax per micro-batch it holds. total = states + activations + logits, but a pipeline's is "
        "its larger stage's: the first's activations, or the last's (fewer) activations plus the logits",
        f"comm per step: what the busiest rank sends per optimizer step of {n_micro or 'm'} micro-batches, "
        f"in the dtype each script sends (fp32 gradients for DDP, the residual stream between pipeline "
        f"stages, fp32 dK/dV around the ring). The model-state table above gives the ZeRO paper's count, one "
        f"micro-batch per step in {'16' if mixed_precision else '32'}-bit gradients: "
        + ("DDP's row here is twice it (fp32 gradients), " if mixed_precision else '')
        + "ZeRO-2's (m+1)/2 times and ZeRO-3's m times it (they reduce at every micro-batch), m = "
        + (str(n_micro) if n_micro else "each row's, to make the global batch"),
        "bf16: the rows without ZeRO keep fp32 weights and gradients under autocast (4+4+8 bytes per "
        "parameter, and a bf16 copy of each block's weights among its activations); the ZeRO rows hold bf16 "
        "weights and an fp32 master (2+2+12 bytes, the ZeRO paper's count)",
        "not counted: the loss's transients (a few more logits-sized tensors for a moment: the fp32 copy of "
        "bf16 logits, their gradients in backward), the embedding's output, communication buffers, a "
        "pipeline's in-flight send and receive buffers, the optimizer step's temporaries, the framework's "
        "own memory (CUDA context, NCCL) and the allocator's caching and fragmentation: leave headroom",
        "GB = 1e9 bytes; fits: total <= --gpu_mem_gb (yes / with ckpt: only with activation checkpointing / "
        "no)"]
    return '\n'.join(lines + [''] + [f"- {n}" for n in notes])


def estimate_json(rows):
    """{name: {param_bytes, grad_bytes, optim_bytes, activation_bytes, logits_bytes, total_bytes, fits, ...}}:
    each strategy twice, as is and '+ ckpt' (full activation checkpointing). total_bytes = the model states +
    gathered_bytes (ZeRO-3's whole blocks at its peak) + activations_and_logits_bytes (the blocks' activations
    plus the logits, on the stage where they peak)."""
    out = {}
    for r in rows:
        for ckpt in (False, True):
            name = r['strategy'] + (' + ckpt' if ckpt else '')
            entry = {k: r.get(k) for k in ('param_bytes', 'grad_bytes', 'optim_bytes')}
            entry.update({x: r[x] for x in GRID_DIMS + ('ep', 'zero_stage', 'sequence_parallel', 'schedule',
                                                        'offload', 'gpus_used', 'n_microbatches')})
            entry['activation_checkpointing'] = ckpt
            if 'error' in r:
                out[name] = dict(entry, activation_bytes=None, logits_bytes=None, total_bytes=None,
                                 fits=False, error=r['error'])
                continue
            suffix = '_ckpt' if ckpt else ''
            out[name] = dict(entry, activation_bytes=r['activation_bytes' + suffix],
                             activations_and_logits_bytes=r['activations_and_logits_bytes' + suffix],
                             total_bytes=r['total_bytes' + suffix],
                             fits=r['fits'] == 'yes' or (ckpt and r['fits'] == 'with ckpt'),
                             host_bytes=r.get('host_bytes', 0), gathered_bytes=r.get('gathered_bytes', 0),
                             **{k: r[k] for k in ('logits_bytes', 'comm_bytes_per_step', 'params_per_rank',
                                                  'activation_bytes_per_layer', 'layers_per_rank',
                                                  'microbatches_in_flight')})
    return out


def print_estimate(args, gptconf, counts, rows, n_micro, seq_len, mixed, vocab_note):
    """The model's line, the ZeRO paper's model-state table and every strategy's row."""
    moe = (f"; {gptconf.n_expert} experts, top-{gptconf.n_expert_active}: {counts['active'] / 1e9:.3g}B "
           f"active, {counts['experts'] / 1e9:.3g}B in the experts" if gptconf.n_expert else '')
    per_step = (f"a global batch of {args.global_batch} sequences per step" if args.global_batch else
                f"{n_micro} micro-batches per step")
    header = (f"{args.estimate}: Ψ = {counts['total'] / 1e9:.3g}B parameters (L {gptconf.n_layer}, "
              f"h {gptconf.n_embd}, a {gptconf.n_head}, kv {gptconf.n_kv_head}, V {gptconf.vocab_size}"
              f"{vocab_note}{moe}); {args.gpus} GPUs of {args.gpu_mem_gb} GB; micro-batch "
              f"{args.micro_batch} x {seq_len} tokens, {per_step}; "
              f"{'bf16 mixed precision' if mixed else 'fp32'}. Per GPU (the largest rank):")
    print(model_state_markdown(counts['total'], args.gpus, mixed) + '\n')
    print(estimate_markdown(rows, header, None if args.global_batch else n_micro, mixed))


def print_checked(checked, gpus):
    print(f"\nThe estimate against what the scripts measured, run here on {gpus} processes:\n")
    print('| strategy | script | what | estimate | measured | measured / estimate |\n'
          '|---|---|---|---|---|---|')
    for c in checked:
        print(f"| {c['strategy']} | {c['script']} | {c['what']} | {c['estimate']:,} | "
              f"{c['measured']:,} | {c['measured'] / c['estimate']:.4f} |")
