"""model.py: the GPT in both layouts, against its own definition (causality, init loss), against an independent
construction (GQA as multi-head with repeated k/v heads), against itself (activation checkpointing, bf16) and
against Hugging Face's implementations when transformers is installed."""
import math

import pytest
import torch

from common.hf import from_hf, to_hf
from model import GPT, GPTConfig

V = 67
GPT2_LAYOUT = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=V)
LLAMA_LAYOUT = dict(GPT2_LAYOUT, n_kv_head=2, norm='rmsnorm', mlp='swiglu', pos='rope', tie_embeddings=False,
                    bias=False)
LAYOUTS = {'gpt2': GPT2_LAYOUT, 'llama_gqa': LLAMA_LAYOUT}
MOE_LAYOUTS = {
    'llama_moe': dict(LLAMA_LAYOUT, n_expert=4, n_expert_active=2),  # Mixtral's layout
    'gpt2_moe_shared_every_2nd': dict(GPT2_LAYOUT, n_expert=3, n_expert_active=2, n_shared_expert=1, moe_every=2),
}


def build(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**kw))


@pytest.mark.parametrize('layout', LAYOUTS)
def test_future_token_never_changes_an_earlier_logit(layout):
    model = build(**LAYOUTS[layout]).eval()
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    logits, _ = model(idx)
    for t in (0, 7, 14):
        changed = idx.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1) % V  # every later token differs
        new_logits, _ = model(changed)
        torch.testing.assert_close(new_logits[:, :t + 1], logits[:, :t + 1], rtol=0, atol=1e-6)
        assert (new_logits[:, t + 1:] - logits[:, t + 1:]).abs().max() > 1e-4  # and the later ones do see it


@pytest.mark.parametrize('layout', LAYOUTS)
def test_loss_at_init_is_ln_vocab(layout):
    model = build(**LAYOUTS[layout])
    g = torch.Generator().manual_seed(2)
    idx, targets = torch.randint(0, V, (8, 16), generator=g), torch.randint(0, V, (8, 16), generator=g)
    _, loss = model(idx, targets)  # random targets: every token equally likely is the best a fresh model can do
    assert abs(loss.item() - math.log(V)) < 0.05, (loss.item(), math.log(V))


def test_layouts_build_what_they_say():
    gpt2, llama = build(**GPT2_LAYOUT), build(**LLAMA_LAYOUT)
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight and gpt2.transformer.wpe is not None
    assert llama.lm_head.weight is not llama.transformer.wte.weight and llama.transformer.wpe is None
    hd = 32 // 4
    assert llama.transformer.h[0].attn.c_attn.weight.shape == ((4 + 2 * 2) * hd, 32)  # q 4 heads, k and v 2 each
    assert hasattr(llama.transformer.h[0].mlp, 'c_gate') and not hasattr(gpt2.transformer.h[0].mlp, 'c_gate')


def test_gqa_equals_multi_head_attention_with_repeated_kv_heads():
    """A GQA model (2 kv heads for 4 query heads) gives the logits of a plain multi-head model whose k and v
    weights are the GQA ones with each kv head repeated for the query heads it serves."""
    gqa = build(**LLAMA_LAYOUT).eval()
    mha = build(**dict(LLAMA_LAYOUT, n_kv_head=4)).eval()
    sd = gqa.state_dict()
    hd, nh, nkv = 8, 4, 2
    for i in range(2):
        w = sd[f'transformer.h.{i}.attn.c_attn.weight']
        q, k, v = w.split([nh * hd, nkv * hd, nkv * hd])
        rep = lambda t: t.view(nkv, hd, -1).repeat_interleave(nh // nkv, dim=0).reshape(nh * hd, -1)
        sd[f'transformer.h.{i}.attn.c_attn.weight'] = torch.cat([q, rep(k), rep(v)])
    mha.load_state_dict(sd)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(gqa(idx)[0], mha(idx)[0], rtol=1e-5, atol=1e-5)


def test_attention_matches_a_hand_written_causal_softmax():
    """The SDPA path against the textbook formula softmax(q k^T / sqrt(d) + causal mask) v."""
    model = build(**GPT2_LAYOUT).eval()
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(4))
    q, k, v = attn.c_attn(x).split(32, dim=2)
    q, k, v = (t.view(2, 16, 4, 8).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)
    scores = scores.masked_fill(torch.triu(torch.ones(16, 16, dtype=torch.bool), 1), float('-inf'))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 16, 32)
    torch.testing.assert_close(attn(x), attn.c_proj(y), rtol=1e-5, atol=1e-6)


