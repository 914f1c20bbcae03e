"""context_parallel.py: ring attention and Ulysses, each on cp = 2 and 4 ranks, equal dense causal attention (its
output and the gradients of q, k, v) and the whole model (loss and every gradient) with learned positions and with
RoPE + grouped-query attention; the bytes they hand to the ring or the all-to-alls are the formula's (fp32 and
bf16), and each rank's own wire bytes are what gloo sends for them; an unmeasured step makes no measuring call;
the script trains train.py's curve for cp=2 and dp=2 x cp=2, resumes exactly, and rejects bad input on every rank.

Against PyTorch's own ring attention: torch.distributed.tensor.experimental.context_parallel itself does not run
on a CPU ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered", torch 2.13), so the comparison calls the ring underneath it (_templated_ring_attention and its
backward, a private API) with the CPU's flash-attention kernel: its load-balanced layout is our zigzag."""
import contextlib
import copy
from unittest import mock

import pytest
import torch

from helpers import (LoopbackFlood, TINY, assert_config_error, assert_same_losses, check, eval_losses,
                     measured_rows, one_error_line_per_rank, read_log, run_script, run_train_py_here, spawn, stdlib_vocab, train_losses,
                     train_py_reference)

import context_parallel
from common import formulas
from common.config import configure, model_config

TOL = 1e-5
LAYOUTS = {
    'gpt2': dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=40, bias=True),
    'llama': dict(n_layer=2, n_head=8, n_kv_head=4, n_embd=32, block_size=16, vocab_size=40, bias=False,
                  pos='rope', norm='rmsnorm', mlp='swiglu', tie_embeddings=False),
}


def _rel_err(a, b):
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


def _against_torchs_ring(rank, world_size):
    """Our RingAttention (forward, and backward with a weighted loss) and torch's ring on the same zigzag shards,
    for cp = 2 (ranks {0, 1} and {2, 3}) and cp = 4: the largest relative difference over out, dq, dk, dv."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp
    import context_parallel as cpm
    from common.distributed import Comm
    aten = torch.ops.aten
    assert torch_cp._cp_options.enable_load_balance  # torch's head-tail shards: chunks i and 2cp-1-i, our zigzag
    groups = {2: dist.new_group([0, 1]), 4: None}, {2: dist.new_group([2, 3]), 4: None}
    errors = {}
    for C in (2, 4):
        group = groups[rank // 2][C] if C == 2 else dist.group.WORLD
        cp = cpm.ContextParallel(Comm(None if C == 4 else group, 'cp'), 'ring')
        cp.positions = pos = cpm.zigzag_positions(16, C, cp.group.rank)
        q, k, v, dout = (t[:, :, pos].contiguous() for t in torch.randn(4, 2, 4, 16, 8,
                                                                          generator=torch.Generator().manual_seed(0)))
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        ours = cpm.RingAttention.apply(*mine, cp)
        ours.backward(dout)
        out, lse = torch_cp._templated_ring_attention(group, 2, aten._scaled_dot_product_flash_attention_for_cpu,
                                                      q, k, v, is_causal=True)[:2]
        grads = torch_cp._templated_ring_attention_backward(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=dout,
            grad_out_name='grad_out', query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=True,
            dropout_p=0.0)[:3]
        errors[C] = max(_rel_err(ours, out), *(_rel_err(t.grad, g) for t, g in zip(mine, grads)))
    return errors


def test_ring_attention_equals_torchs_ring():
    """Forward and backward, cp = 2 and 4, to 1e-5 (3e-7 here): the same merge of partial softmaxes by their
    log-sum-exp, the same gradients. It skips only if torch moves the private module; a torch that changes the
    private functions' arguments or options fails it on purpose, so that the comparison is updated, not lost."""
    pytest.importorskip('torch.distributed.tensor.experimental._context_parallel._attention',
                        reason="torch moved its private ring attention: update this comparison")
    for rank, errors in enumerate(spawn(_against_torchs_ring, 4)):
        assert all(e < TOL for e in errors.values()), (rank, errors)


