"""pipeline.py: GPipe, 1F1B and interleaved 1F1B by hand equal the sequential model, torch.distributed.pipelining's
schedules and train.py's loss curve; dp x pp equals one process; stage checkpoints resume and consolidate exactly; bad
configs are one line and a non-zero exit on every rank."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from consolidate import consolidate
from helpers import (LoopbackFlood, TINY, assert_config_error, assert_same_losses, check, eval_losses,
                     measured_rows, one_error_line_per_rank, read_log, run_script, run_train_py_here, spawn,
                     train_losses, stdlib_vocab, train_py_reference)

from common import formulas
from common.model_parallel import embed_comm

LAYOUTS = {
    'gpt2': dict(),  # tied embeddings: the first stage's wte and the last stage's lm_head are kept equal
    'llama': dict(norm='rmsnorm', mlp='swiglu', pos='rope', n_kv_head=2, tie_embeddings=False),
}
CASES = [(p, s, layout) for p in (2, 4) for s in ('gpipe', '1f1b', 'zb1') for layout in LAYOUTS] + [
    (2, 'interleaved', layout) for layout in LAYOUTS]  # 2 chunks of 1 layer per stage
V = {'gpipe': 1, '1f1b': 1, 'zb1': 1, 'interleaved': 2}  # chunks per stage
M = 4  # microbatches in the in-process checks (8 sequences: 2 per microbatch)


def _rel_err(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


class _TorchStageModule(torch.nn.Module):
    """This stage's part of the GPT as a module for torch.distributed.pipelining.PipelineStage: the last stage
    returns the logits (the schedule's loss_fn takes the loss)."""

    def __init__(self, model, layers, first, last):
        super().__init__()
        self.layers, self.first, self.last = list(layers), first, last
        # the GPT is not a submodule: only the parts this stage runs are, so that two chunks of one rank do not
        # both claim every parameter (torch's schedule scales each stage's gradients once)
        self.__dict__['model'] = model
        parts = [model.transformer.h[i] for i in self.layers]
        if first:
            parts += [m for m in (model.transformer.wte, model.transformer.wpe) if m is not None]
        if last:
            parts += [model.transformer.ln_f, model.lm_head]
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x):
        h = self.model.embed(x) if self.first else x
        for i in self.layers:
            h = self.model.transformer.h[i](h)
        return self.model.lm_head(self.model.transformer.ln_f(h)) if self.last else h


def _sync_tied(model, st, embed_group):
    if embed_group is not None:
        g = model.transformer.wte.weight.grad if st.is_first else model.lm_head.weight.grad
        dist.all_reduce(g, group=embed_group)


