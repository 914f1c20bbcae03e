"""
A rank's memory, limited by the kernel (--memory_limit_mib): as a GPU's memory caps a GPU rank, a memory
cgroup caps a process, and the kernel kills the process (SIGKILL, exit code -9) whose memory goes over it.
Each rank joins a cgroup of its own as its run starts, so the limit covers what the rank allocates from then
on (the parameters, gradients, optimizer state, activations, buffers): torch's own libraries, loaded before,
stay outside it, as they stay outside a GPU's memory. A killed process says nothing, so a small watcher
process started beside each rank says it in one line, and removes the cgroup when the rank ends.

Needs a memory cgroup this process may create (Linux, as root: cgroup v1, or v2 where the process's own
cgroup may hold children); elsewhere --memory_limit_mib is refused in one line.
"""

import os
import subprocess
import sys

from common.distributed import load_meta_kernels, return_freed_buffers_to_the_os

MiB = 1 << 20

# Run by the watcher (a fresh interpreter, outside the rank's cgroup): wait for the rank's end (its pipe
# closes), read the cgroup's count of kernel kills, say so when there was one, and remove the cgroup.
WATCHER = r"""
import os, sys, time
group, rank, limit_mib, version = sys.argv[1:5]
import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun stopping the ranks: finish first
sys.stdin.buffer.read()
events = open(os.path.join(group, 'memory.events' if version == '2' else 'memory.oom_control')).read().split()
peak = os.path.join(group, 'memory.peak' if version == '2' else 'memory.max_usage_in_bytes')
peak = f"{int(open(peak).read()) / 2**20:.0f} MiB" if os.path.exists(peak) else 'not kept by this kernel'
if events[events.index('oom_kill') + 1] != '0':
    sys.stderr.write(f"[rank {rank}] error: killed by the kernel: its memory went over the {limit_mib} MiB "
                     f"limit (--memory_limit_mib={limit_mib}, a memory cgroup)\n")
else:
    sys.stderr.write(f"[rank {rank}] memory at its peak (the kernel's count, file pages included): {peak} "
                     f"of its {limit_mib} MiB limit\n")
for _ in range(100):  # the rank closed its end as it exited: wait until it has left the cgroup
    if not open(os.path.join(group, 'cgroup.procs')).read():
        break
    time.sleep(0.05)
try:
    os.rmdir(group)
except OSError:
    pass
"""


def cgroup_of_this_process():
    """(version, directory of this process's memory cgroup), or (None, why) where there is none to use."""
    for line in open('/proc/self/cgroup'):
        number, controllers, path = line.rstrip('\n').split(':', 2)
        if 'memory' in controllers.split(','):
            return 1, os.path.join('/sys/fs/cgroup/memory', path.lstrip('/'))
    v2 = '/sys/fs/cgroup/cgroup.controllers'
    if os.path.exists(v2) and 'memory' in open(v2).read().split():
        path = [line.split(':', 2)[2].strip() for line in open('/proc/self/cgroup') if line.startswith('0::')]
        return 2, os.path.join('/sys/fs/cgroup', path[0].lstrip('/'))
    return None, 'this machine has no memory cgroup controller'


def make_group(version, parent, name, limit_bytes):
    """A child cgroup of parent capped at limit_bytes, swap included (a rank may not page its tensors out)."""
    group = os.path.join(parent, name)
    os.makedirs(group, exist_ok=True)
    if version == 2:
        with open(os.path.join(parent, 'cgroup.subtree_control'), 'w') as f:
            f.write('+memory')
        settings = [('memory.max', limit_bytes), ('memory.swap.max', 0)]
    else:
        settings = [('memory.limit_in_bytes', limit_bytes), ('memory.memsw.limit_in_bytes', limit_bytes)]
    for file, value in settings:
        if os.path.exists(os.path.join(group, file)):
            with open(os.path.join(group, file), 'w') as f:
                f.write(str(value))
    return group


def why_not_here():
    """None where this process can limit a rank's memory (a probe cgroup made and removed), else why not."""
    version, parent = cgroup_of_this_process()
    if version is None:
        return parent
    try:
        os.rmdir(make_group(version, parent, f"memory-limit-probe-{os.getpid()}", 64 * MiB))
    except OSError as e:
        return f"no memory cgroup can be made here ({e})"
    return None


def limit_this_rank(limit_mib, rank):
    """Move this process into a memory cgroup of its own capped at limit_mib MiB, with a watcher that reports
    a kernel kill. Refuses (SystemExit, one line) where the machine cannot."""
    version, parent = cgroup_of_this_process()
    run = os.environ.get('TORCHELASTIC_RUN_ID') or os.environ.get('MASTER_PORT') or 'single'
    try:
        if version is None:
            raise OSError(parent)
        group = make_group(version, parent, f"memory-limit-{run}-rank{rank}-{os.getpid()}", limit_mib * MiB)
    except OSError as e:
        raise SystemExit(f"error: --memory_limit_mib needs a memory cgroup this process can create (Linux, "
                         f"as root, cgroup v1 or v2): {e}")
    # torch's meta kernels (~800 Python modules, ~70 MiB) load at the first operation on the meta device (a
    # sharded script's build makes one): library code, loaded here, outside the limit, with the rest of torch
    load_meta_kernels()
    # glibc keeps freed blocks of up to 32 MiB in its heap, resident, where they would count against the limit
    return_freed_buffers_to_the_os()
    # the watcher starts outside the cgroup; the pipe's write end stays open here until this process ends
    args = [group, str(rank), str(limit_mib), str(version)]
    limit_this_rank.watcher = subprocess.Popen([sys.executable, '-c', WATCHER, *args], stdin=subprocess.PIPE)
    with open(os.path.join(group, 'cgroup.procs'), 'w') as f:
        f.write(str(os.getpid()))