def _checks(rank, world_size):
    """For cp = 2 (ranks {0, 1} and {2, 3}) and cp = 4, ring and Ulysses: one attention call and the whole model,
    against the dense computation on the same inputs."""
    import torch.distributed as dist
    import torch.nn.functional as F
    import context_parallel as cpm
    from model import GPT, GPTConfig
    from common.distributed import Comm
    from common.model_parallel import average_gradients
    groups = {2: [dist.new_group(r.tolist()) for r in torch.arange(4).view(2, 2)], 4: [None]}
    results = {}
    for C in (2, 4):
        comm = Comm(groups[C][rank // C], 'cp')
        for attention in ('ring', 'ulysses'):
            cp = cpm.ContextParallel(comm, attention)
            # one attention call: 8 query heads, 4 kv heads, 16 tokens
            gen = torch.Generator().manual_seed(0)
            q, k, v = torch.randn(2, 8, 16, 4, generator=gen), *torch.randn(2, 2, 4, 16, 4, generator=gen)
            w = torch.randn(2, 8, 16, 4, generator=gen)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                 is_causal=True)
            (ref * w).sum().backward()
            cp.positions = pos = cpm.zigzag_positions(16, C, comm.rank)
            local = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
            attend = cpm.RingAttention.apply if attention == 'ring' else cpm.ulysses_attention
            out = attend(*local, cp)
            (out * w[:, :, pos]).sum().backward()
            attn_err = max(_rel_err(out, ref[:, :, pos]),
                           *(_rel_err(mine.grad, full.grad[:, :, pos]) for mine, full in zip(local, (q, k, v))))
            # the whole model
            for name, layout in LAYOUTS.items():
                config = GPTConfig(**layout)
                torch.manual_seed(0)
                dense = GPT(config)
                gen = torch.Generator().manual_seed(1)
                x, y = torch.randint(0, 40, (2, 16), generator=gen), torch.randint(0, 40, (2, 16), generator=gen)
                _, dense_loss = dense(x, y)
                dense_loss.backward()
                model = copy.deepcopy(dense)
                model.zero_grad(set_to_none=True)
                cpm.shard_sequence(model, cp)
                comm.clear()
                _, loss = cpm.cp_forward(model, x, y, cp)
                loss.backward()
                sent = sum(v for kind, v in comm.wire_bytes_formula.items() if kind in ('kv', 'dkv', 'all_to_all', 'all_to_all backward'))
                average_gradients(model.parameters(), comm)
                mean_loss = loss.detach().clone()
                comm.all_reduce(mean_loss)
                results[(C, attention, name)] = dict(
                    attn_err=attn_err, loss_err=_rel_err(mean_loss / C, dense_loss.detach()),
                    grad_err=max(_rel_err(a.grad, b.grad) for a, b in zip(model.parameters(), dense.parameters())),
                    sent=sent, sent_formula=config.n_layer * formulas.cp_comm_bytes_formula(
                        16, 2, config.n_head, config.n_kv_head, config.n_embd // config.n_head, C, attention))
    results.update(_measuring_calls(groups[2][rank // 2]))
    return results


def _measuring_calls(group):
    """dp=2 x cp=2: one unmeasured train_step (what main runs on every step but the measured ones) and one
    measured_train_step, each with dist.barrier, torch.cuda.synchronize, time.perf_counter and
    dist.all_gather_object patched to record their calls, and the raw collectives counted."""
    import tempfile
    import time
    from types import SimpleNamespace
    import torch.distributed as dist
    import context_parallel as cpm
    from model import GPT, GPTConfig
    from common.distributed import Comm
    from common.training import run_step
    out = {}
    for attention in ('ring', 'ulysses'):
        cp, dp_cp = cpm.ContextParallel(Comm(group, 'cp'), attention), Comm(None, 'dp_cp')
        torch.manual_seed(0)
        model = GPT(GPTConfig(**LAYOUTS['gpt2']))
        cpm.shard_sequence(model, cp)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(dist.get_rank())
        batches = [(torch.randint(0, 40, (2, 16), generator=gen), torch.randint(0, 40, (2, 16), generator=gen))]
        cfg = SimpleNamespace(block_size=16, batch_size=2, dtype='float32', gradient_accumulation_steps=2,
                              grad_clip=1.0, out_dir=tempfile.mkdtemp(), measure_every=0)
        for measured in (False, True):
            calls = {}

            def recording(name, fn=None):
                def call(*args, **kwargs):
                    calls[name] = calls.get(name, 0) + 1
                    return fn(*args, **kwargs) if fn else None
                return call
            with mock.patch.object(dist, 'barrier', recording('barrier', dist.barrier)), \
                    mock.patch.object(torch.cuda, 'synchronize', recording('synchronize')), \
                    mock.patch.object(time, 'perf_counter', recording('perf_counter', time.perf_counter)), \
                    mock.patch.object(dist, 'all_gather_object', recording('all_gather_object',
                                                                           dist.all_gather_object)), \
                    mock.patch.object(dist, 'all_reduce', recording('all_reduce', dist.all_reduce)), \
                    mock.patch.object(dist, 'all_to_all_single', recording('all_to_all_single',
                                                                           dist.all_to_all_single)), \
                    mock.patch.object(dist, 'batch_isend_irecv', recording('batch_isend_irecv',
                                                                           dist.batch_isend_irecv)):
                cp.group.clear(), dp_cp.clear()
                step = lambda it: cpm.train_step(model, optimizer, batches, contextlib.nullcontext(), 1.0, cp, dp_cp)
                run = SimpleNamespace(kind='context_parallel', model=model, cp=cp, comms=[cp.group, dp_cp], step=step)
                run_step(run, cfg, 0 if measured else 1, 0)  # as the loop runs it: observed at iter 0, the first
            out[('calls', attention, measured)] = dict(calls, kinds=sorted(cp.group.collective_bytes)
                                                       + sorted(dp_cp.collective_bytes))
    return out


@pytest.fixture(scope='module')
def spawned():
    """One spawn of 4 gloo processes runs every in-process check."""
    return spawn(_checks, 4)


@pytest.mark.parametrize('C', [2, 4])
@pytest.mark.parametrize('attention', ['ring', 'ulysses'])
@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_equals_dense_attention_and_model(spawned, C, attention, layout):
    for rank, results in enumerate(spawned):
        r = results[(C, attention, layout)]
        assert r['attn_err'] < TOL, (rank, r)  # the attention's output and the gradients of q, k and v
        assert r['loss_err'] < TOL and r['grad_err'] < TOL, (rank, r)  # the loss and every parameter's gradient
        assert r['sent'] == pytest.approx(r['sent_formula']) and r['sent'] > 0, (rank, r)  # counted calls


def test_an_unmeasured_step_makes_no_measuring_call(spawned):
    """Measuring is off the hot path: a step that is not measured runs no barrier, device synchronize, timer or
    all_gather_object, and no collective but the algorithm's (per layer, ring: 1 kv exchange forward, 1 kv and
    2 dkv backward; Ulysses: 4 all-to-alls forward, 4 backward; then the gradients' and the loss's
    all-reduces). The measured step does measure (the patches see it)."""
    n_layer = LAYOUTS['gpt2']['n_layer']
    algorithm = {'ring': {'batch_isend_irecv': n_layer * 4, 'all_reduce': 2},
                 'ulysses': {'all_to_all_single': n_layer * 8, 'all_reduce': 2}}
    kinds = {'ring': ['dkv', 'kv', 'all_reduce', 'scalars'], 'ulysses': ['all_to_all', 'all_to_all backward', 'all_reduce', 'scalars']}
    for rank, results in enumerate(spawned):
        for attention in ('ring', 'ulysses'):
            unmeasured = results[('calls', attention, False)]
            assert unmeasured == dict(algorithm[attention], kinds=kinds[attention]), (rank, attention, unmeasured)
            measured = results[('calls', attention, True)]
            assert measured['barrier'] >= 2 and measured['perf_counter'] > 0, (rank, attention, measured)
            assert measured['all_gather_object'] == 1, (rank, attention, measured)


# --- the script -------------------------------------------------------------------------------------------------

FLAGS = TINY + ['--gradient_accumulation_steps=2', '--log_interval=1', '--eval_interval=2', '--max_iters=4',
                '--learning_rate=1e-2', '--warmup_iters=1']
LLAMA = ['--n_embd=32', '--n_head=4', '--n_kv_head=2', '--norm=rmsnorm', '--mlp=swiglu', '--pos=rope',
         '--tie_embeddings=False']


def test_ring_and_ulysses_cp2_train_train_py_curve_and_measure_their_own_bytes(tmp_path, tmp_path_factory):
    ref = train_py_reference(FLAGS + LLAMA, tmp_path_factory)
    ring, ulysses = tmp_path / 'ring', tmp_path / 'ulysses'
    with LoopbackFlood():  # other traffic on the machine: each rank's wire bytes must still be its own
        check(run_script('context_parallel.py', FLAGS + LLAMA + ['--cp=2', '--measure_every=2', f'--out_dir={ring}'],
                         nproc=2))
        check(run_script('context_parallel.py', FLAGS + LLAMA + ['--cp=2', '--cp_attention=ulysses',
                                                                 f'--out_dir={ulysses}'], nproc=2))
    for out in (ring, ulysses):
        assert_same_losses(train_losses(out), train_losses(ref), range(4))
        assert_same_losses(eval_losses(out), eval_losses(ref), [0, 2, 4])
    llama = model_config(configure(context_parallel.config, FLAGS + LLAMA), stdlib_vocab())  # the runs' model
    for out, attention in ((ring, 'ring'), (ulysses, 'ulysses')):
        rows = [r for r in read_log(out) if 'rank' in r]
        # measured: the first step, and (ring: --measure_every=2) every 2nd; each rank's own row
        assert sorted((r['iter'], r['rank']) for r in rows) == ([(0, 0), (0, 1), (2, 0), (2, 1)]
                                                                if attention == 'ring' else [(0, 0), (0, 1)])
        for r in rows:
            assert r['cp_attention'] == attention
            assert r['cp_attention_bytes'] == pytest.approx(r['cp_attention_bytes_formula'])
            # each rank keeps 1/cp of the sequence: its block saves what a block of s/cp tokens saves (this
            # repo's count, read off model.py: 91,392 bytes here, the whole sequence's 182,784), and the
            # attention's own extras (the ring's log-sum-exp and k, v widened for GQA; Ulysses' all-to-all
            # outputs): 4.8% and 6.7% more here
            chunk = formulas.saved_bytes_formula(llama, 16 // 2, 4)
            assert chunk <= r['activation_bytes'] <= 1.1 * chunk, (r['activation_bytes'], chunk)
            assert r['activation_bytes_formula'] == chunk and r['activation_bytes_korthikanti'] > 0, r
            assert r['attention_compute_s'] > 0 and r['attention_wait_s'] > 0
            # this rank's own sockets: what its calls hand gloo (ring all-reduces, sends, all-to-alls), plus the
            # messages' headers and the meter's closing barrier; the flood is not in it
            assert 0.99 * r['wire_bytes_formula'] <= r['wire_bytes'] <= 1.05 * r['wire_bytes_formula'] + 16384, r


def test_resume_is_exact_and_train_py_continues(tmp_path, tmp_path_factory):
    """cp=2 for 2 iterations, resumed to 4: train.py's curve; train.py continues from the same checkpoint too."""
    ref = train_py_reference(FLAGS, tmp_path_factory)
    split = tmp_path / 'split'
    check(run_script('context_parallel.py', FLAGS + ['--cp=2', '--max_iters=2', f'--out_dir={split}'], nproc=2))
    copy_dir = tmp_path / 'train_py'
    copy_dir.mkdir()
    for name in ('ckpt.pt', 'log.jsonl'):
        (copy_dir / name).write_bytes((split / name).read_bytes())
    check(run_script('context_parallel.py', FLAGS + ['--cp=2', '--init_from=resume', f'--out_dir={split}'], nproc=2))
    run_train_py_here(FLAGS + ['--init_from=resume', f'--out_dir={copy_dir}'])
    assert_same_losses(train_losses(split), train_losses(ref), range(4))
    assert_same_losses(train_losses(copy_dir), train_losses(ref), range(4))


BAD = [
    (2, ['--cp=3'], 'world size 2 is not divisible by cp=3'),
    (2, ['--cp=2', '--block_size=18'], 'block_size (18) must be divisible by 2 x cp = 4'),
    (4, ['--cp=4', '--cp_attention=ulysses', '--n_head=4', '--n_kv_head=2'], 'n_kv_head (2) divisible by cp=4'),
    (2, ['--cp=2', '--cp_attention=stripes'], "--cp_attention=stripes is not one of ring, ulysses"),
    (2, ['--cp=2', '--dropout=0.1'], 'needs dropout=0.0'),
    (2, ['--cp=2', '--compile=True'], 'not supported by context_parallel.py: pass --compile=False'),
]


@pytest.mark.parametrize('world,args,message', BAD, ids=['world', 'chunks', 'heads', 'kind', 'dropout', 'compile'])
def test_bad_config_is_one_clear_error(monkeypatch, tmp_path, world, args, message):
    import context_parallel
    assert_config_error(context_parallel.main, TINY + [f'--out_dir={tmp_path}'] + args, world, message, monkeypatch)


@pytest.mark.parametrize('args,key', [(['--block_size=18'], 'block_size (18)'),
                                      (['--cp_attention=foo'], '--cp_attention=foo is not one of ring, ulysses')],
                         ids=['chunks', 'attention'])
def test_bad_config_exits_on_every_rank(tmp_path, args, key):
    """One line per rank (its own: torchrun's summary may quote it again, indented), a non-zero exit, nothing run
    (--cp_attention=foo used to run Ulysses)."""
    proc = run_script('context_parallel.py', TINY + [f'--out_dir={tmp_path}', '--cp=2'] + args, nproc=2, timeout=60)
    # (a rank still importing torch when the other has refused is stopped by torchrun: the helper allows that)
    one_error_line_per_rank(proc, key, 'context_parallel.py')
    assert not (tmp_path / 'log.jsonl').exists()


def test_the_attentions_bytes_leave_out_a_mixture_of_experts_routing(tmp_path):
    """With a mixture of experts the cp group also carries the routing (tokens per expert summed; with a
    capacity factor every rank's slots gathered): the report's bytes of the attention are still the ring's
    formula alone (they had included the routing's), and the routing is in the group's total."""
    check(run_script('context_parallel.py', TINY + ['--cp=2', '--n_expert=4', '--n_expert_active=2',
                                                    '--capacity_factor=1.0', '--max_iters=1', '--eval_interval=100',
                                                    f'--out_dir={tmp_path}'], nproc=2))
    for r in measured_rows(tmp_path, 2):
        routing = r['collective_bytes_by_kind']['cp routing']
        assert r['cp_attention_bytes'] == r['cp_attention_bytes_formula'] > 0 and routing > 0, r
        assert r['activation_bytes'] > 0 and r['activation_bytes_formula'] is None, r  # (block 0: an MoE's)


def test_bf16_formula_is_what_ring_and_ulysses_send(tmp_path):
    """Under bf16 autocast the ring's keys and values travel in bf16 and their gradients (dK, dV, accumulated in
    fp32) in fp32; Ulysses' q, k, v, output and their gradients all in bf16. The bytes the Comm counted in a
    real cp=2 run are the formula's with bytes_per_elem=2 (not its all-fp32 count)."""
    L, s, b, cp = 2, 16, 4, 2
    for attention in ('ring', 'ulysses'):
        out = tmp_path / attention
        check(run_script('context_parallel.py', TINY + LLAMA + [
            '--dtype=bfloat16', '--cp=2', f'--cp_attention={attention}', '--max_iters=1', '--eval_interval=100',
            '--gradient_accumulation_steps=1', '--always_save_checkpoint=False', f'--out_dir={out}'], nproc=2))
        rows = [r for r in read_log(out) if 'rank' in r]
        assert len(rows) == 2
        args = (s, b, 4, 2, 8, cp, attention)  # LLAMA: 4 heads, 2 kv heads of 32 / 4 = 8
        formula = L * formulas.cp_comm_bytes_formula(*args, bytes_per_elem=2)
        for r in rows:
            assert r['cp_attention_bytes'] == formula == r['cp_attention_bytes_formula'], (r, formula)
            if attention == 'ring':  # by kind: a kv block is 2 x 32 tokens x 2 heads x 8 = 1024 elements
                kinds = r['collective_bytes_by_kind']
                assert kinds['cp kv'] == L * 2 * (cp - 1) * 1024 * 2 and kinds['cp dkv'] == L * cp * 1024 * 4, r
        assert formula != L * formulas.cp_comm_bytes_formula(*args, bytes_per_elem=4)
