"""tensor_parallel.py against the dense model (logits, loss, every re-assembled gradient), against PyTorch's own
tensor parallelism (DTensor ColwiseParallel/RowwiseParallel on an MLP, a grouped-query attention's heads and the
embedding, and loss_parallel), against train.py's loss curve (dp x tp, tp=4 with sequence parallelism,
consolidate-and-continue, resume) and against its own formulas."""
import contextlib
import copy
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from consolidate import consolidate
from helpers import (LoopbackFlood, TINY, assert_same_losses, check, read_log, refusals_of, run_script,
                     run_train_py_here, spawn, train_losses, train_py_reference)

from common import formulas, model_parallel

# Both layouts, shapes that divide by tp = 1, 2, 4. LLaMA: grouped-query attention (8 heads, 4 KV heads), untied,
# and a vocabulary of 97 so that the vocabulary split is uneven.
LAYOUTS = {
    'gpt2': dict(n_layer=2, n_head=4, n_embd=16, block_size=16, vocab_size=96, bias=True),
    'llama': dict(n_layer=2, n_head=8, n_kv_head=4, n_embd=32, block_size=16, vocab_size=97, bias=False,
                  norm='rmsnorm', mlp='swiglu', pos='rope', tie_embeddings=False),
}
# and with a mixture of experts (n_expert/t whole experts per tp rank): GPT-2 with MoE in every second block and
# a capacity factor that drops slots, LLaMA with sigmoid scores, the z-loss and a shared expert (cut as the MLP)
MOE = {
    'gpt2_moe': dict(LAYOUTS['gpt2'], n_expert=4, n_expert_active=2, moe_every=2, capacity_factor=0.75),
    'llama_moe': dict(LAYOUTS['llama'], n_expert=4, n_expert_active=2, n_shared_expert=1, router='sigmoid',
                      router_z_loss_weight=0.01),
}
TOL = 1e-5


def _rel_err(a, b):
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


def _gather(x, g):
    """Every tp rank's tensor, in rank order."""
    import torch.distributed as dist
    if g.size == 1:
        return [x]
    out = [None] * g.size
    dist.all_gather_object(out, x, group=g.group)
    return out


def _joined(slices, kind, shape, qkv_sizes):
    """The dense tensor from every tp rank's slice (in rank order), laid where model_parallel.slice_boxes says."""
    dense = torch.empty(shape)
    for r, part in enumerate(slices):
        for box, first, last in model_parallel.slice_boxes(shape, kind, SimpleNamespace(size=len(slices), rank=r), qkv_sizes):
            dense[tuple(slice(*b) for b in box)] = part[first:last]
    return dense


