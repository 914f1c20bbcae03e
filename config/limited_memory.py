# A GPT whose full training state does not fit in a rank's memory limit: 18.9M parameters, 16 bytes each (fp32
# weights, gradients, AdamW's two moments) is 289 MiB, over a 256 MiB --memory_limit_mib; a quarter of it fits.
#   torchrun --standalone --nproc_per_node=4 zero.py --stage=3 config/limited_memory.py --memory_limit_mib=256
#   torchrun --standalone --nproc_per_node=4 train_ddp.py config/limited_memory.py --memory_limit_mib=256
n_layer = 6
n_head = 8
n_embd = 512
block_size = 64
batch_size = 2
gradient_accumulation_steps = 4  # one micro-batch per rank on 4 ranks
max_iters = 20                   # (all of them in train.py's warm-up: the lesson is memory, not the curve)
eval_interval = 20
eval_iters = 1
log_interval = 5
sample_at_end = False
