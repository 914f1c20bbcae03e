"""
train.py plus fully sharded data parallelism with PyTorch's FSDP2 (fully_shard): like DDP every rank takes its
slice of the global batch, but each rank stores only 1/N of every parameter, gradient and AdamW moment
(ZeRO-3). Each block's parameters are all-gathered just before it runs and freed after; gradients are
reduce-scattered. bfloat16 is FSDP's MixedPrecisionPolicy (bf16 compute and all-gathers, fp32 sharded master
weights and fp32 gradient reduction), not autocast.

    torchrun --standalone --nproc_per_node=2 train_fsdp.py               # CPU (gloo) or GPUs (NCCL)
    torchrun --standalone --nproc_per_node=2 train_fsdp.py --dtype=bfloat16 --activation_checkpointing=True
    torchrun --standalone --nproc_per_node=2 train_fsdp.py --init_from=resume   # ckpt_dcp/ (or a ckpt.pt)
    python consolidate.py out-fsdp # out-fsdp/ckpt_dcp/ -> out-fsdp/ckpt.pt, train.py's format, offline

Checkpoints are sharded (torch.distributed.checkpoint: every rank writes its own shards to out_dir/ckpt_dcp/);
consolidate.py joins them into train.py's ckpt.pt, from which train.py, sample.py and the data-parallel
scripts continue.
"""

import os
import shutil
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from common.config import config_defaults, configure, refuse, shared_refusals
from common.data import load_dataset, micro_batches
from common.training import (autocast_context, make_out_dir, outputs_line, print_sample, profiled, run_main,
                             run_shape, training_loop)
from common.checkpoints import (gather_rng_states, init_model, init_values, load_params, materialize,
                                restore_rng, seed_dropout, train_checkpoint)
from common.distributed import (Comm, finish_distributed, init_distributed, return_freed_buffers_to_the_os,
                                world_size_from_env)
from model import balance_routers

SHARDED = 'ckpt_dcp'  # the checkpoint: a folder of torch.distributed.checkpoint's shards in out_dir
# -----------------------------------------------------------------------------
# config: train.py's keys (common/config.py's TRAIN_DEFAULTS; `--help` lists them all), and these
out_dir = 'out-fsdp'            # each script its own folder: runs never overwrite one another
dist_timeout = 60               # seconds a rank waits in a collective for the others before it fails
measure_every = 0               # measure and report every this many steps too; 0: the first step only
config = config_defaults(globals())
# -----------------------------------------------------------------------------


def shard_model(model, device_type, dp_size, dtype):
    """FSDP2: one sharded group per block, and the root group for the rest (embeddings, final norm, the tied
    head). fully_shard turns each parameter into a DTensor that holds this rank's slice of dim 0 (the last
    ranks' slices are shorter when dim 0 does not divide). bfloat16 is FSDP's MixedPrecisionPolicy: bf16
    compute and all-gathers, fp32 sharded master weights, fp32 gradient reduction."""
    mesh = init_device_mesh(device_type, (dp_size,))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if dtype == 'bfloat16' else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    # every step gathers and frees each block's parameters (and their gradients): on the host, glibc kept the
    # freed buffers resident (config/limited_memory.py, 4 ranks: the kernel's count of a rank's peak 470-550
    # MiB, 150-175 with this); on a GPU the caching allocator reuses them
    return_freed_buffers_to_the_os()
    return model


def keep_shards(model):
    """For init_params: each value cut as FSDP2 cut its parameter, this rank's piece into its local shard."""
    params = dict(model.named_parameters(remove_duplicate=False))

    def keep(name, full):
        if name in params:
            p = params[name]
            p.to_local().copy_(distribute_tensor(full.to(p.device), p.device_mesh, p.placements,
                                                 src_data_rank=None).to_local())
    return keep


def train_step(model, optimizer, batches, ctx, grad_clip, dp):
    """train.py's iteration on this rank's micro-batches: FSDP2 gathers each block's parameters around its
    forward and backward and reduce-scatters the gradients in the last micro-step's backward. Returns the
    mean loss over the global batch."""
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
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # the norm of all ranks' shards
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    balance_routers(model, lambda loads: dp.summed(loads, 'router loads'))  # (MoE: every rank's loads)
    dp.all_reduce(loss_sum)
    return loss_sum.item() / dp.size


