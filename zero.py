"""
ZeRO by hand, stages 0 to 3 (Rajbhandari et al. 2020): data parallelism in which the N ranks split the model
states (parameters, gradients, AdamW state) instead of each holding all of them. Every collective is written
out with torch.distributed; no DDP, FSDP or ZeroRedundancyOptimizer inside.

    torchrun --standalone --nproc_per_node=2 zero.py --stage=2   # or --deepspeed_config=config/ds_zero3.json
    python consolidate.py out-zero       # the per-rank shards -> out-zero/ckpt.pt, a train.py checkpoint

stage 0  data parallelism: gradients all-reduced bucket by bucket while backward is still running
stage 1  + optimizer state sharded: gradients reduce-scattered, each rank updates its chunk, then all-gathered
stage 2  + gradients sharded: reduce-scattered at every micro-step; a rank keeps only its chunk of them
stage 3  + parameters sharded: each block gathered just before its forward and backward, then freed (zero3.py)

Each stage is a row of the table STAGES: reduce_stage_S (a bucket's gradients, once backward made them) and
how the updated chunk gets back (publish_by_all_gather in stages 1 and 2, publish_by_copy in 0 and 3).
"""

import math
import os
from types import SimpleNamespace

import torch
import torch.nn as nn

from model import balance_routers, param_groups
from common.config import config_defaults, configure, refuse, shared_refusals
from common.data import load_dataset, micro_batches
from common.training import (autocast_context, get_lr, loss_function, outputs_line, print_sample, profiled,
                             run_main, run_shape, start_run, training_loop)
from common.checkpoints import (CheckpointWriter, buffer_pieces, check_resume_grid, checkpoint_of, init_model,
                                init_values, load_buffers, load_params, pieces_of, rank_path, restore_rng,
                                seed_dropout, set_rng_state, zero_buffers)
from common.distributed import (Comm, clip_grad_norm, default_bucket_size, finish_distributed,
                                reduce_scatter_of, world_size_from_env)
from zero3 import block_groups, end_backward, free, install_stage_3_hooks, start_sharded

# -----------------------------------------------------------------------------
# config: train.py's keys (common/config.py's TRAIN_DEFAULTS; `--help` lists them all), and these
out_dir = 'out-zero'            # each script its own folder: runs never overwrite one another
dist_timeout = 60               # seconds before a rank gives up on a dead peer
measure_every = 0               # measure and report every this many steps too; 0: the first step only
stage = 2                       # 0: DP, 1: + optimizer state sharded, 2: + gradients, 3: + parameters
bucket_size = 0                 # elements per gradient bucket in stages 0-2; 0: default_bucket_size's
offload_optimizer = False       # ZeRO-Offload: the fp32 master chunk and AdamW's state on the host (CPU)
prefetch_blocks = 1             # stage 3: gather this many blocks ahead while one computes (0: just in time)
overlap_comm = True             # reduce while backward goes on (False: wait for each; one full bucket fewer)
adam_eps = 1e-8
deepspeed_config = ''           # a DeepSpeed JSON file: its common subset overrides the flags before it
print_ds_config = False         # print this run's DeepSpeed JSON config (to take it to DeepSpeed), then exit
config = config_defaults(globals())
# -----------------------------------------------------------------------------


