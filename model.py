"""
One GPT, shared by every script in this repo.

The first half is the model: GPT-2 layout by default (learned positions, LayerNorm, GELU MLP, tied embeddings),
with LLaMA-style options in the same classes (norm='rmsnorm', mlp='swiglu', pos='rope', n_kv_head for
grouped-query attention, tie_embeddings=False). The second half is the plumbing that every training script
shares (config overrides, the deterministic global batch, the LR schedule, logging, atomic checkpoints,
process-group setup), so that each training script is train.py plus one idea.
"""

import ast
import contextlib
import inspect
import json
import math
import os
import re
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, fields
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

# -----------------------------------------------------------------------------
# The model


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304     # GPT-2's 50257 padded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_kv_head: int = None       # None: same as n_head (multi-head); fewer: grouped-query attention
    n_hidden: int = None        # MLP width; None: 4*n_embd for gelu, ~8/3*n_embd (multiple of 32) for swiglu
    dropout: float = 0.0
    bias: bool = True           # biases in Linear and LayerNorm, as GPT-2; False is a bit faster
    norm: str = 'layernorm'     # 'layernorm' (GPT-2) or 'rmsnorm' (LLaMA)
    mlp: str = 'gelu'           # 'gelu' (GPT-2) or 'swiglu' (LLaMA)
    gelu: str = 'exact'         # 'exact' (erf) or 'tanh': GPT-2's own approximation ('gelu_new'), set by from_hf
    pos: str = 'learned'        # 'learned' (GPT-2) or 'rope' (LLaMA)
    tie_embeddings: bool = True  # share wte and lm_head (GPT-2); LLaMA unties them
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    activation_checkpointing: bool = False  # recompute each block in backward instead of storing its activations

    def __post_init__(self):
        for name in ('n_kv_head', 'n_hidden'):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_hidden is None:
            self.n_hidden = 4 * self.n_embd if self.mlp == 'gelu' else 32 * math.ceil(8 * self.n_embd / 3 / 32)
        checks = [
            (self.norm in ('layernorm', 'rmsnorm'), f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}"),
            (self.mlp in ('gelu', 'swiglu'), f"mlp must be 'gelu' or 'swiglu', got {self.mlp!r}"),
            (self.gelu in ('exact', 'tanh'), f"gelu must be 'exact' or 'tanh', got {self.gelu!r}"),
            (self.pos in ('learned', 'rope'), f"pos must be 'learned' or 'rope', got {self.pos!r}"),
            (self.n_embd % self.n_head == 0, f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"),
            (self.n_head % self.n_kv_head == 0,
             f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})"),
            (self.pos != 'rope' or (self.n_embd // self.n_head) % 2 == 0, "rope needs an even head size"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1)."""

    def __init__(self, ndim, bias, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None
        self.eps = eps

    def reset_parameters(self):  # (what __init__ set: init_params replays it on a model built on the meta device)
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """LLaMA's norm: scale by the root mean square, no centring, no bias. Computed in fp32 as Hugging Face does."""

    def __init__(self, ndim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.eps = eps

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.type_as(x)


def make_norm(config):
    if config.norm == 'rmsnorm':
        return RMSNorm(config.n_embd, config.norm_eps)
    return LayerNorm(config.n_embd, config.bias, config.norm_eps)


def rope_cos_sin(seq_len, head_dim, theta, device, start=0):
    """cos and sin of the rotary angles for positions start..start+seq_len-1, shape (seq_len, head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(start, start + seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # the "rotate half" layout used by Hugging Face LLaMA
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate pairs (x_i, x_{i+d/2}) of x (B, nh, T, hd) by the position's angle."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention. The query, key and value projections are one
    Linear, c_attn, whose output is laid out as [q (n_head*hd) | k (n_kv_head*hd) | v (n_kv_head*hd)]."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_kv_head) * self.head_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout
        self.rope = config.pos == 'rope'
        self.rope_theta = config.rope_theta
        # the random stream the attention-probability dropout draws from; tensor parallelism gives each rank's
        # heads their own (Megatron's model-parallel RNG), everything else shares the process's stream
        self.dropout_rng = contextlib.nullcontext

    def forward(self, x):
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).split([self.n_head * self.head_dim, self.n_kv_head * self.head_dim,
                                        self.n_kv_head * self.head_dim], dim=2)
        # (B, T, heads*hd) -> (B, heads, T, hd); the head count is read from the tensor, so a tensor-parallel
        # rank that holds only some of the heads runs this same code.
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            cos, sin = rope_cos_sin(T, self.head_dim, self.rope_theta, x.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if k.size(1) != q.size(1):  # grouped-query attention: each kv head serves n_head // n_kv_head query heads
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        dropout = self.dropout if self.training else 0.0
        with self.dropout_rng() if dropout > 0 else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GPT-2: c_proj(gelu(c_fc(x))). LLaMA (SwiGLU): c_proj(silu(c_gate(x)) * c_fc(x))."""

    def __init__(self, config):
        super().__init__()
        self.swiglu = config.mlp == 'swiglu'
        self.gelu_approximate = 'tanh' if config.gelu == 'tanh' else 'none'
        self.c_fc = nn.Linear(config.n_embd, config.n_hidden, bias=config.bias)
        if self.swiglu:
            self.c_gate = nn.Linear(config.n_embd, config.n_hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.n_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        if self.swiglu:
            h = F.silu(self.c_gate(x)) * self.c_fc(x)
        else:
            h = F.gelu(self.c_fc(x), approximate=self.gelu_approximate)
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd) if config.pos == 'learned' else None,
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=make_norm(config),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        # GPT-2's scaled init: each residual projection is divided by sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=True):
        """Parameter count; by default without the position embeddings (the token embeddings count, since they
        are tied to the head and so do the head's FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.transformer.wpe is not None:
            n -= self.transformer.wpe.weight.numel()
        return n

    # forward is three pieces so that the pipeline can run them on different stages
    def embed(self, idx):
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}")
        x = self.transformer.wte(idx)
        if self.transformer.wpe is not None:
            x = x + self.transformer.wpe(torch.arange(T, dtype=torch.long, device=idx.device))
        return self.transformer.drop(x)

    def run_block(self, block, x):
        if self.config.activation_checkpointing and self.training:
            # keep only the block's input; recompute its inside in backward (dropout masks are replayed)
            return checkpoint(block, x, use_reentrant=False)
        return block(x)

    def head(self, x, targets=None):
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1), ignore_index=-1)
        return logits, loss

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for block in self.transformer.h:
            x = self.run_block(block, x)
        return self.head(x, targets)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with weight decay on the 2-D weights (matmuls, embeddings) only, never on biases or norms.
        The two groups, in this order, are what every script's optimizer (and ZeRO's hand-written one) uses."""
        groups = param_groups(self, weight_decay)
        fused = device_type == 'cuda'
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token of sequences of seq_len (the run's block_size; default the model's): 6N for
        the N weights that multiply (forward 2N, backward 4N) plus attention's 12*L*d*s (PaLM's appendix B).
        The token embedding multiplies only as the tied head: untied, it is a lookup, and so is wpe."""
        cfg = self.config
        n_matmul = self.get_num_params()
        if not cfg.tie_embeddings:
            n_matmul -= self.transformer.wte.weight.numel()
        return 6 * n_matmul + 12 * cfg.n_layer * cfg.n_embd * (seq_len or cfg.block_size)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens tokens after idx (B, T), one at a time."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / max(temperature, 1e-8)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('inf')
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx

    @classmethod
    def from_hf(cls, hf_model, **overrides):
        """A GPT whose logits match a Hugging Face GPT2LMHeadModel or LlamaForCausalLM to float precision.
        overrides sets GPTConfig fields that do not change the weights (dropout, activation_checkpointing).
        GPT-2's GELU is its tanh approximation ('gelu_new'): gelu='tanh' here."""
        hf_cfg, sd_hf = hf_model.config, hf_model.state_dict()
        if hf_cfg.model_type == 'gpt2':
            model = cls(gpt2_config(hf_cfg, **overrides))
            sd = model.state_dict()
            with torch.no_grad():
                for name, values in gpt2_tensors(sd_hf.items(), model.config):
                    sd[name].copy_(values)
            return model
        if hf_cfg.model_type == 'llama':
            n_kv = getattr(hf_cfg, 'num_key_value_heads', None) or hf_cfg.num_attention_heads
            bias = bool(getattr(hf_cfg, 'attention_bias', False) or getattr(hf_cfg, 'mlp_bias', False))
            config = GPTConfig(block_size=hf_cfg.max_position_embeddings, vocab_size=hf_cfg.vocab_size,
                               n_layer=hf_cfg.num_hidden_layers, n_head=hf_cfg.num_attention_heads,
                               n_embd=hf_cfg.hidden_size, n_kv_head=n_kv, n_hidden=hf_cfg.intermediate_size,
                               bias=bias, norm='rmsnorm', mlp='swiglu', pos='rope',
                               tie_embeddings=bool(getattr(hf_cfg, 'tie_word_embeddings', False)),
                               norm_eps=hf_cfg.rms_norm_eps, rope_theta=hf_rope_theta(hf_cfg),
                               **{'dropout': 0.0, **overrides})
            model = cls(config)
            sd = model.state_dict()
            sd_hf = dict(sd_hf)
            sd_hf.setdefault('lm_head.weight', sd_hf['model.embed_tokens.weight'])  # tied: stored once
            with torch.no_grad():
                for theirs, mine in llama_names(config).items():
                    if mine in sd and theirs in sd_hf:
                        sd[mine].copy_(sd_hf[theirs])
                    elif mine in sd:  # a bias Hugging Face's model lacks (attention_bias xor mlp_bias): zero
                        sd[mine].zero_()
                for i in range(config.n_layer):
                    for suffix in ('weight', 'bias'):
                        qkv = [sd_hf.get(f'model.layers.{i}.self_attn.{p}_proj.{suffix}') for p in 'qkv']
                        target = sd.get(f'transformer.h.{i}.attn.c_attn.{suffix}')
                        if target is not None and qkv[0] is not None:
                            target.copy_(torch.cat(qkv))
                        elif target is not None:
                            target.zero_()
            return model
        raise ValueError(f"from_hf supports gpt2 and llama models, not {hf_cfg.model_type!r}")

    def to_hf(self):
        """This GPT as a Hugging Face transformers model with the same logits (see model.to_hf)."""
        return to_hf(self)

    @classmethod
    def from_pretrained(cls, name, **overrides):
        """Load GPT-2 weights by name ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl') through transformers."""
        try:
            from transformers import GPT2LMHeadModel
        except ImportError:
            raise SystemExit(f"error: init_from={name} needs Hugging Face transformers: pip install transformers")
        return cls.from_hf(GPT2LMHeadModel.from_pretrained(name), **overrides)


GPT2_CONV1D = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')


def gpt2_config(hf_cfg, **overrides):
    """The GPTConfig of a Hugging Face GPT-2 config (a GPT2Config, or its config.json's fields as attributes)."""
    return GPTConfig(block_size=hf_cfg.n_positions, vocab_size=hf_cfg.vocab_size, n_layer=hf_cfg.n_layer,
                     n_head=hf_cfg.n_head, n_embd=hf_cfg.n_embd, norm_eps=hf_cfg.layer_norm_epsilon,
                     n_hidden=getattr(hf_cfg, 'n_inner', None) or 4 * hf_cfg.n_embd,
                     gelu='exact' if hf_cfg.activation_function == 'gelu' else 'tanh',
                     tie_embeddings=bool(getattr(hf_cfg, 'tie_word_embeddings', True)),
                     **{'dropout': 0.0, 'bias': True, **overrides})


def gpt2_tensors(hf_named, config):
    """GPT-2's (name, tensor) pairs as this repo's: the names under transformer., the four Conv1D weights (stored
    (in, out)) transposed, the causal-mask buffers left out, and a tied head under its own name too."""
    for k, values in hf_named:
        if k.endswith(('.attn.masked_bias', '.attn.bias')):
            continue  # causal-mask buffers, not weights (c_attn.bias is a weight: hence the dot)
        name = k if k.startswith(('transformer.', 'lm_head.')) else 'transformer.' + k
        yield name, values.t() if name.endswith(GPT2_CONV1D) else values
        if name == 'transformer.wte.weight' and config.tie_embeddings:
            yield 'lm_head.weight', values


def is_gpt2(init_from):
    """A GPT-2 to start from: a name ('gpt2', 'gpt2-medium', ...) or a directory that save_pretrained wrote."""
    return init_from.startswith('gpt2') or os.path.isfile(os.path.join(init_from, 'config.json'))


def open_gpt2(name, **overrides):
    """A GPT-2's GPTConfig, and a function that yields its weights as this repo's (name, tensor) pairs one at a
    time from its safetensors file, so a sharded script copies out its share of each and never holds the whole.
    name: a local directory, or a Hugging Face hub name (huggingface_hub downloads it once, then reads its cache)."""
    if os.path.isdir(name):
        config_path, weights_path = os.path.join(name, 'config.json'), os.path.join(name, 'model.safetensors')
    else:
        try:
            from huggingface_hub import hf_hub_download
        except ImportError:
            raise SystemExit(f"error: init_from={name} needs Hugging Face's hub client: pip install transformers")
        config_path, weights_path = hf_hub_download(name, 'config.json'), hf_hub_download(name, 'model.safetensors')
    if not os.path.isfile(weights_path):
        raise SystemExit(f"error: init_from={name}: no model.safetensors in it (save_pretrained writes one)")
    with open(config_path) as f:
        hf_cfg = SimpleNamespace(**json.load(f))
    if getattr(hf_cfg, 'model_type', None) != 'gpt2':
        raise SystemExit(f"error: init_from={name} is a {getattr(hf_cfg, 'model_type', None)!r} model; only GPT-2 "
                         f"weights load here (a LLaMA goes through GPT.from_hf)")
    config = gpt2_config(hf_cfg, **overrides)

    def tensors():
        from safetensors import safe_open
        with safe_open(weights_path, framework='pt') as f:
            yield from gpt2_tensors(((k, f.get_tensor(k)) for k in f.keys()), config)
    return config, tensors


def init_values(cfg, config, keep):
    """The values of a model that init_model built on the meta device, handed to keep(name, values) one tensor at
    a time: a GPT-2's from its file (init_from=gpt2, or a directory), else train.py's initialization."""
    if is_gpt2(cfg.init_from):
        load_params(open_gpt2(cfg.init_from)[1](), keep)
    else:
        init_params(config, cfg.seed, keep)


@torch.no_grad()
def init_params(config, seed, keep):
    """train.py's initialization of GPT(config) after torch.manual_seed(seed), without ever holding the model: the
    same random draws in the same order (each module's default init as the constructor builds it, then
    _init_weights, then the scaled residual projections), each into a temporary full-size tensor of one module,
    and keep(name, values) called with every parameter's final values (under each of its names, a tied weight
    under both), for the caller to copy out the share its rank holds. A sharded script builds its part on the
    meta device and fills it here: the peak is its share plus one module. The random stream ends where GPT(config)
    leaves it."""
    torch.manual_seed(seed)
    with torch.device('meta'):
        skeleton = GPT(config)  # (on meta nothing is drawn: it only gives the modules, their order and shapes)
    leaves = [m for m in skeleton.modules() if hasattr(m, 'reset_parameters') and next(m.parameters(), None) is not
              None and not any(True for _ in m.children())]
    # each parameter by its identity in the skeleton (a tied weight is one, in two modules), before to_empty
    # replaces them: its names, the (module, attribute) pairs that hold it, and the op that writes it last
    names, holder, last_write = {}, {}, {}
    for name, p in skeleton.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for i, module in enumerate(leaves):
        for attr, p in module.named_parameters(recurse=False):
            holder[(i, attr)] = id(p)
            last_write[id(p)] = ('construct', i)
    for i, module in enumerate(leaves):
        if isinstance(module, (nn.Linear, nn.Embedding)):  # what _init_weights draws again
            for attr, p in module.named_parameters(recurse=False):
                last_write[id(p)] = ('init', i)
    scaled = [(id(p), p.shape) for name, p in skeleton.named_parameters() if name.endswith('c_proj.weight')]
    for pid, _ in scaled:
        last_write[pid] = ('scale', pid)

    # one module's parameters at a time, drawn into one scratch buffer (reused: the allocator never fragments)
    scratch = torch.empty(max(sum(p.numel() for p in m.parameters(recurse=False)) for m in leaves))

    def draw_on_cpu(i, draw, op):
        module = leaves[i]
        on_meta, offset = dict(module.named_parameters(recurse=False)), 0
        for attr, p in on_meta.items():
            module._parameters[attr] = nn.Parameter(scratch[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        draw(module)
        for attr in on_meta:
            if last_write[holder[(i, attr)]] == op:
                for name in names[holder[(i, attr)]]:
                    keep(name, module._parameters[attr].detach())
        module._parameters.update(on_meta)  # back to shapes only

    for i in range(len(leaves)):  # the constructors' draws (nn.Linear's kaiming_uniform_, nn.Embedding's normal_)
        draw_on_cpu(i, lambda module: module.reset_parameters(), ('construct', i))
    for i in range(len(leaves)):  # self.apply(self._init_weights): children before parents, leaves in order
        draw_on_cpu(i, skeleton._init_weights, ('init', i))
    for pid, shape in scaled:  # GPT-2's scaled residual projections
        full = scratch[:math.prod(shape)].view(shape)
        nn.init.normal_(full, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        for name in names[pid]:
            keep(name, full)


def keep_own(model):
    """For init_params: the parameters the (cut) model still holds, by name, take their values; the rest is not
    kept anywhere."""
    params = dict(model.named_parameters(remove_duplicate=False))

    def keep(name, full):
        if name in params:
            params[name].data.copy_(full)
    return keep


def materialize(model, device):
    """Storage on device for a model built on the meta device (values still to be written), in place: every
    Parameter stays the same object (so what a script holds, its layout of slices, its optimizer, still points at
    it, and a tied weight stays tied), its meta tensor swapped for an empty one."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # (to_empty would otherwise make new Parameters)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    return model


def hf_rope_theta(hf_cfg):
    """The rotary base of a Hugging Face Llama config (transformers 5 keeps it in rope_parameters)."""
    theta = getattr(hf_cfg, 'rope_theta', None)
    return float(theta if theta is not None else (getattr(hf_cfg, 'rope_parameters', None) or {}).get('rope_theta',
                                                                                                      10000.0))


def llama_names(config):
    """{Hugging Face Llama tensor name: ours}, for every tensor but q/k/v, which our c_attn holds end to end."""
    names = {'model.embed_tokens.weight': 'transformer.wte.weight', 'model.norm.weight': 'transformer.ln_f.weight',
             'lm_head.weight': 'lm_head.weight'}
    for i in range(config.n_layer):
        for theirs, mine in (('self_attn.o_proj', 'attn.c_proj'), ('mlp.gate_proj', 'mlp.c_gate'),
                             ('mlp.up_proj', 'mlp.c_fc'), ('mlp.down_proj', 'mlp.c_proj'),
                             ('input_layernorm', 'ln_1'), ('post_attention_layernorm', 'ln_2')):
            for suffix in ('weight', 'bias'):
                names[f'model.layers.{i}.{theirs}.{suffix}'] = f'transformer.h.{i}.{mine}.{suffix}'
    return names


def to_hf(model):
    """The Hugging Face model with this GPT's weights and the same logits: GPT2LMHeadModel for the GPT-2 layout
    (learned positions, LayerNorm, GELU MLP; biases the model lacks are zeros there), LlamaForCausalLM for the
    LLaMA layout (RoPE, RMSNorm, SwiGLU, grouped-query attention). Then save_pretrained(DIR) makes a directory
    that AutoModelForCausalLM.from_pretrained(DIR) loads. Needs transformers."""
    try:
        import transformers
    except ImportError:
        raise SystemExit("error: exporting to Hugging Face needs transformers: pip install transformers")
    c, sd = model.config, {k: v.detach().cpu() for k, v in model.state_dict().items()}
    layout = (c.pos, c.norm, c.mlp)
    if layout == ('learned', 'layernorm', 'gelu'):
        if c.n_kv_head != c.n_head:
            raise ValueError("GPT-2 has no grouped-query attention: n_kv_head must equal n_head to export")
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
            n_inner=c.n_hidden, activation_function='gelu' if c.gelu == 'exact' else 'gelu_new',
            layer_norm_epsilon=c.norm_eps, resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout,
            tie_word_embeddings=c.tie_embeddings, bos_token_id=0, eos_token_id=0))
        transposed = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
        target = hf.state_dict()
        with torch.no_grad():
            for k, v in target.items():
                if k in sd:
                    v.copy_(sd[k].t() if k.endswith(transposed) else sd[k])
                elif not k.endswith(('.attn.bias', '.attn.masked_bias')):
                    v.zero_()  # a bias this model does not have (bias=False): zero is the same function
        return hf
    if layout == ('rope', 'rmsnorm', 'swiglu'):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.n_hidden,
            num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
            max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
            attention_bias=c.bias, mlp_bias=c.bias, attention_dropout=c.dropout,
            tie_word_embeddings=c.tie_embeddings, bos_token_id=0, eos_token_id=0))
        hd = c.n_embd // c.n_head
        target, names = hf.state_dict(), llama_names(c)
        for i in range(c.n_layer):
            for suffix in ('weight', 'bias'):
                if f'transformer.h.{i}.attn.c_attn.{suffix}' in sd:
                    parts = sd[f'transformer.h.{i}.attn.c_attn.{suffix}'].split([c.n_head * hd, c.n_kv_head * hd,
                                                                                  c.n_kv_head * hd])
                    sd.update({f'model.layers.{i}.self_attn.{p}_proj.{suffix}': t for p, t in zip('qkv', parts)})
        with torch.no_grad():
            for k, v in target.items():
                v.copy_(sd[names.get(k, k)])
        return hf
    raise ValueError(f"to_hf exports the GPT-2 layout (learned, layernorm, gelu) or the LLaMA layout (rope, rmsnorm, "
                     f"swiglu), not pos={c.pos}, norm={c.norm}, mlp={c.mlp}")


def param_groups(model, weight_decay):
    """AdamW's two parameter groups: decay for every parameter of 2 or more dims, no decay for the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
            {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]


# -----------------------------------------------------------------------------
# Plumbing shared by every training script: config, data, LR schedule, logging, checkpoints, processes.

def config_defaults(script_globals):
    """The config of a script: its module-level ints, floats, bools, strings and Nones, plus every GPTConfig field."""
    cfg = {f.name: f.default for f in fields(GPTConfig)}
    for k, v in script_globals.items():
        if not k.startswith('_') and not k.isupper() and isinstance(v, (int, float, bool, str, type(None))):
            cfg[k] = v
    cfg.pop('vocab_size')  # comes from the data set
    return cfg


def _checked(key, value, default):
    """value, if it has the type of default (an int is a fine float, None fits a None default), else SystemExit."""
    if default is None or value is None and key in ('n_kv_head', 'n_hidden', 'peak_flops'):
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(default, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float))
        value = float(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise SystemExit(f"error: config key '{key}' must be {type(default).__name__}, got {value!r}")
    return value


def configure(defaults, argv):
    """nanoGPT's override rule: `script.py [config/file.py ...] [--key=value ...]`, applied in order.
    A config file is Python that assigns keys; values on the command line are Python literals (or plain strings).
    An unknown key or a value of the wrong type exits before any work, naming the key and the valid ones."""
    cfg = dict(defaults)

    def set_key(key, value, source):
        if key not in defaults:
            raise SystemExit(f"error: unknown config key '{key}' (from {source}); "
                             f"valid keys: {', '.join(sorted(defaults))}")
        cfg[key] = _checked(key, value, defaults[key])

    for arg in argv:
        if not arg.startswith('--'):
            if not os.path.isfile(arg):
                raise SystemExit(f"error: config file {arg} not found")
            namespace = {}
            exec(open(arg).read(), {}, namespace)
            for key, value in namespace.items():
                if not key.startswith('_') and not inspect.ismodule(value):
                    set_key(key, value, arg)
        else:
            key, eq, text = arg[2:].partition('=')
            if not eq:
                raise SystemExit(f"error: expected --key=value, got {arg}")
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                value = text  # a bare word is a string
            set_key(key, value, arg)
    return SimpleNamespace(**cfg)


def model_config(cfg, vocab_size):
    """The GPTConfig that the run's config describes."""
    args = {f.name: getattr(cfg, f.name) for f in fields(GPTConfig) if f.name != 'vocab_size'}
    args['vocab_size'] = vocab_size
    try:
        return GPTConfig(**args)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


def prepare_once(data_dir, prepare):
    """Run data_dir's prepare.py in one process: every rank of a fresh checkout arrives here at once, the first
    to lock data_dir/.prepare.lock prepares, the others wait on the lock and then find the files (written under
    temporary names and renamed, so nobody reads half a file)."""
    import fcntl
    import runpy
    with open(os.path.join(data_dir, '.prepare.lock'), 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(data_dir, 'train.bin')):
            print(f"{data_dir} is missing its data: preparing it now (python {os.path.relpath(prepare)})",
                  flush=True)
            runpy.run_path(prepare, run_name='__main__')


def load_dataset(dataset):
    """Memmaps of data/<dataset>/{train,val}.bin and the vocabulary size (from meta.pkl, else GPT-2's 50304).
    The default data set (stdlib_char) is built here on first use; any other missing one names its command."""
    import pickle
    data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', dataset)
    if not os.path.exists(os.path.join(data_dir, 'train.bin')):
        prepare = os.path.join(data_dir, 'prepare.py')
        if dataset == 'stdlib_char' and os.path.exists(prepare):
            prepare_once(data_dir, prepare)
        else:
            hint = (f"python data/{dataset}/prepare.py" if os.path.exists(prepare) else
                    "see data/ for the prepare scripts")
            raise SystemExit(f"error: data set '{dataset}' not found in {data_dir}; make it with: {hint}")
    data = {split: np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
            for split in ('train', 'val')}
    vocab_size = 50304
    meta_path = os.path.join(data_dir, 'meta.pkl')
    if os.path.exists(meta_path):
        with open(meta_path, 'rb') as f:
            vocab_size = pickle.load(f)['vocab_size']
    return data, vocab_size


TRAIN_STREAM, EVAL_STREAM = 0, 1


def get_batch(tokens, seed, stream, step, n_rows, block_size, rows=None, device='cpu'):
    """Rows `rows` (a slice; default all) of the batch of n_rows sequences for (seed, stream, step).
    The batch is a pure function of those numbers, so every strategy and world size sees the same global batch
    at iteration `step` and each data-parallel rank just takes its own contiguous slice of it; resume needs no
    data-loader state. x is the sequence, y the same shifted by one token."""
    if len(tokens) <= block_size + 1:
        raise SystemExit(f"error: block_size {block_size} is too large for a data split of {len(tokens)} tokens")
    rng = np.random.default_rng([seed, stream, step])
    starts = rng.integers(0, len(tokens) - block_size - 1, size=n_rows)
    if rows is not None:
        starts = starts[rows]
    window = np.asarray(tokens[starts[:, None] + np.arange(block_size + 1)], dtype=np.int64)  # one gather
    xy = torch.from_numpy(window)
    x, y = xy[:, :-1], xy[:, 1:]
    if device.startswith('cuda'):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.contiguous(), y.contiguous()


def micro_batch_rows(cfg, dp_rank, dp_size, micro_step):
    """The one batch rule of this repo. The global batch is batch_size * gradient_accumulation_steps sequences,
    whatever the world size. Each of the dp_size data-parallel ranks owns a contiguous block of it and walks
    through that block batch_size sequences per micro-step, gradient_accumulation_steps // dp_size micro-steps."""
    rows_per_rank = cfg.batch_size * (cfg.gradient_accumulation_steps // dp_size)
    first = dp_rank * rows_per_rank + micro_step * cfg.batch_size
    return slice(first, first + cfg.batch_size)


def get_lr(it, cfg):
    """Linear warm-up for warmup_iters, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


@torch.no_grad()
def estimate_loss(loss_of, data, cfg, dp=None):
    """Mean loss over eval_iters global batches for each split, by training's one batch rule: evaluation batch k
    is the global batch (batch_size * gradient_accumulation_steps sequences) of (seed, EVAL_STREAM, k), each
    data-parallel rank (dp: their Comm) takes its contiguous slice in micro-batches of batch_size, and one
    all-reduce adds the sums up. So the losses are equal for every strategy, world size and split of the batch.
    loss_of(x, y) returns the mean loss of one micro-batch however the strategy computes it."""
    dp_rank, dp_size = (dp.rank, dp.size) if dp is not None else (0, 1)
    n_micro, global_rows = cfg.gradient_accumulation_steps, cfg.batch_size * cfg.gradient_accumulation_steps
    sums = torch.zeros(2, device=cfg.device)
    for i, split in enumerate(('train', 'val')):
        for k in range(cfg.eval_iters):
            for micro_step in range(n_micro // dp_size):
                x, y = get_batch(data[split], cfg.seed, EVAL_STREAM, k, global_rows, cfg.block_size,
                                 rows=micro_batch_rows(cfg, dp_rank, dp_size, micro_step), device=cfg.device)
                sums[i] += loss_of(x, y).float()
    if dp is not None:
        dp.all_reduce(sums)
    n = cfg.eval_iters * n_micro  # micro-batches of equal size: their mean is the global batch's
    return {'train': sums[0].item() / n, 'val': sums[1].item() / n}


def autocast_context(device_type, dtype):
    """torch.autocast for bfloat16/float16 on CPU or CUDA; a no-op context for float32. On CUDA, float32 matmuls
    run on the TF32 tensor cores, as nanoGPT sets them (so MFU divides by the TF32 peak)."""
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if dtype == 'float32':
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype={'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype])


# Dense (no sparsity) peak FLOP/s of common accelerators by dtype, for MFU; 'float32' is the TF32 tensor-core peak
# where the GPU has one (autocast_context turns TF32 on). A key matches the device name as a whole word, so 'L4'
# is not found inside 'L40S'.
PEAK_FLOPS = {
    'H200': {'bfloat16': 989e12, 'float16': 989e12, 'float32': 495e12},
    'H100': {'bfloat16': 989e12, 'float16': 989e12, 'float32': 495e12},
    'A100': {'bfloat16': 312e12, 'float16': 312e12, 'float32': 156e12},
    'L40S': {'bfloat16': 362e12, 'float16': 362e12, 'float32': 183e12},
    'A10G': {'bfloat16': 70e12, 'float16': 70e12, 'float32': 35e12},
    'L4': {'bfloat16': 121e12, 'float16': 121e12, 'float32': 60e12},
    'RTX 4090': {'bfloat16': 165e12, 'float16': 165e12, 'float32': 83e12},
    'RTX 3090': {'bfloat16': 71e12, 'float16': 71e12, 'float32': 36e12},
    'V100': {'float16': 125e12, 'float32': 15.7e12},  # no bf16, no TF32
    'T4': {'float16': 65e12, 'float32': 8.1e12},
}


def peak_flops_for(device, dtype, override=None, device_name=None):
    """The peak FLOP/s of one device that MFU divides by: the peak_flops config key if set, else the table, else
    None (a CPU's peak is not known here: set --peak_flops to see MFU on one)."""
    if override:
        return override
    if device.startswith('cuda') or device_name:
        name = device_name or torch.cuda.get_device_name(device)
        for key, by_dtype in PEAK_FLOPS.items():
            if re.search(rf'(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])', name):
                return by_dtype.get(dtype)
    return None


def mfu(flops_per_token, tokens_per_sec, n_devices, peak_flops):
    """Model FLOPs utilisation per device: the whole model's training FLOPs per token times the tokens per second
    of the whole run (every rank together), over n_devices devices' peak. None where the peak is unknown."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_sec / (n_devices * peak_flops)


def saved_bytes_counter(model):
    """Measured activations: saved_tensors_hooks that note every distinct storage autograd keeps for backward,
    the model's parameters left out. Use `with hooks:` around a forward; sum(seen.values()) is the bytes held.
    Returns (hooks, seen: {storage: bytes})."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), seen


def peak_memory_bytes(device):
    """Peak memory of this process: the CUDA allocator's high-water mark on GPU, the peak resident set on CPU."""
    if device.startswith('cuda'):
        return torch.cuda.max_memory_allocated(device)
    return peak_resident_bytes()


def peak_resident_bytes():
    """This process's peak resident set: Linux's VmHWM, which starts afresh at exec (getrusage's ru_maxrss keeps
    the parent's resident set from before the exec, so a child of a big process would report the parent's)."""
    try:
        with open('/proc/self/status') as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmHWM:'))
    except (OSError, StopIteration):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == 'darwin' else 1024)


def progress(done, total, what):
    """For a long step (consolidating, preparing data): 'what: done/total (pct)' each time it crosses a tenth."""
    if total and (done == total or int(10 * done / total) != int(10 * (done - 1) / total)):
        print(f"{what}: {done}/{total} ({100 * done / total:.0f}%)", flush=True)


def run_shape(shape, cfg, n_params):
    """The line every training script prints when it starts: the run's shape, in one place."""
    rows = cfg.batch_size * cfg.gradient_accumulation_steps
    return (f"run: {shape}; global batch {rows} sequences x {cfg.block_size} tokens = {rows * cfg.block_size:,} "
            f"tokens per step; {n_params / 1e6:.2f}M parameters; {cfg.dtype} on {cfg.device}; outputs in "
            f"{cfg.out_dir}/")


def profiled(cfg):
    """The trace files of --profile, for outputs_line."""
    return ['trace_rank*.json (--profile: open at ui.perfetto.dev)'] if cfg.profile else []


def outputs_line(out_dir, *files):
    """The line every training script prints when it ends: where its outputs are."""
    return f"done; outputs in {out_dir}/: log.jsonl (every logged row as JSON), " + ', '.join(files)


def log_row(out_dir, row):
    """Append one row to out_dir/log.jsonl and print it as one human line."""
    with open(os.path.join(out_dir, 'log.jsonl'), 'a') as f:
        f.write(json.dumps(row) + '\n')
    if 'val_loss' in row:
        print(f"step {row['iter']}: train loss {row['train_loss']:.4f}, val loss {row['val_loss']:.4f}", flush=True)
    elif 'loss' in row:
        mfu = f"{100 * row['mfu']:.2f}%" if row.get('mfu') is not None else 'n/a'
        print(f"iter {row['iter']}: loss {row['loss']:.4f}, lr {row['lr']:.2e}, {row['ms']:.1f} ms, "
              f"{row['tokens_per_sec']:.0f} tok/s, mfu {mfu}, peak mem {row['peak_mem_bytes'] / 2**20:.0f} MiB",
              flush=True)


def log_rank_rows(out_dir, row):
    """Every rank's row (a collective: each rank passes its own), in rank order; rank 0 appends them to
    out_dir/log.jsonl. Returns the rows on every rank."""
    rows = [row]
    if dist.is_initialized():
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
    if is_master():
        with open(os.path.join(out_dir, 'log.jsonl'), 'a') as f:
            f.writelines(json.dumps(r) + '\n' for r in rows)
    return rows


def trim_log(out_dir, iter_num):
    """On resume, drop the log rows from iter_num on: the resumed run writes them again, so log.jsonl stays the
    record of one run."""
    path = os.path.join(out_dir, 'log.jsonl')
    if os.path.exists(path):
        rows = [line for line in open(path) if line.strip() and json.loads(line).get('iter', -1) < iter_num]
        with open(path, 'w') as f:
            f.writelines(rows)


def get_codec(dataset):
    """encode(str) -> list[int] and decode(list[int]) -> str: the char vocabulary of data/<dataset>/meta.pkl if it
    has one, else (also for dataset None) tiktoken's GPT-2 BPE."""
    import pickle
    meta_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', dataset or '', 'meta.pkl')
    if dataset is not None and os.path.exists(meta_path):
        with open(meta_path, 'rb') as f:
            meta = pickle.load(f)
        stoi, itos = meta['stoi'], meta['itos']
        return (lambda s: [stoi[c] for c in s if c in stoi]), (lambda ids: ''.join(itos[i] for i in ids))
    import tiktoken
    try:
        enc = tiktoken.get_encoding('gpt2')
    except Exception as e:  # offline on first use: tiktoken cannot fetch its vocabulary files
        raise SystemExit(f"error: tiktoken's GPT-2 encoding is not available ({type(e).__name__}); it is "
                         f"downloaded on first use, so run once with network access")
    return (lambda s: enc.encode(s, allowed_special={'<|endoftext|>'})), enc.decode


def save_checkpoint(obj, path):
    """torch.save to a temporary file, then rename: a crash mid-write never leaves a broken checkpoint."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)  # atomic on POSIX and Windows
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def cpu_copy(obj):
    """A copy of obj (dicts, lists, tuples of tensors and plain values) with every tensor copied to CPU memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to('cpu', copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


class CheckpointWriter:
    """Writes checkpoints in a background thread (as torch.distributed.checkpoint's async_save does), so that a
    slow disk never keeps a rank out of the next collective while its peers wait there under the process group's
    timeout: a 7B model's checkpoint takes minutes, the timeout is one. save() copies the state to CPU memory
    (training goes on changing the tensors), waits for the previous write, starts this one and returns."""

    def __init__(self):
        self.thread, self.error = None, None

    def save(self, obj, path):
        snapshot = cpu_copy(obj)
        self.wait()
        self.thread = threading.Thread(target=self._write, args=(snapshot, path), daemon=False)
        self.thread.start()

    def _write(self, snapshot, path):
        try:
            save_checkpoint(snapshot, path)
        except BaseException as e:  # raised again in the training thread, at the next save or at the end
            self.error = e

    def wait(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


class StepProfiler:
    """--profile=N: N training steps (after one warm-up step) under torch.profiler, written per rank as a
    Chrome/Perfetto trace, out_dir/trace_rank{r}.json: kernels, collectives and waits on one time axis (open it at
    ui.perfetto.dev or chrome://tracing). step() after every iteration; stop() after the loop."""

    def __init__(self, n_steps, out_dir, rank, device):
        self.path, self.prof = os.path.join(out_dir, f'trace_rank{rank}.json'), None
        if n_steps > 0:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.startswith('cuda'):
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(
                activities=activities, schedule=torch.profiler.schedule(wait=0, warmup=1, active=n_steps, repeat=1),
                on_trace_ready=lambda prof: prof.export_chrome_trace(self.path))
            self.prof.start()

    def step(self):
        if self.prof is not None:
            self.prof.step()

    def stop(self):
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
            if os.path.exists(self.path):
                print(f"wrote {self.path} (open it at ui.perfetto.dev)", flush=True)


# -----------------------------------------------------------------------------
# The steps of the loop every training script runs, named once, so that each main() reads like train.py's

def is_master():
    """Rank 0, or the only process: it logs, prints and writes the files the ranks share."""
    return not dist.is_initialized() or dist.get_rank() == 0


def check_batch(cfg, dp_size, world_size):
    """The one batch rule needs whole micro-batches on every data-parallel rank."""
    if cfg.gradient_accumulation_steps % dp_size:
        fits = math.ceil(cfg.gradient_accumulation_steps / dp_size) * dp_size
        raise SystemExit(f"error: gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be divisible "
                         f"by the data-parallel size dp={dp_size} (world size {world_size}): each data-parallel "
                         f"rank takes whole micro-batches; use --gradient_accumulation_steps={fits} or fewer "
                         f"processes")


def init_model(cfg, vocab_size, ckpt_path=None, gpt2=True, meta=False):
    """The model init_from names: 'scratch' (train.py's initialization from cfg.seed), 'resume' (ckpt_path, a
    checkpoint with 'model_args') or a GPT-2 name (when gpt2). On the CPU, with the checkpoint's 'model' loaded.
    With meta: on the meta device, shapes only and no values, for a sharded script to cut before it materializes
    its share and fills it (init_params, load_params or its own checkpoint); the checkpoint is memory-mapped, so a
    rank that copies out its share of a whole one reads only those pages; a GPT-2's weights are read one tensor at
    a time by init_values.
    Returns (model, the checkpoint or None, iter_num, best_val_loss); on resume the log is trimmed to iter_num."""
    checkpoint, iter_num, best_val_loss = None, 0, 1e9
    on_meta = torch.device('meta') if meta else contextlib.nullcontext()
    if cfg.init_from == 'scratch':
        with on_meta:
            model = GPT(model_config(cfg, vocab_size))
    elif cfg.init_from == 'resume':
        if os.path.exists(ckpt_path):
            checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=False, mmap=meta)
        check_resume_files(checkpoint, ckpt_path)
        with on_meta:
            model = GPT(GPTConfig(**checkpoint['model_args']))
        if not meta:
            model.load_state_dict(checkpoint['model'])
        iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
        if is_master():
            trim_log(cfg.out_dir, iter_num)
    elif gpt2 and is_gpt2(cfg.init_from):
        overrides = dict(dropout=cfg.dropout, activation_checkpointing=cfg.activation_checkpointing)
        if meta:  # the shapes from its config; its weights come later, one tensor at a time (init_values)
            with on_meta:
                model = GPT(open_gpt2(cfg.init_from, **overrides)[0])
        else:
            model = GPT.from_pretrained(cfg.init_from, **overrides)
    else:
        raise SystemExit(f"error: init_from must be 'scratch', 'resume'{' or a GPT-2 name' if gpt2 else ''}, "
                         f"got {cfg.init_from!r}")
    if cfg.block_size > model.config.block_size:
        raise SystemExit(f"error: block_size {cfg.block_size} is larger than the model's {model.config.block_size}")
    return model, checkpoint, iter_num, best_val_loss


def check_resume_files(checkpoint, ckpt_path):
    """init_from=resume: every rank found its checkpoint file (ckpt_path: a shard, a slice, a stage, or one ckpt.pt
    for all), and all are from one iteration. Each file is written atomically, but by its own rank, so a run stopped
    while saving can leave some ranks' files a save behind: resumed, that mix would be a model that never existed.
    Said on every rank in one line (the ranks compare notes first), never left to hang a later collective."""
    iters = [None if checkpoint is None else checkpoint['iter_num']]
    if dist.is_initialized() and dist.get_world_size() > 1:
        mine, iters = iters[0], [None] * dist.get_world_size()
        dist.all_gather_object(iters, mine)
    if checkpoint is None:
        raise SystemExit(f"error: init_from=resume but there is no checkpoint at {ckpt_path}")
    missing = [rank for rank, it in enumerate(iters) if it is None]
    if missing:
        raise SystemExit(f"error: init_from=resume but rank(s) {', '.join(map(str, missing))} found no checkpoint "
                         f"(this rank's: {ckpt_path})")
    if len(set(iters)) > 1:
        at = ', '.join(f"rank {rank}: {it}" for rank, it in enumerate(iters))
        raise SystemExit(f"error: init_from=resume: the ranks' checkpoint files are from different iterations ({at}; "
                         f"this rank's is {ckpt_path}): a run stopped while saving leaves some a save behind")


@torch.no_grad()
def load_params(named_tensors, keep):
    """A whole model's values ((name, tensor) pairs: a train.py checkpoint's items, or a GPT-2's from open_gpt2)
    handed to keep(name, values) one at a time, as init_params hands train.py's initialization: a sharded script
    copies out its share of each."""
    for name, values in named_tensors:
        keep(name, values)


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group['lr'] = lr


def should_evaluate(iter_num, cfg):
    return iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters


def evaluate(loss_of, model, data, cfg, iter_num, lr, dp=None):
    """estimate_loss with the model in eval mode (no dropout), logged by rank 0. Every rank must call it (the
    data-parallel ranks share the batches). A loss that is not finite stops the run, keeping the last checkpoint."""
    model.eval()
    losses = estimate_loss(loss_of, data, cfg, dp)
    model.train()
    if is_master():
        log_row(cfg.out_dir, {'iter': iter_num, 'train_loss': losses['train'], 'val_loss': losses['val'], 'lr': lr})
    if not math.isfinite(losses['val']):
        raise SystemExit(f"error: val loss is {losses['val']} at iter {iter_num}; kept the last checkpoint")
    return losses


def should_save(iter_num, val_loss, best_val_loss, cfg):
    return iter_num > 0 and (val_loss < best_val_loss or cfg.always_save_checkpoint)


def train_checkpoint(model_sd, optimizer_sd, rng_states, model_args, iter_num, best_val_loss, config, scaler_sd=None):
    """train.py's checkpoint: what every script resumes from and sample.py reads. rng_states: every data-parallel
    rank's random streams, in rank order (rank 0's are also saved under nanoGPT's names)."""
    return {'model': model_sd, 'optimizer': optimizer_sd, 'scaler': scaler_sd or {},
            'rng_state': rng_states[0]['cpu'], 'cuda_rng_state': rng_states[0]['cuda'], 'rng_states': rng_states,
            'model_args': model_args, 'iter_num': iter_num, 'best_val_loss': best_val_loss, 'config': config}


def adamw_state_dict(model_args, state_by_name, cfg):
    """torch AdamW's state_dict for train.py's model (configure_optimizers' groups and parameter order), from the
    per-parameter states {name: {'step', 'exp_avg', 'exp_avg_sq'}} a consolidation has put back together. The model
    is built on the meta device: its names and order, none of its memory."""
    with torch.device('meta'):
        dense = GPT(GPTConfig(**model_args))
    optimizer = dense.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'], (cfg['beta1'], cfg['beta2']),
                                           'cpu')
    name_of = {id(p): n for n, p in dense.named_parameters()}
    order = [name_of[id(p)] for group in optimizer.param_groups for p in group['params']]
    sd = optimizer.state_dict()
    sd['state'] = {i: state_by_name[n] for i, n in enumerate(order) if n in state_by_name}
    for group in sd['param_groups']:
        group['eps'] = cfg.get('adam_eps', group['eps'])
    return sd


def micro_batches(data, cfg, iter_num, dp_rank=0, dp_size=1):
    """This data-parallel rank's (x, y) for each of its micro-steps of iteration iter_num (the one batch rule)."""
    global_rows = cfg.batch_size * cfg.gradient_accumulation_steps
    return [get_batch(data['train'], cfg.seed, TRAIN_STREAM, iter_num, global_rows, cfg.block_size,
                      micro_batch_rows(cfg, dp_rank, dp_size, micro_step), cfg.device)
            for micro_step in range(cfg.gradient_accumulation_steps // dp_size)]


class StepLogger:
    """The line logged every log_interval iterations: the time per iteration since the last line (host clock,
    after the loss's .item() has waited for the device), tokens per second of the whole run, MFU per device, peak
    memory. Every iteration it checks that the loss is finite."""

    def __init__(self, cfg, flops_per_token, n_devices):
        self.cfg, self.flops_per_token, self.n_devices = cfg, flops_per_token, n_devices
        self.peak = peak_flops_for(cfg.device, cfg.dtype, cfg.peak_flops)
        self.tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
        self.restart()

    def restart(self):
        """Time afresh from now (after an evaluation: eval time is not training time)."""
        self.t_last, self.iters = time.time(), 0

    def step(self, iter_num, loss, lr):
        if not math.isfinite(loss):
            raise SystemExit(f"error: loss is {loss} at iter {iter_num}; stopped, the last checkpoint is kept")
        self.iters += 1
        if iter_num % self.cfg.log_interval == 0 and is_master():
            dt = (time.time() - self.t_last) / self.iters
            self.restart()
            tokens_per_sec = self.tokens_per_iter / dt
            log_row(self.cfg.out_dir, {'iter': iter_num, 'loss': loss, 'lr': lr, 'ms': 1000 * dt,
                                       'tokens_per_sec': tokens_per_sec,
                                       'mfu': mfu(self.flops_per_token, tokens_per_sec, self.n_devices, self.peak),
                                       'peak_mem_bytes': peak_memory_bytes(self.cfg.device)})


def print_sample(model, cfg, ctx, show=True, hint='python sample.py --out_dir={out_dir}'):
    """300 characters sampled from the trained model (every rank of a sharded model must take part; the ones
    with show print it), and how to sample more."""
    encode, decode = get_codec(cfg.dataset)
    model.eval()
    start = torch.tensor([encode('\n')], dtype=torch.long, device=cfg.device)
    with ctx:
        text = decode(model.generate(start, 300, temperature=0.8, top_k=200)[0].tolist())
    if show:
        print(f"---------- a sample ----------\n{text}\n------------------------------")
        print(f"sample more with: {hint.format(out_dir=cfg.out_dir)}")


# -----------------------------------------------------------------------------
# Random streams: dropout masks per rank, saved and restored with every rank's checkpoint

def rng_state():
    """This process's random streams: the CPU generator, and the current GPU's when there is one."""
    return {'cpu': torch.get_rng_state(),
            'cuda': torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None}


def set_rng_state(state):
    torch.set_rng_state(state['cpu'])
    if state.get('cuda') is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state['cuda'])


def seed_dropout(seed, dp_rank, pp_rank=0):
    """Call once the model is built (every rank built the same weights from `seed`). Each data-parallel rank, and
    each pipeline stage (as Megatron offsets its seed by the stage), then draws its own dropout masks. The rank
    at (0, 0) keeps the stream train.py has at this point, so a run of one rank is train.py. The same call in
    every data-parallel script: DDP, ZeRO and FSDP draw the same masks and give one another's loss curve."""
    if (dp_rank, pp_rank) != (0, 0):
        torch.manual_seed(seed + dp_rank + 100_003 * pp_rank)


def gather_rng_states(comm):
    """Every rank of comm's group: its rng_state(), in rank order (a collective; the result on every rank)."""
    if comm.size == 1:
        return [rng_state()]
    states = [None] * comm.size
    dist.all_gather_object(states, rng_state(), group=comm.group)
    return states


def restore_rng(checkpoint, rank, world_size, seed, dp_rank, pp_rank=0):
    """Resume the random streams: this rank's own saved state when the checkpoint has one per rank of a world of
    this size ('rng_states'), else (another world size: masks cannot continue exactly) rank 0 takes train.py's
    'rng_state' and the others start their own stream, as at the start of a run."""
    states = checkpoint.get('rng_states')
    if states is not None and len(states) == world_size:
        set_rng_state(states[rank])
        return
    set_rng_state({'cpu': checkpoint['rng_state'], 'cuda': checkpoint.get('cuda_rng_state')})
    seed_dropout(seed, dp_rank, pp_rank)


# -----------------------------------------------------------------------------
# Communication: counted at our calls, modelled by the ring formulas, measured on the wire

# torch 2.13 named these all_gather_single / reduce_scatter_single and deprecated the old names; requirements.txt
# allows torch 2.6, which has only the old ones (same arguments). One choice here, for every file.
all_gather_single = getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, 'reduce_scatter_single', None) or dist.reduce_scatter_tensor

# What a ring algorithm sends per rank, as a multiple of the full tensor's bytes (n ranks in the group): an
# all-reduce is a reduce-scatter then an all-gather. A send moves the tensor once.
RING_FACTOR = {'all_reduce': lambda n: 2 * (n - 1) / n, 'reduce_scatter': lambda n: (n - 1) / n,
               'all_gather': lambda n: (n - 1) / n, 'all_to_all': lambda n: (n - 1) / n, 'send': lambda n: 1.0}


class Comm:
    """One process group (name: 'dp', 'tp', 'pp', ...), the rank's place in it, and its collectives. Every
    collective and send of a strategy goes through one, so the bytes are counted in one place:
    collective_bytes[kind] counts the bytes of the tensors handed to each kind of call (the full tensor for a
    reduce-scatter or all-gather), wire_bytes_formula[kind] what ring algorithms send for those calls (the papers'
    number). What really crosses the wire depends on the backend: see WireMeter. A group of one moves nothing."""

    def __init__(self, group=None, name='dp', alone=False):
        self.group, self.name = group, name  # group None: the whole world; alone: a group of this rank only
        self.rank = dist.get_rank(group) if dist.is_initialized() and not alone else 0
        self.size = dist.get_world_size(group) if dist.is_initialized() and not alone else 1
        self.collective_bytes, self.wire_bytes_formula = Counter(), Counter()
        self.observe = None  # a function to call at every collective, as it is posted (to sample memory there)

    def count(self, kind, tensor, op=None):
        nbytes = tensor.numel() * tensor.element_size()
        self.collective_bytes[kind] += nbytes
        self.wire_bytes_formula[kind] += RING_FACTOR[op or kind](self.size) * nbytes
        if self.observe is not None:
            self.observe()

    def clear(self):
        self.collective_bytes.clear()
        self.wire_bytes_formula.clear()

    def all_reduce(self, x, op=dist.ReduceOp.SUM, async_op=False, kind='all_reduce'):
        if self.size == 1:
            return None
        self.count(kind, x, 'all_reduce')
        return dist.all_reduce(x, op=op, group=self.group, async_op=async_op)

    def reduce_scatter(self, out, full, async_op=False):
        """out (this rank's 1/size) = its chunk of the sum over ranks of full."""
        if self.size == 1:
            out.copy_(full)
            return None
        self.count('reduce_scatter', full)
        return reduce_scatter_single(out, full, group=self.group, async_op=async_op)

    def all_gather(self, full, shard, async_op=False):
        """full = every rank's shard, in rank order."""
        if self.size == 1:
            full.copy_(shard)
            return None
        self.count('all_gather', full)
        return all_gather_single(full, shard, group=self.group, async_op=async_op)

    def all_to_all(self, out, inp):
        """out's i-th 1/size slice (dim 0) = rank i's inp's slice for this rank: each rank sends (size-1)/size."""
        if self.size == 1:
            out.copy_(inp)
            return None
        self.count('all_to_all', inp)
        return dist.all_to_all_single(out, inp, group=self.group)

    def global_rank(self, group_rank):
        """The global rank of this group's rank group_rank (point-to-point calls take global ranks)."""
        if self.size == 1:
            return dist.get_rank() if dist.is_initialized() else 0
        return dist.get_global_rank(self.group or dist.group.WORLD, group_rank)

    def send_recv(self, sends, recvs, kind='send'):
        """Post sends [(tensor, global peer rank[, tag])] and receives [(buffer, peer[, tag])] together in one
        batch_isend_irecv (as Megatron does: two neighbours sending to each other at once cannot deadlock, on NCCL
        too). Returns (works of the sends, works of the receives); the caller waits for them."""
        ops = [dist.P2POp(dist.isend, t, peer, tag=rest[0] if rest else 0) for t, peer, *rest in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, tag=rest[0] if rest else 0) for t, peer, *rest in recvs]
        for t, *_ in sends:
            self.count(kind, t, 'send')
        if not ops:
            return [], []
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # a backend that coalesces the batch into one work: it covers everything
            return [], works
        return works[:len(sends)], works[len(sends):]


def average_gradients(params, comm):
    """Data parallelism by hand: every gradient averaged over comm's ranks, in one flat all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if comm.size > 1 and grads:
        flat = torch.cat([g.flatten() for g in grads])
        comm.all_reduce(flat)
        flat /= comm.size
        for g, new in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(new.view_as(g))


def comm_report(comms):
    """{'collective_bytes': {'dp all_reduce': ...}, 'wire_bytes_formula': {...}} over several groups' Comms."""
    out = {'collective_bytes': {}, 'wire_bytes_formula': {}}
    for c in comms:
        for key in out:
            for kind, value in getattr(c, key).items():
                out[key][f'{c.name} {kind}'] = out[key].get(f'{c.name} {kind}', 0) + value
    return out


def loopback_bytes_sent():
    """Bytes this whole machine has sent through its loopback interface since boot (Linux's /proc/net/dev), or
    None. Every process's traffic is in it, so it is only a cross-check (the tests use it to see their flood)."""
    try:
        with open('/proc/net/dev') as f:
            for line in f:
                name, _, counters = line.partition(':')
                if name.strip() == 'lo':
                    return int(counters.split()[8])  # transmit bytes
    except OSError:
        return None
    return None


TCPI_BYTES_SENT = 200  # offset of tcpi_bytes_sent (u64) in Linux's struct tcp_info (linux/tcp.h, Linux >= 4.19)


def tcp_bytes_sent_by_socket():
    """{socket inode: payload bytes sent} for every TCP socket this process holds open, from the kernel's own
    per-socket count (getsockopt TCP_INFO, tcpi_bytes_sent), or None where the kernel does not keep it.
    gloo talks over TCP sockets of the process itself, so this is this rank's own traffic and nobody else's."""
    if not hasattr(socket, 'TCP_INFO') or not os.path.isdir('/proc/self/fd'):
        return None
    sent = {}
    for fd in os.listdir('/proc/self/fd'):
        try:
            target = os.readlink(f'/proc/self/fd/{fd}')
            if not target.startswith('socket:'):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))  # a duplicate descriptor: closing it leaves ours open
        except OSError:
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < TCPI_BYTES_SENT + 8:
            return None  # a kernel older than 4.19
        sent[target] = int.from_bytes(info[TCPI_BYTES_SENT:TCPI_BYTES_SENT + 8], sys.byteorder)
    return sent


class WireMeter:
    """Measured: the bytes this rank itself sent over a window of steps. gloo moves every collective and send over
    TCP sockets that this process owns, and the kernel counts each socket's payload bytes (TCP_INFO): summed over
    the process's sockets at the end of the window minus at its start, that is exactly this rank's traffic,
    whoever else uses the network, on one machine or between machines. Both ends sit behind a barrier, so every
    collective of the window has finished on every rank (what this rank sent has left it). NCCL moves its
    bytes over NVLink or InfiniBand, past the process's sockets: then the meter reports None and says why."""

    def __init__(self):
        self.why_not = None
        if not dist.is_initialized():
            self.why_not = 'not measured: one process'
        elif dist.get_backend() != 'gloo':
            self.why_not = 'not measured: NCCL moves its bytes past the process\'s sockets'
        elif tcp_bytes_sent_by_socket() is None:
            self.why_not = 'not measured: this OS gives no per-socket TCP counters'
        self.start_sent = None

    def start(self):
        if self.why_not is None:
            dist.barrier()
            self.start_sent = tcp_bytes_sent_by_socket()

    def stop(self):
        """The bytes this rank sent since start(), or None. A socket opened in the window counts from zero."""
        if self.why_not is not None or self.start_sent is None:
            return None
        dist.barrier()
        now = tcp_bytes_sent_by_socket()
        return sum(n - self.start_sent.get(sock, 0) for sock, n in now.items())


_GROUP_IS_OURS = False  # init_distributed made the process group, so finish_distributed tears it down


def init_distributed(timeout_s, group_of_one=False):
    """Join the process group that torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or run as
    one process without it (group_of_one: in a group of one, for code that needs a group, as FSDP2 does). NCCL
    with one GPU per process when CUDA is there, gloo on CPU. Inside a process group that already exists (a
    notebook, a test harness) it joins that one and leaves it standing at the end.
    Returns (rank, local_rank, world_size, device). A rank that dies makes the others fail within timeout_s."""
    import datetime
    global _GROUP_IS_OURS
    local_rank = int(os.environ.get('LOCAL_RANK', '0'))
    device = f'cuda:{local_rank}' if torch.cuda.is_available() else 'cpu'
    if dist.is_initialized():
        return dist.get_rank(), local_rank, dist.get_world_size(), device
    if 'RANK' not in os.environ:
        script = os.path.basename(sys.argv[0])
        print(f"running as a single process (started without torchrun); for N processes: torchrun --standalone "
              f"--nproc_per_node=N {script} {' '.join(sys.argv[1:])}".rstrip(), flush=True)
    if 'RANK' not in os.environ and not group_of_one:
        return 0, 0, 1, ('cuda' if torch.cuda.is_available() else 'cpu')
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    backend, timeout = 'nccl' if torch.cuda.is_available() else 'gloo', datetime.timedelta(seconds=timeout_s)
    if 'RANK' in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, store=dist.HashStore(), rank=0, world_size=1)
    _GROUP_IS_OURS = True
    return dist.get_rank(), local_rank, dist.get_world_size(), device


def finish_distributed(cfg=None):
    """Leave together: every rank's peak memory reported (with cfg: one line, and one row in log.jsonl), then a
    barrier, then tear down the group init_distributed made (tearing gloo down under a peer still inside a
    collective can abort it)."""
    global _GROUP_IS_OURS
    if cfg is not None and dist.is_initialized():
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak_memory_bytes(cfg.device))
        if dist.get_rank() == 0:
            kind = 'allocated on the GPU' if cfg.device.startswith('cuda') else 'resident set'
            print(f"peak memory per rank ({kind}, measured): " + ', '.join(f"{p / 2**20:.0f}" for p in peaks)
                  + f" MiB; the largest {max(peaks) / 2**20:.0f} MiB", flush=True)
            with open(os.path.join(cfg.out_dir, 'log.jsonl'), 'a') as f:
                f.write(json.dumps({'peak_mem_bytes_by_rank': peaks}) + '\n')
    if dist.is_initialized() and _GROUP_IS_OURS:
        dist.barrier()
        dist.destroy_process_group()
        _GROUP_IS_OURS = False


GRID_DIMS = ('dp', 'pp', 'cp', 'tp')


def process_grid(world_size, rank, dp=1, pp=1, cp=1, tp=1):
    """The process grid of every parallel script: torch.arange(world).view(dp, pp, cp, tp), so a global rank is
    ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank. tp varies fastest: a tensor-parallel group, which
    talks the most, is neighbouring ranks (one node's GPUs). A dimension's groups are the ranks that differ only in
    that coordinate. Every rank creates every group in the same order (new_group is collective).
    Returns (grid, {dim: this rank's coordinate}, {dim: Comm of this rank's group along dim})."""
    sizes = dict(dp=dp, pp=pp, cp=cp, tp=tp)
    if dp * pp * cp * tp != world_size:
        raise SystemExit(f"error: world size {world_size} is not dp x pp x cp x tp = {dp} x {pp} x {cp} x {tp}")
    grid = torch.arange(world_size).view(dp, pp, cp, tp)
    coords = dict(zip(GRID_DIMS, (int(i) for i in (grid == rank).nonzero()[0])))
    comms = {}
    for d, dim in enumerate(GRID_DIMS):
        if sizes[dim] == 1:
            comms[dim] = Comm(None, dim, alone=True)
        elif sizes[dim] == world_size:
            comms[dim] = Comm(None, dim)  # the whole world: its default group
        else:
            for members in grid.movedim(d, -1).reshape(-1, sizes[dim]).tolist():
                group = dist.new_group(members)
                if rank in members:
                    comms[dim] = Comm(group, dim)
    return grid, coords, comms


def world_size_from_env():
    """WORLD_SIZE as torchrun sets it (1 without torchrun): known before the process group exists, so bad
    combinations can be rejected before any work."""
    return int(os.environ.get('WORLD_SIZE', '1'))


def record_for_torchrun(message, callstack):
    """Leave the rank's error where torchrun's closing summary reads it (TORCHELASTIC_ERROR_FILE, the format of
    torch.distributed.elastic's @record), so the user's last screen says what went wrong, not only an exit code."""
    path = os.environ.get('TORCHELASTIC_ERROR_FILE')
    if path:
        with open(path, 'w') as f:
            json.dump({'message': {'message': message, 'extraInfo': {'py_callstack': callstack,
                                                                     'timestamp': str(int(time.time()))}}}, f)


def run_main(main):
    """Run main(argv) and turn a config error into one line on stderr and exit code 1 (on every rank); under
    torchrun that line, or an unexpected error's traceback, is also what torchrun's summary shows."""
    try:
        main(sys.argv[1:])
        # free what the run built (DDP's reducer, gloo's work objects) while the interpreter is whole: freed during
        # its shutdown instead, a C++ thread can reach for the GIL too late and abort the process (SIGABRT)
        import gc
        gc.collect()
    except SystemExit as e:
        if isinstance(e.code, str):
            rank = os.environ.get('RANK')
            line = (f"[rank {rank}] " if rank is not None else '') + e.code + '\n'
            # the whole line in one write: the ranks share one stderr pipe, and print() writes the text and its
            # newline in two, which (unbuffered, as under PYTHONUNBUFFERED) lets two ranks' lines run together
            sys.stderr.write(line)
            sys.stderr.flush()
            record_for_torchrun(e.code, line)
            if dist.is_initialized() and _GROUP_IS_OURS:  # (an error found after joining, e.g. on resume): left to
                dist.destroy_process_group()  # the interpreter's exit, gloo's threads can abort ('terminate called')
            sys.exit(1)
        raise
    except Exception as e:
        import traceback
        record_for_torchrun(f"{type(e).__name__}: {e}", traceback.format_exc())
        raise
