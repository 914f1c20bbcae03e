"""bench.py: the estimate reproduces the ZeRO paper's worked example and, at the tiny scale, what zero.py measures
from the tensors it holds; a bench run produces one table whose rows all reach the same loss, and the JSON."""
import json
import os

import pytest
from helpers import REPO, TINY, check, read_log, run_script, stdlib_vocab

import bench
from common import planner
from common import formulas
from common.data import load_dataset

# The ZeRO paper (Rajbhandari et al. 2020), its worked example: Ψ = 7.5B, N = 64, mixed-precision Adam.
# Published, rounded to 0.1 GB: DP 120 GB, ZeRO-1 31.4 GB, ZeRO-2 16.6 GB, ZeRO-3 1.9 GB per GPU.
PAPER_GB = [120.0, 31.4, 16.6, 1.9]

BENCH_MODEL = ['--n_layer=2', '--n_head=2', '--n_embd=16', '--block_size=16', '--batch_size=4']


def test_estimate_reproduces_the_zero_papers_example():
    for stage, paper in enumerate(PAPER_GB):
        states = planner.model_states(int(7.5e9), 64, stage, mixed_precision=True)
        assert abs(sum(states.values()) / 1e9 - paper) <= 0.05, (stage, states)
    proc = check(run_script('bench.py', ['--estimate', '--params=7.5e9', '--gpus=64']))
    for shown in ('120 GB', '31.4 GB', '16.6 GB', '1.88 GB'):
        assert shown in proc.stdout, proc.stdout


def estimate(config, *flags):
    """bench.py --estimate config flags --json, parsed."""
    return json.loads(check(run_script('bench.py', ['--estimate', str(config), '--json'] + list(flags))).stdout)


def test_estimate_of_a_config_lists_every_strategy(tmp_path):
    config = tmp_path / 'shape.py'
    config.write_text('# vocab_size: 32000\nn_layer = 4\nn_head = 8\nn_kv_head = 4\nn_embd = 256\n'
                      "block_size = 256\nnorm = 'rmsnorm'\nmlp = 'swiglu'\npos = 'rope'\ntie_embeddings = False\n")
    plan = estimate(config, '--gpus=8', '--gpu_mem_gb=1', '--tp=4', '--pp=2', '--cp=2', f'--out={tmp_path}')
    rows = plan['strategies']
    for name in ('DDP', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3', 'ZeRO-3 + offload', 'FSDP2 (full shard = ZeRO-3)', 'TP=4',
                 'TP=4 + SP', 'PP=2 1F1B', 'PP=2 GPipe', 'CP=2 ring'):
        for variant in (name, name + ' + ckpt'):
            assert variant in rows and 'error' not in rows[variant], variant
            assert set(rows[variant]) >= {'param_bytes', 'grad_bytes', 'optim_bytes', 'activation_bytes',
                                          'total_bytes', 'fits'}, variant
            assert isinstance(rows[variant]['fits'], bool)
    ddp, tp, tp_sp, zero3 = rows['DDP'], rows['TP=4'], rows['TP=4 + SP'], rows['ZeRO-3']
    assert rows['PP=2 GPipe']['activation_bytes'] > rows['PP=2 1F1B']['activation_bytes']
    assert tp_sp['activation_bytes'] < tp['activation_bytes'] < ddp['activation_bytes']
    assert rows['CP=2 ring']['activation_bytes'] < ddp['activation_bytes']
    assert rows['DDP + ckpt']['activation_bytes'] < ddp['activation_bytes']
    assert zero3['param_bytes'] + zero3['grad_bytes'] + zero3['optim_bytes'] < ddp['total_bytes'] - ddp[
        'activation_bytes']
    assert rows['ZeRO-3 + offload']['optim_bytes'] == 0 < rows['ZeRO-3 + offload']['host_bytes']
    assert plan['cheapest'] in rows and rows[plan['cheapest']]['fits'] and rows[plan['cheapest']]['gpus_used'] == 8
    ranked = plan['ranking']  # the step time on the stated GPUs: every row that fits on all 8, fastest first
    assert plan['fastest'] == ranked[0]['strategy'] and all(rows[s['strategy']]['fits'] for s in ranked)
    assert plan['fastest_command'].startswith('torchrun --standalone --nproc_per_node=8 ')


# 12 layers: on 2 ranks ZeRO-3 saves half the parameters, and holds two blocks (and their gradients) whole
# at its peak besides its embeddings: with fewer layers ZeRO-2 takes less
PLANNED = "n_layer = 12\nn_head = 4\nn_kv_head = 2\nn_embd = 32\nblock_size = 16\nbias = False\n" \
          "norm = 'rmsnorm'\nmlp = 'swiglu'\npos = 'rope'\ntie_embeddings = False\n"


def test_the_estimate_against_what_the_scripts_measure(tmp_path):
    """The planner on a tiny LLaMA-shaped model, 2 GPUs in fp32, with a memory limit between ZeRO-2's and
    ZeRO-3's totals: it must pick ZeRO-3 and write its DeepSpeed config. --check runs zero.py with that config,
    tensor_parallel.py and pipeline.py here: the model states they hold are the estimate's (exact up to padding),
    the activations they save within 10% (the embedding's indices and the like come on top)."""
    config = tmp_path / 'planned.py'
    config.write_text(PLANNED)
    vocab = load_dataset('stdlib_char')[1]
    flags = ['--gpus=2', '--dtype=float32', '--micro_batch=2', '--tp=2', '--pp=2', '--cp=2', '--n_microbatches=2',
             f'--vocab_size={vocab}', f'--out={tmp_path / "plan"}']
    rows = estimate(config, *flags)['strategies']
    limit = (rows['ZeRO-3']['total_bytes'] + rows['ZeRO-2']['total_bytes']) / 2
    plan = estimate(config, *flags, f'--gpu_mem_gb={limit / 1e9}', '--check')
    assert plan['cheapest'] == 'ZeRO-3', plan['cheapest']
    assert json.load(open(plan['ds_config']))['zero_optimization'] == {'stage': 3, 'overlap_comm': True}
    checked = {(c['script'], c['what']): c for c in plan['checked']}
    assert len(checked) == 6, checked
    for key in ('param_bytes', 'grad_bytes', 'optim_bytes'):
        c = checked[('zero.py', key)]
        padding = 4 * 3 * 12  # a bucket pads its chunk by at most N-1 elements (a few buckets, 12 bytes each)
        assert 0 <= c['measured'] - c['estimate'] <= padding, c
    c = checked[('tensor_parallel.py', 'param_bytes')]
    assert abs(c['measured'] - c['estimate']) <= 2 * 32 * 4, c  # the uneven vocabulary split: one row per table
    for c in (checked[('tensor_parallel.py', 'activation_bytes')], checked[('pipeline.py', 'peak_activation_bytes')]):
        assert abs(c['measured'] - c['estimate']) <= 0.1 * c['estimate'], c