class Bucket:
    """Parameters laid end to end in one flat buffer, padded to a multiple of N when sharded: one collective
    moves all of them, and rank r owns the chunk [r·S, (r+1)·S), S = padded/N. Each parameter's .data is a
    view of the buffer, so a gather into it is a gather into the model. The buffers of each stage (P padded
    elements, W the working dtype, fp32 or bf16; in fp32 without offload `master` is `shard` itself):
                    stage 0             stage 1             stage 2                stage 3
      flat (W)      P, the parameters   P                   P                      P while gathered, else 0 B
      shard (W)     = flat              S, a view of flat   S, a view of flat      S, its own: the parameters
      master (fp32) P                   S                   S                      S
      grad_flat (W) P, p.grad its views P, p.grad its views -                      -
      filling (W)   -                   -                   P, filled then reduced P, filled then reduced
      grad_shard(W) -                   S, from the reduce  S, micro-steps summed  S, micro-steps summed
    """

    def __init__(self, group, decay, rank, world_size, stage, dtype, device, offload=False):
        names, params = [n for n, _ in group], [p for _, p in group]
        self.names, self.params = names, params
        self.shapes = [tuple(p.shape) for p in params]
        self.offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
        self.numel = sum(p.numel() for p in params)
        n, r = (world_size, rank) if stage >= 1 else (1, 0)  # stage 0: every rank's chunk is the whole bucket
        self.padded = math.ceil(self.numel / n) * n
        self.shard_numel, self.lo = self.padded // n, r * (self.padded // n)
        on_meta = params[0].is_meta  # built on the meta device: the values come later (Zero.set_param_values)
        flat32 = torch.zeros(self.padded, device=device)
        for p, view in zip(params, self.views(flat32) if not on_meta else ()):
            view.copy_(p.detach())
        # a chunk spans both AdamW groups (and padding): the decayed parameters are ranges of this chunk
        parts = [self.owned_part(i)[:2] for i, p in enumerate(params) if id(p) in decay]
        self.decay_ranges = [(start, end) for start, end in parts if start < end]
        self.flat = flat32.to(dtype)  # (flat32 itself in fp32)
        for p, view in zip(params, self.views(self.flat)):
            if on_meta:  # (a meta tensor's .data cannot be set: the Parameter is swapped for the view)
                torch.utils.swap_tensors(p, nn.Parameter(view))
            else:
                p.data = view
        self.shard = self.owned(self.flat).clone() if stage == 3 else self.owned(self.flat)
        self.master = self.shard if dtype == torch.float32 else self.owned(flat32).clone()
        self.grad_host = self.grad_flat = self.filling = self.grad_shard = None
        if offload:  # ZeRO-Offload: the fp32 master chunk (and AdamW's state, made like it) on the host, and
            pin = torch.cuda.is_available()  # a host buffer for the reduced gradient chunk; pinned on a GPU
            self.master = torch.empty(self.shard_numel, pin_memory=pin).copy_(self.master)  # (async copies)
            self.grad_host = torch.zeros(self.shard_numel, dtype=dtype, pin_memory=pin)
        if stage <= 1:
            self.grad_flat = torch.zeros(self.padded, dtype=dtype, device=device)
            for p, view in zip(params, self.views(self.grad_flat)):
                p.grad = view  # autograd accumulates into an existing .grad in place: it stays a view
        else:
            self.grad_shard = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        self.ready = 0  # parameters whose gradient backward has produced this micro-step
        if stage == 3:
            start_sharded(self)  # at rest a rank keeps only its chunk (zero3.py)

    def views(self, flat):
        return [flat[off:off + math.prod(s)].view(s) for off, s in zip(self.offsets, self.shapes)]

    def owned(self, flat):
        return flat[self.lo:self.lo + self.shard_numel]

    def owned_part(self, i):
        """Where parameter i meets this rank's chunk: (start, end) in the chunk, and where that is in i."""
        off = self.offsets[i]
        lo, hi = max(off, self.lo), min(off + math.prod(self.shapes[i]), self.lo + self.shard_numel)
        return lo - self.lo, hi - self.lo, lo - off

    def copy_owned(self, i, values, chunk):
        """The part of parameter i's whole values in this rank's chunk, into chunk (nothing else is read)."""
        start, end, at = self.owned_part(i)
        if start < end:
            chunk[start:end].copy_(values.reshape(-1)[at:at + end - start])


# -----------------------------------------------------------------------------
# What each stage does with a bucket's gradients (reduce_stage_S) and with its updated chunk (publish_by_*)

def reduce_stage_0(z, b):
    """Plain data parallelism: all-reduce the full gradients in place, asynchronously, so backward goes on
    meanwhile; every rank gets the whole average and updates everything."""
    b.grad_flat.div_(z.divisor)
    z.in_flight.append((z.comm.all_reduce(b.grad_flat, async_op=True), None, None, b))


def reduce_stage_1(z, b):
    """Every rank keeps the full gradients (they accumulate over micro-steps in grad_flat), but it updates
    only its chunk: a reduce-scatter gives it that chunk of the average (NCCL: half an all-reduce's bytes)."""
    b.grad_shard = torch.empty(b.shard_numel, dtype=z.dtype, device=z.device)
    b.grad_flat.div_(z.divisor)
    z.in_flight.append((z.comm.reduce_scatter(b.grad_shard, b.grad_flat, async_op=True), None, None, b))


