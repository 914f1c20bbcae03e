"""parallel_4d.py: tensor_parallel.py's, context_parallel.py's and zero.py's pieces composed on a dp 2 x cp 2 x tp 2
grid of 8 gloo processes train train.py's loss curve, resume on the same grid and consolidate into train.py's
checkpoint; every rank's groups are the grid's rows along each dimension; the bench's price of that grid counts
the calls it makes; bad input is one line; a step main() does not measure makes no measuring call (on a pp 2 x
tp 2 grid). The grids with a pipeline and with experts train train.py's curve in tests/test_matrix.py. (Two
8-process runs: each costs half a minute on two cores.)"""
from pathlib import Path

import pytest
import torch

from consolidate import consolidate
from helpers import (TINY, assert_config_error, assert_same_checkpoint, assert_same_losses, check, eval_losses,
                     measured_rows, measuring_calls_per_step, one_error_line_per_rank, read_log, run_script, spawn,
                     train_losses, stdlib_vocab, train_py_reference)

FLAGS = TINY + ['--gradient_accumulation_steps=2', '--log_interval=1', '--eval_interval=2', '--max_iters=4',
                '--learning_rate=1e-2', '--warmup_iters=1']
LLAMA = ['--n_embd=32', '--n_head=4', '--n_kv_head=2', '--norm=rmsnorm', '--mlp=swiglu', '--pos=rope',
         '--tie_embeddings=False']


def assert_groups_are_the_grids_rows(out_dir, shape):
    """Each rank logged its coordinates and the global ranks of its groups: they must be the grid's rows along each
    dimension, torch.arange(8).view(dp, pp, cp, tp), and dp_cp the ranks with its pp and tp coordinates."""
    grid = torch.arange(8).view(*shape)
    rows = {r['rank']: r for r in read_log(out_dir) if 'groups' in r}  # (a resumed run logs them again)
    assert sorted(rows) == list(range(8))
    for r in rows.values():
        c = r['coords']
        assert int(grid[c['dp'], c['pp'], c['cp'], c['tp']]) == r['rank']
        g = r['groups']
        assert g['dp'] == grid[:, c['pp'], c['cp'], c['tp']].tolist()
        assert g['pp'] == grid[c['dp'], :, c['cp'], c['tp']].tolist()
        assert g['cp'] == grid[c['dp'], c['pp'], :, c['tp']].tolist()
        assert g['tp'] == grid[c['dp'], c['pp'], c['cp'], :].tolist()
        assert g['dp_cp'] == grid[:, c['pp'], :, c['tp']].flatten().tolist()


def assert_bench_prices_what_it_sends(out_dir):
    """bench.py's predicted step for its grid_dp_cp_tp row counts the calls parallel_4d.py makes (this run is
    that row's shape: dp 2 x cp 2 x tp 2, one micro-step of 2 microbatches a dp rank): the bytes of each
    group's calls, beside what every rank counted at its calls. The ring's are exact; tp's and dp x cp's
    within 5% (the model leaves out a few small calls and the parameters every tp rank keeps whole)."""
    from common import step_time
    from model import GPTConfig
    config = GPTConfig(n_layer=2, n_head=4, n_embd=16, block_size=16, vocab_size=stdlib_vocab(), bias=False)
    work = step_time.row_work('grid_dp_cp_tp', config, 4, 2, 2)
    priced = {kind: sum(n * c for k, n, c in work['calls'] if k == kind)
              for kind in ('all_reduce', 'send', 'all_reduce burst x4')}
    for r in measured_rows(out_dir, 8):
        counted = r['collective_bytes_by_kind']
        assert priced['send'] == counted['cp kv'] + counted['cp dkv'], (priced, counted)
        assert priced['all_reduce'] == pytest.approx(counted['tp all_reduce'], rel=0.05), (priced, counted)
        assert priced['all_reduce burst x4'] == pytest.approx(counted['dp_cp reduce_scatter'], rel=0.05)


def test_dp2_cp2_tp2_resumes_and_consolidates_to_train_py(tmp_path, tmp_path_factory):
    """GPT-2 layout (learned positions, tied), ring attention across 2 cp ranks inside tensor-parallel blocks, ZeRO-1
    over dp x cp: 2 iterations, then resumed to 4, give train.py's curve; consolidated (ZeRO-1 chunks, tp slices and
    stages put back together), the checkpoint is the one train.py writes after the same 4 iterations: the same
    parameters and AdamW moments. And bench.py prices the calls it makes."""
    ref = train_py_reference(FLAGS, tmp_path_factory)
    flags = FLAGS + ['--cp=2', '--tp=2', f'--out_dir={tmp_path}']
    first = check(run_script('parallel_4d.py', flags + ['--max_iters=2'], nproc=8, timeout=400))
    check(run_script('parallel_4d.py', flags + ['--init_from=resume'], nproc=8, timeout=400))
    assert "more on the wire than the ring formula: on gloo a reduce-scatter is an all-reduce" in first.stdout
    assert_same_losses(train_losses(tmp_path), train_losses(ref), range(4))
    assert_same_losses(eval_losses(tmp_path), eval_losses(ref), [0, 2, 4])
    assert_groups_are_the_grids_rows(tmp_path, (2, 1, 2, 2))
    assert_bench_prices_what_it_sends(tmp_path)
    consolidate(str(tmp_path))
    assert_same_checkpoint(tmp_path / 'ckpt.pt', Path(ref) / 'ckpt.pt')


