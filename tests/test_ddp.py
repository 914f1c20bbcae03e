"""train_ddp.py: DistributedDataParallel trains the same model to the same numbers as train.py.

One train.py run is the reference; the DDP runs (torchrun, 2 and 3 ranks) must log the same losses and write the
same train.py-format checkpoint, and each script must continue from the other's checkpoint as if uninterrupted."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import (REPO, TINY, assert_same_checkpoint, assert_same_losses, check, eval_losses, free_port,
                     read_log, run_script, run_train_py_here, spawn, train_losses, train_py_reference)

# gradient accumulation (6 micro-batches: 3 per rank on 2 ranks, 2 on 3), clipping that always bites (0.1), and a
# learning rate large enough that the parameters move well away from their initial values in 8 steps
ARGS = TINY + ['--gradient_accumulation_steps=6', '--eval_interval=4', '--eval_iters=3', '--log_interval=1',
               '--warmup_iters=2', '--learning_rate=1e-2', '--lr_decay_iters=8', '--min_lr=1e-3', '--grad_clip=0.1']


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """ref: train.py for 8 iterations. a: DDP on 2 ranks for 4, then train.py resumes to 8. b: train.py for 4
    (kept as ref4), then DDP on 3 ranks resumes to 8."""
    d = {name: str(tmp_path_factory.mktemp(name)) for name in ('a', 'b')}
    d['ref'] = train_py_reference(ARGS + ['--max_iters=8'], tmp_path_factory)
    check(run_script('train_ddp.py', ARGS + [f'--out_dir={d["a"]}', '--max_iters=4'], nproc=2))
    d['a4'] = os.path.join(d['a'], 'ckpt4.pt')
    shutil.copy(os.path.join(d['a'], 'ckpt.pt'), d['a4'])
    d['a_log4'] = train_losses(d['a'])
    run_train_py_here(ARGS + [f'--out_dir={d["a"]}', '--max_iters=8', '--init_from=resume'])
    run_train_py_here(ARGS + [f'--out_dir={d["b"]}', '--max_iters=4'])
    d['ref4'] = os.path.join(d['b'], 'ckpt4.pt')
    shutil.copy(os.path.join(d['b'], 'ckpt.pt'), d['ref4'])
    check(run_script('train_ddp.py', ARGS + [f'--out_dir={d["b"]}', '--max_iters=8', '--init_from=resume'], nproc=3))
    return d


def test_ddp_two_ranks_logs_train_py_losses(runs):
    assert_same_losses(runs['a_log4'], train_losses(runs['ref']), range(4))
    assert_same_losses(eval_losses(runs['a']), eval_losses(runs['ref']), [0, 4, 8])


def test_ddp_two_ranks_checkpoint_equals_single_process(runs):
    """4 AdamW steps on 2 ranks (accumulation, clipping) = 4 steps of one process on the whole batch."""
    assert_same_checkpoint(runs['a4'], runs['ref4'])


def test_train_py_continues_from_ddp_checkpoint(runs):
    assert_same_losses(train_losses(runs['a']), train_losses(runs['ref']), range(8))
    assert_same_checkpoint(os.path.join(runs['a'], 'ckpt.pt'), os.path.join(runs['ref'], 'ckpt.pt'))


def test_ddp_three_ranks_continues_from_train_py_checkpoint(runs):
    """DDP on 3 ranks resumed from train.py's checkpoint: the same losses and final state as train.py throughout."""
    assert_same_losses(train_losses(runs['b']), train_losses(runs['ref']), range(8))
    assert_same_losses(eval_losses(runs['b']), eval_losses(runs['ref']), [0, 4, 8])
    assert_same_checkpoint(os.path.join(runs['b'], 'ckpt.pt'), os.path.join(runs['ref'], 'ckpt.pt'))


def test_ddp_without_torchrun_is_train_py(runs, tmp_path):
    """One process, no torchrun: no process group, no DDP wrapper, train.py's numbers."""
    check(run_script('train_ddp.py', ARGS + ['--max_iters=2', f'--out_dir={tmp_path}']))
    assert_same_losses(train_losses(str(tmp_path)), train_losses(runs['ref']), range(2))


