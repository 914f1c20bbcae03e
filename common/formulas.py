"""
Modelled: the formulas this repo prints beside what it measures and counts, in one place. Most are the papers'
(ZeRO, Megatron-LM and Korthikanti et al., GPipe, ring attention); saved_bytes_formula is this repo's own
count of what one of its blocks keeps for backward, read off model.py. Each script prints the ones of its idea
next to its measurements; bench.py --estimate prices every strategy with them; the tests hold each one against
the bytes the code really holds and sends.

Notation: Ψ parameters, N data-parallel ranks, t tensor-parallel, p pipeline stages, m microbatches, v chunks
per stage, s sequence length, b micro-batch size, h hidden size, a attention heads.
"""

import math


# -----------------------------------------------------------------------------
# Model states and data-parallel traffic (ZeRO, Rajbhandari et al. 2020): zero.py, train_fsdp.py

def model_state_bytes_formula(numel, world_size, stage, mixed_precision, offload=False):
    """Bytes of parameters, gradients and optimizer state per rank (ZeRO paper). fp32: 4 + 4 + 8 (Adam m, v)
    bytes per parameter; mixed precision: 2 + 2 + 12 (fp32 master, m, v). Sharded states hold ceil(numel/N).
    offload (ZeRO-Offload): the optimizer state is on the host, 12 bytes per parameter of the chunk (the fp32
    master is its own copy there), with a host copy of the gradient chunk; host_bytes counts them."""
    p, g, k = (2, 2, 12) if mixed_precision else (4, 4, 8)
    shard = math.ceil(numel / world_size)
    owned = shard if stage >= 1 else numel
    return {'param_bytes': p * (shard if stage >= 3 else numel),
            'grad_bytes': g * (shard if stage >= 2 else numel),
            'optim_bytes': 0 if offload else k * owned,
            'host_bytes': (12 + g) * owned if offload else 0}


def comm_bytes_formula(numel, world_size, stage, bytes_per_elem, micro_steps=1):
    """Bytes one rank sends per step, ring algorithms (the paper's count). Stages 0-2: one all-reduce's worth,
    2(N-1)/N·Ψ (stage 1/2 as a reduce-scatter plus an all-gather). Stage 3: 3(N-1)/N·Ψ, the parameters
    gathered for forward and again for backward. Stages 2 and 3 cannot hold gradients across micro-steps, so
    they reduce at every one. On gloo a reduce-scatter is an all-reduce underneath: the wire carries more (see
    WireMeter)."""
    one = (world_size - 1) / world_size * numel * bytes_per_elem
    return {0: 2 * one, 1: 2 * one, 2: (micro_steps + 1) * one, 3: 3 * micro_steps * one}[stage]


def fsdp_held_bytes_formula(numel, world_size, micro_steps):
    """ZeRO-3 for Ψ = numel parameters over N ranks, as FSDP2 keeps them: fp32 parameter shards 4Ψ/N (they
    are the master weights; bf16 copies exist only while a group is gathered), fp32 gradient shards 4Ψ/N (the
    reduce dtype), AdamW's m and v 8Ψ/N. The measured numbers differ from these only by the dim-0 rounding.
    Gradients at their peak: with more than one micro-step per rank, the accumulation without sync holds the
    full-size fp32 gradients, 4Ψ (ZeRO-2/3 pay a reduce-scatter per micro-step instead)."""
    return {'param_bytes': 4 * numel / world_size, 'grad_bytes': 4 * numel / world_size,
            'optim_bytes': 8 * numel / world_size,
            'peak_grad_bytes': 4 * numel if micro_steps > 1 else 4 * numel / world_size}


def fsdp_comm_bytes_formula(numel, world_size, micro_steps, gather_bytes_per_elem=4):
    """Bytes one rank sends per step as FSDP2 (train_fsdp.py) communicates, ring algorithms: every micro-step
    gathers the parameters for forward and again for backward (in the compute dtype: bf16 under its
    MixedPrecisionPolicy), then one fp32 reduce-scatter of the gradients in the last micro-step's backward
    (the others accumulate unsharded, without a sync): (N-1)/N·Ψ·(2m·g + 4). FSDP2 keeps the root group's
    parameters (embeddings, final norm) gathered from forward to backward: a little less."""
    return (world_size - 1) / world_size * numel * (2 * micro_steps * gather_bytes_per_elem + 4)


