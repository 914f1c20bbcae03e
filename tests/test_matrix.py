"""One matrix: every strategy x {GPT-2, LLaMA} x {dense, mixture of experts} trains train.py's first steps (three
iterations, fp32, dropout 0, to 1e-5), or refuses in one line, the same on every rank. The MoE models use every
routing option between them: GPT-2's softmax scores with a capacity factor that drops slots and DeepSeek-V3's
balancing bias, LLaMA's sigmoid scores with the router z-loss and a shared expert. And in bfloat16, the GPU's
default, on GPT-2 dense and LLaMA MoE: every strategy within 2e-3 of train.py's fp32 losses.

Every script's main() runs in-process, one after another, inside one gloo world (4 processes, 8 for the grid):
the start-up is paid once, each cell costs well under a second. Each cell splits train.py's global batch (8
sequences, 4 micro-batches of 2) into the same forwards: 2 rows each (a pipeline's microbatch included), which
the aux loss needs (it depends on the tokens routed together)."""
import contextlib
import importlib
import io
import json
import os

import pytest

from helpers import assert_same_losses, run_train_py_here, spawn, train_losses, train_py_reference

COMMON = ['--n_layer=2', '--n_head=4', '--n_embd=16', '--block_size=16', '--dropout=0.0', '--dtype=float32',
          '--compile=False', '--eval_iters=1', '--eval_interval=100', '--log_interval=1', '--max_iters=3',
          '--learning_rate=1e-2', '--warmup_iters=1', '--sample_at_end=False', '--device=cpu']
MODELS = {
    ('gpt2', 'dense'): [],
    ('gpt2', 'moe'): ['--n_expert=4', '--n_expert_active=2', '--capacity_factor=1.0', '--router_bias_rate=0.01'],
    ('llama', 'dense'): ['--norm=rmsnorm', '--mlp=swiglu', '--pos=rope', '--n_kv_head=2', '--tie_embeddings=False'],
    ('llama', 'moe'): ['--norm=rmsnorm', '--mlp=swiglu', '--pos=rope', '--n_kv_head=2', '--tie_embeddings=False',
                       '--n_expert=4', '--n_expert_active=2', '--router=sigmoid', '--router_z_loss_weight=0.01',
                       '--n_shared_expert=1'],
}
ROWS_2 = ['--batch_size=2', '--gradient_accumulation_steps=4']  # train.py's: 4 micro-batches of 2 rows
PIPELINED = ['--batch_size=4', '--n_microbatches=2', '--gradient_accumulation_steps=2']  # 2 microbatches of 2
# (strategy, script, its flags, world): a world of 4 ranks, or the grid's 8
STRATEGIES = [
    ('ddp', 'train_ddp', ROWS_2, 4),
    ('fsdp2', 'train_fsdp', ROWS_2, 4),
    ('zero1', 'zero', ROWS_2 + ['--stage=1'], 4),
    ('zero3', 'zero', ROWS_2 + ['--stage=3'], 4),
    ('ep1', 'expert_parallel', ROWS_2 + ['--ep=1'], 4),
    ('ep2', 'expert_parallel', ROWS_2 + ['--ep=2'], 4),
    ('tp2', 'tensor_parallel', ROWS_2 + ['--tp=2'], 4),
    ('tp2-sp', 'tensor_parallel', ROWS_2 + ['--tp=2', '--sequence_parallel=True'], 4),
    ('pp2-1f1b', 'pipeline', PIPELINED + ['--pp=2', '--schedule=1f1b'], 4),
    ('pp2-zb1', 'pipeline', PIPELINED + ['--pp=2', '--schedule=zb1'], 4),
    ('cp2-ring', 'context_parallel', ROWS_2 + ['--cp=2', '--cp_attention=ring'], 4),
    ('cp2-ulysses', 'context_parallel', ROWS_2 + ['--cp=2', '--cp_attention=ulysses'], 4),
    ('4d-dp2-pp2', 'parallel_4d', PIPELINED + ['--pp=2'], 4),
    ('4d-pp2-cp2-tp2', 'parallel_4d', PIPELINED + ['--pp=2', '--cp=2', '--tp=2'], 8),
    ('4d-dp4-tp2-ep2', 'parallel_4d', ROWS_2 + ['--tp=2', '--ep=2', '--n_microbatches=1'], 8),
    ('4d-dp2-pp2-tp2-ep2-zb1-sp', 'parallel_4d', PIPELINED + ['--pp=2', '--tp=2', '--ep=2', '--schedule=zb1',
                                                            '--sequence_parallel=True'], 8),
]
# bfloat16, the GPU's default, on two of the models (with every option between them): CI has no GPU
IN_BF16, BF16 = [('gpt2', 'dense'), ('llama', 'moe')], ['--dtype=bfloat16']
# the cells that must refuse (a dense model has no experts to share out), and the line that says why
REFUSED = {('ep1', 'dense'): 'n_expert=0: a dense model has no experts',
           ('ep2', 'dense'): 'n_expert=0: a dense model has no experts',
           ('4d-dp4-tp2-ep2', 'dense'): '--ep=2 needs a mixture of experts',
           ('4d-dp2-pp2-tp2-ep2-zb1-sp', 'dense'): '--ep=2 needs a mixture of experts'}


