# Fine-tune OpenAI's GPT-2 (124M) on tiny Shakespeare BPE tokens. Needs Hugging Face transformers for the weights
# (pip install transformers; without it train.py says so in one line) and the network once for the data and weights.
#   python data/shakespeare/prepare.py
#   python train.py config/finetune_gpt2.py           # --init_from=gpt2-medium / gpt2-large / gpt2-xl for bigger
#   python sample.py --out_dir=out-finetune-gpt2
out_dir = 'out-finetune-gpt2'
eval_interval = 5
eval_iters = 40
log_interval = 1
always_save_checkpoint = False  # only save when val loss improves
init_from = 'gpt2'
dataset = 'shakespeare'
# 32 sequences of 1024 tokens per iteration; one epoch of tiny Shakespeare is ~300k tokens, i.e. ~9 iterations
batch_size = 1
gradient_accumulation_steps = 32
block_size = 1024               # GPT-2's context
max_iters = 20
learning_rate = 3e-5            # fine-tuning: a small constant learning rate
decay_lr = False
