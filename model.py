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
    aux_loss_style: str = 'switch'  # 'switch': per layer, averaged; 'hf': Hugging Face's Mixtral (pooled)
    router: str = 'softmax'     # each expert's score: 'softmax' (Mixtral) or 'sigmoid' (DeepSeek-V3)
    router_z_loss_weight: float = 0.0  # ST-MoE's router z-loss: this x the mean of logsumexp(logits)^2
    router_bias_rate: float = 0.0  # DeepSeek-V3's loss-free balancing: a bias's step per iteration (0: off)
    capacity_factor: float = 0.0  # 0: dropless; else an expert takes this x its even share, drops the rest

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
            (self.router in ('softmax', 'sigmoid') and self.aux_loss_style in ('switch', 'hf'),
             f"router must be 'softmax' or 'sigmoid' and aux_loss_style 'switch' or 'hf', got "
             f"{self.router!r}, {self.aux_loss_style!r}"),
            (self.capacity_factor >= 0 and self.router_bias_rate >= 0 and self.router_z_loss_weight >= 0,
             "capacity_factor, router_bias_rate and router_z_loss_weight must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def is_moe(self, layer):
        return self.n_expert > 0 and (layer + 1) % self.moe_every == 0


class RMSNorm(nn.Module):
    """LLaMA's norm: scale by the root mean square, no centring, no bias; in fp32, as Hugging Face."""

    def __init__(self, ndim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.eps = eps

    # (what __init__ set: checkpoints.init_params replays it on a model built on the meta device)
    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.type_as(x)


def make_norm(config):
    if config.norm == 'rmsnorm':
        return RMSNorm(config.n_embd, config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)  # (GPT-2's)


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
    The steps are named for expert parallelism, which replaces experts_forward: dispatch, compute, combine.
    A capacity factor caps the token-slots an expert takes per forward (the others pass on the residual);
    DeepSeek-V3's balancing bias steers which experts are chosen, never their weights (balance_routers)."""

    def __init__(self, config):
        super().__init__()
        self.n_expert, self.k, self.score = config.n_expert, config.n_expert_active, config.router
        self.capacity_factor, self.bias_rate = config.capacity_factor, config.router_bias_rate
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = nn.ModuleList([MLP(config) for _ in range(config.n_expert)])  # (a rank may hold some)
        self.shared_expert = MLP(config) if config.n_shared_expert else None
        self.register_buffer('router_bias', torch.zeros(config.n_expert))  # (zero unless router_bias_rate)
        self.routing = None  # the last forward's routing (Routing), what the auxiliary losses read
        self.load = 0  # token-slots per expert since the last balancing (moe_loss counts, in training)
        # (a rank whose tokens are routed together with other ranks' replaces these two: context parallelism)
        self.routed_together = lambda counts: counts  # tokens per expert of all the tokens routed together
        self.earlier_slots = lambda counts: 0  # (capacity) slots its experts took before these tokens

    def route(self, x):
        """x (N, C) -> each token's k experts (N, k) and their weights (N, k), summing to 1 (Mixtral's and
        DeepSeek-V3's renormalization: a dense MLP's scale whatever the scores' spread; with k=1 the weight
        is 1, and only the losses train the router). Keeps the statistics the losses read in self.routing."""
        logits = self.router(x).float()  # in fp32, as Mixtral
        scores = F.softmax(logits, dim=-1) if self.score == 'softmax' else torch.sigmoid(logits)
        index = (scores + self.router_bias).topk(self.k, dim=-1).indices  # the bias steers the choice only
        weights = scores.gather(-1, index)
        weights = weights / weights.sum(-1, keepdim=True)
        counts = self.routed_together(torch.bincount(index.flatten(), minlength=self.n_expert))
        probs = scores / scores.sum(-1, keepdim=True)  # the router's distribution (softmax: its scores)
        self.routing = Routing(counts, probs.mean(0), torch.logsumexp(logits, -1).pow(2).mean(), self.k)
        if self.capacity_factor:  # the slots past an expert's capacity weigh nothing and go to no expert
            keep = within_capacity(index, self.n_expert, self.capacity(index.size(0)),
                                   self.earlier_slots(index))
            weights, index = weights * keep, index.masked_fill(~keep, self.n_expert)
        return index, weights.type_as(x)

    def capacity(self, n_tokens):
        """Token-slots an expert takes in one forward: capacity_factor x its even share of them (Switch,
        GShard), counted over all the tokens routed together."""
        return math.ceil(self.capacity_factor * self.routing.counts.sum().item() / self.n_expert)

    def experts_forward(self, x, index, weights):
        """Every token x (N, C) through its k experts index (N, k), summed by weights (N, k). Dropless unless
        a capacity caps the experts: then a dropped slot (expert index n_expert) adds nothing."""
        order = index.flatten().argsort(stable=True)  # the token-slots (t*k + j) by expert, in token order
        rows = x[order // self.k].split(torch.bincount(index.flatten(), minlength=self.n_expert + 1).tolist())
        # (an expert another rank holds, None here, adds nothing: tensor parallelism spreads them)
        out = [r.new_zeros(r.shape) if expert is None else expert(r) for expert, r in zip(self.experts, rows)]
        out.append(rows[-1].new_zeros(rows[-1].shape))  # the dropped slots (a capacity factor)
        return combine(torch.cat(out), order, weights)

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))  # (B*T, C): routing is per token
        index, weights = self.route(flat)
        y = self.experts_forward(flat, index, weights)
        if self.shared_expert is not None:
            y = y + self.shared_expert(flat)
        return y.reshape(x.shape[0], -1, x.size(-1))


@dataclass
class Routing:
    """One MoE layer's routing in one forward: the token-slots each expert was chosen for (all the tokens
    routed together), the router's mean distribution over the experts and its mean squared log-sum-exp
    (this rank's tokens: differentiable), k."""
    counts: torch.Tensor
    probs: torch.Tensor
    z: torch.Tensor
    k: int


def within_capacity(index, n_expert, capacity, earlier=0):
    """Which token-slots (N, k) keep their expert: each expert takes its first `capacity` slots in token order
    (t*k + j), after the `earlier` ones (one per slot) other ranks' earlier tokens gave it (context
    parallelism's)."""
    flat = index.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=n_expert)
    position = torch.empty_like(flat)
    first = counts.cumsum(0) - counts  # where each expert's slots start in `order`
    position[order] = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
    return (position + earlier < capacity).view_as(index)