def test_bench_rows_equal_losses_and_estimate_matches_measured(tmp_path):
    rows = 'train,zero3'
    proc = run_script('bench.py', [f'--rows={rows}', '--max_iters=4', '--warmup=1', '--world_size=2',
                                   '--peak_flops=1e12', f'--out={tmp_path}'] + BENCH_MODEL, timeout=300)
    check(proc)
    assert (tmp_path / 'bench.md').read_text().count('\n| ') >= 1 + len(rows.split(','))
    report = json.load(open(tmp_path / 'bench.json'))
    results = report['rows']
    assert list(results) == rows.split(',')
    for name, r in results.items():
        assert r['status'] == 'ok', (name, r['status'])
        for key in ('ms', 'tokens_per_sec', 'mfu', 'final_loss', 'losses', 'command', 'ranks'):
            assert r.get(key) is not None, (name, key)
    # every row reached train.py's loss, read straight from the JSON (not from the bench's own verdict)
    reference = results['train']['final_loss']
    for name, r in results.items():
        assert abs(r['final_loss'] - reference) <= 1e-5 * abs(reference), (name, r['final_loss'], reference)
    assert report['all_losses_equal'] is True

    # the estimate for this model (Ψ from the meta-device count) against the bytes zero.py measured per rank
    vocab_size = load_dataset('stdlib_char')[1]
    gptconf = planner.gpt_config_from(None, TINY + BENCH_MODEL, vocab_size)
    numel = planner.param_counts(gptconf)['total']
    for stage in (3,):
        estimate = planner.model_states(numel, 2, stage, mixed_precision=False)
        ranks = results[f'zero{stage}']['ranks']
        assert len(ranks) == 2
        for rank_row in ranks:
            assert rank_row['numel'] == numel  # the meta-device count is the model zero.py trains
            for key in ('param_bytes', 'grad_bytes', 'optim_bytes'):
                padding = 0.01 * estimate[key] + 64  # a few padded elements per shard
                assert abs(rank_row[key] - estimate[key]) <= padding, (stage, key, rank_row[key], estimate[key])
        # bytes sent: counted, the ring formula, and measured on the loopback interface, from zero.py's own rows
        row = results[f'zero{stage}']
        assert row['collective_bytes'] > 0 and row['wire_bytes'] > 0 and row['wire_bytes_formula'] > 0
    md = (tmp_path / 'bench.md').read_text()
    assert 'collective bytes' in md and 'wire bytes' in md
    # the step time predicted from this machine's measured rates (kept for the next run), beside the measured
    assert all(r['predicted_ms'] > 0 for r in results.values())
    assert 'predicted ms/step' in proc.stdout and (tmp_path / 'machine.json').exists()
    for name, r in results.items():  # beside the measured median, the spread of that row's own steps
        low, high = r['ms_range']
        assert f"(its steps {low:.0f}-{high:.0f})" in proc.stdout
        # the model's order of magnitude, not its accuracy (a benchmark's claim): a unit slip (seconds for
        # milliseconds) lands far outside this band
        assert 0.2 < r['predicted_ms'] / r['ms'] < 5, (name, r['predicted_ms'], r['ms'])
    assert_zero3_priced_as_counted(results['zero3'])
    waits = json.loads((tmp_path / 'machine.json').read_text())['waits']  # [(compute before a call, more s)]
    # four gaps, the first one timed unit of the sweep's compute (about a millisecond of three 256 x 256
    # matmuls): a clock or a unit slip puts it out of this range. (The later gaps are its multiples and the
    # waits its differences, clipped at 0 by construction: nothing more of their shape can be asserted.)
    assert len(waits) == 4 and 1e-5 < waits[0][0] < 0.1, waits
    rates = json.loads((tmp_path / 'machine.json').read_text())  # every part timed alone was timed
    assert {'ring_attention_s', 'tp_pass_s', 'tp_sp_pass_s', 'fsdp_pass_s', 'fsdp_update_s'} <= set(rates)
    assert 'not_timed' not in rates, rates['not_timed']



def assert_zero3_priced_as_counted(row):
    """What the prediction prices for the bench's zero3 row against what zero.py counted at its calls, on every
    rank: each bucket (a block, the root) gathered twice and reduced once (gloo: an all-reduce of the whole
    bucket); the sweep's all-gather is keyed by each rank's chunk, zero.py counts the gathered whole."""
    from common import step_time
    from model import GPTConfig
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=stdlib_vocab(), bias=False)
    calls = step_time.row_work('zero3', config, 4, 2, 4)['calls']
    priced = lambda kind, big: sum(n * c for k, n, c in calls if k == kind and (n > 4) == big)
    for r in row['ranks']:
        counted = r['collective_bytes_by_kind']
        assert priced('all_gather', True) * 2 == counted['all_gather'], (calls, counted)
        assert priced('all_reduce', True) == counted['reduce_scatter'], (calls, counted)
        assert priced('all_reduce', False) == counted['scalars'], (calls, counted)  # the loss, the clip's norm

def test_the_predicted_step_is_compute_plus_every_call_at_its_latency_and_bandwidth():
    """The arithmetic, on rates given by hand: two passes at 2 ms fixed, 2e8 FLOPs at 1e9 FLOP/s, half of a
    10 ms update, two 1 MB all-reduces at 1 ms + 1 MB / (1 GB/s) (the sweep's line through 0 and 2 MB):
    4 + 200 + 5 + 2 x 2 = 213 ms; a call's time between the sizes the sweep measured, below the smallest and
    beyond the largest."""
    from common import step_time
    table = [(0, 1e-3), (2e6, 3e-3), (4e6, 4e-3)]
    rates = {'flops_per_s': 1e9, 'pass_fixed_s': 2e-3, 'update_s': 0.01, 'collectives': {'all_reduce': table},
             'waits': []}
    work = {'flops': 2e8, 'pieces': 2, 'update': 0.5, 'calls': [('all_reduce', 1e6, 2)]}
    assert step_time.predict_ms(work, rates) == pytest.approx((213.0, 209.0, 4.0, 0.0))
    # a row that maps its buffers afresh (zero3, fsdp) at the rates measured so: 2 x 3 + 400 + 10 ms, and
    # 1 MB of fresh buffers filled at 1 GB/s: 1 ms more
    rates['mapped'] = {'flops_per_s': 5e8, 'pass_fixed_s': 3e-3, 'update_s': 0.02, 'fresh_s_per_byte': 1e-9}
    mapped = dict(work, mapped=True, fresh_bytes=1e6)
    assert step_time.predict_ms(mapped, rates) == pytest.approx((421.0, 417.0, 4.0, 0.0))
    assert step_time.predict_ms(work, rates) == pytest.approx((213.0, 209.0, 4.0, 0.0))
    table = [(1000, 1e-3), (2000, 3e-3), (4000, 4e-3)]
    assert [step_time.call_seconds(table, n) for n in (10, 1500, 3000, 8000)] == \
        pytest.approx([1e-3, 2e-3, 3.5e-3, 6e-3])
    assert step_time.ddp_buckets(60 << 20) == [1 << 20, 25 << 20, 25 << 20, 9 << 20]  # DDP's: 1 MiB first


def test_the_ring_attention_is_priced_at_its_measured_time_in_place_of_its_flops():
    """cp_ring's attention, given by hand: 4 layers of 5 ms each measured, in place of its 1e8 FLOPs at 1e9
    FLOP/s (100 ms): 200 + 20 - 100 ms of compute. Rates measured without the ring (no ring_attention_s) price
    its FLOPs as before."""
    from common import step_time
    rates = {'flops_per_s': 1e9, 'pass_fixed_s': 0.0, 'update_s': 0.0, 'collectives': {}, 'waits': [],
             'ring_attention_s': 5e-3}
    work = {'flops': 2e8, 'pieces': 0, 'update': 0, 'calls': [], 'ring': (4, 1e8)}
    assert step_time.predict_ms(work, rates) == pytest.approx((120.0, 120.0, 0.0, 0.0))
    assert step_time.predict_ms(work, {k: v for k, v in rates.items() if k != 'ring_attention_s'}) == \
        pytest.approx((200.0, 200.0, 0.0, 0.0))
    assert "the ring's attention 5.0 ms a layer (cp_ring; timed alone)" in step_time.rates_line(rates, 'out')
    failed = dict(rates, not_timed={'ring_attention_s': 'RuntimeError: shapes'})  # (the FLOPs price, said)
    del failed['ring_attention_s']
    assert "the ring's attention not timed (RuntimeError: shapes: cp_ring priced without it)" in \
        step_time.rates_line(failed, 'out')
    assert "cp_ring" not in step_time.rates_line(rates, 'out', rows=['train', 'tp'])  # (cp_ring not run)


def test_a_tp_rank_s_passes_are_priced_at_its_pass_timed_alone():
    """tp, rates by hand: its 3 micro-batches' passes at 30 ms each timed alone, in place of their fixed cost
    and FLOPs at the whole model's rate; its update and its calls as before. The row_work of the bench's tp
    rows names the pass it is priced at (tp_moe's experts are priced by their FLOPs)."""
    from common import step_time
    from model import GPTConfig
    rates = {'flops_per_s': 1e9, 'pass_fixed_s': 2e-3, 'update_s': 0.01, 'waits': [],
             'collectives': {'all_reduce': [(0, 1e-3), (1 << 30, 2e-3)]}, 'tp_pass_s': 0.03}
    work = {'flops': 1e8, 'pieces': 3, 'update': 0.5, 'calls': [('all_reduce', 0, 4)],
            'timed_pass': 'tp_pass_s'}
    assert step_time.predict_ms(work, rates) == pytest.approx((99.0, 95.0, 4.0, 0.0))  # 90 + 5; 4 x 1 ms
    untimed = {k: v for k, v in rates.items() if k != 'tp_pass_s'}  # 3 x 2 + 100 + 5 ms: the FLOPs price
    assert step_time.predict_ms(work, untimed) == pytest.approx((115.0, 111.0, 4.0, 0.0))
    assert "a tp rank's pass 30.0 ms a micro-batch (tp; timed alone)" in step_time.rates_line(rates, 'out')
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=32, bias=False)
    works = [step_time.row_work(n, config, 4, 2, 4) for n in ('tp', 'tp_sp', 'ddp')]
    assert [(w.get('timed_pass'), w['pieces']) for w in works] == \
        [('tp_pass_s', 2), ('tp_sp_pass_s', 2), (None, 1)]  # (tp: both micro-batches on each rank; ddp: one)


