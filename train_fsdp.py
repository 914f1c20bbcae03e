"""
train.py plus fully sharded data parallelism with PyTorch's FSDP2 (fully_shard): like DDP every rank takes its
slice of the global batch, but each rank stores only 1/N of every parameter, gradient and AdamW moment (ZeRO-3).
Each block's parameters are all-gathered just before it runs and freed after; gradients are reduce-scattered.

    torchrun --standalone --nproc_per_node=2 train_fsdp.py                  # CPU (gloo) or GPUs (NCCL)
    torchrun --standalone --nproc_per_node=2 train_fsdp.py --dtype=bfloat16 --activation_checkpointing=True
    torchrun --standalone --nproc_per_node=2 train_fsdp.py --init_from=resume   # from ckpt_dcp/ (or a ckpt.pt)
    python consolidate.py out      # out/ckpt_dcp/ -> out/ckpt.pt in train.py's format, offline, a tensor at a time

bfloat16 is FSDP's MixedPrecisionPolicy (bf16 compute and all-gathers, fp32 sharded master weights and fp32
gradient reduction), not autocast. Checkpoints are sharded (torch.distributed.checkpoint, out_dir/ckpt_dcp/, every
rank writes its own shards); consolidate.py turns them into train.py's ckpt.pt (full model and AdamW state), from
which train.py, sample.py and every other script continue (--export=True: rank 0 gathers it at the end instead,
for small models).
"""

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from formulas import fsdp_held_bytes_formula
from model import init_values, load_params, materialize
from training import (StepLogger, autocast_context, check_batch, config_defaults, configure, evaluate, get_lr,
                      load_dataset, micro_batches, outputs_line, print_sample, profiled, run_main, run_shape,
                      set_lr, should_evaluate, should_save)
from checkpoints import (CheckpointWriter, gather_rng_states, init_model, restore_rng, seed_dropout,
                         train_checkpoint)
from distributed import Comm, finish_distributed, init_distributed, world_size_from_env
from measure import StepProfiler

# -----------------------------------------------------------------------------
# config: train.py's keys (training.TRAIN_DEFAULTS; `--help` lists them all), and these
dist_timeout = 60               # seconds a rank waits in a collective for the others before it fails
export = False                  # when the run ends, rank 0 gathers the whole state into out_dir/ckpt.pt (small models)
config = config_defaults(globals())
# -----------------------------------------------------------------------------


def shard_model(model, device_type, dp_size, dtype):
    """FSDP2: one sharded group per block, and the root group for the rest (embeddings, final norm, the tied
    head). fully_shard turns each parameter into a DTensor that holds this rank's slice of dim 0 (the last
    ranks' slices are shorter when dim 0 does not divide). bfloat16 is FSDP's MixedPrecisionPolicy: bf16 compute
    and all-gathers, fp32 sharded master weights, fp32 gradient reduction."""
    mesh = init_device_mesh(device_type, (dp_size,))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if dtype == 'bfloat16' else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def keep_shards(model):
    """For init_params: each parameter's values cut as FSDP2 cut it (a DTensor's placements on its mesh), this
    rank's piece copied into its local shard; no communication."""
    params = dict(model.named_parameters(remove_duplicate=False))

    def keep(name, full):
        if name in params:
            p = params[name]
            p.to_local().copy_(distribute_tensor(full.to(p.device), p.device_mesh, p.placements,
                                                 src_data_rank=None).to_local())
    return keep


def nbytes(tensors):
    """Bytes of this rank's part of the tensors (a DTensor's local shard)."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in local)


def held_bytes(model, optimizer):
    """Measured: the bytes this rank holds between steps in its local shards of the parameters, the gradients
    and AdamW's two moments (not counting the step counters, one scalar per tensor)."""
    params = list(model.parameters())
    moments = [s[k] for s in optimizer.state.values() for k in ('exp_avg', 'exp_avg_sq') if k in s]
    return {'param_bytes': nbytes(params), 'grad_bytes': nbytes(p.grad for p in params),
            'optim_bytes': nbytes(moments)}