# -----------------------------------------------------------------------------
# Tensor parallelism (Megatron-LM; Korthikanti et al. 2022): tensor_parallel.py

def param_bytes_formula(config, t, bytes_per_elem=4):
    """Parameter bytes on one tp rank: 1/t of the split layers (q/k/v, attention output, MLP, embedding, head)
    plus every replicated one (norms, the row-parallel biases, learned positions). A MoE layer instead of its
    MLP: n_expert/t whole experts (each an MLP), its router whole, a shared expert cut as the MLP is."""
    h, L, hd, bias = config.n_embd, config.n_layer, config.n_embd // config.n_head, int(config.bias)
    qkv = (config.n_head + 2 * config.n_kv_head) * hd
    n_mlp_in = 2 if config.mlp == 'swiglu' else 1
    mlp = config.n_hidden * (n_mlp_in * (h + bias) + h)  # (its c_proj bias: replicated, below)
    n_moe = sum(config.is_moe(layer) for layer in range(L))
    split_per_layer = qkv * (h + bias) + config.n_head * hd * h
    split = L * split_per_layer + (L - n_moe + n_moe * config.n_shared_expert) * mlp
    split += config.vocab_size * h * (1 if config.tie_embeddings else 2)
    norm = h * (1 + (bias if config.norm == 'layernorm' else 0))
    wpe = config.block_size * h if config.pos == 'learned' else 0
    dense_proj_biases = (L - n_moe + n_moe * config.n_shared_expert) * h * bias
    replicated = L * (2 * norm + h * bias) + dense_proj_biases + norm + wpe + n_moe * config.n_expert * h
    experts = n_moe * config.n_expert // t * (mlp + h * bias)  # whole experts, each with its c_proj bias
    return (split / t + replicated + experts) * bytes_per_elem


