"""
The measured step's observer: the one seam between the training loop and what is measured. On a step that
training.measured_step names (the run's first, every --measure_every-th), training.run_step hands the step to
measured_step here instead of running it alone. The observer for the script's kind (run.kind) attaches its
meters to the public parts the script put in `run` (its Comms, what its engine says it holds, its model's
modules, its pipeline stage), runs the step, takes them off and hands the numbers to the script's table in
reports.py. The idea files name nothing of this, and on every other step none of it exists.

What each kind reads: zero: run.zero (Zero.held: the tensors it holds), what autograd saves and run.comms;
tensor_parallel: the model's first block (the bytes it saves for backward) and run.tp; pipeline and
parallel_4d: run.stage, whose ops it times (stage.observer); context_parallel: run.cp (its Comm, timed) and
the model's attention layers; expert_parallel: run.optimizer (the gradients it is handed); fsdp: the model,
run.optimizer and the process's sockets.
"""

import contextlib
import weakref
from collections import Counter

import torch

from common import reports
from common.distributed import Comm
from common.measure import (ScheduleClock, WaitClock, WireMeter, first_block_saved_bytes, fsdp_grad_bytes,
                            nbytes)


def measured_step(run, cfg, iter_num):
    """run.step(iter_num), observed by its kind's observer; returns the step's loss."""
    return OBSERVERS[run.kind](run, cfg, iter_num)


@contextlib.contextmanager
def counting(comms, at_each_call=None):
    """The step's bytes: every Comm's counts from zero (counted at our calls), and what this rank's own
    sockets send (WireMeter: measured), from before the step to after it. at_each_call(): called as each
    collective is posted (to sample what the rank holds then). Yields the meter; .sent is set at the end."""
    for comm in comms:
        comm.clear()
        comm.observe = at_each_call
    wire = WireMeter()
    wire.start()
    try:
        yield wire
    finally:
        for comm in comms:
            comm.observe = None
    wire.sent = wire.stop()


def saved_while_alive():
    """Measured activations as they live: saved_tensors_hooks keep a weak reference to each tensor autograd
    saves for backward (it dies once backward has used it, unless something else holds it). Use `with hooks:`
    around the step; alive(skip) is the bytes of the distinct storages alive now, less skip's (the
    parameters': a Linear saves its weight too). Returns (hooks, alive)."""
    saved = []

    def alive(skip=()):
        storages = {}
        for ref in saved:
            t = ref()
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        for t in skip:
            storages.pop(None if t is None else t.untyped_storage().data_ptr(), None)
        saved[:] = [ref for ref in saved if ref() is not None]
        return sum(storages.values())
    pack = lambda t: saved.append(weakref.ref(t)) or t  # (the tensor itself, kept as it is)
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), alive


def observe_zero(run, cfg, iter_num):
    """zero.py: the bytes this rank holds (Zero.held) and the activations saved for backward, sampled as each
    collective is posted and after each gradient is taken (the step's peak) and at rest after the step, beside
    the ZeRO formula; the bytes sent."""
    zero, peak = run.zero, Counter()
    saving, alive = saved_while_alive()

    def sample(*_):
        held = zero.held()
        for kind, value in reports.held_bytes(held).items():
            peak[kind] = max(peak[kind], value)
        peak['saved_bytes'] = max(peak['saved_bytes'], alive(held['param']))
    hooks = [p.register_post_accumulate_grad_hook(sample) for p in run.model.parameters()]
    try:
        with counting(run.comms, sample) as wire, saving:
            loss = run.step(iter_num)
    finally:
        for hook in hooks:
            hook.remove()
    at_rest = reports.held_bytes(zero.held())
    sample()
    reports.zero_step(zero, run.comms[0], cfg, iter_num, at_rest, peak, wire.sent, wire.why_not)
    return loss


def observe_tensor_parallel(run, cfg, iter_num):
    """tensor_parallel.py: the bytes one layer keeps for backward (the first block, in the step's first
    micro-batch) and this rank's parameter bytes, beside this code's count and Megatron's; the tp and dp
    traffic (run.tp: the TensorParallel whose group it counts)."""
    with first_block_saved_bytes(run.model) as saved, counting(run.comms) as wire:
        loss = run.step(iter_num)
    params = sum(p.numel() * p.element_size() for p in run.model.parameters())
    reports.tensor_parallel_step(iter_num, cfg, run.model.config, params, run.tp, run.comms[1], saved.bytes,
                                 wire.sent, wire.why_not)
    return loss