def _one_case(rank, world_size, p, schedule, layout):
    """One step of pipeline.py's schedule and of PyTorch's schedule of the same name, each against the
    sequential model's loss and gradients, plus the executed order's checks."""
    import pipeline
    from model import GPT, GPTConfig
    from common.model_parallel import process_grid
    from common.measure import ScheduleClock
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)
    config = GPTConfig(block_size=16, vocab_size=32, n_layer=4, n_head=4, n_embd=16, dropout=0.0, bias=False,
                       **LAYOUTS[layout])
    torch.manual_seed(1337)
    full = GPT(config)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 32, (8, 16), generator=g), torch.randint(0, 32, (8, 16), generator=g)
    ref = copy.deepcopy(full)
    ref_loss = ref(x, y)[1]
    ref_loss.backward()
    ref_grads = {n: p_.grad for n, p_ in ref.named_parameters()}
    ref_grads['lm_head.weight'] = ref.lm_head.weight.grad  # the tied weight under its second name too

    grid, coords, comms = process_grid(world_size, rank, dp=world_size // p, pp=p)
    dp_rank, stage = coords['dp'], coords['pp']
    embed = embed_comm(grid, rank, config.tie_embeddings)
    pp_group, embed_group = comms['pp'].group, embed.group if embed is not None else None
    out = {}

    # pipeline.py
    v = V[schedule]
    model = copy.deepcopy(full)
    chunks = pipeline.keep_stage(model, stage, p, v)
    st = pipeline.Stage(model, chunks, stage, p, grid[dp_rank, :, 0, 0], (8 // M, 16, 16), 'cpu',
                        torch.autocast('cpu', enabled=False), comms['pp'])
    st.observer = ScheduleClock(st, comms['pp'])  # a measured step: what ran when, the bytes held
    pipeline.run_schedule(st, schedule, M, x, y, 1.0 / M)
    _sync_tied(model, st, embed_group)
    mine = {n: p_.grad for n, p_ in model.named_parameters()}
    out['grad_err'] = max(_rel_err(mine[n], ref_grads[n]) for n in mine)
    out['n_grads'] = len(mine)
    out['loss_err'] = _rel_err(st.loss_sum, ref_loss.detach()) if st.is_last else 0.0
    ops = [(op, i) for op, i, _, _ in st.observer.schedules[-1][0] if op in 'FBW']
    keys = [(i, c) for i in range(M) for c in range(v)] if v > 1 else list(range(M))
    kinds = 'FBW' if schedule == 'zb1' else 'FB'
    out['each_op_once'] = sorted(ops) == sorted([(o, i) for o in kinds for i in keys])
    out['b_after_f'] = all(ops.index(('F', i)) < ops.index(('B', i)) for i in keys)
    out['w_after_b'] = all(ops.index(('B', i)) < ops.index(('W', i)) for i in keys) if schedule == 'zb1' else True
    out['peak_held'] = st.observer.peak_held
    out['peak_held_bytes'], out['microbatch_bytes'] = st.observer.peak_held_bytes, st.observer.microbatch_bytes
    out['peak_pending_sends'] = st.observer.peaks['pending_sends']
    # zb1: after B of microbatch k stage r keeps W's input for microbatches k-r..k: r+1 of them at the peak
    out['peak_grad_bytes'] = st.observer.peak_grad_bytes
    out['peak_grad_bytes_formula'] = (stage + 1) * formulas.zb1_output_grad_bytes_formula(
        config, 8 // M, 16, len(chunks[0]), st.is_first, st.is_last) if schedule == 'zb1' else 0
    # ZB-H1 holds a microbatch until its W, r backwards after its B on stage r: p on every stage (1F1B's stage 0)
    out['peak_held_formula'] = p if schedule == 'zb1' else formulas.peak_microbatches_formula(schedule, p, M, stage, v)
    out['ops'] = ops

    # torch.distributed.pipelining on the same weights and batch
    model = copy.deepcopy(full)
    chunks = pipeline.keep_stage(model, stage, p, v)
    pstages = [PipelineStage(_TorchStageModule(model, layers, stage == 0 and c == 0, stage == p - 1 and c == v - 1),
                             c * p + stage, p * v, torch.device('cpu'), group=pp_group)
               for c, layers in enumerate(chunks)]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    if schedule == 'interleaved':
        sched = ScheduleInterleaved1F1B(pstages, M, loss_fn=loss_fn)
    elif schedule == 'zb1':  # torch's ZB1P with one stage per rank: ZB-H1, and its own split of B and W
        sched = ScheduleInterleavedZeroBubble(pstages, M, loss_fn=loss_fn)
    else:
        sched = (ScheduleGPipe if schedule == 'gpipe' else Schedule1F1B)(pstages[0], M, loss_fn=loss_fn)
    losses = []
    if stage == 0:
        sched.step(x)
    elif stage == p - 1:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    _sync_tied(model, st, embed_group)
    theirs = {n: p_.grad for n, p_ in model.named_parameters()}
    out['torch_grad_err'] = max(_rel_err(mine[n], theirs[n]) for n in mine)
    out['torch_loss_err'] = _rel_err(torch.stack(losses).mean(), st.loss_sum) if st.is_last else 0.0
    return out


def _all_cases(rank, world_size):
    return {case: _one_case(rank, world_size, *case) for case in CASES}


@pytest.fixture(scope='module')
def spawned():
    """One spawn of 4 gloo processes runs every in-process case (P=2 runs as two pipelines side by side)."""
    return spawn(_all_cases, 4)


@pytest.mark.parametrize('case', CASES, ids=[f"p{p}-{s}-{layout}" for p, s, layout in CASES])
def test_one_step_equals_sequential_and_torch_pipelining(spawned, case):
    for rank, results in enumerate(spawned):
        r = results[case]
        assert r['n_grads'] > 0
        assert r['loss_err'] < 1e-5 and r['grad_err'] < 1e-5, (rank, r)
        assert r['torch_loss_err'] < 1e-5 and r['torch_grad_err'] < 1e-5, (rank, r)


@pytest.mark.parametrize('case', CASES, ids=[f"p{p}-{s}-{layout}" for p, s, layout in CASES])
def test_executed_order_is_a_valid_schedule(spawned, case):
    p, schedule, _ = case
    for rank, results in enumerate(spawned):
        r = results[case]
        assert r['each_op_once'] and r['b_after_f'] and r['w_after_b'], (rank, r['ops'])
        assert r['peak_held'] == r['peak_held_formula'], (rank, r['peak_held'], r['ops'])
        # measured from the tensors autograd saved: the peak is that many microbatches' activations (with chunks,
        # that many chunk-microbatches, of which the embedding's and the loss's chunks hold a little more)
        if schedule == 'interleaved':
            assert 0 < r['peak_held_bytes'] <= r['peak_held_formula'] * r['microbatch_bytes'], (rank, r)
        else:  # zb1: and the output gradients its B's keep for their W's (the formula's bytes, by module)
            assert r['peak_grad_bytes'] == r['peak_grad_bytes_formula'] and (r['peak_grad_bytes'] > 0) == (
                schedule == 'zb1'), (rank, r['peak_grad_bytes'], r['peak_grad_bytes_formula'])
            assert r['peak_held_bytes'] == r['peak_held_formula'] * r['microbatch_bytes'] + r['peak_grad_bytes'] > 0, (
                rank, r)
        # a send's buffer is let go one exchange later, not kept to the end of the schedule
        assert r['peak_pending_sends'] <= 2, (rank, r['peak_pending_sends'])
        stage = rank % p
        if schedule == 'gpipe':  # all forwards, then all backwards
            assert [op for op, _ in r['ops']] == ['F'] * M + ['B'] * M
        elif schedule == 'interleaved':  # Megatron's order: 2(p-r-1) + (v-1)p warm-up forwards, then 1F1B
            assert r['ops'] == _megatron_interleaved_order(p, 2, M, stage), (rank, r['ops'])
        elif schedule == 'zb1':  # 1F1B's F and B, and W r backwards late on stage r
            assert r['ops'] == _zb_h1_order(p, M, stage), (rank, r['ops'])
        else:  # p-r-1 warm-up forwards, then F and B alternate, then the cool-down backwards
            warmup = p - stage - 1
            ops = [op for op, _ in r['ops']]
            assert ops == ['F'] * warmup + ['F', 'B'] * (M - warmup) + ['B'] * warmup, (rank, r['ops'])


def _megatron_interleaved_order(p, v, m, r):
    """The (op, (microbatch, chunk)) sequence of Megatron's interleaved schedule on stage r, from its warm-up count
    and its chunk and microbatch ids (megatron/core/pipeline_parallel/schedules.py)."""
    total, warmup = m * v, min(2 * (p - r - 1) + (v - 1) * p, m * v)

    def op(kind, k):
        chunk = (k % (p * v)) // p
        return kind, ((k // (p * v)) * p + k % p, chunk if kind == 'F' else v - 1 - chunk)

    steady = [o for k in range(total - warmup) for o in (op('F', k + warmup), op('B', k))]
    return [op('F', k) for k in range(warmup)] + steady + [op('B', k) for k in range(total - warmup, total)]


def _zb_h1_order(p, m, r):
    """ZB-H1's (op, microbatch) sequence on stage r, as torch.distributed.pipelining builds it for
    ScheduleInterleavedZeroBubble with one stage per rank (_get_1f1b_rank_ops with enable_zero_bubble): 1F1B's
    p-r-1 warm-up forwards, then F and B alternate, and after the r-th B each B is followed by the W of the
    microbatch r backwards earlier; the last r W's close the schedule."""
    warmup, ops = p - r - 1, []
    for k in range(m):
        ops += [('F', warmup + k)] if warmup + k < m else []
        ops += [('B', k)] + ([('W', k - r)] if k >= r else [])
    return [('F', i) for i in range(warmup)] + ops + [('W', k) for k in range(m - r, m)]


@pytest.mark.parametrize('p', [2, 4])
def test_zb1_executed_order_has_a_smaller_bubble_than_1f1b(spawned, p):
    """The bubble, deterministically: each stage's executed order of one pipeline replayed with unit costs (F = B
    = W = 1; 1F1B's whole backward B + W = 2; timelines.unit_time_bubbles, which the report prints). 1F1B's step is
    the ideal 3m plus 3(p-1) idle units; zb1's is 3m plus (p-1), the paper's (p-1)(F+B-W): a third of the bubble.
    (bench.py's pp rows compare the measured time.)"""
    from common.timelines import unit_time_bubbles
    for layout in LAYOUTS:
        for pipeline in range(4 // p):
            stages = range(pipeline * p, (pipeline + 1) * p)
            for schedule, idle in (('1f1b', 3 * (p - 1)), ('zb1', p - 1)):
                tracks = [[(op, i, 0, 0) for op, i in spawned[r][(p, schedule, layout)]['ops']] for r in stages]
                assert unit_time_bubbles(tracks) == pytest.approx([idle / (3 * M + idle)] * p), schedule


def test_zb1_b_skips_the_weights_matmuls_and_w_does_them():
    """zb1's B asks autograd for no weight, so it skips the weights' matmuls; W does exactly those: W's FLOPs
    (torch's counter) are 2 x tokens x each Linear's weights, and B + W is one whole backward's. (A B that
    computed the weights' gradients too, with W doing nothing, passed every other zb1 test.)"""
    import contextlib
    from torch.utils.flop_counter import FlopCounterMode
    import pipeline
    from model import GPT, GPTConfig
    for layout, extra in LAYOUTS.items():
        torch.manual_seed(0)
        # one stage is first and last: untied (zb1 runs on pp >= 2, where the head's weight is a copy of its own)
        model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=16, dropout=0.0,
                              **{**extra, 'tie_embeddings': False}))
        st = pipeline.Stage(model, pipeline.keep_stage(model, 0, 1), 0, 1, [0], (2, 16, 16), 'cpu',
                            contextlib.nullcontext(), None)
        x, y = [torch.randint(0, 32, (2, 16))] * 2, [torch.randint(0, 32, (2, 16))] * 2
        flops = {}
        for name, run in (('B', lambda: pipeline.backward_input_step(st, 0, None)),
                          ('W', lambda: pipeline.backward_weight_step(st, 0)),
                          ('whole', lambda: pipeline.backward_step(st, 1, None))):
            if name != 'W':
                pipeline.forward_step(st, 0 if name == 'B' else 1, None, x, y, 1.0, split=name == 'B')
            with FlopCounterMode(display=False) as counter:
                run()
            flops[name] = counter.get_total_flops()
        linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert flops['W'] == 2 * 2 * 16 * linear_weights, (layout, flops)
        assert flops['B'] + flops['W'] == flops['whole'], (layout, flops)


MEASURING = [('dist', 'barrier'), ('dist', 'all_gather_object'), ('torch.cuda', 'synchronize'),
             ('torch.cuda', 'Event'), ('time', 'perf_counter'), ('torch.autograd.graph', 'saved_tensors_hooks')]


def _step_calls(rank, world_size):
    """pp=2 with tied embeddings, 2 micro-steps of 2 microbatches: one unmeasured train_step, then one measured.
    For each: the calls made to what only measuring needs (patched to record them) and every collective a Comm
    passed on to the group (name, call, kind, op)."""
    import time
    from types import SimpleNamespace
    import pipeline
    from common.distributed import Comm
    from common.model_parallel import process_grid
    from common.measure import ScheduleClock
    from model import GPT, GPTConfig
    calls, collectives = [], []

    def recording(name, f, record):
        def wrapped(*args, **kwargs):
            record(name, args, kwargs)
            return f(*args, **kwargs)
        return wrapped
    modules = {'dist': dist, 'torch.cuda': torch.cuda, 'time': time, 'torch.autograd.graph': torch.autograd.graph}
    for module, name in MEASURING:
        setattr(modules[module], name, recording(name, getattr(modules[module], name), lambda n, a, k: calls.append(n)))
    for name in ('all_reduce', 'reduce_scatter', 'all_gather', 'send_recv'):
        setattr(Comm, name, recording(name, getattr(Comm, name), lambda n, a, k: a[0].size > 1 and collectives.append(
            (a[0].name, n, k.get('kind'), str(k.get('op'))))))
    torch.manual_seed(1337)
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=16, dropout=0.0, bias=False))
    grid, coords, comms = process_grid(world_size, rank, dp=1, pp=2)
    embed = embed_comm(grid, rank, True)
    st = pipeline.Stage(model, pipeline.keep_stage(model, coords['pp'], 2), coords['pp'], 2, grid[0, :, 0, 0],
                        (2, 16, 16), 'cpu', torch.autocast('cpu', enabled=False), comms['pp'])
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    cfg = SimpleNamespace(batch_size=4, n_microbatches=2, block_size=16, schedule='1f1b', device='cpu', grad_clip=1.0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 32, (4, 16), generator=g), torch.randint(0, 32, (4, 16), generator=g))
               for _ in range(2)]
    out = []
    for clock in (None, ScheduleClock(st, comms['pp'])):
        st.observer = clock
        calls.clear(), collectives.clear()
        pipeline.train_step(st, optimizer, batches, cfg, comms['dp'], embed)
        out.append((list(calls), list(collectives)))
    return out