def saved_bytes_and_grads(activation_checkpointing, layout):
    """Bytes of the tensors autograd keeps for backward (parameters left out: they are held anyway), counted by
    storage with saved_tensors_hooks, plus, with checkpointing, the block inputs the checkpoint keeps to recompute
    from; and the gradients of one backward."""
    model = build(**dict(LAYOUTS[layout], n_layer=4, activation_checkpointing=activation_checkpointing))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = {}

    def keep(t):
        if t.untyped_storage().data_ptr() not in params:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    def pack(t):
        keep(t)
        return t

    hooks = []
    if activation_checkpointing:
        hooks = [b.register_forward_pre_hook(lambda m, args: keep(args[0])) for b in model.transformer.h]
    idx = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(5))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
    for h in hooks:
        h.remove()
    loss.backward()
    return sum(held.values()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize('layout', LAYOUTS)
def test_activation_checkpointing_same_grads_fewer_bytes(layout):
    plain_bytes, plain_grads = saved_bytes_and_grads(False, layout)
    ckpt_bytes, ckpt_grads = saved_bytes_and_grads(True, layout)
    for name in plain_grads:
        torch.testing.assert_close(ckpt_grads[name], plain_grads[name], rtol=0, atol=0, msg=name)
    assert ckpt_bytes < plain_bytes / 3, (ckpt_bytes, plain_bytes)


@pytest.mark.parametrize('layout', LAYOUTS)
def test_bfloat16_autocast_close_to_float32(layout):
    model = build(**LAYOUTS[layout])
    idx = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(6))
    logits32, loss32 = model(idx, idx)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        logits16, loss16 = model(idx, idx)
    assert logits16.dtype == torch.bfloat16  # autocast really ran the matmuls in bf16
    assert abs(loss16.item() - loss32.item()) < 1e-2 * loss32.item()
    assert (logits16.float() - logits32).abs().max() < 0.05 * logits32.abs().max() + 1e-3


def test_generate_extends_and_respects_top_k():
    model = build(**GPT2_LAYOUT).eval()
    torch.manual_seed(0)
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), 20, temperature=1.0, top_k=1)
    assert out.shape == (2, 23)
    # top_k=1 is greedy: each token is the argmax given what came before (the window slides past block_size)
    for t in range(3, 23):
        logits, _ = model(out[:, max(0, t - 16):t])
        assert torch.equal(out[:, t], logits[:, -1].argmax(-1))


def test_too_long_sequence_is_an_error():
    model = build(**GPT2_LAYOUT)
    with pytest.raises(ValueError, match='block_size'):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_bad_model_config_is_a_value_error():
    with pytest.raises(ValueError, match='n_kv_head'):
        GPTConfig(n_head=4, n_embd=32, n_kv_head=3)
    with pytest.raises(ValueError, match='norm'):
        GPTConfig(norm='batchnorm')


@pytest.mark.parametrize('kind', ['gpt2', 'llama_gqa'])
def test_from_hf_logits_match(kind):
    transformers = pytest.importorskip('transformers', reason='transformers is not installed (it is optional)')
    torch.manual_seed(0)
    if kind == 'gpt2':
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0))
    hf.eval()
    # random init is tiny (std 0.02): scale the weights up so that a wrong transpose or rotary layout shows
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.mul_(10)
    ours = from_hf(hf).eval()
    idx = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf(idx).logits
    # GPT-2's GELU is its tanh form, and from_hf sets gelu='tanh': both layouts match to float error
    assert ours.config.gelu == ('tanh' if kind == 'gpt2' else 'exact')
    torch.testing.assert_close(ours(idx)[0], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_from_hf_overrides_build_the_dropout_modules():
    """Fine-tuning with dropout: the override must reach the Dropout modules, not only the config."""
    transformers = pytest.importorskip('transformers', reason='transformers is not installed (it is optional)')
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=1,
                                                              n_head=2, bos_token_id=0, eos_token_id=0))
    ours = from_hf(hf, dropout=0.1)
    ps = [m.p for m in ours.modules() if isinstance(m, torch.nn.Dropout)]
    assert ps and all(p == 0.1 for p in ps) and ours.transformer.h[0].attn.dropout == 0.1


