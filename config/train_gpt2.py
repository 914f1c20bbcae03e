# GPT-2 small (124M) from scratch, nanoGPT's recipe: ~0.5M tokens per iteration (12 sequences x 1024 tokens x 40
# micro-steps), bfloat16 autocast, torch.compile. Meant for GPUs: one node of 8 GPUs with a data-parallel script,
#   torchrun --standalone --nproc_per_node=8 train_ddp.py config/train_gpt2.py
# where gradient_accumulation_steps (the global count) is shared out among the ranks: 5 micro-steps each on 8 GPUs.
# train.py runs the same config on one GPU, 40 micro-steps per iteration.
# Data: GPT-2 BPE tokens in data/<dataset>/{train,val}.bin. tiny Shakespeare (python data/shakespeare/prepare.py
# downloads it) is far too small for 124M parameters; for a real run make a large corpus with
#   python data/text/prepare.py --input 'corpus/**/*.txt' --tokenizer gpt2 --out data/corpus
# and pass --dataset=corpus. vocab_size is not a config key: it is 50304 for any BPE data set (GPT-2's 50257
# padded to a multiple of 64).
out_dir = 'out-gpt2'
eval_interval = 1000
eval_iters = 200
log_interval = 10
always_save_checkpoint = True
dataset = 'shakespeare'
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
learning_rate = 6e-4
max_iters = 600000
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 2000
lr_decay_iters = 600000
min_lr = 6e-5
dtype = 'bfloat16'
compile = True
