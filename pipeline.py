"""
Pipeline parallelism: train.py with the model's blocks split over pp stages, written by hand with point-to-point
send/recv. Stage 0 holds the embedding, the last stage the final norm, head and loss; each micro-step's batch is
cut into n_microbatches that flow through the stages. Two schedules, each one straight-line function below:
GPipe (all forwards, then all backwards) and 1F1B (warm-up, one forward one backward, cool-down).
Composes with data parallelism: world = dp x pp.

    torchrun --nproc_per_node=2 pipeline.py --pp=2 --schedule=1f1b --n_microbatches=4
    torchrun --nproc_per_node=4 pipeline.py --pp=2 --gradient_accumulation_steps=2   # dp=2 x pp=2
    python consolidate.py out out_full             # out's stage checkpoints -> out_full/ckpt.pt, train.py's format

At the end it prints the schedule each stage actually executed, as a timeline from the clock, with the measured
bubble fraction beside (p-1)/(m+p-1) and the peak number of microbatches whose activations the stage held.
"""

import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from formulas import bubble_fraction_formula, p2p_comm_bytes_formula, peak_microbatches_formula
from model import init_params, keep_own, materialize
from training import (StepLogger, autocast_context, check_batch, config_defaults, configure, evaluate, get_lr,
                      load_dataset, log_row, micro_batches, outputs_line, profiled, run_main, run_shape,
                      set_lr, should_evaluate, should_save)
from checkpoints import (CheckpointWriter, gather_rng_states, init_model, restore_rng, seed_dropout,
                         train_checkpoint)
from distributed import Comm, finish_distributed, init_distributed, process_grid, world_size_from_env
from measure import (StepProfiler, WireMeter, comm_report, op_label, saved_bytes_counter, time_split, timeline,
                     write_schedule_trace)

# -----------------------------------------------------------------------------
# config: train.py's keys (training.TRAIN_DEFAULTS; `--help` lists them all), and these
init_from = 'scratch'           # 'scratch' or 'resume' (out_dir/ckpt_stage{r}.pt)
sample_at_end = False           # (no sampling here: consolidate, then python sample.py)
dist_timeout = 60               # seconds before a rank gives up on a dead peer
# pipeline
pp = 2                          # pipeline stages; world size = dp * pp
schedule = '1f1b'               # 'gpipe', '1f1b' or 'interleaved' (Megatron's interleaved 1F1B)
virtual_stages = 1              # interleaved: model chunks per rank (each rank holds v non-adjacent groups of layers)
n_microbatches = 4              # microbatches per micro-step: batch_size sequences cut into this many
config = config_defaults(globals())
# -----------------------------------------------------------------------------


def validate(cfg, world_size):
    """Every bad combination, before any work (the same on every rank)."""
    check_schedule(cfg)
    if cfg.pp < 1 or world_size % cfg.pp != 0:
        raise SystemExit(f"error: world size {world_size} is not divisible by pp={cfg.pp} (world = dp x pp)")
    check_batch(cfg, world_size // cfg.pp, world_size)
    if cfg.n_layer % (cfg.pp * cfg.virtual_stages) != 0:
        raise SystemExit(f"error: n_layer ({cfg.n_layer}) must be divisible by pp ({cfg.pp}) x virtual_stages "
                         f"({cfg.virtual_stages}): each stage gets n_layer/pp blocks, in virtual_stages chunks")
    if cfg.batch_size % cfg.n_microbatches != 0:
        raise SystemExit(f"error: batch_size ({cfg.batch_size}) must be divisible into n_microbatches "
                         f"({cfg.n_microbatches}) equal microbatches")
    if cfg.schedule == '1f1b' and cfg.n_microbatches < cfg.pp:
        raise SystemExit(f"error: 1f1b needs n_microbatches ({cfg.n_microbatches}) >= pp ({cfg.pp}) to fill the "
                         f"pipeline")
    if cfg.schedule == 'interleaved' and cfg.n_microbatches % cfg.pp:
        raise SystemExit(f"error: interleaved needs n_microbatches ({cfg.n_microbatches}) to be a multiple of pp "
                         f"({cfg.pp}): the microbatches go through the chunks in groups of pp")
    if cfg.dtype not in ('float32', 'bfloat16'):
        raise SystemExit(f"error: pipeline.py trains in float32 or bfloat16, got dtype={cfg.dtype!r} (float16 would "
                         f"need one loss scale agreed by every stage)")
    check_no_compile(cfg, 'pipeline.py')
    check_resume_grid(cfg, {'pp': cfg.pp, 'virtual_stages': cfg.virtual_stages}, stage_ckpt_path(cfg.out_dir, 0))


def check_schedule(cfg):
    """The schedule's keys, checked before any other (the others divide by them); parallel_4d.py checks them too."""
    if cfg.schedule not in SCHEDULES:
        raise SystemExit(f"error: --schedule={cfg.schedule} is not one of {', '.join(SCHEDULES)}")
    if cfg.virtual_stages < 1 or (cfg.virtual_stages > 1 and cfg.schedule != 'interleaved'):
        raise SystemExit(f"error: --virtual_stages={cfg.virtual_stages} must be 1, or more with "
                         f"--schedule=interleaved (got --schedule={cfg.schedule})")
    if cfg.virtual_stages > 1 and cfg.pp == 1:  # (pp < 1 is the world-size check's)
        raise SystemExit(f"error: --virtual_stages={cfg.virtual_stages} needs pp >= 2: the chunks pass activations "
                         f"round the ring of stages, and with pp=1 a stage's neighbour is itself; use "
                         f"--virtual_stages=1")
    if cfg.n_microbatches < 1:
        raise SystemExit(f"error: --n_microbatches={cfg.n_microbatches} must be at least 1")


def check_no_compile(cfg, script):
    """torch.compile is not wired into the sharded scripts: say so rather than ignore it."""
    if cfg.compile:
        raise SystemExit(f"error: --compile=True is not supported by {script}: pass --compile=False (a config file "
                         f"that sets compile = True needs it after the file)")


def check_resume_grid(cfg, grid, ckpt_path):
    """init_from=resume: the saved files must be cut as this run cuts the model (grid: {key: this run's value}),
    else loading them fails deep in load_state_dict. The first file tells (memory-mapped: little is read); its
    'grid', else its config (a file written before 'grid' was saved)."""
    if cfg.init_from != 'resume' or not os.path.exists(ckpt_path):
        return  # (a missing file is init_model's to report, on every rank)
    checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=False, mmap=True)
    saved = checkpoint.get('grid', checkpoint['config'])
    saved = {k: saved[k] for k in grid if k in saved}
    if saved != {k: grid[k] for k in saved}:
        def as_flags(g):
            return ' '.join(f"--{k}={v}" for k, v in g.items() if k != 'ranks') + \
                (f" on {g['ranks']} ranks" if 'ranks' in g else '')
        raise SystemExit(f"error: init_from=resume: {ckpt_path} was saved with {as_flags(saved)}, this run has "
                         f"{as_flags(grid)}: resume with the saved ones, or python consolidate.py {cfg.out_dir} "
                         f"makes one ckpt.pt, which train.py, train_ddp.py, zero.py, train_fsdp.py and "
                         f"context_parallel.py continue from on any number of ranks")


