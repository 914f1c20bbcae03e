"""
The GPT, and only the GPT: GPT-2's layout by default (learned positions, LayerNorm, GELU MLP, tied
embeddings), with LLaMA-style options (norm='rmsnorm', mlp='swiglu', pos='rope', n_kv_head for grouped-query
attention, tie_embeddings=False) and a mixture of experts (n_expert) in the same classes: its forward, its
initialization, its AdamW groups, its FLOPs and generate. Hugging Face's weights in and out are common/hf.py;
the same initialization on the meta device, for a rank that builds only its share, common/checkpoints.py.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


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
    gelu: str = 'exact'         # 'exact' (erf) or 'tanh' (GPT-2's 'gelu_new', set by from_hf)
    pos: str = 'learned'        # 'learned' (GPT-2) or 'rope' (LLaMA)
    tie_embeddings: bool = True  # share wte and lm_head (GPT-2); LLaMA unties them
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    activation_checkpointing: bool = False  # recompute each block in backward instead of keeping its tensors
    n_expert: int = 0           # experts per MoE layer (mixture of experts in place of the MLP); 0: dense
    n_expert_active: int = 2    # top-k: the experts each token goes through
    n_shared_expert: int = 0    # 1: an always-on expert beside the routed ones (DeepSeek, Qwen-MoE)
    moe_every: int = 1          # MoE in every moe_every-th block (the moe_every-th, 2*moe_every-th, ...)
    aux_loss_weight: float = 0.01  # the weight of the MoE load-balancing loss added to the training loss

    def __post_init__(self):
        for name in ('n_kv_head', 'n_hidden'):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_hidden is None:
            swiglu_width = 32 * math.ceil(8 * self.n_embd / 3 / 32)  # ~8/3 n_embd: SwiGLU's 3 matrices
            self.n_hidden = 4 * self.n_embd if self.mlp == 'gelu' else swiglu_width
        checks = [
            (self.norm in ('layernorm', 'rmsnorm'),
             f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}"),
            (self.mlp in ('gelu', 'swiglu'), f"mlp must be 'gelu' or 'swiglu', got {self.mlp!r}"),
            (self.gelu in ('exact', 'tanh'), f"gelu must be 'exact' or 'tanh', got {self.gelu!r}"),
            (self.pos in ('learned', 'rope'), f"pos must be 'learned' or 'rope', got {self.pos!r}"),
            (self.n_embd % self.n_head == 0,
             f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"),
            (self.n_head % self.n_kv_head == 0,
             f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})"),
            (self.pos != 'rope' or (self.n_embd // self.n_head) % 2 == 0, "rope needs an even head size"),
            (self.n_expert >= 0 and self.n_shared_expert in (0, 1) and self.moe_every >= 1,
             "n_expert must be >= 0, n_shared_expert 0 or 1, moe_every >= 1"),
            (self.n_expert == 0 or 1 <= self.n_expert_active <= self.n_expert,
             f"n_expert_active (top-k, {self.n_expert_active}) must be 1 to n_expert ({self.n_expert})"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def is_moe(self, layer):
        return self.n_expert > 0 and (layer + 1) % self.moe_every == 0


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1)."""

    def __init__(self, ndim, bias, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None
        self.eps = eps

    # (what __init__ set: checkpoints.init_params replays it on a model built on the meta device)
    def reset_parameters(self):
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """LLaMA's norm: scale by the root mean square, no centring, no bias; in fp32, as Hugging Face."""

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
        self.c_attn = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_kv_head) * self.head_dim,
                                bias=config.bias)
        self.c_proj = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout
        self.rope = config.pos == 'rope'
        self.rope_theta = config.rope_theta

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
        # grouped-query attention: each kv head serves n_head // n_kv_head query heads
        if k.size(1) != q.size(1):
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        dropout = self.dropout if self.training else 0.0
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