def keep_clip_norms(patch=setattr):
    """Every gradient norm the clips return from now on, in a list: torch's clip_grad_norm_ (train.py,
    train_ddp.py, train_fsdp.py, context_parallel.py) and common.distributed's (the others take it by name when
    imported: patched before any script is). A norm counted wrong (a tied weight twice, experts left out) only
    scales every gradient alike, which AdamW all but undoes: the losses move by 1e-6, the norm does not."""
    import torch
    from common import distributed
    norms = []
    for owner, name in ((torch.nn.utils, 'clip_grad_norm_'), (distributed, 'clip_grad_norm')):
        def kept(*args, clip=getattr(owner, name), **kwargs):
            norm = clip(*args, **kwargs)
            norms.append(float(norm.full_tensor() if hasattr(norm, 'full_tensor') else norm))  # (FSDP2: a DTensor)
            return norm
        patch(owner, name, kept)
    return norms


def run_cells(rank, world_size, cells, out_root):
    """In each rank: every cell's main() in turn, its printing and the norms its clip returned kept (rank 0's in
    out_root/cell/stdout.txt and norms.json). Returns {cell: None (it trained: its log is in out_root/cell) or
    the line it stopped with}."""
    results, norms = {}, keep_clip_norms()
    for name, script, argv in cells:
        out_dir, printed = os.path.join(out_root, name), io.StringIO()
        norms.clear()
        try:
            with contextlib.redirect_stdout(printed):
                importlib.import_module(script).main(argv + [f'--out_dir={out_dir}'])
            results[name] = None
        except SystemExit as e:
            results[name] = str(e.code)
        if rank == 0 and results[name] is None:
            with open(os.path.join(out_dir, 'stdout.txt'), 'w') as f:
                f.write(printed.getvalue())
            with open(os.path.join(out_dir, 'norms.json'), 'w') as f:
                json.dump(norms, f)
    return results


@pytest.fixture(scope='module')
def matrix(tmp_path_factory):
    """Every cell run: {world: [each rank's {cell: outcome}]}, and the root of their out_dirs."""
    out_root = str(tmp_path_factory.mktemp('matrix'))
    outcomes = {}
    for world in (4, 8):
        cells = [(f'{s}-{layout}-{kind}', script, COMMON + flags + MODELS[layout, kind])
                 for s, script, flags, w in STRATEGIES if w == world for layout, kind in MODELS]
        cells += [(f'{s}-{layout}-{kind}-bf16', script, COMMON + flags + MODELS[layout, kind] + BF16)
                  for s, script, flags, w in STRATEGIES if w == world for layout, kind in IN_BF16]
        outcomes[world] = spawn(run_cells, world, cells, out_root, timeout=600)
    return outcomes, out_root


