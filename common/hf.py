"""
Hugging Face's GPT-2, LLaMA and Mixtral, in and out of model.GPT: from_hf(hf_model) gives the GPT with the
same logits, to_hf(model) the transformers model with this GPT's; from_pretrained('gpt2') reads GPT-2's
weights through transformers, and open_gpt2 reads them from a safetensors file one tensor at a time, so that a
sharded script copies out its share of each (checkpoints.init_values). transformers is needed only here.
"""

import json
import os
from types import SimpleNamespace

import torch

from common.distributed import is_master
from common.training import first_sentence
from model import GPT, GPTConfig


def from_hf(hf_model, **overrides):
    """A GPT whose logits match a Hugging Face GPT2LMHeadModel, LlamaForCausalLM or MixtralForCausalLM.
    overrides sets GPTConfig fields that do not change the weights (dropout, activation_checkpointing).
    GPT-2's GELU is its tanh approximation ('gelu_new'): gelu='tanh' here."""
    hf_cfg, sd_hf = hf_model.config, hf_model.state_dict()
    if hf_cfg.model_type == 'gpt2':
        model = GPT(gpt2_config(hf_cfg, **overrides))
        pairs = ((name, ..., values) for name, values in gpt2_tensors(sd_hf.items(), model.config))
    elif hf_cfg.model_type in ('llama', 'mixtral'):
        model = GPT(llama_config(hf_cfg, **overrides))
        pairs = llama_pairs(sd_hf, model.config)
    else:
        raise ValueError(f"from_hf supports gpt2, llama and mixtral models, not {hf_cfg.model_type!r}")
    sd = model.state_dict()
    with torch.no_grad():
        for mine, rows, theirs in pairs:
            if mine in sd:  # (theirs None: a bias their model lacks, attention_bias xor mlp_bias: zero)
                sd[mine][rows].zero_() if theirs is None else sd[mine][rows].copy_(theirs)
    return model


def from_pretrained(name, **overrides):
    """GPT-2's weights by name ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl'), through transformers. A
    directory without weights, or a name offline and not in the cache: one line (transformers' first)."""
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise SystemExit(f"error: init_from={name} needs Hugging Face transformers: pip install "
                         f"transformers")
    config_path = os.path.join(name, 'config.json')
    if os.path.isfile(config_path):  # (a LLaMA's or Mixtral's export: GPT2LMHeadModel would misread it)
        with open(config_path) as f:
            refuse_not_gpt2(name, json.load(f).get('model_type'))
    hf_model = cache_first(name, lambda cached: GPT2LMHeadModel.from_pretrained(name,
                                                                             local_files_only=cached))
    return from_hf(hf_model, **overrides)


def cache_first(name, fetch):
    """fetch(cached=True): a model from a directory or from Hugging Face's cache, with no network (a cached
    GPT-2 starts at once, offline too); else fetch(cached=False) downloads it from the hub, saying so first
    (the one download a training script makes, and only when init_from asks for it). A failure is one line:
    the library's first (no weights in the directory; no network and no cached copy, after its retries; a
    name the hub cannot have)."""
    try:
        return fetch(True)
    except OSError as e:  # (not cached: huggingface_hub's LocalEntryNotFoundError, transformers' OSError)
        if os.path.isdir(name):
            raise SystemExit(f"error: init_from={name}: {first_sentence(e)}")
    except ValueError as e:  # (not a name the hub can have: huggingface_hub's HFValidationError)
        raise SystemExit(f"error: init_from={name}: {first_sentence(e)}")
    if is_master():
        print(f"downloading {name} from the Hugging Face hub (once: later runs read its cache)", flush=True)
    try:
        return fetch(False)
    except OSError as e:
        raise SystemExit(f"error: init_from={name}: {first_sentence(e)}")


GPT2_CONV1D = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')


