"""Helpers for the tests: run a script the way a user does (python or torchrun) and read its log, or run a
function in N gloo processes and gather what each returns."""
import json
import os
import socket
import subprocess
import sys
import traceback

import pytest
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny GPT (about 8k parameters, block 16) that every distributed test trains: fast on 2 CPU cores.
TINY = ['--n_layer=2', '--n_head=4', '--n_embd=16', '--block_size=16', '--batch_size=4', '--dropout=0.0',
        '--dtype=float32', '--compile=False', '--eval_iters=2', '--sample_at_end=False', '--device=cpu']


def stdlib_vocab():
    """The vocabulary of the data set the scripts train on by default (stdlib_char: the characters of this
    Python's standard library; 96 with 3.11, built on first use): a test that prices a run's logits needs it."""
    from common.data import load_dataset
    return load_dataset('stdlib_char')[1]


def run_script(script, args, nproc=None, timeout=240, env=None):
    """Run `python script args` (nproc None) or `torchrun --nproc_per_node=nproc script args` from the repo root.
    Returns the CompletedProcess; never raises on a non-zero exit. A run past timeout seconds (a hang) fails the
    test, with the output so far."""
    if nproc is None:
        cmd = [sys.executable, script] + list(args)
    else:
        cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}',
               script] + list(args)
    full_env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', **(env or {}))
    try:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b'')[-3000:], (e.stderr or b'')[-3000:]
        raise AssertionError(f"{' '.join(cmd[1:])} did not finish within {timeout} s (a hang?)\n"
                             f"stdout:\n{out[0]!r}\nstderr:\n{out[1]!r}") from None


def check(proc):
    """Assert a CompletedProcess succeeded, showing its output if not."""
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def one_error_line_per_rank(proc, key, script, nproc=2):
    """A run stopped by bad input: a non-zero exit, on each rank one line 'error: ...' that names the key (the
    rank's own line: torchrun's summary may quote it again, indented), and no traceback from the script. A rank
    still importing torch when another has refused is stopped by torchrun (SIGTERM) before it reaches the
    check: then the summary says so, and the first failure it names is the line."""
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.startswith('[rank ') and '] error: ' in l]
    ranks = sorted(l.split(']')[0] for l in lines)
    assert ranks and set(ranks) <= {f'[rank {r}' for r in range(nproc)}, proc.stderr[-3000:]
    assert len(ranks) == len(set(ranks)), lines
    if len(ranks) < nproc:
        assert proc.stderr.count('(SIGTERM)') >= nproc - len(ranks), proc.stderr[-3000:]
    assert all(key in l for l in lines), lines
    assert f'{script}", line' not in proc.stderr, proc.stderr[-3000:]


def read_log(out_dir):
    """The rows of out_dir/log.jsonl."""
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f if line.strip()]


def measured_rows(out_dir, world_size):
    """The log's measured rows (a row per rank and measured step; not a grid's rows of coordinates), with every
    rank's there: a loop over them checks something only if the run measured at all."""
    rows = [r for r in read_log(out_dir) if 'rank' in r and 'iter' in r]
    assert sorted({r['rank'] for r in rows}) == list(range(world_size)), (out_dir, rows)
    return rows


def train_losses(out_dir):
    """{iter: loss} of the training rows of a log."""
    return {r['iter']: r['loss'] for r in read_log(out_dir) if 'loss' in r and 'rank' not in r}


def eval_losses(out_dir):
    """{iter: (train_loss, val_loss)} of the evaluation rows of a log."""
    return {r['iter']: (r['train_loss'], r['val_loss']) for r in read_log(out_dir) if 'val_loss' in r}


def assert_same_losses(got, want, iters=None, rel=1e-5):
    """The repo's one test of "the same loss curve": got and want are {iter: loss (or a tuple of losses)}; the
    iterations logged must be `iters` (default: want's), each loss within rel of want's. fp32 and dropout 0: only
    the summation order (over ranks, shards, buckets) differs, which moves the last digits."""
    iters = sorted(want) if iters is None else list(iters)
    assert sorted(got) == iters, f"logged iterations {sorted(got)}, expected {iters}"
    for i in iters:
        assert got[i] == pytest.approx(want[i], rel=rel), f"iter {i}: {got[i]} vs train.py's {want[i]}"