def _clipped_grads(rank, world_size, layout):
    """One pipeline.train_step on pp=2 with a clip that bites (the norm is far above 0.05): the gradients AdamW
    is handed (an optimizer pre-hook reads them) beside the sequential model's after torch's clip_grad_norm_."""
    from types import SimpleNamespace
    import pipeline
    from common.distributed import Comm
    from common.model_parallel import process_grid
    from model import GPT, GPTConfig
    torch.manual_seed(1337)
    full = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=16, dropout=0.0, bias=False,
                         **LAYOUTS[layout]))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 32, (4, 16), generator=g), torch.randint(0, 32, (4, 16), generator=g)
    ref = copy.deepcopy(full)
    ref(x, y)[1].backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
    want = {n: p.grad for n, p in ref.named_parameters()}
    want['lm_head.weight'] = ref.lm_head.weight.grad  # the tied weight under its second name too
    grid, coords, comms = process_grid(world_size, rank, dp=1, pp=2)
    st = pipeline.Stage(full, pipeline.keep_stage(full, coords['pp'], 2), coords['pp'], 2, grid[0, :, 0, 0],
                        (2, 16, 16), 'cpu', torch.autocast('cpu', enabled=False), comms['pp'])
    optimizer = full.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    got = {}
    optimizer.register_step_pre_hook(lambda *_: got.update(
        {n: p.grad.clone() for n, p in full.named_parameters() if p.grad is not None}))
    cfg = SimpleNamespace(batch_size=4, n_microbatches=2, block_size=16, schedule='1f1b', device='cpu', grad_clip=0.05)
    pipeline.train_step(st, optimizer, [(x, y)], cfg, Comm(None, 'dp', alone=True),
                        embed_comm(grid, rank, full.config.tie_embeddings))
    return norm, max(_rel_err(g, want[n]) for n, g in got.items()), sorted(got)


