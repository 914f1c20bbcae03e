"""
Sample from a trained model: out_dir/ckpt.pt (its model config and data set come from the checkpoint, so no
model flags are needed) or real GPT-2 weights through Hugging Face transformers.

    python sample.py                                  # out/ckpt.pt, as written by python train.py
    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=2
    python sample.py --start=FILE:prompt.txt --max_new_tokens=200 --temperature=0.9 --top_k=50
    python sample.py --init_from=gpt2 --start="Hello, I'm a language model,"   # needs transformers
    python sample.py --export_hf=out_hf     # out/ckpt.pt as a Hugging Face model directory, then exit

An exported directory loads with transformers.AutoModelForCausalLM.from_pretrained('out_hf') and gives this
model's logits (the GPT-2 layout as GPT2LMHeadModel, the LLaMA layout as LlamaForCausalLM). The tokenizer is
not exported: a character-level data set's vocabulary is in data/<dataset>/meta.pkl, a BPE one is GPT-2's.
"""

import os

import torch

from model import GPT, GPTConfig
from common.config import configure
from common.data import get_codec
from common.training import autocast_context, first_sentence, run_main

# -----------------------------------------------------------------------------
# config
init_from = 'resume'            # 'resume' (out_dir/ckpt.pt), a GPT-2 name ('gpt2', 'gpt2-medium', ...) or dir
out_dir = 'out'
start = '\n'                    # the prompt; FILE:path reads it from a file
num_samples = 3
max_new_tokens = 500
temperature = 0.8               # < 1 sharper, > 1 more random
top_k = 200                     # keep only the top_k most likely tokens; 0 keeps all
seed = 1337
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float32'
compile = False
export_hf = ''                  # a directory: save the model there in Hugging Face's format, then exit
# only the keys above: the model is what the checkpoint (or GPT-2) says it is, and nothing trains
config = {k: v for k, v in globals().items() if k in (
    'init_from', 'out_dir', 'start', 'num_samples', 'max_new_tokens', 'temperature', 'top_k', 'seed',
    'device', 'dtype', 'compile', 'export_hf')}
# -----------------------------------------------------------------------------


def load_model(cfg):
    """(model, dataset name or None for GPT-2 BPE) for init_from."""
    if cfg.init_from == 'resume':
        ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
        if not os.path.exists(ckpt_path):
            shards = os.path.isdir(cfg.out_dir) and any(n != 'log.jsonl' for n in os.listdir(cfg.out_dir))
            raise SystemExit(f"error: no checkpoint at {ckpt_path}; " + (
                f"if {cfg.out_dir} holds a sharded one, join it first: python consolidate.py {cfg.out_dir}"
                if shards else "train one first (python train.py) or set --out_dir"))
        warn_if_older_than_shards(ckpt_path)
        try:
            checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=False)
            if not (isinstance(checkpoint, dict) and 'model_args' in checkpoint):
                raise ValueError('no model_args in it')
        except Exception as e:  # (truncated, not a torch file, not a checkpoint): one line, not a traceback
            raise SystemExit(f"error: {ckpt_path} is not a checkpoint this can read ({type(e).__name__}: "
                             f"{first_sentence(e)}); train again, or join the rank files: python "
                             f"consolidate.py {cfg.out_dir}")
        model = GPT(GPTConfig(**checkpoint['model_args']))
        model.load_state_dict(checkpoint['model'])
        print(f"loaded {ckpt_path}: iteration {checkpoint['iter_num']}, best val loss "
              f"{checkpoint['best_val_loss']:.4f}, data set {checkpoint['config']['dataset']}")
        return model, checkpoint['config']['dataset']
    if cfg.init_from.startswith('gpt2') or os.path.isfile(os.path.join(cfg.init_from, 'config.json')):
        from common.hf import from_pretrained  # (needs transformers
        return from_pretrained(cfg.init_from), None
    raise SystemExit(f"error: init_from must be 'resume', a GPT-2 name or a GPT-2's save_pretrained "
                     f"directory, got {cfg.init_from!r}")


def warn_if_older_than_shards(ckpt_path):
    """A sharded run writes rank files beside ckpt.pt; consolidate.py joins them into ckpt.pt. Rank files
    newer than ckpt.pt are a later run that was not joined: say so, and how to sample it."""
    out_dir, written = os.path.dirname(ckpt_path), os.path.getmtime(ckpt_path)
    newer = sorted(n for n in os.listdir(out_dir) if n.endswith('.pt') and n != 'ckpt.pt'
                   and os.path.getmtime(os.path.join(out_dir, n)) > written)
    if newer:
        print(f"note: {ckpt_path} is older than the rank files beside it ({', '.join(newer[:3])}"
              f"{', ...' if len(newer) > 3 else ''}): this samples the older run; to sample the newer one, "
              f"join it first: python consolidate.py {out_dir}")


def read_prompt(start):
    """--start: the prompt itself, or FILE:path to read it from a file."""
    if not start.startswith('FILE:'):
        return start
    path = start[len('FILE:'):]
    if not os.path.isfile(path):
        raise SystemExit(f"error: start file {path} not found")
    try:
        with open(path, encoding='utf-8') as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise SystemExit(f"error: start file {path} is not UTF-8 text ({e.reason} at byte {e.start})")


def main(argv):
    cfg = configure(config, argv)  # (with its refusals: top_k, temperature below 0, no samples or tokens)
    prompt = read_prompt(cfg.start)
    if cfg.export_hf and os.path.exists(cfg.export_hf) and not os.path.isdir(cfg.export_hf):
        raise SystemExit(f"error: --export_hf={cfg.export_hf} is a file: name a directory (a new one, or one "
                         "to write the model's files into)")

    torch.manual_seed(cfg.seed)
    device_type = 'cuda' if cfg.device.startswith('cuda') else 'cpu'
    ctx = autocast_context(device_type, cfg.dtype)
    model, dataset = load_model(cfg)
    if cfg.export_hf:
        try:
            from common.hf import to_hf  # (needs transformers
            hf_model = to_hf(model)
        except ValueError as e:  # a layout Hugging Face has no class for: one line, not a traceback
            raise SystemExit(f"error: --export_hf: {e}")
        hf_model.save_pretrained(cfg.export_hf)
        print(f"saved the model to {cfg.export_hf} in Hugging Face's format; load it with "
              f"transformers.AutoModelForCausalLM.from_pretrained({cfg.export_hf!r})")
        return
    model.eval()
    model.to(cfg.device)
    if cfg.compile:
        model = torch.compile(model)
    encode, decode = get_codec(dataset, model.config.vocab_size)
    ids = encode(prompt)
    if not ids:
        raise SystemExit(f"error: the prompt {prompt!r} has no character of the model's vocabulary")
    unknown = sorted(set(prompt) - set(decode(ids)))  # (a char vocabulary leaves them out; BPE keeps all)
    if unknown:
        print(f"note: the prompt's {''.join(unknown)!r} is not in the model's vocabulary: left out")
    x = torch.tensor([ids], dtype=torch.long, device=cfg.device)

    with torch.no_grad(), ctx:
        for _ in range(cfg.num_samples):
            y = model.generate(x, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k or None)
            print(decode(y[0].tolist()))
            print('---------------')


if __name__ == '__main__':
    run_main(main)