@pytest.mark.parametrize('layout,kind', list(MODELS), ids=['-'.join(k) for k in MODELS])
@pytest.mark.parametrize('strategy,world', [(s, w) for s, _, _, w in STRATEGIES], ids=[s[0] for s in STRATEGIES])
def test_every_strategy_trains_train_py_first_steps_or_refuses(matrix, tmp_path_factory, strategy, world,
                                                               layout, kind):
    outcomes, out_root = matrix
    cell = f'{strategy}-{layout}-{kind}'
    seen = [per_rank[cell] for per_rank in outcomes[world]]
    if (strategy, kind) in REFUSED:  # one line, 'error: ...', the same on every rank, before any work
        assert len(set(seen)) == 1 and seen[0] is not None, seen
        assert seen[0].startswith('error: ') and REFUSED[strategy, kind] in seen[0] and '\n' not in seen[0], seen
        assert not os.path.exists(os.path.join(out_root, cell, 'log.jsonl'))
        return
    assert seen == [None] * world, f"{cell} stopped: {seen}"
    want = train_losses(train_py_reference(COMMON + ROWS_2 + MODELS[layout, kind], tmp_path_factory))
    assert_same_losses(train_losses(os.path.join(out_root, cell)), want, range(3))


@pytest.fixture(scope='module')
def train_py_norms(tmp_path_factory):
    """{model: the gradient norms train.py's clip returned, an iteration each}, train.py run here again with
    its clip watched."""
    by_model = {}
    for model, flags in MODELS.items():
        with pytest.MonkeyPatch.context() as patched:
            norms = keep_clip_norms(patched.setattr)
            run_train_py_here(COMMON + ROWS_2 + flags + [f"--out_dir={tmp_path_factory.mktemp('norms')}"])
        by_model[model] = norms
    return by_model


@pytest.mark.parametrize('strategy,layout,kind', [(s, layout, kind) for s, _, _, _ in STRATEGIES
                                                 for layout, kind in MODELS if (s, kind) not in REFUSED])
def test_every_strategy_clips_at_train_py_s_gradient_norm(matrix, train_py_norms, strategy, layout, kind):
    """The norm each cell's clip returned at each iteration is train.py's whole-model norm (to 1e-5): every
    parameter counted once, over every shard, slice, stage and expert."""
    _, out_root = matrix
    norms = json.load(open(os.path.join(out_root, f'{strategy}-{layout}-{kind}', 'norms.json')))
    assert len(norms) == len(train_py_norms[layout, kind]) == 3 and norms == pytest.approx(
        train_py_norms[layout, kind], rel=1e-5), (norms, train_py_norms[layout, kind])


@pytest.mark.parametrize('layout,kind', IN_BF16, ids=['-'.join(k) for k in IN_BF16])
@pytest.mark.parametrize('strategy,world', [(s, w) for s, _, _, w in STRATEGIES], ids=[s[0] for s in STRATEGIES])
def test_every_strategy_trains_in_bfloat16_near_train_py_in_float32(matrix, tmp_path_factory, strategy, world,
                                                                    layout, kind):
    """bfloat16, the dtype every script takes on a GPU (autocast; zero.py and the grid keep their parameters in
    bf16 too): every cell runs on every rank (or refuses as in fp32), its first losses within 2e-3 of
    train.py's fp32 ones: bf16's rounding moves them by 4.4e-4 at most here (zero1 on LLaMA MoE), a learning
    rate off by half by 1.5%. The pipeline grids failed in bf16 until their stages' buffers took the stream's
    dtype."""
    outcomes, out_root = matrix
    cell = f'{strategy}-{layout}-{kind}-bf16'
    seen = [per_rank[cell] for per_rank in outcomes[world]]
    if (strategy, kind) in REFUSED:
        assert len(set(seen)) == 1 and seen[0] is not None and REFUSED[strategy, kind] in seen[0], seen
        return
    assert seen == [None] * world, f"{cell} stopped: {seen}"
    want = train_losses(train_py_reference(COMMON + ROWS_2 + MODELS[layout, kind], tmp_path_factory))
    assert_same_losses(train_losses(os.path.join(out_root, cell)), want, range(3), rel=2e-3)


