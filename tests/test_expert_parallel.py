"""expert_parallel.py against train.py: ep 2, ep 4 and dp 2 x ep 2 give train.py's loss curve and every gradient
(in-process, train.train_step as the reference), the script end to end (train.py's logged curve, resume exact,
its consolidated checkpoint = train.py's), the all-to-all's counted bytes against the split sizes, the wire
bytes under a loopback flood, an unmeasured step that measures nothing, bad input one line per rank."""
import contextlib

import pytest
import torch

from helpers import (TINY, LoopbackFlood, assert_same_checkpoint, assert_same_losses, check, eval_losses,
                     measured_rows, read_log, run_script, spawn, train_losses, train_py_reference)

MOE = ['--n_expert=4', '--n_expert_active=2']
FLAGS = TINY + MOE + ['--gradient_accumulation_steps=4', '--log_interval=1', '--eval_interval=2', '--max_iters=4',
                      '--learning_rate=1e-2', '--warmup_iters=0']
ITERS = 2  # in-process steps per setting


def _rel_err(a, b):
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


def _comms(rank, world_size):
    """Every setting's (ep, edp, dp) Comms on 4 ranks: ep=2 (two independent worlds of 2: ranks 0-1, 2-3),
    ep=4, and dp 2 x ep 2 (the script's own grid). Every rank makes every group, in the same order."""
    import torch.distributed as dist
    from common.distributed import Comm
    import expert_parallel as epm
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = Comm(pairs[rank // 2], 'ep')
    return {'ep2': (pair, Comm(None, 'edp', alone=True), Comm(pairs[rank // 2], 'dp')),
            'ep4': epm.ep_comms(world_size, rank, 4), 'dp2xep2': epm.ep_comms(world_size, rank, 2)}


def _cfg(out_dir, *extra):
    import expert_parallel as epm
    from common.config import configure
    from common.data import load_dataset
    cfg = configure(epm.config, FLAGS + [f'--out_dir={out_dir}', *extra])
    return cfg, *load_dataset(cfg.dataset)


def _train_py(cfg, data, vocab_size):
    """train.py's own train_step, ITERS iterations from train.py's initialization: the losses, and the first
    step's gradients (before AdamW) by name."""
    import train
    from model import GPT
    from common.config import model_config
    from common.training import get_lr, set_lr
    from common.data import micro_batches
    torch.manual_seed(cfg.seed)
    model = GPT(model_config(cfg, vocab_size))
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), 'cpu')
    return _run(model, optimizer, cfg, lambda it: train.train_step(
        model, optimizer, torch.amp.GradScaler('cpu', enabled=False), micro_batches(data, cfg, it),
        contextlib.nullcontext(), cfg.grad_clip), get_lr, set_lr)


def _run(model, optimizer, cfg, step, get_lr, set_lr):
    grads = {}

    def first_grads(*_):  # the gradients AdamW is handed at the first step
        if not grads:
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
    hook = optimizer.register_step_pre_hook(first_grads)
    losses = []
    for it in range(ITERS):
        set_lr(optimizer, get_lr(it, cfg))
        losses.append(step(it))
    hook.remove()
    return losses, grads


def _expert_parallel(cfg, data, vocab_size, comms):
    """expert_parallel.py's build and train_step, ITERS iterations: the losses and the first step's gradients."""
    import expert_parallel as epm
    from common.training import get_lr, set_lr
    from common.data import micro_batches
    ep, edp, dp = comms
    model, params, optimizer, *_ = epm.build(cfg, vocab_size, ep, dp.rank, dp.size)
    losses, grads = _run(model, optimizer, cfg, lambda it: epm.train_step(
        model, optimizer, micro_batches(data, cfg, it, dp.rank, dp.size), contextlib.nullcontext(), cfg.grad_clip,
        params, comms), get_lr, set_lr)
    return losses, grads, model, params


def _against_train_py(rank, world_size, out_dir, all_comms):
    # a clip that bites at the first step (the norm is 0.69 there): the gradients AdamW is handed are scaled by
    # 0.5 / the norm, so a norm that counts the dense or the experts' gradients wrongly fails the comparison
    cfg, data, vocab_size = _cfg(out_dir, '--grad_clip=0.5')
    want_losses, want_grads = _train_py(cfg, data, vocab_size)
    results = {}
    for name, comms in all_comms.items():
        losses, grads, model, _ = _expert_parallel(cfg, data, vocab_size, comms)
        experts = sorted(n for n in grads if '.experts.' in n)
        results[name] = dict(losses=losses, want=want_losses, experts=experts,
                             dense_names=sorted(n for n in grads if '.experts.' not in n),
                             want_dense=sorted(n for n in want_grads if '.experts.' not in n),
                             grad_err=max(_rel_err(g, want_grads[n]) for n, g in grads.items()))
    return results


def _counted_bytes(rank, world_size, comms):
    """One forward and backward of dp 2 x ep 2 with the all-to-all's calls recorded: what Comm counted equals
    the split sizes handed to torch times the row's bytes, and the rows each rank's experts got are the routing's
    (every rank's tokens per expert, gathered)."""
    from unittest import mock
    import torch.distributed as dist
    import expert_parallel as epm
    from model import GPT, GPTConfig
    ep, edp, dp = comms
    torch.manual_seed(0)
    with torch.device('meta'):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=32, n_expert=4))
    epm.cut_experts(model, ep)
    epm.materialize(model, 'cpu')
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    idx = torch.randint(0, 32, (3, 16), generator=torch.Generator().manual_seed(rank))
    handed, real = [], dist.all_to_all_single
    with mock.patch.object(dist, 'all_to_all_single', lambda out, inp, o, i, **k: (
            handed.append(sum(i) * inp[:1].numel() * inp.element_size()), real(out, inp, o, i, **k))[1]):
        ep.clear()
        model(idx, idx)[1].backward()
    counts = [None] * world_size
    dist.all_gather_object(counts, model.tokens_per_expert.tolist())
    group = torch.tensor(counts).view(-1, ep.size, 2, 4).sum(1)[rank // ep.size]  # (layer, expert): my group's
    rows_here = int(group[:, 2 * ep.rank:2 * ep.rank + 2].sum())
    return dict(counted=dict(ep.collective_bytes), handed=sum(handed), rows_here=rows_here,
                slots=sum(sum(layer) for layer in model.tokens_per_expert.tolist()))


def _same_as_torch(rank, world_size):
    """model_parallel.AllToAll (dispatch's, Ulysses') against torch.distributed.nn.functional.all_to_all_single: forward and backward."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_nn
    from common.distributed import Comm
    from common.model_parallel import AllToAll
    comm = Comm(None, 'ep')
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 4, (world_size, world_size), generator=gen)  # [src, dst] rows
    send, recv = sizes[rank].tolist(), sizes[:, rank].tolist()
    x = torch.randn(sum(send), 3, generator=torch.Generator().manual_seed(rank + 1), requires_grad=True)
    w = torch.randn(sum(recv), 3)
    ours = AllToAll.apply(x, comm, send, recv, 'test')
    (ours * w).sum().backward()
    ours_grad, x.grad = x.grad, None
    theirs = dist_nn.all_to_all_single(torch.empty(sum(recv), 3), x, recv, send, group=dist.group.WORLD)
    (theirs * w).sum().backward()
    return torch.equal(ours, theirs) and torch.equal(ours_grad, x.grad)


def _measuring_calls(rank, world_size, out_dir, comms):
    """The calls of one step as main() runs it (inside expert_parallel.measuring), unmeasured (iteration 1 of
    a run that started at 0), then measured (iteration 0): every collective handed to a Comm, every one
    torch.distributed made, and every call that exists only to measure."""
    from collections import Counter
    from unittest import mock
    import torch.distributed as dist
    from common import distributed
    from types import SimpleNamespace
    import expert_parallel as epm
    from common.data import micro_batches
    from common.training import run_step
    cfg, data, vocab_size = _cfg(out_dir, '--measure_every=0')
    model, params, optimizer, *_ = epm.build(cfg, vocab_size, comms[0], rank, world_size)
    batches = micro_batches(data, cfg, 0, comms[2].rank, comms[2].size)
    from helpers import counting_patches, measuring_calls
    calls = Counter()
    a2a = distributed.Comm.all_to_all_v  # (counts its bytes itself: not through Comm.count)
    patches = [mock.patch.object(distributed.Comm, 'all_to_all_v', lambda self, *a: (
        calls.update([f'comm {self.name} {a[-1]}']), a2a(self, *a))[1])] + counting_patches(calls, [
            (dist, 'all_reduce', 'dist collective'), (dist, 'all_to_all_single', 'dist collective')]
        + measuring_calls())
    seen = {}
    for iter_num in (1, 0):
        calls.clear()
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            step = lambda it: epm.train_step(model, optimizer, batches, contextlib.nullcontext(), 1.0, params, comms)
            run_step(SimpleNamespace(kind='expert_parallel', model=model, optimizer=optimizer, comms=list(comms),
                                     step=step), cfg, iter_num, 0)  # as the loop runs it: observed at iter 0
        seen[iter_num] = dict(calls)
    return seen


def _all_checks(rank, world_size, out_dir):
    torch.set_num_threads(1)
    all_comms = _comms(rank, world_size)
    return dict(train_py=_against_train_py(rank, world_size, out_dir, all_comms),
                counted=_counted_bytes(rank, world_size, all_comms['dp2xep2']),
                torch_a2a=_same_as_torch(rank, world_size),
                calls=_measuring_calls(rank, world_size, out_dir, all_comms['dp2xep2']))


@pytest.fixture(scope='module')
def spawned(tmp_path_factory):
    """One spawn of 4 gloo processes runs every in-process check (the start-up is the slow part)."""
    return spawn(_all_checks, 4, str(tmp_path_factory.mktemp('ep_spawned')))


@pytest.mark.parametrize('setting', ['ep2', 'ep4', 'dp2xep2'])
def test_losses_and_every_gradient_equal_train_py(spawned, setting):
    """From train.py's initialization (each rank materializes only its experts), ITERS steps of
    expert_parallel.train_step on the script's batches give train.train_step's losses to 1e-5, and the first
    step's gradients (after the syncs) equal the single process's, each expert's on the ranks that hold it."""
    for rank, result in enumerate(spawned):
        r = result['train_py'][setting]
        assert r['losses'] == pytest.approx(r['want'], rel=1e-5), (rank, r['losses'], r['want'])
        assert r['grad_err'] < 1e-5, (rank, setting, r['grad_err'])
        assert r['dense_names'] == r['want_dense']  # every dense parameter on every rank
        ep = {'ep2': 2, 'ep4': 4, 'dp2xep2': 2}[setting]
        first = (rank % ep) * 4 // ep
        mine = {f'transformer.h.{i}.mlp.experts.{e}' for i in range(2) for e in range(first, first + 4 // ep)}
        assert {n.rsplit('.', 2)[0] for n in r['experts']} == mine, (rank, r['experts'])


def test_all_to_all_bytes_counted_are_the_split_sizes(spawned):
    """Counted at the calls: the bytes handed to torch (the input split sizes x a row's bytes), whatever the
    routing. Dispatch hands the k slots of every token of every MoE layer (N·k rows of C fp32); the combine
    hands back the rows this rank's experts got, which the routing of its ep group says (tokens per expert)."""
    row = 16 * 4  # C x fp32
    for rank, result in enumerate(spawned):
        c = result['counted']
        assert c['counted']['dispatch'] == c['counted']['combine backward'] == c['slots'] * row == 2 * 48 * 2 * row
        assert c['counted']['combine'] == c['counted']['dispatch backward'] == c['rows_here'] * row, (rank, c)
        assert sum(c['counted'].values()) == c['handed'], (rank, c)  # (the split sizes' int64 counts too)


def test_all_to_all_equals_torch_distributed_nn(spawned):
    assert all(r['torch_a2a'] for r in spawned)


def test_an_unmeasured_step_makes_no_measuring_call(spawned):
    """Measuring off the hot path: a step measured_step does not name runs no barrier, all_gather_object,
    synchronize or clock, and no collective but the algorithm's, each through its Comm: per MoE layer and
    micro-batch the split sizes, dispatch and combine and their backward over ep, then the dense gradients
    over every rank, the experts' over their replicas, the clip's and the loss's scalars."""
    for rank, result in enumerate(spawned):
        unmeasured, measured = result['calls'][1], result['calls'][0]
        comm_calls = sum(n for k, n in unmeasured.items() if k.startswith('comm '))
        assert unmeasured.get('dist collective') == comm_calls, (rank, unmeasured)
        assert set(unmeasured) == {
            'comm ep split sizes', 'comm ep dispatch', 'comm ep combine', 'comm ep combine backward',
            'comm ep dispatch backward', 'comm dp all_reduce', 'comm edp expert all_reduce', 'comm ep scalars',
            'comm dp scalars', 'dist collective'}, (rank, unmeasured)
        assert unmeasured['comm ep dispatch'] == 2  # 2 MoE layers x 1 micro-batch on this rank
        assert measured['barrier'] >= 2 and measured['all_gather_object'] >= 1, (rank, measured)


def test_the_script_resumes_exactly_and_consolidates_to_train_py(tmp_path, tmp_path_factory):
    """The script end to end on 2 ranks (ep=2): train.py's logged losses (train and eval); stopped at 2 and
    resumed to 4 it logs the same numbers as straight through (with dropout on: tests/test_trust.py); the rank
    files consolidate into train.py's checkpoint; the first step's report counts every token-slot."""
    ref = train_py_reference(FLAGS, tmp_path_factory)
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    proc = check(run_script('expert_parallel.py', FLAGS + ['--ep=2', f'--out_dir={straight}'], nproc=2))
    assert 'load max/mean: ranks' in proc.stdout and 'rank 1 bytes sent' in proc.stdout
    assert_same_losses(train_losses(straight), train_losses(ref), range(4))
    assert_same_losses(eval_losses(straight), eval_losses(ref), [0, 2, 4])
    import consolidate
    assert_same_checkpoint(consolidate.consolidate(str(straight), str(tmp_path / 'joined')), f'{ref}/ckpt.pt')
    rows = [r for r in read_log(straight) if 'rank' in r]
    assert [r['rank'] for r in rows] == [0, 1]
    for r in rows:
        assert [sum(layer) for layer in r['tokens_per_expert']] == [2 * 4 * 16] * 2  # k x batch x block
        assert r['all_to_all_bytes_by_kind']['dispatch'] == 2 * 2 * 4 * 16 * 2 * 16 * 4  # 2 micro x 2 layers
        # what this rank holds (measured) against the formula on the whole model's counts (n_expert/ep each)
        assert (r['param_bytes'], r['grad_bytes'], r['optim_bytes']) == (
            r['param_bytes_formula'], r['grad_bytes_formula'], r['optim_bytes_formula'])
    from common import planner  # the planner's expert-parallel row holds what each rank held
    from common.data import load_dataset
    gptconf = planner.gpt_config_from(None, FLAGS, load_dataset('stdlib_char')[1])
    plan = next(p for p in planner.estimate(gptconf, 2, 1, 4, 16, 1, 1, 1, 2, False, 2) if p['ep'] == 2)
    assert all((r['param_bytes'], r['grad_bytes'], r['optim_bytes']) ==
               (plan['param_bytes'], plan['grad_bytes'], plan['optim_bytes']) for r in rows), plan
    check(run_script('expert_parallel.py', FLAGS + ['--ep=2', '--max_iters=2', f'--out_dir={split}'], nproc=2))
    check(run_script('expert_parallel.py', FLAGS + ['--ep=2', '--init_from=resume', f'--out_dir={split}'],
                     nproc=2))
    assert train_losses(split) == train_losses(straight) and eval_losses(split) == eval_losses(straight)


def test_measured_wire_bytes_are_what_gloo_sends(tmp_path):
    """ep=2 on 2 ranks, all-to-alls of ~0.25 MB (TCP's and gloo's headers are noise): each rank's own sockets
    (measure.WireMeter) against what the counted calls put on the wire (the all-to-all's off-rank rows
    exactly, the all-reduces' ring), with other traffic on the machine."""
    with LoopbackFlood() as flood:
        check(run_script('expert_parallel.py', TINY + MOE + [
            '--n_embd=128', '--block_size=64', '--batch_size=8', '--ep=2', '--gradient_accumulation_steps=2',
            '--eval_iters=1', '--max_iters=1', '--eval_interval=1', f'--out_dir={tmp_path}'], nproc=2))
    assert flood.sent > 0
    for r in measured_rows(tmp_path, 2):
        assert 0.99 * r['wire_bytes_formula'] <= r['wire_bytes'] <= 1.05 * r['wire_bytes_formula'] + 16384, r
        assert r['all_to_all_wire_bytes'] > 0.2 * r['wire_bytes_formula']


@pytest.mark.parametrize('argv, world, message', [
    (['--ep=2'], 2, 'n_expert=0: a dense model has no experts'),
    (MOE + ['--ep=4'], 2, 'world size 2 is not divisible by ep=4'),
    (['--n_expert=6', '--ep=4'], 4, 'n_expert (6) must be divisible by ep=4'),
    (['--n_expert=4', '--n_expert_active=5', '--ep=2'], 2, 'n_expert_active (top-k, 5) must be 1 to n_expert (4)'),
    (MOE + ['--ep=2', '--gradient_accumulation_steps=3'], 2, 'gradient_accumulation_steps (3) must be divisible'),
    (MOE + ['--ep=2', '--dtype=float16'], 2, 'float32 or bfloat16'),
    (MOE + ['--ep=2', '--init_from=gpt2'], 2, "init_from must be 'scratch' or 'resume'"),
    (MOE + ['--ep=2', '--moe_every=3'], 2, 'moe_every (3) > n_layer (2): no MoE layer'),
])
def test_bad_input_is_one_line(argv, world, message, monkeypatch):
    from helpers import assert_config_error
    import expert_parallel as epm
    assert_config_error(epm.main, TINY + argv, world, message, monkeypatch)


def test_bad_input_exits_on_every_rank(tmp_path):
    proc = run_script('expert_parallel.py', TINY + ['--n_expert=3', '--ep=2', f'--out_dir={tmp_path}'], nproc=2,
                      timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines()
             if line.startswith('[rank ') and '] error: n_expert (3) must be divisible by ep=2' in line]
    assert sorted(line.split(']')[0] for line in lines) == ['[rank 0', '[rank 1'], proc.stderr[-2000:]
    assert 'expert_parallel.py", line' not in proc.stderr  # no traceback from the script