def embed_comm(grid, rank, tied):
    """With tied embeddings and pp > 1: the group {first stage, last stage} of this rank's pipeline, which holds the
    tied weight's two copies (None without). Every rank creates every pair's group, in one order."""
    if not tied or grid.size(1) == 1:
        return None
    pipelines = grid.movedim(1, -1).reshape(-1, grid.size(1))  # each row one pipeline's ranks, stage by stage
    comm = None
    for row in pipelines.tolist():
        group = dist.new_group([row[0], row[-1]])
        if rank in (row[0], row[-1]):
            comm = Comm(group, 'embed')
    return comm


def keep_stage(model, stage, pp_size, virtual_stages=1):
    """Cut the full GPT down to this stage's part, in place: its n_layer/pp blocks (the others become Identity, so
    parameter names stay the full model's and the stage checkpoints merge by name), the embedding on the first
    stage, ln_f and lm_head on the last. With tied embeddings and pp > 1 the first stage's wte and the last stage's
    lm_head are two copies of the one weight, kept equal by summing their gradients (as Megatron does).
    Returns the stage's chunks of layers: one, or with virtual stages v, the v non-adjacent chunks of the
    interleaved schedule (chunk c of stage r is virtual stage c·pp + r)."""
    n = model.config.n_layer // (pp_size * virtual_stages)
    chunks = [range((c * pp_size + stage) * n, (c * pp_size + stage + 1) * n) for c in range(virtual_stages)]
    for i in range(model.config.n_layer):
        if not any(i in chunk for chunk in chunks):
            model.transformer.h[i] = torch.nn.Identity()
    if stage != 0:
        model.transformer['wte'] = None
        model.transformer['wpe'] = None
    if stage != pp_size - 1:
        model.transformer['ln_f'] = None
        model.lm_head = None
    return chunks


class Clock:
    """The step's clock: the device's own on a GPU (CUDA events; kernels run after the host has moved on, so the
    host clock would time their launches), the host's on a CPU. mark() stamps now; seconds() reads the gaps once
    the step is over, after one synchronize."""

    def __init__(self, device):
        self.cuda = device.startswith('cuda')

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end):
        return start.elapsed_time(end) / 1000 if self.cuda else end - start

    def synchronize(self):
        if self.cuda:
            torch.cuda.synchronize()