@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_the_clip_is_over_every_stage_with_a_tied_weight_once(layout):
    """The clip's norm is the whole model's (the stages' squares summed, the tied embedding counted once): the
    clipped gradients equal the sequential model's after torch's clip_grad_norm_ (counting the tied weight on
    both stages, or one stage's alone, fails this)."""
    results = spawn(_clipped_grads, 2, layout)
    assert results[0][0] > 0.5  # the clip bites: the gradients are scaled by 0.05 / norm
    for rank, (_, err, names) in enumerate(results):
        assert names and err < 1e-5, (rank, err, names)


def test_an_unmeasured_step_makes_no_measuring_calls():
    """A step that is not measured runs the schedules alone: no barrier, no device synchronize or CUDA event, no
    clock read, no all_gather_object, no saved-tensor hooks (the held-activation count), and the only collectives
    besides the sends are the algorithm's (the loss and the clip's norm over the pipeline, the tied weight's
    gradient). The measured step after it makes those calls (the patches see them), a barrier and a MAX
    all-reduce per schedule among them."""
    for rank, ((calls, collectives), (measured_calls, measured_collectives)) in enumerate(spawn(_step_calls, 2)):
        assert calls == [], (rank, sorted(set(calls)))
        assert sorted(c for c in collectives if c[1] != 'send_recv') == [
            ('embed', 'all_reduce', None, 'None'), ('pp', 'all_reduce', 'scalars', 'None'),
            ('pp', 'all_reduce', 'scalars', 'None')], (rank, collectives)
        assert {'barrier', 'perf_counter', 'saved_tensors_hooks'} <= set(measured_calls), rank
        assert measured_calls.count('barrier') == 2, (rank, measured_calls.count('barrier'))
        maxed = [c for c in measured_collectives if 'MAX' in c[3]]
        assert maxed == [('pp', 'all_reduce', 'scalars', str(dist.ReduceOp.MAX))] * 2, (rank, measured_collectives)
        assert [c for c in measured_collectives if c not in maxed] == collectives, rank