def reduce_stage_2(z, b):
    """Full-size gradients exist only in the bucket's `filling` buffer, from the moment backward produces the
    first until this reduce-scatter has sent it; then only this rank's chunk of the average is kept, added to
    grad_shard (the micro-steps sum there). One bucket in flight at a time bounds the full-size gradients."""
    finish_in_flight(z)
    full = b.filling if b.filling is not None else torch.zeros(b.padded, dtype=z.dtype, device=z.device)
    full.div_(z.divisor)  # (zeros: a bucket whose parameters got no gradient)
    work, out = reduce_scatter_of(z.comm, full)  # out: this rank's chunk (on gloo, a view of full)
    b.filling = None  # full lives on in in_flight until the reduce has sent it
    z.in_flight.append((work, full, out, b))


def reduce_stage_3(z, b):
    """Stage 2's reduce-scatter; and the block's backward is over, so its gathered parameters are freed."""
    free(b)
    reduce_stage_2(z, b)


def finish_in_flight(z):
    for work, full, out, b in z.in_flight:
        if work is not None:
            work.wait()
        if out is not None:
            b.grad_shard.add_(out)
        if b.grad_host is not None and z.last_micro_step:
            # ZeRO-Offload: to the host now, while backward goes on (asynchronous into pinned memory on a GPU)
            b.grad_host.copy_(b.grad_flat if z.stage == 0 else b.grad_shard, non_blocking=True)
    z.in_flight = []


def publish_by_copy(z, b):
    """The updated master copied into shard (nothing to do where they are one tensor). Stage 0: shard is the
    whole bucket, the model's parameters; stage 3: this rank's chunk, which the next forward gathers."""
    if b.shard is not b.master:
        b.shard.copy_(b.master)


def publish_by_all_gather(z, b):
    """Every rank updated only its chunk: an all-gather gives every rank every chunk (sent from a copy: the
    chunk is a view inside flat, the output). Returns the work, waited for once every gather is posted."""
    return z.comm.all_gather(b.flat, b.master.to(z.device, z.dtype, copy=True), async_op=True)


STAGES = {0: (reduce_stage_0, publish_by_copy),        # every rank updated the whole bucket
          1: (reduce_stage_1, publish_by_all_gather),  # each rank its chunk; every rank holds every parameter
          2: (reduce_stage_2, publish_by_all_gather),  # as stage 1
          3: (reduce_stage_3, publish_by_copy)}        # each rank keeps its chunk: forward gathers (zero3.py)


# -----------------------------------------------------------------------------
# The engine: the buckets, the hook that reduces them as backward fills them, the clip and the step

