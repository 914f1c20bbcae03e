"""
What the scripts measure, apart from what they compute: the bytes each rank's own sockets sent, the peak
memory (the allocator on GPU, the resident set on CPU), the bytes autograd keeps for backward, MFU against the
device's peak, and torch.profiler traces.
"""

import contextlib
import functools
import json
import os
import socket
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist


def storage_ptrs(tensors):
    """The storages' addresses of tensors (a DTensor's: its local shard's)."""
    return {(t.to_local() if hasattr(t, 'to_local') else t).untyped_storage().data_ptr() for t in tensors}


def saved_bytes_counter(params, noting=lambda: True):
    """Measured activations: saved_tensors_hooks that note every distinct storage autograd keeps for backward
    (while noting() says so), the parameters' storages (params, a set the caller may add to, as FSDP2 gathers
    a block) left out. Use `with hooks:` around a forward; sum(seen.values()) is the bytes held. Returns
    (hooks, seen: {storage: bytes})."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and noting():
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), seen


def nbytes(tensors):
    """Bytes of the tensors this rank holds (a DTensor's: its local shard's)."""
    local = [t.to_local() if hasattr(t, 'to_local') else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in local)


def storage_bytes(tensors, skip=()):
    """Bytes of the distinct storages behind tensors (views of one buffer count once; a DTensor: its local
    shard's), and the storages seen (skip: ones already counted elsewhere)."""
    seen, total = set(skip), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, 'to_local') else t
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total, seen


def fsdp_grad_bytes(model):
    """Every gradient byte an FSDP2 rank holds right now: the sharded gradients, and the full-size (unsharded)
    gradients that FSDP2 keeps while set_requires_gradient_sync(False) accumulates micro-steps locally (each
    storage once: once a group is gathered again, its parameter's .grad and the accumulated gradient are one
    tensor). Those live in FSDP's own parameter records (a private attribute, read only here); None where this
    torch version keeps them elsewhere."""
    grads = [p.grad for p in model.parameters()]
    for module in model.modules():
        state = getattr(module, '_get_fsdp_state', lambda: None)()
        group = getattr(state, '_fsdp_param_group', None)
        for fsdp_param in getattr(group, 'fsdp_params', []):
            try:
                unsharded = getattr(getattr(fsdp_param, '_unsharded_param', None), 'grad', None)
                grads += [unsharded, fsdp_param.unsharded_accumulated_grad]
            except AttributeError:
                return None
    return storage_bytes(grads)[0]


class StepProfiler:
    """--profile=N: N training steps (after one warm-up step) under torch.profiler, written per rank as a
    Chrome/Perfetto trace, out_dir/trace_rank{r}.json: kernels, collectives and waits on one time axis (open
    it at ui.perfetto.dev or chrome://tracing). step() after every iteration; stop() after the loop."""

    def __init__(self, n_steps, out_dir, rank, device):
        self.path, self.prof = os.path.join(out_dir, f'trace_rank{rank}.json'), None
        if n_steps > 0:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.startswith('cuda'):
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(
                activities=activities, schedule=torch.profiler.schedule(wait=0, warmup=1, active=n_steps,
                                                                        repeat=1),
                on_trace_ready=lambda prof: prof.export_chrome_trace(self.path))
            self.prof.start()

    def step(self):
        if self.prof is not None:
            self.prof.step()

    def stop(self):
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
            if os.path.exists(self.path):
                print(f"wrote {self.path} (open it at ui.perfetto.dev)", flush=True)


def comm_report(comms):
    """{'collective_bytes': {'dp all_reduce': ...}, 'wire_bytes_formula': {...}} over several groups'
    Comms."""
    out = {'collective_bytes': {}, 'wire_bytes_formula': {}}
    for c in comms:
        for key in out:
            for kind, value in getattr(c, key).items():
                out[key][f'{c.name} {kind}'] = out[key].get(f'{c.name} {kind}', 0) + value
    return out


