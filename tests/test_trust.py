"""What makes the printed numbers and the runs trustworthy, across scripts: dropout masks drawn per data-parallel
rank the same way by DDP, ZeRO 0-3 and FSDP2 (so they give one another's loss curve with dropout on), the peak
FLOP/s table, checkpoint writes that never hold a rank inside the training loop, and a test harness that fails
on a hang instead of waiting forever."""
import time

import numpy as np
import pytest
import torch

import model as M
from helpers import TINY, check, run_script, spawn, train_losses
from test_multinode import assert_mfu_per_device

DROPOUT = TINY + ['--dropout=0.2', '--gradient_accumulation_steps=4', '--max_iters=4', '--eval_interval=4',
                  '--log_interval=1', '--learning_rate=1e-2', '--warmup_iters=1', '--peak_flops=1e12']


def zero_stages_with_dropout(rank, world_size, out):
    from zero import main
    for stage in range(4):
        main(DROPOUT + [f'--stage={stage}', f'--out_dir={out}/zero{stage}'])


def test_data_parallel_strategies_agree_with_dropout_on(tmp_path):
    """Each rank draws its own masks (its own stream), the same way in every data-parallel script: the curves of
    DDP, ZeRO 0-3 and FSDP2 on 2 ranks are one curve, and it is not the dropout-free one."""
    out = str(tmp_path)
    check(run_script('train_ddp.py', DROPOUT + [f'--out_dir={out}/ddp'], nproc=2))
    check(run_script('train_fsdp.py', DROPOUT + [f'--out_dir={out}/fsdp'], nproc=2))
    spawn(zero_stages_with_dropout, 2, out)
    check(run_script('train_ddp.py', DROPOUT + ['--dropout=0.0', f'--out_dir={out}/no_dropout'], nproc=2))
    ddp = train_losses(f'{out}/ddp')
    assert sorted(ddp) == [0, 1, 2, 3]
    for name in ['fsdp'] + [f'zero{s}' for s in range(4)]:
        got = train_losses(f'{out}/{name}')
        for it in ddp:
            assert got[it] == pytest.approx(ddp[it], rel=1e-5), (name, it, got[it], ddp[it])
    plain = train_losses(f'{out}/no_dropout')
    assert all(abs(plain[it] - ddp[it]) > 1e-4 for it in ddp), "dropout changed nothing"
    assert_mfu_per_device(f'{out}/ddp', 2)
    assert_mfu_per_device(f'{out}/fsdp', 2)


def _masks(rank, world_size):
    torch.manual_seed(1337)  # every rank built the same model from the seed
    M.seed_dropout(1337, rank)
    return torch.nn.functional.dropout(torch.ones(64), 0.5).numpy()


def test_each_data_parallel_rank_draws_its_own_masks():
    masks = spawn(_masks, 2)
    assert not np.array_equal(masks[0], masks[1])
    torch.manual_seed(1337)
    assert np.array_equal(masks[0], torch.nn.functional.dropout(torch.ones(64), 0.5).numpy())  # rank 0 = train.py


@pytest.mark.parametrize('name, dtype, peak', [
    ('NVIDIA L4', 'bfloat16', 121e12), ('NVIDIA L40S', 'bfloat16', 362e12),
    ('NVIDIA H100 80GB HBM3', 'float32', 495e12), ('NVIDIA A100-SXM4-80GB', 'bfloat16', 312e12),
    ('Tesla T4', 'bfloat16', None), ('NVIDIA GeForce RTX 4090', 'float16', 165e12),
    ('Some Future GPU', 'bfloat16', None)])
def test_peak_flops_table_matches_whole_names(name, dtype, peak):
    assert M.peak_flops_for('cuda:0', dtype, device_name=name) == peak
    assert M.peak_flops_for('cpu', dtype) is None and M.peak_flops_for('cpu', dtype, override=5e12) == 5e12


def test_mfu_divides_by_every_device():
    assert M.mfu(6e9, 1000.0, 8, 1e15) == pytest.approx(6e9 * 1000 / (8 * 1e15))
    assert M.mfu(6e9, 1000.0, 8, None) is None


def test_checkpoint_writer_returns_before_the_disk_and_raises_its_errors(tmp_path, monkeypatch):
    real_save = M.save_checkpoint

    def slow_save(obj, path):
        time.sleep(2)
        real_save(obj, path)

    monkeypatch.setattr(M, 'save_checkpoint', slow_save)
    writer, weights = M.CheckpointWriter(), torch.ones(3)
    start = time.time()
    writer.save({'w': weights}, str(tmp_path / 'ckpt.pt'))
    assert time.time() - start < 1.0  # the training thread goes on while the disk works
    weights.add_(1)  # and may change its tensors: the write has its own copy
    writer.wait()
    assert torch.equal(torch.load(tmp_path / 'ckpt.pt')['w'], torch.ones(3))

    def broken_save(obj, path):
        raise OSError('disk full')

    monkeypatch.setattr(M, 'save_checkpoint', broken_save)
    writer.save({'w': weights}, str(tmp_path / 'ckpt.pt'))
    with pytest.raises(OSError, match='disk full'):
        writer.wait()


def _deadlock(rank, world_size):
    import torch.distributed as dist
    if rank == 0:
        dist.barrier()  # rank 1 never comes
    else:
        time.sleep(120)


def test_a_hang_fails_within_the_timeout_with_the_ranks_stacks():
    start = time.time()
    with pytest.raises(AssertionError, match='did not finish within 15 s') as e:
        spawn(_deadlock, 2, timeout=15)
    assert time.time() - start < 45
    assert 'rank 1' in str(e.value) and '_deadlock' in str(e.value)  # where each stuck rank was
