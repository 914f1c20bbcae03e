"""
train.py plus data parallelism with PyTorch's DistributedDataParallel: every rank holds the whole model, takes
its own slice of the global batch, and DDP all-reduces (averages) the gradients during backward, so every rank
takes the same optimizer step that one process would take on the whole batch.

    torchrun --standalone --nproc_per_node=2 train_ddp.py   # CPU (gloo) or one GPU per process (NCCL)
    python train_ddp.py                                     # one process, no torchrun: exactly train.py
    torchrun --standalone --nproc_per_node=2 train_ddp.py --init_from=resume   # its (or train.py's) ckpt.pt

The global batch is batch_size * gradient_accumulation_steps sequences whatever the world size: N ranks each
run gradient_accumulation_steps // N micro-steps. The ranks share the evaluation; rank 0 logs and writes
train.py's checkpoint format, with every rank's random state in it.
"""

import contextlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common.config import batch_refusal, config_defaults, configure, refuse
from common.data import load_dataset, micro_batches
from common.training import (StepLogger, autocast_context, evaluate, get_lr, loss_function, make_out_dir,
                             outputs_line, print_sample, profiled, run_main, run_shape, set_lr,
                             should_evaluate, should_save, step_profiler)
from common.checkpoints import (CheckpointWriter, gather_rng_states, init_model, restore_rng, seed_dropout,
                                train_checkpoint)
from common.distributed import Comm, finish_distributed, init_distributed, world_size_from_env
from model import balance_routers

# -----------------------------------------------------------------------------
# config: train.py's keys (common/config.py's TRAIN_DEFAULTS; `--help` lists them all), and these
out_dir = 'out-ddp'             # each script its own folder: runs never overwrite one another
dist_timeout = 60               # seconds a rank waits in a collective for the others before it fails
config = config_defaults(globals())
# -----------------------------------------------------------------------------


def sync_context(model, micro_step, micro_steps):
    """DDP all-reduces the gradients inside backward. While accumulating, that would be wasted work: under
    no_sync the gradients only add up locally, and the last micro-step's backward all-reduces the sum."""
    if isinstance(model, DDP) and micro_step < micro_steps - 1:
        return model.no_sync()
    return contextlib.nullcontext()


def train_step(model, optimizer, scaler, batches, ctx, grad_clip, dp):
    """train.py's iteration on this rank's micro-batches: DDP averages the gradients over the ranks during the
    last micro-step's backward. Returns the mean loss over the global batch."""
    loss_sum = 0.0
    for micro_step, (x, y) in enumerate(batches):
        with sync_context(model, micro_step, len(batches)):
            with ctx:
                _, loss = model(x, y)
                loss = loss / len(batches)  # the gradient is the mean over the batch (DDP averages ranks)
            loss_sum += loss.detach()
            scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    balance_routers(model, lambda loads: dp.summed(loads, 'router loads'))  # (MoE: every rank's loads)
    dp.all_reduce(loss_sum)
    return loss_sum.item() / dp.size


def build_ddp(cfg, vocab_size, dp_rank, dp_size):
    """train.py's model, optimizer and scaler (from out_dir/ckpt.pt on resume), each rank its own dropout
    stream, and the model wrapped in DDP. Returns (the wrapped model, the model itself, optimizer, scaler,
    iter_num, best_val_loss)."""
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path)
    model.to(cfg.device)
    if dp_rank == 0:
        print(run_shape(f'world {dp_size} = dp {dp_size} (DDP)', cfg, model.get_num_params()))
    scaler = torch.amp.GradScaler(device_type, enabled=(cfg.dtype == 'float16'))
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                           device_type)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint['optimizer'])
        if checkpoint.get('scaler'):  # (empty where saved without float16's scaler: a fresh one)
            scaler.load_state_dict(checkpoint['scaler'])
        # every rank its own saved dropout stream
        restore_rng(checkpoint, dp_rank, dp_size, cfg.seed, dp_rank)
    else:
        seed_dropout(cfg.seed, dp_rank)  # its own dropout masks; rank 0 keeps train.py's stream
    raw_model = model
    if cfg.compile:
        model = torch.compile(model)
    if dist.is_initialized():
        # broadcasts rank 0's parameters, then all-reduces gradients in buckets as backward produces them
        model = DDP(model, device_ids=[torch.device(cfg.device).index] if device_type == 'cuda' else None)
    return model, raw_model, optimizer, scaler, iter_num, best_val_loss


