"""
A planned strategy's step on a GPU cluster (cluster_step_ms), for bench.py --estimate's ranking of the
strategies that fit: compute, a pipeline's bubble and each group's communication (step_time.py's three sums),
from figures the user states (peak FLOP/s and an efficiency, NVLink and network bandwidths, a latency), each
group's traffic hidden where the strategy overlaps it. Modelled: nothing here is measured.
"""

import torch

from common import formulas
from model import GPT

FIGURES = ('gpu_tflops', 'flops_efficiency', 'gpus_per_node', 'nvlink_gbps', 'ib_gbps', 'pcie_gbps',
           'host_adam_gparams', 'latency_us')  # the flags of add_device_arguments


def add_device_arguments(p):
    """The stated figures of the GPUs bench.py --estimate prices a step on (defaults: an H100 SXM node)."""
    p.add_argument('--gpu_tflops', type=float, default=None,
                   help="--estimate: a GPU's peak TFLOP/s in the run's dtype (default: H100 SXM, dense: 989 "
                        "in bf16, 495 in fp32: TF32, as the scripts run it)")
    p.add_argument('--flops_efficiency', type=float, default=0.5,
                   help='--estimate: the fraction of that peak the model computes at (stated, not measured)')
    p.add_argument('--gpus_per_node', type=int, default=8)
    p.add_argument('--nvlink_gbps', type=float, default=450,
                   help='--estimate: GB/s a GPU sends to one in its node (H100 NVLink: 450 each way)')
    p.add_argument('--ib_gbps', type=float, default=50,
                   help='--estimate: GB/s a GPU sends to other nodes (a 400 Gb/s NIC per GPU: 50)')
    p.add_argument('--pcie_gbps', type=float, default=50, help='--estimate: GB/s between a GPU and its host')
    p.add_argument('--host_adam_gparams', type=float, default=1.0,
                   help="--estimate: offload: billions of parameters a second the host's AdamW updates for "
                        "one GPU")
    p.add_argument('--latency_us', type=float, default=10, help="--estimate: a collective's fixed time")


