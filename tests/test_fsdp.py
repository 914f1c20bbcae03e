"""train_fsdp.py: FSDP2 (fully_shard) trains the same model to the same numbers as train.py, resumes from its
sharded (DCP) checkpoint as if uninterrupted, and consolidates it offline into a train.py checkpoint that train.py,
and FSDP on another world size, continue exactly; a step it does not measure makes no measuring call."""
import os
import shutil
import subprocess
import sys
import warnings

import torch

from common import formulas
from consolidate import consolidate
from helpers import (REPO, TINY, assert_same_checkpoint, assert_same_losses, check, eval_losses,
                     measuring_calls_per_step, read_log, run_script, run_train_py_here, spawn, train_losses,
                     train_py_reference)
from test_ddp import ARGS, assert_survivors_fail_when_a_rank_dies

import pytest


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """ref: train.py for 8 iterations. f: FSDP on 2 ranks for 4 (sharded checkpoint), consolidated offline into a
    ckpt.pt, then resumed from the sharded checkpoint alone to 8 and consolidated again. g: a copy of f at 4 that
    train.py continues from the consolidated ckpt.pt. h: another copy that FSDP on 3 ranks continues from that
    ckpt.pt (each rank reading its shards of it) with activation checkpointing, its shards consolidated at 8."""
    d = {name: str(tmp_path_factory.mktemp(name)) for name in ('f',)}
    d['g'], d['h'] = d['f'] + '_g', d['f'] + '_h'
    d['ref'] = train_py_reference(ARGS + ['--max_iters=8'], tmp_path_factory)
    check(run_script('train_fsdp.py', ARGS + [f'--out_dir={d["f"]}', '--max_iters=4'], nproc=2))
    with warnings.catch_warnings():  # (torch had warned on stderr, at every join, that no_dist is one process)
        warnings.filterwarnings('error', message='torch.distributed is disabled')
        consolidate(str(d["f"]))
    d['f_log4'] = train_losses(d['f'])
    for copy in ('g', 'h'):
        shutil.copytree(d['f'], d[copy])
        shutil.rmtree(os.path.join(d[copy], 'ckpt_dcp'))  # only the consolidated ckpt.pt: make sure of it
    run_train_py_here(ARGS + [f'--out_dir={d["g"]}', '--max_iters=8', '--init_from=resume'])
    check(run_script('train_fsdp.py', ARGS + [f'--out_dir={d["h"]}', '--max_iters=8', '--init_from=resume',
                                              '--activation_checkpointing=True'], nproc=3))
    consolidate(str(d["h"]))
    os.remove(os.path.join(d['f'], 'ckpt.pt'))  # resume from the shards alone
    check(run_script('train_fsdp.py', ARGS + [f'--out_dir={d["f"]}', '--max_iters=8', '--init_from=resume'], nproc=2))
    consolidate(str(d["f"]))
    return d


def test_fsdp_two_ranks_logs_train_py_losses(runs):
    assert_same_losses(runs['f_log4'], train_losses(runs['ref']), range(4))


def test_train_py_continues_from_consolidated_checkpoint(runs):
    """The consolidated ckpt.pt (full model, plain AdamW state in configure_optimizers' order, written offline one
    tensor at a time from the shards) continues in train.py exactly as the uninterrupted train.py run: so it was
    train.py's state at 4."""
    assert_same_losses(train_losses(runs['g']), train_losses(runs['ref']), range(8))
    assert_same_checkpoint(os.path.join(runs['g'], 'ckpt.pt'), os.path.join(runs['ref'], 'ckpt.pt'))


def test_sharded_resume_is_uninterrupted_run(runs):
    """Resumed from its DCP shards at 4: the losses 4..7 and the consolidated state at 8 are train.py's."""
    assert not os.path.exists(os.path.join(runs['f'], 'ckpt_dcp.tmp'))
    assert_same_losses(train_losses(runs['f']), train_losses(runs['ref']), range(8))
    assert_same_losses(eval_losses(runs['f']), eval_losses(runs['ref']), [0, 4, 8])
    assert_same_checkpoint(os.path.join(runs['f'], 'ckpt.pt'), os.path.join(runs['ref'], 'ckpt.pt'))