def test_fsdp_s_pass_and_update_are_priced_at_an_fsdp2_rank_s_timed_alone():
    """fsdp, rates by hand: its 2 passes at 40 ms each timed alone (their fresh buffers in them), in place of
    their fixed cost, FLOPs and fresh buffers; its update: its half's at the mapped rate, plus what FSDP2's
    update adds on the whole model timed alone (16 ms against the mapped 12); its calls as before."""
    from common import step_time
    from model import GPTConfig
    rates = {'flops_per_s': 1e9, 'pass_fixed_s': 2e-3, 'update_s': 0.01, 'waits': [],
             'collectives': {'all_reduce': [(0, 1e-3), (1 << 30, 2e-3)]},
             'mapped': {'update_s': 0.012, 'fresh_s_per_byte': 1e-9},
             'fsdp_pass_s': 0.04, 'fsdp_update_s': 0.016}
    work = {'flops': 1e8, 'pieces': 2, 'update': 0.5, 'calls': [('all_reduce', 0, 3)], 'mapped': True,
            'fresh_bytes': 1e6, 'timed_pass': 'fsdp_pass_s', 'timed_update': 'fsdp_update_s'}
    assert step_time.predict_ms(work, rates) == pytest.approx((93.0, 90.0, 3.0, 0.0))  # 80 + 6 + 4; 3 x 1 ms
    untimed = {k: v for k, v in rates.items() if not k.startswith('fsdp')}  # 2 x 2 + 100 + 1 + 6 ms
    assert step_time.predict_ms(work, untimed) == pytest.approx((114.0, 111.0, 3.0, 0.0))
    line = step_time.rates_line(rates, 'out')
    assert "an FSDP2 rank's pass 40.0 ms a micro-batch (fsdp; timed alone)" in line
    assert "FSDP2's update 16.0 ms a step on the whole model (fsdp; timed alone)" in line
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=32, bias=False)
    works = [step_time.row_work(n, config, 4, 2, 4) for n in ('fsdp', 'zero3')]
    assert [(w.get('timed_pass'), w.get('timed_update')) for w in works] == \
        [('fsdp_pass_s', 'fsdp_update_s'), (None, None)]


def _shard_and_log(model, device_type, dp_size, dtype):
    """train_fsdp.shard_model, logging to $FSDP_LOG what the process that times it does: whether every
    parameter is a DTensor and the world's size, each forward's input shape, each backward through the loss,
    each clip and optimizer step (for the test below: the timing runs in a process of its own)."""
    import torch
    import train_fsdp
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def log(line):
        with open(os.environ['FSDP_LOG'], 'a') as f:
            f.write(line + '\n')
    model = train_fsdp.shard_model(model, device_type, dp_size, dtype)
    log(f"DTensors {all(isinstance(p, DTensor) for p in model.parameters())}, a world of {dp_size}")
    model.register_forward_pre_hook(lambda m, args: log(f"forward {tuple(args[0].shape)}"))
    model.register_forward_hook(lambda m, args, out: [out[1].register_hook(lambda g: log('backward'))] and None)
    clip = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = lambda *args, **kwargs: log('clip') or clip(*args, **kwargs)
    register_optimizer_step_post_hook(lambda *args: log('step'))
    return model


def test_an_fsdp2_rank_s_pass_and_update_are_timed_as_train_fsdp_py_shards_it(tmp_path, monkeypatch):
    """machine_rates.fsdp_seconds runs the shard function it is handed (train_fsdp.shard_model's, logged)
    in a world of one, in one process: the pass a forward and backward of the bench micro-batch each time it
    is timed, the update an optimizer step on the DTensors each time, the two taking turns in 3 rounds."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException
    from common import machine_rates
    from model import GPTConfig
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=32, bias=False)
    monkeypatch.setenv('FSDP_LOG', str(tmp_path / 'fsdp.log'))
    seconds = machine_rates.fsdp_seconds(_shard_and_log, config, 3, 1, str(tmp_path))
    assert sorted(seconds) == ['fsdp_pass_s', 'fsdp_update_s'] and min(seconds.values()) > 0, seconds
    # (a forward and backward first, for gradients to clip; then in each round a warm-up and 10 or 15 timed)
    a_round = ['forward (3, 16)', 'backward'] * 11 + ['clip', 'step'] * 16
    assert (tmp_path / 'fsdp.log').read_text().splitlines() == \
        ['DTensors True, a world of 1', 'forward (3, 16)', 'backward'] + a_round * 3
    # a timing that fails in its process says why: its traceback's last line, not spawn's message's empty first
    # (as torch's spawn raises it, from the process's traceback; not spawned again here, to save the seconds)
    trace = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: no mesh here. More text\n'

    def spawn(*args, **kwargs):
        raise ProcessRaisedException(f"\n\n-- Process 0 terminated with the following error:\n{trace}", 0, 1)
    monkeypatch.setattr(machine_rates.mp, 'spawn', spawn)
    why = 'RuntimeError: ValueError: no mesh here'
    with pytest.raises(RuntimeError, match='^ValueError: no mesh here. More text$'):
        machine_rates.fsdp_seconds(_shard_and_log, config, 3, 1, str(tmp_path))
    rates = {'not_timed': {'ring_attention_s': 'RuntimeError: shapes'}}  # (machine_rates says so, for both)
    machine_rates.time_fsdp(rates, _shard_and_log, config, 3, 1, str(tmp_path))
    assert rates == {'not_timed': {'ring_attention_s': 'RuntimeError: shapes', 'fsdp_pass_s': why,
                                   'fsdp_update_s': why}}

    # a process that dies (killed: no traceback) loses both too, and says how
    def killed(*args, **kwargs):
        raise ProcessExitedException('process 0 terminated with signal SIGKILL', 0, 1, -9, 'SIGKILL')
    monkeypatch.setattr(machine_rates.mp, 'spawn', killed)
    rates = {}
    machine_rates.time_fsdp(rates, _shard_and_log, config, 3, 1, str(tmp_path))
    why = 'ProcessExitedException: process 0 terminated with signal SIGKILL'
    assert rates == {'not_timed': {'fsdp_pass_s': why, 'fsdp_update_s': why}}
    # a part that fails in the process loses its own price only; its why joins the others'
    monkeypatch.setattr(machine_rates, 'fsdp_seconds', lambda *args: {
        'fsdp_pass_s': 0.1, 'not_timed': {'fsdp_update_s': 'KeyError: step'}})
    rates = {'not_timed': {'ring_attention_s': 'RuntimeError: shapes'}}
    machine_rates.time_fsdp(rates, _shard_and_log, config, 3, 1, str(tmp_path))
    assert rates == {'fsdp_pass_s': 0.1, 'not_timed': {'ring_attention_s': 'RuntimeError: shapes',
                                                       'fsdp_update_s': 'KeyError: step'}}


def test_machine_rates_wires_each_part_to_its_own_timing(tmp_path, monkeypatch):
    """machine_rates times the ring, tp's pass without sequence parallelism and tp_sp's with it, and fsdp's
    pass and update, each under its own key (the timings stubbed: each answers what it was asked)."""
    from common import machine_rates
    from model import GPTConfig
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=32, bias=False)
    stubs = {'measure_collectives': lambda *a: ({}, []), 'measure_mapped': lambda *a: {},
             'measure_compute': lambda *a, **k: {'flops_per_s': 1.0},
             'ring_attention_seconds': lambda script, *a: script,
             'tp_pass_seconds': lambda script, c, b, w, t, sp=False: (script, 'sp' if sp else 'no sp'),
             'fsdp_seconds': lambda shard, c, b, t, folder: {'fsdp_pass_s': (shard, 'pass'),
                                                             'fsdp_update_s': (shard, 'update')}}
    for name, stub in stubs.items():
        monkeypatch.setattr(machine_rates, name, stub)
    rates = machine_rates.machine_rates(str(tmp_path), config, 3, 2, 1, cp_script='cp', tp_script='tp',
                                        fsdp_shard='shard')
    assert {k: rates[k] for k in ('ring_attention_s', 'tp_pass_s', 'tp_sp_pass_s', 'fsdp_pass_s',
                                  'fsdp_update_s')} == \
        {'ring_attention_s': 'cp', 'tp_pass_s': ('tp', 'no sp'), 'tp_sp_pass_s': ('tp', 'sp'),
         'fsdp_pass_s': ('shard', 'pass'), 'fsdp_update_s': ('shard', 'update')}
    assert 'not_timed' not in rates, rates['not_timed']  # (every part timed: none said not to be)


def test_a_train_row_priced_far_off_its_step_says_the_machine_s_speed_moved():
    """step_time.speed_moved: the train row is compute alone, so a prediction more than 20% off its step says
    the rates and the rows ran at different speeds of the machine (one line, its miss in it); none within."""
    from common import step_time
    assert step_time.speed_moved({'train': {'predicted_ms': 132.0, 'ms': 100.0}}) == [
        "  (train, all compute, is predicted +32% off its own step: this machine's speed likely moved between its "
        "rows and its rates, measured after them or kept in machine.json; `--remeasure` measures them again)"]
    assert '-25%' in step_time.speed_moved({'train': {'predicted_ms': 75.0, 'ms': 100.0}})[0]
    assert step_time.speed_moved({'train': {'predicted_ms': 119.0, 'ms': 100.0}}) == []
    assert step_time.speed_moved({'ddp': {'predicted_ms': 200.0, 'ms': 100.0}}) == []  # (no train row)


def test_a_part_that_fails_to_time_loses_its_own_price_only():
    """machine_rates.time_alone: a timing that raises leaves its key out of the rates (its row is priced
    without it), says why in one line and is not timed again; the others are timed in rounds, taking turns, and
    each keeps its median (a slow spell on one round of a part does not move it)."""
    from common import machine_rates
    calls = []

    def broken():
        calls.append('tp')
        raise RuntimeError('shapes do not match. More text\nand a second line')
    ring, fsdp = iter([0.25, 0.9, 0.26]), iter([0.1, 0.2, 0.3])
    rates = {'flops_per_s': 1.0}
    machine_rates.time_alone(rates, {'tp_pass_s': broken, 'ring_attention_s': lambda: calls.append('ring') or
                                     next(ring), 'fsdp_pass_s': lambda: calls.append('fsdp') or next(fsdp)})
    assert rates == {'flops_per_s': 1.0, 'ring_attention_s': 0.26, 'fsdp_pass_s': 0.2,
                     'not_timed': {'tp_pass_s': 'RuntimeError: shapes do not match'}}
    assert calls == ['tp', 'ring', 'fsdp', 'ring', 'fsdp', 'ring', 'fsdp']


def test_a_tp_rank_s_pass_is_timed_on_tensor_parallel_py_s_own_slices():
    """machine_rates.tp_pass_seconds shards the model as tensor_parallel.py does, rank 0's slices of 2 (half
    of each layer's heads and hidden units, half the vocabulary), and runs its tp_forward and a backward each
    time it is timed, with sequence parallelism where asked: its gathers and scatters give rank 0's shapes."""
    import tensor_parallel
    from types import SimpleNamespace
    from common import machine_rates
    from model import GPTConfig
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=32, bias=False)
    seen = []

    def tp_forward(model, idx, targets, tp):
        attn = model.transformer.h[0].attn
        seen.append((tuple(idx.shape), attn.n_head, tuple(attn.c_attn.weight.shape),
                     tuple(model.transformer.wte.weight.shape), tp.sequence_parallel))
        return tensor_parallel.tp_forward(model, idx, targets, tp)
    script = SimpleNamespace(TensorParallel=tensor_parallel.TensorParallel,
                             shard_gpt=tensor_parallel.shard_gpt, tp_forward=tp_forward)
    for sp in (False, True):
        seen.clear()
        assert machine_rates.tp_pass_seconds(script, config, 3, 2, 1, sp) > 0
        assert seen == [((3, 16), 1, (24, 16), (16, 16), sp)] * 11  # a warm-up, 10 timed