def _against_dense(rank, world_size):
    """For each layout, tp and sequence_parallel: the tp model vs the dense model on one batch; also what it
    sends and saves for backward, measured."""
    import torch.distributed as dist
    from common import measure
    import tensor_parallel as tpm
    from model import GPT, GPTConfig
    from common.distributed import Comm
    groups = {}
    for t in (1, 2, 4):  # every rank creates every group, in the same order
        made = [dist.new_group(row.tolist()) for row in torch.arange(world_size).view(-1, t)]
        groups[t] = Comm(made[rank // t], 'tp')
    results = {}
    for name, layout in {**LAYOUTS, **MOE}.items():
        config = GPTConfig(**layout)
        hd = config.n_embd // config.n_head
        qkv_sizes = [config.n_head * hd, config.n_kv_head * hd, config.n_kv_head * hd]
        gen = torch.Generator().manual_seed(1)
        idx = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
        targets = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
        targets[0, :3] = -1  # ignored, as in F.cross_entropy(ignore_index=-1)
        torch.manual_seed(0)
        dense = GPT(config)
        dense_logits, dense_loss = dense(idx, targets)
        dense_loss.backward()
        dense_params = dict(dense.named_parameters())
        dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), float('inf'))  # (scales by 1)
        for t in (1, 2, 4):
            for sp in (False, True):
                tp = tpm.TensorParallel(groups[t], sp)
                model = copy.deepcopy(dense)
                model.zero_grad(set_to_none=True)
                param_layout = tpm.shard_gpt(model, tp)
                tp.group.clear()
                with measure.first_block_saved_bytes(model) as saved:  # (its first block's, in this forward)
                    logits, loss = tpm.tp_forward(model, idx, targets, tp)
                loss.backward()
                comm = sum(tp.group.wire_bytes_formula.values())  # counted at the calls, ring bytes
                tpm.sync_tp_grads(param_layout, tp)
                full_logits = torch.cat(_gather(logits.detach(), tp.group), dim=-1)
                grad_err = max(_rel_err(_joined(_gather(p.grad, tp.group), kind, dense_params[n].shape, qkv_sizes)
                                        if kind != 'expert' else p.grad,  # (whole, on this rank only)
                                        dense_params[n].grad) for n, (p, kind) in param_layout.items())
                held = set().union(*_gather(set(param_layout), tp.group))
                L, h = config.n_layer, config.n_embd
                results[(name, t, sp)] = dict(
                    logits_err=_rel_err(full_logits, dense_logits.detach()),
                    loss_err=abs(loss.item() - dense_loss.item()),
                    grad_err=grad_err,
                    norm_err=_rel_err(tpm.clip_grads(param_layout, tp, float('inf')), dense_norm),
                    covered=held == set(dense_params),
                    comm=comm,
                    comm_formula=L * formulas.tp_comm_bytes_formula(16, 2, h, t, sp, 4)
                    + formulas.tp_edge_comm_bytes_formula(16, 2, h, t, sp, 4),
                    param_bytes=sum(p.numel() * 4 for p in model.parameters()),
                    param_bytes_formula=formulas.param_bytes_formula(config, t),
                    dense_param_bytes=sum(p.numel() * 4 for p in dense.parameters()), n_embd=h,
                    activation_bytes=saved.bytes,
                    activation_bytes_formula=formulas.saved_bytes_formula(config, 16, 2, t, sp))
    return results