HF_LAYOUTS = {
    'gpt2_tanh_bias': dict(GPT2_LAYOUT, gelu='tanh'),
    'gpt2_no_bias_untied': dict(GPT2_LAYOUT, bias=False, tie_embeddings=False),
    'llama_gqa': LLAMA_LAYOUT,
    'llama_bias_tied': dict(LLAMA_LAYOUT, bias=True, tie_embeddings=True, n_kv_head=4),
}


@pytest.mark.parametrize('layout', list(HF_LAYOUTS))
def test_to_hf_round_trip_same_logits(layout):
    """ours -> Hugging Face -> ours: the same logits at every step (weights scaled up so a wrong transpose shows)."""
    pytest.importorskip('transformers', reason='transformers is not installed (it is optional)')
    ours = build(**HF_LAYOUTS[layout]).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.2)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(8))
    hf = to_hf(ours).eval()
    back = from_hf(hf).eval()
    with torch.no_grad():
        want, theirs, again = ours(idx)[0], hf(idx).logits, back(idx)[0]
    tol = dict(rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(theirs, want, **tol)
    torch.testing.assert_close(again, want, **tol)
    assert back.config.tie_embeddings == ours.config.tie_embeddings and back.config.gelu == ours.config.gelu


def test_to_hf_rejects_a_layout_hugging_face_has_no_class_for():
    pytest.importorskip('transformers', reason='transformers is not installed (it is optional)')
    with pytest.raises(ValueError, match='GPT-2 layout'):
        to_hf(build(**dict(GPT2_LAYOUT, pos='rope')))


@pytest.mark.parametrize('layout', ['gpt2', 'gpt2_bias', 'llama'] + list(MOE_LAYOUTS))
def test_init_params_replays_train_py_initialization_exactly(layout):
    """init_params draws what GPT(config) draws after torch.manual_seed(seed), one module at a time: every
    parameter (a tied weight under both names) bitwise equal, and the random stream left where GPT leaves it
    (the mixtures of experts too)."""
    from common.checkpoints import init_params
    extra = {'gpt2': {}, 'gpt2_bias': dict(bias=True),
             'llama': dict(pos='rope', norm='rmsnorm', mlp='swiglu', n_kv_head=2, tie_embeddings=False)}
    shape = dict(n_layer=2, n_head=4, block_size=16)
    config = GPTConfig(**{**shape, **MOE_LAYOUTS.get(layout, extra.get(layout)), 'n_embd': 16, 'vocab_size': 40})
    torch.manual_seed(7)
    ref = GPT(config)
    ref_next = torch.rand(3)
    got = {}
    init_params(config, 7, lambda name, values: got.__setitem__(name, values.clone()))
    assert torch.equal(torch.rand(3), ref_next)
    named = dict(ref.named_parameters(remove_duplicate=False))
    assert sorted(got) == sorted(named)
    for name, p in named.items():
        assert torch.equal(got[name], p.detach()), name


@pytest.mark.parametrize('layout', LAYOUTS)
def test_flops_per_token_equals_torch_s_count_of_a_training_step(layout):
    """MFU's numerator against PyTorch's own FLOP counter (torch.utils.flop_counter counts every matmul, none of
    the lookups) over one forward and backward of sequences shorter than block_size, attention on its math
    kernel (two bmm, whose FLOPs the counter sees). The formula also counts the norms' and biases' weights as
    if they multiplied (6 FLOPs each per token): with those taken out the two agree exactly. Counting the untied
    token embedding, or the model's block size instead of the run's sequence length, would not."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    model = build(**dict(LAYOUTS[layout], n_embd=64))
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert model.flops_per_token(seq_len=12) - 6 * vectors == counter.get_total_flops() / idx.numel()


# -----------------------------------------------------------------------------
# Mixture of experts: dropless top-k routing, the load-balancing loss, against a dense block and Mixtral

def moe_layers(model):
    from model import MoE
    return [b.mlp for b in model.transformer.h if isinstance(b.mlp, MoE)]


@pytest.mark.parametrize('layout', MOE_LAYOUTS)
def test_moe_is_dropless_every_token_reaches_its_k_experts(layout):
    """tokens_per_expert sums to k x tokens in every MoE layer, and each token's output is, token by token, its
    k experts' outputs weighted by the router's renormalized top-k probabilities (plus the shared expert's):
    even with a router that sends every token to expert 0, no token is dropped or cut short."""
    model = build(**MOE_LAYOUTS[layout]).eval()
    k, E = model.config.n_expert_active, model.config.n_expert
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(9))
    model(idx)
    assert model.tokens_per_expert.shape == (len(moe_layers(model)), E)
    assert model.tokens_per_expert.sum(-1).tolist() == [k * idx.numel()] * len(moe_layers(model))
    layer = moe_layers(model)[0]
    with torch.no_grad():
        layer.router.weight[0] += 5.0  # x > 0 below: expert 0 is every token's first choice
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(10)).abs()
    with torch.no_grad():
        y = layer(x).view(-1, 32)
        assert layer.routing.counts.sum().item() == k * 32 and layer.routing.counts[0] == 32
        for t, xt in enumerate(x.view(-1, 32)):
            probs = torch.softmax(layer.router(xt), -1)
            top = probs.topk(k)
            want = sum(w / top.values.sum() * layer.experts[e](xt) for w, e in zip(top.values, top.indices))
            if layer.shared_expert is not None:
                want = want + layer.shared_expert(xt)
            torch.testing.assert_close(y[t], want, rtol=1e-5, atol=1e-6)


def test_moe_aux_loss_is_the_switch_formula():
    """A known router: 4 experts, the router the identity times c, top-1, four tokens: e0, e0, e1, e2. Each
    token's own expert has probability a = e^c / (e^c + 3), the others b = 1 / (e^c + 3); the slots go 2, 1, 1, 0
    to the experts, so f = (1/2, 1/4, 1/4, 0) and P = ((2a + 2b) / 4, (a + 3b) / 4, (a + 3b) / 4, 4b / 4):
    aux = 4 * sum f P. Then the model: its loss is cross-entropy + aux_loss_weight x the MoE layers' mean aux."""
    from model import MoE, moe_loss
    c = 2.0
    layer_config = GPTConfig(n_embd=4, n_head=1, n_expert=4, n_expert_active=1, mlp='swiglu', bias=False)
    layer = MoE(layer_config)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4) * c)
    x = torch.eye(4)[[0, 0, 1, 2]].view(1, 4, 4)
    layer(x)
    a, b = math.exp(c) / (math.exp(c) + 3), 1 / (math.exp(c) + 3)
    f, P = [1 / 2, 1 / 4, 1 / 4, 0], [(2 * a + 2 * b) / 4, (a + 3 * b) / 4, (a + 3 * b) / 4, b]
    assert layer.routing.counts.tolist() == [2, 1, 1, 0]
    assert moe_loss([layer], layer_config)[1].item() == pytest.approx(4 * sum(fe * pe for fe, pe in zip(f, P)),
                                                                      rel=1e-6)

    model = build(**dict(MOE_LAYOUTS['llama_moe'], aux_loss_weight=0.25))
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(11))
    logits, loss = model(idx, idx)
    auxes, seen = [], saved_inputs(model, idx)
    for m in moe_layers(model):  # each layer's aux from its own router and the tokens it counted
        probs = torch.softmax(m.router(seen[m]), -1)
        auxes.append(4 * (m.routing.counts / (2 * 32) * probs.mean(0)).sum())
    ce = torch.nn.functional.cross_entropy(logits.view(-1, V), idx.view(-1))
    torch.testing.assert_close(loss, ce + 0.25 * sum(auxes) / len(auxes))
    torch.testing.assert_close(model.aux_loss, (sum(auxes) / len(auxes)).detach())