@contextlib.contextmanager
def timing_schedules(stage):
    """The stage's ops timed for one step (stage.observer: a ScheduleClock, the schedule's timeline). Its
    barrier and MAX all-reduce go through a Comm of their own over the pp group: they measure, so the
    algorithm's counts leave them out."""
    clock = ScheduleClock(stage, Comm(stage.comm.group, 'pp clock', alone=stage.comm.size == 1))
    stage.observer = clock
    try:
        yield clock
    finally:
        stage.observer = None


def observe_pipeline(run, cfg, iter_num):
    """pipeline.py: each stage's schedule timed op by op (the timeline, the bubble), the microbatches and
    activation bytes it held, the bytes it sent, beside the formulas."""
    with counting(run.comms) as wire, timing_schedules(run.stage) as clock:
        loss = run.step(iter_num)
    reports.report_pipeline(run.stage, clock, cfg, run.comms, wire, iter_num, run.rank, run.dp.rank)
    return loss


def observe_4d(run, cfg, iter_num):
    """parallel_4d.py: the grid's stage timed as pipeline.py's is; each rank's model states (its ZeRO-1
    engine's held tensors), activations at the schedules' peak and bytes sent along every dimension."""
    with counting(run.comms) as wire, timing_schedules(run.stage) as clock:
        loss = run.step(iter_num)
    reports.report_4d(clock, run.zeros, run.comms, wire, cfg, run.coords, iter_num, run.rank)
    return loss


def observe_context_parallel(run, cfg, iter_num):
    """context_parallel.py: the bytes one layer keeps for backward (this rank's tokens), the bytes the
    attention sends, and the attention layers' time split into computing and waiting on the cp group: for the
    step a WaitClock stands in for run.cp.group (the ContextParallel's Comm) and times every wait on it."""
    cp, comm = run.cp, run.cp.group
    with first_block_saved_bytes(run.model) as saved, counting(run.comms) as wire:
        cp.group = clock = WaitClock(comm, run.model)
        try:
            loss = run.step(iter_num)
        finally:
            cp.group = comm
            for hook in clock.hooks:
                hook.remove()
    reports.report_context_parallel(cfg, run.model.config, cp.attention, comm, run.comms[1], iter_num,
                                    saved.bytes, wire.sent, wire.why_not, clock)
    return loss


def observe_expert_parallel(run, cfg, iter_num):
    """expert_parallel.py: the tokens each expert and each rank got, the all-to-alls' bytes (counted, and the
    uniform-routing formula), each rank's model states (its gradients read as AdamW is handed them)."""
    seen = {}
    hook = run.optimizer.register_step_pre_hook(lambda *_: seen.update(grad_bytes=nbytes(
        p.grad for p in run.model.parameters() if p.grad is not None)))
    try:
        with counting(run.comms) as wire:
            loss = run.step(iter_num)
    finally:
        hook.remove()
    reports.report_expert_parallel(iter_num, cfg, run.model, run.optimizer, run.comms,
                                   dict(seen, wire_bytes=wire.sent), wire.why_not)
    return loss


def observe_fsdp(run, cfg, iter_num):
    """train_fsdp.py: the bytes in each rank's shards beside ZeRO-3's formula, and the most gradient bytes it
    held: sampled before each micro-step's forward (what the backward before it left: FSDP2 keeps unsharded
    gradients while it accumulates without syncing) and as AdamW is handed the reduce-scattered shards; the
    bytes one layer keeps for backward; the bytes sent."""
    seen = {'peak_grad_bytes': 0, 'grad_bytes': 0}

    def sample(*_):
        now, peak = fsdp_grad_bytes(run.model), seen["peak_grad_bytes"]
        seen['peak_grad_bytes'] = None if now is None or peak is None else max(peak, now)

    def before_step(*_):
        sample()
        seen['grad_bytes'] = nbytes(p.grad for p in run.model.parameters())
    hooks = [run.model.register_forward_pre_hook(sample), run.optimizer.register_step_pre_hook(before_step)]
    try:
        # (torch's FSDP2 makes its own calls: only the rank's sockets see them)
        with first_block_saved_bytes(run.model) as saved, counting([run.dp]) as wire:
            loss = run.step(iter_num)
    finally:
        for hook in hooks:
            hook.remove()
    reports.report_fsdp(cfg, iter_num, run.model, run.optimizer, dict(seen, activation_bytes=saved.bytes),
                        cfg.gradient_accumulation_steps // run.n_devices, wire)
    return loss


OBSERVERS = {'zero': observe_zero, 'tensor_parallel': observe_tensor_parallel, 'pipeline': observe_pipeline,
             'parallel_4d': observe_4d, 'context_parallel': observe_context_parallel,
             'expert_parallel': observe_expert_parallel, 'fsdp': observe_fsdp}
