"""
Every strategy of this repo side by side on the same model and data, measured beside the papers' formulas; and
a memory planner (planner.py) for models too large to run here.

    python bench.py                         # quick: 8 rows, a small model, ~75 s on 2 cores
    python bench.py --full --plot           # every row, 512 wide (~10 minutes), and its pictures (matplotlib)
    python bench.py --rows=train,zero2,tp --world_size=4 --max_iters=20 --out=out_bench
    python bench.py --estimate config/tinyllama_1b.py --gpus=8 --gpu_mem_gb=80 --micro_batch=1 --tp=8 --pp=4
    python bench.py --estimate config/llama2_7b.py --gpus=16 --global_batch=256 --json   # as JSON
    python bench.py --estimate config/train_stdlib_char.py --gpus=2 --tp=2 --pp=2 --vocab_size=96 --check
    python bench.py --estimate --params=7.5e9 --gpus=64   # the ZeRO paper's example (model states only)

The bench runs each script as a user does (torchrun) and reads what the script wrote to its log.jsonl:
timing, loss, measured bytes and their formulas. It measures nothing of the runs itself and writes no formula;
under the table, each row's step time as common/step_time.py predicts it from rates it measures here. The
planner (--estimate, common/planner.py): memory from formulas.py (what the scripts print beside what they
measure); the strategies that fit, ranked by common/cluster_time.py's step; --check runs three of them here.
"""

import argparse
import contextlib
import json
import re
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

import context_parallel as cp_script  # (its ring's attention, timed alone for the predicted step)
import tensor_parallel as tp_script  # (a tp rank's pass, timed alone for the predicted step)
from train_fsdp import shard_model as fsdp_shard  # (an FSDP2 rank's pass and update: the same)
from common.plots import plot
from common import plan_tables, planner, step_time
from common.data import load_dataset

REPO = os.path.dirname(os.path.abspath(__file__))


# -----------------------------------------------------------------------------
# --estimate --check: three of the planned strategies run here, estimate beside measured

CHECK_FLAGS = ['--dropout=0.0', '--compile=False', '--eval_iters=1', '--eval_interval=1000', '--max_iters=2',
               '--log_interval=1', '--sample_at_end=False', '--always_save_checkpoint=False']


