"""
What the scripts measure, apart from what they compute: the bytes each rank's own sockets sent, the peak
memory (the allocator on GPU, the resident set on CPU), the bytes autograd keeps for backward, MFU against the
device's peak, and torch.profiler traces.
"""

import contextlib
import functools
import os
import socket
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
