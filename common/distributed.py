"""
Process groups and the collectives every parallel script calls: init_distributed / finish_distributed
(torchrun's group: NCCL on GPUs, gloo on CPU), and Comm, one group's collectives with every byte handed to
them counted (the papers' ring formula beside it); the global-norm clip over ranks (the grid and the gradient
average: common/model_parallel.py); two collectives written for gloo's memory (all_gather_direct,
reduce_scatter_of) with glibc's allocator setting that ZeRO-3 needs (return_freed_buffers_to_the_os); and the
process's memory: its peak, and what the run added to it (torch's own code left out).
"""

import json
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist



def is_master():
    """Rank 0, or the only process: it logs, prints and writes the files the ranks share."""
    return not dist.is_initialized() or dist.get_rank() == 0


# torch 2.13 named these all_gather_single / reduce_scatter_single and deprecated the old names (same
# arguments); older versions have only the old ones. One choice here, for every file.
all_gather_single = getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor


reduce_scatter_single = getattr(dist, 'reduce_scatter_single', None) or dist.reduce_scatter_tensor


# What a ring algorithm sends per rank, as a multiple of the full tensor's bytes (n ranks in the group): an
# all-reduce is a reduce-scatter then an all-gather. A send moves the tensor once.
RING_FACTOR = {'all_reduce': lambda n: 2 * (n - 1) / n, 'reduce_scatter': lambda n: (n - 1) / n,
               'all_gather': lambda n: (n - 1) / n, 'send': lambda n: 1.0}


class Comm:
    """One process group (name: 'dp', 'tp', 'pp', ...), the rank's place in it, and its collectives. Every
    collective and send of a strategy goes through one, so the bytes are counted in one place:
    collective_bytes[kind] counts the bytes of the tensors handed to each kind of call (the full tensor for a
    reduce-scatter or all-gather), wire_bytes_formula[kind] what ring algorithms send for those calls (the
    papers' number). What really crosses the wire depends on the backend: see WireMeter. A group of one moves
    nothing."""

    def __init__(self, group=None, name='dp', alone=False):
        self.group, self.name = group, name  # group None: the whole world; alone: a group of this rank only
        self.rank = dist.get_rank(group) if dist.is_initialized() and not alone else 0
        self.size = dist.get_world_size(group) if dist.is_initialized() and not alone else 1
        self.collective_bytes, self.wire_bytes_formula = Counter(), Counter()
        # a function to call at every collective, as it is posted (to sample memory there)
        self.observe = None

    def count(self, kind, tensor, op=None):
        nbytes = tensor.numel() * tensor.element_size()
        self.collective_bytes[kind] += nbytes
        self.wire_bytes_formula[kind] += RING_FACTOR[op or kind](self.size) * nbytes
        if self.observe is not None:
            self.observe()

    def clear(self):
        self.collective_bytes.clear()
        self.wire_bytes_formula.clear()

    def all_reduce(self, x, op=dist.ReduceOp.SUM, async_op=False, kind='all_reduce'):
        if self.size == 1:
            return None
        self.count(kind, x, 'all_reduce')
        return dist.all_reduce(x, op=op, group=self.group, async_op=async_op)

    def summed(self, x, kind='all_reduce'):
        """x summed over the group's ranks, in place; returns x."""
        self.all_reduce(x, kind=kind)
        return x

    def reduce_scatter(self, out, full, async_op=False):
        """out (this rank's 1/size) = its chunk of the sum over ranks of full."""
        if self.size == 1:
            out.copy_(full)
            return None
        self.count('reduce_scatter', full)
        return reduce_scatter_single(out, full, group=self.group, async_op=async_op)

    def all_gather(self, full, shard, async_op=False):
        """full = every rank's shard, in rank order."""
        if self.size == 1:
            full.copy_(shard)
            return None
        self.count('all_gather', full)
        return all_gather_single(full, shard, group=self.group, async_op=async_op)

    def all_to_all_v(self, out, inp, out_splits, in_splits, kind='all_to_all_v'):
        """An all-to-all of variable sizes (expert parallelism's): in_splits[i] rows (dim 0) of inp go to rank
        i, out_splits[i] rows of out come from rank i (the sizes exchanged beforehand). Counted: inp's bytes;
        its wire bytes are exact, not a ring's: every row but the ones this rank keeps leaves it."""
        if self.size == 1:
            out.copy_(inp)
            return None
        nbytes, row_bytes = inp.numel() * inp.element_size(), inp[:1].numel() * inp.element_size()
        self.collective_bytes[kind] += nbytes
        self.wire_bytes_formula[kind] += nbytes - row_bytes * in_splits[self.rank]
        if self.observe is not None:
            self.observe()
        return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def global_rank(self, group_rank):
        """The global rank of this group's rank group_rank (point-to-point calls take global ranks)."""
        if self.size == 1:
            return dist.get_rank() if dist.is_initialized() else 0
        return dist.get_global_rank(self.group or dist.group.WORLD, group_rank)

    def send_recv(self, sends, recvs, kind='send'):
        """Post sends [(tensor, global peer rank[, tag])] and receives [(buffer, peer[, tag])] together in one
        batch_isend_irecv (as Megatron does: two neighbours sending to each other at once cannot deadlock, on
        NCCL too). Returns (works of the sends, works of the receives); the caller waits for them."""
        ops = [dist.P2POp(dist.isend, t, peer, tag=rest[0] if rest else 0) for t, peer, *rest in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, tag=rest[0] if rest else 0) for t, peer, *rest in recvs]
        for t, *_ in sends:
            self.count(kind, t, 'send')
        if not ops:
            return [], []
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # a backend that coalesces the batch into one work: it covers everything
            return [], works
        return works[:len(sends)], works[len(sends):]