class Zero:
    """The ZeRO engine of one rank. Its stage picks the reduce and publish functions above; the Bucket's
    buffers and a few stage branches below do the rest. parallel_4d.py's experts get an engine of their own
    (params: which of the model's; divisor: what the summed gradients are divided by, world_size unless the
    ranks summed saw more of the batch than their number: Megatron's gradient scaling factor)."""
    STATE_KEYS = ('master', 'exp_avg', 'exp_avg_sq')  # what a rank's checkpoint keeps of each chunk

    def __init__(self, model, stage, rank, world_size, weight_decay, betas, eps, bucket_size, dtype, comm,
                 device=None, offload=False, prefetch_blocks=0, params=None, divisor=None, overlap_comm=True):
        self.model, self.stage, self.rank, self.world_size, self.comm = model, stage, rank, world_size, comm
        self.divisor = divisor or world_size
        self.prefetch_blocks, self.overlap_comm, self.dtype = prefetch_blocks, overlap_comm, dtype
        self.weight_decay, self.device = weight_decay, device or next(model.parameters()).device
        self.reduce, self.publish = STAGES[stage]
        decay = {id(p) for p in param_groups(model, weight_decay)[0]['params']}
        self.buckets = [Bucket(group, decay, rank, world_size, stage, dtype, self.device, offload)
                        for group in bucket_groups(model, stage, bucket_size, params)]
        self.numel = sum(b.numel for b in self.buckets)
        self.where = {name: (b, i) for b in self.buckets for i, name in enumerate(b.names)}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                p.register_post_accumulate_grad_hook(lambda p, b=b, i=i: self.grad_ready(b, i, p))
        # train.py's AdamW, handed only this rank's fp32 chunks: unchanged, it sees 1/N of the model. Its
        # state is made now (held from the start); weight decay is applied in step, range by range
        self.optimizer = torch.optim.AdamW([b.master for b in self.buckets], 0.0, betas, eps, weight_decay=0)
        for m in self.optimizer.param_groups[0]['params']:
            self.optimizer.state[m] = dict(step=torch.tensor(0.0), exp_avg=torch.zeros_like(m),
                                           exp_avg_sq=torch.zeros_like(m))
        if stage == 3:
            install_stage_3_hooks(self, model)
        self.last_micro_step = True  # stages 0-1 reduce only then (gradients accumulate locally); 2-3 at each
        self.next_bucket = 0         # buckets are reduced in order, so every rank issues the same collectives
        self.in_flight = []          # (work, full buffer, output, bucket) of reductions not yet waited for

    def grad_ready(self, b, i, p):
        """post_accumulate_grad hook: p's gradient is in (stages 0-1: summed over the micro-steps)."""
        if self.stage < 2 and not self.last_micro_step:
            return
        b.ready += 1
        if self.stage >= 2:  # into the bucket's buffer, and freed at once: no full-size gradients outside it
            if b.filling is None:
                b.filling = torch.zeros(b.padded, dtype=self.dtype, device=self.device)
            b.views(b.filling)[i].copy_(p.grad)
            p.grad = None
        # reduce in bucket order (a bucket may fill early; the collectives must match across ranks)
        while self.next_bucket < len(self.buckets) and \
                self.buckets[self.next_bucket].ready == len(self.buckets[self.next_bucket].params):
            self.reduce(self, self.buckets[self.next_bucket])
            self.next_bucket += 1
            if not self.overlap_comm:  # (off: freed before backward fills the next; waits on the path)
                finish_in_flight(self)

    def finish_backward(self):
        """After backward: reduce any bucket whose hooks did not fire (unused parameters: zero gradients),
        then wait for every collective still running: the step needs their results."""
        if self.stage >= 2 or self.last_micro_step:
            for b in self.buckets[self.next_bucket:]:
                self.reduce(self, b)
            finish_in_flight(self)
            if self.buckets[0].grad_host is not None and torch.cuda.is_available():
                torch.cuda.synchronize()  # offload: the gradients' copies land before the host reads them
        for b in self.buckets:
            b.ready = 0
            if self.stage == 3:
                end_backward(b)
        self.next_bucket = 0

    def held(self):
        """What this rank holds now, by kind (a measured step's observer reads it): the parameters (p, the
        flat buffers, this rank's chunks), the gradients (p.grad, the buckets' buffers, those being reduced),
        AdamW's state (the fp32 master chunks, the moments); with offload, the host's state and gradients."""
        bs, offload = self.buckets, self.buckets[0].grad_host is not None
        state = [t for key in self.STATE_KEYS for t in self.adam_state(key)]
        reducing = [t for _, full, out, _ in self.in_flight for t in (full, out)]
        return {'param': [p for b in bs for p in b.params] + [t for b in bs for t in (b.flat, b.shard)],
                'grad': [p.grad for b in bs for p in b.params] + reducing +
                        [t for b in bs for t in (b.grad_flat, b.grad_shard, b.filling)],
                'host' if offload else 'optim': state + [b.grad_host for b in bs if offload]}

    def grads(self):
        """The gradients this rank updates with: stage 0 the full ones, else its chunks (offload: on host)."""
        return [b.grad_host if b.grad_host is not None else b.grad_flat if self.stage == 0 else b.grad_shard
                for b in self.buckets]

    def clip_grad_norm(self, max_norm, weights=None, other_comms=(), also=()):
        """clip_grad_norm_ over the model: this rank's chunks' squares, all-reduced. parallel_4d.py adds
        other_comms (ranks holding other parts), weights {id(p): w} (p's squares count w times here: 1/k for a
        copy on k ranks, 0 if counted elsewhere) and also, its experts' engine (whose chunks count too)."""
        grads = [g for z in (self, *also) for g in z.grads()]
        counted = [(g, 1.0) for g in grads]
        for b, g in zip([b for z in (self, *also) for b in z.buckets], grads):
            for j, p in enumerate(b.params):
                if weights and weights.get(id(p), 1.0) != 1.0:
                    start, end, _ = b.owned_part(j)
                    counted.append((g[start:max(start, end)], weights[id(p)] - 1.0))
        comms = ([self.comm] if self.stage >= 1 else []) + list(other_comms)  # (stage 0: every rank has all)
        return clip_grad_norm(grads, max_norm, comms, counted, self.device)  # (offload: the host's grads)

    @torch.no_grad()
    def step(self, lr):
        """AdamW on this rank's chunks, then the parameters published; the gradients start again from zero."""
        for b, grad in zip(self.buckets, self.grads()):
            b.master.grad = grad.float()  # (in bf16 an fp32 copy, dropped after the step)
            for start, end in b.decay_ranges:  # decoupled weight decay, first, as torch's AdamW does it
                b.master[start:end].mul_(1 - lr * self.weight_decay)
        self.optimizer.param_groups[0]['lr'] = lr
        self.optimizer.step()
        self.publish_all()
        for b in self.buckets:
            b.master.grad = None
            if self.stage <= 1:
                b.grad_flat.zero_()
                b.grad_shard = None  # (stage 1: the next reduce-scatter makes a new one)
            else:
                b.grad_shard.zero_()

    def publish_all(self):
        for work in [self.publish(self, b) for b in self.buckets]:  # every gather posted, then waited for
            if work is not None:
                work.wait()

    @torch.no_grad()
    def set_param_values(self, name, values):
        """One whole parameter's values (init_values, load_params): its part in this rank's chunk to
        the master (stage 3: and the shard); stages 0-2 hold every parameter: all of it to the flat buffer."""
        if name not in self.where:
            return  # (a second name of a tied weight)
        b, i = self.where[name]
        if self.stage < 3:
            b.views(b.flat)[i].copy_(values)
        b.copy_owned(i, values, b.master)
        if self.stage == 3 and b.shard is not b.master:
            b.copy_owned(i, values, b.shard)

    def pieces(self, cut=None, key='zero'):
        """Where this rank's chunks sit in the whole model, for consolidate.py: in each bucket a run of each
        parameter's elements (checkpoints.pieces_of). Stage 0's buckets are whole on every rank: rank 0's.
        cut(name, p): parallel_4d.py's (its parameters are tp slices), as model_parallel.held_pieces takes it;
        key: the engine's state_dict in the rank file."""
        pieces = []
        for k, b in enumerate(self.buckets if self.stage > 0 or self.rank == 0 else ()):
            paths = {'param': (key, 'master', k), 'exp_avg': (key, 'exp_avg', k),
                     'exp_avg_sq': (key, 'exp_avg_sq', k), 'step': (key, 'step')}
            for i, (name, p) in enumerate(zip(b.names, b.params)):
                where = cut(name, p) if cut else (name, b.shapes[i], None)
                if where is not None:
                    start, end, at = b.owned_part(i)
                    pieces += pieces_of(*where[:2], paths, boxes=where[2], chunk=(at, start, end))
        return pieces

    def adam_state(self, key):  # a checkpoint's: 'master' (fp32 weights), 'exp_avg', 'exp_avg_sq', 'step'
        return [b.master if key == 'master' else self.optimizer.state[b.master][key] for b in self.buckets]

    def state_dict(self):
        return {'stage': self.stage, 'world_size': self.world_size, 'rank': self.rank,
                'step': int(self.adam_state('step')[0]),
                'layout': [{'names': b.names, 'shapes': b.shapes, 'numel': b.numel, 'lo': b.lo}
                           for b in self.buckets], **{k: self.adam_state(k) for k in self.STATE_KEYS}}

    @torch.no_grad()
    def load_state_dict(self, sd):
        for key in self.STATE_KEYS:
            for mine, saved in zip(self.adam_state(key), sd[key]):
                mine.copy_(saved)
        for step in self.adam_state('step'):
            step.fill_(sd['step'])
        self.publish_all()

    @torch.no_grad()
    def load_torch_optimizer(self, osd):
        """Start from a torch AdamW state_dict (train.py's checkpoint; its params in param_groups order)."""
        order = [p for g in param_groups(self.model, self.weight_decay) for p in g['params']]
        saved = {id(p): osd['state'][i] for i, p in enumerate(order)}
        for b in self.buckets:
            state = self.optimizer.state[b.master]
            state['step'].fill_(float(osd['state'][0]['step']))
            for j, p in enumerate(b.params):  # only the part in this rank's chunk is read
                b.copy_owned(j, saved[id(p)]['exp_avg'], state['exp_avg'])
                b.copy_owned(j, saved[id(p)]['exp_avg_sq'], state['exp_avg_sq'])