def test_three_ranks_continue_from_a_whole_checkpoint_with_activation_checkpointing(runs):
    """Another world size, from the whole ckpt.pt (memory-mapped, each rank copying out its shards), with
    recomputation: the losses 4..7 and the consolidated state at 8 are train.py's."""
    assert_same_losses(train_losses(runs['h']), train_losses(runs['ref']), range(8))
    assert_same_losses(eval_losses(runs['h']), eval_losses(runs['ref']), [0, 4, 8])
    assert_same_checkpoint(os.path.join(runs['h'], 'ckpt.pt'), os.path.join(runs['ref'], 'ckpt.pt'))


@pytest.mark.parametrize('run,world_size', [('f', 2), ('h', 3)])
def test_held_bytes_are_the_shards_and_match_psi_over_n(runs, run, world_size):
    """The logged per-rank bytes add up to the whole model's 4Ψ (parameters), 4Ψ (gradients), 8Ψ (AdamW m and
    v); no rank holds more than its padded share (ceil(dim 0 / N) rows of every parameter, FSDP's chunk), and
    the formula logged beside each is 4Ψ/N, 4Ψ/N, 8Ψ/N."""
    from model import GPT, GPTConfig
    rows = [r for r in read_log(runs[run]) if 'rank' in r]
    rows = [r for r in rows if r['iter'] == rows[-1]['iter']]  # (the first iteration of the last run)
    assert sorted(r['rank'] for r in rows) == list(range(world_size))
    model = GPT(GPTConfig(block_size=16, vocab_size=torch.load(os.path.join(runs[run], 'ckpt.pt'),
                                                               weights_only=False)['model_args']['vocab_size'],
                          n_layer=2, n_head=4, n_embd=16, bias=False))
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    padded_share = sum(-(-p.shape[0] // world_size) * p[0].numel() for p in params)
    for r in rows:  # one layer's activations (fp32; run h checkpoints: the block keeps nothing inside itself)
        assert r['activation_bytes'] == (r['activation_bytes_formula'] if run == 'f' else 0), r
        assert r['activation_bytes_formula'] == (formulas.saved_bytes_formula(model.config, 16, 4)
                                                 if run == 'f' else None)
    for r in rows:  # accumulating 3 (2 ranks) or 2 (3 ranks) micro-steps without sync holds full-size gradients
        assert r['micro_steps'] > 1 and r['peak_grad_bytes'] == r['peak_grad_bytes_formula'] == 4 * numel
    for key, per_param in (('param_bytes', 4), ('grad_bytes', 4), ('optim_bytes', 8)):
        assert sum(r[key] for r in rows) == per_param * numel
        for r in rows:
            assert r[key + '_formula'] == pytest.approx(per_param * numel / world_size)
            assert r[key] <= per_param * padded_share
    # bench.py --estimate's FSDP2 row holds what the ranks held: fp32 shards, the whole fp32 gradients while
    # the micro-steps accumulate, AdamW's moments (it priced ZeRO-3's 2 + 2 + 12 split before)
    from common import planner
    gptconf = planner.gpt_config_from(None, ARGS, model.config.vocab_size)
    plan = [p for p in planner.estimate(gptconf, world_size, 1, 4, 16, 1, 1, 1, rows[0]['micro_steps'], False)
            if p['strategy'].startswith('FSDP2')]
    for key in ('param_bytes', 'optim_bytes'):  # (summed: the shards' dim-0 rounding moves a rank's own)
        assert sum(r[key] for r in rows) == pytest.approx(world_size * plan[0][key]), (key, plan[0])
    assert all(r['peak_grad_bytes'] == plan[0]['grad_bytes'] for r in rows), plan[0]


@pytest.mark.parametrize('run,world_size', [('f', 2), ('h', 3)])
def test_bytes_sent_are_the_ring_formula_plus_gloos_all_reduce(runs, run, world_size):
    """What each rank's sockets sent in its measured step (torch's FSDP2 calls: nothing counts them at ours)
    is the ring formula logged beside it, both gathers every micro-step and one reduce-scatter a step, plus
    what gloo adds: its reduce-scatter is an all-reduce underneath, (N-1)/N·4Ψ more; for Ψ the parameters as
    FSDP2 pads them (dim 0 rounded up to N equal shards: 5% more here on 3 ranks). A little less: in part,
    FSDP2 keeps the root's parameters (the embeddings, 23% of Ψ here) gathered from forward to backward."""
    from model import GPT, GPTConfig
    rows = [r for r in read_log(runs[run]) if 'rank' in r]
    rows = [r for r in rows if r['iter'] == rows[-1]['iter']]
    model = GPT(GPTConfig(block_size=16, vocab_size=torch.load(os.path.join(runs[run], 'ckpt.pt'),
                                                               weights_only=False)['model_args']['vocab_size'],
                          n_layer=2, n_head=4, n_embd=16, bias=False))
    n, padded = world_size, sum(-(-p.shape[0] // world_size) * world_size * p[0].numel() for p in model.parameters())
    for r in rows:
        gloo = r['wire_bytes_formula'] * padded / r['numel'] + (n - 1) / n * 4 * padded
        assert 0.95 * gloo <= r['wire_bytes'] <= gloo + 4096, (r['wire_bytes'], gloo, r)


def _layer_activations_worker(rank, world_size):
    """FSDP2 in bf16 (its MixedPrecisionPolicy, no autocast) on GPT-2's and LLaMA's block: the bytes the first
    block keeps for backward, measured (measure.first_block_saved_bytes, the gathered bf16 weights left out);
    saved_bytes_formula without autocast on a CPU and on a GPU, and with a GPU's autocast; the planner's
    (GPU) FSDP2 and ZeRO-3 rows' bytes a layer."""
    from common import formulas, planner
    from common.measure import first_block_saved_bytes
    from model import GPT, GPTConfig
    from train_fsdp import shard_model
    out = {}
    for name, layout in (('gpt2', {}), ('gpt2_swiglu', dict(mlp='swiglu')),
                         ('llama', dict(norm='rmsnorm', mlp='swiglu', pos='rope', n_kv_head=2, tie_embeddings=False))):
        torch.manual_seed(0)
        config = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=16, vocab_size=64, bias=False, **layout)
        model = shard_model(GPT(config), 'cpu', world_size, 'bfloat16')
        x = torch.randint(0, 64, (4, 16))
        with first_block_saved_bytes(model) as saved:
            model(x, x)[1].backward()
        formula = lambda **k: formulas.saved_bytes_formula(config, 16, 4, bytes_per_elem=2, fp32_weights=False,
                                                           **k)
        rows = {r['strategy'].split()[0]: r['activation_bytes_per_layer']
                for r in planner.estimate(config, world_size, 80, 4, 16, 1, 1, 1, 1, True)}
        out[name] = dict(measured=saved.bytes, cpu=formula(autocast=False, device_type='cpu'),
                         gpu=formula(autocast=False), gpu_autocast=formula(), planned=rows['FSDP2'],
                         planned_zero3=rows['ZeRO-3'])
    return out


def test_a_layers_activations_in_bf16_are_the_formula_without_autocast():
    """FSDP2 casts with its MixedPrecisionPolicy, not autocast, so a LayerNorm keeps its bf16 input, and its
    statistics in bf16 on a CPU (in fp32 on a GPU: CUDA's accumulate type); a GPU's autocast (zero.py's) would
    keep an fp32 copy of the input: 11% more on this block. RMSNorm computes in fp32 itself either way. The
    planner prices a GPU's FSDP2 and ZeRO-3 rows so."""
    for name, n in spawn(_layer_activations_worker, 1)[0].items():
        assert n['measured'] == n['cpu'] and n['planned'] == n['gpu'] and n['planned_zero3'] == n['gpu_autocast']
        if name != 'llama':  # (a LayerNorm; with SwiGLU, its bf16 output feeds both Linears as one input)
            assert n['cpu'] < n['gpu'] < n['gpu_autocast'] and n['gpu_autocast'] > 1.1 * n['cpu'], n
        else:
            assert n['cpu'] == n['gpu'] == n['gpu_autocast'], n


def test_bf16_run_reports_its_activations_and_bf16_gathers(tmp_path):
    """train_fsdp.py in bfloat16 on 2 ranks: the first block's activations are the formula of its report (no
    autocast, this CPU), and its sockets sent the ring formula with bf16 gathers (2 bytes, not 4) and one fp32
    reduce-scatter, plus gloo's all-reduce in its place."""
    check(run_script('train_fsdp.py', ARGS + [f'--out_dir={tmp_path}', '--max_iters=1', '--dtype=bfloat16'],
                     nproc=2))
    rows = [r for r in read_log(tmp_path) if 'rank' in r]
    assert len(rows) == 2
    for r in rows:
        psi, m = r['numel'], r['micro_steps']
        assert r['activation_bytes'] == r['activation_bytes_formula'] > 0, r
        assert r['wire_bytes_formula'] == pytest.approx(0.5 * psi * (2 * m * 2 + 4))
        gloo = r['wire_bytes_formula'] + 0.5 * 4 * psi
        assert 0.95 * gloo <= r['wire_bytes'] <= gloo + 4096, (r['wire_bytes'], gloo)


def test_with_dropout_the_activations_are_measured_not_priced(tmp_path):
    """Dropout's masks are saved for backward too, which saved_bytes_formula (dropout 0) does not count: the
    report leaves the formula out, and what it measures is more than the dropout-0 count."""
    from model import GPTConfig
    check(run_script('train_fsdp.py', ARGS + [f'--out_dir={tmp_path}', '--max_iters=1', '--dropout=0.1'],
                     nproc=2))
    rows = [r for r in read_log(tmp_path) if 'rank' in r]
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=16, bias=False)
    assert len(rows) == 2 and all(r['activation_bytes_formula'] is None for r in rows), rows
    assert all(r['activation_bytes'] > formulas.saved_bytes_formula(config, 16, 4) for r in rows), rows



def test_the_reports_notes_follow_the_run():
    """train_fsdp.py's report notes, which the rows alone do not say: the gradients' peak as accumulated or
    not, gloo's all-reduce only where there is a wire (N > 1; one process said '0 more' once), the activations'
    row only without activation checkpointing, and why there is no formula with dropout or experts."""
    from types import SimpleNamespace
    from common.reports import fsdp_notes
    from model import GPT, GPTConfig
    dense, moe = (GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=16, **kw))
                  for kw in ({}, dict(n_expert=4, n_expert_active=2)))
    run = lambda **kw: SimpleNamespace(**dict(dict(activation_checkpointing=False, dropout=0.0), **kw))
    wire = SimpleNamespace(sent=123, why_not=None)
    notes = fsdp_notes(run(), dense, 1000, 2, 4, wire)
    assert notes[0].endswith('over 2 micro-step(s): 4Ψ, unsharded, accumulated without a sync'), notes
    assert 'all-reduce underneath' in notes[2] and ': 3,000 more (measured a little less' in notes[2], notes
    assert notes[3] == 'activations: what block 0 saves for backward in the first micro-batch', notes
    assert fsdp_notes(run(), dense, 1000, 1, 4, wire)[0].endswith('4Ψ/N, one micro-step: each gradient '
                                                                 'reduce-scattered as it is made')
    assert not any('gloo' in note for note in fsdp_notes(run(), dense, 1000, 2, 1, wire))  # one process
    unmeasured = fsdp_notes(run(), dense, 1000, 2, 4, SimpleNamespace(sent=None, why_not='not read: why'))
    assert 'wire bytes not read: why' in unmeasured and not any('gloo' in note for note in unmeasured)
    for notes in (fsdp_notes(run(dropout=0.1), dense, 1000, 2, 4, wire), fsdp_notes(run(), moe, 1000, 2, 4, wire)):
        assert notes[-1].endswith(': no formula with dropout (its masks) or a mixture of experts (its router '
                                  'decides)'), notes
    assert not any('activations' in note for note in fsdp_notes(run(activation_checkpointing=True), dense, 1000, 2,
                                                                 4, wire))