def train(cfg, model, raw_model, optimizer, scaler, data, ctx, iter_num, best_val_loss, dp):
    """train.py's loop on this rank's slice of every batch: set the LR; every eval_interval evaluate (the
    ranks share the batches) and checkpoint (rank 0 writes, with every rank's dropout stream); one iteration
    and its log line; until max_iters."""
    ckpt_path, master_process = os.path.join(cfg.out_dir, 'ckpt.pt'), dp.rank == 0  # rank 0 logs and saves
    loss_of = loss_function(raw_model, ctx)  # each rank its share of the eval batches: no DDP hooks needed
    writer = CheckpointWriter(cfg.max_iters)  # rank 0 writes in the background: no rank waits on its disk
    profiler = step_profiler(cfg, dp.rank)  # --profile=N: a trace per rank (None without)
    logger = StepLogger(cfg, raw_model.flops_per_token(cfg.block_size), n_devices=dp.size)
    while True:
        lr = get_lr(iter_num, cfg)
        set_lr(optimizer, lr)

        # evaluate, and checkpoint the state from which iteration iter_num starts
        if should_evaluate(iter_num, cfg):
            losses = evaluate(loss_of, model, data, cfg, iter_num, lr, dp)
            if should_save(iter_num, losses['val'], best_val_loss, cfg):
                best_val_loss = min(best_val_loss, losses['val'])
                rng_states = gather_rng_states(dp)  # every rank's dropout stream, so that resume is exact
                if master_process:
                    writer.save(train_checkpoint(raw_model.state_dict(), optimizer.state_dict(), rng_states,
                                                 vars(raw_model.config), iter_num, best_val_loss, vars(cfg),
                                                 scaler.state_dict()), ckpt_path, iter_num)
            logger.restart()
        if iter_num == cfg.max_iters or cfg.eval_only:
            break

        # one iteration, then its log line
        batches = micro_batches(data, cfg, iter_num, dp.rank, dp.size)
        loss = train_step(model, optimizer, scaler, batches, ctx, cfg.grad_clip, dp)
        logger.step(iter_num, loss, lr)
        if profiler:
            profiler.step()
        iter_num += 1
    if profiler:
        profiler.stop()
    writer.wait()


def main(argv):
    cfg = configure(config, argv)
    refuse(batch_refusal(cfg, world_size_from_env(), world_size_from_env()))
    dp_rank, _, dp_size, device = init_distributed(cfg.dist_timeout)  # torchrun's group (or one process)
    cfg.device = device if dist.is_initialized() else cfg.device  # cuda:LOCAL_RANK with NCCL, else the cpu
    dp = Comm(None, 'dp')  # the whole world

    # setup
    make_out_dir(cfg)  # (a new run: a log of its own)
    torch.manual_seed(cfg.seed)
    ctx = autocast_context(cfg.device.split(':')[0], cfg.dtype)

    # data
    data, vocab_size = load_dataset(cfg.dataset)

    # model: train.py's, wrapped in DDP (build_ddp)
    model, raw_model, optimizer, scaler, iter_num, best_val_loss = build_ddp(cfg, vocab_size, dp_rank,
                                                                             dp_size)

    # training loop
    train(cfg, model, raw_model, optimizer, scaler, data, ctx, iter_num, best_val_loss, dp)
    finish_distributed(cfg)

    if dp_rank == 0 and cfg.sample_at_end and not cfg.eval_only:  # the group is gone: no timeout to trip
        print_sample(raw_model, cfg, ctx)
    if dp_rank == 0:
        print(outputs_line(cfg.out_dir, "ckpt.pt (train.py's format: resume, sample.py)", *profiled(cfg)))


if __name__ == '__main__':
    run_main(main)