def _against_dtensor(rank, world_size):
    """Column then row parallel Linear (plain and sequence parallel) vs DTensor's parallelize_module with
    ColwiseParallel/RowwiseParallel on a gloo CPU mesh, same weights: outputs and every gradient."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import tensor_parallel as tpm
    from common.distributed import Comm
    mesh = init_device_mesh('cpu', (world_size,))
    g = Comm(None, 'tp')
    errors = {}
    for sp in (False, True):
        torch.manual_seed(0)
        dense = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        ref = copy.deepcopy(dense)
        if sp:  # input and output sharded along the sequence (dim 1)
            plan = {'0': ColwiseParallel(input_layouts=Shard(1)), '2': RowwiseParallel(output_layouts=Shard(1))}
        else:
            plan = {'0': ColwiseParallel(), '2': RowwiseParallel()}
        parallelize_module(ref, mesh, plan)
        tp = tpm.TensorParallel(g, sp)
        cut = lambda t, kind: nn.Parameter(model_parallel.take_slice(t.detach(), kind, g).clone())
        col = tpm.ColumnParallelLinear(cut(dense[0].weight, 'col'), cut(dense[0].bias, 'col'))
        row = tpm.RowParallelLinear(cut(dense[2].weight, 'row'), cut(dense[2].bias, 'replicated'), tp)
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(3, 8, 16, generator=gen)
        if sp:
            x = x.tensor_split(world_size, dim=1)[rank]
        x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref = ref(x_ref)
        y_ours = row(F.gelu(col(tp.enter(x_ours))))
        w = torch.randn(y_ref.shape, generator=gen)
        (y_ref * w).sum().backward()
        (y_ours * w).sum().backward()
        tpm.sync_tp_grads({'bias': (row.bias, 'replicated')}, tp)  # SP: the bias saw only this rank's tokens
        errors[sp] = max(_rel_err(y_ours, y_ref), _rel_err(x_ours.grad, x_ref.grad),
                         _rel_err(col.weight.grad, ref[0].weight.grad.to_local()),
                         _rel_err(col.bias.grad, ref[0].bias.grad.to_local()),
                         _rel_err(row.weight.grad, ref[2].weight.grad.to_local()),
                         _rel_err(row.bias.grad, ref[2].bias.grad.full_tensor()))
    errors['vocab'] = _vocab_against_dtensor(rank, world_size, mesh, g)
    errors['attention'] = _attention_against_dtensor(rank, world_size, mesh, g)
    return errors


def _attention_against_dtensor(rank, world_size, mesh, g):
    """A grouped-query attention layer cut by shard_gpt (c_attn's 'qkv' slices: this rank's query heads and
    their key/value heads) against the plan torchtitan uses: separate q, k, v Linears ColwiseParallel, c_proj
    RowwiseParallel, each rank attending over its local heads. Output, input gradient and every weight's."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import tensor_parallel as tpm
    from model import GPT, GPTConfig
    config = GPTConfig(n_layer=1, n_head=8, n_kv_head=4, n_embd=32, block_size=8, vocab_size=16, bias=True)
    torch.manual_seed(0)
    ours_model = GPT(config)
    dense = copy.deepcopy(ours_model.transformer.h[0].attn)
    tp = tpm.TensorParallel(g, False)
    tpm.shard_gpt(ours_model, tp)
    ours = ours_model.transformer.h[0].attn
    q_n, kv_n, _ = model_parallel.qkv_split(config)
    ref = nn.ModuleDict({name: nn.Linear(32, n) for name, n in (('q', q_n), ('k', kv_n), ('v', kv_n))})
    ref['c_proj'] = copy.deepcopy(dense.c_proj)
    for (name, linear), part_w, part_b in zip(list(ref.items())[:3], dense.c_attn.weight.split([q_n, kv_n, kv_n]),
                                             dense.c_attn.bias.split([q_n, kv_n, kv_n])):
        linear.weight.data.copy_(part_w)
        linear.bias.data.copy_(part_b)
    parallelize_module(ref, mesh, {'q': ColwiseParallel(), 'k': ColwiseParallel(), 'v': ColwiseParallel(),
                                   'c_proj': RowwiseParallel()})
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 8, 32, generator=gen), torch.randn(2, 8, 32, generator=gen)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    heads = lambda t: t.view(2, 8, -1, 4).transpose(1, 2)  # (this rank's heads, head_dim 4)
    q, k, v = heads(ref['q'](x_ref)), heads(ref['k'](x_ref)), heads(ref['v'](x_ref))
    y = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    y_ref = ref['c_proj'](y.transpose(1, 2).reshape(2, 8, -1))
    y_ours = ours(tp.enter(x_ours))
    (y_ref * w).sum().backward()
    (y_ours * w).sum().backward()
    local = lambda name, kind: getattr(ref[name], kind).grad.to_local()
    return max(_rel_err(y_ours, y_ref), _rel_err(x_ours.grad, x_ref.grad),
               _rel_err(ours.c_attn.weight.grad, torch.cat([local(n, 'weight') for n in 'qkv'])),
               _rel_err(ours.c_attn.bias.grad, torch.cat([local(n, 'bias') for n in 'qkv'])),
               _rel_err(ours.c_proj.weight.grad, local('c_proj', 'weight')),
               _rel_err(ours.c_proj.bias.grad, ref['c_proj'].bias.grad.full_tensor()))