def clip_grad_norm(grads, max_norm, comms=(), counted=None, device=None):
    """torch.nn.utils.clip_grad_norm_ for a model spread over ranks, the one written here for every script.
    The norm's square is this rank's share, summed over comms (the ranks holding the other parts): the
    squares of its entries, each entry of the model counted once over all ranks. counted: [(tensor, weight)]
    (default: each of grads once): a copy that k ranks hold weighs 1/k on each, or 1 on one rank and 0 on the
    others. Then every gradient this rank holds (grads) is scaled by the one coefficient. Returns the norm.
    device: where the sum is all-reduced, if not the gradients' (ZeRO-Offload's are on the host; NCCL takes
    only the GPU's tensors)."""
    local_sq = torch.zeros((), device=grads[0].device if grads else None)
    for g, weight in [(g, 1.0) for g in grads] if counted is None else counted:
        if weight:
            local_sq += weight * g.float().pow(2).sum()  # (fp32)
    local_sq = local_sq.to(device or local_sq.device)  # (offload: the host's sum to the GPU, once)
    for comm in comms:
        comm.all_reduce(local_sq, kind='scalars')
    norm = local_sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(grads[0].device if grads else norm.device)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))  # (on the gradients' device already: a cast at most, no transfer)
    return norm


def peak_memory_bytes(device):
    """Peak memory of this process: the CUDA allocator's high-water mark on GPU, the peak resident set on
    CPU."""
    if device.startswith('cuda'):
        return torch.cuda.max_memory_allocated(device)
    return peak_resident_bytes()


def resident_bytes(key='VmRSS'):
    """This process's resident set now (VmRSS; VmHWM: its peak) from Linux's /proc, else None."""
    try:
        with open('/proc/self/status') as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ':'))
    except (OSError, StopIteration):
        return None


def peak_resident_bytes():
    """This process's peak resident set: Linux's VmHWM, which starts afresh at exec (getrusage's ru_maxrss
    keeps the parent's resident set from before the exec, so a child of a big process would report the
    parent's)."""
    peak = resident_bytes('VmHWM')
    if peak is None:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == 'darwin' else 1024)
    return peak


# the resident set once torch is imported, before a run builds anything: what the run adds counts from it
START_RESIDENT_BYTES = resident_bytes()


def load_meta_kernels():
    """torch's meta-device kernels (~800 Python modules of its own, ~70 MiB), which the first operation on a
    meta tensor loads (a sharded script's build), loaded now and added to the start: torch's code, like
    `import torch` itself, is not what the run holds. (Where it is loaded already, this adds nothing.)"""
    global START_RESIDENT_BYTES
    before = resident_bytes()
    torch.empty(1, device='meta').normal_()
    if START_RESIDENT_BYTES is not None and before is not None:
        START_RESIDENT_BYTES += resident_bytes() - before