def _no_sync_worker(rank, world_size):
    """Rank's view of DDP with gradient accumulation: after a no_sync micro-step its gradient is its own (no
    all-reduce yet); after the last micro-step it is the mean gradient of the whole global batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from model import GPT, GPTConfig
    from train_ddp import sync_context
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=16, bias=False))
    reference = GPT(model.config)
    reference.load_state_dict(model.state_dict())
    ddp = DDP(model)
    micro_steps, rows = 2, 3
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 32, (world_size * micro_steps * rows, 16), generator=g)
    y = torch.randint(0, 32, x.shape, generator=g)
    grads_after_first = None
    for m in range(micro_steps):
        block = slice((rank * micro_steps + m) * rows, (rank * micro_steps + m + 1) * rows)
        with sync_context(ddp, m, micro_steps):
            (ddp(x[block], y[block])[1] / micro_steps).backward()
        if m == 0:
            grads_after_first = model.lm_head.weight.grad.clone()
    reference(x, y)[1].backward()  # one process, the whole global batch
    # numpy: torch tensors would travel through shared memory that dies with this process
    return grads_after_first.numpy(), {n: p.grad.numpy() for n, p in model.named_parameters()}, \
        {n: p.grad.numpy() for n, p in reference.named_parameters()}


def test_no_sync_accumulates_locally_then_all_reduces():
    results = spawn(_no_sync_worker, 2)  # 3 ranks: the torchrun run above
    firsts = [torch.from_numpy(r[0]) for r in results]
    assert not torch.allclose(firsts[0], firsts[1]), "gradients were synchronised inside no_sync"
    for _, synced, reference in results:
        for name in reference:
            torch.testing.assert_close(torch.from_numpy(synced[name]), torch.from_numpy(reference[name]), atol=1e-6,
                                       rtol=1e-5, msg=name)


def test_world_larger_than_the_batch_is_one_line():
    """Checked before any process group, as every rank runs it (WORLD_SIZE as torchrun sets it)."""
    proc = subprocess.run([sys.executable, 'train_ddp.py'] + TINY + ['--gradient_accumulation_steps=2'], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, WORLD_SIZE='3'))
    assert proc.returncode == 1 and proc.stdout == ''
    assert proc.stderr.strip().count('\n') == 0, proc.stderr
    assert proc.stderr.startswith('error: gradient_accumulation_steps (2) must be divisible by the data-parallel '
                                  'size dp=3')


def test_missing_data_set_is_one_line_on_every_rank(tmp_path):
    """Under torchrun: each rank prints its one line and exits 1 (torchrun then reports the failed workers)."""
    proc = run_script('train_ddp.py', TINY + ['--dataset=no_such_data', f'--out_dir={tmp_path}',
                                              '--gradient_accumulation_steps=2'], nproc=2, timeout=120)
    assert proc.returncode != 0
    for rank in range(2):
        assert f"[rank {rank}] error: data set 'no_such_data' not found" in proc.stderr, proc.stderr


def launch_without_agent(script, args, world_size, out_dir):
    """The workers torchrun would start (same environment variables), but with no agent above them that would
    kill the survivors when one dies: what they do then is up to the script and its process-group timeout."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(world_size), OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
        procs.append(subprocess.Popen([sys.executable, script] + args + [f'--out_dir={out_dir}'], cwd=REPO, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def assert_survivors_fail_when_a_rank_dies(script, args, out_dir, timeout_s=10):
    procs = launch_without_agent(script, args + [f'--dist_timeout={timeout_s}', '--max_iters=100000',
                                                 '--eval_interval=100000', '--log_interval=1'], 2, out_dir)
    try:
        deadline = time.time() + 120
        log = os.path.join(out_dir, 'log.jsonl')
        while not (os.path.exists(log) and any('"loss"' in line for line in open(log))):  # it is training
            assert time.time() < deadline and all(p.poll() is None for p in procs), 'not training'
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at = time.time()
        code = procs[0].wait(timeout=timeout_s + 60)
        assert code != 0
        assert time.time() - killed_at < timeout_s + 60
        # one line, not the collective's traceback (which had buried the dead rank's cause under torchrun)
        lines = [line for line in procs[0].stderr.read().splitlines() if line.strip()]
        assert lines[-1].startswith('[rank 0] error: another rank of this run stopped') and \
            not any('Traceback' in line for line in lines), lines[-12:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stderr.close()


def test_a_rank_that_never_joins_is_one_line_and_other_errors_keep_their_traceback():
    """The rendezvous' timeout (a rank that died before joining) is one line naming --dist_timeout; any other
    error is left to its traceback (lost_rank_line gives None)."""
    import torch.distributed as dist
    from common.training import lost_rank_line
    line = lost_rank_line(dist.DistStoreError('Timed out after 16 seconds waiting for clients. 1/2 clients joined.'))
    assert line == 'error: not every rank joined within --dist_timeout (Timed out after 16 seconds waiting for ' \
                   'clients. 1/2 clients joined.)', line
    assert lost_rank_line(RuntimeError('shape mismatch')) is None and lost_rank_line(ValueError('x')) is None


def test_a_rank_that_dies_makes_the_others_exit_non_zero(tmp_path):
    assert_survivors_fail_when_a_rank_dies('train_ddp.py', TINY + ['--gradient_accumulation_steps=2'], str(tmp_path))


def test_a_distributed_run_ends_with_every_ranks_peak_and_what_the_run_added(runs):
    """The last row of a distributed run: every rank's peak resident set, and what the run added to each
    (the peak less the start: most of a CPU peak is torch itself)."""
    end = [r for r in read_log(runs['b']) if 'peak_mem_bytes_by_rank' in r][-1]
    peaks, added = end['peak_mem_bytes_by_rank'], end['mem_added_bytes_by_rank']
    assert len(peaks) == len(added) == 3
    assert all(0 < a < p for a, p in zip(added, peaks)), end