def assert_same_checkpoint(got, want, atol=1e-5):
    """Two train.py-format checkpoints (paths or loaded dicts): the same iteration, parameters and AdamW state
    (position by position). Parameters to 1e-5 = 1/1000 of one step at lr 1e-2: AdamW divides by sqrt(v), so on
    an element whose gradient is nearly zero the rounding of another summation order grows to ~1e-6..1e-5."""
    import torch
    got, want = (torch.load(c, map_location='cpu', weights_only=False) if isinstance(c, (str, os.PathLike)) else c
                 for c in (got, want))
    assert got['iter_num'] == want['iter_num']
    assert got['model'].keys() == want['model'].keys()
    for k in want['model']:
        torch.testing.assert_close(got['model'][k], want['model'][k], atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")
    assert got['optimizer']['state'].keys() == want['optimizer']['state'].keys()
    steps = [s['step'] for s in got['optimizer']['state'].values()]  # one tensor shared by every parameter would
    assert len({id(t) for t in steps}) == len(steps), "parameters share one AdamW step tensor"  # advance n times
    for i, state in want['optimizer']['state'].items():
        for k in ('exp_avg', 'exp_avg_sq'):
            # absolute 1e-6, or 1e-4 of the tensor's largest value where that is smaller: the second moment is
            # a squared gradient, often all below 1e-6, where a fixed 1e-6 would pass zeros or 3x the value
            atol = min(1e-6, 1e-4 * state[k].abs().max().item())
            torch.testing.assert_close(got['optimizer']['state'][i][k], state[k], atol=atol, rtol=1e-4,
                                       msg=lambda m: f"optimizer state {i} {k}: {m}")
        assert float(got['optimizer']['state'][i]['step']) == float(state['step'])
    assert [len(g['params']) for g in got['optimizer']['param_groups']] == \
        [len(g['params']) for g in want['optimizer']['param_groups']]


def assert_config_error(main, argv, world_size, message, monkeypatch):
    """main(argv) run as one of world_size ranks would run it, before any process group exists: it must stop with
    one line that starts with 'error:' and says message."""
    monkeypatch.setenv('WORLD_SIZE', str(world_size))
    with pytest.raises(SystemExit) as e:
        main(argv)
    code = e.value.code
    assert isinstance(code, str) and code.startswith('error:') and message in code and '\n' not in code, code


def refusals_of(script):
    """A model-parallel script's table of refusals (common/model_parallel.py) as check(cfg, world_size), given
    what the script's main gives it: its rank files, its schedules."""
    import importlib
    from common import model_parallel as mp
    s = importlib.import_module(script)
    return {'tensor_parallel': lambda cfg, world: mp.check_tensor_parallel(cfg, world, s.RANK_FILE),
            'pipeline': lambda cfg, world: mp.check_pipeline(cfg, world, s.STAGE_FILE, s.SCHEDULES),
            'context_parallel': mp.check_context_parallel,
            'expert_parallel': lambda cfg, world: mp.check_expert_parallel(cfg, world, s.RANK_FILE),
            'parallel_4d': lambda cfg, world: mp.check_parallel_4d(cfg, world, s.RANK_FILE, s.run_grid,
                                                                   s.SCHEDULES)}[script]


_TRAIN_PY_RUNS = {}


def train_py_reference(args, tmp_path_factory):
    """The out_dir of `python train.py args`, run once per pytest run for each distinct argument list (several
    test files compare against the same reference). Read it; never resume or write in it."""
    key = tuple(args)
    if key not in _TRAIN_PY_RUNS:
        out = str(tmp_path_factory.mktemp('train_py'))
        _TRAIN_PY_RUNS[key] = run_train_py_here(list(args) + [f'--out_dir={out}'])
    return _TRAIN_PY_RUNS[key]


def run_train_py_here(argv):
    """train.py's main in this process (no interpreter and torch to start: ~3 s less than a subprocess), on
    one thread as run_script's processes run; its printing swallowed. Returns its out_dir."""
    import contextlib
    import io
    import torch
    import train
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            train.main(argv)
    finally:
        torch.set_num_threads(threads)
    return next(a.split('=', 1)[1] for a in reversed(argv) if a.startswith('--out_dir='))


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


# On Linux a rank starts as a fork of a server that imported torch once (multiprocessing's forkserver), not as a
# fresh interpreter that imports it again (~1 s of a core a rank, ~4 s a 4-rank world on 2 cores). Elsewhere as a
# fresh interpreter: Windows has no fork, and on macOS a fork after system frameworks are loaded can crash (why
# Python spawns there by default). Each rank still gets this process's environment, working directory and
# sys.path as they are at the call, as a spawned one does.
START_METHOD = 'forkserver' if sys.platform.startswith('linux') else 'spawn'
mp.set_forkserver_preload(['torch', 'torch.distributed'])


def _worker(rank, world_size, port, fn, args, queue, timeout, dump_dir, environ):
    os.environ.clear()
    os.environ.update(environ)  # (the caller's, at the call: the fork server keeps the one it started with)
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS='1')
    import datetime
    import faulthandler
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    # a rank stuck in a collective writes every thread's stack to its dump file before the parent gives up
    dump = open(os.path.join(dump_dir, f'rank{rank}.txt'), 'w')
    faulthandler.dump_traceback_later(max(1, timeout - 10), exit=False, file=dump)
    try:
        dist.init_process_group('gloo', rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        dist.destroy_process_group()
        queue.put((rank, 'ok', result))
    except BaseException:
        queue.put((rank, 'error', traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()


def spawn(fn, world_size, *args, timeout=180):
    """Run fn(rank, world_size, *args) in world_size processes joined in a gloo process group and return the
    list of what each returned (rank order). fn must be a module-level function of an importable module.
    A rank's exception fails the call with that rank's traceback; a hang (a deadlocked collective) fails it
    after timeout seconds with every rank's stacks, and the ranks are killed."""
    import queue as queue_module
    import tempfile
    for attempt in range(3):  # the free port can be taken between picking it and binding it
        port = free_port()
        ctx = mp.get_context(START_METHOD)
        results_queue = ctx.Queue()
        dump_dir = tempfile.mkdtemp(prefix='spawn_dumps_')
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results_queue, timeout, dump_dir,
                                                   dict(os.environ)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results, errors = {}, {}
        try:
            for _ in range(world_size):
                rank, status, payload = results_queue.get(timeout=timeout)
                (results if status == 'ok' else errors)[rank] = payload
        except queue_module.Empty:
            for p in procs:
                p.kill()
            stacks = ''.join(f"\n--- rank {r} ---\n" + open(os.path.join(dump_dir, f'rank{r}.txt')).read()[-3000:]
                             for r in range(world_size) if r not in results and r not in errors)
            raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(results) - set(errors))} did not "
                                 f"finish within {timeout} s (a hang?); their stacks:{stacks}")
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
        if errors and attempt < 2 and any('address already in use' in e.lower() for e in errors.values()):
            continue
        if errors:
            rank = min(errors)
            raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
        return [results[r] for r in range(world_size)]