def bucket_groups(model, stage, bucket_size, params=None):
    """(name, parameter) groups in the order backward produces their gradients: the model's, reversed (the
    tied token embedding gets its last contribution last). Stage 3: one per block (zero3.block_groups)."""
    held = {id(p) for p in params or model.parameters()}  # (params: parallel_4d.py's experts, or the rest)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) in held]
    if stage == 3:
        return block_groups(model, named)
    bucket_size = bucket_size or default_bucket_size(stage)
    groups = [[]]
    for n, p in reversed(named):
        if sum(q.numel() for _, q in groups[-1]) >= bucket_size:
            groups.append([])
        groups[-1].append((n, p))
    return groups


def train_step(zero, model, batches, ctx, grad_clip, lr, dp):
    """train.py's step on this rank's micro-batches: the hooks reduce each bucket as backward fills it (at
    every micro-step in stages 2-3, which cannot hold full gradients; at the last in stages 0-1, which
    accumulate them, as DDP's no_sync does), then the clip and the sharded step. Returns the mean loss."""
    loss_sum = 0.0
    for micro_step, (x, y) in enumerate(batches):
        zero.last_micro_step = micro_step == len(batches) - 1
        with ctx:
            _, loss = model(x, y)
            loss = loss / len(batches)  # the mean over this rank's rows; the reduction averages the ranks
        loss_sum += loss.detach()
        loss.backward()
        zero.finish_backward()
    if grad_clip != 0.0:
        zero.clip_grad_norm(grad_clip)
    zero.step(lr)
    balance_routers(model, lambda loads: dp.summed(loads, 'router loads'))  # (a MoE's: every rank's tokens)
    dp.all_reduce(loss_sum, kind='scalars')
    return loss_sum.item() / dp.size