def grad_bytes_now(model):
    """Measured: every gradient byte this rank holds right now: the sharded gradients, and the full-size
    (unsharded) gradients that FSDP2 keeps while set_requires_gradient_sync(False) accumulates micro-steps
    locally. Those live in FSDP's own parameter records (a private attribute, read only here); None where this
    torch version keeps them elsewhere."""
    total = nbytes(p.grad for p in model.parameters())
    for module in model.modules():
        state = getattr(module, '_get_fsdp_state', lambda: None)()
        group = getattr(state, '_fsdp_param_group', None)
        for fsdp_param in getattr(group, 'fsdp_params', []):
            try:
                unsharded = fsdp_param._unsharded_param.grad if hasattr(fsdp_param, '_unsharded_param') else None
                total += nbytes([unsharded, fsdp_param.unsharded_accumulated_grad])
            except AttributeError:
                return None
    return total


class GradPeak:
    """The most gradient bytes this rank held after any micro-step's backward (grad_bytes_now)."""

    def __init__(self, model):
        self.model, self.peak = model, 0

    def update(self):
        if self.peak is not None:
            now = grad_bytes_now(self.model)
            self.peak = None if now is None else max(self.peak, now)


def log_held_bytes(out_dir, iter_num, model, optimizer, peak_grad_bytes, micro_steps, master_process):
    """Every rank's measured bytes, gathered to rank 0: one log row per rank with the formula beside each."""
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, dict(held_bytes(model, optimizer), peak_grad_bytes=peak_grad_bytes))
    numel = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the full parameter's
    formula = fsdp_held_bytes_formula(numel, len(rows), micro_steps)
    for rank, measured in enumerate(rows if master_process else []):
        row = {'iter': iter_num, 'rank': rank, 'numel': numel, 'micro_steps': micro_steps}
        for key, value in measured.items():
            row[key], row[key + '_formula'] = value, formula[key]
        with open(os.path.join(out_dir, 'log.jsonl'), 'a') as f:
            f.write(json.dumps(row) + '\n')
        peak = 'n/a' if measured['peak_grad_bytes'] is None else f"{measured['peak_grad_bytes']:,}"
        print(f"rank {rank} holds (measured, its shards): parameters {measured['param_bytes']:,} B, gradients "
              f"{measured['grad_bytes']:,} B (peak {peak} B over {micro_steps} micro-step(s)), AdamW moments "
              f"{measured['optim_bytes']:,} B | formula 4Ψ/N, 4Ψ/N (peak {formula['peak_grad_bytes']:,.0f}), 8Ψ/N "
              f"(Ψ={numel:,}, N={len(rows)}): {formula['param_bytes']:,.0f}, {formula['grad_bytes']:,.0f}, "
              f"{formula['optim_bytes']:,.0f}")


def save_sharded(state, extras, path, master_process):
    """A sharded checkpoint: every rank writes its own shards of state (torch.distributed.checkpoint) into a
    fresh directory, rank 0 adds the small train.py fields (extras.pt), then swaps the directory in whole, so a
    crash mid-save leaves the previous checkpoint."""
    tmp, old = path + '.tmp', path + '.old'
    if master_process:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=tmp)
    if master_process:
        torch.save(extras, os.path.join(tmp, 'extras.pt'))
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def export_full(model, optimizer, rng_states, iter_num, best_val_loss, cfg, writer):
    """out_dir/ckpt.pt in train.py's format (rank 0 writes it in the background): every rank must call it."""
    model_sd, optim_sd = full_checkpoint_state(model, optimizer)
    if model_sd:
        path = os.path.join(cfg.out_dir, 'ckpt.pt')
        writer.save(train_checkpoint(model_sd, optim_sd, rng_states, vars(model.config), iter_num, best_val_loss,
                                     vars(cfg)), path)
        print(f"exported {path} (train.py's format) at iter {iter_num}")