def test_the_router_gradient_of_the_aux_loss_is_its_formula():
    """The aux loss alone (no token's output in it) trains the router through P_e, the mean router probability:
    aux = E sum_e f_e P_e with f fixed (counted), so d aux / d logit_tj = E/N p_tj (f_j - sum_e f_e p_te), and
    the router weight's gradient is that times the token, summed: written out here, against autograd. A router
    whose probabilities the loss detaches keeps the loss's value and fails this."""
    from model import MoE, moe_loss
    config = GPTConfig(n_embd=8, n_head=1, n_expert=4, n_expert_active=2, aux_loss_weight=1.0, bias=False)
    layer = MoE(config)
    x = torch.randn(1, 24, 8, generator=torch.Generator().manual_seed(19))
    layer(x)
    moe_loss([layer], config)[0].backward()
    with torch.no_grad():
        tokens = x.view(-1, 8)
        p = torch.softmax(tokens @ layer.router.weight.t(), -1)
        f = layer.routing.counts / layer.routing.counts.sum()
        dlogits = 4 / 24 * p * (f - (p * f).sum(-1, keepdim=True))
    torch.testing.assert_close(layer.router.weight.grad, dlogits.t() @ tokens, rtol=1e-5, atol=1e-7)
    assert layer.router.weight.grad.abs().sum() > 0