class LoopbackFlood:
    """Other traffic on this machine while a test measures wire bytes: a thread of the test process pushes bytes
    through a TCP connection on 127.0.0.1 (about rate bytes/s, for at most max_s seconds) until the block ends.
    The machine's loopback counter sees it; a rank's own sockets must not. `sent` is what the flood pushed."""

    def __init__(self, rate=20_000_000, max_s=300):
        import threading
        self.rate, self.max_s, self.sent, self.stopped = rate, max_s, 0, threading.Event()
        self.server = socket.create_server(('127.0.0.1', 0))
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._drain, self._push)]

    def _drain(self):
        conn, _ = self.server.accept()
        with conn:
            while conn.recv(1 << 16):
                pass

    def _push(self):
        import time
        chunk, t0 = b'x' * (1 << 16), time.monotonic()
        with socket.create_connection(self.server.getsockname()) as conn:
            while not self.stopped.is_set() and time.monotonic() - t0 < self.max_s:
                conn.sendall(chunk)
                self.sent += len(chunk)
                self.stopped.wait(len(chunk) / self.rate)  # a bounded rate: the test's ranks need the cores

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        for t in self.threads:
            t.join(10)
        self.server.close()


def counting_patches(calls, targets):
    """For the tests that an unmeasured step makes no measuring call: mock patches of distributed.Comm.count
    (each collective a Comm is handed, as 'comm <group> <kind>') and of each (module, attribute, label) in
    targets (calls[label] += 1, then the real call). Enter them, run a step, read calls."""
    from unittest import mock
    from common import distributed

    def counted(label, f):
        def wrapper(*args, **kwargs):
            calls[label] += 1
            return f(*args, **kwargs)
        return wrapper
    count = distributed.Comm.count
    patches = [mock.patch.object(distributed.Comm, 'count', lambda self, kind, *a, **k: (
        calls.update([f'comm {self.name} {kind}']), count(self, kind, *a, **k))[1])]
    return patches + [mock.patch.object(m, n, counted(label, getattr(m, n))) for m, n, label in targets]


def measuring_calls():
    """The calls that exist only to measure, as counting_patches targets: barriers, object gathers, device
    synchronizes and clocks."""
    import time
    import torch
    import torch.distributed as dist
    return [(dist, 'barrier', 'barrier'), (dist, 'all_gather_object', 'all_gather_object'),
            (torch.cuda, 'synchronize', 'synchronize'), (time, 'perf_counter', 'clock'), (time, 'time', 'clock')]


def measuring_calls_per_step(rank, world_size, module, argv):
    """In each spawned rank: module.main(argv) as a user runs it, with every call that exists only to measure
    (measuring_calls) counted inside each step the training loop runs (training.run_step: the script's own
    step, and on a measured step the observer around it and its report). Returns one {label: count} per step,
    in order."""
    import contextlib
    import importlib
    from collections import Counter
    from unittest import mock
    from common import training
    script, calls, per_step = importlib.import_module(module), Counter(), []
    run_step = training.run_step

    def counted_step(*args):
        calls.clear()
        loss_and_observed = run_step(*args)
        per_step.append({k: v for k, v in calls.items() if not k.startswith('comm ')})
        return loss_and_observed
    with contextlib.ExitStack() as stack:
        for p in counting_patches(calls, measuring_calls()) + [mock.patch.object(training, 'run_step',
                                                                                 counted_step)]:
            stack.enter_context(p)
        script.main(argv)
    return per_step
