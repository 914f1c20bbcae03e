"""
What every training loop shares, named once so that each script's main() reads like train.py's: the run's
start (start_run), the LR schedule, autocast, evaluation, MFU, the log line and log.jsonl, the loop itself
(training_loop, with its one seam for a measured step), the closing sample and run_main (a bad input is one
line on every rank). The config is common/config.py's, the data common/data.py's.
"""

import contextlib
import glob
import json
import math
import os
import re
import sys
import threading
import time

import torch
import torch.distributed as dist

from common import distributed
from common.data import EVAL_STREAM, get_batch, get_codec, micro_batch_rows
from common.distributed import added_resident_bytes, is_master, peak_memory_bytes


# Dense (no sparsity) peak FLOP/s of common accelerators by dtype, for MFU; 'float32' is the TF32 tensor-core
# peak where the GPU has one (autocast_context turns TF32 on). A key matches the device name as a whole word,
# so 'L4' is not found inside 'L40S'.
PEAK_FLOPS = {
    # (dense peaks, float32 as TF32: the scripts allow it; the PCIe and NVL cards before the SXM's name)
    'H200 NVL': {'bfloat16': 835e12, 'float16': 835e12, 'float32': 418e12},
    'H200': {'bfloat16': 989e12, 'float16': 989e12, 'float32': 495e12},
    'H100 PCIe': {'bfloat16': 756e12, 'float16': 756e12, 'float32': 378e12},
    'H100 NVL': {'bfloat16': 835e12, 'float16': 835e12, 'float32': 418e12},
    'H100': {'bfloat16': 989e12, 'float16': 989e12, 'float32': 495e12},
    'A100': {'bfloat16': 312e12, 'float16': 312e12, 'float32': 156e12},
    'L40S': {'bfloat16': 362e12, 'float16': 362e12, 'float32': 183e12},
    'A10G': {'bfloat16': 70e12, 'float16': 70e12, 'float32': 35e12},
    'L4': {'bfloat16': 121e12, 'float16': 121e12, 'float32': 60e12},
    'RTX 4090': {'bfloat16': 165e12, 'float16': 165e12, 'float32': 83e12},
    'RTX 3090': {'bfloat16': 71e12, 'float16': 71e12, 'float32': 36e12},
    'V100': {'float16': 125e12, 'float32': 15.7e12},  # no bf16, no TF32
    'T4': {'float16': 65e12, 'float32': 8.1e12},
}


def peak_flops_for(device, dtype, override=None, device_name=None):
    """The peak FLOP/s of one device that MFU divides by: the peak_flops config key if set, else the table,
    else None (a CPU's peak is not known here: set --peak_flops to see MFU on one)."""
    if override:
        return override
    if device.startswith('cuda') or device_name:
        name = device_name or torch.cuda.get_device_name(device)
        for key, by_dtype in PEAK_FLOPS.items():
            if re.search(rf'(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])', name):
                return by_dtype.get(dtype)
    return None


def mfu(flops_per_token, tokens_per_sec, n_devices, peak_flops):
    """Model FLOPs utilisation per device: the whole model's training FLOPs per token times the tokens per
    second of the whole run (every rank together), over n_devices devices' peak. None where the peak is
    unknown."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_sec / (n_devices * peak_flops)


def measured_step(iter_num, first_iter, every=0):
    """Whether iteration iter_num is measured: the run's first, and every `every`-th (--measure_every; 0: none
    after the first)."""
    return iter_num == first_iter or (every > 0 and iter_num % every == 0)


# -----------------------------------------------------------------------------
# The loop

def get_lr(it, cfg):
    """Linear warm-up for warmup_iters, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