class Stage:
    """What one pipeline stage knows: its part of the model, its neighbours, the shape of what crosses the
    boundary, and the record of what it executed and held during the last schedule."""

    def __init__(self, model, chunks, index, pp_size, grid_row, act_shape, device, ctx, pp_comm):
        self.model, self.chunks, self.index, self.pp = model, chunks, index, pp_size
        self.is_first, self.is_last = index == 0, index == pp_size - 1  # holds the embedding / the head and loss
        # neighbours: with chunks, a ring (the last stage's chunk c feeds the first stage's chunk c + 1)
        ring = len(chunks) > 1
        self.prev_rank = None if self.is_first and not ring else int(grid_row[(index - 1) % pp_size])
        self.next_rank = None if self.is_last and not ring else int(grid_row[(index + 1) % pp_size])
        self.act_shape, self.device, self.ctx, self.comm = act_shape, device, ctx, pp_comm
        # the first chunk's embedding and the last chunk's head and loss: the model's own, unless another
        # parallelism brings its own (parallel_4d.py: vocabulary-parallel, on this rank's part of the sequence)
        self.embed, self.head = model.embed, model.head
        self.clock = Clock(device)
        self.held = {}            # microbatch (and chunk) -> (input, output): activations whose graph is alive
        self.held_bytes = {}      # microbatch (and chunk) -> bytes autograd saved for its backward, measured
        self.pending_sends = []   # sends not yet complete: each holds its tensor until it is
        self.splits = []          # every schedule's time split (compute, send/recv, other, bubble)
        self.loss_sum = torch.zeros((), device=device)
        self.reset()

    def reset(self):
        """A new schedule: its records start empty."""
        self.records = []         # (op, microbatch, start mark, end mark): F, B, or W (waiting in send/recv)
        self.peak_held, self.peak_held_bytes, self.peak_pending_sends = 0, 0, 0
        self.microbatch_bytes = 0  # the most one microbatch's saved activations took
        self.t0 = self.clock.mark()

    # What the schedules measure goes through these two: the clock around each F, B and wait (the timeline and
    # the bubble), and the activations a microbatch keeps from its forward to its backward (the memory peak).

    @contextlib.contextmanager
    def timed(self, op, i=None):
        start = self.clock.mark()
        yield
        self.records.append((op, i, start, self.clock.mark()))
        self.peak_pending_sends = max(self.peak_pending_sends, len(self.pending_sends))

    @contextlib.contextmanager
    def holding(self, i):
        """Around microbatch i's forward: counts the bytes autograd saves for its backward (saved_tensors_hooks),
        held until backward_step lets them go (Stage.release)."""
        hooks, saved = saved_bytes_counter(self.model)
        with hooks:
            yield
        self.held_bytes[i] = sum(saved.values())
        self.microbatch_bytes = max(self.microbatch_bytes, self.held_bytes[i])
        self.peak_held = max(self.peak_held, len(self.held))
        self.peak_held_bytes = max(self.peak_held_bytes, sum(self.held_bytes.values()))

    def release(self, i):
        """Microbatch i's kept input and output, for its backward; its activations are no longer held."""
        self.held_bytes.pop(i)
        return self.held.pop(i)


# -----------------------------------------------------------------------------
# point-to-point communication: activations go to the next stage, their gradients back to the previous one