def gpt2_config(hf_cfg, **overrides):
    """The GPTConfig of a Hugging Face GPT-2 config (a GPT2Config, or its config.json's fields)."""
    return GPTConfig(block_size=hf_cfg.n_positions, vocab_size=hf_cfg.vocab_size, n_layer=hf_cfg.n_layer,
                     n_head=hf_cfg.n_head, n_embd=hf_cfg.n_embd, norm_eps=hf_cfg.layer_norm_epsilon,
                     n_hidden=getattr(hf_cfg, 'n_inner', None) or 4 * hf_cfg.n_embd,
                     gelu='exact' if hf_cfg.activation_function == 'gelu' else 'tanh',
                     tie_embeddings=bool(getattr(hf_cfg, 'tie_word_embeddings', True)),
                     **{'dropout': 0.0, 'bias': True, **overrides})


# The hub's four GPT-2 sizes (their config.json's shape, as nanoGPT's from_pretrained writes them): a check
# knows the model a name starts before anything is downloaded
GPT2_SIZES = {'gpt2': dict(n_layer=12, n_head=12, n_embd=768),
              'gpt2-medium': dict(n_layer=24, n_head=16, n_embd=1024),
              'gpt2-large': dict(n_layer=36, n_head=20, n_embd=1280),
              'gpt2-xl': dict(n_layer=48, n_head=25, n_embd=1600)}


def gpt2_shape(name):
    """A GPT-2's GPTConfig without its weights: a directory's config.json, or one of the hub's four sizes;
    None for another name (its config is on the hub) or another kind of model (open_gpt2 refuses it)."""
    path = os.path.join(name, 'config.json')
    if os.path.isfile(path):
        with open(path) as f:
            hf_cfg = SimpleNamespace(**json.load(f))
        return gpt2_config(hf_cfg) if getattr(hf_cfg, 'model_type', None) == 'gpt2' else None
    if name in GPT2_SIZES:
        return gpt2_config(SimpleNamespace(n_positions=1024, vocab_size=50257, layer_norm_epsilon=1e-5,
                                           activation_function='gelu_new', **GPT2_SIZES[name]))
    return None


def gpt2_start_config(cfg):
    """checkpoints.resumed_config where init_from names a GPT-2: the command's config with the GPT-2's shape
    (init_model builds that, whatever the flags say), and words for a refusal naming the values the checks
    divide that differ from the command's (None where none does)."""
    from common.checkpoints import model_shape
    config = gpt2_shape(cfg.init_from)
    shape = model_shape(cfg, vars(config) if config else {})
    said = ', '.join(f"{k}={v!r}" for k, v in shape.items() if getattr(cfg, k) != v and k in
                     ('n_layer', 'n_head', 'n_kv_head', 'n_embd', 'n_hidden'))
    return SimpleNamespace(**dict(vars(cfg), **shape)), (f"init_from={cfg.init_from} has {said}" if said
                                                         else None)


def gpt2_tensors(hf_named, config):
    """GPT-2's (name, tensor) pairs as this repo's: the names under transformer., the four Conv1D weights
    (stored (in, out)) transposed, no causal-mask buffers, a tied head under its own name too."""
    for k, values in hf_named:
        if k.endswith(('.attn.masked_bias', '.attn.bias')):
            continue  # causal-mask buffers, not weights (c_attn.bias is a weight: hence the dot)
        name = k if k.startswith(('transformer.', 'lm_head.')) else 'transformer.' + k
        yield name, values.t() if name.endswith(GPT2_CONV1D) else values
        if name == 'transformer.wte.weight' and config.tie_embeddings:
            yield 'lm_head.weight', values


def refuse_not_gpt2(name, model_type):
    """One line for a Hugging Face model that is not a GPT-2 (init_from loads GPT-2's weights)."""
    if model_type != 'gpt2':
        raise SystemExit(f"error: init_from={name} is a {model_type!r} model; only GPT-2 weights load here "
                         f"(a LLaMA goes through hf.from_hf)")