@pytest.mark.parametrize('cell', [f'ep{ep}-{layout}-moe' for ep in (1, 2) for layout in ('gpt2', 'llama')])
def test_expert_parallel_reports_its_all_to_alls_beside_the_formula(matrix, cell):
    """expert_parallel.py's report, the first step's: with ep 1 (every expert on each rank) no all-to-all,
    counted and modelled; with ep 2 the dispatch and the combine's backward hand every token's k slots (the
    routing decides where, not how many): together half of the formula's four all-to-alls, exactly, where no
    slot is dropped (LLaMA's MoE here); GPT-2's capacity factor of 1 drops some, which go nowhere."""
    from helpers import read_log
    outcomes, out_root = matrix
    rows = [r for r in read_log(os.path.join(out_root, cell)) if 'all_to_all_bytes_by_kind' in r]
    assert len(rows) == 4, rows
    for r in rows:
        if cell.startswith('ep1'):
            assert r['all_to_all_bytes'] == r['all_to_all_bytes_formula'] == 0, r
        else:
            slots = r['all_to_all_bytes_by_kind']['dispatch'] + r['all_to_all_bytes_by_kind']['combine backward']
            if 'llama' in cell:
                assert slots == r['all_to_all_bytes_formula'] / 2 > 0, r
            else:
                assert 0.5 * r['all_to_all_bytes_formula'] / 2 < slots < r['all_to_all_bytes_formula'] / 2, r


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_the_planner_prices_the_grids_pipeline_sends_as_counted(matrix, dtype):
    """bench.py --estimate's dp x PP ZeRO-1 row (parallel_4d.py) prices the first stage's sends, its
    activations and the tied embedding's gradient, in the grid's dtype: bf16 where its ZeRO-1 keeps the
    weights in bf16 (pipeline.py's autocast stream stays fp32); against what each rank counted at its calls."""
    from common import planner
    from helpers import read_log, stdlib_vocab
    outcomes, out_root = matrix
    cell = '4d-dp2-pp2-gpt2-dense' + ('-bf16' if dtype == 'bfloat16' else '')
    counted = [r['collective_bytes_by_kind'] for r in read_log(os.path.join(out_root, cell)) if 'numel' in r]
    assert len(counted) == 4, counted
    gptconf = planner.gpt_config_from(None, COMMON + MODELS['gpt2', 'dense'], stdlib_vocab())
    rows = planner.estimate(gptconf, 4, 1, 2, 16, 1, 2, 1, 2, dtype == 'bfloat16')
    grid = [r for r in rows if r['pp'] == r['dp'] == 2]  # (dp=2 x PP=2 1F1B, ZeRO-1)
    assert len(grid) == 1, rows
    assert grid[0]['comm_parts']['pp'][0] == max(c['pp send'] + c.get('embed all_reduce', 0) for c in counted)


@pytest.mark.parametrize('layout', ['gpt2', 'llama'])
def test_the_planner_prices_the_grid_with_experts_as_the_ranks_held_them(matrix, layout):
    """bench.py --estimate's row for dp x tp x ep (parallel_4d.py: 1/tp of the dense weights, n_expert/(ep·tp)
    whole experts, each part's AdamW state sharded over the ranks that hold the same) holds each rank's
    measured bytes: its two ZeRO-1 engines' parameters, gradients and AdamW moments."""
    from common import planner
    from common.data import load_dataset
    from helpers import read_log
    outcomes, out_root = matrix
    rows = [r for r in read_log(os.path.join(out_root, f'4d-dp4-tp2-ep2-{layout}-moe')) if 'numel' in r]
    assert sorted(r['rank'] for r in rows) == list(range(8))
    flags = COMMON + MODELS[layout, 'moe']
    gptconf = planner.gpt_config_from(None, flags, load_dataset('stdlib_char')[1])
    plan = [p for p in planner.estimate(gptconf, 8, 1, 2, 16, 2, 1, 1, 1, False, 2) if p['ep'] == p['tp'] == 2]
    assert len(plan) == 1 and 'error' not in plan[0], plan
    for r in rows:
        assert (r['param_bytes'], r['grad_bytes'], r['optim_bytes']) == (
            plan[0]['param_bytes'], plan[0]['grad_bytes'], plan[0]['optim_bytes']), (r, plan[0])