def check_estimate(args, overrides, rows, best, ds_path, n_micro):
    """--check: run three of the estimated strategies here, on --gpus processes with the estimate's shapes (so
    only for a model that fits this machine), and read back what each script measured: the cheapest ZeRO stage
    (zero.py with the ds_config.json just written; ZeRO-1 when the cheapest is not a ZeRO stage) its model
    states, TP + SP one block's saved activations and its parameters, PP 1F1B the first stage's peak of saved
    activations. Returns one dict per number."""
    by_name = {r['strategy']: r for r in rows}
    base = [args.estimate] + list(overrides) + CHECK_FLAGS + [f'--dtype={args.dtype}']
    base += [f'--block_size={args.seq_len}'] if args.seq_len else []
    runs = []
    # zero.py run with the DeepSpeed config of the cheapest strategy when that is a ZeRO stage, else of ZeRO-1
    # (the DDP row is priced as train_ddp.py holds it, which zero.py's stage 0 does not: bf16 weights)
    zero_row = by_name.get((best or '').replace(' + ckpt', ''))
    plain_zero = zero_row and zero_row['tp'] == zero_row['pp'] == zero_row['cp'] == 1
    if not (plain_zero and zero_row['zero_stage'] >= 1 and 'FSDP' not in zero_row['strategy']):
        zero_row = by_name['ZeRO-1']
        ds_path = os.path.join(args.out, 'check_ds_config.json')
        with open(ds_path, 'w') as f:
            json.dump(planner.ds_config_for(zero_row, args.estimate, overrides, args.micro_batch, n_micro,
                                            args.dtype != 'float32'), f, indent=2)
    runs.append((zero_row, 'zero.py', [f'--deepspeed_config={ds_path}'],
                 [('param_bytes', 'param_bytes'), ('grad_bytes', 'grad_bytes'),
                  ('optim_bytes', 'optim_bytes')]))
    tp_row = by_name.get(f'TP={args.tp} + SP')
    if tp_row and 'error' not in tp_row and args.gpus % args.tp == 0:
        runs.append((tp_row, 'tensor_parallel.py', [f'--tp={args.tp}', '--sequence_parallel=True',
                                                    f'--batch_size={args.micro_batch}',
                                                    f'--gradient_accumulation_steps={args.gpus // args.tp}'],
                     [('activation_bytes_per_layer', 'activation_bytes'), ('param_bytes', 'param_bytes')]))
    pp_row = by_name.get(f'PP={args.pp} 1F1B')
    if pp_row and 'error' not in pp_row and args.gpus % args.pp == 0:
        runs.append((pp_row, 'pipeline.py',
                     [f'--pp={args.pp}', '--schedule=1f1b', f'--n_microbatches={n_micro}',
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
        ranks = [r for r in read_log(out_dir)
                 if 'rank' in r and (script != 'pipeline.py' or r.get('stage') == 0)]
        for planned, measured in pairs:
            values = [r[measured] for r in ranks if r.get(measured) is not None]
            checked.append({'strategy': row['strategy'], 'script': script, 'what': measured,
                            'estimate': row[planned], 'measured': max(values)})
    return checked


# -----------------------------------------------------------------------------
# the bench: every script on the same small GPT, the same data and the same global batch

# `python bench.py` runs these (about 75 s on 2 cores); --full runs every row of bench_rows
MOE, MOE_ROWS = ['--n_expert=4', '--n_expert_active=2'], step_time.MOE_ROWS + ('grid_pp_tp_ep',)
QUICK_ROWS = ['train', 'ddp', 'zero0', 'zero3', 'fsdp', 'tp', 'pp_1f1b', 'cp_ring']


def bench_rows(world_size, n_microbatches, max_iters=12):
    """name -> (script, its own flags, processes). The order is the table's. The pipeline rows measure their
    first step and their last (warm) one, whose numbers the table shows."""
    w, last = world_size, f'--measure_every={max(1, max_iters - 1)}'
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
        'pp_gpipe': ('pipeline.py', [f'--pp={w}', '--schedule=gpipe', f'--n_microbatches={n_microbatches}',
                                     last], w),
        'pp_1f1b': ('pipeline.py', [f'--pp={w}', '--schedule=1f1b', f'--n_microbatches={n_microbatches}',
                                    last], w),
        'pp_zb1': ('pipeline.py', [f'--pp={w}', '--schedule=zb1', f'--n_microbatches={n_microbatches}', last],
                   w),
        # the same run measured on every step (a barrier, a synchronize, clocks, a MAX all-reduce a schedule)
        'pp_1f1b_measured': ('pipeline.py', [f'--pp={w}', '--schedule=1f1b',
                                             f'--n_microbatches={n_microbatches}', '--measure_every=1'], w),
        'pp_interleaved': ('pipeline.py', [f'--pp={w}', '--schedule=interleaved', '--virtual_stages=2',
                                           f'--n_microbatches={n_microbatches}', last], w),
        'cp_ring': ('context_parallel.py', [f'--cp={w}', '--cp_attention=ring'], w),
        'cp_ulysses': ('context_parallel.py', [f'--cp={w}', '--cp_attention=ulysses'], w),
        # a mixture of experts (4 experts, top-2): its own model, so its own reference row
        'train_moe': ('train.py', MOE, 1),
        'ep': ('expert_parallel.py', [f'--ep={w}'] + MOE, w),
        'tp_moe': ('tensor_parallel.py', [f'--tp={w}'] + MOE, w),  # whole experts spread over the tp ranks
        # the grid with experts (ep 2 folded into dp), a microbatch a micro-step: routed as train.py's
        'grid_pp_tp_ep': ('parallel_4d.py', ['--pp=2', '--tp=2', '--ep=2', '--schedule=gpipe',
                                             '--n_microbatches=1'] + MOE, 4 * w),
        # the grid: dp = world_size again, times 2 x 2 more processes (8 for the default world_size of 2)
        'grid_dp_pp_tp': ('parallel_4d.py', ['--pp=2', '--tp=2'], 4 * w),
        'grid_dp_cp_tp': ('parallel_4d.py', ['--cp=2', '--tp=2'], 4 * w),
    }


def model_flags(args):
    """The small GPT and the batch every row trains: the same global batch (batch_size x world_size sequences)
    for every script; dp ranks split it, tp/pp ranks share it. fp32, dropout 0: every row gives one loss."""
    return [f'--n_layer={args.n_layer}', f'--n_head={args.n_head}', f'--n_embd={args.n_embd}',
            f'--block_size={args.block_size}', f'--batch_size={args.batch_size}',
            f'--gradient_accumulation_steps={args.world_size}', f'--max_iters={args.max_iters}',
            f'--lr_decay_iters={args.max_iters}', '--warmup_iters=2', f'--learning_rate={args.learning_rate}',
            '--log_interval=1', f'--eval_interval={args.max_iters}', '--eval_iters=1', '--dropout=0.0',
            f'--dtype={args.dtype}', '--compile=False', '--sample_at_end=False',
            '--always_save_checkpoint=False', f'--seed={args.seed}'] + (
        [f'--peak_flops={args.peak_flops}'] if args.peak_flops else [])


def command(script, flags, nproc):
    torchrun = ['-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}']
    return [sys.executable] + (torchrun if nproc > 1 else []) + [script] + flags


def read_log(out_dir):
    path = os.path.join(out_dir, 'log.jsonl')
    with open(path) if os.path.exists(path) else contextlib.nullcontext([]) as f:
        return [json.loads(line) for line in f if line.strip()]


MEASURED = ['param_bytes', 'grad_bytes', 'optim_bytes', 'activation_bytes', 'peak_activation_bytes',
            'collective_bytes', 'wire_bytes', 'p2p_bytes_per_step', 'bubble_fraction', 'compute_fraction',
            'send_recv_fraction', 'peak_microbatches_held']


def summarize(log, warmup):
    """What the script reported: median ms (its timed steps' range), tokens/s, MFU after the warm-up, of the
    steps not observed; the loss curve, a MoE's routing, per-rank rows (merged), each measured's largest."""
    train_rows = [r for r in log if 'loss' in r and 'rank' not in r and 'ms' in r]
    timed = [r for r in train_rows if r['iter'] >= warmup] or train_rows
    timed = [r for r in timed if not r.get('observed')] or timed  # (observed: the observer's time in it)
    out = {'losses': {r['iter']: r['loss'] for r in train_rows}}
    for key in ('ms', 'tokens_per_sec', 'mfu', 'peak_mem_bytes'):
        values = [r[key] for r in timed if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out['ms_range'] = (min(r['ms'] for r in timed), max(r['ms'] for r in timed)) if timed else None
    out['final_loss'] = train_rows[-1]['loss'] if train_rows else None
    out['tokens_per_expert'] = [r['tokens_per_expert'] for r in log
                                if 'tokens_per_expert' in r and 'rank' not in r and r['iter'] >= warmup]
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
    env, t0 = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED='1'), time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.row_timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return {'status': f'failed: no result within {args.row_timeout} s', 'wall_s': time.time() - t0}
    row = {'wall_s': time.time() - t0,
           'command': ' '.join(['python' if c == sys.executable else c for c in cmd])}
    if proc.returncode != 0:
        lines = [l for l in (proc.stderr + proc.stdout).splitlines() if l.strip()]
        # the script's own line ('[rank r] error: ...', or a traceback's last line), not torchrun's summary
        ours = [l for l in lines if 'error:' in l or re.match(r'\w+(Error|Exception): ', l.strip())]
        error = (ours or [l for l in lines if 'error' in l.lower()] or lines[-1:] or [''])[0]
        row['status'] = f'failed (exit {proc.returncode}): {error.strip()[:200]}'
        return row
    row.update(summarize(read_log(out_dir), args.warmup))
    row['status'] = 'ok' if row['final_loss'] is not None else 'failed: no training rows in log.jsonl'
    return row


def check_losses(results, rtol):
    """Compare every row's loss curve with the first ok row's of the same model (train.py's when it ran; the
    mixture-of-experts rows with train_moe's): the largest relative difference over the iterations both
    logged. Marks each row 'same' or 'DIFFERS'."""
    ok = {n: r for n, r in results.items() if r.get('status') == 'ok'}
    if not ok:
        return None
    for name, r in ok.items():
        group = [n for n in ok if (n in MOE_ROWS) == (name in MOE_ROWS)]
        ref = ok[group[0]]['losses']
        common = [i for i in r['losses'] if i in ref]
        r['loss_max_rel_diff'] = (max(abs(r['losses'][i] - ref[i]) / abs(ref[i]) for i in common)
                                  if common else None)
        r['loss_matches'] = r['loss_max_rel_diff'] is not None and r['loss_max_rel_diff'] <= rtol
    return all(r['loss_matches'] for r in ok.values())


def measured_cell(row, key, fmt=plan_tables.fmt_bytes):
    """'measured (formula)' from the script's own per-rank rows; '-' where the script does not report it."""
    value, formula = row.get(key), row.get(key + '_formula')
    if value is None:
        return '-' if formula is None else f"- ({fmt(formula)})"
    return fmt(value) + ('' if formula is None else f" ({fmt(formula)})")


def activation_cell(row):
    """tensor_parallel.py: one layer's saved activations; pipeline.py: a stage's peak of saved activations."""
    if row.get('activation_bytes') is None and row.get('peak_activation_bytes') is not None:
        return measured_cell(row, 'peak_activation_bytes') + ' peak'
    return measured_cell(row, 'activation_bytes')


def sent_cells(row):
    """Bytes one rank sent per step: handed to its collectives and sends (counted at the calls), and on the
    wire: measured from the OS's loopback counter (the ring formula for those calls in parentheses)."""
    counted = plan_tables.fmt_bytes(row.get('collective_bytes'))  # ('-' for none)
    if row.get('wire_bytes') is None and row.get('wire_bytes_formula') is None:
        return counted, '-'
    return counted, measured_cell(row, 'wire_bytes')


def bubble_cell(row, pct):
    """The pipeline's measured bubble (formula), the share of the step in send/recv, and the most
    micro-batches' activations a stage held."""
    cell = measured_cell(row, 'bubble_fraction', pct)
    if row.get('send_recv_fraction') is not None:
        cell += f", send/recv {pct(row['send_recv_fraction'])}"
    held = row.get('peak_microbatches_held')
    return cell if held is None else f"{cell}, held {held}"


def bench_markdown(results, rows, all_same, rtol):
    pct = lambda x: f"{100 * x:.1f}%"
    cols = ('row, script, ms/step, tokens/s, MFU, params/rank, grads/rank, optimizer/rank, activations/rank, '
            'sent/step/rank: collective bytes, wire bytes, bubble, final loss, same loss').split(', ')
    lines = ['| ' + ' | '.join(cols) + ' |', '|---' * len(cols) + '|']
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
        verdict = (f"Final loss: the same in every row that ran ({len(ok)} rows, loss curves within {rtol:g} "
                   f"relative).")
    elif all_same is None:  # (the GPT-2 row alone: a model of its own, nothing to compare its loss with)
        verdict = "No row of the bench's model ran: no losses to compare."
    else:
        differ = [n for n in ok if not results[n]['loss_matches']]
        verdict = (f"Final loss: DIFFERS in rows {', '.join(differ)} (more than {rtol:g} relative from "
                   f"{ok[0]}).")
    missing = [f"{n} ({results[n]['status']})" for n in results if results[n].get('status') != 'ok']
    not_run = [f"Rows that did not run: {'; '.join(missing)}."] if missing else []
    return '\n'.join(lines + ['', verdict] + not_run)


def machine_description(args):
    if torch.cuda.is_available():
        name = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, NCCL"
    else:
        name = f"{os.cpu_count()}-core CPU, gloo"
    load = f", load average {os.getloadavg()[0]:.1f} at the start" if hasattr(os, 'getloadavg') else ''
    return (f"{name}, torch {torch.__version__}, {args.world_size} processes per distributed row, "
            f"{args.threads} thread(s) per process{load}")


GPT2_ROW = 'gpt2_124m_bf16_compile'  # a different model: left out of the same-loss comparison


def select_rows(args):
    """The rows this machine runs: (every row by name, the names selected). On one GPU only the single-process
    rows, and (on any GPU) GPT-2 124M in bf16 with compile, for MFU: on GPT-2 BPE tokens when they are there
    (python data/shakespeare/prepare.py), else the same shape on the default characters."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus == 1:
        args.world_size = 1
    elif n_gpus > 1 and args.world_size > n_gpus:
        raise SystemExit(f"error: --world_size={args.world_size} but only {n_gpus} GPUs")
    rows = bench_rows(args.world_size, args.n_microbatches, args.max_iters)
    if n_gpus == 1:
        rows = {'train': rows['train']}
    if n_gpus >= 1:
        bpe = os.path.exists(os.path.join(REPO, 'data', 'shakespeare', 'train.bin'))
        rows[GPT2_ROW] = ('train.py', ['--n_layer=12', '--n_head=12', '--n_embd=768', '--block_size=1024',
                                       '--batch_size=16', '--gradient_accumulation_steps=1',
                                       '--dtype=bfloat16', '--compile=True', '--bias=True',
                                       f"--dataset={'shakespeare' if bpe else 'stdlib_char'}"], 1)
    selected = list(rows) if args.rows == 'all' or (n_gpus == 1 and args.rows == ','.join(QUICK_ROWS)) \
        else args.rows.split(',')
    unknown = [n for n in selected if n not in rows]
    if unknown:
        raise SystemExit(f"error: unknown row(s) {', '.join(map(repr, unknown))}; valid: {', '.join(rows)}")
    if args.world_size < 2 and any(rows[n][2] > 1 for n in selected):
        raise SystemExit("error: distributed rows need --world_size >= 2")
    split = any(n.startswith(('tp', 'pp', 'cp', 'grid')) for n in selected)
    if split and (args.n_head % args.world_size or args.n_layer % args.world_size):
        raise SystemExit(f"error: n_head ({args.n_head}) and n_layer ({args.n_layer}) must be divisible by "
                         f"--world_size={args.world_size} for the tp, pp and cp rows")
    return rows, selected


def repeated_times(runs, results):
    """--repeat: each row's medians of its runs (ms/step, tokens/s, MFU), alternated with the others'; for two
    rows, their ratio run by run: a busy moment slows both runs of a pair, so that ratio is steadier."""
    lines = [f"{n}: {statistics.median(r['ms'] for r in rs):.1f} ms/step, the median of {len(rs)} runs "
             f"({min(r['ms'] for r in rs):.1f} to {max(r['ms'] for r in rs):.1f})" for n, rs in runs.items()]
    if len(runs) == 2:
        (a, runs_a), (b, runs_b) = runs.items()
        ratios = [x['ms'] / y['ms'] for x, y in zip(runs_a, runs_b)]
        lines.append(f"{a} / {b}, run by run: median {statistics.median(ratios):.3f} "
                     f"({min(ratios):.3f} to {max(ratios):.3f})")
    for name, rs in runs.items():  # (last: a row's result is its first run; the runs' range is printed above)
        results[name].update({k: statistics.median(r[k] for r in rs) for k in ('ms', 'tokens_per_sec', 'mfu')
                              if rs[0].get(k) is not None}, ms_range=None)
    return '\n'.join(lines)


def run_bench(args):
    rows, selected = select_rows(args)
    load_dataset('stdlib_char')  # prepare the data once, before the rows race to do it
    runs_dir = os.path.join(args.out, 'runs')
    os.makedirs(runs_dir, exist_ok=True)
    machine = machine_description(args)
    print(f"bench: {len(selected)} rows on {machine}; {args.max_iters} iterations each, "
          f"timing after {args.warmup}; logs in {runs_dir}", flush=True)
    results, runs, t_start = {}, {}, time.time()
    for i, name in [(i, name) for _ in range(args.repeat) for i, name in enumerate(selected)]:  # alternated
        script, flags, nproc = rows[name]
        print(f"[{i + 1}/{len(selected)}] {name}: {' '.join([script] + flags)} on {nproc} process(es) ...",
              end=' ', flush=True)
        r = run_row(name, script, flags, nproc, args, runs_dir)  # its flags override the bench's
        results.setdefault(name, r)
        runs.setdefault(name, []).append(r)
        detail = f"{r['ms']:.1f} ms/step, loss {r['final_loss']:.6f}" if r['status'] == 'ok' else r['status']
        print(f"{detail} ({r.get('wall_s', 0):.0f} s; {time.time() - t_start:.0f} s so far)", flush=True)
    if args.repeat > 1 and all(r.get('ms') is not None for rs in runs.values() for r in rs):
        print(repeated_times(runs, results))
    moe = planner.gpt_config_from(None, model_flags(args) + MOE, load_dataset('stdlib_char')[1])  # (MoE rows)
    priced = step_time.predicted_lines(results, args, moe.vocab_size, moe, cp_script, tp_script, fsdp_shard)
    compared = {n: r for n, r in results.items() if n != GPT2_ROW}
    rtol = args.loss_rtol if args.loss_rtol is not None else (1e-4 if args.dtype == 'float32' else 2e-2)
    all_same = check_losses(compared, rtol)
    cmd_line = 'python bench.py ' + ' '.join(sys.argv[1:])
    other = ' (the GPT-2 row: its own)' * (GPT2_ROW in results)
    header = (f"`{cmd_line.strip()}` on {machine}. Model{other}: {args.n_layer} layers, {args.n_head} heads, "
              f"{args.n_embd} wide, block {args.block_size}; global batch {args.batch_size * args.world_size}"
              f" sequences; {args.dtype}. Times: median of iterations {args.warmup}..{args.max_iters - 1}. "
              f"Bytes: the script's own per-rank report, largest rank, measured (formula); a pipeline's peak "
              f"activations' formula: microbatches held x the most one held, measured (zb1: + W's grads).")
    table = bench_markdown(results, rows, all_same, rtol)
    table += '\n\n' + '\n'.join(priced)
    print('\n' + header + '\n\n' + table, flush=True)
    with open(os.path.join(args.out, 'bench.md'), 'w') as f:
        f.write(header + '\n\n' + table + '\n')
    with open(os.path.join(args.out, 'bench.json'), 'w') as f:
        json.dump({'command': cmd_line.strip(), 'machine': machine, 'all_losses_equal': all_same,
                   'loss_rtol': rtol, 'rows': results}, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'bench.md')} and bench.json ({time.time() - t_start:.0f} s)")
    if args.plot:
        print(f"drew {', '.join(plot(results, args.out, GPT2_ROW))}")
    failed = [n for n, r in results.items() if r['status'].startswith('failed')]
    if failed or all_same is False:
        sys.exit(1)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], allow_abbrev=False,  # (no --n_emb)
                                formatter_class=argparse.RawTextHelpFormatter)
    planner.add_estimate_arguments(p)  # --estimate and its flags: planner.py
    p.add_argument('--full', action='store_true', help='every row, on the 512-wide model, 12 iterations')
    p.add_argument('--rows', default=None,
                   help=f"comma-separated rows (default {','.join(QUICK_ROWS)}; --full: all)")
    p.add_argument('--world_size', type=int, default=2)
    p.add_argument('--max_iters', type=int, default=None, help='default 8 (--full: 12)')
    p.add_argument('--warmup', type=int, default=2, help='iterations left out of the timing')
    p.add_argument('--n_layer', type=int, default=4)
    p.add_argument('--n_head', type=int, default=4)
    p.add_argument('--n_embd', type=int, default=None,
                   help='default 128; --full: 512, wide enough that compute dominates, so the pipeline rows '
                        'measure a bubble near the formula')
    p.add_argument('--block_size', type=int, default=128)
    p.add_argument('--learning_rate', type=float, default=3e-4,
                   help='low enough that the 512-wide model trains without a loss spike: a spike amplifies '
                        'the rounding differences between strategies past the same-loss tolerance')
    p.add_argument('--batch_size', type=int, default=8, help='sequences per dp rank (x world_size)')
    p.add_argument('--dtype', default=None, help='bench default float32; estimate default bfloat16 (mixed)')
    p.add_argument('--seed', type=int, default=1337)
    p.add_argument('--peak_flops', type=float, default=None, help="the device's peak FLOP/s (CPU MFU)")
    p.add_argument('--loss_rtol', type=float, default=None, help='default 1e-4 (fp32), 2e-2 (16-bit)')
    p.add_argument('--threads', type=int, default=None,
                   help='threads per process in every row (default: cores / world_size, at least 1)')
    p.add_argument('--row_timeout', type=int, default=600)
    p.add_argument('--repeat', type=int, default=1, help='run the rows this many times, alternating (zero0,'
                   'ddp,zero0,...): the median of each, and two rows\' ratio run by run')
    p.add_argument('--remeasure', action='store_true', help="measure the predicted step's rates again")
    p.add_argument('--out', default='out_bench')
    p.add_argument('--plot', action='store_true',
                   help='also draw the loss curves, memory and communication as PNGs in --out (matplotlib)')
    args, rest = p.parse_known_args(argv)
    rest += planner.planned_model_flags(argv) if args.estimate is not None else []  # (the plan's model's)
    args.rows = ('all' if args.full else ','.join(QUICK_ROWS)) if args.rows is None else args.rows
    args.max_iters = args.max_iters or (12 if args.full else 8)
    args.n_embd = args.n_embd or (512 if args.full else 128)
    bad = [a for a in rest if not a.startswith('--') or args.estimate is None]
    if bad:
        raise SystemExit(f"error: unrecognized arguments: {' '.join(bad)}")
    if (args.json or args.check) and (args.estimate is None or args.params):
        raise SystemExit("error: --json and --check need --estimate CONFIG (a model's shape), not --params")
    args.dtype = args.dtype or ('bfloat16' if args.estimate is not None else 'float32')
    if args.dtype not in ('float32', 'bfloat16', 'float16'):
        raise SystemExit(f"error: --dtype must be float32, bfloat16 or float16, got {args.dtype!r}")
    if args.estimate is None and args.max_iters <= args.warmup:
        raise SystemExit(f"error: --max_iters ({args.max_iters}) must be more than --warmup ({args.warmup})")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.world_size)
    if min(args.gpus, args.world_size, args.micro_batch, args.repeat) < 1:
        raise SystemExit("error: --gpus, --world_size, --micro_batch and --repeat must be at least 1")
    return args, rest


def main(argv):
    args, overrides = parse_args(argv)
    if args.estimate is not None:
        planner.run_estimate(args, overrides, check=check_estimate)
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