def communicate(stage, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
    """Post this stage's sends and receives together (Comm.send_recv: one batch_isend_irecv), and wait for the
    receives. The sends are waited for at the next exchange (the compute in between overlaps them), so a sent
    buffer is let go one exchange later, not kept until the schedule ends. The shape is known from the config,
    so there is no shape handshake. Returns (from_prev, from_next); the time spent is recorded as W."""
    with stage.timed('W'):
        finish_sends(stage)  # the previous exchange's: their peers have posted the matching receives by now
        # tag 0: activations (to the next stage), tag 1: gradients (to the previous one); on a ring of two stages
        # both go to the same peer, and the tags keep them apart
        sends = [(t.detach().contiguous(), peer, tag) for t, peer, tag in
                 ((send_next, stage.next_rank, 0), (send_prev, stage.prev_rank, 1)) if t is not None]
        from_prev = torch.empty(stage.act_shape, device=stage.device) if recv_prev else None
        from_next = torch.empty(stage.act_shape, device=stage.device) if recv_next else None
        recvs = [(t, peer, tag) for t, peer, tag in
                 ((from_prev, stage.prev_rank, 0), (from_next, stage.next_rank, 1)) if t is not None]
        send_works, recv_works = stage.comm.send_recv(sends, recvs)
        for w in recv_works:
            w.wait()
        stage.pending_sends += [(w, t) for w, (t, _, _) in zip(send_works, sends)]
        return from_prev, from_next


def finish_sends(stage):
    for w, _ in stage.pending_sends:
        w.wait()
    stage.pending_sends = []


def recv_forward(stage):
    return None if stage.is_first else communicate(stage, recv_prev=True)[0]


def send_forward(stage, y):
    if not stage.is_last:
        communicate(stage, send_next=y)


def recv_backward(stage):
    return None if stage.is_last else communicate(stage, recv_next=True)[1]


def send_backward(stage, dx):
    if not stage.is_first:
        communicate(stage, send_prev=dx)


def send_forward_recv_backward(stage, y):
    """1F1B's steady state: the forward's output goes on while the gradient of an older microbatch comes back."""
    if stage.is_last:
        return None
    return communicate(stage, send_next=y, recv_next=True)[1]


def send_backward_recv_forward(stage, dx):
    if stage.is_first:
        return None
    return communicate(stage, send_prev=dx, recv_prev=True)[0]


# -----------------------------------------------------------------------------
# one microbatch's forward and backward on this stage


def forward_step(stage, i, x, idx, targets, loss_scale, chunk=0):
    """F of microbatch i (with chunks: of chunk `chunk`, and i is (microbatch, chunk)): embed (the first chunk of
    the first stage) or take the received activation, run the chunk's blocks, and after the last chunk of the last
    stage the head and the loss. Keeps the input and output for the backward; returns what to send on."""
    model, microbatch = stage.model, i[0] if isinstance(i, tuple) else i
    first, last = stage.is_first and chunk == 0, stage.is_last and chunk == len(stage.chunks) - 1
    with stage.timed('F', i), stage.holding(i), stage.ctx:
        if first:
            x = None
            h = stage.embed(idx[microbatch])
        else:
            x.requires_grad_(True)
            h = x
        for layer in stage.chunks[chunk]:
            h = model.run_block(model.transformer.h[layer], h)
        if last:
            _, loss = stage.head(h, targets[microbatch])
            h = loss * loss_scale  # the gradient is the mean over the global batch
            stage.loss_sum += h.detach()
        stage.held[i] = (x, h)
    # the residual stream stays float32 under autocast (fp32 embedding + bf16 branch outputs), so the fp32
    # buffers of the next stage fit it
    return None if last else h


def backward_step(stage, i, grad_output, chunk=0):
    """B of microbatch i (of chunk `chunk`): backpropagate from its loss (the last chunk of the last stage) or from
    the received gradient of its output, free its activations, return the gradient of its input (to send back)."""
    with stage.timed('B', i):
        x, out = stage.release(i)
        if stage.is_last and chunk == len(stage.chunks) - 1:
            out.backward()
        else:
            torch.autograd.backward(out, grad_output)
    return None if stage.is_first and chunk == 0 else x.grad


# -----------------------------------------------------------------------------
# the schedules; idx and targets are lists of the m microbatches (only the first and last stage read them)
def gpipe(stage, m, idx, targets, loss_scale):
    """GPipe: every microbatch forward, then every microbatch backward. A stage holds all m microbatches'
    activations before the first backward; the bubble is (p-1) forward slots at the start plus (p-1) backward
    slots at the end."""
    for i in range(m):
        x = recv_forward(stage)
        y = forward_step(stage, i, x, idx, targets, loss_scale)
        send_forward(stage, y)
    for i in range(m):
        dy = recv_backward(stage)
        dx = backward_step(stage, i, dy)
        send_backward(stage, dx)


def one_f_one_b(stage, m, idx, targets, loss_scale):
    """1F1B (PipeDream-Flush, Megatron's non-interleaved schedule). Stage r first does p-r-1 forwards to fill the
    pipeline, then alternates one forward and one backward, then drains the last backwards. The same bubble as
    GPipe, but a stage never holds more than p-r microbatches' activations."""
    warmup = min(stage.pp - stage.index - 1, m)
    steady = m - warmup
    # warm-up: forwards only
    for i in range(warmup):
        x = recv_forward(stage)
        y = forward_step(stage, i, x, idx, targets, loss_scale)
        send_forward(stage, y)
    x = recv_forward(stage) if steady > 0 else None
    # steady state: forward of microbatch warmup+k, then backward of microbatch k
    for k in range(steady):
        y = forward_step(stage, warmup + k, x, idx, targets, loss_scale)
        dy = send_forward_recv_backward(stage, y)
        dx = backward_step(stage, k, dy)
        if k == steady - 1:
            send_backward(stage, dx)
        else:
            x = send_backward_recv_forward(stage, dx)
    # cool-down: the backwards of the warm-up microbatches
    for k in range(steady, m):
        dy = recv_backward(stage)
        dx = backward_step(stage, k, dy)
        send_backward(stage, dx)


def interleaved_1f1b(stage, m, idx, targets, loss_scale):
    """Megatron's interleaved 1F1B (Narayanan et al. 2021). Each stage holds v chunks of layers; chunk c of stage r
    is virtual stage c·p + r, so a microbatch goes around the ring of stages v times. The k-th forward of a stage
    works on chunk (k mod p·v) // p and microbatch (k // p·v)·p + k mod p: groups of p microbatches through one
    chunk, then the next chunk. Warm-up is 2(p-r-1) + (v-1)·p forwards, then one forward one backward, then the
    remaining backwards; every exchange posts the sends and receives of that moment together, and received
    tensors wait in a queue per chunk until their forward or backward comes. The bubble shrinks v times."""
    p, v, r = stage.pp, len(stage.chunks), stage.index
    total = m * v
    warmup = min(2 * (p - r - 1) + (v - 1) * p, total)

    def chunk_of(k, forward=True):
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def microbatch_of(k):
        return (k // (p * v)) * p + k % p

    def is_first(c):  # the embedding's chunk
        return r == 0 and c == 0

    def is_last(c):  # the loss's chunk
        return r == p - 1 and c == v - 1

    inputs, grads = [[] for _ in range(v)], [[] for _ in range(v)]  # received, waiting for their F / B

    def forward(k):
        c = chunk_of(k)
        x = None if is_first(c) else inputs[c].pop(0)
        y = forward_step(stage, (microbatch_of(k), c), x, idx, targets, loss_scale, c)
        return None if is_last(c) else y

    def backward(k):
        c = chunk_of(k, forward=False)
        dy = None if is_last(c) else grads[c].pop(0)
        dx = backward_step(stage, (microbatch_of(k), c), dy, c)
        return None if is_first(c) else dx

    if r != 0:
        inputs[0].append(communicate(stage, recv_prev=True)[0])
    # warm-up: forwards only (the last one also receives the first gradient)
    for k in range(warmup):
        y = forward(k)
        recv_prev = not (r == 0 and chunk_of(k + 1) == 0) and k != total - 1
        recv_next = k == warmup - 1 and warmup < total and r != p - 1
        x, dy = communicate(stage, send_next=y, recv_prev=recv_prev, recv_next=recv_next)
        if recv_prev:
            inputs[chunk_of(k + 1)].append(x)
        if recv_next:
            grads[v - 1].append(dy)
    # steady state: forward k + warmup, backward k, one exchange both ways
    for k in range(total - warmup):
        y, dx = forward(k + warmup), backward(k)
        if r == 0:  # the first stage's next input comes from the last stage, p - 1 forwards behind
            next_f = chunk_of(k + warmup - (p - 1)) + 1
            recv_prev = next_f != v
        else:
            next_f, recv_prev = chunk_of(k + warmup + 1), True
        if r == p - 1:  # the last stage's next gradient comes from the first stage, p - 1 backwards behind
            next_b = chunk_of(k - (p - 1), forward=False) - 1
            recv_next = next_b != -1
        else:
            next_b, recv_next = chunk_of(k + 1, forward=False), True
        recv_prev = recv_prev and k != total - warmup - 1
        x, dy = communicate(stage, send_next=y, send_prev=dx, recv_prev=recv_prev, recv_next=recv_next)
        if recv_prev:
            inputs[next_f].append(x)
        if recv_next:
            grads[next_b].append(dy)
    # cool-down: the remaining backwards
    if warmup == total and r != p - 1:
        grads[v - 1].append(communicate(stage, recv_next=True)[1])
    for k in range(total - warmup, total):
        dx = backward(k)
        recv_next = not (r == p - 1 and chunk_of(k + 1, forward=False) == v - 1) and k != total - 1
        _, dy = communicate(stage, send_prev=dx, recv_next=recv_next)
        if recv_next:
            grads[chunk_of(k + 1, forward=False)].append(dy)


SCHEDULES = {'gpipe': gpipe, '1f1b': one_f_one_b, 'interleaved': interleaved_1f1b}


def run_schedule(stage, name, m, x, y, loss_scale):
    """Split the micro-step's batch into m microbatches and run the schedule; all stages start together (a
    barrier), so that their clocks start at the same moment. The records are this schedule's."""
    idx, targets = list(x.chunk(m)), list(y.chunk(m))
    if stage.comm.size > 1:
        dist.barrier(group=stage.comm.group)
    stage.reset()
    SCHEDULES[name](stage, m, idx, targets, loss_scale)
    finish_sends(stage)
    stage.t_end = stage.clock.mark()
    stage.records_s = schedule_record(stage)  # one synchronize per schedule on a GPU
    total = torch.tensor([stage.clock.seconds(stage.t0, stage.t_end)], device=stage.device)  # on the GPU for NCCL
    stage.comm.all_reduce(total, op=dist.ReduceOp.MAX, kind='scalars')  # the step is the slowest stage's
    stage.total = float(total)
    stage.splits.append(time_split(stage.records_s, stage.total))


@torch.no_grad()
def forward_loss(stage, x, y):
    """The mean loss of one whole batch, forward only, through the stages (for estimate_loss), on every rank."""
    stage.act_shape = (x.size(0),) + tuple(stage.act_shape[1:])  # whole batches: more rows, same tokens
    model, last_chunk = stage.model, len(stage.chunks) - 1
    for chunk, layers in enumerate(stage.chunks):  # chunk c of every stage, then chunk c + 1 of every stage
        first, last = stage.is_first and chunk == 0, stage.is_last and chunk == last_chunk
        h = stage.embed(x) if first else communicate(stage, recv_prev=True)[0]
        with stage.ctx:
            for layer in layers:
                h = model.run_block(model.transformer.h[layer], h)
            if last:
                loss = stage.head(h, y)[1].float()
        if not last:
            communicate(stage, send_next=h)
    if not stage.is_last:
        loss = torch.zeros((), device=stage.device)
    finish_sends(stage)
    stage.comm.all_reduce(loss, kind='scalars')  # the last stage's loss to every stage (the others add zero)
    return loss


# -----------------------------------------------------------------------------
# what was executed: a timeline per stage from the clock, the measured bubble and held activations


def schedule_record(stage):
    """The last schedule in seconds since its start: [(op, microbatch, start, end)], after one synchronize."""
    stage.clock.synchronize()
    seconds = stage.clock.seconds
    return [(op, i, seconds(stage.t0, a), seconds(stage.t0, b)) for op, i, a, b in stage.records]


class LastStepReport:
    """The last iteration, measured: the schedule each stage executed (its records, from the clock) and the bytes
    sent in that step, counted by the Comms and measured on the wire; report_schedule prints them."""

    def __init__(self, stage, comms, cfg, rank, dp_rank):
        self.stage, self.comms, self.cfg, self.rank, self.dp_rank = stage, comms, cfg, rank, dp_rank
        self.wire = WireMeter()

    def start(self, iter_num):
        if iter_num == self.cfg.max_iters - 1:
            for comm in self.comms:
                comm.clear()
            self.wire.start()

    def finish(self, iter_num):
        if iter_num == self.cfg.max_iters - 1:
            wire_bytes = self.wire.stop()
            micro_steps = self.cfg.gradient_accumulation_steps // self.comms[0].size
            report_schedule(self.stage, self.cfg, self.rank, self.dp_rank, iter_num, micro_steps, self.comms,
                            wire_bytes, self.wire.why_not)


def report_schedule(stage, cfg, rank, dp_rank, iter_num, micro_steps, comms, wire_bytes, wire_why_not):
    """Gather every stage's record to rank 0, print the timelines and the measured-vs-formula lines, log one row
    per stage (dp replica 0's pipeline)."""
    records, total = stage.records_s, stage.total
    # the split: the median over the run's schedules (the first one, a warm-up, left out when there are more)
    splits = stage.splits[1:] or stage.splits
    split = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
    sent = comm_report(comms)
    m, p = cfg.n_microbatches, cfg.pp
    mine = dict({'rank': rank, 'stage': stage.index, 'dp_rank': dp_rank, 'records': records,
                 'p2p_bytes': stage.comm.collective_bytes['send'],
                 'peak_microbatches_held': stage.peak_held, 'peak_activation_bytes': stage.peak_held_bytes,
                 'activation_bytes_per_microbatch': stage.microbatch_bytes,
                 'peak_pending_sends': stage.peak_pending_sends,
                 'collective_bytes': sum(sent['collective_bytes'].values()),
                 'collective_bytes_by_kind': sent['collective_bytes'],
                 'wire_bytes_formula': sum(sent['wire_bytes_formula'].values()),
                 'wire_bytes': wire_bytes, 'wire_bytes_note': wire_why_not, 'n_schedules': len(splits)}, **split)
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    if rank != 0:
        return
    stages = sorted((r for r in everyone if r['dp_rank'] == 0), key=lambda r: r['stage'])
    v = cfg.virtual_stages
    n_slots = 3 * (v * m + p - 1)  # about one forward per slot when a backward costs two forwards
    width = len(str(m - 1)) + (3 if v > 1 else 1)
    clock = 'CUDA events' if stage.clock.cuda else 'host clock'
    print(f"schedule {cfg.schedule}, p={p} stages, m={m} microbatches{f', v={v} chunks per stage' if v > 1 else ''}, "
          f"iter {iter_num}, step {1000 * total:.1f} ms ({clock}; one slot = {1000 * total / n_slots:.2f} ms; "
          f"F3/B3 = forward/backward of microbatch 3{', F3.1 on chunk 1' if v > 1 else ''}, - = still running, "
          f". = not computing)")
    for r in stages:
        print(f"stage {r['stage']} | {timeline(r['records'], total, n_slots, width)}")
    for r in stages:
        order = ' '.join(op_label(op, i) for op, i, _, _ in r['records'] if op in 'FB')
        print(f"stage {r['stage']} executed: {order}")
    trace = os.path.join(cfg.out_dir, 'schedule_trace.json')
    write_schedule_trace(stages, total, trace)
    print(f"the same schedule as a trace, one track per stage: {trace} (open it at ui.perfetto.dev)")
    formula = bubble_fraction_formula(p, m, v)
    b, h = cfg.batch_size // m, stage.model.config.n_embd
    for r in stages:
        held_formula = peak_microbatches_formula(cfg.schedule, p, m, r['stage'], v)
        bytes_formula = micro_steps * p2p_comm_bytes_formula(cfg.block_size, b, h, p, m, 4, r['stage'], v)
        wire = r['wire_bytes_note'] if r['wire_bytes'] is None else f"{r['wire_bytes']:,.0f}"
        print(f"stage {r['stage']} (median of {r['n_schedules']} schedules): compute {r['compute']:.1%}, in send/recv "
              f"{r['send_recv']:.1%}, other "
              f"{r['other']:.1%}: bubble (not computing) {r['bubble_fraction']:.3f}, formula (p-1)/(v·m+p-1) = "
              f"{formula:.3f} (= (p-1)/(v·m) = {(p - 1) / (v * m):.3f} of the ideal compute); activations held at "
              f"peak {r['peak_activation_bytes']:,} B = {r['peak_microbatches_held']} microbatches (formula "
              f"{ {'gpipe': 'm', '1f1b': 'p-r'}.get(cfg.schedule, '2(p-r-1)+(v-1)p+1')} = "
              f"{held_formula} x {r['activation_bytes_per_microbatch']:,} B); p2p bytes sent {r['p2p_bytes']:,} "
              f"(formula {bytes_formula:,}); all sent: collective bytes {r['collective_bytes']:,}, wire "
              f"{r['wire_bytes_formula']:,.0f} (ring formula), {wire} (measured, loopback, mean per rank)")
        log_row(cfg.out_dir, {
            'iter': iter_num, 'rank': r['rank'], 'stage': r['stage'], 'schedule': cfg.schedule,
            'compute_fraction': r['compute'], 'send_recv_fraction': r['send_recv'], 'other_fraction': r['other'],
            'bubble_fraction': r['bubble_fraction'], 'bubble_fraction_formula': formula,
            'peak_microbatches_held': r['peak_microbatches_held'], 'peak_microbatches_held_formula': held_formula,
            'peak_activation_bytes': r['peak_activation_bytes'],
            'peak_activation_bytes_formula': held_formula * r['activation_bytes_per_microbatch'],
            'peak_pending_sends': r['peak_pending_sends'],
            'p2p_bytes_per_step': r['p2p_bytes'], 'p2p_bytes_per_step_formula': bytes_formula,
            'collective_bytes': r['collective_bytes'], 'collective_bytes_by_kind': r['collective_bytes_by_kind'],
            'wire_bytes_formula': r['wire_bytes_formula'], 'wire_bytes': r['wire_bytes'],
            'wire_bytes_note': r['wire_bytes_note']})


# -----------------------------------------------------------------------------
# checkpoints: one file per stage (consolidate.py merges them into train.py's format)


def stage_ckpt_path(out_dir, stage):
    return os.path.join(out_dir, f'ckpt_stage{stage}.pt')


def optimizer_param_names(model, optimizer):
    """The names of the optimizer's parameters in its order (the order its state_dict numbers them)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group['params']]


# -----------------------------------------------------------------------------


def train_step(stage, optimizer, batches, cfg, dp, embed):
    """One iteration: the schedule over each micro-step's microbatches, then the gradient syncs a pipeline adds:
    each stage's gradients averaged over its data-parallel column, the tied embedding's two copies summed, the
    clip over every stage. Returns the mean loss over the global batch."""
    model = stage.model
    stage.loss_sum = torch.zeros((), device=cfg.device)
    stage.act_shape = (cfg.batch_size // cfg.n_microbatches, cfg.block_size, model.config.n_embd)
    for x, y in batches:
        run_schedule(stage, cfg.schedule, cfg.n_microbatches, x, y, 1.0 / (cfg.n_microbatches * len(batches)))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for grad in grads:  # data parallel: average each stage's gradients over its column of the grid
        dp.all_reduce(grad)
        grad.div_(dp.size)
    if embed is not None:  # the tied weight's two copies: sum the embedding's and the head's gradient
        embed.all_reduce(model.transformer.wte.weight.grad if stage.is_first else model.lm_head.weight.grad)
    if cfg.grad_clip != 0.0:
        clip_grad_norm(stage, grads, cfg.grad_clip, embed)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = stage.loss_sum.clone()  # nonzero on the last stages only: summed over the stages, then over dp
    stage.comm.all_reduce(loss_sum, kind='scalars')
    dp.all_reduce(loss_sum, kind='scalars')
    return loss_sum.item() / dp.size


def clip_grad_norm(stage, grads, max_norm, embed):
    """clip_grad_norm_ over the whole model: every stage's squared norm, summed over the pipeline. A tied weight
    counts once: on the last stage lm_head.weight is a copy of the first stage's wte."""
    tied_copy = stage.model.lm_head.weight if embed is not None and stage.is_last else None
    sq = sum(p.grad.pow(2).sum() for p in stage.model.parameters() if p.grad is not None and p is not tied_copy)
    sq = torch.as_tensor(sq, dtype=torch.float32, device=stage.device)
    stage.comm.all_reduce(sq, kind='scalars')
    clip_coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(clip_coef)


def build_stage_model(cfg, vocab_size, pp_rank, dp, ckpt_path):
    """train.py's GPT on the meta device, cut to this stage's blocks (keep_stage), which alone get storage and then
    values: train.py's (init_params, one tensor at a time) or this stage's checkpoint; then this rank's dropout
    stream (its own saved one, or seeded per replica and stage), and its AdamW. Returns (model, its chunks of
    layers, the optimizer, iter_num, best_val_loss, the whole model's parameters and FLOPs per token)."""
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path, gpt2=False, meta=True)
    n_params, flops_per_token = model.get_num_params(), model.flops_per_token()  # of the full model
    chunks = keep_stage(model, pp_rank, cfg.pp, cfg.virtual_stages)  # on the meta device: shapes only
    materialize(model, cfg.device)  # storage for this stage's part alone
    if checkpoint is not None:
        model.load_state_dict(checkpoint['model'])
    else:  # train.py's values, one tensor at a time; this stage keeps its own
        init_params(model.config, cfg.seed, keep_own(model))
    if checkpoint is not None:
        restore_rng(checkpoint, dp.rank, dp.size, cfg.seed, dp.rank, pp_rank)  # this rank's own dropout stream
    else:
        seed_dropout(cfg.seed, dp.rank, pp_rank)  # each replica, and each stage (as Megatron), its own masks
    if dp.rank == pp_rank == 0:
        print(run_shape(f"world {dp.size * cfg.pp} = dp {dp.size} x pp {cfg.pp}, {model.config.n_layer // cfg.pp} "
                        f"blocks per stage in {cfg.virtual_stages} chunk(s), {cfg.schedule} over {cfg.n_microbatches} "
                        f"microbatches of {cfg.batch_size // cfg.n_microbatches}", cfg, n_params))
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device_type)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint['optimizer'])
    return model, chunks, optimizer, iter_num, best_val_loss, n_params, flops_per_token


