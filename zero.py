"""
ZeRO by hand, stages 0 to 3: data parallelism in which the N data-parallel ranks split the model states
(parameters, gradients, AdamW state) between them instead of each holding all of them. Every collective is
written out with torch.distributed; no DDP, FSDP or ZeroRedundancyOptimizer inside.

    torchrun --standalone --nproc_per_node=2 zero.py --stage=2
    torchrun --standalone --nproc_per_node=2 zero.py --deepspeed_config=config/ds_zero3.json
    WORLD_SIZE=8 python zero.py --stage=3 --dtype=bfloat16 --print_ds_config=True   # the same run's ds_config.json
    python zero.py --consolidate=out      # the per-rank shards in out/ -> out/ckpt.pt, a train.py checkpoint

stage 0  data parallelism: gradients all-reduced bucket by bucket while backward is still running
stage 1  + optimizer state sharded: rank r keeps AdamW's state (and, in bf16, the fp32 master weights) only for
           its chunk of each flat bucket; gradients are reduce-scattered, each rank updates its chunk, and the
           parameters are all-gathered back
stage 2  + gradients sharded: each bucket is reduce-scattered as soon as backward has filled it and the
           full-size gradients are freed, so a rank only ever keeps its gradient chunk
stage 3  + parameters sharded: a block's parameters are all-gathered just before its forward and again just
           before its backward, and freed after each

The update is torch.optim.AdamW's, element by element, so every stage trains the same numbers as train.py.
It prints, per rank, the bytes it holds (at rest and at the peak of a step) and the bytes it sends per step,
measured, beside the ZeRO paper's formulas (Rajbhandari et al. 2020). Diff it against train.py.
"""

import json
import math
import os
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from model import (GPT, TRAIN_STREAM, CheckpointWriter, Comm, GPTConfig, StepProfiler, WireMeter, autocast_context,
                   config_defaults, configure, estimate_loss, get_batch, get_codec, get_lr, init_distributed,
                   load_dataset, log_row, mfu, micro_batch_rows, model_config, outputs_line, param_groups,
                   peak_flops_for, peak_memory_bytes, profiled, progress, restore_rng, rng_state, run_main, run_shape,
                   save_checkpoint, seed_dropout, set_rng_state, trim_log, world_size_from_env)

# -----------------------------------------------------------------------------
# config: the defaults train a small character-level GPT on a laptop CPU in about 3 minutes
out_dir = 'out'
eval_interval = 250
log_interval = 25
eval_iters = 20
eval_only = False
always_save_checkpoint = True   # save at every eval, not only when val loss improves
init_from = 'scratch'           # 'scratch' or 'resume' (out_dir's rank shards, else a train.py out_dir/ckpt.pt)
sample_at_end = True            # print a short sample when training ends
# data
dataset = 'stdlib_char'
gradient_accumulation_steps = 2  # micro-steps per iteration, summed over all data-parallel ranks
batch_size = 8                   # sequences per micro-step per data-parallel rank
block_size = 128
# model (every GPTConfig field is a config key: norm, mlp, pos, n_kv_head, tie_embeddings, ...)
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
# AdamW
learning_rate = 2e-3
max_iters = 1250                # ~0.12 s per iteration on an idle 2-core CPU: under 3 minutes
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0                 # clip the global gradient norm to this; 0.0 turns clipping off
# learning rate schedule
decay_lr = True
warmup_iters = 50
lr_decay_iters = 1250           # usually equal to max_iters
min_lr = 2e-4
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float32'
compile = False
seed = 1337
peak_flops = None               # the device's peak FLOP/s for MFU; None: looked up by GPU name (unknown on CPU)
profile = 0                     # trace this many steps with torch.profiler: out_dir/trace_rank{r}.json
# ZeRO
stage = 2                       # 0: DP, 1: + optimizer state sharded, 2: + gradients, 3: + parameters
bucket_size = 100_000           # elements per gradient bucket in stages 0-2 (stage 3: one bucket per block)
adam_eps = 1e-8
deepspeed_config = ''           # a DeepSpeed JSON file; its common subset overrides the keys above
print_ds_config = False         # print the DeepSpeed JSON config of this run (to take it to DeepSpeed), then exit
consolidate = ''                # a directory: write its rank shards as one train.py checkpoint, then exit
dist_timeout = 60               # seconds before a rank gives up on a dead peer
config = config_defaults(globals())
# -----------------------------------------------------------------------------


def model_state_bytes_formula(numel, world_size, stage, mixed_precision):
    """Bytes of parameters, gradients and optimizer state per rank (ZeRO paper). fp32: 4 + 4 + 8 (Adam m, v)
    bytes per parameter; mixed precision: 2 + 2 + 12 (fp32 master, m, v). Sharded states hold ceil(numel/N)."""
    p, g, k = (2, 2, 12) if mixed_precision else (4, 4, 8)
    shard = math.ceil(numel / world_size)
    return {'param_bytes': p * (shard if stage >= 3 else numel),
            'grad_bytes': g * (shard if stage >= 2 else numel),
            'optim_bytes': k * (shard if stage >= 1 else numel)}