def _vocab_against_dtensor(rank, world_size, mesh, g):
    """The vocabulary-parallel embedding against DTensor's RowwiseParallel nn.Embedding (rows sharded, the
    lookups summed), and vocab_parallel_cross_entropy against DTensor's loss_parallel on logits sharded along
    the vocabulary: the embedding's output and weight gradient, the loss and the logits' gradient."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import RowwiseParallel, loss_parallel, parallelize_module
    import tensor_parallel as tpm
    V, n = 16, 16 // world_size  # (a vocabulary both cut into equal runs: DTensor's Shard and tensor_split agree)
    tp, start, gen = tpm.TensorParallel(g, False), rank * n, torch.Generator().manual_seed(3)
    torch.manual_seed(1)
    dense = nn.Embedding(V, 8)
    ref = parallelize_module(copy.deepcopy(dense), mesh, RowwiseParallel(input_layouts=Replicate(),
                                                                         output_layouts=Replicate()))
    ours = tpm.VocabParallelEmbedding(nn.Parameter(dense.weight.detach()[start:start + n].clone()), start, tp)
    idx, w = torch.randint(0, V, (3, 8), generator=gen), torch.randn(3, 8, 8, generator=gen)
    y_ref, y_ours = ref(idx), ours(idx)
    (y_ref * w).sum().backward()
    (y_ours * w).sum().backward()
    logits, targets = torch.randn(3, 8, V, generator=gen), torch.randint(0, V, (3, 8), generator=gen)
    mine = logits[..., start:start + n].clone().requires_grad_()
    loss = tpm.vocab_parallel_cross_entropy(mine, targets, start, tp)
    loss.backward()
    sharded = distribute_tensor(logits, mesh, [Shard(2)]).requires_grad_()
    with loss_parallel():
        loss_ref = F.cross_entropy(sharded.flatten(0, 1), targets.flatten())
        loss_ref.backward()
    return max(_rel_err(y_ours, y_ref), _rel_err(ours.weight.grad, ref.weight.grad.full_tensor()[start:start + n]),
               _rel_err(loss, loss_ref.full_tensor()), _rel_err(mine.grad, sharded.grad.to_local()))


def _dropout_checks(rank, world_size):
    """tp=2, dropout 0.5, the heads of rank 1 made identical to those of rank 0: each rank's attention output
    (before c_proj) and the block's output, which is replicated on the tp ranks, and the shared stream after."""
    import torch.distributed as dist
    import tensor_parallel as tpm
    from model import GPT, GPTConfig
    from common.distributed import Comm
    made = [dist.new_group(row.tolist()) for row in torch.arange(world_size).view(-1, 2)]
    tp = tpm.TensorParallel(Comm(made[rank // 2], 'tp'), False)
    config = GPTConfig(n_layer=1, n_head=4, n_embd=16, block_size=16, vocab_size=32, dropout=0.5, bias=False)
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():  # heads 2, 3 (rank 1's) = heads 0, 1 (rank 0's), in q, k and v and in c_proj
        w = model.transformer.h[0].attn.c_attn.weight.view(3, 4, 4, 16)
        w[:, 2:] = w[:, :2]
        model.transformer.h[0].attn.c_proj.weight.view(16, 4, 4)[:, 2:] = \
            model.transformer.h[0].attn.c_proj.weight.view(16, 4, 4)[:, :2]
    tpm.shard_gpt(model, tp)
    tpm.give_tp_ranks_their_dropout(model, tp)
    seen = {}
    block = model.transformer.h[0]
    block.attn.c_proj.register_forward_pre_hook(lambda m, args: seen.setdefault('attn', args[0].detach()))
    block.register_forward_hook(lambda m, args, out: seen.setdefault('block', out.detach()))
    torch.manual_seed(7)  # the tp ranks of a replica share the stream
    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(3))
    tpm.tp_forward(model.train(), idx, idx, tp)
    return seen['attn'].numpy(), seen['block'].numpy(), torch.rand(4).numpy()  # (tensors die with the process)


def _measuring_calls(rank, world_size, out_dir):
    """dp=2 x tp=2 with sequence parallelism, dropout and clipping: the calls of one step as main() runs it (inside
    tensor_parallel.measuring), unmeasured (iteration 1 of a run that started at 0), then measured (iteration 0).
    Counted: every collective handed to a Comm, every collective torch.distributed made, and every call that
    exists only to measure (barrier, all_gather_object, device synchronize, clock, saved-tensor hooks)."""
    from collections import Counter
    import torch.distributed as dist
    from common import distributed, model_parallel
    from common import measure
    from common.training import run_step
    import tensor_parallel as tpm
    from model import GPT, GPTConfig
    _, _, comms = model_parallel.process_grid(world_size, rank, dp=2, tp=2)
    tp, dp = tpm.TensorParallel(comms['tp'], True), comms['dp']
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(LAYOUTS['gpt2'], dropout=0.1)))
    layout = tpm.shard_gpt(model, tp)
    tpm.give_tp_ranks_their_dropout(model, tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = SimpleNamespace(measure_every=0, device='cpu', block_size=16, batch_size=2, dtype='float32',
                          sequence_parallel=True, gradient_accumulation_steps=4, out_dir=out_dir)
    step = lambda it: tpm.train_step(model, optimizer, batches, contextlib.nullcontext(), 1.0, tp, dp, layout)
    run = SimpleNamespace(kind='tensor_parallel', model=model, tp=tp, comms=[tp.group, dp], step=step)
    gen = torch.Generator().manual_seed(rank // 2)  # the tp ranks of a replica share its batches
    batches = [(torch.randint(0, 96, (2, 16), generator=gen), torch.randint(0, 96, (2, 16), generator=gen))
               for _ in range(2)]
    from helpers import counting_patches, measuring_calls
    calls = Counter()
    patches = counting_patches(calls, [
        (dist, 'all_reduce', 'dist collective'), (distributed, 'all_gather_single', 'dist collective'),
        (distributed, 'reduce_scatter_single', 'dist collective'),
        (measure, 'saved_bytes_counter', 'saved-tensor hooks')] + measuring_calls())
    seen = {}
    for iter_num in (1, 0):
        calls.clear()
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            run_step(run, cfg, iter_num, 0)  # as the loop runs a step: observed at iter 0, the run's first
        seen[iter_num] = dict(calls)
    return seen


def _all_checks(rank, world_size, out_dir):
    return (_against_dense(rank, world_size), _against_dtensor(rank, world_size), _dropout_checks(rank, world_size),
            _measuring_calls(rank, world_size, out_dir))


@pytest.fixture(scope='module')
def spawned(tmp_path_factory):
    """One spawn of 4 gloo processes runs every in-process check (the start-up is the slow part)."""
    return spawn(_all_checks, 4, str(tmp_path_factory.mktemp('measured')))


def test_an_unmeasured_step_makes_no_measuring_call(spawned):
    """Measuring off the hot path: a step that measured_step does not name runs no barrier, all_gather_object,
    synchronize, clock or saved-tensor hook, and no collective but the algorithm's, each through its Comm: per
    micro-batch SP's all-gathers and reduce-scatters and the vocabulary-parallel loss's all-reduces, then the
    replicated gradients' all-reduce over tp, the gradients' over dp, the clip's and the loss's scalars. The
    measured step makes those measuring calls (so the patches do see them)."""
    for rank, (*_, seen) in enumerate(spawned):
        unmeasured, measured = seen[1], seen[0]
        comm_calls = sum(n for k, n in unmeasured.items() if k.startswith('comm '))
        assert unmeasured.get('dist collective') == comm_calls, (rank, unmeasured)
        assert {k for k in unmeasured if k.startswith('comm ')} == {
            'comm tp all_gather', 'comm tp reduce_scatter', 'comm tp all_reduce', 'comm tp grad_all_reduce',
            'comm tp scalars', 'comm dp all_reduce', 'comm dp scalars'}, (rank, unmeasured)
        assert set(unmeasured) == {k for k in unmeasured if k.startswith('comm ')} | {'dist collective'}, \
            (rank, unmeasured)
        assert measured['barrier'] >= 2 and measured['all_gather_object'] >= 1, (rank, measured)
        assert measured['saved-tensor hooks'] == 1, (rank, measured)


@pytest.mark.parametrize('layout', list(LAYOUTS) + list(MOE))
@pytest.mark.parametrize('t', [1, 2, 4])
@pytest.mark.parametrize('sp', [False, True])
def test_logits_loss_and_every_gradient_equal_the_dense_model(spawned, layout, t, sp):
    for rank, (dense, *_) in enumerate(spawned):
        r = dense[(layout, t, sp)]
        assert r['covered'], "the shard layout must cover every dense parameter"
        assert r['logits_err'] < TOL and r['loss_err'] < TOL and r['grad_err'] < TOL, (rank, r)
        assert r['norm_err'] < TOL, (rank, r)  # the clip's global norm: the dense model's


def test_a_sharded_model_refuses_the_dense_forward():
    """After shard_gpt, GPT.forward would give a loss over this rank's slice of the vocabulary: it raises."""
    import tensor_parallel as tpm
    from model import GPT, GPTConfig
    from common.distributed import Comm
    model = GPT(GPTConfig(**LAYOUTS['gpt2']))
    tpm.shard_gpt(model, tpm.TensorParallel(Comm(None, 'tp')))
    with pytest.raises(RuntimeError, match='tp_forward'):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_tp_layers_equal_dtensor_colwise_rowwise_and_loss_parallel(spawned):
    for rank, (_, errors, *_) in enumerate(spawned):
        assert errors[False] < TOL, f"plain TP vs DTensor, rank {rank}: {errors[False]}"
        assert errors[True] < TOL, f"sequence parallel vs DTensor (Shard(1)), rank {rank}: {errors[True]}"
        assert errors['vocab'] < TOL, f"vocabulary-parallel embedding and loss vs DTensor, rank {rank}"
        assert errors['attention'] < TOL, f"grouped-query attention's head split vs DTensor, rank {rank}"


def test_measured_bytes_against_the_formulas(spawned):
    for rank, (dense, *_) in enumerate(spawned):
        for (layout, t, sp), r in dense.items():
            # parameters: 1/t of the split layers (the uneven vocabulary split is off by under one row per table),
            # n_expert/t whole experts
            assert abs(r['param_bytes'] - r['param_bytes_formula']) <= 2 * r['n_embd'] * 4, (layout, t, r)
            if layout in MOE:
                continue  # (what a MoE layer sends and saves follows its router)
            # bytes sent, counted at the calls: exactly 2 all-reduces per block forward and 2 backward (or their
            # all-gather + reduce-scatter), plus the embedding, head and cross-entropy
            assert r['comm'] == pytest.approx(r['comm_formula']), (layout, t, sp, r)
            if t == 1:
                assert r['comm'] == 0 and r['param_bytes'] == r['dense_param_bytes'] == r['param_bytes_formula']
        for layout in LAYOUTS:
            dense_act = dense[(layout, 1, False)]['activation_bytes']
            for t in (2, 4):
                tp_act = dense[(layout, t, False)]['activation_bytes']
                sp_act = dense[(layout, t, True)]['activation_bytes']
                assert sp_act < tp_act < dense_act, (layout, t, dense_act, tp_act, sp_act)
            assert dense[(layout, 4, True)]['activation_bytes'] < dense[(layout, 2, True)]['activation_bytes']
        # what one block saves for backward, measured by saved_tensors_hooks, against the count read off the code
        for key, r in [(key, r) for key, r in dense.items() if key[0] in LAYOUTS]:
            assert r['activation_bytes'] == r['activation_bytes_formula'], (key, r)


# --- the script itself: loss curves, resume, consolidation, errors ---------------------------------------------

FLAGS = TINY + ['--gradient_accumulation_steps=2', '--log_interval=1', '--eval_interval=2', '--max_iters=4']


def test_dropout_masks_differ_per_rank_in_the_tp_region_and_agree_outside_it(spawned):
    """Megatron's RNG: the tp ranks hold identical heads here, yet their attention outputs differ (each rank's
    heads draw their own masks); the block's output, replicated on the tp ranks, is the same on both, and so is
    the shared stream afterwards."""
    for pair in ((0, 1), (2, 3)):
        (attn0, block0, rand0), (attn1, block1, rand1) = (spawned[r][2] for r in pair)
        assert not np.allclose(attn0, attn1), "the tp ranks drew the same attention-dropout masks"
        assert np.array_equal(block0, block1) and np.array_equal(rand0, rand1)


def test_dp_x_tp_resume_and_consolidate_match_train_py(tmp_path, tmp_path_factory):
    tp_dir, full = tmp_path / 'tp', tmp_path / 'full'
    want = train_losses(train_py_reference(FLAGS, tmp_path_factory))
    # dp=2 x tp=2: the first 2 iterations, one checkpoint per rank; consolidated offline into a train.py ckpt.pt
    proc = check(run_script('tensor_parallel.py', FLAGS + ['--tp=2', '--max_iters=2', f'--out_dir={tp_dir}'], nproc=4))
    assert 'wire bytes, rank 3' in proc.stdout and 'reduce-scatter' not in proc.stdout  # no SP: no SP note
    consolidate(str(tp_dir))
    full.mkdir()
    shutil.move(str(tp_dir / 'ckpt.pt'), str(full / 'ckpt.pt'))
    shutil.copy(tp_dir / 'log.jsonl', full / 'log.jsonl')
    # resume the tp run to iter 4, and continue the consolidated checkpoint in train.py
    check(run_script('tensor_parallel.py', FLAGS + ['--tp=2', '--init_from=resume', f'--out_dir={tp_dir}'], nproc=4))
    run_train_py_here(FLAGS + ['--init_from=resume', f'--out_dir={full}'])
    assert_same_losses(train_losses(tp_dir), want, range(4))
    assert_same_losses(train_losses(full), want, range(4))  # 0-1 from the tp run, 2-3 from train.py
    rows = [r for r in read_log(tp_dir) if 'rank' in r]
    assert sorted(r['rank'] for r in rows if r['iter'] == 0) == [0, 1, 2, 3]
    for r in rows:
        assert (r['tp'], r['dp']) == (2, 2)
        assert r['tp_activation_wire_bytes_formula'] == pytest.approx(r['tp_comm_bytes_formula'])
        assert r['param_bytes'] == pytest.approx(r['param_bytes_formula'])
        assert r['dp_grad_wire_bytes_formula'] == pytest.approx(r['dp_grad_bytes_formula'])
        assert r['activation_bytes'] == r['activation_bytes_formula'] > 0


def test_measured_wire_bytes_are_what_gloo_sends(tmp_path):
    """Sequence parallelism on 2 ranks, activations of 0.5 MB (so TCP's headers are noise): the loopback
    interface's counter against what gloo sends for the calls counted. gloo's reduce-scatter is an all-reduce,
    so SP's all-gather + reduce-scatter pair puts 3(t-1)/t of the tensor on the wire where the ring formula
    says 2(t-1)/t."""
    with LoopbackFlood() as flood:  # other traffic on the machine: each rank counts only its own sockets
        proc = check(run_script('tensor_parallel.py', TINY + [
            '--n_embd=256', '--block_size=64', '--batch_size=8', '--tp=2', '--sequence_parallel=True', '--max_iters=1',
            '--eval_interval=1', f'--out_dir={tmp_path}'], nproc=2))
    assert flood.sent > 0
    assert "gloo's reduce-scatter (sequence parallelism's) is an all-reduce" in proc.stdout, proc.stdout[-3000:]
    n = 2
    for r in [r for r in read_log(tmp_path) if 'rank' in r]:
        gloo = sum(v * ((n - 1) / n if k.endswith('all_gather') else 2 * (n - 1) / n)
                   for k, v in r['collective_bytes_by_kind'].items())
        assert 0.99 * gloo <= r['wire_bytes'] <= 1.05 * gloo + 16384, (r['wire_bytes'], gloo)
        assert r['wire_bytes'] > 1.4 * r['wire_bytes_formula'], (r['wire_bytes'], r['wire_bytes_formula'])


def _cfg(**over):
    base = dict(tp=2, gradient_accumulation_steps=2, n_head=4, n_kv_head=None, sequence_parallel=False,
                block_size=16, dtype='float32', compile=False, init_from='scratch', out_dir='out', n_expert=0)
    return SimpleNamespace(**dict(base, **over))


@pytest.mark.parametrize('over, world, message', [
    (dict(tp=4), 2, 'world size 2 is not divisible by tp=4: start a multiple of 4 processes'),
    (dict(tp=2, gradient_accumulation_steps=1), 4, 'divisible by the data-parallel size dp=2'),
    (dict(tp=4, n_head=8, n_kv_head=2), 4, 'n_kv_head (2) must both be divisible by tp=4'),
    (dict(tp=4, n_head=6), 4, 'n_head (6)'),
    (dict(tp=4, sequence_parallel=True, block_size=18), 4, 'block_size (18) divisible by tp=4'),
    (dict(dtype='float16'), 2, 'float32 or bfloat16'),
    (dict(init_from='resume', out_dir='/nonexistent'), 2, 'no checkpoint at'),
    (dict(compile=True), 2, 'not supported by tensor_parallel.py: pass --compile=False'),
    (dict(tp=4, n_expert=6), 4, 'n_expert (6) must be divisible by tp=4'),
])
def test_bad_config_is_one_clear_error(over, world, message):
    refusals = refusals_of('tensor_parallel')
    with pytest.raises(SystemExit) as e:
        refusals(_cfg(**over), world)
    assert isinstance(e.value.code, str) and e.value.code.startswith('error: ') and message in e.value.code
    refusals(_cfg(), 2)  # and the good one passes


@pytest.mark.parametrize('saved_tp, saved_world', [(1, 2), (2, 4)])
def test_resume_with_another_tp_or_world_says_what_to_do(tmp_path, saved_tp, saved_world):
    """Rank checkpoints saved with another tp or world size: one line naming the saved ones and consolidate.py,
    before any work (the check reads rank 0's file), instead of a load_state_dict traceback."""
    import tensor_parallel as tpm
    for r in range(saved_world):  # the keys tensor_parallel.py saves that say how the model was cut
        torch.save({'grid': {'tp': saved_tp, 'ranks': saved_world}, 'config': {}, 'iter_num': 2},
                   os.path.join(tmp_path, tpm.RANK_FILE.format(r)))
    with pytest.raises(SystemExit) as e:
        refusals_of('tensor_parallel')(_cfg(tp=2, init_from='resume', out_dir=str(tmp_path)), 2)
    assert e.value.code.startswith(f"error: init_from=resume: {os.path.join(tmp_path, tpm.RANK_FILE.format(0))} was saved with "
                                   f"--tp={saved_tp} on {saved_world} ranks, this run has --tp=2 on 2 ranks"), \
        e.value.code
    assert f'python consolidate.py {tmp_path}' in e.value.code


def test_heads_not_divisible_exits_on_every_rank(tmp_path):
    proc = run_script('tensor_parallel.py', TINY + ['--tp=2', '--n_kv_head=1', f'--out_dir={tmp_path}'], nproc=2,
                      timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith('[rank ') and '] error: n_head' in line]
    assert sorted(line.split(']')[0] for line in lines) == ['[rank 0', '[rank 1'], proc.stderr[-2000:]
    assert 'tensor_parallel.py", line' not in proc.stderr  # no traceback from the script
