"""
The plain training loop: one process, one device. AMP (bfloat16/float16 autocast, GradScaler for float16),
activation checkpointing, gradient accumulation, gradient clipping, cosine LR, checkpoint and exact resume.

    python train.py                                   # CPU, ~3 minutes, the Python stdlib as characters
    python train.py config/train_shakespeare_char.py  # a config file, then --key=value overrides
    python train.py --init_from=resume                # continue the run in out_dir exactly

Every other training script is this file plus one idea, section by section: diff them against it.
"""

import math
import os
import time

import torch

from model import (GPT, TRAIN_STREAM, CheckpointWriter, GPTConfig, StepProfiler, autocast_context, config_defaults,
                   configure, estimate_loss, get_batch, get_codec, get_lr, load_dataset, log_row, mfu,
                   micro_batch_rows, model_config, outputs_line, peak_flops_for, peak_memory_bytes, profiled,
                   restore_rng, rng_state, run_main, run_shape, trim_log)

# -----------------------------------------------------------------------------
# config: the defaults train a small character-level GPT on a laptop CPU in about 3 minutes
out_dir = 'out'
eval_interval = 250
log_interval = 25
eval_iters = 20
eval_only = False
always_save_checkpoint = True   # save at every eval, not only when val loss improves
init_from = 'scratch'           # 'scratch', 'resume' (out_dir/ckpt.pt) or a GPT-2 name: 'gpt2', 'gpt2-medium', ...
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
config = config_defaults(globals())
# -----------------------------------------------------------------------------


def main(argv):
    cfg = configure(config, argv)
    if cfg.dtype not in ('float32', 'bfloat16', 'float16'):
        raise SystemExit(f"error: dtype must be float32, bfloat16 or float16, got {cfg.dtype!r}")
    dp_rank, dp_size = 0, 1  # one process: it holds the whole global batch
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size

    # setup
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    ctx = autocast_context(device_type, cfg.dtype)

    # data
    data, vocab_size = load_dataset(cfg.dataset)

    # model
    iter_num, best_val_loss, checkpoint = 0, 1e9, None
    if cfg.init_from == 'scratch':
        model = GPT(model_config(cfg, vocab_size))
    elif cfg.init_from == 'resume':
        ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
        if not os.path.exists(ckpt_path):
            raise SystemExit(f"error: init_from=resume but there is no checkpoint at {ckpt_path}")
        checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=False)
        model = GPT(GPTConfig(**checkpoint['model_args']))
        model.load_state_dict(checkpoint['model'])
        iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
        trim_log(cfg.out_dir, iter_num)
    elif cfg.init_from.startswith('gpt2'):
        model = GPT.from_pretrained(cfg.init_from, dropout=cfg.dropout,
                                    activation_checkpointing=cfg.activation_checkpointing)
    else:
        raise SystemExit(f"error: init_from must be 'scratch', 'resume' or a GPT-2 name, got {cfg.init_from!r}")
    if cfg.block_size > model.config.block_size:
        raise SystemExit(f"error: block_size {cfg.block_size} is larger than the model's {model.config.block_size}")
    model.to(cfg.device)
    flops_per_token = model.flops_per_token()
    print(run_shape('one process', cfg, model.get_num_params()))
    scaler = torch.amp.GradScaler(device_type, enabled=(cfg.dtype == 'float16'))
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device_type)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint['optimizer'])
        scaler.load_state_dict(checkpoint['scaler'])
        restore_rng(checkpoint, dp_rank, dp_size, cfg.seed, dp_rank)
    checkpoint = None  # free it
    raw_model = model
    if cfg.compile:
        model = torch.compile(model)

    def loss_of(x, y):
        with ctx:
            return model(x, y)[1]

    # training loop
    peak = peak_flops_for(cfg.device, cfg.dtype, cfg.peak_flops)
    writer = CheckpointWriter()  # writes in the background: the next iteration need not wait for the disk
    profiler = StepProfiler(cfg.profile, cfg.out_dir, 0, cfg.device)  # --profile=N: a trace per rank
    t_last, iters_since_log = time.time(), 0
    while True:
        lr = get_lr(iter_num, cfg)
        for group in optimizer.param_groups:
            group['lr'] = lr

        # evaluate, and checkpoint the state from which iteration iter_num starts
        if iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters:
            model.eval()
            losses = estimate_loss(loss_of, data, cfg)
            model.train()
            log_row(cfg.out_dir, {'iter': iter_num, 'train_loss': losses['train'], 'val_loss': losses['val'], 'lr': lr})
            if not math.isfinite(losses['val']):
                raise SystemExit(f"error: val loss is {losses['val']} at iter {iter_num}; kept the last checkpoint")
            if iter_num > 0 and (losses['val'] < best_val_loss or cfg.always_save_checkpoint):
                best_val_loss = min(best_val_loss, losses['val'])
                rng_states = [rng_state()]  # every data-parallel rank's random streams (here one)
                writer.save({
                    'model': raw_model.state_dict(),
                    'optimizer': optimizer.state_dict(),
                    'scaler': scaler.state_dict(),
                    'rng_state': rng_states[0]['cpu'],
                    'cuda_rng_state': rng_states[0]['cuda'],
                    'rng_states': rng_states,
                    'model_args': vars(raw_model.config),
                    'iter_num': iter_num,
                    'best_val_loss': best_val_loss,
                    'config': vars(cfg),
                }, os.path.join(cfg.out_dir, 'ckpt.pt'))
            t_last, iters_since_log = time.time(), 0  # do not count eval time as training time
        if iter_num == cfg.max_iters or cfg.eval_only:
            break

        # one iteration: forward and backward over every micro-batch, then one optimizer step
        micro_steps = cfg.gradient_accumulation_steps // dp_size
        global_rows = cfg.batch_size * cfg.gradient_accumulation_steps
        loss_sum = torch.zeros((), device=cfg.device)
        for micro_step in range(micro_steps):
            rows = micro_batch_rows(cfg, dp_rank, dp_size, micro_step)
            x, y = get_batch(data['train'], cfg.seed, TRAIN_STREAM, iter_num, global_rows, cfg.block_size, rows,
                             cfg.device)
            with ctx:
                _, loss = model(x, y)
                loss = loss / micro_steps  # the gradient is the mean over the whole batch
            loss_sum += loss.detach()
            scaler.scale(loss).backward()
        if cfg.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        # log
        loss_value = loss_sum.item()  # the mean loss over the global batch
        if not math.isfinite(loss_value):
            raise SystemExit(f"error: loss is {loss_value} at iter {iter_num}; stopped, the last checkpoint is kept")
        iters_since_log += 1
        if iter_num % cfg.log_interval == 0:
            dt = (time.time() - t_last) / iters_since_log
            t_last, iters_since_log = time.time(), 0
            tokens_per_sec = tokens_per_iter / dt
            log_row(cfg.out_dir, {'iter': iter_num, 'loss': loss_value, 'lr': lr, 'ms': 1000 * dt,
                                  'tokens_per_sec': tokens_per_sec,
                                  'mfu': mfu(flops_per_token, tokens_per_sec, dp_size, peak),
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
        print(f"---------- a sample ----------\n{text}\n------------------------------")
        print(f"sample more with: python sample.py --out_dir={cfg.out_dir}")
    print(outputs_line(cfg.out_dir, "ckpt.pt (the checkpoint: resume, sample.py)", *profiled(cfg)))


if __name__ == '__main__':
    run_main(main)