TCPI_BYTES_SENT = 200  # offsets of tcpi_bytes_sent and tcpi_bytes_retrans (u64s) in struct tcp_info
TCPI_BYTES_RETRANS = 208  # (linux/tcp.h, Linux >= 4.19)


def tcp_bytes_sent_by_socket():
    """{socket inode: payload bytes sent once} for each TCP socket of this process (TCP_INFO's bytes sent less
    those TCP resent when an acknowledgement came late, as on a busy machine), or None where the kernel keeps
    no such count. gloo talks over the process's own TCP sockets: this rank's traffic and nobody else's."""
    if not hasattr(socket, 'TCP_INFO') or not os.path.isdir('/proc/self/fd'):
        return None
    sent = {}
    for fd in os.listdir('/proc/self/fd'):
        try:
            target = os.readlink(f'/proc/self/fd/{fd}')
            if not target.startswith('socket:'):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))  # a duplicate: closing it leaves ours open
        except OSError:
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < TCPI_BYTES_RETRANS + 8:
            return None  # a kernel older than 4.19
        sent[target] = (int.from_bytes(info[TCPI_BYTES_SENT:TCPI_BYTES_SENT + 8], sys.byteorder)
                        - int.from_bytes(info[TCPI_BYTES_RETRANS:TCPI_BYTES_RETRANS + 8], sys.byteorder))
    return sent


class WireMeter:
    """Measured: the bytes this rank itself sent over a window of steps. gloo sends over TCP sockets this
    process owns, and the kernel counts each socket's payload bytes (TCP_INFO): their sum at the window's end
    minus at its start is this rank's traffic alone, whoever else uses the network. Both ends sit behind a
    barrier (what this rank sent has left it). NCCL's bytes pass its sockets by: None, and why."""

    def __init__(self):
        self.why_not, self.start_sent = None, None
        if not dist.is_initialized():
            self.why_not = 'not measured: one process'
        elif dist.get_backend() != 'gloo':
            self.why_not = 'not measured: NCCL moves its bytes past the process\'s sockets'
        elif tcp_bytes_sent_by_socket() is None:
            self.why_not = 'not measured: this OS gives no per-socket TCP counters'

    def start(self):
        if self.why_not is None:
            dist.barrier()
            self.start_sent = tcp_bytes_sent_by_socket()

    def stop(self):
        """The bytes this rank sent since start(), or None. A socket opened in the window counts from zero."""
        if self.why_not is not None or self.start_sent is None:
            return None
        dist.barrier()
        now = tcp_bytes_sent_by_socket()
        return sum(n - self.start_sent.get(sock, 0) for sock, n in now.items())


# -----------------------------------------------------------------------------
# Measured steps and their report. Measuring costs time (a barrier to line the ranks up, a device synchronize
# before reading a clock, an all-gather of the numbers), so a script measures only the steps this names and
# runs the algorithm alone on every other one.

def _cell(value):
    if value is None:
        return '-'
    if isinstance(value, float) and abs(value) < 1000:
        return f"{value:.3g}"
    return f"{value:,.0f}" if isinstance(value, (int, float)) else str(value)


def print_measured(title, lines, notes=()):
    """A measured step's report: one line per quantity with what was measured (the running system), counted
    (at our own calls) and modelled (a paper's formula) side by side, '-' where a kind does not apply; then
    each note that explains a gap between them. lines: [(quantity, measured, counted, modelled)]."""
    width = max([len(name) for name, *_ in lines] + [8])
    print(title)
    print(f"  {'':<{width}}  {'measured':>14}  {'counted':>14}  {'modelled':>14}")
    for name, *values in lines:
        print(f"  {name:<{width}}  " + '  '.join(f"{_cell(v):>14}" for v in values))
    for note in notes:
        print(f"  ({note})")


# -----------------------------------------------------------------------------
# Executed schedules (pipeline.py): what each rank ran, as ops with a start and an end on its clock, drawn as
# a text timeline and as a Perfetto trace.

COMPUTE = ('F', 'B', 'W')  # forward, backward (zb1: of the input), the weights' gradients (zb1)