def main(argv):
    cfg = configure(config, argv)
    validate(cfg, world_size_from_env())
    rank, _, world_size, device = init_distributed(cfg.dist_timeout)
    cfg.device = device if world_size > 1 else cfg.device
    grid, coords, comms = process_grid(world_size, rank, dp=world_size // cfg.pp, pp=cfg.pp)
    dp, pp_comm = comms['dp'], comms['pp']  # every collective and send goes through a Comm, and is counted there
    embed = embed_comm(grid, rank, cfg.tie_embeddings)
    if rank == 0:
        print(f"process grid (dp={dp.size} x pp={cfg.pp}): pipelines are rows, stages are columns\n"
              f"{grid.view(dp.size, cfg.pp)}")

    # setup
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    ctx = autocast_context(device_type, cfg.dtype)

    # data
    data, vocab_size = load_dataset(cfg.dataset)

    # model: this stage's part of train.py's GPT (build_stage_model)
    ckpt_path = stage_ckpt_path(cfg.out_dir, pp_comm.rank)
    model, chunks, optimizer, iter_num, best_val_loss, n_params, flops_per_token = build_stage_model(
        cfg, vocab_size, pp_comm.rank, dp, ckpt_path)
    stage = Stage(model, chunks, pp_comm.rank, cfg.pp, grid[coords['dp'], :, coords['cp'], coords['tp']],
                  (cfg.batch_size // cfg.n_microbatches, cfg.block_size, model.config.n_embd), cfg.device, ctx, pp_comm)

    def loss_of(x, y):
        return forward_loss(stage, x, y)

    # training loop
    writer = CheckpointWriter()  # every stage writes its file in the background
    profiler = StepProfiler(cfg.profile, cfg.out_dir, rank, cfg.device)  # --profile=N: a trace per rank
    logger = StepLogger(cfg, flops_per_token, n_devices=world_size)
    report = LastStepReport(stage, [c for c in (dp, pp_comm, embed) if c], cfg, rank, dp.rank)
    while True:
        lr = get_lr(iter_num, cfg)
        set_lr(optimizer, lr)

        # evaluate, and checkpoint the state from which iteration iter_num starts
        if should_evaluate(iter_num, cfg):
            losses = evaluate(loss_of, model, data, cfg, iter_num, lr, dp)  # each pipeline its share of the batches
            if should_save(iter_num, losses['val'], best_val_loss, cfg):
                best_val_loss = min(best_val_loss, losses['val'])
                rng_states = gather_rng_states(dp)  # every replica's dropout stream for this stage
                if dp.rank == 0:  # the dp replicas of a stage are equal: one file per stage
                    checkpoint = train_checkpoint(model.state_dict(), optimizer.state_dict(), rng_states,
                                                  vars(model.config), iter_num, best_val_loss, vars(cfg))
                    checkpoint.update(param_names=optimizer_param_names(model, optimizer), stage=pp_comm.rank)
                    writer.save(checkpoint, ckpt_path)
                    checkpoint = None
            logger.restart()
        if iter_num == cfg.max_iters or cfg.eval_only:
            break

        # one iteration, then its log line (the last one also reports its schedule, as executed)
        report.start(iter_num)
        loss = train_step(stage, optimizer, micro_batches(data, cfg, iter_num, dp.rank, dp.size), cfg, dp, embed)
        logger.step(iter_num, loss, lr)
        report.finish(iter_num)
        profiler.step()
        iter_num += 1
    profiler.stop()
    writer.wait()

    if rank == 0:
        print(outputs_line(cfg.out_dir, "ckpt_stage*.pt (one per stage: resume; python consolidate.py "
                                        f"{cfg.out_dir} makes one ckpt.pt)",
                           "schedule_trace.json (the last schedule: open at ui.perfetto.dev)", *profiled(cfg)))
    finish_distributed(cfg)


if __name__ == '__main__':
    run_main(main)