def activation_bytes_formula(s, b, h, a, t, sequence_parallel, recompute=False, bytes_per_elem=2):
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, table 2; their
    numbers are for 16-bit activations, scaled here by bytes_per_elem / 2). recompute: full activation
    checkpointing, only the layer input is kept (sharded along the sequence under sequence parallelism)."""
    scale = bytes_per_elem / 2
    if recompute:
        return 2 * s * b * h * scale / (t if sequence_parallel else 1)
    if sequence_parallel:
        return s * b * h * (34 + 5 * a * s / h) / t * scale
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * scale


def saved_bytes_formula(config, s, b, t=1, sequence_parallel=False, bytes_per_elem=4, fp32_weights=True,
                        autocast=True, device_type='cuda'):
    """Bytes one of this repo's blocks keeps for backward on one tp rank, read off model.py's code (dropout 0;
    scaled_dot_product_attention's flash/efficient kernels keep no s x s matrix, only q, k, v, out and the
    log-sum-exp). What saves what: each norm its input and statistics (dtypes below; RMSNorm also its
    normalised x); each Linear its input; SDPA q, k, v (views of c_attn's
    output keep that whole output alive; RoPE and GQA's repeat make new tensors) and its output, which c_proj
    then saves with no copy; GELU its input; SwiGLU its gate output, the SiLU and c_fc outputs and their
    product. Under tensor parallelism the heads and the MLP's hidden width are 1/t per rank; sequence
    parallelism cuts the norms and the residual stream to s/t, while the column-parallel Linears keep their
    all-gathered input (Megatron keeps the chunk and all-gathers again in backward: that is Korthikanti's
    34/t, activation_bytes_formula). bytes_per_elem=2 means bf16 autocast: the norms stay fp32, and over fp32
    weights (train.py, DDP, tensor and pipeline parallelism) the bf16 copy of each weight that autocast makes
    is saved for backward too; zero.py and FSDP2 compute with bf16 weights (fp32_weights=False), so there is
    no copy. Their stream is bf16: RMSNorm saves its own x.float() on any device (its normalised x is then
    bf16); a LayerNorm the fp32 copies a GPU's autocast makes (of its input, weight and bias), but the bf16
    stream itself under a CPU's autocast (device_type='cpu') or without autocast (FSDP2's
    MixedPrecisionPolicy: autocast=False), with its statistics in fp32 on a GPU (CUDA's accumulate type) and
    in bf16 on a CPU (its input's dtype)."""
    e, fp32 = bytes_per_elem, 4
    stream = fp32 if fp32_weights else e  # (over fp32 weights autocast adds the residual stream in fp32)
    residual = fp32 if config.norm == 'rmsnorm' or (autocast and device_type == 'cuda') else stream
    stats = fp32 if residual == fp32 or device_type == 'cuda' else e  # a norm's saved input, statistics
    hd = config.n_embd // config.n_head
    heads, kv, hidden = config.n_head // t, config.n_kv_head // t, config.n_hidden // t
    tokens, norm_tokens = s * b, s * b // (t if sequence_parallel else 1)
    h = config.n_embd
    per_norm = norm_tokens * (h * residual + stats * (2 if config.norm == 'layernorm' else 1))
    if config.norm == 'rmsnorm':  # and its normalised x, in the stream's dtype (bf16 over bf16 weights)
        per_norm += norm_tokens * h * (fp32 if fp32_weights or e == 4 else e)
    linear_inputs = 2 * tokens * h * e  # c_attn's and c_fc's (full sequence: all-gathered under SP)
    gqa, rope = config.n_kv_head != config.n_head, config.pos == 'rope'
    qkv_output = tokens * (heads + 2 * kv) * hd * e
    new_q = tokens * heads * hd * e if rope else 0
    new_k = tokens * heads * hd * e if gqa else tokens * kv * hd * e if rope else 0
    new_v = tokens * heads * hd * e if gqa else 0
    views_kept = not new_q or not new_k or not new_v  # any of q, k, v still a view of c_attn's output
    attention = new_q + new_k + new_v + (qkv_output if views_kept else 0) + tokens * heads * hd * e
    attention += tokens * heads * fp32 + (2 * s * hd * fp32 if rope else 0)  # log-sum-exp; RoPE's cos, sin
    mlp = tokens * hidden * e * (4 if config.mlp == 'swiglu' else 2)
    n_mlp_in = 2 if config.mlp == 'swiglu' else 1
    weights = h * (heads + 2 * kv) * hd + heads * hd * h + (n_mlp_in + 1) * h * hidden
    autocast_copies = weights * e if e == 2 and fp32_weights else 0  # autocast's bf16 weights, kept too
    # over bf16 weights a LayerNorm runs in fp32 only in a GPU's autocast
    fp32_layernorm = config.norm == 'layernorm' and residual == fp32 and not fp32_weights
    if e == 2 and config.mlp == 'swiglu' and (fp32_weights or fp32_layernorm):
        autocast_copies += tokens * h * e  # c_gate and c_fc each cast their fp32 input: two bf16 copies
        # (over bf16 weights an RMSNorm's output is bf16 already; a LayerNorm's fp32 only in a GPU's autocast)
    if e == 2 and fp32_layernorm:  # and keeps the fp32 copies autocast makes of its weight and bias
        per_norm += h * fp32 * (2 if config.bias else 1)
    return 2 * per_norm + linear_inputs + attention + mlp + autocast_copies


def logits_bytes_formula(tokens, vocab, bytes_per_elem=4, losses_held=1):
    """Bytes of the head's output that a rank holds at its peak, for `tokens` tokens (b·s; s/cp under context
    parallelism) and `vocab` entries (V/t for a vocabulary-parallel head), counted off model.py's head: the
    logits in the compute dtype (bf16 under bf16 autocast; train.py's loop keeps them through the backward),
    and for each micro-batch whose loss is held for backward one fp32 tensor of their shape: F.cross_entropy
    of the logits' fp32 copy saves its log-softmax output (tensor_parallel.py's vocabulary-parallel loss its
    exponentials). A pipeline's last stage keeps only that fp32 tensor of each microbatch it holds
    (losses_held), the logits of one at a time. Transients are left out: under bf16 the fp32 copy itself
    while log-softmax runs, and in backward the gradients of the log-softmax's output and input (fp32) and
    under bf16 the input's bf16 cast: a few more tensors of this shape for a moment."""
    return tokens * vocab * (bytes_per_elem + 4 * losses_held)


def tp_comm_bytes_formula(s, b, h, t, sequence_parallel=False, bytes_per_elem=2):
    """Bytes one rank sends per transformer layer per micro-batch (forward + backward), ring algorithms:
    4 all-reduces of the b*s*h activations, each 2(t-1)/t of it. Sequence parallelism turns each into an
    all-gather + reduce-scatter of (t-1)/t each: the same total."""
    return 4 * 2 * (t - 1) / t * s * b * h * bytes_per_elem


def tp_edge_comm_bytes_formula(s, b, h, t, sequence_parallel=False, bytes_per_elem=2):
    """The rest of a micro-batch: the vocabulary-parallel embedding (1 all-reduce forward) and head (1
    backward) of b*s*h each, and the vocabulary-parallel cross-entropy's 3 all-reduces of b*s fp32 numbers
    (max, sum of exponentials, target logit)."""
    return 2 * 2 * (t - 1) / t * s * b * h * bytes_per_elem + 3 * 2 * (t - 1) / t * s * b * 4


# -----------------------------------------------------------------------------
# Pipeline parallelism (GPipe; Narayanan et al. 2021): pipeline.py

def bubble_fraction_formula(p, m, v=1, schedule=None):
    """Idle fraction of a GPipe/1F1B step, (p-1)/(m+p-1) (GPipe paper); interleaved with v chunks per stage
    the bubble shrinks v times: (p-1)/(v*m + p-1) of the total time (Narayanan et al. 2021 give (p-1)/(v*m) of
    the ideal). ZB-H1 (Qi et al. 2023) splits each backward into B and W and fills the cool-down with W: idle
    (p-1)(F+B-W) of m(F+B+W), so with F = B = W, (p-1)/(3m+p-1) of the total."""
    if schedule == 'zb1':
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def peak_microbatches_formula(schedule_name, p, m, stage, v=1):
    """Microbatches whose activations stage `stage` holds at peak: GPipe all m; 1F1B p - stage (at most m);
    ZB-H1 p; interleaved its warm-up forwards plus one, 2(p-stage-1) + (v-1)p + 1 (at most m·v), each a
    chunk's worth."""
    if schedule_name == 'gpipe':
        return m
    if schedule_name == 'interleaved':
        return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
    if schedule_name == 'zb1':  # a microbatch is held until its W: p on every stage, 1F1B's first stage's
        return min(p, m)
    return min(p - stage, m)


def zb1_output_grad_bytes_formula(config, b, s, n_blocks, first, last, linear_bytes=4):
    """Bytes zb1's B keeps for W per microbatch of b sequences of s tokens: the gradient of every weight
    module's output (W's input; the ZB-H1 paper's M_W), on a stage of n_blocks dense blocks: per token the
    two norms' h, the attention's q, k, v and projection (n_head + 2·n_kv_head)·head_dim + h, the MLP's
    hidden (twice with SwiGLU's gate) and projection h; the first stage's token embedding h (and the learned
    positions' s·h once), the last's final norm h and head vocab_size. Linear outputs in linear_bytes (2
    under bf16 autocast), the rest fp32. None for a mixture of experts (how many slots reach each expert's
    matmuls is the routing's)."""
    c = config
    if any(c.is_moe(i) for i in range(c.n_layer)):
        return None
    hidden = c.n_hidden * (2 if c.mlp == 'swiglu' else 1)
    linears = (c.n_head + 2 * c.n_kv_head) * (c.n_embd // c.n_head) + c.n_embd + hidden + c.n_embd
    per_token = n_blocks * (2 * c.n_embd * 4 + linears * linear_bytes)
    if first:
        per_token += c.n_embd * 4
    if last:
        per_token += c.n_embd * 4 + c.vocab_size * linear_bytes
    positions = s * c.n_embd * 4 if first and c.pos == 'learned' else 0
    return b * s * per_token + positions


def p2p_comm_bytes_formula(s, b, h, p, m, bytes_per_elem=4, stage=None, v=1):
    """Bytes one stage sends per schedule of m microbatches of b sequences: each microbatch's activation (b,
    s, h) out of each of its v chunks (but the model's last) and its gradient back into each (but the model's
    first). stage=None: the busiest stage (a middle one when p > 2)."""
    if p == 1:
        return 0
    if stage is None:
        return (2 * v if p > 2 else 2 * v - 1) * m * b * s * h * bytes_per_elem
    return (2 * v - int(stage == p - 1) - int(stage == 0)) * m * b * s * h * bytes_per_elem


# -----------------------------------------------------------------------------
# Context parallelism (ring attention; Ulysses): context_parallel.py

def cp_comm_bytes_formula(s, b, n_head, n_kv_head, head_dim, cp, attention, bytes_per_elem=4):
    """Bytes one rank sends for one layer's attention, forward and backward, per micro-batch of b sequences of
    s tokens; bytes_per_elem is the size of q, k, v (2 under bf16 autocast: c_attn's output). ring: a kv block
    (keys and values of its s/cp tokens) goes on cp-1 times forward and cp-1 times backward, in q's dtype, and
    the block's gradients cp times (the last brings them home), in fp32 whatever the dtype:
    RingAttention.backward accumulates dK and dV in fp32 buffers and sends those. Ulysses: q, k, v and the
    output all-to-all'd forward and their gradients backward, (cp-1)/cp of each, all in q's dtype (autograd
    hands each gradient back in its tensor's dtype)."""
    if cp == 1:
        return 0
    tokens = b * s // cp
    kv = 2 * tokens * n_kv_head * head_dim  # elements of one kv block
    if attention == 'ring':
        return 2 * (cp - 1) * kv * bytes_per_elem + cp * kv * 4
    qo = 2 * tokens * n_head * head_dim
    return 2 * (cp - 1) / cp * (qo + kv) * bytes_per_elem


# -----------------------------------------------------------------------------
# Expert parallelism (GShard, Lepikhin et al. 2020; DeepSpeed-MoE): expert_parallel.py

def ep_all_to_all_bytes_formula(tokens, k, h, ep, bytes_per_elem=4, out_bytes_per_elem=None):
    """Bytes of one MoE layer's all-to-alls on one rank per micro-batch of `tokens` tokens (b·s), forward and
    backward: each token's k slots (h elements each) dispatched to their experts' ranks and combined back,
    then the gradients of both the other way: 4 all-to-alls of tokens·k·h elements handed to the calls
    ('all_to_all_bytes'). The dispatched rows and their gradients are the norm's output, bytes_per_elem (fp32
    under autocast too); the experts' outputs and their gradients out_bytes_per_elem (2 under bf16 autocast;
    default bytes_per_elem). Of them (ep-1)/ep leave the rank ('wire_bytes') ASSUMING UNIFORM ROUTING: the
    router spreads the slots evenly over the experts, so 1/ep of them stay on this rank's own experts. A real
    router is not uniform: what a rank hands to the combine and sends off-rank follows its experts' load,
    which is why the scripts print the counted bytes beside this. The split sizes exchanged first (ep·E/ep
    integers each way) are left out. With ep 1 every expert is on the rank: no all-to-all, 0."""
    handed = 2 * tokens * k * h * (bytes_per_elem + (out_bytes_per_elem or bytes_per_elem)) if ep > 1 else 0
    return {'all_to_all_bytes': handed, 'wire_bytes': (ep - 1) / ep * handed}


def ep_model_state_bytes_formula(dense_numel, expert_numel, ep):
    """Bytes one rank holds with the experts split over ep ranks: the dense weights (attention, router,
    embeddings, norms, a shared expert) whole, 1/ep of the routed experts, each in fp32 with its fp32 gradient
    and AdamW's two fp32 moments (4 + 4 + 8 bytes per parameter, as DDP keeps them, under autocast too)."""
    numel = dense_numel + expert_numel / ep
    return {'param_bytes': 4 * numel, 'grad_bytes': 4 * numel, 'optim_bytes': 8 * numel}