class MoE(nn.Module):
    """A mixture of experts in place of the MLP: a router picks each token's top-k of n_expert experts (each
    the model's own MLP), whose outputs it sums by the router's weights (plus an always-on shared expert's).
    The steps are named for expert parallelism, which replaces experts_forward: dispatch, compute, combine."""

    def __init__(self, config):
        super().__init__()
        self.n_expert, self.k = config.n_expert, config.n_expert_active
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = nn.ModuleList([MLP(config) for _ in range(config.n_expert)])  # (a rank may hold some)
        self.shared_expert = MLP(config) if config.n_shared_expert else None
        self.aux_loss = self.tokens_per_expert = None  # of the last forward: for the loss and the log

    def route(self, x):
        """x (N, C) -> each token's k experts (N, k), their weights (N, k), and the aux stats: the load-
        balancing loss (Switch/GShard: n_expert * sum_e f_e * P_e, f_e the fraction of token-slots sent to e,
        P_e its mean router probability; 1 balanced, n_expert if all go to one) and the tokens per expert."""
        probs = F.softmax(self.router(x).float(), dim=-1)  # over all experts, in fp32 as Mixtral
        weights, index = probs.topk(self.k, dim=-1)
        # renormalized over the k to sum to 1, as Mixtral: a dense MLP's scale whatever the softmax's spread
        # (with k=1 the weight is then 1, and only the aux loss trains the router)
        weights = weights / weights.sum(-1, keepdim=True)
        counts = torch.bincount(index.flatten(), minlength=self.n_expert)
        aux = self.n_expert * (counts / index.numel() * probs.mean(0)).sum()
        return index, weights.type_as(x), (aux, counts)

    def experts_forward(self, x, index, weights):
        """Every token x (N, C) through its k experts index (N, k), summed by weights (N, k). Dropless (no
        capacity factor, whatever the load): no token's output depends on the others, nor on a run's split."""
        order = index.flatten().argsort(stable=True)  # the token-slots (t*k + j) by expert, in token order
        rows = x[order // self.k].split(torch.bincount(index.flatten(), minlength=self.n_expert).tolist())
        return combine(torch.cat([expert(r) for expert, r in zip(self.experts, rows)]), order, weights)

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))  # (B*T, C): routing is per token
        index, weights, (self.aux_loss, self.tokens_per_expert) = self.route(flat)
        y = self.experts_forward(flat, index, weights)
        if self.shared_expert is not None:
            y = y + self.shared_expert(flat)
        return y.view_as(x)


def combine(out, order, weights):
    """The experts' outputs (rows in `order`) back to (token, slot), each token's k summed by its weights."""
    slots = torch.empty_like(out).index_copy(0, order, out).view(*weights.shape, -1)
    return (slots * weights.unsqueeze(-1)).sum(1)  # in slot order: the same sum wherever the experts ran


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)) (the mlp a MoE if moe)."""

    def __init__(self, config, moe=False):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MoE(config) if moe else MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """The GPT: embeddings, n_layer Blocks, the final norm and the head (tied to the embedding by default)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd) if config.pos == 'learned' else None,
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, config.is_moe(i)) for i in range(config.n_layer)]),
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

    def get_num_params(self, non_embedding=True, active=False):
        """Parameter count; by default without the position embeddings (the token embeddings count, since they
        are tied to the head and so do the head's FLOPs). active: only those one token multiplies: k of each
        MoE layer's n_expert experts (of a whole model: a rank that holds some experts counts too few)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.transformer.wpe is not None:
            n -= self.transformer.wpe.weight.numel()
        if active:
            n -= sum((m.n_expert - m.k) * sum(p.numel() for p in next(filter(None, m.experts)).parameters())
                     for m in self.modules() if isinstance(m, MoE))
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
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for block in self.transformer.h:
            x = self.run_block(block, x)
        logits, loss = self.head(x, targets)
        moe = [block.mlp for block in self.transformer.h if isinstance(block.mlp, MoE)]
        if moe:  # the MoE layers' mean load-balancing loss, kept (with their tokens per expert) for the log
            aux = sum(m.aux_loss for m in moe) / len(moe)
            self.aux_loss = aux.detach()
            self.tokens_per_expert = torch.stack([m.tokens_per_expert for m in moe])  # (MoE layers, n_expert)
            loss = None if loss is None else loss + self.config.aux_loss_weight * aux
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with weight decay on the 2-D weights (matmuls, embeddings) only, never on biases or norms:
        the two groups, in this order, of every script's optimizer (and of ZeRO's hand-written one)."""
        return torch.optim.AdamW(param_groups(self, weight_decay), lr=learning_rate, betas=betas,
                                 fused=device_type == 'cuda')

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token of sequences of seq_len (the run's block_size; default the model's): 6N
        for the N weights that multiply (forward 2N, backward 4N) plus attention's 12*L*d*s (PaLM's appendix
        B). The token embedding multiplies only as the tied head: untied, it is a lookup, and so is wpe."""
        cfg = self.config
        n_matmul = self.get_num_params(active=True)  # a MoE's router, shared expert and k of its experts
        if not cfg.tie_embeddings:
            n_matmul -= self.transformer.wte.weight.numel()
        return 6 * n_matmul + 12 * cfg.n_layer * cfg.n_embd * (seq_len or cfg.block_size)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens tokens after idx (B, T), one at a time."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :] / max(temperature, 1e-8)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('inf')
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
        return idx


def param_groups(model, weight_decay):
    """AdamW's two parameter groups: decay for every parameter of 2 or more dims, no decay for the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
            {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]

