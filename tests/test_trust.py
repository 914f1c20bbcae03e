"""What makes the printed numbers and the runs trustworthy, across scripts: dropout masks drawn per
data-parallel rank the same way by DDP, ZeRO 0-3 and FSDP2 (so they give one another's loss curve with dropout
on) and continued exactly on resume by every data-parallel script, the peak FLOP/s table, checkpoint writes
that never hold a rank inside the training loop, a wire meter that reads what a rank sent, and a test harness that fails on a hang instead of waiting
forever."""
import os
import time

import numpy as np
import pytest
import torch

from common import checkpoints
from common import training
from helpers import TINY, spawn, train_losses
from test_multinode import assert_mfu_per_device

DROPOUT = TINY + ['--dropout=0.2', '--gradient_accumulation_steps=4', '--max_iters=4', '--eval_interval=4',
                  '--log_interval=1', '--learning_rate=1e-2', '--warmup_iters=1', '--peak_flops=1e12']
# every data-parallel script as (name, module, flags): each trains DROPOUT straight, and split (2 iterations,
# stopped, resumed to 4). parallel_4d.py with only dp > 1 is ZeRO-1 over the data-parallel ranks, but its
# masks are its own (its model is built on the meta device and cut for the grid): held to its own curve only.
DATA_PARALLEL = [('ddp', 'train_ddp', []), ('fsdp', 'train_fsdp', [])] + \
    [(f'zero{s}', 'zero', [f'--stage={s}']) for s in range(4)] + [('grid', 'parallel_4d', [])]
# the model-parallel scripts that train with dropout, each rank its own stream (tp: Megatron's per-rank one for
# the heads it holds; pp: per stage; ep: per data-parallel rank): held to their own curve, split and resumed
MODEL_PARALLEL = [('tp', 'tensor_parallel', ['--tp=2']), ('pp', 'pipeline', ['--pp=2', '--n_microbatches=2']),
                  ('ep', 'expert_parallel', ['--ep=2', '--n_expert=4', '--n_expert_active=2'])]


def data_parallel_runs(rank, world_size, out):
    """In each spawned rank, one process group: every DATA_PARALLEL script straight to 4 and split at 2, and
    DDP without dropout."""
    import importlib
    for name, module, flags in DATA_PARALLEL + MODEL_PARALLEL:
        main = importlib.import_module(module).main
        main(DROPOUT + flags + [f'--out_dir={out}/{name}'])
        main(DROPOUT + flags + [f'--out_dir={out}/{name}_split', '--max_iters=2'])
        main(DROPOUT + flags + [f'--out_dir={out}/{name}_split', '--init_from=resume'])
    importlib.import_module('train_ddp').main(DROPOUT + ['--dropout=0.0', f'--out_dir={out}/no_dropout'])


def test_data_parallel_strategies_agree_and_resume_exactly_with_dropout_on(tmp_path):
    """Each rank draws its own masks (its own stream), the same way in every data-parallel script: the curves
    of DDP, FSDP2 and ZeRO 0-3 on 2 ranks are one curve, and it is not the dropout-free one. Stopped at 2 and
    resumed, each rank must go on with its own stream: every split curve (the 4D grid's too) equals its
    uninterrupted one exactly, and so must tensor_parallel.py's, pipeline.py's and expert_parallel.py's. A bug
    that restored rank 0's stream on every rank moved DDP's loss after the resume by 4e-5, which the
    cross-script 1e-5 would catch only just; a script's own curve must not move."""
    out = str(tmp_path)
    spawn(data_parallel_runs, 2, out)
    ddp = train_losses(f'{out}/ddp')
    assert sorted(ddp) == [0, 1, 2, 3]
    for name, _, _ in DATA_PARALLEL:
        got, split = train_losses(f'{out}/{name}'), train_losses(f'{out}/{name}_split')
        assert split == got, (name, 'resumed at 2:', split, 'uninterrupted:', got)
        for it in ddp if name != 'grid' else ():
            assert got[it] == pytest.approx(ddp[it], rel=1e-5), (name, it, got[it], ddp[it])
    for name, _, _ in MODEL_PARALLEL:  # (tensor_parallel.py's and expert_parallel.py's resume once lost a stream)
        got, split = train_losses(f'{out}/{name}'), train_losses(f'{out}/{name}_split')
        assert split == got and sorted(got) == [0, 1, 2, 3], (name, 'resumed at 2:', split, 'uninterrupted:', got)
    plain = train_losses(f'{out}/no_dropout')
    assert all(abs(plain[it] - ddp[it]) > 1e-4 for it in ddp), "dropout changed nothing"
    assert_mfu_per_device(f'{out}/ddp', 2, DROPOUT)
    assert_mfu_per_device(f'{out}/fsdp', 2, DROPOUT)


def _masks(rank, world_size):
    torch.manual_seed(1337)  # every rank built the same model from the seed
    checkpoints.seed_dropout(1337, rank)
    return torch.nn.functional.dropout(torch.ones(64), 0.5).numpy()


def test_each_data_parallel_rank_draws_its_own_masks():
    masks = spawn(_masks, 2)
    assert not np.array_equal(masks[0], masks[1])
    torch.manual_seed(1337)
    assert np.array_equal(masks[0], torch.nn.functional.dropout(torch.ones(64), 0.5).numpy())  # rank 0 = train.py


def _one_way(rank, world_size):
    import torch.distributed as dist
    from common.measure import WireMeter
    meter, t = WireMeter(), torch.ones(1 << 18)  # 1 MiB, from rank 0 to rank 1 only
    meter.start()
    dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
    return meter.stop(), meter.why_not