def full_checkpoint_state(model, optimizer):
    """train.py's 'model' and 'optimizer': the shards gathered to full tensors on rank 0 (on the CPU), the
    optimizer state keyed by position in configure_optimizers' parameter order, as a plain AdamW's state_dict.
    Every rank must call it (it gathers); the others get empty dicts."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options)  # keyed by parameter name
    if not model_sd:
        return {}, {}
    name_of = {p: name for name, p in model.named_parameters()}
    names = [name_of[p] for group in optimizer.param_groups for p in group['params']]
    plain = optimizer.state_dict()  # ids 0..n-1 in that order, and the groups' hyperparameters
    plain['state'] = {i: optim_sd['state'][name] for i, name in enumerate(names) if name in optim_sd['state']}
    return model_sd, plain


def load_whole_optimizer(optimizer, osd):
    """A whole AdamW state_dict (train.py's, memory-mapped) into the optimizer over the shards: each moment cut to
    this rank's shard as its parameter is, one tensor at a time, before the optimizer sees it."""
    params = [p for group in optimizer.param_groups for p in group['params']]
    state = {}
    for i, moments in osd['state'].items():
        p = params[i]
        # src_data_rank=None: each rank cuts its own piece of the whole value (no broadcast)
        state[i] = {k: v if k == 'step' else distribute_tensor(v.to(p.device), p.device_mesh, p.placements,
                                                                src_data_rank=None) for k, v in moments.items()}
    optimizer.load_state_dict(dict(osd, state=state))


def load_sharded(model, optimizer, path):
    """Resume from a sharded checkpoint: every rank reads only its own shards of the model and optimizer state."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {'model': model_sd, 'optimizer': optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state['model'], optim_state_dict=state['optimizer'])


def train_step(model, optimizer, batches, ctx, grad_clip, dp, on_micro_step=None):
    """train.py's iteration on this rank's micro-batches: FSDP2 gathers each block's parameters around its
    forward and backward and reduce-scatters the gradients in the last micro-step's backward. on_micro_step()
    runs after each backward (to measure). Returns the mean loss over the global batch."""
    loss_sum = 0.0
    for micro_step, (x, y) in enumerate(batches):
        # reduce-scatter in the last micro-step's backward only; before it the gradients add up locally
        # (full size, per block: less communication for more memory)
        model.set_requires_gradient_sync(micro_step == len(batches) - 1)
        with ctx:
            _, loss = model(x, y)
            loss = loss / len(batches)  # the gradient is the mean over the whole batch (FSDP averages ranks)
        loss_sum += loss.detach()
        loss.backward()
        if on_micro_step is not None:
            on_micro_step()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # the norm of all ranks' shards
    optimizer.step()
    dp.all_reduce(loss_sum)
    return loss_sum.item() / dp.size


def build_fsdp(cfg, vocab_size, dp_rank, dp_size, sharded_path):
    """train.py's GPT on the meta device, sharded there (shard_model), then each rank's 1/N of every parameter gets
    storage and train.py's values (init_params), its shards of our sharded checkpoint, or its shards of a
    train.py-format ckpt.pt (any script's; memory-mapped, so each rank reads only its part), or GPT-2's (one tensor
    at a time). AdamW is built over the shards: each rank updates and stores only its own.
    Returns (model, optimizer, iter_num, best_val_loss)."""
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    sharded = os.path.exists(sharded_path)
    ckpt_path = os.path.join(sharded_path, 'extras.pt') if sharded else os.path.join(cfg.out_dir, 'ckpt.pt')
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path, meta=True)
    if dp_rank == 0:
        print(run_shape(f'world {dp_size} = dp {dp_size} (FSDP2, fully sharded)', cfg, model.get_num_params()))
    model = shard_model(model, device_type, dp_size, cfg.dtype)  # on meta: each rank's 1/N, shapes only
    materialize(model, cfg.device)  # each rank's 1/N of every parameter gets storage, then its values:
    if checkpoint is None:  # train.py's initialization, or GPT-2's weights, one tensor at a time
        init_values(cfg, model.config, keep_shards(model))
    elif not sharded:  # a whole ckpt.pt: each rank copies out its shard of each parameter
        load_params(checkpoint['model'].items(), keep_shards(model))
    # built over the sharded (DTensor) parameters: each rank's AdamW updates and stores only its shards
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device_type)
    if checkpoint is not None:
        if sharded:
            load_sharded(model, optimizer, sharded_path)
        else:
            load_whole_optimizer(optimizer, checkpoint['optimizer'])
        restore_rng(checkpoint, dp_rank, dp_size, cfg.seed, dp_rank)  # every rank its own saved dropout stream
    else:
        seed_dropout(cfg.seed, dp_rank)  # its own dropout masks; rank 0 keeps train.py's stream
    return model, optimizer, iter_num, best_val_loss


def main(argv):
    cfg = configure(config, argv)
    if cfg.dtype not in ('float32', 'bfloat16'):
        raise SystemExit(f"error: train_fsdp.py trains in float32 or bfloat16 (FSDP's MixedPrecisionPolicy), got "
                         f"{cfg.dtype!r}; float16 needs train.py's loss scaling")
    check_batch(cfg, world_size_from_env(), world_size_from_env())
    dp_rank, _, dp_size, device = init_distributed(cfg.dist_timeout, group_of_one=True)  # FSDP2 needs a group
    if 'RANK' in os.environ:
        cfg.device = device  # cuda:LOCAL_RANK with NCCL, else cpu with gloo
    master_process = dp_rank == 0  # logs, writes the full checkpoint, prints the sample
    dp = Comm(None, 'dp')

    # setup
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    ctx = autocast_context(device_type, 'float32')  # no autocast: the MixedPrecisionPolicy casts instead

    # data
    data, vocab_size = load_dataset(cfg.dataset)

    # model: this rank's shards of train.py's GPT, and its AdamW over them (build_fsdp)
    sharded_path = os.path.join(cfg.out_dir, 'ckpt_dcp')
    model, optimizer, iter_num, best_val_loss = build_fsdp(cfg, vocab_size, dp_rank, dp_size, sharded_path)
    raw_model = model
    if cfg.compile:
        model = torch.compile(model)

    def loss_of(x, y):
        with ctx:
            return model(x, y)[1]

    # training loop
    writer = CheckpointWriter()  # for the exported ckpt.pt, which rank 0 writes in the background
    profiler = StepProfiler(cfg.profile, cfg.out_dir, dp_rank, cfg.device)  # --profile=N: a trace per rank
    logger = StepLogger(cfg, raw_model.flops_per_token(cfg.block_size), n_devices=dp_size)
    grad_peak = GradPeak(raw_model) if iter_num < cfg.max_iters else None  # the first iteration is measured
    while True:
        lr = get_lr(iter_num, cfg)
        set_lr(optimizer, lr)

        # evaluate, and checkpoint the state from which iteration iter_num starts
        if should_evaluate(iter_num, cfg):
            losses = evaluate(loss_of, model, data, cfg, iter_num, lr, dp)
            if should_save(iter_num, losses['val'], best_val_loss, cfg):
                best_val_loss = min(best_val_loss, losses['val'])
                model_sd, optim_sd = get_state_dict(raw_model, optimizer)  # this rank's shards, keyed by name
                extras = train_checkpoint(None, None, gather_rng_states(dp), vars(raw_model.config), iter_num,
                                          best_val_loss, vars(cfg))
                save_sharded({'model': model_sd, 'optimizer': optim_sd}, extras, sharded_path, master_process)
            logger.restart()
        if iter_num == cfg.max_iters or cfg.eval_only:
            break

        # one iteration, then its log line (the first also logs what each rank holds)
        batches = micro_batches(data, cfg, iter_num, dp_rank, dp_size)
        loss = train_step(model, optimizer, batches, ctx, cfg.grad_clip, dp,
                          grad_peak.update if grad_peak else None)
        if grad_peak is not None:  # once, while the gradients and the AdamW state exist
            log_held_bytes(cfg.out_dir, iter_num, model, optimizer, grad_peak.peak, len(batches), master_process)
            grad_peak = None
        optimizer.zero_grad(set_to_none=True)
        logger.step(iter_num, loss, lr)
        profiler.step()
        iter_num += 1
    profiler.stop()

    if cfg.export:  # one train.py-format checkpoint of the state from which iteration iter_num starts
        export_full(raw_model, optimizer, gather_rng_states(dp), iter_num, best_val_loss, cfg, writer)
    if cfg.sample_at_end and not cfg.eval_only:  # every rank generates (each forward gathers the shards)
        print_sample(raw_model, cfg, ctx, show=master_process)
    writer.wait()
    if master_process:
        print(outputs_line(cfg.out_dir, f"ckpt_dcp/ (every rank's shards: resume; python consolidate.py {cfg.out_dir} "
                                        "makes one ckpt.pt)",
                           *(["ckpt.pt (train.py's format, exported at the end)"] if cfg.export else []),
                           *profiled(cfg)))
    finish_distributed(cfg)


if __name__ == '__main__':
    run_main(main)
