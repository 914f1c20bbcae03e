"""Helpers for the tests: run a script the way a user does (python or torchrun) and read its log, or run a
function in N gloo processes and gather what each returns."""
import json
import os
import socket
import subprocess
import sys
import traceback

import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny GPT (about 8k parameters, block 16) that every distributed test trains: fast on 2 CPU cores.
TINY = ['--n_layer=2', '--n_head=4', '--n_embd=16', '--block_size=16', '--batch_size=4', '--dropout=0.0',
        '--dtype=float32', '--compile=False', '--eval_iters=2', '--sample_at_end=False', '--device=cpu']


def run_script(script, args, nproc=None, timeout=240, env=None):
    """Run `python script args` (nproc None) or `torchrun --nproc_per_node=nproc script args` from the repo root.
    Returns the CompletedProcess; never raises on a non-zero exit."""
    if nproc is None:
        cmd = [sys.executable, script] + list(args)
    else:
        cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}',
               script] + list(args)
    full_env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', **(env or {}))
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)


def check(proc):
    """Assert a CompletedProcess succeeded, showing its output if not."""
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def read_log(out_dir):
    """The rows of out_dir/log.jsonl."""
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(out_dir):
    """{iter: loss} of the training rows of a log."""
    return {r['iter']: r['loss'] for r in read_log(out_dir) if 'loss' in r and 'rank' not in r}


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS='1')
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group('gloo', rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.destroy_process_group()
        queue.put((rank, 'ok', result))
    except BaseException:
        queue.put((rank, 'error', traceback.format_exc()))


def spawn(fn, world_size, *args, timeout=180):
    """Run fn(rank, world_size, *args) in world_size processes joined in a gloo process group and return the
    list of what each returned (rank order). fn must be a module-level function of an importable module.
    A rank's exception fails the call with that rank's traceback."""
    for attempt in range(3):  # the free port can be taken between picking it and binding it
        port = free_port()
        ctx = mp.get_context('spawn')
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
        for p in procs:
            p.start()
        results, errors = {}, {}
        for _ in range(world_size):
            rank, status, payload = queue.get()
            (results if status == 'ok' else errors)[rank] = payload
        for p in procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
        if errors and attempt < 2 and any('address already in use' in e.lower() for e in errors.values()):
            continue
        if errors:
            rank = min(errors)
            raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
        return [results[r] for r in range(world_size)]