def _mixed_precision_worker(rank, world_size):
    """bf16 MixedPrecisionPolicy: blocks compute with bf16 weights while the stored shards, their gradients and
    the reduction stay fp32; and with gradient sync off the sharded gradients are not produced (no
    reduce-scatter) until the last micro-step."""
    from torch.distributed.tensor import DTensor
    from model import GPT, GPTConfig
    from train_fsdp import shard_model
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=16, bias=False)
    model = shard_model(GPT(config), 'cpu', world_size, 'bfloat16')
    seen = []
    model.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, i, o: seen.append((m.weight.dtype, o.dtype)))
    x = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(rank))
    model.set_requires_gradient_sync(False)
    model(x, x)[1].backward()
    no_grad_yet = all(p.grad is None for p in model.parameters())
    model.set_requires_gradient_sync(True)
    model(x, x)[1].backward()
    p = model.transformer.h[0].attn.c_attn.weight
    return (seen[0], no_grad_yet, isinstance(p, DTensor), p.to_local().dtype, p.grad.to_local().dtype,
            tuple(p.to_local().shape), tuple(p.shape))


def test_bf16_mixed_precision_policy_and_deferred_gradient_sync():
    for rank, (dtypes, no_grad_yet, is_dtensor, param_dtype, grad_dtype, local, full) in enumerate(
            spawn(_mixed_precision_worker, 2)):
        assert dtypes == (torch.bfloat16, torch.bfloat16)
        assert no_grad_yet
        assert is_dtensor and param_dtype == torch.float32 and grad_dtype == torch.float32
        assert local == (full[0] // 2, full[1])


def run_alone(args, world_size='1'):
    """python train_fsdp.py with WORLD_SIZE set as torchrun would: the checks that run before any process group."""
    return subprocess.run([sys.executable, 'train_fsdp.py'] + args, cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, WORLD_SIZE=world_size))


