# The TinyLlama-1.1B shape (a LLaMA-2 layout): 22 layers, hidden 2048, 32 query heads sharing 4 key/value heads
# (grouped-query attention), SwiGLU MLP of width 5632, RMSNorm, rotary positions, untied head, context 2048.
# bench.py --estimate reads this shape; with a 32000-token vocabulary it is 1.1B parameters. vocab_size is not a
# config key (it comes from the data set: 50304 for GPT-2 BPE data), so a run here has GPT-2's vocabulary:
#   torchrun --nproc_per_node=8 train_fsdp.py config/tinyllama_1b.py        # or any other strategy script
out_dir = 'out-tinyllama'
n_layer = 22
n_head = 32
n_kv_head = 4
n_embd = 2048
n_hidden = 5632
block_size = 2048
norm = 'rmsnorm'
mlp = 'swiglu'
pos = 'rope'
tie_embeddings = False
bias = False
norm_eps = 1e-5
rope_theta = 10000.0
dropout = 0.0
dataset = 'shakespeare'  # (a stand-in: python data/shakespeare/prepare.py downloads it once)
batch_size = 4
gradient_accumulation_steps = 8
learning_rate = 4e-4
min_lr = 4e-5
beta2 = 0.95
warmup_iters = 2000
max_iters = 600000              # (a real run's length: the warm-up, then the cosine
lr_decay_iters = 600000         #  decay to min_lr; train.py's 1250 would end inside the warm-up)
dtype = 'bfloat16'
compile = False  # pipeline.py, tensor_parallel.py, context_parallel.py, expert_parallel.py, parallel_4d.py
#                  and zero.py stage 3 do not compile; train.py, train_ddp.py, train_fsdp.py and zero.py
#                  (stages 0-2) take --compile=True
