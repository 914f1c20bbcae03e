"""On a GPU (skipped where there is none, as in CI): every script runs a few iterations with CUDA, NCCL and
bfloat16, through torchrun with one process per GPU (1, or 2 where two GPUs exist), and its losses are finite and
close to the fp32 CPU run of train.py. Run it by hand on any machine with a GPU: python -m pytest tests/test_gpu.py"""
import math

import pytest
import torch

from helpers import check, read_log, run_script, train_losses

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU (CI has none)')

N_GPUS = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0
MODEL = ['--n_layer=4', '--n_head=4', '--n_embd=128', '--block_size=128', '--batch_size=8', '--eval_iters=2',
         f'--gradient_accumulation_steps={2 * max(N_GPUS, 1)}', '--max_iters=6', '--eval_interval=6',
         '--log_interval=1', '--sample_at_end=False', '--compile=False']
SCRIPTS = {
    'train_ddp.py': [], 'train_fsdp.py': [], 'zero.py': ['--stage=3'], 'zero.py --stage=2': ['--stage=2'],
    'tensor_parallel.py': [f'--tp={N_GPUS}', f'--sequence_parallel={N_GPUS > 1}'],
    'pipeline.py': [f'--pp={N_GPUS}', '--n_microbatches=2'],
}


@pytest.fixture(scope='module')
def cpu_fp32(tmp_path_factory):
    out = str(tmp_path_factory.mktemp('cpu'))
    check(run_script('train.py', MODEL + ['--device=cpu', '--dtype=float32', f'--out_dir={out}']))
    return train_losses(out)


def assert_close_to_cpu(out_dir, cpu_fp32):
    got = train_losses(out_dir)
    assert sorted(got) == sorted(cpu_fp32)
    for it, loss in got.items():
        assert math.isfinite(loss) and loss == pytest.approx(cpu_fp32[it], rel=0.02), (it, loss, cpu_fp32[it])


def test_train_py_bf16_on_the_gpu(cpu_fp32, tmp_path):
    check(run_script('train.py', MODEL + ['--device=cuda', '--dtype=bfloat16', f'--out_dir={tmp_path}']))
    assert_close_to_cpu(str(tmp_path), cpu_fp32)
    assert all(r['mfu'] is not None for r in read_log(str(tmp_path)) if 'loss' in r)  # the GPU's peak was known


@pytest.mark.parametrize('name', list(SCRIPTS))
def test_script_bf16_nccl(cpu_fp32, tmp_path, name):
    script = name.split()[0]
    check(run_script(script, MODEL + SCRIPTS[name] + ['--dtype=bfloat16', f'--out_dir={tmp_path}'],
                     nproc=max(N_GPUS, 1)))
    assert_close_to_cpu(str(tmp_path), cpu_fp32)