@torch.no_grad()
def estimate_loss(loss_of, data, cfg, dp=None):
    """Mean loss over eval_iters global batches for each split, by training's one batch rule: evaluation batch
    k is the global batch (batch_size * gradient_accumulation_steps sequences) of (seed, EVAL_STREAM, k), each
    data-parallel rank (dp: their Comm) takes its contiguous slice in micro-batches of batch_size, and one
    all-reduce adds the sums up. So the losses are equal for every strategy, world size and split of the
    batch. loss_of(x, y) returns the mean loss of one micro-batch however the strategy computes it."""
    dp_rank, dp_size = (dp.rank, dp.size) if dp is not None else (0, 1)
    n_micro, global_rows = cfg.gradient_accumulation_steps, cfg.batch_size * cfg.gradient_accumulation_steps
    sums = torch.zeros(2, device=cfg.device)
    for i, split in enumerate(('train', 'val')):
        for k in range(cfg.eval_iters):
            for micro_step in range(n_micro // dp_size):
                x, y = get_batch(data[split], cfg.seed, EVAL_STREAM, k, global_rows, cfg.block_size,
                                 rows=micro_batch_rows(cfg, dp_rank, dp_size, micro_step), device=cfg.device)
                sums[i] += loss_of(x, y).float()
    if dp is not None:
        dp.all_reduce(sums)
    n = cfg.eval_iters * n_micro  # micro-batches of equal size: their mean is the global batch's
    return {'train': sums[0].item() / n, 'val': sums[1].item() / n}


def loss_function(model, ctx):
    """What evaluation calls, loss_of(x, y): the model's mean loss on a batch, under ctx (autocast)."""
    def loss_of(x, y):
        with ctx:
            return model(x, y)[1]
    return loss_of


def autocast_context(device_type, dtype):
    """torch.autocast for bfloat16/float16 on CPU or CUDA; a no-op context for float32. On CUDA, float32
    matmuls run on the TF32 tensor cores, as nanoGPT sets them (so MFU divides by the TF32 peak)."""
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if dtype == 'float32':
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type,
                          dtype={'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype])


def run_shape(shape, cfg, n_params, n_expert=0):
    """The line every training script prints when it starts: the run's shape, in one place. A mixture of
    experts cut into microbatches (pipeline.py, parallel_4d.py) gets a second line: a router sees one
    forward's tokens, so its auxiliary loss and capacity are those of a microbatch's rows (as in any
    pipeline), and the curve is train.py's with that many rows a micro-step (n_expert: the model's, which on a
    resume is the checkpoint's)."""
    rows, m = cfg.batch_size * cfg.gradient_accumulation_steps, getattr(cfg, 'n_microbatches', 1)
    routed = f"{cfg.batch_size // m} row{'s' * (cfg.batch_size // m != 1)}"
    moe = (f"\nnote: a mixture of experts routes each microbatch ({routed}) on its own, its "
           f"auxiliary loss and capacity too: train.py's curve with --batch_size={cfg.batch_size // m} "
           f"--gradient_accumulation_steps={cfg.gradient_accumulation_steps * m}"
           if n_expert and m > 1 else '')
    return (f"run: {shape}; global batch {rows} sequences x {cfg.block_size} tokens = "
            f"{rows * cfg.block_size:,} "
            f"tokens per step; {n_params / 1e6:.2f}M parameters; {cfg.dtype} on {cfg.device}; outputs in "
            f"{cfg.out_dir}/{moe}")


def profiled(cfg):
    """The trace files of --profile, for outputs_line."""
    return ['trace_rank*.json (--profile: open at ui.perfetto.dev)'] if cfg.profile else []


def cpu_busy_elsewhere(seconds=0.2):
    """The cores other processes kept busy over the next `seconds`, while this one sleeps (Linux's /proc/stat:
    the time every core spent running, summed), e.g. 1.9 of 2; None where /proc/stat is not there. The load
    average would lag by a minute and still count the run that just ended."""
    def busy_and_total():
        with open('/proc/stat') as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # (idle and iowait left out)
    try:
        (b0, t0), _, (b1, t1) = busy_and_total(), time.sleep(seconds), busy_and_total()
    except (OSError, ValueError, IndexError):
        return None
    return (os.cpu_count() or 1) * (b1 - b0) / max(t1 - t0, 1)


def busy_cpu_note(device):
    """One line when torch would share a busy CPU: its threads (one per core) wait for one another while other
    work holds the cores, and a step can take 10-20x longer than on an idle machine. torchrun gives each
    process one thread already; this is for a script run alone. None when the CPU is idle enough."""
    if not device.startswith('cpu') or torch.get_num_threads() == 1:
        return None
    busy, cores = cpu_busy_elsewhere(), os.cpu_count() or 1
    if busy is None or busy < 0.5 * cores:
        return None
    return (f"note: this CPU is busy ({busy:.1f} of its {cores} cores running other work) and torch runs "
            f"{torch.get_num_threads()} threads, which wait for one another behind it: expect a much slower "
            "run; OMP_NUM_THREADS=1 in front of the command is often several times faster\n")


def outputs_line(out_dir, *files):
    """The line every training script prints when it ends: where its outputs are. Each of files is a name (a
    pattern) and its words, 'ckpt.pt (the checkpoint)', named only where out_dir holds it: a new run of
    --max_iters=0 (iteration 0 is never saved) names no checkpoint."""
    there = [f for f in files if glob.glob(os.path.join(glob.escape(out_dir), f.split(' ')[0]))]
    return f"done; outputs in {out_dir}/: " + ', '.join(['log.jsonl (every logged row as JSON)', *there])


def log_row(out_dir, row):
    """Append one row to out_dir/log.jsonl and print it as one human line."""
    with open(os.path.join(out_dir, 'log.jsonl'), 'a') as f:
        f.write(json.dumps(row) + '\n')
    if 'val_loss' in row:
        print(f"step {row['iter']}: train loss {row['train_loss']:.4f}, val loss {row['val_loss']:.4f}",
              flush=True)
    elif 'loss' in row:
        mfu = f"{100 * row['mfu']:.2f}%" if row.get('mfu') is not None else 'n/a'
        print(f"iter {row['iter']}: loss {row['loss']:.4f}, lr {row['lr']:.2e}, {row['ms']:.1f} ms, "
              f"{row['tokens_per_sec']:.0f} tok/s, mfu {mfu}, peak mem {row['peak_mem_bytes'] / 2**20:.0f} "
              "MiB" + ('' if row.get('mem_added_bytes') is None else
                       f" ({row['mem_added_bytes'] / 2**20:+.0f} by the run)"),
              flush=True)


def log_rank_rows(out_dir, row):
    """Every rank's row (a collective: each rank passes its own), in rank order; rank 0 appends them to
    out_dir/log.jsonl. Returns the rows on every rank."""
    rows = [row]
    if dist.is_initialized():
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
    if is_master():
        with open(os.path.join(out_dir, 'log.jsonl'), 'a') as f:
            f.writelines(json.dumps(r) + '\n' for r in rows)
    return rows


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group['lr'] = lr


def should_evaluate(iter_num, cfg):
    return iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters or cfg.eval_only


def evaluate(loss_of, model, data, cfg, iter_num, lr, dp=None):
    """estimate_loss with the model in eval mode (no dropout), logged by rank 0. Every rank must call it (the
    data-parallel ranks share the batches). A loss that is not finite stops the run, keeping the last
    checkpoint."""
    model.eval()
    losses = estimate_loss(loss_of, data, cfg, dp)
    model.train()
    if is_master():
        log_row(cfg.out_dir, {'iter': iter_num, 'train_loss': losses['train'], 'val_loss': losses['val'],
                              'lr': lr})
    if not math.isfinite(losses['val']):
        raise SystemExit(f"error: val loss is {losses['val']} at iter {iter_num}; kept the last checkpoint")
    return losses


def should_save(iter_num, val_loss, best_val_loss, cfg):
    """nanoGPT's rule (after iteration 0: a better val loss, or always_save_checkpoint), but an
    evaluation-only run writes nothing: the checkpoint it evaluated stays as it was (on another world size,
    rewritten, it would keep only this run's random streams, and a resume would not continue the run)."""
    return iter_num > 0 and not cfg.eval_only and (val_loss < best_val_loss or cfg.always_save_checkpoint)


class StepLogger:
    """The line logged every log_interval iterations: the time per iteration since the last line (host clock,
    after the loss's .item() has waited for the device), tokens per second of the whole run, MFU per device,
    peak memory. Every iteration it checks that the loss is finite."""

    def __init__(self, cfg, flops_per_token, n_devices):
        self.cfg, self.flops_per_token, self.n_devices = cfg, flops_per_token, n_devices
        self.peak = peak_flops_for(cfg.device, cfg.dtype, cfg.peak_flops)
        self.tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
        self.every = min(cfg.log_interval, max(1, cfg.max_iters // 10))  # a short run logs ~10 lines too
        self.restart()

    def restart(self):
        """Time afresh from now (after an evaluation: eval time is not training time)."""
        self.t_last, self.iters, self.observed = time.time(), 0, False

    def step(self, iter_num, loss, lr, observed=False):
        """observed: the step ran with a measuring observer, whose work is in its time (its row says so)."""
        if not math.isfinite(loss):
            raise SystemExit(f"error: loss is {loss} at iter {iter_num}; stopped, the last checkpoint kept")
        self.iters, self.observed = self.iters + 1, self.observed or observed
        if iter_num % self.every == 0 and is_master():
            flag = {'observed': True} if self.observed else {}  # (before restart clears it)
            dt = (time.time() - self.t_last) / self.iters
            self.restart()
            tokens_per_sec = self.tokens_per_iter / dt
            log_row(self.cfg.out_dir, {'iter': iter_num, 'loss': loss, 'lr': lr, 'ms': 1000 * dt,
                                       'tokens_per_sec': tokens_per_sec,
                                       'mfu': mfu(self.flops_per_token, tokens_per_sec, self.n_devices,
                                                  self.peak),
                                       'peak_mem_bytes': peak_memory_bytes(self.cfg.device),
                                       'mem_added_bytes': self.added_memory(), **flag})

    def added_memory(self):
        """On a CPU, what the run added to the process's resident set (distributed.added_resident_bytes):
        where ZeRO's saving shows. None on a GPU, whose peak (the allocator's) holds only the run's tensors
        already."""
        return None if self.cfg.device.startswith('cuda') else added_resident_bytes()


def observer_for(run, cfg, iter_num, first_iter):
    """The observer of a step that measured_step names (common/observe.py's measured_step, imported only
    then): it runs the step, reads what the strategy holds and sends (run.kind says which parts of run it
    reads) and prints the report. None for every other step, and for a measured one where the measuring files
    were not copied."""
    if getattr(run, 'kind', None) is None or not measured_step(iter_num, first_iter, cfg.measure_every):
        return None
    try:
        import common.observe
    except ModuleNotFoundError as e:  # a script copied without the measuring files trains on, unmeasured
        if not (e.name or '').startswith('common.'):
            raise
        if is_master():
            print(f"(iter {iter_num} not measured: {e.name.replace('.', '/')}.py is not here)")
        return None
    return common.observe.measured_step


def run_step(run, cfg, iter_num, first_iter):
    """One iteration, run.step(iter_num), observed where observer_for names an observer. Returns (the loss,
    whether it was observed: its time holds the observer's work)."""
    observe = observer_for(run, cfg, iter_num, first_iter)
    return (run.step(iter_num) if observe is None else observe(run, cfg, iter_num)), observe is not None


def step_profiler(cfg, rank):
    """--profile=N: N steps under torch.profiler, a trace per rank (common/measure.py's StepProfiler, imported
    only then); None without."""
    if not cfg.profile:
        return None
    from common.measure import StepProfiler
    return StepProfiler(cfg.profile, cfg.out_dir, rank, cfg.device)


def training_loop(cfg, run, iter_num, best_val_loss):
    """train.py's loop, for every other script: set the LR, evaluate and checkpoint every eval_interval, one
    train step, its log line, until max_iters. What differs from script to script comes in `run`, a namespace
    of: model, optimizer (a torch optimizer whose LR it sets, or None), loss_of(x, y) (evaluation), dp (the
    data-parallel Comm that shares the evaluation, or None), data, step(iter_num) -> the mean loss (one
    iteration), save(iter_num, best_val_loss), flops_per_token, n_devices, rank; and for the measured steps
    (run_step) kind and what that kind's observer reads. Returns (iter_num, best_val_loss) when it stops."""
    profiler = step_profiler(cfg, run.rank)  # --profile=N: a trace per rank
    logger, first_iter = StepLogger(cfg, run.flops_per_token, run.n_devices), iter_num
    while True:
        lr = get_lr(iter_num, cfg)
        if run.optimizer is not None:  # (a script with an optimizer of its own takes get_lr in its step)
            set_lr(run.optimizer, lr)
        # evaluate, and checkpoint the state from which iteration iter_num starts
        if should_evaluate(iter_num, cfg):
            losses = evaluate(run.loss_of, run.model, run.data, cfg, iter_num, lr, run.dp)
            if should_save(iter_num, losses['val'], best_val_loss, cfg):
                best_val_loss = min(best_val_loss, losses['val'])
                run.save(iter_num, best_val_loss)
            logger.restart()
        if iter_num == cfg.max_iters or cfg.eval_only:
            break
        loss, observed = run_step(run, cfg, iter_num, first_iter)  # (observed: its log row says so)
        logger.step(iter_num, loss, lr, observed)  # one iteration, its log line
        if profiler:
            profiler.step()
        iter_num += 1
    if profiler:
        profiler.stop()
    return iter_num, best_val_loss


def print_sample(model, cfg, ctx, show=True, hint='python sample.py --out_dir={out_dir}'):
    """200 characters sampled from the trained model (every rank of a sharded model must take part; the ones
    with show print it), and how to sample more. A short run (under 100 iterations) has learned too little to
    be worth the time: it only says how."""
    if cfg.max_iters < 100:
        if show:
            print(f"(no sample after {cfg.max_iters} iterations; to sample: "
                  f"{hint.format(out_dir=cfg.out_dir)})")
        return
    encode, decode = get_codec(cfg.dataset)
    model.eval()
    start = torch.tensor([encode('\n')], dtype=torch.long, device=cfg.device)
    with ctx:
        text = decode(model.generate(start, 200, temperature=0.8, top_k=200)[0].tolist())
    if show:
        print(f"---------- a sample ----------\n{text}\n------------------------------")
        print(f"sample more with: {hint.format(out_dir=cfg.out_dir)}")


def record_for_torchrun(message, callstack):
    """Leave the rank's error where torchrun's closing summary reads it (TORCHELASTIC_ERROR_FILE, the format
    of torch.distributed.elastic's @record), so the user's last screen says what went wrong, not only an exit
    code."""
    path = os.environ.get('TORCHELASTIC_ERROR_FILE')
    if path:
        with open(path, 'w') as f:
            json.dump({'message': {'message': message, 'extraInfo': {'py_callstack': callstack,
                                                                     'timestamp': str(int(time.time()))}}}, f)


def first_sentence(error):
    """An exception's first sentence, for a one-line error (a library's messages run to paragraphs): its first
    line up to a full stop before a capital (not a '. ' inside a path: 'runs. old/ckpt.pt')."""
    return re.split(r'\.\s+(?=[A-Z])', (str(error).splitlines() or [''])[0])[0]


def run_main(main):
    """Run main(argv) and turn a config error into one line on stderr and exit code 1 (on every rank); under
    torchrun that line, or an unexpected error's traceback, is also what torchrun's summary shows."""
    try:
        main(sys.argv[1:])
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        rank = os.environ.get('RANK')
        line = (f"[rank {rank}] " if rank is not None else '') + e.code + '\n'
        # the whole line in one write: the ranks share one stderr pipe, and print() writes the text and its
        # newline in two, which (unbuffered, as under PYTHONUNBUFFERED) lets two ranks' lines run together
        sys.stderr.write(line)
        sys.stderr.flush()
        record_for_torchrun(e.code, line)
        # an error found after joining (e.g. on resume): the group torn down here, with every rank still in it
        if dist.is_initialized() and distributed._GROUP_IS_OURS:
            dist.destroy_process_group()
        exit_run(1, main)
    except Exception as e:
        import traceback
        lost = lost_rank_line(e)
        record_for_torchrun(lost or f"{type(e).__name__}: {e}", lost or traceback.format_exc())
        if lost is None:
            raise
        sys.stderr.write((f"[rank {os.environ['RANK']}] " if 'RANK' in os.environ else '') + lost + '\n')
        exit_run(1, main)  # (no teardown of the group: its other end is gone)
    exit_run(0, main)


def lost_rank_line(error):
    """One line for a rank whose peer died (killed, out of memory) or never joined, where the collective's
    traceback would bury the first rank's own message (torchrun's summary names that rank); None for any
    other error, whose traceback is the message."""
    text = str(error)
    if 'Connection reset by peer' in text or 'Connection closed by peer' in text:
        return ("error: another rank of this run stopped (gloo: the connection to it was closed), so this "
                "one stops too: that rank's own message, or torchrun's summary, says why")
    if type(error).__name__ == 'DistStoreError' and 'Timed out' in text and not distributed.JOINED:
        return f"error: not every rank joined within --dist_timeout ({text.splitlines()[0]})"
    return None


def exit_run(code, main):
    """Exit a run with code. A script's run (main is its __main__'s) that joined a process group leaves
    without the interpreter's teardown (os._exit), once its other threads (a checkpoint being written) have
    ended and its output is flushed: that teardown destroys torch's C++ threads too, and one destroyed out of
    order can abort the finished process ('terminate called without an active exception', seen under a busy
    machine's load). Called from elsewhere (a test, a notebook), it raises SystemExit as usual."""
    if not distributed.JOINED or getattr(sys.modules['__main__'], 'main', None) is not main:
        sys.exit(code)
    for thread in threading.enumerate():  # (what the interpreter's own exit waits for)
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def make_out_dir(cfg):
    """out_dir, made if missing. A new run (not a resume) starts out_dir/log.jsonl afresh: its rows are this
    run's alone (rank 0 writes it)."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    if cfg.init_from != 'resume' and is_master():
        open(os.path.join(cfg.out_dir, 'log.jsonl'), 'w').close()


def start_run(cfg):
    """A parallel script's start, its config checked: join torchrun's process group (cfg.device becomes this
    rank's GPU under torchrun), make out_dir, seed torch (every rank builds the same weights). Returns (rank,
    world_size)."""
    rank, _, world_size, device = distributed.init_distributed(cfg.dist_timeout)
    cfg.device = device if world_size > 1 else cfg.device
    make_out_dir(cfg)
    torch.manual_seed(cfg.seed)
    return rank, world_size
