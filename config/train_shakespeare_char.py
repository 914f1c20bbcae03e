# A baby GPT on tiny Shakespeare characters, as nanoGPT's: about 10M parameters, ~1.47 val loss after 5000 iters.
# A few minutes on one GPU; on a laptop CPU add --device=cpu --compile=False and expect hours (shorten max_iters).
#   python data/shakespeare_char/prepare.py     # (downloads tiny Shakespeare once: needs the network)
#   python train.py config/train_shakespeare_char.py
#   python sample.py --out_dir=out-shakespeare-char
out_dir = 'out-shakespeare-char'
eval_interval = 250             # evaluate often: this small run overfits
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # keep the checkpoint with the best val loss
dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256                # characters of context
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2
learning_rate = 1e-3            # a small model can take a large step
max_iters = 5000
lr_decay_iters = 5000           # usually equal to max_iters
min_lr = 1e-4                   # learning_rate / 10
beta2 = 0.99                    # a bit larger: few tokens per iteration
warmup_iters = 100