def added_resident_bytes():
    """What the run added: the peak resident set minus the start (most of the ~380 MiB a CPU step shows is
    torch itself); None where /proc is not there."""
    peak = peak_resident_bytes()
    return None if START_RESIDENT_BYTES is None or peak is None else peak - START_RESIDENT_BYTES


_GROUP_IS_OURS = False  # init_distributed made the process group, so finish_distributed tears it down
JOINED = False  # init_distributed made a process group in this process (training.exit_run: no teardown)


def init_distributed(timeout_s, group_of_one=False):
    """Join the process group that torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or run
    as one process without it (group_of_one: in a group of one, for code that needs a group, as FSDP2 does).
    NCCL with one GPU per process when CUDA is there, gloo on CPU. Inside a process group that already exists
    (a notebook, a test harness) it joins that one and leaves it standing at the end. Returns (rank,
    local_rank, world_size, device). A rank that dies makes the others fail within timeout_s."""
    import datetime
    global _GROUP_IS_OURS, JOINED
    local_rank = int(os.environ.get('LOCAL_RANK', '0'))
    device = f'cuda:{local_rank}' if torch.cuda.is_available() else 'cpu'
    if dist.is_initialized():
        return dist.get_rank(), local_rank, dist.get_world_size(), device
    if 'RANK' not in os.environ:
        script = os.path.basename(sys.argv[0])
        print("running as a single process (started without torchrun); for N processes: torchrun "
              "--standalone "
              f"--nproc_per_node=N {script} {' '.join(sys.argv[1:])}".rstrip(), flush=True)
    if 'RANK' not in os.environ and not group_of_one:
        return 0, 0, 1, ('cuda' if torch.cuda.is_available() else 'cpu')
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    backend, timeout = 'nccl' if torch.cuda.is_available() else 'gloo', datetime.timedelta(seconds=timeout_s)
    # NCCL: the group is bound to this rank's GPU (its barriers use it; without it torch warns that they take
    # the current device), and its communicator is made here, so a broken NCCL fails at the start
    bound = dict(device_id=torch.device(device)) if torch.cuda.is_available() else {}
    if 'RANK' in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout, **bound)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, store=dist.HashStore(), rank=0,
                                world_size=1, **bound)
    _GROUP_IS_OURS = JOINED = True
    return dist.get_rank(), local_rank, dist.get_world_size(), device


def finish_distributed(cfg=None):
    """Leave together: every rank's peak memory reported (with cfg: one line, and one row in log.jsonl), then
    a barrier, then tear down the group init_distributed made (tearing gloo down under a peer still inside a
    collective can abort it)."""
    global _GROUP_IS_OURS
    if cfg is not None and dist.is_initialized():
        on_gpu = cfg.device.startswith('cuda')
        rows = [None] * dist.get_world_size()
        mine = (peak_memory_bytes(cfg.device), None if on_gpu else added_resident_bytes())
        dist.all_gather_object(rows, mine)
        if dist.get_rank() == 0:
            peaks, added = [p for p, _ in rows], [a for _, a in rows]
            print(peak_memory_line(peaks, added, on_gpu), flush=True)
            with open(os.path.join(cfg.out_dir, 'log.jsonl'), 'a') as f:
                row = {'peak_mem_bytes_by_rank': peaks, 'mem_added_bytes_by_rank': added}
                f.write(json.dumps(row) + '\n')
    if dist.is_initialized() and _GROUP_IS_OURS:
        dist.barrier()
        dist.destroy_process_group()
        _GROUP_IS_OURS = False


def peak_memory_line(peaks, added, on_gpu):
    """The line a distributed run ends with: every rank's peak, and on a CPU what the run added to each."""
    mib = lambda values: ', '.join(f"{v / 2**20:.0f}" for v in values)
    line = (f"peak memory per rank ({'allocated on the GPU' if on_gpu else 'resident set'}, measured): "
            f"{mib(peaks)} MiB; the largest {max(peaks) / 2**20:.0f} MiB")
    if None in added:
        return line
    return line + f"; by the run: {mib(added)} MiB, the largest {max(added) / 2**20:.0f} MiB"


