# The Llama-2-7B shape: 32 layers, hidden 4096, 32 heads (multi-head: n_kv_head = n_head), SwiGLU MLP of width
# 11008, RMSNorm, rotary positions, untied head, context 4096. bench.py --estimate reads this shape (V = 32000;
# vocab_size is not a config key: it comes from the data set, 50304 for GPT-2 BPE data).
#   torchrun --nnodes=4 --nproc_per_node=8 ... train_fsdp.py config/llama2_7b.py
out_dir = 'out-llama2-7b'
n_layer = 32
n_head = 32
n_embd = 4096
n_hidden = 11008
block_size = 4096
norm = 'rmsnorm'
mlp = 'swiglu'
pos = 'rope'
tie_embeddings = False
bias = False
norm_eps = 1e-5
dropout = 0.0
dataset = 'shakespeare'
batch_size = 1
gradient_accumulation_steps = 32
learning_rate = 3e-4
min_lr = 3e-5
beta2 = 0.95
warmup_iters = 2000
activation_checkpointing = True
dtype = 'bfloat16'
compile = True