def combine(out, order, weights):
    """The experts' outputs (rows in `order`) back to (token, slot), each token's k summed by its weights."""
    slots = torch.empty_like(out).index_copy(0, order, out).view(*weights.shape, -1)
    return (slots * weights.unsqueeze(-1)).sum(1)  # in slot order: the same sum wherever the experts ran


def moe_loss(layers, config, n_layers=None):
    """The MoE layers' auxiliary loss from their last forwards, weighted, to add to the training loss: the
    load-balancing loss (Switch / GShard: n_expert x sum_e f_e P_e, f_e the share of token-slots sent to e,
    P_e its mean router probability; 1 when balanced) averaged over the layers (n_layers: all the model's,
    where these are some), or Hugging Face's Mixtral ('hf': f_e per token, summing to k, both pooled over the
    layers); plus the router z-loss. Returns (that, the balancing loss alone: for the log). In training it
    also counts each layer's load (balance_routers')."""
    routing, e = [m.routing for m in layers], config.n_expert
    if config.aux_loss_style == 'hf':
        f = sum(r.counts for r in routing) / sum(r.counts.sum() / r.k for r in routing)
        aux = e * (f * sum(r.probs for r in routing) / len(routing)).sum()
    else:
        aux = sum(e * (r.counts / r.counts.sum() * r.probs).sum() for r in routing)
        aux = aux / (n_layers or len(routing))
    z = sum(r.z for r in routing) / (n_layers or len(routing))
    for m, r in zip(layers, routing):
        if m.training:
            m.load = m.load + r.counts
        m.routing = Routing(r.counts, r.probs.detach(), r.z.detach(), r.k)  # (kept for the log: no graph)
    return config.aux_loss_weight * aux + config.router_z_loss_weight * z, aux


@torch.no_grad()
def balance_routers(model, sum_over_ranks=lambda loads: loads):
    """DeepSeek-V3's auxiliary-loss-free balancing (router_bias_rate), once per iteration after the
    optimizer's step: each expert's bias moves by the rate toward the mean load, up for an expert that got
    fewer token-slots than the mean since the last balancing, down for one that got more. The loads are
    summed over the ranks that route other tokens (sum_over_ranks: the data-parallel ones), so every rank
    moves its biases alike. Nothing to do (and no collective) when the rate is 0 or the model is dense."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.bias_rate]
    if not layers:
        return
    loads = sum_over_ranks(torch.stack([m.router_bias * 0 + m.load for m in layers]).float())
    for m, load in zip(layers, loads):
        m.router_bias += m.bias_rate * torch.sign(load.mean() - load)
        m.load = 0


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
        moe = self.moe_layers()
        if moe:  # the MoE layers' auxiliary loss; it and their tokens per expert kept for the log
            self.tokens_per_expert = torch.stack([m.routing.counts for m in moe])  # (MoE layers, n_expert)
            extra, aux = moe_loss(moe, self.config)
            self.aux_loss, loss = aux.detach(), None if loss is None else loss + extra
        return logits, loss

    def moe_layers(self):
        """The MoE layers this model (or this rank's part of it) holds, in order."""
        return [b.mlp for b in self.transformer.h if isinstance(getattr(b, 'mlp', None), MoE)]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with weight decay on the 2-D weights (matmuls, embeddings) only, never on biases or norms:
        the two groups, in this order, of every script's optimizer (zero.py keeps one group of chunks and
        applies this split's decay range by range)."""
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

