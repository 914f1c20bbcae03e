"""
The plain training loop: one process, one device. AMP (bfloat16/float16 autocast, GradScaler for float16),
activation checkpointing, gradient accumulation, gradient clipping, cosine LR, checkpoint and exact resume.

    python train.py                                   # CPU, ~3 minutes, the Python stdlib as characters
    python train.py config/train_shakespeare_char.py  # a config file, then --key=value overrides
    python train.py --init_from=resume                # continue the run in out_dir exactly

Every other training script is this file plus one idea, section by section: diff them against it.
"""

import os

import torch

from common.config import config_defaults, configure
from common.data import load_dataset, micro_batches
from common.training import (StepLogger, autocast_context, busy_cpu_note, evaluate, get_lr, log_row,
                             loss_function, make_out_dir, outputs_line, print_sample, profiled, run_main,
                             run_shape, set_lr, should_evaluate, should_save, step_profiler)
from common.checkpoints import CheckpointWriter, init_model, restore_rng, rng_state, train_checkpoint
from model import balance_routers

# -----------------------------------------------------------------------------
# config: the defaults train a small character-level GPT on a laptop CPU in about 3 minutes
out_dir = 'out'
eval_interval = 250
log_interval = 25
eval_iters = 20
eval_only = False
always_save_checkpoint = True   # save at every eval, not only when val loss improves
init_from = 'scratch'           # 'scratch', 'resume' (out_dir/ckpt.pt) or a GPT-2 name: 'gpt2', 'gpt2-xl'
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
peak_flops = None               # a device's peak FLOP/s for MFU; None: looked up by GPU name (unknown on CPU)
profile = 0                     # trace this many steps with torch.profiler: out_dir/trace_rank{r}.json
memory_limit_mib = 0            # cap each rank's memory in the kernel (a memory cgroup); 0: no cap
config = config_defaults(globals())
# -----------------------------------------------------------------------------


def train_step(model, optimizer, scaler, batches, ctx, grad_clip):
    """One iteration: forward and backward over every micro-batch (the gradients add up in .grad), then one
    optimizer step. Returns the mean loss over the batch."""
    loss_sum = 0.0
    for x, y in batches:
        with ctx:
            _, loss = model(x, y)
            loss = loss / len(batches)  # the gradient is the mean over the whole batch
        loss_sum += loss.detach()
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    balance_routers(model)  # (a mixture of experts with --router_bias_rate: DeepSeek-V3's balancing)
    return loss_sum.item()


def log_moe(out_dir, iter_num, model, every):
    """A mixture of experts' own row beside each logged step's (of its last micro-batch): the MoE layers'
    mean load-balancing loss ('aux', 1.0 when balanced) and the tokens each expert got, per MoE layer; its
    line says how uneven the load is: the busiest expert's tokens over the mean (1.0 when balanced)."""
    if not model.config.n_expert or iter_num % every:
        return
    tokens = model.tokens_per_expert
    imbalance = (tokens.max(-1).values / tokens.float().mean(-1)).max().item()
    log_row(out_dir, {'iter': iter_num, 'aux': model.aux_loss.item(), 'tokens_per_expert': tokens.tolist()})
    print(f"iter {iter_num}: moe aux {model.aux_loss.item():.4f}, load max/mean {imbalance:.2f}", flush=True)


def build(cfg, vocab_size, device_type):
    """The model init_from names (train.py's initialization, a checkpoint to resume, or GPT-2), its AdamW
    and the float16 loss scaler, on cfg.device. Returns (model, optimizer, scaler, iter_num,
    best_val_loss)."""
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    model, checkpoint, iter_num, best_val_loss = init_model(cfg, vocab_size, ckpt_path)
    model.to(cfg.device)
    print(run_shape('one process', cfg, model.get_num_params()))
    scaler = torch.amp.GradScaler(device_type, enabled=(cfg.dtype == 'float16'))
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                           device_type)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint['optimizer'])
        if checkpoint.get('scaler'):  # (empty where saved without float16's scaler: a fresh one)
            scaler.load_state_dict(checkpoint['scaler'])
        restore_rng(checkpoint, 0, 1, cfg.seed, 0)
    return model, optimizer, scaler, iter_num, best_val_loss


def train(cfg, model, raw_model, optimizer, scaler, data, ctx, iter_num, best_val_loss):
    """nanoGPT's loop: set the LR; every eval_interval evaluate and checkpoint; one iteration and its log
    line; until max_iters. (raw_model: the model itself where model is torch.compile's)"""
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    loss_of = loss_function(model, ctx)  # what evaluation calls: the mean loss of a batch, under autocast
    writer = CheckpointWriter(cfg.max_iters)  # in the background: the next iteration need not wait
    profiler = step_profiler(cfg, 0)  # --profile=N: a trace per rank (None without)
    logger = StepLogger(cfg, raw_model.flops_per_token(cfg.block_size), n_devices=1)
    while True:
        lr = get_lr(iter_num, cfg)
        set_lr(optimizer, lr)

        # evaluate, and checkpoint the state from which iteration iter_num starts
        if should_evaluate(iter_num, cfg):
            losses = evaluate(loss_of, model, data, cfg, iter_num, lr)
            if should_save(iter_num, losses['val'], best_val_loss, cfg):
                best_val_loss = min(best_val_loss, losses['val'])
                writer.save(train_checkpoint(raw_model.state_dict(), optimizer.state_dict(), [rng_state()],
                                             vars(raw_model.config), iter_num, best_val_loss, vars(cfg),
                                             scaler.state_dict()), ckpt_path, iter_num)
            logger.restart()
        if iter_num == cfg.max_iters or cfg.eval_only:
            break

        # one iteration, then its log line
        loss = train_step(model, optimizer, scaler, micro_batches(data, cfg, iter_num), ctx, cfg.grad_clip)
        logger.step(iter_num, loss, lr)
        log_moe(cfg.out_dir, iter_num, raw_model, logger.every)  # (a dense model logs nothing more)
        if profiler:
            profiler.step()
        iter_num += 1
    if profiler:
        profiler.stop()
    writer.wait()


def main(argv):
    cfg = configure(config, argv)
    print(busy_cpu_note(cfg.device) or '', end='')  # (a laptop doing other work: what to expect, what to do)

    # setup
    make_out_dir(cfg)  # (a new run: a log of its own)
    torch.manual_seed(cfg.seed)
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    ctx = autocast_context(device_type, cfg.dtype)

    # data
    data, vocab_size = load_dataset(cfg.dataset)

    # model
    model, optimizer, scaler, iter_num, best_val_loss = build(cfg, vocab_size, device_type)
    raw_model = model
    if cfg.compile:
        model = torch.compile(model)

    # training loop
    train(cfg, model, raw_model, optimizer, scaler, data, ctx, iter_num, best_val_loss)
    if cfg.sample_at_end and not cfg.eval_only:
        print_sample(raw_model, cfg, ctx)
    print(outputs_line(cfg.out_dir, "ckpt.pt (the checkpoint: resume, sample.py)", *profiled(cfg)))


if __name__ == '__main__':
    run_main(main)