def world_size_from_env():
    """WORLD_SIZE as torchrun sets it (1 without torchrun): known before the process group exists, so bad
    combinations can be rejected before any work."""
    return int(os.environ.get('WORLD_SIZE', '1'))


# The two collectives, as gloo's memory needs them. gloo's all-gather receives into a full-size temporary of
# its own and copies it out: with a 50 MB block, 50 MB more at the peak per gather in flight. Its send/recv
# use the tensor's own memory, so each rank sends its chunk straight to every other rank and receives theirs
# straight into their slots of `full`: a ring's bytes ((N-1)/N of full per rank), all posted at once, and no
# temporary.

def all_gather_direct(comm, full, shard, tag):
    """full (contiguous, N equal chunks) = every rank's shard in rank order, posted asynchronously: returns
    the works. On gloo, sends and receives (tag keeps apart the gathers in flight at once, one per bucket).
    Other backends (NCCL) all-gather into full with no temporary; there, sends posted before receives on
    both sides could also deadlock."""
    if comm.size > 1 and dist.get_backend(comm.group) != 'gloo':
        return [comm.all_gather(full, shard, async_op=True)]
    full.chunk(comm.size)[comm.rank].copy_(shard)
    if comm.size == 1:
        return []
    comm.count('all_gather', full)  # counted as the all-gather it is
    works = []
    for peer in range(comm.size):
        if peer != comm.rank:
            to = comm.global_rank(peer)
            works += [dist.isend(shard, to, group=comm.group, tag=tag),
                      dist.irecv(full.chunk(comm.size)[peer], to, group=comm.group, tag=tag)]
    return works


def default_bucket_size(stage):
    """zero.py's gradient bucket, in elements. Stages 0-1 keep every gradient anyway: DDP's 25 MiB (of fp32),
    so no more collectives (each a fixed latency) than DDP; stage 2 holds full-size gradients one bucket at a
    time: small ones keep them small. (bench.py's predicted step counts the same buckets.)"""
    return 25 * 2**20 // 4 if stage <= 1 else 100_000


def reduce_scatter_of(comm, full):
    """This rank's chunk of the sum over ranks of full (N equal chunks), asynchronously: returns (work,
    chunk). gloo's reduce-scatter is an all-reduce of a full-size clone of its input, then a copy of the chunk
    out. full is thrown away after this, so on gloo it is all-reduced in place and the chunk is a view of it:
    the bytes gloo sends anyway, and no temporary. Other backends (NCCL) have a true reduce-scatter, which
    sends half as much."""
    if comm.size > 1 and dist.get_backend(comm.group) == 'gloo':
        comm.count('reduce_scatter', full)  # counted as the reduce-scatter the algorithm asks for
        return dist.all_reduce(full, group=comm.group, async_op=True), full.chunk(comm.size)[comm.rank]
    out = torch.empty(full.numel() // comm.size, dtype=full.dtype, device=full.device)
    return comm.reduce_scatter(out, full, async_op=True), out


def return_freed_buffers_to_the_os(threshold=1 << 20):
    """glibc's malloc serves a block of at least M_MMAP_THRESHOLD bytes with its own mmap, and free gives it
    back to the OS. But the threshold is dynamic: each such block freed raises it to the block's size (up to
    32 MB), and from then on blocks under it come from the heap, whose freed pages stay resident. ZeRO frees
    and reallocates block-sized buffers all through a step, so the heap grew step after step (4 ranks, a 100
    MB model: a resident peak 2.0-2.4x the rank's tensors). A fixed threshold turns the dynamic one off:
    buffers of 1 MB or more are mapped and unmapped with their tensors, smaller ones stay on the fast heap."""
    import ctypes  # (here, not at the top: only glibc has mallopt)
    try:
        ctypes.CDLL('libc.so.6').mallopt(-3, threshold)  # -3: M_MMAP_THRESHOLD, glibc's malloc.h
    except OSError:
        pass  # not glibc (macOS, musl): their allocators do not keep a dynamic threshold