def group_gbps(row, group, figures):
    """The bandwidth a rank of the group sends at: NVLink when the group's ranks share a node; else the
    network, whose NICs (one a GPU) the group's ranks in a node use side by side (NCCL runs a ring through
    each): k x ib_gbps for k of them in a node, at most NVLink's. Ranks are laid out as the scripts' grids
    are, (dp, pp, cp, tp) with tp fastest; the gradients' group is dp x cp, an ep group a run of dp ranks."""
    grid = torch.arange(row['dp'] * row['pp'] * row['cp'] * row['tp']).view(row['dp'], row['pp'], row['cp'],
                                                                            row['tp'])
    members = {'tp': grid[0, 0, 0], 'cp': grid[0, 0, :, 0], 'pp': grid[0, :, 0, 0],
               'dp': grid[:, 0, :, 0].flatten(), 'ep': grid[:row['ep'], 0, 0, 0]}[group]
    per_node = torch.bincount(members // figures.gpus_per_node)
    if (per_node > 0).sum() == 1:
        return figures.nvlink_gbps
    return min(figures.nvlink_gbps, int(per_node.max()) * figures.ib_gbps)


def cluster_step_ms(row, gptconf, seq_len, micro_batch, figures, ckpt=False):
    """{ms, compute_ms, bubble_ms, comm_ms, exposed_ms}: a step of a planner row on GPUs of stated figures.
    compute: the step's training FLOPs (model.flops_per_token; 8N instead of 6N with activation checkpointing,
    which runs each forward twice) split over the tp x pp x cp ranks that share a replica, at
    gpu_tflops x flops_efficiency; a pipeline's bubble on top (formulas.bubble_fraction_formula). Each group's
    traffic (planner.comm_per_step) at its link's bandwidth plus a latency a call; hidden behind compute where
    the strategy overlaps it: gradients behind the backward (DDP and ZeRO-1 only the last micro-batch's;
    ZeRO-2 every micro-batch's; ZeRO-3's gathers behind all the compute), the ring's kv blocks behind the
    attention they feed; ZeRO-1's and 2's gather of the updated parameters after the step, tensor
    parallelism's, the pipeline's, the all-to-alls and offload's copies and host AdamW not."""
    with torch.device('meta'):
        gpt = GPT(gptconf)
    flops_per_token = gpt.flops_per_token(seq_len)
    # attention's FLOPs a token: the term linear in the sequence, what doubling it adds
    attention_share = (gpt.flops_per_token(2 * seq_len) - flops_per_token) / flops_per_token
    m, p = row['n_microbatches'], row['pp']  # micro-batches a replica runs a step, stages
    flops = flops_per_token * micro_batch * seq_len * m * (8 / 6 if ckpt else 1)
    compute = flops / (row['tp'] * p * row['cp']) / (figures.gpu_tflops * 1e12 * figures.flops_efficiency)
    # (the update: the GPU's AdamW, memory-bound, is left out; offload's on the host is priced below)
    bubble = 0.0
    if p > 1:
        f = formulas.bubble_fraction_formula(p, m, schedule=row['schedule'])
        bubble = compute * f / (1 - f)
    attention = compute * attention_share
    hidden_by = {'dp': (compute if row['zero_stage'] == 3 else 2 / 3 * compute if row['zero_stage'] == 2
                        else 2 / 3 * compute / m), 'cp': attention}
    comm = exposed = 0.0
    for group, (nbytes, calls) in row['comm_parts'].items():
        gbps = group_gbps(row, group.split()[0], figures)
        seconds = calls * figures.latency_us * 1e-6 + nbytes / (gbps * 1e9)
        comm += seconds
        exposed += max(0.0, seconds - hidden_by.get(group, 0.0))
    if row['offload']:  # a rank's gradient shard to the host, the host's AdamW on it, its parameters back
        host = (row['grad_bytes'] + row['param_bytes']) / (figures.pcie_gbps * 1e9)
        comm, exposed = comm + host, exposed + host
        compute += row['params_per_rank'] / (row['dp'] * row['cp']) / (figures.host_adam_gparams * 1e9)
    ms = lambda x: 1000 * x
    return dict(ms=ms(compute + bubble + exposed), compute_ms=ms(compute), bubble_ms=ms(bubble),
                comm_ms=ms(comm), exposed_ms=ms(exposed))


def fastest_first(rows, gpus, gptconf, seq_len, micro_batch, figures):
    """The planner's rows that fit on all the gpus (with activation checkpointing where only so), each priced
    by cluster_step_ms, with its tokens a second over the cluster (dp replicas of micro_batch x seq_len x
    n_microbatches tokens a step) and its MFU (the model's 6N + attention FLOPs of those tokens, over all the
    GPUs' peak: a recomputed forward is not counted), the fastest first."""
    ranked = []
    with torch.device('meta'):
        flops_per_token = GPT(gptconf).flops_per_token(seq_len)
    for r in rows:
        if r.get('fits') not in ('yes', 'with ckpt') or r['gpus_used'] != gpus:
            continue
        ckpt = r['fits'] == 'with ckpt'
        step = cluster_step_ms(r, gptconf, seq_len, micro_batch, figures, ckpt)
        sequences = r['dp'] * micro_batch * r['n_microbatches']
        tokens_per_s = sequences * seq_len / (step['ms'] / 1000)
        ranked.append(dict(step, strategy=r['strategy'] + ' + ckpt' * ckpt, ckpt=ckpt,
                           sequences=sequences, tokens_per_s=tokens_per_s,
                           mfu=tokens_per_s * flops_per_token / (gpus * figures.gpu_tflops * 1e12)))
    return sorted(ranked, key=lambda step: -step['tokens_per_s'])


def ranking_lines(ranked, gpus, figures):
    """fastest_first's rows as a table, under a line that says what the times stand on."""
    f = figures
    lines = [f"Step time on the stated GPUs (modelled, nothing measured: {f.gpu_tflops:g} TFLOP/s peak x "
             f"{f.flops_efficiency:g}; NVLink {f.nvlink_gbps:g} GB/s inside nodes of {f.gpus_per_node}, "
             f"{f.ib_gbps:g} GB/s between them, {f.latency_us:g} us a call; cluster_step_ms says what "
             f"overlaps), the strategies that fit on all {gpus} GPUs, fastest first:",
             '', '| | strategy | sequences a step | ms/step | compute | bubble | communication (exposed) '
             '| tokens/s | MFU |', '|---|---|---|---|---|---|---|---|---|']
    for i, s in enumerate(ranked, 1):
        lines.append(f"| {i} | {s['strategy']} | {s['sequences']} | {s['ms']:.1f} | {s['compute_ms']:.1f} | "
                     f"{s['bubble_ms']:.1f} | {s['comm_ms']:.1f} ({s['exposed_ms']:.1f}) | "
                     f"{s['tokens_per_s']:,.0f} | {100 * s['mfu']:.0f}% |")
    return lines if ranked else lines[:1] + ['(none fits)']