# -----------------------------------------------------------------------------
# the script, end to end, against train.py

ARGS = [a for a in TINY if not a.startswith('--n_layer')] + [
    '--n_layer=4', '--gradient_accumulation_steps=2', '--eval_interval=3', '--log_interval=1', '--warmup_iters=2',
    '--lr_decay_iters=6', '--learning_rate=1e-2', '--min_lr=1e-3']


@pytest.fixture(scope='module')
def baseline(tmp_path_factory):
    return train_py_reference(ARGS + ['--max_iters=6'], tmp_path_factory)


def test_resume_as_dp_x_pp_and_consolidate_continue_train_py_exactly(baseline, tmp_path):
    """pp=2 1F1B on 2 processes for 3 iterations, consolidated at its checkpoint into train.py's format; then the
    pipeline resumes from its stage checkpoints as dp=2 x pp=2 on 4 processes, and train.py from the consolidated
    checkpoint, both to 6: every loss equals one train.py process's. The resume says --tie_embeddings=False: the
    checkpoint's model is tied, and its two stages must keep summing the tied embedding's gradients (they took
    the flag and drifted apart)."""
    pipe, full = str(tmp_path / 'pipe'), str(tmp_path / 'full')
    pargs = ARGS + ['--pp=2', '--schedule=1f1b', '--n_microbatches=2', f'--out_dir={pipe}']
    check(run_script('pipeline.py', pargs + ['--max_iters=3'], nproc=2))
    consolidate(str(pipe), str(full))
    resumed = check(run_script('pipeline.py', pargs + ['--max_iters=6', '--init_from=resume',
                                                       '--tie_embeddings=False'], nproc=4))
    assert "tie_embeddings=True (the checkpoint's; this command says False)" in resumed.stdout
    run_train_py_here(ARGS + [f'--out_dir={full}', '--max_iters=6', '--init_from=resume'])
    want = train_losses(baseline)
    assert_same_losses(train_losses(pipe), want, range(6))
    assert_same_losses(eval_losses(pipe), eval_losses(baseline), [0, 3, 6])
    assert_same_losses(train_losses(full), want, range(3, 6))
    rows = [r for r in read_log(pipe) if 'rank' in r]
    assert sorted(r['iter'] for r in rows) == [0, 0, 3, 3, 3, 3]  # each run's first step only is measured
    rows = [r for r in rows if r['iter'] == 3]  # the resumed run's: every rank's row, dp x pp
    from common import formulas
    from model import GPTConfig
    gptconf = GPTConfig(n_layer=4, n_head=4, n_embd=16, block_size=16, vocab_size=stdlib_vocab())  # (ARGS')
    assert sorted((r['rank'], r['dp_rank'], r['stage']) for r in rows) == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    for r in rows:
        assert r['peak_microbatches_held'] == r['peak_microbatches_held_formula'] == 2 - r['stage']
        assert r['peak_activation_bytes'] == r['peak_activation_bytes_formula'] > 0
        if r['stage'] == 0:  # and against the model of a block's saves, not one microbatch's measured: its 2
            # blocks' for 2 microbatches of 2 sequences (the embedding's saved token indices besides: 0.6%)
            modelled = 2 * 2 * formulas.saved_bytes_formula(gptconf, 16, 2)
            assert r['peak_activation_bytes'] == pytest.approx(modelled, rel=0.01), (r, modelled)
        assert r['p2p_bytes_per_step'] == r['p2p_bytes_per_step_formula'] > 0
        # measured by the clock: the step less its compute (the F and B spans it recorded), as a fraction
        assert r['n_schedules'] == 1 and r['bubble_fraction_formula'] == pytest.approx(1 / 3)
        compute = sum(t1 - t0 for op, _, t0, t1 in r['records'] if op in ('F', 'B', 'W'))
        assert 0 < compute < r['step_s'] and r['bubble_fraction'] == pytest.approx(1 - compute / r['step_s'])
    from common.timelines import unit_time_bubbles
    for dp_rank in (0, 1):  # the order each stage ran its ops, replayed at one unit an op: 1F1B's own bubble
        tracks = [r['records'] for r in sorted(rows, key=lambda r: r['stage']) if r['dp_rank'] == dp_rank]
        assert unit_time_bubbles(tracks) == pytest.approx([1 / 3, 1 / 3]), tracks