def test_the_wire_meter_reads_the_bytes_this_rank_sent():
    """One-way traffic (every collective the scripts measure sends as much as it receives, so a meter reading
    the bytes received passed them all): the sender's own sockets show the MiB and its headers, the receiver's
    only the barriers' few bytes."""
    (sender, why), (receiver, why_receiver) = spawn(_one_way, 2)
    if why is not None and 'per-socket TCP counters' in why:  # (the one reason a gloo rank may not measure)
        pytest.skip(f"the wire meter is {why}")
    assert why is None and why_receiver is None, (why, why_receiver)  # gloo, two processes: both measure
    assert (1 << 20) <= sender < 1.02 * (1 << 20) and receiver < 4096, (sender, receiver)


@pytest.mark.parametrize('name, dtype, peak', [
    ('NVIDIA L4', 'bfloat16', 121e12), ('NVIDIA L40S', 'bfloat16', 362e12),
    ('NVIDIA H100 80GB HBM3', 'float32', 495e12), ('NVIDIA A100-SXM4-80GB', 'bfloat16', 312e12),
    ('Tesla T4', 'bfloat16', None), ('NVIDIA GeForce RTX 4090', 'float16', 165e12),
    ('Some Future GPU', 'bfloat16', None), ('NVIDIA H100 PCIe', 'bfloat16', 756e12),
    ('NVIDIA H100 NVL', 'float32', 418e12), ('NVIDIA H200 NVL', 'bfloat16', 835e12),  # (not the SXM's 989 and 495: the first key that names the card)
    ('NVIDIA RTX A1000', 'bfloat16', None), ('NVIDIA GH200 480GB', 'bfloat16', None)])  # (whole names only)
def test_peak_flops_table_matches_whole_names(name, dtype, peak):
    assert training.peak_flops_for('cuda:0', dtype, device_name=name) == peak
    assert training.peak_flops_for('cpu', dtype) is None and training.peak_flops_for('cpu', dtype, override=5e12) == 5e12


def test_mfu_divides_by_every_device():
    assert training.mfu(6e9, 1000.0, 8, 1e15) == pytest.approx(6e9 * 1000 / (8 * 1e15))
    assert training.mfu(6e9, 1000.0, 8, None) is None


def test_checkpoint_writer_returns_before_the_disk_and_raises_its_errors(tmp_path, monkeypatch):
    real_save = checkpoints.save_checkpoint

    def slow_save(obj, path):
        time.sleep(2)
        real_save(obj, path)

    monkeypatch.setattr(checkpoints, 'save_checkpoint', slow_save)
    writer, weights = checkpoints.CheckpointWriter(), torch.ones(3)
    start = time.time()
    writer.save({'w': weights}, str(tmp_path / 'ckpt.pt'))
    assert time.time() - start < 1.0  # the training thread goes on while the disk works
    weights.add_(1)  # and may change its tensors: the write has its own copy
    writer.wait()
    assert torch.equal(torch.load(tmp_path / 'ckpt.pt')['w'], torch.ones(3))

    def broken_save(obj, path):
        raise OSError('disk full')

    monkeypatch.setattr(checkpoints, 'save_checkpoint', broken_save)
    writer.save({'w': weights}, str(tmp_path / 'ckpt.pt'))
    with pytest.raises(OSError, match='disk full'):
        writer.wait()


def test_the_last_checkpoint_of_a_run_is_written_without_a_copy(tmp_path, monkeypatch):
    """A save before the last copies the state (training changes it next); the run's last save (iter_num is
    the writer's last_iter) hands a whole CPU tensor to the thread as it is, and copies only a view (torch.save
    would write its whole storage: a ZeRO rank's chunk inside its bucket would save the bucket)."""
    written = []
    monkeypatch.setattr(checkpoints, 'save_checkpoint', lambda obj, path: written.append(obj))
    writer, weights, bucket = checkpoints.CheckpointWriter(last_iter=10), torch.ones(1000), torch.ones(1000)
    for iter_num in (5, 10):
        writer.save({'w': weights, 'chunk': bucket[:250]}, str(tmp_path / 'ckpt.pt'), iter_num)
        writer.wait()
    assert written[0]['w'].data_ptr() != weights.data_ptr()  # iteration 5: a copy
    assert written[1]['w'].data_ptr() == weights.data_ptr()  # iteration 10, the last: the tensor itself
    chunk = written[1]['chunk']  # ... and the view's quarter alone
    assert chunk.untyped_storage().nbytes() == 250 * 4 and torch.equal(chunk, bucket[:250])


def test_torchs_meta_kernels_count_in_the_start_not_in_the_run():
    """'by the run' leaves out torch's own code: the meta kernels a sharded build loads (~70 MiB of Python
    modules) move the start up by what loading them took, once. In a fresh process, where they are not
    loaded yet."""
    import subprocess
    import sys
    code = ("from common import distributed as t; s0 = t.START_RESIDENT_BYTES; t.load_meta_kernels(); "
            "s1 = t.START_RESIDENT_BYTES; t.load_meta_kernels(); print(s0, s1, t.START_RESIDENT_BYTES)")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    s0, s1, s2 = map(int, out.stdout.split())
    assert s1 - s0 > 20 * 2**20  # the first load: tens of MiB, added to the start
    assert s2 - s1 < 4 * 2**20   # loaded already: nothing more


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