# -----------------------------------------------------------------------------
# The build, the checkpoint (every rank its own file: RANK_FILE), the config's checks, main

RANK_FILE = 'zero_rank{}.pt'


def build_zero(cfg, vocab_size, rank, world_size, dp):
    """train.py's GPT on the meta device; the buckets give storage to what this rank keeps, filled with
    train.py's values (or GPT-2's), this rank's shard, or its chunks of a memory-mapped train.py ckpt.pt."""
    full_file = os.path.join(cfg.out_dir, 'ckpt.pt')  # (every rank decides alike, from rank 0's shard)
    from_shard = os.path.exists(rank_path(cfg.out_dir, RANK_FILE, 0)) or not os.path.exists(full_file)
    ckpt_path = rank_path(cfg.out_dir, RANK_FILE, rank) if from_shard else full_file  # (init_model: missing)
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path, meta=True)
    if rank == 0:
        print(run_shape(f'world {world_size} = dp (ZeRO-{cfg.stage})', cfg, model.get_num_params()))
    zero = Zero(model, cfg.stage, rank, world_size, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.adam_eps,
                cfg.bucket_size, torch.bfloat16 if cfg.dtype == 'bfloat16' else torch.float32, dp, cfg.device,
                cfg.offload_optimizer, cfg.prefetch_blocks, overlap_comm=cfg.overlap_comm)
    zero_buffers(model, cfg.device)  # (the MoE routers' balancing biases; a checkpoint's below)
    if checkpoint is None:  # train.py's initialization, or GPT-2's weights: a tensor at a time, each its part
        init_values(cfg, model.config, zero.set_param_values)
        seed_dropout(cfg.seed, rank)  # each rank its own dropout masks, as train_ddp.py and train_fsdp.py
    elif from_shard:  # (its stage and world size: check_config's)
        zero.load_state_dict(checkpoint['zero'])
        load_buffers(model, checkpoint.get('buffers', {}))
        set_rng_state(checkpoint['rng'])  # this rank's own dropout stream, from its own shard
    else:  # a whole (memory-mapped) ckpt.pt: each rank reads its part
        load_params(checkpoint['model'].items(), zero.set_param_values)
        load_buffers(model, checkpoint['model'])
        zero.load_torch_optimizer(checkpoint['optimizer'])
        restore_rng(checkpoint, rank, world_size, cfg.seed, rank)
    return model, zero, iter_num, best_val_loss