GRIDS = {'4d-pp2-cp2-tp2': (1, 2, 2, 2), '4d-dp4-tp2-ep2': (4, 1, 1, 2), '4d-dp2-pp2-tp2-ep2-zb1-sp': (2, 2, 1, 2)}


@pytest.mark.parametrize('cell', [f'{g}-{layout}-{kind}' for g in GRIDS for layout, kind in MODELS
                                  if ('ep2' not in g or kind == 'moe')])
def test_the_grid_logs_its_groups_and_holds_zero_1s_slices(matrix, cell):
    """Each grid cell: every rank's groups are the rows of torch.arange(8).view(dp, pp, cp, tp), its ep group a run
    of ep ranks of its dp x cp group and its expert-data-parallel group the ranks of that group with its ep rank;
    its ZeRO-1 engines hold the formula's bytes (AdamW's chunks up to their padding)."""
    from test_parallel_4d import assert_groups_are_the_grids_rows
    from helpers import read_log
    outcomes, out_root = matrix
    out_dir, shape = os.path.join(out_root, cell), GRIDS[cell.rsplit('-', 2)[0]]
    assert_groups_are_the_grids_rows(out_dir, shape)
    ep = 2 if '-ep2' in cell else 1
    for r in [r for r in read_log(out_dir) if 'groups' in r]:
        g, me = r['groups'], r['rank']
        run = g['dp_cp'].index(me) // ep * ep
        assert g.get('ep', [me]) == g['dp_cp'][run:run + ep], r
        assert g.get('edp', g['dp_cp']) == g['dp_cp'][g['dp_cp'].index(me) % ep::ep], r
    rows = [r for r in read_log(out_dir) if 'numel' in r]
    assert sorted(r['rank'] for r in rows) == list(range(8))
    for r in rows:
        assert (r['param_bytes'], r['grad_bytes']) == (r['param_bytes_formula'], r['grad_bytes_formula']), r
        assert r['optim_bytes_formula'] <= r['optim_bytes'] <= r['optim_bytes_formula'] + 2 * 16 * 2 * 8, r


@pytest.mark.parametrize('cell', ['pp2-1f1b', '4d-dp2-pp2'])
def test_the_pipelined_cells_print_that_note_for_a_moe_only(matrix, cell):
    """The scripts hand run_shape their model's experts: the MoE cells print the note with the flags the matrix
    compares them at (ROWS_2), the dense cells none."""
    _, out_root = matrix
    for kind in ('moe', 'dense'):
        printed = open(os.path.join(out_root, f'{cell}-gpt2-{kind}', 'stdout.txt')).read()
        note = "note: a mixture of experts routes each microbatch (2 rows) on its own, its auxiliary loss and " \
               "capacity too: train.py's curve with " + ' '.join(ROWS_2)
        assert (note in printed) == (kind == 'moe'), printed[:600]


@pytest.mark.parametrize('script', ['pipeline', 'parallel_4d'])
def test_a_pipelined_mixture_of_experts_names_the_curve_it_trains(script):
    """A router sees one forward's tokens: a pipeline's MoE routes (and balances, and caps) each microbatch on
    its own, so it trains train.py's curve at a microbatch's rows a micro-step (the matrix compares PIPELINED with
    ROWS_2: found by a helper's audit, 3e-3 apart at the same batch flags). The run's first lines say which
    flags that is; a dense model, whose loss does not depend on the split, gets no note."""
    from common.config import configure
    from common.training import run_shape
    module = importlib.import_module(script)
    for kind, flags in (('moe', MODELS[('gpt2', 'moe')]), ('dense', [])):
        cfg = configure(module.config, COMMON + PIPELINED + flags)
        lines = run_shape('the grid', cfg, 1e6, cfg.n_expert).splitlines()
        if kind == 'dense':
            assert len(lines) == 1, lines
        else:
            assert len(lines) == 2 and lines[1].endswith('train.py\'s curve with ' + ' '.join(ROWS_2)), lines