def build_fsdp(cfg, vocab_size, dp_rank, dp_size):
    """train.py's GPT on the meta device, sharded there (shard_model), then each rank's 1/N of every parameter
    gets storage and train.py's values (init_params), its shards of our sharded checkpoint, or its shards of a
    train.py-format ckpt.pt (any script's; memory-mapped, so each rank reads only its part), or GPT-2's (one
    tensor at a time). AdamW is built over the shards: each rank updates and stores only its own. Returns
    (model, optimizer, iter_num, best_val_loss)."""
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    path = os.path.join(cfg.out_dir, SHARDED)
    sharded = os.path.exists(path)
    ckpt_path = os.path.join(path, 'extras.pt') if sharded else os.path.join(cfg.out_dir, 'ckpt.pt')
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path, meta=True)
    if dp_rank == 0:
        print(run_shape(f'world {dp_size} = dp {dp_size} (FSDP2)', cfg, model.get_num_params()))
    model = shard_model(model, device_type, dp_size, cfg.dtype)  # on meta: each rank's 1/N, shapes only
    materialize(model, cfg.device)  # each rank's 1/N of every parameter gets storage, then its values:
    if checkpoint is None:  # train.py's initialization, or GPT-2's weights, one tensor at a time
        init_values(cfg, model.config, keep_shards(model))
    elif not sharded:  # a whole ckpt.pt: each rank copies out its shard of each parameter
        load_params(checkpoint['model'].items(), keep_shards(model))
    # built over the sharded (DTensor) parameters: each rank's AdamW updates and stores only its shards
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                           device_type)
    if checkpoint is not None:
        if sharded:
            load_sharded(model, optimizer, path)
        else:
            load_whole_optimizer(optimizer, checkpoint['optimizer'])
        # every rank its own saved dropout stream
        restore_rng(checkpoint, dp_rank, dp_size, cfg.seed, dp_rank)
    else:
        seed_dropout(cfg.seed, dp_rank)  # its own dropout masks; rank 0 keeps train.py's stream
    return model, optimizer, iter_num, best_val_loss


# -----------------------------------------------------------------------------
# Checkpoints: torch.distributed.checkpoint's shards, every rank writing its own


def save_sharded(model, optimizer, rng_states, iter_num, best_val_loss, cfg):
    """Every rank writes its own shards of the model and AdamW (torch.distributed.checkpoint) into a fresh
    directory, rank 0 adds the small train.py fields (extras.pt), then swaps the directory in whole, so a
    crash mid-save leaves the previous checkpoint."""
    path, master_process = os.path.join(cfg.out_dir, SHARDED), dist.get_rank() == 0
    tmp, old = path + '.tmp', path + '.old'
    model_sd, optim_sd = get_state_dict(model, optimizer)  # this rank's shards, keyed by name
    if master_process:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save({'model': model_sd, 'optimizer': optim_sd}, checkpoint_id=tmp)
    if master_process:
        extras = train_checkpoint(None, None, rng_states, vars(model.config), iter_num, best_val_loss,
                                  vars(cfg))  # the small fields of train.py's checkpoint
        torch.save(extras, os.path.join(tmp, 'extras.pt'))
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_sharded(model, optimizer, path):
    """Resume from a sharded checkpoint: every rank reads only its own shards of the model and AdamW."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({'model': model_sd, 'optimizer': optim_sd}, checkpoint_id=path)  # in place
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def load_whole_optimizer(optimizer, osd):
    """A whole AdamW state_dict (train.py's, memory-mapped) into the optimizer over the shards: each moment
    cut to this rank's shard as its parameter is, one tensor at a time, before the optimizer sees it."""
    params = [p for group in optimizer.param_groups for p in group['params']]
    state = {}
    for i, moments in osd['state'].items():
        p = params[i]
        # src_data_rank=None: each rank cuts its own piece of the whole value (no broadcast)
        cut = lambda v: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
        state[i] = {k: v if k == 'step' else cut(v) for k, v in moments.items()}
    optimizer.load_state_dict(dict(osd, state=state))


def main(argv):
    cfg = configure(config, argv)
    world = world_size_from_env()
    refuse(*shared_refusals(cfg, 'train_fsdp.py', world, world, compiles=True))
    dp_rank, _, dp_size, device = init_distributed(cfg.dist_timeout, group_of_one=True)  # FSDP2 needs a group
    if 'RANK' in os.environ:
        cfg.device = device  # cuda:LOCAL_RANK with NCCL, else cpu with gloo
    make_out_dir(cfg)  # (a new run: a log of its own)
    torch.manual_seed(cfg.seed)
    ctx = autocast_context(cfg.device.split(':')[0], 'float32')  # no autocast: the MixedPrecisionPolicy casts
    data, vocab_size = load_dataset(cfg.dataset)
    model, optimizer, iter_num, best_val_loss = build_fsdp(cfg, vocab_size, dp_rank, dp_size)
    compiled, dp = torch.compile(model) if cfg.compile else model, Comm(None, 'dp')
    step = lambda it: train_step(compiled, optimizer, micro_batches(data, cfg, it, dp_rank, dp_size), ctx,
                                 cfg.grad_clip, dp)
    save = lambda it, best: save_sharded(model, optimizer, gather_rng_states(dp), it, best, cfg)
    run = SimpleNamespace(model=compiled, optimizer=optimizer, loss_of=lambda x, y: compiled(x, y)[1], dp=dp,
                          data=data, step=step, save=save, n_devices=dp_size, rank=dp_rank,
                          flops_per_token=model.flops_per_token(cfg.block_size), kind='fsdp')
    training_loop(cfg, run, iter_num, best_val_loss)
    if cfg.sample_at_end and not cfg.eval_only:  # every rank generates (each forward gathers the shards)
        print_sample(model, cfg, ctx, show=dp_rank == 0, hint=f"python consolidate.py {cfg.out_dir} && "
                     f"python sample.py --out_dir={cfg.out_dir}")
    if dp_rank == 0:
        print(outputs_line(cfg.out_dir, f"ckpt_dcp/ (every rank's shards: resume; python consolidate.py "
                                        f"{cfg.out_dir} makes one ckpt.pt)", *profiled(cfg)))
    finish_distributed(cfg)


if __name__ == '__main__':
    run_main(main)