def check_config(cfg, world_size, argv=()):
    """Every bad combination, before any work: one line, the same on every rank (the DeepSpeed JSON on)."""
    if cfg.deepspeed_config:  # (a DeepSpeed JSON's common subset: common/deepspeed_config.py)
        from common.deepspeed_config import apply_deepspeed_config
        apply_deepspeed_config(cfg, cfg.deepspeed_config, world_size, argv)  # (flags after it override it)
    refuse((cfg.stage not in (0, 1, 2, 3), f"stage must be 0, 1, 2 or 3, got {cfg.stage!r}"),
           *shared_refusals(cfg, 'zero.py', world_size, world_size, compiles=cfg.stage < 3))  # (3: hooks)
    check_resume_grid(cfg, {'stage': cfg.stage, 'ranks': world_size}, rank_path(cfg.out_dir, RANK_FILE, 0),
                      then=" (and delete the zero_rank*.pt files)")  # (the same grid as save() writes)
    return cfg


def main(argv):
    world = world_size_from_env()
    cfg = check_config(configure(config, argv), world, argv)
    if cfg.print_ds_config:  # the run's DeepSpeed JSON (common/deepspeed_config.py), and nothing run
        from common.deepspeed_config import print_deepspeed_config
        return print_deepspeed_config(cfg, world)
    rank, world_size = start_run(cfg)
    dp = Comm(None, 'dp')  # every collective goes through it, and is counted there
    ctx = autocast_context('cuda' if cfg.device.startswith('cuda') else 'cpu', cfg.dtype)
    data, vocab_size = load_dataset(cfg.dataset)
    model, zero, iter_num, best_val_loss = build_zero(cfg, vocab_size, rank, world_size, dp)
    compiled = torch.compile(model) if cfg.compile else model
    writer = CheckpointWriter(cfg.max_iters)
    step = lambda it: train_step(zero, compiled, micro_batches(data, cfg, it, rank, world_size), ctx,
                                 cfg.grad_clip, get_lr(it, cfg), dp)

    def save(it, best):  # every rank its own shard, written in the background
        pieces = zero.pieces() + buffer_pieces(model, 'buffers') * (rank == 0)  # (the routers' biases: once)
        writer.save(checkpoint_of({'zero': zero.state_dict(), 'buffers': dict(model.named_buffers())}, pieces,
                                  (RANK_FILE, world_size), {'stage': cfg.stage, 'ranks': world_size}, rank,
                                  vars(model.config), it, best, vars(cfg)),
                    rank_path(cfg.out_dir, RANK_FILE, rank), it)
    run = SimpleNamespace(model=compiled, optimizer=None, loss_of=loss_function(compiled, ctx), dp=dp,
                          data=data, step=step, save=save, n_devices=world_size, rank=rank,
                          flops_per_token=model.flops_per_token(cfg.block_size),
                          kind='zero', zero=zero, comms=[dp])  # (what a measured step's observer reads)
    training_loop(cfg, run, iter_num, best_val_loss)  # (every rank evaluates: stage 3's forward gathers)
    writer.wait()
    if cfg.sample_at_end and not cfg.eval_only:  # every rank generates (stage 3 gathers); rank 0 prints
        print_sample(model, cfg, ctx, show=rank == 0, hint=f"python consolidate.py {cfg.out_dir} && "
                                                           f"python sample.py --out_dir={cfg.out_dir}")
    if rank == 0:
        print(outputs_line(cfg.out_dir, "zero_rank*.pt (each rank's shard: resume; python consolidate.py "
                                        f"{cfg.out_dir} makes one ckpt.pt)", *profiled(cfg)))
    finish_distributed(cfg)


if __name__ == '__main__':
    run_main(main)