def test_the_ring_attention_is_timed_on_context_parallel_py_s_own_blocks():
    """machine_rates.ring_attention_seconds runs context_parallel.py's RingAttention itself (its exchanges
    copies): rank 0's queries, keys and values (grouped-query: 1 kv head for 2) and positions, forward and
    backward, each time it is timed."""
    import context_parallel
    from types import SimpleNamespace
    from common import machine_rates
    from model import GPTConfig
    config = GPTConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=16, block_size=16, vocab_size=32, bias=False)
    calls, ring = [], context_parallel.RingAttention

    class Counted(ring):
        @staticmethod
        def forward(ctx, q, k, v, cp):
            calls.append(('F', tuple(q.shape), tuple(k.shape), cp.positions.tolist()))
            return ring.forward(ctx, q, k, v, cp)

        @staticmethod
        def backward(ctx, dout):
            calls.append('B')
            return ring.backward(ctx, dout)
    script = SimpleNamespace(zigzag_positions=context_parallel.zigzag_positions, RingAttention=Counted)
    seconds = machine_rates.ring_attention_seconds(script, config, 3, 2, 1)
    rank_0 = [0, 1, 2, 3, 12, 13, 14, 15]  # (the zig-zag: chunks 0 and 3 of 4)
    # a warm-up, then 10 timed
    assert seconds > 0 and calls == [('F', (3, 2, 8, 8), (3, 1, 8, 8), rank_0), 'B'] * 11


def test_each_call_inside_the_step_waits_for_the_slower_rank_as_the_sweep_measured_after_that_compute():
    """Rates given by hand: a call waits 2 ms more after 10 ms of compute than after 1 ms (the sweep's own
    gap), 4 ms after 30 ms. A step of 40 ms of compute and 4 calls inside it has 10 ms before each: 4 x 2 ms
    of waiting; a burst (posted back to back) waits for nothing; between the gaps linear, beyond the last
    held, below the first none."""
    from common import step_time
    waits = [(1e-3, 0.0), (1e-2, 2e-3), (3e-2, 4e-3)]
    rates = {'flops_per_s': 1e9, 'pass_fixed_s': 0.0, 'update_s': 0.0, 'waits': waits,
             'collectives': {'all_reduce': [(0, 1e-3), (1e6, 1e-3)], 'all_gather burst': [(0, 1e-3), (1e6, 1e-3)]}}
    work = {'flops': 4e7, 'pieces': 1, 'update': 0, 'calls': [('all_reduce', 100, 4)]}
    assert step_time.predict_ms(work, rates) == pytest.approx((40 + 4 + 8, 40, 4 + 8, 8))
    burst = dict(work, calls=[('all_reduce', 100, 4), ('all_gather burst', 100, 6)])
    assert step_time.predict_ms(burst, rates) == pytest.approx((40 + 10 + 8, 40, 10 + 8, 8))
    assert [step_time.wait_seconds(waits, g) for g in (5e-4, 5.5e-3, 2e-2, 1.0)] == \
        pytest.approx([0.0, 1e-3, 3e-3, 4e-3])
    assert step_time.predict_ms(work, dict(rates, waits=[])) == pytest.approx((44, 40, 4, 0))
    # a pipeline's calls wait on its schedule (its bubble, priced as slots), not on a drifting rank: no waits
    assert step_time.predict_ms(dict(work, on_schedule=True), rates) == pytest.approx((44, 40, 4, 0))


def test_a_grid_is_priced_at_the_rates_of_its_processes_at_once():
    """A grid row (8 processes on this machine's cores) at the rates measured with 8 processes at once (kept in
    machine.json's 'crowded'), its model's compute and the collectives of groups of 2 and 4, and no waits.
    Given by hand: nothing is measured here."""
    from types import SimpleNamespace
    from common import step_time
    from model import GPTConfig
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, bias=False)
    slow = {'pass_fixed_s': 0.05, 'flops_per_s': 1e9, 'update_s': 0.1}
    table = {kind: [(16 << 10, 1e-3), (8 << 20, 2e-3)] for kind in ('all_reduce', 'all_reduce burst x4')}
    rates = {'crowded': {'dense': slow, 'collectives': table, 'key': [8, ['dense'], None]}}
    args = SimpleNamespace(out='unused', world_size=2, batch_size=4)
    at = step_time.grid_rates(args, rates, config, None, ['grid_dp_cp_tp'])['grid_dp_cp_tp']
    assert at == dict(slow, collectives=table, waits=[])  # (the waits are not measured with 8 processes)
    assert step_time.grid_note({'grid_dp_cp_tp': at}, 8)[0].startswith(
        "  (the grids at rates measured with 8 processes at once, as they run: a pass's fixed cost 50.0 ms")


@pytest.mark.parametrize('row, schedule, p, v', [('pp_1f1b', '1f1b', 2, 1), ('pp_1f1b', '1f1b', 4, 1),
                                                  ('pp_zb1', 'zb1', 2, 1), ('pp_zb1', 'zb1', 4, 1),
                                                  ('pp_interleaved', 'interleaved', 2, 2),
                                                  ('pp_interleaved', 'interleaved', 4, 2),
                                                  ('pp_gpipe', 'gpipe', 2, 1), ('pp_gpipe', 'gpipe', 4, 1)])
