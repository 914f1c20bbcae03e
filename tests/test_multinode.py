"""Many nodes, proven on one machine: two torchrun agents (--nnodes=2, one process each) meet through the c10d
rendezvous on 127.0.0.1, as two machines would through a real host name, and train_ddp.py, zero.py,
tensor_parallel.py and pipeline.py train train.py's loss curve across the two "nodes". The same runs check that
every script reports MFU per device: the whole model's FLOPs per token times the run's tokens per second, over
the world's devices times one device's peak."""
import os
import subprocess
import sys

import pytest

from helpers import (REPO, TINY, assert_same_losses, free_port, measured_rows, read_log, train_losses,
                     train_py_reference)

ARGS = TINY + ['--gradient_accumulation_steps=2', '--max_iters=3', '--eval_interval=3', '--log_interval=1',
               '--peak_flops=1e12']
SCRIPTS = {'train_ddp.py': [], 'zero.py': ['--stage=3'], 'tensor_parallel.py': ['--tp=2'],
           'pipeline.py': ['--pp=2', '--n_microbatches=2']}


def multinode_command(node_rank, port, script, args):
    """README's multi-node command, with this machine as the rendezvous host."""
    return [sys.executable, '-m', 'torch.distributed.run', '--nnodes=2', '--nproc_per_node=1',
            f'--node_rank={node_rank}', '--rdzv_backend=c10d', f'--rdzv_endpoint=127.0.0.1:{port}',
            script] + args


def run_two_nodes(script, args, timeout=240):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    procs = [subprocess.Popen(multinode_command(r, port, script, args), cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, f"{script}: exit {p.returncode}\n{out[-3000:]}\n{err[-3000:]}"


def flops_per_token(out_dir):
    import torch
    from model import GPT, GPTConfig
    path = os.path.join(out_dir, 'ckpt.pt')
    if not os.path.exists(path):  # the sharded scripts: the model is TINY's on the default data set
        from common.data import load_dataset
        vocab_size = load_dataset('stdlib_char')[1]
        return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=16, block_size=16, bias=False,
                             vocab_size=vocab_size)).flops_per_token()
    return GPT(GPTConfig(**torch.load(path, weights_only=False)['model_args'])).flops_per_token()


def flag(args, key):
    """The last --key=value in args, as an int."""
    return int([a.split('=', 1)[1] for a in args if a.startswith(f'--{key}=')][-1])


def assert_mfu_per_device(out_dir, world_size, args=ARGS):
    """Every logged line's tokens per second is the global batch's tokens (from the flags, not the script's
    own count) over the logged time per iteration, and its MFU that times the whole model's FLOPs per token
    over the world's devices times one device's peak (--peak_flops=1e12)."""
    rows = [r for r in read_log(out_dir) if 'mfu' in r]
    tokens_per_step = flag(args, 'batch_size') * flag(args, 'gradient_accumulation_steps') * \
        flag(args, 'block_size')
    assert rows
    for r in rows:
        assert r['tokens_per_sec'] == pytest.approx(tokens_per_step * 1000 / r['ms'], rel=1e-9), (out_dir, r)
        expected = flops_per_token(out_dir) * r['tokens_per_sec'] / (world_size * 1e12)
        assert r['mfu'] == pytest.approx(expected, rel=1e-9), (out_dir, r)


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    return train_py_reference(ARGS, tmp_path_factory)


def test_train_py_mfu_is_per_device(reference):
    assert_mfu_per_device(reference, 1)


@pytest.mark.parametrize('script', list(SCRIPTS))
def test_two_nodes_train_train_py_curve(reference, tmp_path, script):
    out = str(tmp_path)
    run_two_nodes(script, ARGS + SCRIPTS[script] + [f'--out_dir={out}'])
    assert_same_losses(train_losses(out), train_losses(reference), [0, 1, 2])
    assert_mfu_per_device(out, 2)
    if script == 'train_ddp.py':  # (torch DDP's step is not observed: it logs no per-rank rows)
        return
    # the first step ran with the observer, and its log row says so (its time holds the measuring)
    assert [r.get('observed', False) for r in read_log(out) if 'mfu' in r] == [True, False, False]
    # each rank measures what its own sockets sent, so it works between machines too
    rows = measured_rows(out, 2)
    assert all(r['wire_bytes'] is not None and r['wire_bytes'] > 0 for r in rows), rows