def comm_bytes_formula(numel, world_size, stage, bytes_per_elem, micro_steps=1):
    """Bytes one rank sends per step, ring algorithms (the paper's count). Stages 0-2: one all-reduce's worth,
    2(N-1)/N·Ψ (stage 1/2 as a reduce-scatter plus an all-gather). Stage 3: 3(N-1)/N·Ψ, the parameters gathered
    for forward and again for backward. Stages 2 and 3 cannot hold gradients across micro-steps, so they reduce
    at every one. On gloo a reduce-scatter is an all-reduce underneath: the wire carries more (see WireMeter)."""
    one = (world_size - 1) / world_size * numel * bytes_per_elem
    return {0: 2 * one, 1: 2 * one, 2: (micro_steps + 1) * one, 3: 3 * micro_steps * one}[stage]


def wait(work):
    if work is not None:
        work.wait()


class Bucket:
    """Some parameters laid end to end in one flat buffer, padded to a multiple of N when sharded, so that one
    collective moves all of them and rank r owns the contiguous chunk [r·S, (r+1)·S), S = padded/N. Each
    parameter's .data becomes a view of the flat buffer, so a gather into the buffer is a gather into the model."""

    def __init__(self, names, params, decay, rank, world_size, sharded, dtype, device):
        self.names, self.params = names, params
        self.shapes = [tuple(p.shape) for p in params]
        self.offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / world_size) * world_size if sharded else self.numel
        self.shard_numel = self.padded // world_size if sharded else self.numel
        self.lo = rank * self.shard_numel if sharded else 0
        flat32 = self.flatten([p.detach().float() for p in params], device)
        # a flat shard spans both AdamW groups (and padding): the decayed parameters are ranges of this rank's chunk
        self.decay_ranges = self.owned_ranges([id(p) in decay for p in params])
        self.flat = flat32.to(dtype)  # the full parameters, in the working dtype (flat32 itself in fp32)
        for p, view in zip(params, self.views(self.flat)):
            p.data = view
        # the fp32 weights AdamW updates: in fp32 this rank's chunk of the parameters themselves, in bf16 a copy
        self.master = self.owned(flat32) if dtype == torch.float32 else self.owned(flat32).clone()
        self.ready = 0              # parameters whose gradient backward has produced this micro-step
        self.grad_flat = None       # stages 0-1: the full gradients (each p.grad is a view of it)
        self.filling = None         # stages 2-3: the bucket's gradients, copied in as backward produces them
        self.grad_shard = None      # stages 1-3: this rank's chunk of the reduced gradients

    def flatten(self, tensors, device):
        flat = torch.zeros(self.padded, dtype=tensors[0].dtype, device=device)
        for t, off in zip(tensors, self.offsets):
            flat[off:off + t.numel()] = t.reshape(-1)
        return flat

    def views(self, flat):
        return [flat[off:off + math.prod(s)].view(s) for off, s in zip(self.offsets, self.shapes)]

    def owned(self, flat):
        return flat[self.lo:self.lo + self.shard_numel]

    def owned_ranges(self, flags):
        """(start, end) within this rank's chunk of the part of each flagged parameter that falls in it."""
        ranges = []
        for flag, off, shape in zip(flags, self.offsets, self.shapes):
            start, end = max(off, self.lo) - self.lo, min(off + math.prod(shape), self.lo + self.shard_numel) - self.lo
            if flag and start < end:
                ranges.append((start, end))
        return ranges