def test_a_pipeline_is_priced_with_the_sends_its_schedule_makes(row, schedule, p, v, monkeypatch):
    """pipeline_work's sends a schedule against the sends pipeline.py's own schedule functions post, counted
    on every stage with the compute and the network stubbed out: 1F1B, ZB-H1 and interleaved at the busiest
    stage's (its sends lie on the critical path); GPipe, every forward before any backward, at both
    directions' with 2 stages (stage 0's on and stage 1's back, both on its path), the busiest's with more."""
    import pipeline
    from types import SimpleNamespace
    from common import step_time
    from model import GPTConfig
    m = 4
    config = GPTConfig(n_layer=8, n_head=2, n_embd=16, block_size=16, vocab_size=32, bias=False)

    def communicate(stage, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        stage.sent += (send_next is not None) + (send_prev is not None)
        return ('x' if recv_prev else None), ('dy' if recv_next else None)
    # what a step returns to send on: nothing from the loss's chunk forward, nor from the embedding's back
    forward = lambda stage, i, x, idx, targets, scale, chunk=0, split=False: \
        None if stage.is_last and chunk == v - 1 else 'y'
    backward = lambda stage, i, dy, chunk=0: None if stage.is_first and chunk == 0 else 'dx'
    monkeypatch.setattr(pipeline, 'communicate', communicate)
    monkeypatch.setattr(pipeline, 'forward_step', forward)
    monkeypatch.setattr(pipeline, 'backward_step', backward)
    monkeypatch.setattr(pipeline, 'backward_input_step', lambda stage, i, dy: backward(stage, i, dy))
    monkeypatch.setattr(pipeline, 'backward_weight_step', lambda stage, i: None)
    sent = []
    for r in range(p):
        stage = SimpleNamespace(index=r, pp=p, is_first=r == 0, is_last=r == p - 1, chunks=[None] * v, sent=0)
        pipeline.SCHEDULES[schedule](stage, m, None, None, 1.0)
        sent.append(stage.sent)
    priced = step_time.row_work(row, config, 4, p, m)['calls'][0]
    assert priced[0] == 'send' and priced[2] % p == 0  # (p schedules a step: gradient_accumulation_steps)
    assert priced[2] // p == (sum(sent) if schedule == 'gpipe' and p == 2 else max(sent)), sent


def test_each_row_sends_what_its_script_sends():
    """row_work's collectives for a 2-layer model on 2 ranks, counted by hand from the scripts: ZeRO-3 gathers
    each block and the root twice and reduces each once; tp all-reduces 4 times a layer and twice more
    (embedding, head) per micro-batch, plus the loss's 3 small ones."""
    from common import step_time
    from model import GPTConfig
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, bias=False)
    block = 12 * 32 * 32 + 2 * 32  # c_attn, c_proj, c_fc, c_proj (no biases), two norms' weights
    numel = 2 * block + 64 * 32 + 16 * 32 + 32  # the blocks, wte (tied to the head), wpe, ln_f
    zero3 = step_time.row_work('zero3', config, 4, 2, 2)
    assert zero3['calls'][:2] == [('all_gather', 4 * block // 2, 2), ('all_reduce', 4 * block, 1)]
    assert len(zero3['calls']) == 2 * 3 + 1 and zero3['update'] == 0.5
    # fresh buffers filled a step: zero.py's flat gathered twice and its zeroed gradient bucket; FSDP2's
    # all-gather output, gloo's temporary and the parameters copied out, twice, its reduce-scatter input and
    # gloo's clone of it (torch's _fsdp_collectives.py; gloo's all-gather: distributed.all_gather_direct)
    fsdp = step_time.row_work('fsdp', config, 4, 2, 2)
    assert (zero3['mapped'], zero3['fresh_bytes'], fsdp['fresh_bytes']) == (True, 3 * 4 * numel, 8 * 4 * numel)
    assert fsdp['calls'] == zero3['calls'] and 'mapped' not in step_time.row_work('zero2', config, 4, 2, 2)
    tp = step_time.row_work('tp', config, 4, 2, 2)
    assert tp['calls'][0] == ('all_reduce', 4 * 16 * 32 * 4, (4 * 2 + 2) * 2)
    pp = step_time.row_work('pp_1f1b', config, 4, 2, 2)  # 2 schedules of 2 + 2 - 1 slots, each half a pass
    # the busiest stage's sends, 2 a schedule: with 2 stages, stage 0 sends each micro-batch's output on (the
    # first block's input needs no gradient), stage 1 each input's gradient back (its output is the loss)
    assert pp['pieces'] == 3 and pp['calls'][0] == ('send', 4 * 16 * 32 * 4 // 2, 2 * 2) and pp['on_schedule']
    assert pp['calls'][-1] == ('all_reduce', 4, 2)  # the clip's norm and the loss over the stages (dp = 1)
    # 4 stages: a middle one sends both ways, 2 x 4 a schedule, in 4 schedules. Interleaved on 2 stages, 2
    # chunks each: each chunk sends on and back, less stage 0's first chunk's gradient (stage 1's last
    # chunk's output): 3 a micro-batch. GPipe on 2 stages: all forwards first, both ways on its path
    assert step_time.row_work('pp_1f1b', config, 4, 4, 4)['calls'][0][2] == 2 * 4 * 4
    assert step_time.row_work('pp_interleaved', config, 4, 2, 2)['calls'][0][2] == (2 * 2 - 1) * 2 * 2
    assert step_time.row_work('pp_gpipe', config, 4, 2, 2)['calls'][0][2] == 2 * 2 * 2
    zero2 = step_time.row_work('zero2', config, 4, 2, 2)  # 100,000-element buckets: this model is one
    # (the chunks gathered after the step, every bucket's posted back to back: zero.publish_all, a burst)
    assert zero2['calls'][:2] == [('all_reduce', 4 * numel, 1), ('all_gather burst', 4 * numel // 2, 1)]
    tp_sp = step_time.row_work('tp_sp', config, 4, 2, 2)  # each all-reduce also an all-gather of half the tokens
    assert tp_sp['calls'][:3:2] == [tp['calls'][0], ('all_gather', 4 * 16 * 32 * 4 // 2, (4 * 2 + 2) * 2)]
    ulysses = step_time.row_work('cp_ulysses', config, 4, 2, 2)  # q, k, v, out; forward and backward; a layer
    assert ulysses['calls'][0] == ('all_to_all', 4 * 16 * 32 * 4 // 2, 8 * 2 * 2) and ulysses['update'] == 1
    ring = step_time.row_work('cp_ring', config, 4, 2, 2)  # k and v sent on (2 calls), and back with their
    # gradients (2 steps, 2 calls each): a layer, a micro-batch (4 sequences x 8 tokens x 2 heads x 16, fp32)
    assert ring['calls'][0] == ('send', 4 * 8 * 32 * 4, (2 + 2 + 4) * 2 * 2)
    # and its attention, priced at the ring's own measured time: a layer of each of its 2 micro-batches, whose
    # attention FLOPs are PaLM's 12·L·d·s a token (appendix B), for 4 sequences x 16 tokens a rank
    assert ring['ring'] == (2 * 2, 12 * 2 * 32 * 16 * 4 * 16)
    assert 'ring' not in ulysses
    # on 4 ranks: a layer of each of 4 micro-batches
    deeper = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=64, bias=False)
    assert step_time.row_work('cp_ring', deeper, 4, 4, 2)['ring'][0] == 3 * 4
    zb1 = step_time.row_work('pp_zb1', config, 4, 2, 2)  # ZB-H1's cool-down: W fills two thirds of the bubble
    assert zb1['pieces'] == pytest.approx(2 + 1 / 3) and zb1['calls'][0] == pp['calls'][0]
    moe = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, bias=False, n_expert=4,
                    n_expert_active=2)  # every layer an MoE layer: per layer the sizes, then 4 all-to-alls of
    ep = step_time.row_work('ep', moe, 4, 2, 2)  # the 4 x 16 tokens' 2 slots each (uniform routing)
    assert ep['calls'][:2] == [('all_to_all', 8 * 4, 2), ('all_to_all', 4 * 16 * 2 * 32 * 4, 4 * 2)]  # (int64)
    tp_moe = step_time.row_work('tp_moe', moe, 4, 2, 2)  # tp's, and the router weights' gradient a layer
    assert tp_moe['calls'][:2] == tp['calls'][:2] and ('all_reduce', 4 * 16 * 2 * 4, 2 * 2) in tp_moe['calls']
    # the grids, 8 ranks (dp 2; each dp rank one micro-step of 2 microbatches of 2 sequences): a rank's tp
    # all-reduces (4 a layer of its stage, and the embedding's or the head's), pp's activation and gradient,
    # the tied embedding's half (vocabulary-parallel), the ZeRO-1 bucket over dp (reduced, then gathered: a
    # burst), 1/8 of the FLOPs and the update, a microbatch's pass through half the model each
    pp_tp = step_time.row_work('grid_dp_pp_tp', config, 4, 2, 2)
    act = 2 * 16 * 32 * 4
    assert pp_tp['calls'][0] == ('all_reduce', act, 2 * (4 * 1 + 1)) and ('send', act, 2 * 2) in pp_tp['calls']
    assert ('all_reduce', 64 * 32 * 4 // 2, 1) in pp_tp['calls']
    first_stage = (64 * 32 + 16 * 32 + block) // 2  # (wte, wpe and block 0, a tp slice of each: one bucket)
    assert pp_tp['calls'][-2:] == [('all_reduce burst', 4 * first_stage, 1),
                                   ('all_gather burst', 4 * first_stage // 2, 1)]
    assert (pp_tp['pieces'], pp_tp['update'], pp_tp['flops']) == (1, 1 / 8, tp['flops'] / 4)
    # cp 2 x tp 2: half the tokens; the ring's k and v blocks (1 head of 16 on 8 tokens) 8 sends a layer
    # and microbatch; dp x cp is a group of 4 (' x4')
    cp_tp = step_time.row_work('grid_dp_cp_tp', config, 4, 2, 2)
    assert cp_tp['calls'][0] == ('all_reduce', act // 2, 2 * (4 * 2 + 2))
    assert ('send', 2 * 8 * 16 * 4, 8 * 2 * 2) in cp_tp['calls'] and cp_tp['pieces'] == 2
    assert cp_tp['calls'][-2:] == [('all_reduce burst x4', 4 * numel // 2, 1),
                                   ('all_gather burst x4', numel // 2, 1)]
    # pp 2 x tp 2 x ep 2 (one microbatch of 4 sequences): the tp ranks share out a MoE layer's token-slots
    ep_grid = step_time.row_work('grid_pp_tp_ep', moe, 4, 2, 2)
    assert ('all_to_all', 4 * 16 * 2 * 32 * 4 // 2, 4 * 1) in ep_grid['calls']
    assert step_time.row_work('grid_dp_cp_tp', config, 4, 4, 2) is None  # (dp x cp 8: no such sweep)


def test_the_zero_rows_are_priced_with_the_buckets_zero_py_makes():
    """step_time.zero_buckets against zero.py's own bucket_groups, stages 0-2, on the bench's 512-wide model
    (on meta): a bucket closes only at a parameter's end, so stage 2's 100,000-element buckets each take a
    whole weight (a 1M-element one among them), not equal slices of the gradients."""
    import torch
    import zero
    from common import step_time
    from common.distributed import default_bucket_size
    from model import GPT, GPTConfig
    with torch.device('meta'):
        model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=512, block_size=128, vocab_size=65, bias=False))
    for stage in (0, 1, 2):
        theirs = [sum(p.numel() for _, p in group) for group in zero.bucket_groups(model, stage, 0)]
        ours = step_time.zero_buckets([p.numel() for p in model.parameters()], default_bucket_size(stage))
        assert ours == theirs, stage
    assert max(theirs) >= 512 * 4 * 512 and len(theirs) < sum(theirs) / 100_000 / 5  # (an MLP weight whole)


def test_a_moe_rows_busiest_rank_computes_its_experts_share_of_the_slots():
    """ep and tp_moe hold a run of n_expert/w experts a rank: priced at the rank whose run gets the most of a
    layer's token-slots (train_moe's counts), not 1/w. Counted by hand: 2 ranks, experts {0, 1} and {2, 3}; one
    layer's slots all on rank 0's experts, the other's even: a share of (1 + 1/2) / 2 = 3/4. Each expert is the
    model's MLP, 32 -> 128 -> 32 without biases, in 2 layers; 4 x 2 x 16 tokens, k = 2: 6 x 2 x 8192 weights x
    2 slots x 128 tokens x (3/4 - 1/2) FLOPs more a step on the busiest rank."""
    from common import step_time
    from model import GPTConfig
    assert step_time.busiest_share([[[3, 1, 0, 0], [1, 1, 1, 1]]], 2) == 0.75
    assert step_time.busiest_share([], 2) is None and step_time.busiest_share([[[0, 0, 2, 2]]], 2) == 1.0
    moe = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, bias=False, n_expert=4,
                    n_expert_active=2)
    for name in ('ep', 'tp_moe'):
        even, busy = (step_time.row_work(name, moe, 4, 2, 2, share) for share in (None, 0.75))
        assert busy['flops'] - even['flops'] == pytest.approx(6 * 2 * 8192 * 2 * 128 * 0.25)
        assert busy['calls'] == even['calls']
    assert step_time.row_work('ep', moe, 4, 2, 2, 0.5)['flops'] == step_time.row_work('ep', moe, 4, 2, 2)['flops']
    # MoE in every second block (here 1 of 2) and a shared expert beside: half the routed experts' extra
    every_2nd = GPTConfig(**{**moe.__dict__, 'moe_every': 2, 'n_shared_expert': 1})
    even, busy = (step_time.row_work('ep', every_2nd, 4, 2, 2, share) for share in (None, 0.75))
    assert busy['flops'] - even['flops'] == pytest.approx(6 * 1 * 8192 * 2 * 128 * 0.25)
    assert step_time.busiest_share([[[1, 2, 3]]], 2) is None  # (3 experts do not split over 2 ranks)


def _results():
    row = {'status': 'ok', 'losses': {'0': 4.0, '1': 3.5}, 'param_bytes': 4e6, 'param_bytes_formula': 4e6,
           'grad_bytes': 2e6, 'grad_bytes_formula': 2e6, 'collective_bytes': 8e6, 'wire_bytes_formula': 4e6,
           'wire_bytes': 6e6}
    return {'train': {'status': 'ok', 'losses': {'0': 4.0, '1': 3.5}}, 'zero2': row}


def test_plot_draws_three_pictures(tmp_path):
    import pytest
    pytest.importorskip('matplotlib', reason='matplotlib is an optional install')
    paths = bench.plot(_results(), str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ['bench_loss.png', 'bench_memory.png', 'bench_comm.png']
    for p in paths:
        assert open(p, 'rb').read(8) == b'\x89PNG\r\n\x1a\n'


def test_plot_without_matplotlib_names_the_install(tmp_path, monkeypatch):
    import builtins
    import pytest
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith('matplotlib'):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, '__import__', no_matplotlib)
    with pytest.raises(SystemExit, match='pip install matplotlib'):
        bench.plot(_results(), str(tmp_path))


# Published parameter counts (Hugging Face's meta-llama/Llama-2-7b-hf and gpt2-xl, as their model cards and
# num_parameters() give them): each with its own vocabulary, which the config file names in a comment.
PUBLISHED = {'config/llama2_7b.py': (32000, 6_738_415_616), 'config/gpt2_xl_1.5b.py': (50257, 1_557_611_200)}


def test_the_estimate_reads_the_configs_vocabulary():
    for config, (vocab, params) in PUBLISHED.items():
        gptconf = planner.gpt_config_from(os.path.join(REPO, config), [], None)
        assert (gptconf.vocab_size, planner.param_counts(gptconf)['total']) == (vocab, params), config
    assert planner.gpt_config_from(os.path.join(REPO, 'config/llama2_7b.py'), [], 96).vocab_size == 96  # --vocab_size


def test_logits_are_in_the_estimate_as_the_head_holds_them():
    """formulas.logits_bytes_formula against the tensors of the logits' shape that a real forward of model.py's
    GPT leaves held: the logits it returns and what autograd saved for backward (saved-tensor hooks, one count
    per storage), in fp32 and under bf16 autocast; the planner adds them to every total, and "fits" sees them."""
    import torch
    from model import GPT, GPTConfig
    b, s, V = 3, 16, 80  # (the tensors of V x 32 are the embedding's and the head's weights)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=s, vocab_size=V)
    model, x = GPT(config), torch.randint(0, V, (b, s))
    for mixed in (False, True):
        held = {}

        def pack(t):
            if t.dim() and t.size(-1) == V and t.numel() == b * s * V:  # the logits' shape
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=mixed), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits, _ = model(x, x)
        held[logits.untyped_storage().data_ptr()] = logits.untyped_storage().nbytes()
        assert sum(held.values()) == formulas.logits_bytes_formula(b * s, V, 2 if mixed else 4) > 0, (mixed, held)

        ddp = planner.estimate(config, 2, 1, b, s, 1, 1, 1, 1, mixed)[0]
        assert ddp['strategy'] == 'DDP' and ddp['logits_bytes'] == sum(held.values())
        assert ddp['total_bytes'] == ddp['model_state_bytes'] + ddp['activation_bytes'] + ddp['logits_bytes']
        limit = (ddp['total_bytes'] - ddp['logits_bytes'] / 2) / 1e9  # room for everything but half the logits
        assert planner.estimate(config, 2, limit, b, s, 1, 1, 1, 1, mixed)[0]['fits'] != 'yes'


def test_pipeline_traffic_is_priced_as_pipeline_py_sends_it(tmp_path):
    """Under bf16, pipeline.py sends the fp32 residual stream and its fp32 gradient, and with tied embeddings
    its first and last stage all-reduce the tied weight's fp32 gradient: the planner's PP row per step is what
    the Comm counted on each stage of a real run (one step of 2 micro-batches; the loss scalars left out)."""
    out = tmp_path / 'pp'
    check(run_script('pipeline.py', TINY + [
        '--dtype=bfloat16', '--pp=2', '--schedule=1f1b', '--n_microbatches=2', '--gradient_accumulation_steps=1',
        '--max_iters=1', '--eval_interval=100', '--always_save_checkpoint=False', f'--out_dir={out}'], nproc=2))
    stages = [r for r in read_log(out) if 'stage' in r and 'rank' in r]
    assert len(stages) == 2
    gptconf = planner.gpt_config_from(None, TINY, load_dataset('stdlib_char')[1])
    # 2 GPUs, 1 GB, micro-batch 2 of 16 tokens, tp 1, pp 2, cp 1, 2 micro-batches, ZeRO-1, bf16
    plan = {r['strategy']: r for r in planner.estimate(gptconf, 2, 1, 2, 16, 1, 2, 1, 2, True)}
    for r in stages:
        kinds = r['collective_bytes_by_kind']
        assert plan['PP=2 1F1B']['comm_bytes_per_step'] == kinds['pp send'] + kinds['embed all_reduce'], r


def test_the_two_tables_say_what_their_communication_counts(tmp_path):
    """The ZeRO paper's table counts one micro-batch per step in 16-bit gradients, the strategies' table a step
    of m micro-batches as the scripts send it: the two agree where they should (ZeRO-1) and differ by the
    factors the note names; and the output says what the estimate leaves out."""
    proc = check(run_script('bench.py', ['--estimate', 'config/llama2_7b.py', '--gpus=8', '--n_microbatches=8',
                                         f'--out={tmp_path}']))
    out = proc.stdout
    assert 'Ψ = 6.74B' in out and 'V 32000)' in out, out[:2000]
    assert "comm per step (the paper's: 1 micro-batch)" in out and 'comm per step (8 micro-batches)' in out
    assert 'not counted:' in out and 'logits' in out
    gptconf = planner.gpt_config_from(os.path.join(REPO, 'config/llama2_7b.py'), [], None)
    numel = planner.param_counts(gptconf)['total']
    rows = {r['strategy']: r for r in planner.estimate(gptconf, 8, 80, 1, 4096, 8, 4, 4, 8, True)}
    paper = {stage: formulas.comm_bytes_formula(numel, 8, stage, 2) for stage in range(4)}
    assert rows['ZeRO-1']['comm_bytes_per_step'] == paper[1]
    assert rows['DDP']['comm_bytes_per_step'] == 2 * paper[0]
    assert rows['ZeRO-2']['comm_bytes_per_step'] == pytest.approx((8 + 1) / 2 * paper[2])
    assert rows['ZeRO-3']['comm_bytes_per_step'] == pytest.approx(8 * paper[3])


def test_the_planner_prints_a_command_that_runs_its_recommendation(tmp_path):
    """bench.py --estimate CONFIG --gpus=N ends with the torchrun command of the cheapest strategy. Every
    strategy's command names a script that takes all of its flags (each script's own configure rejects an
    unknown key or a wrong type), and the recommended one, run here for 2 iterations, trains."""
    import importlib
    import shlex
    from types import SimpleNamespace
    args = SimpleNamespace(micro_batch=1, dtype='bfloat16', seq_len=None, estimate='config/tinyllama_1b.py')
    gptconf = planner.gpt_config_from(os.path.join(REPO, args.estimate), [], None)
    rows = [r for r in planner.estimate(gptconf, 8, 80, 1, 2048, 4, 4, 4, 8, True) if 'error' not in r]
    assert len(rows) >= 10
    for row in rows:
        words = shlex.split(planner.launch_command(row, True, args, [], 2048, 8, 'ds.json'))
        assert words[:3] == ['torchrun', '--standalone', f"--nproc_per_node={row['gpus_used']}"], words
        script = importlib.import_module(words[3][:-3])
        cfg = script.configure(script.config, [os.path.join(REPO, words[4])] + [
            w.replace('ds.json', os.path.join(REPO, 'config/ds_zero1.json')) for w in words[5:]])
        assert (cfg.tp if hasattr(cfg, 'tp') else 1) == row['tp'] and cfg.activation_checkpointing, words
    out = str(tmp_path)
    proc = check(run_script('bench.py', ['--estimate', 'config/train_stdlib_char.py', '--gpus=2',
                                         f'--out={out}', '--vocab_size=96', '--dtype=float32']))
    command = shlex.split(proc.stdout.split('run it with:\n')[1].splitlines()[0])
    assert command[:3] == ['torchrun', '--standalone', '--nproc_per_node=2'], command
    check(run_script(command[3], command[4:] + TINY[:4] + ['--max_iters=2', '--eval_interval=2',
                                                           f'--out_dir={out}/run'], nproc=2))
    assert [r['iter'] for r in read_log(f'{out}/run') if 'loss' in r] == [0, 1]


def test_repeated_rows_report_each_median_and_the_ratio_run_by_run():
    """--repeat: a busy moment (the third pair) slows both rows; the ratio run by run stays near the truth. The
    table's tokens/s is the runs' median too, not the first run's (as it was), and an MFU not known stays so."""
    times = {'zero0': [99.0, 110.0, 200.0], 'ddp': [100.0, 100.0, 180.0]}  # (zero0's first run: not its median)
    runs = {name: [{'ms': t, 'tokens_per_sec': 2048e3 / t, 'mfu': None} for t in ms] for name, ms in times.items()}
    results = {name: rs[0] for name, rs in runs.items()}  # (as run_bench keeps them: a row's first run)
    text = bench.repeated_times(runs, results)
    # each row's median of its runs; no spread of steps (one run's steps are not the median's)
    assert results == {'zero0': {'ms': 110.0, 'tokens_per_sec': 2048e3 / 110, 'mfu': None, 'ms_range': None},
                       'ddp': {'ms': 100.0, 'tokens_per_sec': 2048e3 / 100, 'mfu': None, 'ms_range': None}}
    assert 'zero0: 110.0 ms/step, the median of 3 runs (99.0 to 200.0)' in text
    assert 'zero0 / ddp, run by run: median 1.100 (0.990 to 1.111)' in text, text


def figures(**changed):
    """The stated GPUs bench.py --estimate prices by default (cluster_time.add_device_arguments), some changed."""
    import argparse
    from common import cluster_time
    p = argparse.ArgumentParser()
    cluster_time.add_device_arguments(p)
    return p.parse_args([f'--{k}={v}' for k, v in dict(dict(gpu_tflops=989), **changed).items()])


def test_the_planned_step_on_gpus_follows_the_figures_it_is_given():
    """--estimate's step time (modelled from stated figures): the compute splits over the ranks of a replica,
    recomputation adds a forward (8N against 6N), a pipeline idles (p-1)/(m+p-1) of its step; a group's traffic
    crosses the network only where its ranks leave a node, so a faster network speeds only those; what a
    strategy overlaps is hidden; and the ranking holds the rows that fit on every GPU, the fastest first, none
    above the efficiency it was given."""
    from common import cluster_time
    gptconf = planner.gpt_config_from(os.path.join(REPO, 'config/llama2_7b.py'), [], None)
    rows = {r['strategy']: r for r in planner.estimate(gptconf, 16, 80, 1, 4096, 8, 4, 4, 8, True)}
    price = lambda name, ckpt=False, **f: cluster_time.cluster_step_ms(rows[name], gptconf, 4096, 1,
                                                                       figures(**f), ckpt)
    zero1, tp, pp = price('ZeRO-1'), price('dp=2 x TP=8 + SP, ZeRO-1'), price('dp=4 x PP=4 1F1B, ZeRO-1')
    assert tp['compute_ms'] == pytest.approx(zero1['compute_ms'] / 8)
    assert price('ZeRO-1', ckpt=True)['compute_ms'] == pytest.approx(zero1['compute_ms'] * 8 / 6)
    assert price('ZeRO-1', gpu_tflops=1978)['compute_ms'] == pytest.approx(zero1['compute_ms'] / 2)
    assert pp['bubble_ms'] / (pp['compute_ms'] + pp['bubble_ms']) == pytest.approx(3 / (8 + 3))
    # dp x tp: tp inside a node of 8 (NVLink), dp across the two nodes: only dp's time depends on the network
    fast_net = price('dp=2 x TP=8 + SP, ZeRO-1', ib_gbps=500)
    assert fast_net['comm_ms'] < tp['comm_ms'] and price('TP=8 + SP', ib_gbps=500) == price('TP=8 + SP')
    assert price('ZeRO-1', ib_gbps=500)['comm_ms'] < zero1['comm_ms']
    assert price('TP=8 + SP')['exposed_ms'] == price('TP=8 + SP')['comm_ms'] > 0  # (tp's calls: not hidden)
    assert zero1['exposed_ms'] < zero1['comm_ms']  # (the last backward hides part of the gradients')
    # across nodes a group's ranks in a node send side by side, each through its own NIC
    assert cluster_time.group_gbps(rows['ZeRO-1'], 'dp', figures()) == 8 * 50  # 8 a node, at most NVLink's
    assert cluster_time.group_gbps(rows['dp=2 x TP=8 + SP, ZeRO-1'], 'dp', figures()) == 50  # 1 a node
    assert cluster_time.group_gbps(rows['dp=2 x TP=8 + SP, ZeRO-1'], 'tp', figures()) == 450
    slow_host = price('ZeRO-3 + offload', host_adam_gparams=0.1)  # offload: the host's AdamW is compute
    assert slow_host['compute_ms'] > price('ZeRO-3 + offload')['compute_ms'] > price('ZeRO-3')['compute_ms']
    ranked = cluster_time.fastest_first(list(rows.values()), 16, gptconf, 4096, 1, figures())
    fitting = {r['strategy'] + ' + ckpt' * (r['fits'] == 'with ckpt') for r in rows.values()
               if r.get('fits') in ('yes', 'with ckpt') and r['gpus_used'] == 16}
    assert {s['strategy'] for s in ranked} == fitting and len(fitting) >= 4
    assert [s['tokens_per_s'] for s in ranked] == sorted((s['tokens_per_s'] for s in ranked), reverse=True)
    assert all(0 < s['mfu'] <= 0.5 + 1e-9 for s in ranked)


def test_the_grids_expert_row_reduces_each_part_over_the_ranks_that_hold_it():
    """parallel_4d.py with tp and ep (ZeRO-1 in fp32): a rank's dense weights reduce-scattered and gathered
    over dp x cp ranks, its experts (n_expert / (ep x tp) of each MoE layer's) over dp x cp / ep: the planner's
    gradient traffic is the two rings (it once subtracted a whole model's experts from a tp rank's weights,
    and came out negative)."""
    gptconf = planner.gpt_config_from(os.path.join(REPO, 'config/tinyllama_1b.py'),
                                      ['--n_expert=8', '--n_expert_active=2'], None)
    row = next(r for r in planner.estimate(gptconf, 16, 80, 1, 2048, 4, 2, 4, 4, False, 2)
               if r['tp'] == 4 and r['ep'] == 2)
    experts = planner.param_counts(gptconf)['experts'] // (4 * 2)  # n_expert / (tp x ep) whole experts
    dense = row['params_per_rank'] - experts
    ring = lambda n, ranks: 2 * (ranks - 1) / ranks * n * 4
    parts = row['comm_parts']  # (ZeRO-1: half of each ring is the updated parameters' gather after the step)
    assert parts['dp'][0] + parts['dp gather'][0] == pytest.approx(ring(dense, 4) + ring(experts, 2))
    assert parts['dp gather'][0] == pytest.approx((ring(dense, 4) + ring(experts, 2)) / 2)
    assert dense > 0 and all(nbytes > 0 for nbytes, _ in row['comm_parts'].values())


def test_a_global_batch_gives_every_row_the_same_sequences_a_step():
    """--global_batch: each row runs as many micro-batches as make it (global / (dp x micro_batch)), so the
    ranking compares layouts on one batch: a pipeline next to fewer replicas gets more micro-batches and a
    smaller bubble; a row whose replicas do not divide the batch says so."""
    from common import cluster_time
    gptconf = planner.gpt_config_from(os.path.join(REPO, 'config/llama2_7b.py'), [], None)
    rows = {r['strategy']: r for r in planner.estimate(gptconf, 16, 80, 1, 4096, 8, 4, 4, 8, True,
                                                       global_batch=256)}
    assert rows['ZeRO-1']['n_microbatches'] == 16 and rows['dp=4 x PP=4 1F1B, ZeRO-1']['n_microbatches'] == 64
    assert rows['dp=4 x PP=4 1F1B, ZeRO-1']['bubble_fraction'] == pytest.approx(3 / (64 + 3))
    ranked = cluster_time.fastest_first(list(rows.values()), 16, gptconf, 4096, 1, figures())
    assert len(ranked) >= 4 and {s['sequences'] for s in ranked} == {256}
    odd = {r['strategy']: r for r in planner.estimate(gptconf, 16, 80, 1, 4096, 8, 4, 4, 8, True,
                                                      global_batch=8)}
    assert 'not divisible by dp=16' in odd['ZeRO-1']['error']
    assert 'needs n_microbatches 2 >= pp=4' in odd['dp=4 x PP=4 1F1B, ZeRO-1']['error']  # (pipeline.py refuses it)


@pytest.mark.parametrize('flag, message', [('--global_batch=0', '--global_batch=0 must be at least 1'),
                                           ('--gpus_per_node=0', '--gpus_per_node=0 must be positive'),
                                           ('--ib_gbps=-5', '--ib_gbps=-5.0 must be positive')])
def test_a_flag_the_estimate_cannot_use_is_one_line(flag, message):
    """A global batch below 1 or a GPU figure that is not positive: one line and a non-zero exit, before any
    work (a node of 0 GPUs divided by zero in the ranking)."""
    proc = run_script('bench.py', ['--estimate', 'config/llama2_7b.py', flag])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and lines == [f'error: {message}'], proc.stderr


def test_the_estimate_plans_the_model_flags_bench_shares():
    """--n_layer, --n_head, --n_embd and --block_size are bench.py's own flags too: under --estimate they shape
    the planned model, written either way (the bench's parser had kept them, and the plan was the config
    file's model without a word); without --estimate they stay the bench's."""
    args, overrides = bench.parse_args(['--estimate', 'config/tinyllama_1b.py', '--n_layer=11', '--block_size',
                                        '512', '--n_head=16'])
    gptconf = planner.gpt_config_from(args.estimate, overrides, 32000)
    assert (gptconf.n_layer, gptconf.block_size, gptconf.n_head, gptconf.n_embd) == (11, 512, 16, 2048)
    args, overrides = bench.parse_args(['--n_layer=11'])
    assert overrides == [] and args.n_layer == 11


def test_the_bench_times_the_steps_nobody_observed():
    """A measured step's row says 'observed' (its time holds the observer's work): the bench's median leaves
    it out (the pipeline rows measure their last step too), unless every timed step was observed (the
    pp_1f1b_measured row, whose point is what measuring costs)."""
    row = lambda it, ms, observed=False: dict(iter=it, loss=1.0, ms=ms, tokens_per_sec=1.0, mfu=None,
                                              peak_mem_bytes=1, **({'observed': True} if observed else {}))
    log = [row(0, 900, True), row(1, 50), row(2, 10), row(3, 12), row(4, 400, True)]
    assert bench.summarize(log, 2)['ms'] == 11 and bench.summarize(log, 2)['ms_range'] == (10, 12)
    every = [row(it, ms, True) for it, ms in enumerate((900, 50, 30, 40))]
    assert bench.summarize(every, 2)['ms'] == 35


def test_an_empty_row_list_is_one_line():
    """--rows= named no row and ran the default eight (a minute of work, out_bench/ overwritten): one line now."""
    proc = run_script('bench.py', ['--rows='])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: unknown row(s) ''"), proc.stderr


def test_summarize_keeps_the_routing_of_the_timed_iterations():
    """A MoE run's counted routing (train.py logs it every log step) is kept for the iterations after the
    warm-up, the ones whose ms the row reports; a rank's report rows are not the run's."""
    log = [{'iter': i, 'loss': 4.0 - i, 'ms': 10.0 + i} for i in range(4)]
    log += [{'iter': i, 'aux': 1.0, 'tokens_per_expert': [[i, 1, 1, 1]]} for i in range(4)]
    log += [{'rank': 0, 'iter': 3, 'tokens_per_expert': [[9, 9, 9, 9]]}]
    out = bench.summarize(log, warmup=2)
    assert out['tokens_per_expert'] == [[[2, 1, 1, 1]], [[3, 1, 1, 1]]] and out['ms'] == 12.5
    assert out['ms_range'] == (12.0, 13.0)  # the spread of the timed steps, the warm-up's left out