def time_split(records, total):
    """The stage's share of the step in compute (F, B and W), in send/recv (the transfer, and on a CPU the
    wait for a neighbour that is still computing) and elsewhere; the bubble is everything that is not
    compute."""
    compute = sum(t1 - t0 for op, _, t0, t1 in records if op in COMPUTE)
    comm = sum(t1 - t0 for op, _, t0, t1 in records if op == 'send/recv')
    return {'compute_fraction': compute / total, 'send_recv_fraction': comm / total,
            'other_fraction': 1 - (compute + comm) / total, 'bubble_fraction': 1 - compute / total}


def schedule_measurements(clock, comms, wire, sent_p2p):
    """A measured step's numbers for its log row: the median time split of its schedules (the first left out
    as a warm-up when there are more), the peaks the clock kept, the bytes counted at the calls and on the
    wire. """
    splits = [time_split(*schedule) for schedule in clock.schedules[1:] or clock.schedules]
    sent = comm_report(comms)
    return {**{k: statistics.median(split[k] for split in splits) for k in splits[0]},
            'n_schedules': len(splits),
            'peak_microbatches_held': clock.peak_held, 'peak_activation_bytes': clock.peak_held_bytes,
            'activation_bytes_per_microbatch': clock.microbatch_bytes,
            'peak_output_grad_bytes': clock.peak_grad_bytes,
            'peak_pending_sends': clock.peaks.get('pending_sends', 0), 'p2p_bytes_per_step': sent_p2p,
            'collective_bytes': sum(sent['collective_bytes'].values()),
            'collective_bytes_by_kind': sent['collective_bytes'], 'wire_bytes': wire.sent,
            'wire_bytes_note': wire.why_not, 'wire_bytes_formula': sum(sent['wire_bytes_formula'].values()),
            'records': clock.schedules[-1][0], 'step_s': clock.schedules[-1][1]}