def saved_inputs(model, idx):
    """The input each MoE layer saw in a forward of idx, flattened to (tokens, C)."""
    seen, hooks = {}, []
    for m in moe_layers(model):
        hooks.append(m.register_forward_pre_hook(lambda mod, args: seen.__setitem__(mod, args[0].reshape(-1, 32))))
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    return seen


def test_one_expert_moe_equals_the_dense_mlp():
    """n_expert=1, k=1: the router's one weight renormalizes to 1, so an MoE GPT whose expert holds a dense GPT's
    MLP weights gives the dense GPT's logits (the aux loss is then exactly 1: f = P = 1)."""
    for layout in (LLAMA_LAYOUT, GPT2_LAYOUT):
        dense = build(**layout).eval()
        moe = build(seed=1, **dict(layout, n_expert=1, n_expert_active=1)).eval()
        sd = {k.replace('.mlp.', '.mlp.experts.0.'): v for k, v in dense.state_dict().items()}
        sd.update({k: v for k, v in moe.state_dict().items() if 'router' in k})
        moe.load_state_dict(sd)
        idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(12))
        torch.testing.assert_close(moe(idx)[0], dense(idx)[0], rtol=1e-6, atol=1e-6)
        assert moe.aux_loss.item() == pytest.approx(1.0)


def test_gradients_reach_the_router_through_the_weights_and_the_aux_loss():
    for weight in (0.0, 0.01):  # 0: through the top-k weights alone
        model = build(**dict(MOE_LAYOUTS['llama_moe'], aux_loss_weight=weight))
        idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(13))
        model(idx, idx)[1].backward()
        for m in moe_layers(model):
            g = m.router.weight.grad
            assert g is not None and torch.isfinite(g).all() and (g.abs().sum(-1) > 0).all(), weight


@pytest.mark.parametrize('layout', MOE_LAYOUTS)
def test_moe_activation_checkpointing_gives_the_same_grads(layout):
    """The aux loss leaves each block beside its output: recomputed in backward, it must still give every
    gradient (the router's too) exactly."""
    grads = []
    for ac in (False, True):
        model = build(**dict(MOE_LAYOUTS[layout], activation_checkpointing=ac))
        idx = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(14))
        model(idx, idx)[1].backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0, msg=name)


def test_moe_config_is_checked():
    with pytest.raises(ValueError, match=r'n_expert_active \(top-k, 5\) must be 1 to n_expert \(4\)'):
        GPTConfig(n_expert=4, n_expert_active=5)
    with pytest.raises(ValueError, match='n_shared_expert'):
        GPTConfig(n_expert=4, n_shared_expert=2)
    GPTConfig(n_expert=0, n_expert_active=5)  # dense: the MoE keys are not read


