"""
This machine's measured rates, at which common/step_time.py prices a bench row's step: one process's compute
on the model (measure_compute; with its buffers mapped afresh, as zero.py's stage 3 and train_fsdp.py run:
measure_mapped; the MoE model's: moe_rates), each kind of collective's time on gloo at each size (a short
sweep: sweep_rounds, each call posted after some compute as in training), the wait for the slower rank that a
call adds after more compute (waits_after_compute), both again with a grid's processes all computing and
calling at once (crowded_rates), context_parallel.py's ring attention of one layer timed alone
(ring_attention_seconds: its blocks' attention in small ops of its own, which the FLOPs rate does not price),
a tensor_parallel.py rank's pass timed alone on its slices (tp_pass_seconds: narrower matmuls, f's and g's
copies), and a train_fsdp.py rank's pass and update timed alone in a world of one (fsdp_seconds: FSDP2's
hooks, copies and DTensors).
They are kept in the bench's out folder (machine.json; the sweep's in sweep.json) and measured again when the
model, the processes, the cores or torch change, or with --remeasure.
"""

import json
import os
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.distributed import all_gather_single, return_freed_buffers_to_the_os
from common.training import first_sentence
from model import GPT

VERSION = 13  # of machine.json: a file from another version is measured again
SIZES = (16 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20)  # bytes per call in the sweep
KINDS = ('all_reduce', 'all_gather', 'send', 'all_to_all')
GAPS = (1, 3, 10, 30)  # waits_after_compute: the compute before a call, in the sweep's ~1 ms units


def timed(fn, reps, between=None, average=statistics.median):
    """The median (or another average) seconds of reps calls of fn, after one to warm it up; between() runs
    untimed before each."""
    fn()
    times = []
    for _ in range(reps):
        if between is not None:
            between()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return average(times)