def unit_time_bubbles(tracks):
    """Each stage's idle fraction if every op took one unit (F = B = W = 1; a whole backward, B with its W,
    2), replayed in the order each stage ran its ops: a stage starts its next op when it is free and the op's
    input is there (neighbour_op). The wall clock's bubble moves with the machine's load; this one is the
    schedule's own. tracks: each stage's records [(op, key, start, end)], stage 0 first; keys (microbatch,
    chunk) with v chunks a stage. None for an order that cannot run."""
    p = len(tracks)
    ops = [[(op, tuple(k) if isinstance(k, list) else k) for op, k, *_ in records if op in 'FBW']
           for records in tracks]
    v = 1 + max((k[1] for track in ops for _, k in track if isinstance(k, tuple)), default=0)
    cost = {'F': 1, 'W': 1, 'B': 1 if any(op == 'W' for track in ops for op, _ in track) else 2}
    done, free, nxt = {}, [0] * p, [0] * p
    while any(nxt[r] < len(ops[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while nxt[r] < len(ops[r]):
                op, key = ops[r][nxt[r]]
                before = neighbour_op(r, op, key, p, v)
                if before is not None and before not in done:
                    break
                free[r] = done[(r, op, key)] = max(free[r], done.get(before, 0)) + cost[op]
                nxt[r], moved = nxt[r] + 1, True
        if not moved:
            return None
    return [1 - sum(cost[op] for op, _ in track) / max(free) for track in ops]


def neighbour_op(r, op, key, p, v):
    """(stage, op, key) that must end before stage r runs op of key: an F waits for the previous virtual
    stage's F of that microbatch, a B for the next one's B; a W (and the ends of the pipe) for nobody else."""
    i, c = key if v > 1 else (key, 0)
    place = c * p + r + (-1 if op == 'F' else 1)
    if op == 'W' or place in (-1, p * v):
        return None
    return place % p, op, ((i, place // p) if v > 1 else i)


def op_label(op, i):
    """F3 / B3 / W3: forward / backward / weights' gradients of microbatch 3; F3.1: of microbatch 3 on
    chunk 1."""
    return f"{op}{i[0]}.{i[1]}" if isinstance(i, (tuple, list)) else f"{op}{i}"


def timeline(records, total, n_slots, width):
    """One line of the stage's step, n_slots equal slices of the clock: each forward and backward once, in the
    order executed (F3 = forward of microbatch 3, B3 its backward), in the slot where it started, '-' in the
    slots it goes on running through, '.' where the stage was not computing. An op shorter than a slot, or one
    starting in a slot already taken, takes the next free slot (the row grows past n_slots rather than drop
    it)."""
    slot, cells = total / n_slots, []
    for op, i, t0, t1 in records:
        if op not in COMPUTE:
            continue
        start = max(len(cells), int(t0 / slot))
        cells += ['.'] * (start - len(cells)) + [op_label(op, i)]
        cells += ['-'] * (round(t1 / slot) - len(cells))  # the slots whose middle it runs through
    cells += ['.'] * (n_slots - len(cells))
    return ' '.join(c.ljust(width) for c in cells).rstrip()


def write_schedule_trace(tracks, total, path):
    """The executed schedule as a Chrome/Perfetto trace (open it at ui.perfetto.dev): one track per rank
    (tracks: {name: records}), a slice for each forward, backward and send/recv, and 'idle' for the gaps in
    between, so the bubble is a picture."""
    events = []
    for tid, (name, records) in enumerate(tracks.items()):
        track = {'pid': 0, 'tid': tid}
        events.append(dict(track, ph='M', name='thread_name', args={'name': name}))
        busy = sorted((t0, t1, op_label(op, i) if op in COMPUTE else op) for op, i, t0, t1 in records)
        edges = [(0.0, 0.0, None)] + busy + [(total, total, None)]
        for (_, prev_end, _), (start, _, _) in zip(edges, edges[1:]):
            if start > prev_end:
                events.append(dict(track, ph='X', name='idle', cat='idle', ts=1e6 * prev_end,
                                   dur=1e6 * (start - prev_end)))
        for t0, t1, op in busy:
            events.append(dict(track, ph='X', name=op,
                               cat='communication' if op == 'send/recv' else 'compute',
                               ts=1e6 * t0, dur=1e6 * (t1 - t0)))
    with open(path, 'w') as f:
        json.dump({'traceEvents': events, 'displayTimeUnit': 'ms'}, f)


def print_timelines(title, tracks, total, n_slots, clock):
    """Each rank's executed schedule as one text line (timeline), then each one's order of forwards and
    backwards. tracks: {name: records}; n_slots: the slots a line has; clock: what timed it."""
    width = max(len(op_label(op, i)) for records in tracks.values() for op, i, _,
                _ in records if op in COMPUTE)
    print(f"{title}, step {1000 * total:.1f} ms ({clock}; one slot = {1000 * total / n_slots:.2f} ms; F3/B3 "
          "= "
          f"forward/backward of microbatch 3, W3 its weights' gradients, F3.1 on chunk 1, - = still running, "
          f". = not computing)")
    for name, records in tracks.items():
        print(f"{name} | {timeline(records, total, n_slots, width)}")
    for name, records in tracks.items():
        print(f"{name} executed: " + ' '.join(op_label(op, i) for op, i, _, _ in records if op in COMPUTE))


def print_schedule_report(title, stages, formulas, trace, clock):
    """pipeline.py's measured step: the stages' timelines (a slot ~ one F), the schedule as a Perfetto trace,
    then each stage's (quantity, measured, counted, modelled) lines. stages: the stages' log rows."""
    tracks, total, r0 = {f"stage {r['stage']}": r['records'] for r in stages}, stages[0]['step_s'], stages[0]
    order = sorted(stages, key=lambda r: r['stage'])
    unit = dict(zip([r['stage'] for r in order], unit_time_bubbles([r['records'] for r in order]) or []))
    work = 3 * len({i for op, i, _, _ in r0['records'] if op == 'F'})  # F + B (~2F), or F + B + W: 3 slots
    print_timelines(title, tracks, total, round(work / (1 - r0['bubble_fraction_formula'])), clock)
    write_schedule_trace(tracks, total, trace)
    print_measured(f"measured at iter {r0['iter']}, the median of {r0['n_schedules']} schedule(s); formulas: "
                   f"{formulas} x the most one held, measured; bytes: counted at the calls, the ring "
                   "formula, on the stage's own sockets",
                   [(f"stage {r['stage']} {name}", *values) for r in stages for name, *values in (
                       ('in compute', r['compute_fraction'], None, None),
                       ('in send/recv', r['send_recv_fraction'], None, None),
                       ('other', r['other_fraction'], None, None),
                       ('bubble (not computing)', r['bubble_fraction'], None, r['bubble_fraction_formula']),
                       ('bubble in unit time, as run', None, unit.get(r['stage']),
                        r['bubble_fraction_formula']),
                       ('microbatches held at peak', r['peak_microbatches_held'], None,
                        r['peak_microbatches_held_formula']),
                       ('activation bytes at peak', r['peak_activation_bytes'], None,
                        r['peak_activation_bytes_formula']),
                       *((('  of them output gradients for W', r['peak_output_grad_bytes'], None,
                           r['peak_output_grad_bytes_formula']),) if r['schedule'] == 'zb1' else ()),
                       ('p2p bytes sent', None, r['p2p_bytes_per_step'], r['p2p_bytes_per_step_formula']),
                       ('bytes sent, all groups', r['wire_bytes'], r['collective_bytes'],
                        r['wire_bytes_formula']))],
                   ["bubble in unit time: the order each stage ran its ops, replayed with F = B = W = 1 (a "
                    "whole backward 2): the schedule's own (the clock's moves with the machine's load)",
                    f"the schedule as a trace, one track per stage: {trace} (open at ui.perfetto.dev)"] +
                   [f"wire bytes {r['wire_bytes_note']}" for r in stages[:1] if r['wire_bytes'] is None])


class ScheduleClock:
    """A measured step's observer of one pipeline stage (stage.observer; pipeline.timed hands it every op).
    op(name, key) stamps each op's start and end on the device's clock (CUDA events on a GPU; the host clock
    on a CPU). It counts the bytes autograd saves in an F (saved_bytes_counter) and the output gradients zb1's
    B keeps for W (stage.output_grads), held until the key leaves stage.held; after a send/recv, the sends
    pending. Around a whole schedule the ranks of comm start together (a barrier) and its length is the
    slowest rank's (a MAX all-reduce): (records, length) in self.schedules. comm: the stage's pp group in a
    Comm of its own (what measuring sends is counted apart from the algorithm's)."""

    def __init__(self, stage, comm):
        self.stage, self.comm, self.device = stage, comm, stage.device
        self.cuda = self.device.startswith('cuda')
        self.name = 'CUDA events' if self.cuda else 'host clock'
        self.records, self.schedules, self.peaks, self.held_bytes, self.grad_bytes = [], [], {}, {}, {}
        self.peak_held = self.peak_held_bytes = self.microbatch_bytes = self.peak_grad_bytes = 0

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end):
        return start.elapsed_time(end) / 1000 if self.cuda else end - start

    @contextlib.contextmanager
    def op(self, name, key=None):
        if name == 'schedule':
            self.start()
            yield
            self.stop()
            return
        start = self.mark()
        with self.holding(key) if name == 'F' else contextlib.nullcontext():
            yield
        self.records.append((name, key, start, self.mark()))
        if name == 'B' and key in self.stage.output_grads:  # zb1: B left W its input, held until W
            self.grad_bytes[key] = storage_bytes(self.stage.output_grads[key])[0]
            self.held_bytes[key] += self.grad_bytes[key]
            self.peak_grad_bytes = max(self.peak_grad_bytes, sum(self.grad_bytes.values()))
            self.peak_held_bytes = max(self.peak_held_bytes, sum(self.held_bytes.values()))
        if name in ('B', 'W') and key not in self.stage.held:
            self.held_bytes.pop(key, None)  # released: its activations (and output gradients) are gone
            self.grad_bytes.pop(key, None)
        if name == 'send/recv':
            pending = len(self.stage.pending_sends)
            self.peaks['pending_sends'] = max(self.peaks.get('pending_sends', 0), pending)

    @contextlib.contextmanager
    def holding(self, key):
        hooks, saved = saved_bytes_counter(storage_ptrs(self.stage.model.parameters()))
        with hooks:
            yield
        self.held_bytes[key] = sum(saved.values())
        self.microbatch_bytes = max(self.microbatch_bytes, self.held_bytes[key])
        self.peak_held = max(self.peak_held, len(self.held_bytes))
        self.peak_held_bytes = max(self.peak_held_bytes, sum(self.held_bytes.values()))

    def start(self):
        if self.comm.size > 1:
            dist.barrier(group=self.comm.group)
        self.records, self.t0 = [], self.mark()

    def stop(self):
        end = self.mark()
        if self.cuda:
            torch.cuda.synchronize()
        total = torch.tensor([self.seconds(self.t0, end)], device=self.device)  # on the GPU for NCCL
        self.comm.all_reduce(total, op=dist.ReduceOp.MAX, kind='scalars')
        seconds = [(op, key, self.seconds(self.t0, a), self.seconds(self.t0, b)) for op, key, a,
                   b in self.records]
        self.schedules.append((seconds, float(total)))


@contextlib.contextmanager
def first_block_saved_bytes(model):
    """Bytes one layer saves for backward, measured in the running step: the storages autograd keeps from the
    first block's first forward (its first micro-batch, as the block sees it: with sequence parallelism this
    rank's chunk of the sequence, with context parallelism its tokens). saved_tensors_hooks around the whole
    step (outermost, as activation checkpointing's own must stay inside them) note what is saved while the
    block's forward hooks say it runs. Yields a namespace whose .bytes is set at the end."""
    block, state, result = model.transformer.h[0], {'inside': False, 'done': False}, SimpleNamespace(bytes=0)

    def enter(*_):
        state['inside'] = not state['done']
        params.update(storage_ptrs(block.parameters()))  # (FSDP2: the block's gathered parameters, now)

    def leave(*_):
        state['done'] = state['done'] or state['inside']
        state['inside'] = False
    handles = [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    params = storage_ptrs(model.parameters())
    hooks, seen = saved_bytes_counter(params, lambda: state['inside'])
    try:
        with hooks:
            yield result
    finally:
        for handle in handles:
            handle.remove()
    result.bytes = sum(seen.values())


class WaitClock:
    """For a measured step only: it stands in for the cp group's Comm and adds up the time spent waiting on
    the group's communication (a ring exchange's wait(), a Ulysses all-to-all); its hooks add up the attention
    layers' forward and backward time. The layers' time less the waits is computing."""

    def __init__(self, comm, model):
        self.comm, self.wait_s, self.layer_s, self.t0 = comm, 0.0, 0.0, 0.0
        on = lambda *_: setattr(self, 't0', self.now())  # noqa: E731
        off = lambda *_: setattr(self, 'layer_s', self.layer_s + self.now() - self.t0)  # noqa: E731
        self.hooks = [register(hook) for b in model.transformer.h for register, hook in (
            (b.attn.register_forward_pre_hook, on), (b.attn.register_forward_hook, off),
            (b.attn.register_full_backward_pre_hook, on), (b.attn.register_full_backward_hook, off))]

    @staticmethod
    def now():  # the host clock, after the device has caught up
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def __getattr__(self, name):  # rank, size, global_rank, the counters: the Comm's own
        return getattr(self.comm, name)

    def clocked(self, fn, *args):
        start = self.now()
        out = fn(*args)
        self.wait_s += self.now() - start
        return out

    def all_to_all_v(self, *args):
        return self.clocked(self.comm.all_to_all_v, *args)

    def send_recv(self, sends, recvs, kind='send'):
        return tuple([SimpleNamespace(wait=functools.partial(self.clocked, w.wait)) for w in works]
                     for works in self.comm.send_recv(sends, recvs, kind))
