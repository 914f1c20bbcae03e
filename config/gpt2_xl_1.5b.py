# The GPT-2 XL shape (1.5B parameters): 48 layers, hidden 1600, 25 heads, context 1024, GPT-2 layout (LayerNorm
# with biases, GELU, learned positions, tied embeddings). bench.py --estimate reads this shape (V = 50257, GPT-2's;
# vocab_size itself is not a config key: it comes from the data set, 50304 for GPT-2 BPE data).
#   torchrun --nproc_per_node=8 train_fsdp.py config/gpt2_xl_1.5b.py
out_dir = 'out-gpt2-xl'
n_layer = 48
n_head = 25
n_embd = 1600
block_size = 1024
bias = True
dropout = 0.0
dataset = 'shakespeare'  # (a stand-in: python data/shakespeare/prepare.py downloads it once)
batch_size = 4
gradient_accumulation_steps = 16
learning_rate = 2e-4
min_lr = 2e-5
beta2 = 0.95
warmup_iters = 2000
max_iters = 600000              # (a real run's length: the warm-up, then the cosine
lr_decay_iters = 600000         #  decay to min_lr; train.py's 1250 would end inside the warm-up)
dtype = 'bfloat16'
compile = False  # bench.py --estimate's commands name scripts that do not compile (train.py, train_ddp.py,
#                  train_fsdp.py and zero.py stages 0-2 take --compile=True)