def measure_compute(config, batch_size, threads, reps=15):
    """One process with `threads` threads on the model, as a latency and a rate: a forward and backward timed
    on the whole micro-batch and on one short sequence, t = fixed + FLOPs / rate (the fixed part is the ops'
    own cost, which a strategy that cuts the work into pieces pays on every piece); and the seconds of the
    update (clip, AdamW's step), each the median of reps timings (15: in three quick benches on 2 idle cores
    the train row was then predicted within 3% of its step; with 5, from -4% to +15% in seven).
    model.flops_per_token counts the FLOPs."""
    torch.set_num_threads(threads)
    model = GPT(config)
    optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.99), 'cpu')
    points = []
    for rows, tokens in ((batch_size, config.block_size), (1, max(1, config.block_size // 8))):
        x = torch.randint(0, config.vocab_size, (rows, tokens))
        seconds = timed(lambda: model(x, x)[1].backward(), reps)
        points.append((model.flops_per_token(tokens) * rows * tokens, seconds))
    (f1, t1), (f0, t0) = points
    rate = (f1 - f0) / max(t1 - t0, 1e-9)
    return {'flops_per_s': rate, 'pass_fixed_s': max(t0 - f0 / rate, 0.0),
            'update_s': update_seconds(model, optimizer, reps)}


def update_seconds(model, optimizer, reps):
    """The median seconds of a step's update, as the scripts make it: the clip, then the optimizer's step."""
    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return timed(update, reps)


def _mapped(_, config, batch_size, threads, out):
    """measure_compute with malloc mapping each buffer of 1 MB or more afresh, as zero.py's stage 3 and
    train_fsdp.py run, and the seconds a byte of a fresh buffer takes to fill; in a process of its own
    (measure_mapped spawns it: malloc's setting cannot be undone)."""
    return_freed_buffers_to_the_os()
    rates, block = measure_compute(config, batch_size, threads), torch.ones(8 << 18)  # (8 MiB)
    rates['fresh_s_per_byte'] = timed(lambda: torch.empty_like(block).copy_(block), 10) / (8 << 20)
    with open(out, 'w') as f:
        json.dump(rates, f)


def measure_mapped(config, batch_size, threads, folder):
    """_mapped's rates: compute with buffers mapped afresh, and a fresh buffer's fill."""
    mp.spawn(_mapped, args=(config, batch_size, threads, os.path.join(folder, 'mapped.json')), nprocs=1)
    return json.load(open(os.path.join(folder, 'mapped.json')))


def sweep_rounds(group=None, kinds=KINDS):
    """Each kind of collective at each size among the ranks of `group` (None: the world), each call posted
    after some compute, as a training step posts it (gloo's threads, idle meanwhile, must wake: on 2 busy CPU
    cores that doubled a small all-reduce's time); a send between the group's first two ranks. All-reduces
    and all-gathers also in bursts, posted back to back as a ZeRO engine posts its buckets (' burst'). In 5
    rounds of every kind and size, so that a busy spell of the machine falls on them alike (one round's 512
    KiB all-reduce, as the median of its calls: 0.6 to 2.9 ms from run to run). A round's time is the mean of
    its calls, not their median: a step pays for every call, one that waited long for a thread to wake
    included (a 512 KiB all-reduce after 1 ms of compute: a median of 0.9 ms, a mean of 1.6 to 2.2). Returns
    {'kind bytes': the median of the rounds' means}."""
    ranks, me = dist.get_process_group_ranks(group or dist.group.WORLD), dist.get_rank()
    rounds, a = {}, torch.randn(256, 256)
    compute = lambda: [a @ a for _ in range(3)]  # about a millisecond
    for nbytes in [n for _ in range(5) for n in SIZES]:
        t = torch.ones(nbytes // 4)
        full = torch.empty(t.numel() * len(ranks))
        send = {ranks[0]: lambda: dist.send(t, ranks[1]), ranks[1]: lambda: dist.recv(t, ranks[0])}.get(
            me, lambda: None)
        calls = {'all_reduce': lambda: dist.all_reduce(t, group=group), 'send': send,
                 'all_gather': lambda: all_gather_single(full, t, group=group),
                 'all_to_all': lambda: dist.all_to_all_single(full[:t.numel()], t, group=group)}
        posted = {'all_reduce': lambda: dist.all_reduce(t, group=group, async_op=True),
                  'all_gather': lambda: all_gather_single(full, t, group=group, async_op=True)}
        for kind in kinds:
            dist.barrier()
            rounds.setdefault(f'{kind} {nbytes}', []).append(timed(calls[kind], 8, compute, statistics.mean))
            if kind in posted:  # a burst: 4 posted back to back, then waited for (a call's share of it)
                burst = lambda: [work.wait() for work in [posted[kind]() for _ in range(4)]]
                seconds = timed(burst, 4, compute, statistics.mean) / 4
                rounds.setdefault(f'{kind} burst {nbytes}', []).append(seconds)
    return {key: statistics.median(times) for key, times in rounds.items()}


def waits_after_compute(group=None):
    """How much longer a call takes the longer the ranks computed since their last one: a 16 KiB all-reduce
    (nearly all latency) after GAPS x the sweep's ~1 ms of compute, the median over 10 rounds of each round's
    mean call. That is what is measured; the presumed cause is that the ranks drift apart over a longer
    stretch of compute on shared cores, so the first to call waits for the other (gloo's threads sleeping
    longer may add to it). Noisy: in nine sweeps on 2026-12-05, 0 to 1.3 ms more after 10 ms of compute,
    1.0 to 2.1 ms after 30. Returns [(the compute's seconds, the call's seconds beyond the first gap's)]."""
    a, t = torch.randn(256, 256), torch.ones(4096)
    compute = lambda: [a @ a for _ in range(3)]  # (sweep_rounds' unit: about a millisecond)
    unit_s, rounds = timed(compute, 10), {}
    for _ in range(10):
        for k in GAPS:
            dist.barrier()
            rounds.setdefault(k, []).append(timed(lambda: dist.all_reduce(t, group=group), 8,
                                                  lambda: [compute() for _ in range(k)], statistics.mean))
    call_s = {k: statistics.median(times) for k, times in rounds.items()}
    return [(k * unit_s, max(0.0, call_s[k] - call_s[GAPS[0]])) for k in GAPS]


def _sweep(rank, world_size, port, threads, out):
    """One rank of the sweep (sweep_rounds among all of them, then waits_after_compute); rank 0 writes the
    times."""
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group('gloo', rank=rank, world_size=world_size)
    seconds, waits = sweep_rounds(), waits_after_compute()
    if rank == 0:
        with open(out, 'w') as f:
            json.dump({'calls': seconds, 'waits': waits}, f)
    dist.barrier()
    dist.destroy_process_group()


def moe_rates(folder, rates, config, batch_size, threads):
    """The MoE model's compute rates (its experts' loop costs what a dense MLP does not) beside rates'
    collectives and waits, kept in machine.json's 'moe' entry (measured again with the rest)."""
    key = [config.n_layer, config.n_embd, config.n_expert, config.n_expert_active, batch_size]
    if rates.get('moe', {}).get('key') != key:
        rates['moe'] = dict(measure_compute(config, batch_size, threads), key=key)
        with open(os.path.join(folder, 'machine.json'), 'w') as f:
            json.dump(rates, f, indent=1)
    return dict(rates['moe'], collectives=rates['collectives'], waits=rates['waits'])


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def measure_collectives(world_size, threads, folder):
    """Each kind of collective's [(bytes, seconds)] on gloo among world_size processes of this machine, and
    waits_after_compute's [(seconds of compute, seconds a call waits more)]."""
    out = os.path.join(folder, 'sweep.json')
    mp.spawn(_sweep, args=(world_size, free_port(), threads, out), nprocs=world_size)
    swept = json.load(open(out))
    return tables(swept['calls']), swept['waits']


def tables(seconds):
    """sweep_rounds' {'kind bytes': seconds} as {kind: [(bytes, seconds)], sizes ascending}."""
    kinds = dict.fromkeys(key.rsplit(' ', 1)[0] for key in seconds)
    return {kind: [(n, seconds[f'{kind} {n}']) for n in SIZES] for kind in kinds}


def _crowded(rank, n, port, configs, batch_size, out):
    """One of n one-thread processes measuring at once, as a grid row's n processes share this machine's
    cores: measure_compute on each model in configs (every process at once), then the sweep in groups of 2
    and of 4 ranks (each group calling at once with the others). Rank 0 writes the medians over the ranks."""
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group('gloo', rank=rank, world_size=n)
    mine = {}
    for name, config in configs.items():
        dist.barrier()
        mine[name] = measure_compute(config, batch_size, 1, reps=5)  # (the median over n ranks besides)
    for size, kinds in ((2, KINDS), (4, ('all_reduce', 'all_gather'))):
        groups = [dist.new_group(list(range(i, i + size))) for i in range(0, n, size)]  # (every rank: all)
        measured = tables(sweep_rounds(groups[rank // size], kinds)).items()
        mine['collectives'] = dict(mine.get('collectives', {}),
                                   **{kind + ('' if size == 2 else ' x4'): table for kind, table in measured})
    every = [None] * n
    dist.all_gather_object(every, mine)
    if rank == 0:
        median = lambda values: statistics.median(values)
        crowded = {name: {k: median(r[name][k] for r in every) for k in mine[name]} for name in configs}
        crowded['collectives'] = {kind: [(b, median(r['collectives'][kind][i][1] for r in every))
                                         for i, (b, _) in enumerate(table)]
                                  for kind, table in mine['collectives'].items()}
        with open(out, 'w') as f:
            json.dump(crowded, f)
    dist.barrier()
    dist.destroy_process_group()


def crowded_rates(folder, rates, n, configs, batch_size):
    """The rates of n processes sharing this machine's cores at once (_crowded): each model's compute in
    configs ({'dense': ..., 'moe': ...}) and the collectives among groups of 2 and 4 ranks, kept in
    machine.json's 'crowded' entry (measured again with the rest)."""
    moe = configs.get('moe')
    key = [n, sorted(configs), moe and [moe.n_expert, moe.n_expert_active]]
    if rates.get('crowded', {}).get('key') != key:
        out = os.path.join(folder, 'crowded.json')
        mp.spawn(_crowded, args=(n, free_port(), configs, batch_size, out), nprocs=n)
        rates['crowded'] = dict(json.load(open(out)), key=key)
        with open(os.path.join(folder, 'machine.json'), 'w') as f:
            json.dump(rates, f, indent=1)
    return rates['crowded']


class CopyRing:
    """A ring of one process, for timing a ring's own compute: what rank 0 sends comes straight back as the
    block it receives (a Comm's rank, size, global_rank and send_recv, without the network)."""

    def __init__(self, size):
        self.rank, self.size = 0, size

    def global_rank(self, rank):
        return rank

    def send_recv(self, sends, recvs, kind=None):
        for (tensor, _), (buffer, _) in zip(sends, recvs):
            buffer.copy_(tensor)
        return [], []


def ring_attention_seconds(cp_script, config, batch_size, world_size, threads):
    """The seconds of one layer's ring attention on rank 0 of world_size ranks, forward and backward, on a
    bench micro-batch (batch_size sequences, the rank's two chunks of each): the ring's blocks and merges as
    context_parallel.py computes them (cp_script: that module, handed in by bench.py, as a helper imports no
    script), its exchanges replaced by copies (CopyRing): its compute alone."""
    torch.set_num_threads(threads)
    head, tokens = config.n_embd // config.n_head, config.block_size // world_size
    cp = SimpleNamespace(group=CopyRing(world_size),
                         positions=cp_script.zigzag_positions(config.block_size, world_size, 0))
    q, k, v = (torch.randn(batch_size, n, tokens, head, requires_grad=True)
               for n in (config.n_head, config.n_kv_head or config.n_head, config.n_kv_head or config.n_head))
    return timed(lambda: cp_script.RingAttention.apply(q, k, v, cp).sum().backward(), 10)


class StillTP:
    """A tp group of one process, for timing a tp rank's own compute: rank 0 of size ranks, whose collectives
    leave its tensors as they are (an all-reduce does nothing; a gather repeats the rank's chunk, a
    reduce-scatter keeps the first): a Comm's rank, size and calls, without the network."""

    def __init__(self, size):
        self.rank, self.size = 0, size

    def all_reduce(self, x, *args, **kwargs):
        return None

    def all_gather(self, full, shard, async_op=False):  # (written once, as the real gather writes it)
        full.view(self.size, *shard.shape).copy_(shard.expand(self.size, *shard.shape))

    def reduce_scatter(self, out, full, async_op=False):
        out.copy_(full[:out.size(0)])


def tp_pass_seconds(tp_script, config, batch_size, world_size, threads, sequence_parallel=False):
    """The seconds of a tp rank's forward and backward of one bench micro-batch on its slices of the model, as
    tensor_parallel.py shards and runs it (tp_script: that module, handed in by bench.py), its collectives
    replaced by StillTP's: its compute alone. Its matmuls are 1/world_size as wide as the whole model's, g
    copies the activations and f their gradients, so it may run below the rate measure_compute measured on the
    whole model (on the quick model it does; on the 512-wide one hardly)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = GPT(config)
    tp = tp_script.TensorParallel(StillTP(world_size), sequence_parallel)
    tp_script.shard_gpt(model, tp)
    idx = torch.randint(config.vocab_size, (batch_size, config.block_size))
    return timed(lambda: tp_script.tp_forward(model, idx, idx, tp)[1].backward(), 10)


def time_alone(rates, parts, rounds=3):
    """rates[key] for each {key: measure} of parts (measure() the seconds of a part of a step, timed alone):
    in `rounds` rounds, the parts taking turns, each part's median kept. A slow spell of a shared machine of
    a few seconds then falls on one round of a part, not on all of them (in one quick bench the ring's
    attention, timed once, took 9.2 ms a layer in such a spell, 4.0 to 4.9 in ten others); one of tens of
    seconds still moves them all (step_time.speed_moved says so when it shows in the train row). A part whose
    timing fails loses its price alone (its row is priced without it); rates['not_timed'][key] says why."""
    times = {key: [] for key in parts}
    for _ in range(rounds):
        for key in [key for key in parts if key in times]:  # (a part that failed is not timed again)
            try:
                times[key].append(parts[key]())
            except Exception as e:
                rates.setdefault('not_timed', {})[key] = f"{type(e).__name__}: {first_sentence(e)}"
                del times[key]
    rates.update({key: statistics.median(seconds) for key, seconds in times.items()})


def _fsdp_alone(_, shard_model, config, batch_size, threads, out):
    """An FSDP2 rank's own compute, in a world of one: the model sharded by shard_model (train_fsdp.py's,
    handed in by bench.py), its pass (fsdp_pass_s: a forward and backward of one bench micro-batch) and its
    update (fsdp_update_s: the clip and AdamW's step on its DTensors), timed in rounds, taking turns
    (time_alone). In a world of one its gathers and reduce-scatters copy and the clip's all-reduce returns:
    FSDP2's hooks, its copies in and out and its DTensors' dispatch, without the network (its shards are whole
    tensors here: the copy into a gather and a reduce-scatter's output are w times a w-rank world's, a little
    over-priced). In a process of its own: shard_model maps buffers afresh, which cannot be undone."""
    torch.set_num_threads(threads)
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = shard_model(GPT(config), 'cpu', 1, 'float32')
    idx = torch.randint(config.vocab_size, (batch_size, config.block_size))
    optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.99), 'cpu')
    model(idx, idx)[1].backward()  # (gradients for the update to clip)
    seconds = {}
    time_alone(seconds, {'fsdp_pass_s': lambda: timed(lambda: model(idx, idx)[1].backward(), 10),
                         'fsdp_update_s': lambda: update_seconds(model, optimizer, 15)})
    dist.destroy_process_group()
    with open(out, 'w') as f:
        json.dump(seconds, f)


def fsdp_seconds(shard_model, config, batch_size, threads, folder):
    """_fsdp_alone's {'fsdp_pass_s': seconds, 'fsdp_update_s': seconds} (a part whose timing failed, in
    'not_timed', as time_alone says it), timed in a process of its own."""
    out = os.path.join(folder, 'fsdp.json')
    try:
        mp.spawn(_fsdp_alone, args=(shard_model, config, batch_size, threads, out), nprocs=1)
    except mp.ProcessRaisedException as e:  # (its message is the process's traceback: the last line says why)
        raise RuntimeError([line for line in str(e).splitlines() if line.strip()][-1]) from None
    return json.load(open(out))


def time_fsdp(rates, shard_model, config, batch_size, threads, folder):
    """rates' fsdp_pass_s and fsdp_update_s (fsdp_seconds'), timed in 3 rounds in one process; a part that
    fails there is left out, and rates['not_timed'] says why (as time_alone does); where the process fails
    (it raised, or died), both are, with its why."""
    try:
        seconds = fsdp_seconds(shard_model, config, batch_size, threads, folder)
    except Exception as e:
        why = f"{type(e).__name__}: {first_sentence(e)}"
        seconds = {'not_timed': dict.fromkeys(('fsdp_pass_s', 'fsdp_update_s'), why)}
    not_timed = {**rates.pop('not_timed', {}), **seconds.pop('not_timed', {})}
    rates.update(seconds, **({'not_timed': not_timed} if not_timed else {}))


def machine_rates(folder, config, batch_size, world_size, threads, remeasure=False, cp_script=None,
                  tp_script=None, fsdp_shard=None):
    """The measured rates (measure_compute's, each kind of collective's times; with cp_script, the ring
    attention's; with tp_script, a tp rank's pass, with and without sequence parallelism; with fsdp_shard
    (train_fsdp.shard_model), an FSDP2 rank's pass and its update), from
    folder/machine.json when it was measured for this model, these processes and this torch; else measured now
    (seconds) and kept."""
    key = {'version': VERSION, 'model': [config.n_layer, config.n_head, config.n_embd, config.block_size,
                                         batch_size, config.n_expert, config.n_expert_active],
           'world_size': world_size, 'threads': threads, 'torch': torch.__version__, 'cpus': os.cpu_count(),
           'ring': cp_script is not None, 'tp': tp_script is not None, 'fsdp': fsdp_shard is not None}
    path = os.path.join(folder, 'machine.json')
    if not remeasure and os.path.exists(path):
        kept = json.load(open(path))
        if kept.get('key') == key:
            return kept
    os.makedirs(folder, exist_ok=True)
    collectives, waits = measure_collectives(world_size, threads, folder) if world_size > 1 else ({}, [])
    rates = dict(measure_compute(config, batch_size, threads), key=key, collectives=collectives, waits=waits,
                 mapped=measure_mapped(config, batch_size, threads, folder))
    parts = {}
    if cp_script is not None and world_size > 1 and config.block_size % (2 * world_size) == 0:  # (cp's rule)
        parts['ring_attention_s'] = lambda: ring_attention_seconds(cp_script, config, batch_size, world_size,
                                                                   threads)
    for sp in (False, True) if tp_script is not None and world_size > 1 else ():
        parts['tp_sp_pass_s' if sp else 'tp_pass_s'] = \
            lambda sp=sp: tp_pass_seconds(tp_script, config, batch_size, world_size, threads, sp)
    time_alone(rates, parts)
    if fsdp_shard is not None:
        time_fsdp(rates, fsdp_shard, config, batch_size, threads, folder)
    with open(path, 'w') as f:
        json.dump(rates, f, indent=1)
    return rates