def test_each_stage_measures_its_own_wire_bytes(tmp_path):
    """With another process flooding the loopback interface, each stage's measured wire bytes are what gloo sends
    for its own calls (on 2 ranks every call puts its whole tensor on the wire once: sends, the scalars'
    and the tied embedding's all-reduces), activations large enough (~64 kB) that TCP's headers are noise."""
    with LoopbackFlood() as flood:
        check(run_script('pipeline.py', TINY + ['--n_embd=64', '--block_size=64', '--batch_size=8', '--pp=2',
                                                '--n_microbatches=2', '--max_iters=1', '--eval_interval=100',
                                                f'--out_dir={tmp_path}'], nproc=2))
    rows = [r for r in read_log(tmp_path) if 'rank' in r]
    assert sorted(r['stage'] for r in rows) == [0, 1] and flood.sent > 0
    for r in rows:
        counted = r['collective_bytes']
        assert r['wire_bytes'] is not None, r['wire_bytes_note']
        assert r['wire_bytes_formula'] == counted and r['p2p_bytes_per_step'] > 0.9 * counted, r
        assert 0.99 * counted <= r['wire_bytes'] <= 1.05 * counted + 4096, (r['stage'], r['wire_bytes'], counted)
        # counted: the algorithm's calls alone (the clip's norm and the loss: 4 bytes each), not the clock's MAX
        # all-reduce of each schedule's length, which only measures
        assert r['collective_bytes_by_kind']['pp scalars'] == 2 * 4, r['collective_bytes_by_kind']