BAD = [
    (8, ['--pp=3'], 'world size 8 is not divisible by pp=3 x cp=1 x tp=1 = 3: start a multiple of 3'),
    (8, ['--tp=2', '--cp=2', '--cp_attention=ulysses', '--n_head=2'], 'must be divisible by tp x cp = 4'),
    (8, ['--cp=2', '--sequence_parallel=True', '--tp=2'], 'sequence_parallel False'),
    (8, ['--pp=2', '--n_layer=3'], 'n_layer (3) must be divisible by pp x virtual_stages = 2'),
    (8, ['--pp=2', '--compile=True'], 'not supported by parallel_4d.py: pass --compile=False'),
    (8, ['--pp=1', '--schedule=interleaved', '--virtual_stages=2'], '--virtual_stages=2 needs pp >= 2'),
    # each of these crashed (ZeroDivisionError; a KeyError after evaluating; mid-run) or silently ran Ulysses
    (8, ['--pp=2', '--n_microbatches=0'], '--n_microbatches=0 must be at least 1'),
    (8, ['--pp=2', '--virtual_stages=0'], '--virtual_stages=0 must be 1'),
    (8, ['--pp=2', '--schedule=foo'], '--schedule=foo is not one of gpipe, 1f1b, interleaved'),
    (8, ['--pp=2', '--virtual_stages=2', '--schedule=1f1b'], '--virtual_stages=2 must be 1, or more with --schedule=i'),
    (8, ['--cp=2', '--cp_attention=foo'], '--cp_attention=foo is not one of ring, ulysses'),
    (8, ['--tp=2', '--ep=2'], '--ep=2 needs a mixture of experts: pass --n_expert'),
    (8, ['--tp=2', '--ep=3', '--n_expert=6'], 'ep (3) must divide dp x cp = 4'),
    (8, ['--tp=2', '--ep=4', '--n_expert=4'], 'n_expert (4) must be divisible by ep x tp = 8'),
    (8, ['--pp=2', '--n_expert=4', '--aux_loss_style=hf'], "aux_loss_style='hf' (a converted Mixtral's loss) pools"),
]


@pytest.mark.parametrize('world,args,message', BAD,
                         ids=['world', 'heads', 'sp-with-cp', 'layers', 'compile', 'v-on-one-stage', 'm-0', 'v-0',
                              'schedule', 'v-with-1f1b', 'attention', 'ep-dense', 'ep-3', 'ep-tp-8', 'moe-hf'])
def test_bad_config_is_one_clear_error(monkeypatch, tmp_path, world, args, message):
    import parallel_4d
    argv = TINY + ['--gradient_accumulation_steps=8', f'--out_dir={tmp_path}'] + args
    assert_config_error(parallel_4d.main, argv, world, message, monkeypatch)


@pytest.mark.parametrize('args,key', [BAD[i][1:] for i in (6, 8, 9)], ids=['m-0', 'schedule', 'v-with-1f1b'])
def test_bad_input_is_one_line_on_every_rank_before_any_work(tmp_path, args, key):
    """Three of the above on 2 ranks (the rest fail the same check function): run_main's line on each."""
    proc = run_script('parallel_4d.py', TINY + [f'--out_dir={tmp_path}'] + args, nproc=2, timeout=60)
    one_error_line_per_rank(proc, key, 'parallel_4d.py')
    assert not (tmp_path / 'log.jsonl').exists()  # nothing ran


def test_resume_on_another_grid_says_what_to_do(tmp_path):
    """Saved on pp=2 (one iteration, 2 ranks), resumed as tp=2: one line per rank naming the saved grid and
    consolidate.py, before any work, not a load_state_dict traceback."""
    flags = TINY + [f'--out_dir={tmp_path}', '--max_iters=1', '--eval_interval=1', '--eval_iters=1']
    check(run_script('parallel_4d.py', flags + ['--pp=2'], nproc=2))
    proc = run_script('parallel_4d.py', flags + ['--tp=2', '--init_from=resume'], nproc=2, timeout=60)
    one_error_line_per_rank(proc, 'was saved with --pp=2 --cp=1 --tp=1 --ep=1 --virtual_stages=1 on 2 ranks, this run '
                                  'has --pp=1 --cp=1 --tp=2 --ep=1 --virtual_stages=1 on 2 ranks', 'parallel_4d.py')
    assert f'python consolidate.py {tmp_path}' in proc.stderr


def test_an_unmeasured_step_makes_no_measuring_call(tmp_path):
    """main() as a user runs it (pp=2 x tp=2, 3 iterations, --measure_every=0): the schedule's clock (its
    barriers, the MAX all-reduce, perf_counter) and the report run on the measured first step only; the later
    steps make no barrier, all_gather_object, synchronize or clock call (the patches do see the first step's)."""
    argv = FLAGS + ['--pp=2', '--tp=2', '--max_iters=3', '--eval_interval=3', '--sample_at_end=False',
                    '--measure_every=0', f'--out_dir={tmp_path}']
    for rank, per_step in enumerate(spawn(measuring_calls_per_step, 4, 'parallel_4d', argv)):
        assert len(per_step) == 3, (rank, per_step)
        assert per_step[0].get('clock', 0) > 0 and per_step[0].get('barrier', 0) > 0, (rank, per_step[0])
        assert per_step[1] == per_step[2] == {}, (rank, per_step)
