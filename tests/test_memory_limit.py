"""--memory_limit_mib: each rank's memory capped by the kernel (a memory cgroup per rank), as a GPU's
memory caps a GPU rank. A GPT whose full training state (16 bytes a parameter: fp32 weights, gradients,
AdamW's two moments) is larger than the cap trains train.py's curve under ZeRO-3 and FSDP2 on 4 ranks, each
holding its quarter; DDP, which holds all of it on every rank, is killed by the kernel, and the run says so
in one line."""
import math
import os
import re

import pytest

from common import memory_limit
from helpers import REPO, assert_same_losses, check, run_script, train_losses, train_py_reference

WHY_NOT = memory_limit.why_not_here()
needs_a_cgroup = pytest.mark.skipif(WHY_NOT is not None, reason=f"this machine cannot limit memory: "
                                    f"{WHY_NOT}")

CONFIG = os.path.join(REPO, 'config', 'limited_memory.py')
# README's model (18.9M parameters: 16 bytes each is 289 MiB), for 2 iterations
ARGS = [CONFIG, '--max_iters=2', '--eval_interval=100', '--log_interval=1', '--dropout=0.0',
        '--dtype=float32', '--compile=False', '--device=cpu']
MARGIN = 1.25  # what the planner leaves out: the framework's own memory, the loss's transients, buffers


def planned_mib():
    """The planner's ZeRO-3 estimate per rank for this run on 4 ranks (bench.py --estimate), in MiB."""
    from common import planner
    from common.data import load_dataset
    gptconf = planner.gpt_config_from(CONFIG, ['--dtype=float32'], load_dataset('stdlib_char')[1])
    rows = planner.estimate(gptconf, 4, 1, 2, gptconf.block_size, 1, 1, 1, 1, False)
    return next(r for r in rows if r['strategy'] == 'ZeRO-3')['total_bytes'] / 2**20


LIMIT_MIB = math.ceil(MARGIN * planned_mib())


def parameters_of(proc):
    """Ψ as the run's first line states it ('18.93M parameters')."""
    return float(re.search(r'([\d.]+)M parameters', proc.stdout).group(1)) * 1e6


def killed_ranks(proc, limit_mib):
    """The ranks whose watcher said the kernel killed them for going over limit_mib, each once."""
    assert proc.returncode != 0
    killed = re.findall(rf'\[rank (\d)\] error: killed by the kernel: its memory went over the {limit_mib} '
                        r'MiB limit', proc.stderr)
    assert killed and len(killed) == len(set(killed)), proc.stderr[-3000:]
    assert 'iter 0:' not in proc.stdout, proc.stdout[-2000:]  # killed before its first step was over
    return killed


@needs_a_cgroup
@pytest.mark.parametrize('script', ['zero.py --stage=3', 'train_fsdp.py'])
def test_sharded_training_fits_under_a_limit_its_full_state_exceeds(script, tmp_path, tmp_path_factory):
    """At the planner's estimate plus its margin, under the full state's 16 bytes a parameter."""
    name, *flags = script.split()
    proc = check(run_script(name, flags + ARGS + [f'--out_dir={tmp_path}', f'--memory_limit_mib={LIMIT_MIB}'],
                            nproc=4))
    assert 16 * parameters_of(proc) > LIMIT_MIB * 2**20, (proc.stdout[:300], LIMIT_MIB)
    assert_same_losses(train_losses(tmp_path), train_losses(train_py_reference(ARGS, tmp_path_factory)))
    peaks = re.findall(r'\[rank \d\] memory at its peak .*: (\d+) MiB of its (\d+) MiB limit', proc.stderr)
    assert len(peaks) == 4 and all(int(limit) == LIMIT_MIB for _, limit in peaks), proc.stderr[-2000:]
    # the kernel's own count of each rank's peak holds the rank's state: above 0.8 x the planner's estimate
    # (which kills ZeRO-3, below); 1.0-1.1 x it on this machine
    assert all(int(peak) > 0.8 * planned_mib() for peak, _ in peaks), (peaks, planned_mib())


@needs_a_cgroup
def test_ddp_is_killed_by_the_kernel_under_the_same_limit(tmp_path):
    proc = run_script('train_ddp.py', ARGS + [f'--out_dir={tmp_path}', f'--memory_limit_mib={LIMIT_MIB}'],
                      nproc=4)
    killed_ranks(proc, LIMIT_MIB)


@needs_a_cgroup
def test_zero_3_is_killed_at_four_fifths_of_the_planners_estimate(tmp_path):
    """The estimate is no loose upper bound: 0.8 x it is too little for the run it prices."""
    low = math.floor(0.8 * planned_mib())
    proc = run_script("zero.py", ["--stage=3"] + ARGS + [f"--out_dir={tmp_path}", f"--memory_limit_mib={low}"],
                      nproc=4)
    killed_ranks(proc, low)


def test_a_machine_that_cannot_limit_memory_refuses_in_one_line(monkeypatch):
    monkeypatch.setattr(memory_limit, 'cgroup_of_this_process', lambda: (None, 'no memory cgroup controller'))
    with pytest.raises(SystemExit) as stop:
        memory_limit.limit_this_rank(256, 0)
    assert str(stop.value.code).startswith('error: --memory_limit_mib needs a memory cgroup') \
        and str(stop.value.code).endswith('no memory cgroup controller'), stop.value.code


def test_a_negative_limit_is_one_line():
    import train
    with pytest.raises(SystemExit) as stop:
        train.main(['--memory_limit_mib=-5'])
    assert stop.value.code == 'error: --memory_limit_mib must be a size in MiB, or 0 for none, got -5'