@pytest.mark.parametrize('schedule,v', [('interleaved', 2)])
def test_dp_x_pp_loss_curve_equals_train_py(baseline, tmp_path, schedule, v):
    """dp=2 x pp=2: interleaved with 2 chunks of one layer per stage (layers 0 and 2 on stage 0, 1 and 3 on stage
    1). (1F1B and zb1 at dp=2 x pp=2: tests/test_matrix.py.)"""
    out = str(tmp_path)
    check(run_script('pipeline.py', ARGS + ['--pp=2', f'--schedule={schedule}', f'--virtual_stages={v}',
                                            '--n_microbatches=2', f'--out_dir={out}', '--max_iters=6'], nproc=4))
    assert_same_losses(train_losses(out), train_losses(baseline), range(6))
    assert_same_losses(eval_losses(out), eval_losses(baseline), [0, 3, 6])
    for r in measured_rows(out, 4):
        assert r['peak_microbatches_held'] == r['peak_microbatches_held_formula'], r
        assert r['p2p_bytes_per_step'] == r['p2p_bytes_per_step_formula'] > 0, r


@pytest.mark.parametrize('schedule,m', [('gpipe', 2)])
def test_pp4_loss_curve_equals_train_py(baseline, tmp_path, schedule, m):
    out = str(tmp_path)
    proc = check(run_script('pipeline.py', ARGS + ['--pp=4', f'--schedule={schedule}', f'--n_microbatches={m}',
                                                   f'--out_dir={out}', '--max_iters=6'], nproc=4))
    assert_same_losses(train_losses(out), train_losses(baseline), range(6))
    assert_same_losses(eval_losses(out), eval_losses(baseline), [0, 3, 6])
    assert 'stage 3 |' in proc.stdout and 'bubble (not computing)' in proc.stdout
    rows = [r for r in read_log(out) if 'rank' in r]
    assert sorted(r['stage'] for r in rows) == [0, 1, 2, 3]
    for r in rows:
        assert r['peak_microbatches_held'] == r['peak_microbatches_held_formula'] == 4 - 2 * (schedule == 'gpipe')
        # (GPipe holds all m = 2; zb1 p = 4 on every stage, each microbatch until its W)
        assert r['p2p_bytes_per_step'] == r['p2p_bytes_per_step_formula'] > 0  # counted at the send calls


BAD = [
    (2, ['--pp=3'], 'world size 2 is not divisible by pp=3'),
    (2, ['--pp=2', '--n_layer=3'], 'n_layer (3) must be divisible by pp (2)'),
    (2, ['--pp=2', '--n_microbatches=3'], 'must be divisible into n_microbatches'),
    (2, ['--pp=2', '--schedule=1f1b', '--n_microbatches=1'], 'needs n_microbatches (1) >= pp (2)'),
    (4, ['--pp=2', '--gradient_accumulation_steps=1'], 'must be divisible by the data-parallel size dp=2'),
    (2, ['--pp=2', '--schedule=foo'], '--schedule=foo is not one of gpipe, 1f1b, interleaved'),
    (2, ['--pp=2', '--n_microbatches=0'], '--n_microbatches=0 must be at least 1'),
    (2, ['--pp=2', '--virtual_stages=2'], '--virtual_stages=2 must be 1, or more with --schedule=interleaved'),
    (2, ['--pp=1', '--schedule=interleaved', '--virtual_stages=2'], '--virtual_stages=2 needs pp >= 2'),
    (2, ['--pp=2', '--compile=True'], 'not supported by pipeline.py: pass --compile=False'),
    (2, ['--pp=2', '--n_expert=4', '--aux_loss_style=hf'], "aux_loss_style='hf' (a converted Mixtral's loss) pools"),
    (2, ['--pp=2', '--schedule=zb1', '--activation_checkpointing=True'], "would re-run each block's forward once per"),
]


@pytest.mark.parametrize('world,args,message', BAD,
                         ids=['world', 'layers', 'microbatches', '1f1b-m-lt-p', 'dp-gt-batch', 'schedule', 'm-0',
                              'v-without-interleaved', 'v-on-one-stage', 'compile', 'moe-hf', 'zb1-ac'])
def test_bad_config_is_one_clear_error(monkeypatch, tmp_path, world, args, message):
    """Every check runs before the process group exists, from the world size torchrun sets."""
    import pipeline
    assert_config_error(pipeline.main, TINY + [f'--out_dir={tmp_path}'] + args, world, message, monkeypatch)


def test_bad_config_exits_on_every_rank(tmp_path):
    proc = run_script('pipeline.py', TINY + [f'--out_dir={tmp_path}', '--pp=2', '--n_microbatches=3'], nproc=2,
                      timeout=60)
    one_error_line_per_rank(proc, 'must be divisible into n_microbatches', 'pipeline.py')