@pytest.mark.parametrize('layout', MOE_LAYOUTS)
def test_moe_flops_per_token_counts_the_active_experts(layout):
    """As test_flops_per_token_equals_torch_s_count_of_a_training_step, with experts: PyTorch's counter sees
    every token go through the router, the shared expert and exactly k experts, so flops_per_token must count
    k of n_expert experts' weights (their biases too, as the formula counts every vector weight)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    model = build(**dict(MOE_LAYOUTS[layout], n_embd=64))
    c = model.config
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    named = dict(model.named_parameters())
    vectors = sum(p.numel() for n, p in named.items() if p.dim() == 1 and '.experts.' not in n)
    vectors += sum(p.numel() for n, p in named.items() if p.dim() == 1 and '.experts.' in n) * \
        c.n_expert_active // c.n_expert
    assert model.flops_per_token(seq_len=12) - 6 * vectors == counter.get_total_flops() / idx.numel()
    assert model.get_num_params(active=True) < model.get_num_params()


def mixtral(**kw):
    transformers = pytest.importorskip('transformers', reason='transformers is not installed (it is optional)')
    if not hasattr(transformers, 'MixtralForCausalLM'):
        pytest.skip('this transformers has no Mixtral')
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**dict(
        vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        bos_token_id=0, eos_token_id=0), **kw)).eval()


def test_from_hf_mixtral_logits_match():
    """A small random MixtralForCausalLM (offline) through from_hf: the same logits. Its experts are stored fused
    (transformers 5: gate_up_proj (E, 2I, C), down_proj (E, C, I)), its router is mlp.gate."""
    hf = mixtral()
    with torch.no_grad():  # scaled up, as in test_from_hf_logits_match: a wrong layout or routing shows
        for p in hf.parameters():
            if p.dim() >= 2:
                p.mul_(10)
    ours = from_hf(hf).eval()
    c = ours.config
    assert (c.n_expert, c.n_expert_active, c.moe_every, c.n_shared_expert) == (4, 2, 1, 0)
    idx = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        expected, got = hf(idx).logits, ours(idx)[0]
    assert (ours.tokens_per_expert > 0).all()  # every expert took part
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_a_converted_mixtral_trains_on_hugging_faces_loss():
    """from_hf keeps Mixtral's load-balancing loss (the top-k's share of the tokens, pooled over the layers, as
    transformers' load_balancing_loss_func): the converted model's total loss is MixtralForCausalLM's with
    output_router_logits=True, router_aux_loss_coef x its aux included (a larger coefficient makes a wrong aux
    show); and the gradient of the aux alone reaches every router, as theirs does."""
    hf = mixtral(router_aux_loss_coef=0.5, output_router_logits=True)
    ours = from_hf(hf)
    assert ours.config.aux_loss_style == 'hf' and ours.config.aux_loss_weight == 0.5
    x, y = (torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(s)) for s in (17, 18))
    theirs = hf(input_ids=x, labels=y, shift_labels=y, output_router_logits=True)
    torch.testing.assert_close(ours(x, y)[1], theirs.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss.detach(), rtol=1e-5, atol=1e-5)
    assert theirs.aux_loss.item() > 1.5  # (Hugging Face's sums to about k: ours would be about 1)


def test_to_hf_mixtral_round_trip_same_logits():
    pytest.importorskip('transformers', reason='transformers is not installed (it is optional)')
    ours = build(**MOE_LAYOUTS['llama_moe']).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.2)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(16))
    hf = to_hf(ours).eval()
    assert type(hf).__name__ == 'MixtralForCausalLM'
    back = from_hf(hf).eval()
    with torch.no_grad():
        want, theirs, again = ours(idx)[0], hf(idx).logits, back(idx)[0]
    tol = dict(rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(theirs, want, **tol)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="Mixtral's"):  # Mixtral has no shared expert
        to_hf(build(**dict(MOE_LAYOUTS['llama_moe'], n_shared_expert=1)))