def open_gpt2(name, **overrides):
    """A GPT-2's GPTConfig, and a function that yields its weights as this repo's (name, tensor) pairs one at
    a time from its safetensors file, so a sharded script copies out its share of each and never holds the
    whole. name: a local directory, or a Hugging Face hub name (huggingface_hub downloads it once, then reads
    its cache)."""
    if os.path.isdir(name):
        config_path, weights_path = os.path.join(name, 'config.json'), os.path.join(name, 'model.safetensors')
    else:
        try:
            from huggingface_hub import hf_hub_download
        except ImportError:
            raise SystemExit(f"error: init_from={name} needs Hugging Face's hub client: pip install "
                             f"transformers")
        config_path, weights_path = cache_first(name, lambda cached: [
            hf_hub_download(name, f, local_files_only=cached) for f in ('config.json', 'model.safetensors')])
    if not os.path.isfile(weights_path):
        raise SystemExit(f"error: init_from={name}: no model.safetensors in it (save_pretrained writes one)")
    with open(config_path) as f:
        hf_cfg = SimpleNamespace(**json.load(f))
    refuse_not_gpt2(name, getattr(hf_cfg, 'model_type', None))
    config = gpt2_config(hf_cfg, **overrides)

    def tensors():
        from safetensors import safe_open
        with safe_open(weights_path, framework='pt') as f:
            yield from gpt2_tensors(((k, f.get_tensor(k)) for k in f.keys()), config)
    return config, tensors



def llama_config(hf_cfg, **overrides):
    """The GPTConfig of a Hugging Face Llama or Mixtral config."""
    # a Mixtral keeps Hugging Face's load-balancing loss (aux_loss_style='hf': the top-k's share of tokens,
    # pooled over the layers), so that router_aux_loss_coef weighs the same loss and the total is theirs
    moe = dict(n_expert=hf_cfg.num_local_experts, n_expert_active=hf_cfg.num_experts_per_tok,
               aux_loss_weight=hf_cfg.router_aux_loss_coef, aux_loss_style='hf') \
        if hf_cfg.model_type == 'mixtral' else {}
    theta = getattr(hf_cfg, 'rope_theta', None) or hf_cfg.rope_parameters['rope_theta']  # (transformers 5)
    bias = getattr(hf_cfg, 'attention_bias', False) or getattr(hf_cfg, 'mlp_bias', False)
    return GPTConfig(block_size=hf_cfg.max_position_embeddings, vocab_size=hf_cfg.vocab_size,
                     n_layer=hf_cfg.num_hidden_layers, n_head=hf_cfg.num_attention_heads,
                     n_embd=hf_cfg.hidden_size, n_hidden=hf_cfg.intermediate_size, bias=bool(bias),
                     n_kv_head=getattr(hf_cfg, 'num_key_value_heads', None) or hf_cfg.num_attention_heads,
                     norm='rmsnorm', mlp='swiglu', pos='rope',
                     tie_embeddings=bool(getattr(hf_cfg, 'tie_word_embeddings', False)),
                     norm_eps=hf_cfg.rms_norm_eps, rope_theta=float(theta),
                     **{'dropout': 0.0, **moe, **overrides})