def test_interleaved_on_one_stage_exits_on_every_rank(tmp_path):
    """pp=1 with chunks would make a stage its own neighbour: refused before any work (no log written)."""
    proc = run_script('pipeline.py', TINY + [f'--out_dir={tmp_path}', '--pp=1', '--schedule=interleaved',
                                             '--virtual_stages=2'], nproc=2, timeout=60)
    one_error_line_per_rank(proc, '--virtual_stages=2', 'pipeline.py')
    assert not (tmp_path / 'log.jsonl').exists()


def test_resume_with_another_pp_says_what_to_do(tmp_path):
    """Stage files saved with pp=2 (one iteration), resumed with pp=1: one line per rank naming the saved --pp and
    consolidate.py, not a load_state_dict traceback."""
    flags = TINY + [f'--out_dir={tmp_path}', '--max_iters=1', '--eval_interval=1', '--eval_iters=1']
    check(run_script('pipeline.py', flags + ['--pp=2'], nproc=2))
    proc = run_script('pipeline.py', flags + ['--pp=1', '--init_from=resume'], nproc=2, timeout=60)
    one_error_line_per_rank(proc, 'was saved with --pp=2 --virtual_stages=1, this run has --pp=1', 'pipeline.py')
    assert 'python consolidate.py' in proc.stderr


def test_timeline_shows_every_op_once_in_the_order_executed():
    """A stage's row from a known executed order, its ops from 1/1000 of a slot to many slots long (on the bench's
    shape a short B0 used to vanish and a long F2 show three times): every F and B appears exactly once, in the
    order executed; a long op continues with '-'; the waits (W) are not ops."""
    from common import timelines
    ops = [('F', 0, 0.0, 0.001), ('send/recv', 0, 0.001, 0.2), ('F', 1, 0.2, 0.2001), ('B', 0, 0.2001, 0.2002),
           ('F', 2, 0.2002, 0.9), ('B', 1, 0.9, 0.9001), ('F', 3, 0.9001, 0.91), ('B', 2, 0.95, 0.9501),
           ('B', 3, 0.9501, 1.0)]
    for n_slots in (4, 10, 40):
        row = timelines.timeline(ops, 1.0, n_slots, 2).split()
        assert [c for c in row if c[0] in 'FB'] == ['F0', 'F1', 'B0', 'F2', 'B1', 'F3', 'B2', 'B3'], (n_slots, row)
        assert set(row) <= {'F0', 'F1', 'F2', 'F3', 'B0', 'B1', 'B2', 'B3', '-', '.'}, row
        assert len(row) >= n_slots
    row = timelines.timeline(ops, 1.0, 10, 2).split()
    # slots of 0.1: F1 and B0 take slots 2 and 3, F2 the next free one, 4, and runs on to 0.9 through slots 5-8
    assert row[:row.index('B1')] == ['F0', '.', 'F1', 'B0', 'F2', '-', '-', '-', '-'], row
    chunks = [('F', (0, 1), 0.0, 0.5), ('B', (0, 1), 0.5, 0.5001)]  # interleaved labels: F<microbatch>.<chunk>
    assert timelines.timeline(chunks, 1.0, 4, 4).split() == ['F0.1', '-', 'B0.1', '.']


def test_traces_open_in_perfetto(tmp_path):
    """--profile=2 writes one torch.profiler trace per rank (with the send/recv and the matmuls in it), and the
    executed schedule is written as a trace with one track per stage: valid Chrome trace JSON."""
    import json
    out = str(tmp_path)
    check(run_script('pipeline.py', ARGS + ['--pp=2', '--n_microbatches=2', '--max_iters=4', '--profile=2',
                                            f'--out_dir={out}'], nproc=2))
    for rank in range(2):
        events = json.load(open(tmp_path / f'trace_rank{rank}.json'))['traceEvents']
        names = {e.get('name', '') for e in events}
        assert any('mm' in n for n in names), 'no matmul in the profiler trace'
        assert any('send' in n.lower() or 'recv' in n.lower() or 'gloo' in n.lower() for n in names), names
    events = json.load(open(tmp_path / 'schedule_trace.json'))['traceEvents']
    tracks = {e['args']['name'] for e in events if e['ph'] == 'M'}
    assert tracks == {'stage 0', 'stage 1'}
    for stage in range(2):
        slices = [e['name'] for e in events if e['ph'] == 'X' and e['tid'] == stage]
        assert sorted(n for n in slices if n[0] in 'FB') == ['B0', 'B1', 'F0', 'F1']
        assert 'send/recv' in slices
    assert all(e['dur'] >= 0 for e in events if e['ph'] == 'X')
