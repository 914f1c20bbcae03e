# The CPU default, written out: exactly what `python train.py` with no arguments does. A 0.8M-parameter GPT-2-layout
# model on the Python standard library's own sources as characters (data/stdlib_char, built offline on first use),
# 1250 iterations of 2 x 8 x 128 characters: under 3 minutes on 2 idle CPU cores (~0.12 s per iteration). Val loss
# starts near ln(96) = 4.56 (4.42 at step 0: a fresh model's guesses are not quite uniform); a run of all 1250
# iterations ended at 1.78 (1.93 at step 750; 2026-12-06). Copy this file to change the default.
#   python train.py config/train_stdlib_char.py
#   python sample.py
out_dir = 'out'
eval_interval = 250
log_interval = 25
eval_iters = 20
dataset = 'stdlib_char'
gradient_accumulation_steps = 2
batch_size = 8
block_size = 128
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
learning_rate = 2e-3
max_iters = 1250
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0
decay_lr = True
warmup_iters = 50
lr_decay_iters = 1250
min_lr = 2e-4