def llama_pairs(sd_hf, config):
    """The table between our tensors and a Hugging Face Llama's or Mixtral's, read one way by from_hf and the
    other by to_hf: (our name, our rows, their tensor: a view into sd_hf, None where theirs has no such bias),
    for every name either model may have (the reader skips those ours lacks)."""
    theirs = dict(sd_hf)
    theirs.setdefault('lm_head.weight', theirs['model.embed_tokens.weight'])  # tied: stored once
    names = [('transformer.wte', 'model.embed_tokens'), ('transformer.ln_f', 'model.norm'), ('lm_head',) * 2]
    q, kv = config.n_embd, config.n_kv_head * (config.n_embd // config.n_head)
    for i in range(config.n_layer):
        me, hf = f'transformer.h.{i}.', f'model.layers.{i}.'
        names += [(me + a, hf + b) for a, b in (
            ('attn.c_proj', 'self_attn.o_proj'), ('ln_1', 'input_layernorm'), ('mlp.c_fc', 'mlp.up_proj'),
            ('ln_2', 'post_attention_layernorm'), ('mlp.c_gate', 'mlp.gate_proj'), ('mlp.router', 'mlp.gate'),
            ('mlp.c_proj', 'mlp.down_proj'))]
        for p, rows in zip('qkv', (slice(0, q), slice(q, q + kv), slice(q + kv, None))):  # c_attn: [q|k|v]
            for w in ('weight', 'bias'):
                yield f'{me}attn.c_attn.{w}', rows, theirs.get(f'{hf}self_attn.{p}_proj.{w}')
        if config.is_moe(i):  # Mixtral's experts, fused (transformers 5): gate_up_proj (E, 2I, C) [gate; up]
            gate_up, down = theirs[hf + 'mlp.experts.gate_up_proj'], theirs[hf + 'mlp.experts.down_proj']
            for e in range(config.n_expert):
                gate, up = gate_up[e].chunk(2)
                for mine, t in (('c_gate', gate), ('c_fc', up), ('c_proj', down[e])):
                    yield f'{me}mlp.experts.{e}.{mine}.weight', ..., t
    for mine, hf in names:
        for w in ('weight', 'bias'):
            yield f'{mine}.{w}', ..., theirs.get(f'{hf}.{w}')


def to_hf(model):
    """The Hugging Face model with this GPT's weights and the same logits: GPT2LMHeadModel for the GPT-2
    layout (learned positions, LayerNorm, GELU MLP; biases the model lacks are zeros there), LlamaForCausalLM
    for the LLaMA layout (RoPE, RMSNorm, SwiGLU, grouped-query attention), MixtralForCausalLM for it with
    experts. save_pretrained(DIR) then makes a directory that AutoModelForCausalLM.from_pretrained loads."""
    try:
        import transformers
    except ImportError:
        raise SystemExit("error: exporting to Hugging Face needs transformers: pip install transformers")
    c, sd = model.config, {k: v.detach().cpu() for k, v in model.state_dict().items()}
    layout = (c.pos, c.norm, c.mlp)
    mixtral = c.n_expert and c.moe_every == 1 and not c.n_shared_expert and not c.bias and \
        c.router == 'softmax' and not c.capacity_factor and not c.router_bias_rate  # (Mixtral's routing)
    if layout == ('learned', 'layernorm', 'gelu') and c.n_kv_head == c.n_head and not c.n_expert:
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
            n_head=c.n_head, n_inner=c.n_hidden, activation_function=('gelu', 'gelu_new')[c.gelu == 'tanh'],
            layer_norm_epsilon=c.norm_eps, resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout,
            tie_word_embeddings=c.tie_embeddings, bos_token_id=0, eos_token_id=0))
        pairs = ((mine, ..., theirs) for mine, theirs in gpt2_tensors(hf.state_dict().items(), c))
    elif layout == ('rope', 'rmsnorm', 'swiglu') and (mixtral or not c.n_expert):
        common = dict(
            vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.n_hidden, bos_token_id=0,
            num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
            max_position_embeddings=c.block_size, rope_theta=c.rope_theta, attention_dropout=c.dropout,
            rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_embeddings, eos_token_id=0)
        hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_local_experts=c.n_expert, num_experts_per_tok=c.n_expert_active,
            router_aux_loss_coef=c.aux_loss_weight, **common)) if mixtral else transformers.LlamaForCausalLM(
            transformers.LlamaConfig(attention_bias=c.bias, mlp_bias=c.bias, **common))
        pairs = llama_pairs(hf.state_dict(), c)
    else:
        raise ValueError(f"to_hf exports the GPT-2 layout (learned, layernorm, gelu; n_kv_head = n_head, "
                         f"dense), LLaMA's (rope, rmsnorm, swiglu) or Mixtral's (LLaMA's, experts in every "
                         f"block, none shared, no bias, softmax top-k routing, dropless, no balancing bias), "
                         f"not pos={c.pos}, norm={c.norm}, mlp={c.mlp}, n_kv_head={c.n_kv_head} of n_head="
                         f"{c.n_head}, n_expert={c.n_expert}")
    with torch.no_grad():  # their tensors are views into hf's: writing them writes the model
        for mine, rows, theirs in pairs:
            if theirs is not None:  # (theirs has a bias this model lacks: zero, the same function)
                theirs.copy_(sd[mine][rows]) if mine in sd else theirs.zero_()
    return hf