def test_bad_input_is_one_line_and_non_zero(tmp_path):
    for args, world_size, message in [
            (['--gradient_accumulation_steps=2'], '3', 'error: gradient_accumulation_steps (2) must be divisible'),
            (['--dtype=float16'], '1', 'error: train_fsdp.py trains in float32 or bfloat16')]:
        proc = run_alone(TINY + args, world_size)
        assert proc.returncode == 1 and proc.stdout == '', proc.stderr
        assert proc.stderr.startswith(message) and proc.stderr.strip().count('\n') == 0, proc.stderr
    # after the process group (here a group of one); every rank fails alike (train_ddp's test shows it per rank)
    proc = run_alone(TINY + ['--dataset=no_such_data', f'--out_dir={tmp_path}'])
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error: data set 'no_such_data' not found"), proc.stderr
    assert proc.stderr.strip().count('\n') == 0, proc.stderr


def test_a_rank_that_dies_makes_the_others_exit_non_zero(tmp_path):
    assert_survivors_fail_when_a_rank_dies('train_fsdp.py', TINY + ['--gradient_accumulation_steps=2'],
                                           str(tmp_path))


def test_an_unmeasured_step_makes_no_measuring_call(tmp_path):
    """main() as a user runs it (2 ranks, 3 iterations, --measure_every=0): the first step reports each rank's
    held bytes (gathered with all_gather_object); the later steps make no barrier, all_gather_object,
    synchronize or clock call (the patches do see the first step's)."""
    argv = ARGS + ['--max_iters=3', '--eval_interval=3', '--sample_at_end=False', '--measure_every=0',
                   f'--out_dir={tmp_path}']
    for rank, per_step in enumerate(spawn(measuring_calls_per_step, 2, 'train_fsdp', argv)):
        assert len(per_step) == 3, (rank, per_step)
        assert per_step[0].get('all_gather_object', 0) > 0, (rank, per_step[0])
        assert per_step[1] == per_step[2] == {}, (rank, per_step)