class ShardedAdamW:
    """torch.optim.AdamW's update (decoupled weight decay, bias correction, eps added after the square root),
    written once for any flat fp32 tensors: here, this rank's chunks. Element for element what torch computes."""

    def __init__(self, masters, decay_ranges, weight_decay, betas, eps):
        self.masters, self.decay_ranges = masters, decay_ranges
        self.weight_decay, self.betas, self.eps = weight_decay, betas, eps
        self.exp_avg = [torch.zeros_like(m) for m in masters]
        self.exp_avg_sq = [torch.zeros_like(m) for m in masters]
        self.step_count = 0

    @torch.no_grad()
    def step(self, grads, lr):
        beta1, beta2 = self.betas
        self.step_count += 1
        bias_correction1 = 1 - beta1 ** self.step_count
        bias_correction2_sqrt = (1 - beta2 ** self.step_count) ** 0.5
        for p, g, m, v, ranges in zip(self.masters, grads, self.exp_avg, self.exp_avg_sq, self.decay_ranges):
            g = g.float()
            for start, end in ranges:
                p[start:end].mul_(1 - lr * self.weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(self.eps)
            p.addcdiv_(m, denom, value=-lr / bias_correction1)


def storage_bytes(tensors, skip=()):
    """Bytes of the distinct storages behind tensors (views of one buffer count once), and their ids."""
    seen, total = set(skip), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total, seen


class GatherBeforeBackward(torch.autograd.Function):
    """Identity in forward, put on a block's output. Every node of the block's backward hangs below that output,
    so this backward runs first: the place to all-gather the block's parameters again, just in time."""

    @staticmethod
    def forward(ctx, x, zero, bucket):
        ctx.zero, ctx.bucket = zero, bucket
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.bucket.in_backward = True
        ctx.zero.gather(ctx.bucket)
        return grad, None, None


class Zero:
    """The ZeRO engine of one rank: buckets, the hooks that reduce gradients as backward produces them, the
    stage-3 hooks that gather parameters around each block, the sharded AdamW step and the byte counts."""

    def __init__(self, model, stage, rank, world_size, weight_decay, betas, eps, bucket_size, dtype, comm):
        self.model, self.stage, self.rank, self.world_size, self.comm = model, stage, rank, world_size, comm
        self.dtype, self.device = dtype, next(model.parameters()).device
        decay = {id(p) for p in param_groups(model, weight_decay)[0]['params']}
        self.buckets = [Bucket([n for n, _ in group], [p for _, p in group], decay, rank, world_size, stage >= 1,
                               dtype, self.device) for group in self.bucket_groups(model, stage, bucket_size)]
        self.numel = sum(b.numel for b in self.buckets)
        for b in self.buckets:
            if stage <= 1:  # the full gradients live in one flat buffer per bucket, p.grad its views
                b.grad_flat = torch.zeros(b.padded, dtype=dtype, device=self.device)
                for p, view in zip(b.params, b.views(b.grad_flat)):
                    p.grad = view  # autograd accumulates into an existing .grad in place: it stays a view
            if stage >= 2:
                b.grad_shard = torch.zeros(b.shard_numel, dtype=dtype, device=self.device)
            for i, p in enumerate(b.params):
                p.register_post_accumulate_grad_hook(lambda p, b=b, i=i: self.grad_ready(b, i, p))
            if stage == 3:  # at rest a rank keeps only its chunk of the parameters
                b.shard = b.owned(b.flat).clone()
                b.master = b.shard if dtype == torch.float32 else b.master
                b.in_backward = False
                self.free(b)
            else:
                b.shard = b.owned(b.flat)
        self.optimizer = ShardedAdamW([b.master for b in self.buckets], [b.decay_ranges for b in self.buckets],
                                      weight_decay, betas, eps)
        if stage == 3:
            self.install_stage3_hooks(model)
        self.sync = True           # stages 0-1 reduce only at the last micro-step (gradients accumulate locally)
        self.next_bucket = 0       # buckets are reduced in order, so every rank issues the same collectives
        self.in_flight = []        # (work, full buffer, output, bucket) of reduce-scatters not yet waited for
        self.measuring, self.peak = False, defaultdict(int)

    @staticmethod
    def bucket_groups(model, stage, bucket_size):
        """(name, parameter) groups in the order backward produces their gradients: the reverse of the model's
        order (the tied token embedding, first in the model, gets its last contribution last). Stage 3: one
        group per block, and one for the rest (embeddings, final norm, head), which the whole model uses."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if stage == 3:
            blocks = [list(block.named_parameters(prefix=f'transformer.h.{i}'))
                      for i, block in enumerate(model.transformer.h)]
            in_blocks = {id(p) for group in blocks for _, p in group}
            return blocks[::-1] + [[(n, p) for n, p in named if id(p) not in in_blocks]]
        groups, group = [], []
        for n, p in reversed(named):
            group.append((n, p))
            if sum(q.numel() for _, q in group) >= bucket_size:
                groups.append(group)
                group = []
        return groups + ([group] if group else [])

    # --- gradients: reduced bucket by bucket while backward runs ---------------------------------------------

    def grad_ready(self, bucket, i, p):
        """post_accumulate_grad hook: p.grad now holds this micro-step's full gradient of p."""
        if not self.sync:
            return
        bucket.ready += 1
        self.measure()
        if self.stage >= 2:  # move it into the bucket's buffer and free it at once: no full-size gradients
            if bucket.filling is None:
                bucket.filling = torch.zeros(bucket.padded, dtype=self.dtype, device=self.device)
            bucket.views(bucket.filling)[i].copy_(p.grad)
            p.grad = None
        # reduce in bucket order (a bucket may fill early; the collectives must match across ranks)
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].ready == len(
                self.buckets[self.next_bucket].params):
            self.reduce(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def reduce(self, b):
        if self.stage == 0:  # all-reduce the full gradients in place, asynchronously: backward goes on meanwhile
            b.grad_flat.div_(self.world_size)
            self.in_flight.append((self.comm.all_reduce(b.grad_flat, async_op=True), None, None, b))
            return
        if self.stage == 1:  # every rank keeps the full gradients, but needs only its chunk reduced
            b.grad_shard = torch.empty(b.shard_numel, dtype=self.dtype, device=self.device)
            b.grad_flat.div_(self.world_size)
            self.in_flight.append((self.comm.reduce_scatter(b.grad_shard, b.grad_flat, async_op=True), None, None, b))
            return
        # stages 2-3: reduce-scatter (not all-reduce) the bucket's buffer: this rank keeps only its chunk of
        # the sum, for half the bytes of an all-reduce
        self.finish_in_flight()  # one bucket in flight at a time bounds the gradient memory
        full = b.filling if b.filling is not None else torch.zeros(b.padded, dtype=self.dtype, device=self.device)
        b.filling = None  # (zeros: a parameter that got no gradient)
        full.div_(self.world_size)
        if self.stage == 3:
            self.free(b)  # the block's backward is over: its gradients are all here
        out = torch.empty(b.shard_numel, dtype=self.dtype, device=self.device)
        self.in_flight.append((self.comm.reduce_scatter(out, full, async_op=True), full, out, b))
        self.measure()

    def finish_in_flight(self):
        for work, full, out, b in self.in_flight:
            wait(work)
            if out is not None:
                b.grad_shard.add_(out)  # stages 2-3 accumulate micro-steps into the shard
        self.in_flight = []

    def finish_backward(self):
        """After backward: reduce any bucket whose hooks did not fire (unused parameters: zero gradients), then
        wait for every collective still running, as the step needs their results."""
        if self.sync:
            while self.next_bucket < len(self.buckets):
                self.reduce(self.buckets[self.next_bucket])
                self.next_bucket += 1
            self.finish_in_flight()
        for b in self.buckets:
            b.ready = 0
            if self.stage == 3:
                b.in_backward = False
                self.free(b)
        self.next_bucket = 0
        self.measure()

    def grads(self):
        """The gradients this rank updates with: the full ones in stage 0, its chunks otherwise."""
        return [b.grad_flat if self.stage == 0 else b.grad_shard for b in self.buckets]

    def clip_grad_norm(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ over the whole model: each rank sums the squares of its chunks, one
        all-reduce of that scalar gives the global norm (padding is zero and adds nothing)."""
        sq = sum(g.float().pow(2).sum() for g in self.grads())
        if self.stage >= 1:
            self.comm.all_reduce(sq, kind='scalars')
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in self.grads():
            g.mul_(coef.to(g.dtype))
        return norm

    # --- the step: own chunk updated, then parameters published -------------------------------------------

    @torch.no_grad()
    def step(self, lr):
        self.optimizer.step(self.grads(), lr)
        works = []
        for b in self.buckets:
            if self.stage == 0:
                if b.master.data_ptr() != b.flat.data_ptr():  # bf16: the parameters from the fp32 master
                    b.flat.copy_(b.master)
            elif self.stage in (1, 2):  # everyone gets everyone's updated chunk (a copy: the input is in the output)
                works.append(self.comm.all_gather(b.flat, b.master.to(self.dtype, copy=True), async_op=True))
            elif b.shard is not b.master:
                b.shard.copy_(b.master)  # stage 3 gathers at the next forward
        for work in works:
            wait(work)
        self.measure()
        for b in self.buckets:
            if self.stage <= 1:
                b.grad_flat.zero_()
            if self.stage == 1:
                b.grad_shard = None
            if self.stage >= 2:
                b.grad_shard.zero_()

    # --- stage 3: parameters gathered around each block ---------------------------------------------------

    def gather(self, b):
        if b.gathered:
            return
        b.flat.untyped_storage().resize_(b.padded * b.flat.element_size())
        # write through .data: the gather is not an autograd in-place op on the views saved for backward
        self.comm.all_gather(b.flat.data, b.shard)
        b.gathered = True
        self.measure()

    def free(self, b):
        # the views (p.data) and the tensors autograd saved keep pointing at this storage; it just holds no
        # bytes until the next gather refills it
        b.flat.untyped_storage().resize_(0)
        b.gathered = False

    def install_stage3_hooks(self, model):
        *block_buckets, root = self.buckets
        for block, b in zip(model.transformer.h, block_buckets[::-1]):
            block.register_forward_pre_hook(lambda m, args, b=b: self.gather(b))
            block.register_forward_hook(lambda m, args, out, b=b: self.after_forward(b, out))

        def after_model_forward(m, args, out):  # the root's parameters served embed and head: free them
            logits, loss = out
            return logits, self.after_forward(root, loss)

        model.register_forward_pre_hook(lambda m, args: self.gather(root))
        model.register_forward_hook(after_model_forward)

    def after_forward(self, b, out):
        if b.in_backward:  # a recomputation (activation checkpointing) inside backward: keep them
            return out
        self.free(b)
        if out is not None and torch.is_grad_enabled() and out.requires_grad:
            return GatherBeforeBackward.apply(out, self, b)
        return out

    # --- measurement --------------------------------------------------------------------------------------

    def held_bytes(self):
        """Bytes of the tensors this rank holds now, by kind (a storage shared by views counts once)."""
        params, param_ids = storage_bytes([p for b in self.buckets for p in b.params] +
                                          [t for b in self.buckets for t in (b.flat, b.shard)])
        grads, _ = storage_bytes([p.grad for b in self.buckets for p in b.params] +
                                 [t for b in self.buckets for t in (b.grad_flat, b.grad_shard, b.filling)] +
                                 [t for _, full, out, _ in self.in_flight for t in (full, out)])
        optim, _ = storage_bytes(self.optimizer.masters + self.optimizer.exp_avg + self.optimizer.exp_avg_sq,
                                 skip=param_ids)  # in fp32 stages 0-2 the master chunk is the parameters
        return {'param_bytes': params, 'grad_bytes': grads, 'optim_bytes': optim}

    def measure(self):
        if self.measuring:
            for k, v in self.held_bytes().items():
                self.peak[k] = max(self.peak[k], v)

    # --- checkpoints --------------------------------------------------------------------------------------

    def state_dict(self):
        return {'stage': self.stage, 'world_size': self.world_size, 'rank': self.rank,
                'layout': [{'names': b.names, 'shapes': b.shapes, 'numel': b.numel, 'lo': b.lo} for b in self.buckets],
                'master': self.optimizer.masters, 'exp_avg': self.optimizer.exp_avg,
                'exp_avg_sq': self.optimizer.exp_avg_sq, 'step': self.optimizer.step_count}

    @torch.no_grad()
    def load_state_dict(self, sd):
        opt = self.optimizer
        for i, b in enumerate(self.buckets):
            for mine, saved in ((opt.masters[i], sd['master'][i]), (opt.exp_avg[i], sd['exp_avg'][i]),
                                (opt.exp_avg_sq[i], sd['exp_avg_sq'][i])):
                mine.copy_(saved)
        opt.step_count = sd['step']
        self.publish_master()

    @torch.no_grad()
    def load_torch_optimizer(self, osd):
        """Start from a torch AdamW state_dict (train.py's checkpoint; its params in param_groups order)."""
        order = [p for g in param_groups(self.model, self.optimizer.weight_decay) for p in g['params']]
        index = {id(p): i for i, p in enumerate(order)}
        opt = self.optimizer
        for i, b in enumerate(self.buckets):
            for key, mine in (('exp_avg', opt.exp_avg[i]), ('exp_avg_sq', opt.exp_avg_sq[i])):
                full = b.flatten([osd['state'][index[id(p)]][key].float() for p in b.params], self.device)
                mine.copy_(b.owned(full))
        opt.step_count = int(osd['state'][0]['step'])

    def publish_master(self):
        """Parameters from the fp32 master chunks (after loading): every rank's chunk to everyone."""
        for b in self.buckets:
            if self.stage == 3:
                b.shard.copy_(b.master)
            elif self.stage == 0:
                b.flat.copy_(b.master)
            else:
                self.comm.all_gather(b.flat, b.master.to(self.dtype, copy=True))


def shard_path(out_dir, rank):
    return os.path.join(out_dir, f'zero_rank{rank}.pt')


def consolidate_shards(out_dir):
    """The rank shards of out_dir -> out_dir/ckpt.pt in train.py's format: the full model, and torch AdamW's
    state_dict for model.configure_optimizers' parameter order, so any script can go on from it."""
    first = shard_path(out_dir, 0)
    if not os.path.exists(first):
        raise SystemExit(f"error: no ZeRO shards in {out_dir} (expected {first})")
    ck0 = torch.load(first, map_location='cpu', weights_only=False)
    n = ck0['zero']['world_size']
    paths = [shard_path(out_dir, r) for r in range(n)]
    if not all(os.path.exists(p) for p in paths):
        raise SystemExit(f"error: {out_dir} holds a world of {n} shards but not all of them: {paths}")
    shards = [ck0] + [torch.load(p, map_location='cpu', weights_only=False) for p in paths[1:]]
    if len({(s['iter_num'], s['zero']['stage']) for s in shards}) != 1:
        raise SystemExit(f"error: the shards in {out_dir} are from different iterations or stages")
    full, n_buckets = {}, len(ck0['zero']['layout'])
    for k, key in enumerate(('master', 'exp_avg', 'exp_avg_sq')):
        full[key] = {}
        for i, layout in enumerate(ck0['zero']['layout']):
            progress(k * n_buckets + i + 1, 3 * n_buckets, f"consolidating {n} shards (buckets of weights, m, v)")
            flat = shards[0]['zero'][key][i] if ck0['zero']['stage'] == 0 else torch.cat(
                [s['zero'][key][i] for s in shards])  # the chunks of rank 0, 1, ... in order are the bucket
            offset = 0
            for name, shape in zip(layout['names'], layout['shapes']):
                full[key][name] = flat[offset:offset + math.prod(shape)].view(shape).clone()
                offset += math.prod(shape)
    cfg = ck0['config']
    model = GPT(GPTConfig(**ck0['model_args']))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full['master'][name])
    optimizer = model.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'], (cfg['beta1'], cfg['beta2']),
                                           'cpu')
    names = {id(p): name for name, p in model.named_parameters()}
    for group in optimizer.param_groups:
        group['eps'] = cfg['adam_eps']
        for p in group['params']:
            optimizer.state[p] = {'step': torch.tensor(float(ck0['zero']['step'])),
                                  'exp_avg': full['exp_avg'][names[id(p)]],
                                  'exp_avg_sq': full['exp_avg_sq'][names[id(p)]]}
    path = os.path.join(out_dir, 'ckpt.pt')
    save_checkpoint({
        'model': model.state_dict(),
        'optimizer': optimizer.state_dict(),
        'scaler': torch.amp.GradScaler('cpu', enabled=False).state_dict(),
        'rng_state': ck0['rng']['cpu'],
        'cuda_rng_state': ck0['rng']['cuda'],
        'rng_states': [s['rng'] for s in shards],  # every rank's dropout stream: the same world resumes exactly
        'model_args': ck0['model_args'],
        'iter_num': ck0['iter_num'],
        'best_val_loss': ck0['best_val_loss'],
        'config': cfg,
    }, path)
    print(f"wrote {path}: iter {ck0['iter_num']}, from {n} stage-{ck0['zero']['stage']} shards")
    return path


DS_KEYS = {'zero_optimization': {'stage'}, 'train_micro_batch_size_per_gpu': None, 'gradient_accumulation_steps': None,
           'gradient_clipping': None, 'bf16': {'enabled'}, 'optimizer': {'type', 'params'}, 'train_batch_size': None}
DS_OPTIMIZER_PARAMS = {'lr', 'betas', 'eps', 'weight_decay'}


def deepspeed_config_of(cfg, world_size):
    """The DeepSpeed JSON config that runs what this run does: the inverse of apply_deepspeed_config (DeepSpeed's
    gradient_accumulation_steps is per rank, ours summed over ranks)."""
    return {'train_batch_size': cfg.batch_size * cfg.gradient_accumulation_steps,
            'train_micro_batch_size_per_gpu': cfg.batch_size,
            'gradient_accumulation_steps': cfg.gradient_accumulation_steps // world_size,
            'gradient_clipping': cfg.grad_clip,
            'bf16': {'enabled': cfg.dtype == 'bfloat16'},
            'zero_optimization': {'stage': cfg.stage},
            'optimizer': {'type': 'AdamW', 'params': {'lr': cfg.learning_rate, 'betas': [cfg.beta1, cfg.beta2],
                                                      'eps': cfg.adam_eps, 'weight_decay': cfg.weight_decay}}}


def apply_deepspeed_config(cfg, path, world_size):
    """The common subset of a DeepSpeed JSON config, onto cfg. DeepSpeed's gradient_accumulation_steps is per
    rank; ours counts micro-steps summed over ranks, so ours = DeepSpeed's × N. Anything else is an error."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: deepspeed_config {path} not found")
    try:
        ds = json.load(open(path))
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: deepspeed_config {path} is not valid JSON: {e}")
    for key, value in ds.items():
        if key not in DS_KEYS:
            raise SystemExit(f"error: deepspeed_config key '{key}' is not supported by zero.py; "
                             f"supported: {', '.join(sorted(DS_KEYS))}")
        allowed = DS_KEYS[key]
        for sub in (value if allowed is not None else {}):
            if sub not in allowed:
                raise SystemExit(f"error: deepspeed_config key '{key}.{sub}' is not supported by zero.py; "
                                 f"supported: {', '.join(sorted(allowed))}")
    opt = ds.get('optimizer', {})
    if opt.get('type', 'AdamW').lower() != 'adamw':
        raise SystemExit(f"error: deepspeed_config optimizer.type '{opt['type']}' is not supported: zero.py is AdamW")
    for sub in opt.get('params', {}):
        if sub not in DS_OPTIMIZER_PARAMS:
            raise SystemExit(f"error: deepspeed_config key 'optimizer.params.{sub}' is not supported by zero.py; "
                             f"supported: {', '.join(sorted(DS_OPTIMIZER_PARAMS))}")
    params = opt.get('params', {})
    updates = {'stage': ds.get('zero_optimization', {}).get('stage'),
               'batch_size': ds.get('train_micro_batch_size_per_gpu'),
               'gradient_accumulation_steps': (ds['gradient_accumulation_steps'] * world_size
                                               if 'gradient_accumulation_steps' in ds else None),
               'grad_clip': ds.get('gradient_clipping'),
               'dtype': {True: 'bfloat16', False: 'float32'}.get(ds.get('bf16', {}).get('enabled')),
               'learning_rate': params.get('lr'), 'beta1': params.get('betas', [None, None])[0],
               'beta2': params.get('betas', [None, None])[1], 'adam_eps': params.get('eps'),
               'weight_decay': params.get('weight_decay')}
    for key, value in updates.items():
        if value is not None:
            setattr(cfg, key, float(value) if isinstance(getattr(cfg, key), float) else value)
    if 'train_batch_size' in ds and ds['train_batch_size'] != cfg.batch_size * cfg.gradient_accumulation_steps:
        raise SystemExit(f"error: deepspeed_config train_batch_size {ds['train_batch_size']} is not "
                         f"micro batch × accumulation × world = {cfg.batch_size * cfg.gradient_accumulation_steps}")
    return cfg


def report_rows(zero, at_rest, cfg, iter_num, micro_steps, wire_bytes, wire_why_not):
    """This rank's bytes as a log row: held (measured) beside the ZeRO formulas, and sent: counted at the calls,
    the ring formula for those calls, and measured on the wire."""
    mixed = cfg.dtype == 'bfloat16'
    formula = model_state_bytes_formula(zero.numel, zero.world_size, zero.stage, mixed)
    row = {'iter': iter_num, 'rank': zero.rank, 'stage': zero.stage, 'world_size': zero.world_size,
           'numel': zero.numel, 'buckets': len(zero.buckets), 'micro_steps': micro_steps}
    for k in ('param_bytes', 'grad_bytes', 'optim_bytes'):
        row.update({k: at_rest[k], f'{k}_formula': formula[k], f'peak_{k}': zero.peak[k]})
    row['collective_bytes'] = sum(zero.comm.collective_bytes.values())
    row['collective_bytes_by_kind'] = dict(zero.comm.collective_bytes)
    row['wire_bytes_formula'] = sum(zero.comm.wire_bytes_formula.values())
    row['wire_bytes_formula_by_kind'] = dict(zero.comm.wire_bytes_formula)
    row['wire_bytes'] = wire_bytes
    row['wire_bytes_note'] = wire_why_not
    return row


def print_report(rows):
    r0 = rows[0]
    print(f"ZeRO stage {r0['stage']}, N = {r0['world_size']}, Ψ = {r0['numel']:,}: bytes per rank, "
          f"measured at rest / peak of a step (formula)")
    for r in rows:
        cells = [f"{k[:-6]} {r[k]:,} / {r['peak_' + k]:,} ({r[k + '_formula']:,})"
                 for k in ('param_bytes', 'grad_bytes', 'optim_bytes')]
        print(f"  rank {r['rank']}: " + ' | '.join(cells))
    kinds = ', '.join(f"{k} {v:,.0f}" for k, v in r0['collective_bytes_by_kind'].items())
    wire = r0['wire_bytes_note'] if r0['wire_bytes'] is None else f"{r0['wire_bytes']:,.0f}"
    print(f"  sent per step by each rank: collective bytes {r0['collective_bytes']:,} [{kinds}] (counted at the "
          f"calls); wire bytes {r0['wire_bytes_formula']:,.0f} (ring formula), {wire} (measured, loopback)")
    if r0['wire_bytes'] and r0['wire_bytes'] > 1.2 * r0['wire_bytes_formula']:
        print("  (more on the wire than the ring formula: gloo's reduce-scatter is an all-reduce underneath, so "
              "each reduce-scatter sends 2(N-1)/N of the tensor, not (N-1)/N; NCCL's is a true ring reduce-scatter)")


def main(argv):
    cfg = configure(config, argv)
    if cfg.consolidate:
        consolidate_shards(cfg.consolidate)
        return
    world = world_size_from_env()
    if cfg.deepspeed_config:
        cfg = apply_deepspeed_config(cfg, cfg.deepspeed_config, world)
    if cfg.stage not in (0, 1, 2, 3):
        raise SystemExit(f"error: stage must be 0, 1, 2 or 3, got {cfg.stage!r}")
    if cfg.print_ds_config:  # (the learning-rate schedule is DeepSpeed's 'scheduler' section: not written here)
        print(json.dumps(deepspeed_config_of(cfg, world), indent=2))
        return
    if cfg.dtype not in ('float32', 'bfloat16'):
        raise SystemExit(f"error: zero.py trains in float32 or bfloat16 (fp32 master weights), got {cfg.dtype!r}")
    if cfg.gradient_accumulation_steps % world != 0:
        raise SystemExit(f"error: world size {world} is larger than the batch or does not divide it: "
                         f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} must be a multiple of it")
    if cfg.compile and cfg.stage == 3:
        raise SystemExit("error: compile=True is not supported with stage 3 (its hooks free storage)")
    if cfg.bucket_size < 1:
        raise SystemExit(f"error: bucket_size must be positive, got {cfg.bucket_size}")

    # setup
    owns_group = not dist.is_initialized()  # tests may run main() inside a process group they made
    if owns_group:
        rank, local_rank, world_size, device = init_distributed(cfg.dist_timeout)
    else:
        rank, world_size, device = dist.get_rank(), dist.get_world_size(), cfg.device
    cfg.device = device
    master_process = rank == 0
    dp_rank, dp_size = rank, world_size
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    if master_process:
        os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    ctx = autocast_context(device_type, cfg.dtype)

    # data
    data, vocab_size = load_dataset(cfg.dataset)

    # model: every rank builds the same full model as train.py, then keeps its part
    iter_num, best_val_loss, checkpoint, torch_checkpoint = 0, 1e9, None, None
    if cfg.init_from == 'scratch':
        model = GPT(model_config(cfg, vocab_size))
    elif cfg.init_from == 'resume':
        path, ckpt_path = shard_path(cfg.out_dir, rank), os.path.join(cfg.out_dir, 'ckpt.pt')
        if os.path.exists(path):
            checkpoint = torch.load(path, map_location='cpu', weights_only=False)
            if (checkpoint['zero']['world_size'], checkpoint['zero']['stage']) != (world_size, cfg.stage):
                raise SystemExit(f"error: {path} is from stage {checkpoint['zero']['stage']} on "
                                 f"{checkpoint['zero']['world_size']} ranks; run python zero.py "
                                 f"--consolidate={cfg.out_dir}, delete the zero_rank*.pt files, then resume")
            model_args = checkpoint['model_args']
        elif os.path.exists(ckpt_path):  # a train.py-format checkpoint: any script's, any world size
            torch_checkpoint = checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=False)
            model_args = checkpoint['model_args']
        else:
            raise SystemExit(f"error: init_from=resume but there is no checkpoint at {path} or {ckpt_path}")
        model = GPT(GPTConfig(**model_args))
        if torch_checkpoint is not None:
            model.load_state_dict(torch_checkpoint['model'])
        iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
        if master_process:
            trim_log(cfg.out_dir, iter_num)
    else:
        raise SystemExit(f"error: init_from must be 'scratch' or 'resume', got {cfg.init_from!r}")
    if cfg.block_size > model.config.block_size:
        raise SystemExit(f"error: block_size {cfg.block_size} is larger than the model's {model.config.block_size}")
    model.to(cfg.device)
    flops_per_token = model.flops_per_token()
    if master_process:
        print(run_shape(f'world {world_size} = dp {world_size}, ZeRO stage {cfg.stage}', cfg, model.get_num_params()))
    comm = Comm(None, 'dp')  # every collective goes through it, and is counted there
    param_dtype = torch.bfloat16 if cfg.dtype == 'bfloat16' else torch.float32
    zero = Zero(model, cfg.stage, rank, world_size, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.adam_eps,
                cfg.bucket_size, param_dtype, comm)
    if torch_checkpoint is not None:
        zero.load_torch_optimizer(torch_checkpoint['optimizer'])
    elif checkpoint is not None:
        zero.load_state_dict(checkpoint['zero'])
    if torch_checkpoint is not None:
        restore_rng(torch_checkpoint, rank, world_size, cfg.seed, dp_rank)
    elif checkpoint is not None:
        set_rng_state(checkpoint['rng'])  # this rank's own dropout stream, from its own shard
    else:
        seed_dropout(cfg.seed, dp_rank)  # each rank its own dropout masks, as train_ddp.py and train_fsdp.py draw
    checkpoint = torch_checkpoint = None  # free it
    raw_model = model
    if cfg.compile:
        model = torch.compile(model)

    def loss_of(x, y):
        with ctx:
            return model(x, y)[1]

    # training loop
    peak = peak_flops_for(cfg.device, cfg.dtype, cfg.peak_flops)
    writer, wire = CheckpointWriter(), WireMeter()  # every rank writes its shard in the background
    profiler = StepProfiler(cfg.profile, cfg.out_dir, rank, cfg.device)  # --profile=N: a trace per rank
    t_last, iters_since_log, first_iter = time.time(), 0, iter_num
    while True:
        lr = get_lr(iter_num, cfg)

        # evaluate (every rank: in stage 3 each one takes part in the gathers), checkpoint every rank's shard
        if iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters:
            model.eval()
            losses = estimate_loss(loss_of, data, cfg, comm)  # each rank its share of the batches
            model.train()
            if master_process:
                log_row(cfg.out_dir, {'iter': iter_num, 'train_loss': losses['train'], 'val_loss': losses['val'],
                                      'lr': lr})
            if not math.isfinite(losses['val']):
                raise SystemExit(f"error: val loss is {losses['val']} at iter {iter_num}; kept the last checkpoint")
            if iter_num > 0 and (losses['val'] < best_val_loss or cfg.always_save_checkpoint):
                best_val_loss = min(best_val_loss, losses['val'])
                writer.save({
                    'zero': zero.state_dict(),
                    'rng': rng_state(),
                    'model_args': vars(raw_model.config),
                    'iter_num': iter_num,
                    'best_val_loss': best_val_loss,
                    'config': vars(cfg),
                }, shard_path(cfg.out_dir, rank))
            t_last, iters_since_log = time.time(), 0  # do not count eval time as training time
        if iter_num == cfg.max_iters or cfg.eval_only:
            break

        # one iteration: forward and backward over this rank's micro-batches, reducing as backward goes
        measuring = iter_num == first_iter  # the first iteration: held bytes at their peaks, sent bytes
        if measuring:
            comm.clear()
            wire.start()
        zero.measuring = measuring
        micro_steps = cfg.gradient_accumulation_steps // dp_size
        global_rows = cfg.batch_size * cfg.gradient_accumulation_steps
        loss_sum = torch.zeros((), device=cfg.device)
        for micro_step in range(micro_steps):
            # stages 0-1 hold full gradients, so they accumulate locally and reduce once (like DDP's no_sync)
            zero.sync = cfg.stage >= 2 or micro_step == micro_steps - 1
            rows = micro_batch_rows(cfg, dp_rank, dp_size, micro_step)
            x, y = get_batch(data['train'], cfg.seed, TRAIN_STREAM, iter_num, global_rows, cfg.block_size, rows,
                             cfg.device)
            with ctx:
                _, loss = model(x, y)
                loss = loss / micro_steps  # the mean over this rank's rows; the reduction averages the ranks
            loss_sum += loss.detach()
            loss.backward()
            zero.finish_backward()
        if cfg.grad_clip != 0.0:
            zero.clip_grad_norm(cfg.grad_clip)
        zero.step(lr)
        zero.measuring = False
        comm.all_reduce(loss_sum, kind='scalars')
        wire_bytes = wire.stop() if measuring else None

        # log
        loss_value = loss_sum.item() / world_size  # the mean loss over the global batch
        if not math.isfinite(loss_value):
            raise SystemExit(f"error: loss is {loss_value} at iter {iter_num}; stopped, the last checkpoint is kept")
        if measuring:  # one row per rank: what it holds and sends, beside the formulas
            row = report_rows(zero, zero.held_bytes(), cfg, iter_num, micro_steps, wire_bytes, wire.why_not)
            rows = [None] * world_size
            if world_size > 1:
                dist.all_gather_object(rows, row)
            else:
                rows = [row]
            if master_process:
                print_report(rows)
                with open(os.path.join(cfg.out_dir, 'log.jsonl'), 'a') as f:
                    f.writelines(json.dumps(r) + '\n' for r in rows)
        iters_since_log += 1
        if iter_num % cfg.log_interval == 0 and master_process:
            dt = (time.time() - t_last) / iters_since_log
            t_last, iters_since_log = time.time(), 0
            tokens_per_sec = tokens_per_iter / dt
            log_row(cfg.out_dir, {'iter': iter_num, 'loss': loss_value, 'lr': lr, 'ms': 1000 * dt,
                                  'tokens_per_sec': tokens_per_sec,
                                  'mfu': mfu(flops_per_token, tokens_per_sec, world_size, peak),
                                  'peak_mem_bytes': peak_memory_bytes(cfg.device)})
        profiler.step()
        iter_num += 1
    profiler.stop()
    writer.wait()

    if cfg.sample_at_end and not cfg.eval_only:
        encode, decode = get_codec(cfg.dataset)
        raw_model.eval()
        start = torch.tensor([encode('\n')], dtype=torch.long, device=cfg.device)
        with ctx:
            text = decode(raw_model.generate(start, 300, temperature=0.8, top_k=200)[0].tolist())
        if master_process:
            print(f"---------- a sample ----------\n{text}\n------------------------------")
            print(f"consolidate and sample more with: python zero.py --consolidate={cfg.out_dir} && "
                  f"python sample.py --out_dir={cfg.out_dir}")
    if master_process:
        print(outputs_line(cfg.out_dir, "zero_rank*.pt (each rank's shard: resume; python zero.py "
                                        f"--consolidate={cfg.out_dir} makes one ckpt.pt)", *profiled(cfg)))
    if owns_group and world_size > 1:
        dist.barrier()  # all leave together: tearing gloo down under a peer still inside a collective can abort
        dist.destroy_process_group()


if __name__ == '__main__':
    run_main(main)
