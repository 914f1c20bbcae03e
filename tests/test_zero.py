"""zero.py: every stage on 2 and 3 ranks trains the same numbers as train.py (one process, whole batch) with
accumulation, clipped (2 ranks) and not (3 ranks); stage 0/1/3 match DDP / ZeroRedundancyOptimizer / FSDP2; the
bytes it reports equal the ZeRO formulas; shard checkpoints resume exactly and consolidate into a train.py
checkpoint; bad input fails on every rank with one line."""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import (REPO, TINY, LoopbackFlood, assert_same_checkpoint, assert_same_losses, free_port,
                     measured_rows, read_log, spawn, stdlib_vocab, train_losses, train_py_reference)

import consolidate
from common import deepspeed_config
from common.checkpoints import rank_path
from common import formulas
import zero

# 8 layers so a block is a small part of the model (the stage-2/3 "never a full gradient" check means something);
# 6 micro-steps: 3 per rank on 2 ranks, 2 on 3; a clip far below the gradient norm, so it always clips.
ARGS = TINY + ['--n_layer=8', '--gradient_accumulation_steps=6', '--grad_clip=0.05', '--learning_rate=1e-2',
               '--warmup_iters=1', '--lr_decay_iters=10', '--weight_decay=0.1', '--log_interval=1']


LLAMA = ['--norm=rmsnorm', '--mlp=swiglu', '--pos=rope', '--n_kv_head=2', '--tie_embeddings=False']


def zero_args(out_dir, stage, max_iters=3, *extra):
    return ARGS + ['--bucket_size=1500', f'--out_dir={out_dir}', f'--stage={stage}', f'--max_iters={max_iters}',
                   f'--eval_interval={max_iters}', *extra]


def run_mains(rank, world_size, module, argvs):
    """In each spawned rank: module.main(argv) for each argv, one after the other, in one process group."""
    import importlib
    main = importlib.import_module(module).main
    for argv in argvs:
        main(argv)


def train_py(out_dir, max_iters=3, *extra):
    import train
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: on a loaded machine more threads only contend
    try:
        train.main(ARGS + [f'--out_dir={out_dir}', f'--max_iters={max_iters}', f'--eval_interval={max_iters}', *extra])
    finally:
        torch.set_num_threads(threads)
    return torch.load(os.path.join(out_dir, 'ckpt.pt'), weights_only=False)


def train_py_run(tmp_path_factory, *extra):
    """train.py, one process on the whole global batch: 3 iterations. Returns (out_dir, its checkpoint)."""
    out = train_py_reference(ARGS + ['--max_iters=3', '--eval_interval=3', *extra], tmp_path_factory)
    return out, torch.load(os.path.join(out, 'ckpt.pt'), weights_only=False)


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    return train_py_run(tmp_path_factory)


# On 2 ranks clipped (ARGS: a clip that always bites, so the norm over the shards is tested); on 3 unclipped:
# a clip that bites scales a sum of the ranks' gradients and their mean to the same norm (and AdamW's update
# barely sees the scale), so summing instead of averaging passed; unclipped, AdamW's moments show it.
@pytest.mark.parametrize('world_size, clip', [(2, []), (3, ['--grad_clip=0.0'])],
                         ids=['2-clipped', '3-unclipped'])
def test_every_stage_matches_train_py_and_formulas(tmp_path, tmp_path_factory, request, world_size, clip):
    """Params and AdamW state after 3 steps (accumulation; clipping on 2 ranks, none on 3) equal train.py's
    to 1e-5, the loss curves to 1e-5; the per-rank bytes equal the formulas up to padding; stages 2/3 never
    hold a full-size gradient."""
    ref_dir, ref = train_py_run(tmp_path_factory, *clip) if clip else request.getfixturevalue('reference')
    prefetching = [zero_args(tmp_path / f'prefetch{k}', 3, 3, f'--prefetch_blocks={k}', *clip)
                   for k in (0, 2)]
    runs = [zero_args(tmp_path / f's{s}', s, 3, *clip) for s in range(4)]
    serial = zero_args(tmp_path / 'serial', 3, 3, '--overlap_comm=False', *clip)
    spawn(run_mains, world_size, 'zero', runs + prefetching + [serial])
    # stage 3 gathering 0, 1 (the default) or 2 blocks ahead: the same numbers; each block ahead is one more
    # block's full parameters held at the peak, measured
    peaks = {}
    for k, out in ((0, tmp_path / 'prefetch0'), (1, tmp_path / 's3'), (2, tmp_path / 'prefetch2')):
        assert_same_losses(train_losses(out), train_losses(ref_dir))
        peaks[k] = max(r['peak_param_bytes'] for r in read_log(out) if 'rank' in r)
    block = sum(p.numel() for p in torch.nn.Module.get_submodule(meta_model(), 'transformer.h.0').parameters())
    block_bytes = 4 * world_size * -(-block // world_size)  # its bucket, padded to a multiple of N
    block_saved = formulas.saved_bytes_formula(meta_model().config, 16, 4)  # a block's, a micro-batch (4 x 16)
    assert peaks[1] - peaks[0] == peaks[2] - peaks[1] == block_bytes, (peaks, block_bytes)
    # each block's gradients reduced before backward fills the next (--overlap_comm=False): the same numbers,
    # and one block's full gradients fewer at the peak (the bucket in flight while the next one fills)
    assert_same_losses(train_losses(tmp_path / 'serial'), train_losses(ref_dir))
    grad_peaks = [max(r['peak_grad_bytes'] for r in read_log(out) if 'rank' in r)
                  for out in (tmp_path / 's3', tmp_path / 'serial')]
    assert grad_peaks[0] - grad_peaks[1] == block_bytes, (grad_peaks, block_bytes)
    for stage in range(4):
        out = str(tmp_path / f's{stage}')
        assert_same_losses(train_losses(out), train_losses(ref_dir))
        assert_same_checkpoint(torch.load(consolidate.consolidate(out), weights_only=False), ref)
        rows = [r for r in read_log(out) if 'rank' in r]
        assert sorted(r['rank'] for r in rows) == list(range(world_size))
        for r in rows:
            pad = 16 * world_size * r['buckets']  # at most N-1 padding elements per bucket, 16 bytes each
            for k in ('param_bytes', 'grad_bytes', 'optim_bytes'):
                assert r[k + '_formula'] <= r[k] <= r[k + '_formula'] + pad, (stage, k, r)
            # the calls zero.py made, under the ring formula, follow the paper's pattern for the stage (an
            # all-reduce, or a reduce-scatter per micro-step and one or two all-gathers), padding aside
            ring = r['wire_bytes_formula'] - r['wire_bytes_formula_by_kind'].get('scalars', 0)
            formula = r['comm_bytes_formula']  # the report's paper count, from Ψ alone
            assert formula * (1 - 1e-9) <= ring <= formula + 3 * pad, (stage, r)
            if stage == 0:
                assert ring == pytest.approx(formula, rel=1e-12)  # all-reduce: nothing padded
                assert set(r['collective_bytes_by_kind']) == {'all_reduce', 'scalars'}
            full_grads = 4 * r['numel']
            if stage >= 2:
                assert r['peak_grad_bytes'] < full_grads, (stage, r)
            else:
                assert r['peak_grad_bytes'] >= full_grads
            if stage == 3:
                assert r['peak_param_bytes'] < 4 * r['numel']
            # the activations saved for backward, measured: as backward starts every block's are alive (what
            # saved_bytes_formula reads off model.py), and at most the head's logits and log-softmax besides
            logits = 4 * 16 * stdlib_vocab() * 4
            assert 8 * block_saved <= r['peak_saved_bytes'] <= 8 * block_saved + 2 * logits, (stage, r)


def meta_model():
    from model import GPT, GPTConfig
    with torch.device('meta'):
        return GPT(GPTConfig(n_layer=8, n_head=4, n_embd=16, block_size=16, vocab_size=stdlib_vocab(),
                             bias=False))


def test_comm_bytes_per_step_are_the_theory():
    """One micro-step per rank: DP, ZeRO-1 and -2 send an all-reduce's worth, ZeRO-3 1.5 times that."""
    n, N = 10_000, 4
    all_reduce = 2 * (N - 1) / N * n * 4
    assert [formulas.comm_bytes_formula(n, N, s, 4) for s in range(4)] == [all_reduce] * 3 + [1.5 * all_reduce]
    assert formulas.model_state_bytes_formula(7_500_000_000, 64, 0, True)['param_bytes'] == 15e9
    gb = [sum(formulas.model_state_bytes_formula(7_500_000_000, 64, s, True).values()) / 1e9 for s in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]  # the ZeRO paper's worked example


def vs_pytorch(rank, world_size):
    """Our stage 0 / 1 / 3 against DDP / DDP + ZeroRedundancyOptimizer(AdamW) / FSDP2 fully_shard, 10 steps
    (the parameters within 1e-6; bit for bit here, torch 2.13 on a CPU)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    from model import GPT, GPTConfig, param_groups
    from common.distributed import Comm
    config = GPTConfig(n_layer=3, n_head=4, n_embd=16, block_size=16, vocab_size=64, bias=True)
    lr, betas, wd = 1e-2, (0.9, 0.99), 0.1

    def build():
        torch.manual_seed(0)
        return GPT(config)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 64, (2 * world_size, 16), generator=g)
        return x[2 * rank:2 * rank + 2], torch.roll(x, 1, 1)[2 * rank:2 * rank + 2]

    diffs = {}
    for stage, theirs_kind in ((0, 'DDP'), (1, 'ZeroRedundancyOptimizer'), (3, 'FSDP2')):
        ours, theirs = build(), build()
        z = zero.Zero(ours, stage, rank, world_size, wd, betas, 1e-8, 700, torch.float32, Comm(None, 'dp'))
        if theirs_kind == 'FSDP2':
            mesh = init_device_mesh('cpu', (world_size,))
            for block in theirs.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(theirs, mesh=mesh)
            wrapped, opt = theirs, torch.optim.AdamW(param_groups(theirs, wd), lr=lr, betas=betas)
        else:
            wrapped = DDP(theirs)
            groups = param_groups(theirs, wd)
            opt = (torch.optim.AdamW(groups, lr=lr, betas=betas) if theirs_kind == 'DDP' else
                   ZeroRedundancyOptimizer(groups[0]['params'], optimizer_class=torch.optim.AdamW, lr=lr,
                                           betas=betas, weight_decay=wd))
            if theirs_kind == 'ZeroRedundancyOptimizer':
                opt.add_param_group(groups[1])
        for step in range(10):
            x, y = batch(step)
            ours(x, y)[1].backward()
            z.finish_backward()
            z.step(lr)
            wrapped(x, y)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        full = full_params(z)
        worst = 0.0
        for name, p in theirs.named_parameters():
            p = p.full_tensor() if hasattr(p, 'full_tensor') else p
            worst = max(worst, (full[name] - p.detach()).abs().max().item())
        diffs[theirs_kind] = worst
        dist.barrier()
    return diffs


def full_params(z):
    """{name: full parameter} from every rank's fp32 master chunks (any stage)."""
    from common.distributed import all_gather_single
    full = {}
    for b in z.buckets:
        if z.stage == 0:
            flat = b.master
        else:
            flat = torch.empty(b.padded)
            all_gather_single(flat, b.master.contiguous())
        for name, view in zip(b.names, b.views(flat)):
            full[name] = view
    return full


def test_stages_match_pytorch_ddp_zero_redundancy_fsdp2():
    for diffs in spawn(vs_pytorch, 2):
        assert set(diffs) == {'DDP', 'ZeroRedundancyOptimizer', 'FSDP2'}
        assert all(d < 1e-6 for d in diffs.values()), diffs


@pytest.fixture(scope='module')
def split_runs(tmp_path_factory):
    """On 2 ranks: stages 1 and 3 (dropout on) for 2 iterations, then resumed from their shards to 3; stage 2 for 2
    iterations (consolidated and continued elsewhere); every stage for 1 iteration in bfloat16."""
    tmp = tmp_path_factory.mktemp('zero_split')
    argvs = []
    for stage in (1, 3):  # with dropout: every rank's own masks must resume exactly too
        drop = '--dropout=0.2'
        argvs += [zero_args(tmp / f'whole{stage}', stage, 3, drop), zero_args(tmp / f'split{stage}', stage, 2, drop),
                  zero_args(tmp / f'split{stage}', stage, 3, '--init_from=resume', '--eval_interval=2', drop)]
    argvs.append(zero_args(tmp / 'half2', 2, 2))
    argvs += [zero_args(tmp / f'offload{stage}', stage, 3, '--offload_optimizer=True') for stage in (1, 3)]
    argvs += [zero_args(tmp / f'bf16_{stage}', stage, 1, '--dtype=bfloat16') for stage in range(4)]
    argvs.append(zero_args(tmp / 'bf16_llama', 1, 1, '--dtype=bfloat16', *LLAMA))
    spawn(run_mains, 2, 'zero', argvs)
    return tmp


def test_consolidate_refuses_two_runs_unreadable_files_and_a_file_for_a_folder(split_runs, tmp_path):
    """consolidate.py had joined rank 0 of one run with rank 1 of another (same iteration, another seed or
    flag) without a word, and a truncated rank file or an unwritable destination was a traceback (the latter
    after the whole join): one line each, before the work."""
    mixed, cut = tmp_path / 'mixed', tmp_path / 'cut'
    mixed.mkdir()
    shutil.copy(rank_path(split_runs / 'whole1', zero.RANK_FILE, 0), mixed)
    shutil.copy(rank_path(split_runs / 'offload1', zero.RANK_FILE, 1), mixed)
    shutil.copytree(split_runs / 'whole1', cut)
    whole = open(rank_path(cut, zero.RANK_FILE, 1), 'rb').read()
    open(rank_path(cut, zero.RANK_FILE, 1), 'wb').write(whole[:3000])
    (tmp_path / 'a_file').write_text('')
    for args, words in [((mixed,), 'are from different runs (they differ in dropout, model_args, offload_'),
                        ((cut,), 'zero_rank1.pt is not a file this can read'),
                        ((split_runs / 'whole1', tmp_path / 'a_file'), 'cannot write ckpt.pt in')]:
        with pytest.raises(SystemExit) as e:
            consolidate.consolidate(*map(str, args))
        assert e.value.code.startswith('error: consolidate: ') and words in e.value.code, e.value.code


def test_shard_checkpoint_resume_is_identical(split_runs):
    for stage in (1, 3):
        whole, split = split_runs / f'whole{stage}', split_runs / f'split{stage}'
        assert train_losses(whole) == train_losses(split)
        for rank in range(2):
            a = torch.load(rank_path(whole, zero.RANK_FILE, rank), weights_only=False)['zero']
            b = torch.load(rank_path(split, zero.RANK_FILE, rank), weights_only=False)['zero']
            assert a['step'] == b['step'] == 3
            for key in ('master', 'exp_avg', 'exp_avg_sq'):
                assert len(a[key]) == len(b[key]) > 0 and all(torch.equal(x, y) for x, y in zip(a[key], b[key])), (
                    stage, rank, key)


def test_offload_optimizer_trains_the_same_numbers(split_runs, reference):
    """ZeRO-Offload (the master chunk and AdamW's state in host memory, updated there): on a CPU the same numbers as
    train.py, stages 1 and 3 (on a GPU the device's optimizer bytes would drop by 12Ψ/N in bf16)."""
    ref_dir, ref = reference
    for stage in (1, 3):
        out = str(split_runs / f'offload{stage}')
        assert_same_losses(train_losses(out), train_losses(ref_dir))
        assert_same_checkpoint(torch.load(consolidate.consolidate(out), weights_only=False), ref)
        # the engine files the fp32 master, m, v and the gradients' copies as the host's, none beside the model
        # (on a CPU the host is the device: this checks where held() files them and their bytes, not where
        # they live; on a GPU the device's optimizer bytes would drop, untested without one)
        for r in measured_rows(out, 2):
            assert r['optim_bytes'] == r['optim_bytes_formula'] == 0, r
            assert r['host_bytes_formula'] <= r['host_bytes'] <= r['host_bytes_formula'] + 32 * 2 * r['buckets'], r


def run_mains_counting(rank, world_size, module, argvs, as_nccl):
    """run_mains, counting the all-gathers and reduce-scatters handed to torch; as_nccl: with our code told
    the backend is NCCL, so all_gather_direct and reduce_scatter_of take the branch written for it
    (all_gather_into_tensor into the buffer, reduce_scatter_tensor into a chunk of its own), which gloo runs
    too. torch's own code calls its module's get_backend, not this name."""
    import torch.distributed as dist
    from common import distributed
    if as_nccl:
        dist.get_backend = lambda group=None: 'nccl'
    calls = {'all_gather': 0, 'reduce_scatter': 0}
    for name, fn in (('all_gather', distributed.all_gather_single),
                     ('reduce_scatter', distributed.reduce_scatter_single)):
        def counted(*args, _name=name, _fn=fn, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        setattr(distributed, f'{name}_single', counted)
    run_mains(rank, world_size, module, argvs)
    return calls


def test_the_collectives_branch_for_nccl_trains_the_same_numbers(tmp_path, tmp_path_factory):
    """Stages 1-3 on the calls zero.py makes on GPUs (CI's gloo takes the other branch of all_gather_direct
    and reduce_scatter_of): train.py's loss curve and checkpoint, unclipped (so a sum where the mean belongs
    shows in AdamW's moments), and the same bytes counted at the calls as the gloo branch's."""
    ref_dir, ref = train_py_run(tmp_path_factory, '--grad_clip=0.0')
    argvs = lambda name: [zero_args(tmp_path / f'{name}{s}', s, 3, '--grad_clip=0.0') for s in (1, 2, 3)]
    nccl = spawn(run_mains_counting, 2, 'zero', argvs('nccl'), True)
    gloo = spawn(run_mains_counting, 2, 'zero', argvs('gloo'), False)
    for kind in ('all_gather', 'reduce_scatter'):  # the branch ran: more of torch's calls than gloo's branch
        assert all(n[kind] > g[kind] for n, g in zip(nccl, gloo)), (kind, nccl, gloo)
    counted = lambda out: [r['collective_bytes_by_kind'] for r in read_log(str(out)) if 'rank' in r]
    for stage in (1, 2, 3):
        out = str(tmp_path / f'nccl{stage}')
        assert_same_losses(train_losses(out), train_losses(ref_dir))
        assert_same_checkpoint(torch.load(consolidate.consolidate(out), weights_only=False), ref)
        assert counted(out) == counted(tmp_path / f'gloo{stage}'), stage


def test_offload_copies_each_buckets_gradients_to_the_host_during_backward():
    """ZeRO-Offload overlaps the copy to the host with backward: when backward returns, every bucket but the
    one still being reduced (stage 2 keeps one in flight) has its reduced chunk on the host already; after
    finish_backward, and before any step, every one."""
    for during, after in spawn(offload_copy_during_backward, 2):
        assert len(after) > 2 and after == [True] * len(after), after
        assert sum(during) == len(during) - 1, during  # (copied only at the end: none would be)


def offload_copy_during_backward(rank, world_size):
    from model import GPT, GPTConfig
    from common.distributed import Comm
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=4, n_embd=16, block_size=16, vocab_size=64))
    z = zero.Zero(model, 2, rank, world_size, 0.1, (0.9, 0.99), 1e-8, 700, torch.float32, Comm(None, 'dp'),
                  offload=True)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(x, x)[1].backward()
    copied = lambda b: bool(torch.equal(b.grad_host, b.grad_shard)) and bool(b.grad_shard.abs().sum() > 0)
    during = [copied(b) for b in z.buckets]  # backward is over, finish_backward not yet
    z.finish_backward()
    after = [copied(b) for b in z.buckets]
    return during, after


@pytest.mark.parametrize('layout', ['llama', 'gpt2'])
def test_bfloat16_blocks_keep_what_the_formula_counts_over_bf16_weights(split_runs, layout):
    """zero.py computes with bf16 weights, so the residual stream is bf16: a LLaMA block (RMSNorm, SwiGLU,
    RoPE, GQA) keeps saved_bytes_formula(fp32_weights=False)'s bytes, the RMSNorm's normalised x in bf16 and
    one bf16 input for SwiGLU's two Linears (it counted them fp32 and twice: 10% more than measured here); a
    GPT-2 block's LayerNorm keeps the bf16 stream and bf16 statistics under a CPU's autocast (device_type='cpu';
    a GPU's autocast keeps an fp32 copy: 11% more here). Measured as backward starts: every block's, and the
    final norm's and the head's input besides, under three fp32 copies of the stream (2.6%: a count 7% low
    fails too)."""
    from model import GPTConfig
    llama = dict(n_kv_head=2, norm='rmsnorm', mlp='swiglu', pos='rope', tie_embeddings=False)
    config = GPTConfig(n_layer=8, n_head=4, n_embd=16, block_size=16, vocab_size=stdlib_vocab(), bias=False,
                       **(llama if layout == 'llama' else {}))
    blocks = 8 * formulas.saved_bytes_formula(config, 16, 4, bytes_per_elem=2, fp32_weights=False,
                                              device_type='cpu')
    stream = 4 * 16 * 16 * 4  # (b x s x h, fp32)
    rows = [r for r in read_log(split_runs / ('bf16_llama' if layout == 'llama' else 'bf16_1')) if 'rank' in r]
    assert len(rows) == 2 and all(blocks <= r['peak_saved_bytes'] <= blocks + 3 * stream for r in rows), rows


def test_bfloat16_holds_the_papers_2_2_12_bytes(split_runs):
    """bf16 parameters and gradients, fp32 master + Adam m, v: 2Ψ + 2Ψ + 12Ψ, sharded as each stage says."""
    for stage in range(4):
        rows = [r for r in read_log(split_runs / f'bf16_{stage}') if 'rank' in r]
        assert len(rows) == 2
        for r in rows:
            formula = formulas.model_state_bytes_formula(r['numel'], 2, stage, mixed_precision=True)
            for k, v in formula.items():
                assert v == r[k + '_formula'] and v <= r[k] <= v + 16 * 2 * r['buckets'], (stage, k, r)
            ring = r['wire_bytes_formula'] - r['wire_bytes_formula_by_kind'].get('scalars', 0)
            assert ring == pytest.approx(formulas.comm_bytes_formula(r['numel'], 2, stage, 2, micro_steps=3), rel=0.01)


def test_consolidate_then_train_py_and_other_world_sizes_continue_identically(split_runs, reference, tmp_path):
    """Stage 2 on 2 ranks for 2 iterations, consolidated: train.py, and zero.py stage 3 on 3 ranks, both resume
    from that ckpt.pt and end where train.py's own 3 iterations end."""
    ref_dir, ref = reference
    half = split_runs / 'half2'
    proc = subprocess.run([sys.executable, 'consolidate.py', str(half)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert torch.load(half / 'ckpt.pt', weights_only=False)['iter_num'] == 2
    other = tmp_path / 'stage3_on_3'
    other.mkdir()
    shutil.copy(half / 'ckpt.pt', other / 'ckpt.pt')
    shutil.copy(half / 'log.jsonl', other / 'log.jsonl')
    continued = train_py(str(half), 3, '--init_from=resume')
    assert_same_checkpoint(continued, ref)
    assert_same_losses(train_losses(half), train_losses(ref_dir))
    spawn(run_mains, 3, 'zero', [zero_args(other, 3, 3, '--init_from=resume', '--eval_interval=2')])
    assert_same_checkpoint(torch.load(consolidate.consolidate(str(other)), weights_only=False), ref)


def test_deepspeed_config_read_and_unsupported_key_rejected(tmp_path):
    from common.config import configure
    cfg = deepspeed_config.apply_deepspeed_config(configure(zero.config, []),
                                                  os.path.join(REPO, 'config/ds_zero2.json'), 2)
    # train.py's batch: 16 sequences in micro-batches of 8 (DeepSpeed derives 16 / (8 x 2 ranks) = 1 micro-step a
    # rank; ours counts them summed over the ranks: 2)
    assert (cfg.stage, cfg.batch_size, cfg.gradient_accumulation_steps, cfg.grad_clip, cfg.dtype) == \
        (2, 8, 2, 1.0, 'float32')
    assert (cfg.learning_rate, cfg.beta1, cfg.beta2, cfg.adam_eps, cfg.weight_decay) == (2e-3, 0.9, 0.99, 1e-8, 0.1)
    for s in (1, 3):
        assert deepspeed_config.apply_deepspeed_config(configure(zero.config, []),
                                           os.path.join(REPO, f'config/ds_zero{s}.json'), 1).stage == s
    bad = tmp_path / 'ds.json'
    bad.write_text('{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true}}}')
    assert deepspeed_config.apply_deepspeed_config(configure(zero.config, []), str(bad), 1).offload_optimizer is True
    bad.write_text('{"zero_optimization": {"stage": 3, "overlap_comm": false}}')
    assert deepspeed_config.apply_deepspeed_config(configure(zero.config, []), str(bad), 1).overlap_comm is False
    bad.write_text('{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}')
    with pytest.raises(SystemExit, match="offload_optimizer.device 'nvme'"):
        deepspeed_config.apply_deepspeed_config(configure(zero.config, []), str(bad), 1)
    bad.write_text('{"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}')
    with pytest.raises(SystemExit, match='zero_optimization.offload_param'):
        deepspeed_config.apply_deepspeed_config(configure(zero.config, []), str(bad), 1)
    assert (cfg.decay_lr, cfg.warmup_iters, cfg.lr_decay_iters, cfg.min_lr) == (True, 50, 1250, pytest.approx(2e-4))
    bad.write_text('{"scheduler": {"type": "OneCycle", "params": {}}}')
    with pytest.raises(SystemExit, match="scheduler: zero.py runs a WarmupCosineLR"):
        deepspeed_config.apply_deepspeed_config(configure(zero.config, []), str(bad), 1)
    bad.write_text('{"fp16": {"enabled": true}}')
    with pytest.raises(SystemExit, match="'fp16'"):
        deepspeed_config.apply_deepspeed_config(configure(zero.config, []), str(bad), 1)


def test_deepspeed_config_in_order_and_bad_values_in_one_line(tmp_path, capsys):
    """nanoGPT's rule holds for the JSON too: it overrides the flags before it, the flags after it override it
    (with a note); a value zero.py cannot run (DeepSpeed's "auto", a wrong type, a string where an object
    goes, a 0 batch) is one line naming the JSON key, never a traceback or a silent default."""
    from common.config import configure
    ds3 = os.path.join(REPO, 'config/ds_zero3.json')  # stage 3, 16 sequences in micro-batches of 8, lr 2e-3
    argv = ['--stage=1', '--learning_rate=1e-3', f'--deepspeed_config={ds3}', '--batch_size=4']
    cfg = zero.check_config(configure(zero.config, argv), 1, argv)
    assert (cfg.stage, cfg.learning_rate, cfg.batch_size) == (3, 2e-3, 4)
    assert cfg.gradient_accumulation_steps == 4  # the JSON's 16 sequences, from the final micro-batch (DeepSpeed's)
    assert "--batch_size=4 (after --deepspeed_config) overrides" in capsys.readouterr().err
    argv = [f'--deepspeed_config={ds3}', '--learning_rate=1e-3']  # the floor: cos_min_ratio 0.1 of the final peak
    assert zero.check_config(configure(zero.config, argv), 1, argv).min_lr == pytest.approx(1e-4)
    argv = [f'--deepspeed_config={ds3}', '--stage=1']
    assert zero.check_config(configure(zero.config, argv), 1, argv).stage == 1
    bad = tmp_path / 'ds.json'
    bad.write_text('{"train_batch_size": 32, "gradient_accumulation_steps": 2}')  # the micro batch follows: 8
    cfg = deepspeed_config.apply_deepspeed_config(configure(zero.config, []), str(bad), 2)
    assert (cfg.batch_size, cfg.gradient_accumulation_steps) == (8, 4)
    for text, says in [('{"train_micro_batch_size_per_gpu": "auto"}', 'train_micro_batch_size_per_gpu is "auto"'),
                       ('{"bf16": {"enabled": "auto"}}', 'bf16.enabled is "auto"'),
                       ('{"train_batch_size": "auto"}', 'train_batch_size is "auto"'),
                       ('{"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}}',
                        'scheduler.params.total_num_steps is "auto"'),
                       ('{"zero_optimization": 3}', 'zero_optimization must be a JSON object'),
                       ('{"zero_optimization": {"offload_optimizer": "cpu"}}', 'offload_optimizer must be a JSON'),
                       ('{"zero_optimization": {"stage": "3"}}', "zero_optimization.stage must be int, got '3'"),
                       ('{"optimizer": {"params": {"betas": 0.9}}}', 'betas must be list, got 0.9'),
                       ('{"optimizer": {"params": {"betas": [0.9]}}}', 'betas must be two numbers, got [0.9]'),
                       ('{"optimizer": {"params": {"lr": "3e-4"}}}', 'optimizer.params.lr must be float'),
                       ('{"train_micro_batch_size_per_gpu": 0}', 'train_micro_batch_size_per_gpu must be at least 1'),
                       ('{"train_batch_size": 16, "gradient_accumulation_steps": 0}',
                        'gradient_accumulation_steps must be at least 1, got 0'),
                       ('{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 32}',
                        'train_batch_size 16 must be micro batch × accumulation × 1 ranks'),
                       ('{"scheduler": {"type": "WarmupCosineLR", "params": null}}', 'zero.py runs a WarmupCosineLR'),
                       ('{"optimizer": {"params": {"betas": "auto"}}}', 'optimizer.params.betas is "auto"'),
                       ('[1]', 'deepspeed_config file must be a JSON object')]:
        bad.write_text(text)
        argv = [f'--deepspeed_config={bad}']
        with pytest.raises(SystemExit, match=re.escape(says)):
            zero.check_config(configure(zero.config, argv), 1, argv)


def launch_ranks(args, world_size=2, timeout=90):
    """world_size `python zero.py args` processes with torchrun's environment; (returncode, stderr) of each."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, 'zero.py'] + args, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                                       MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), OMP_NUM_THREADS='1'))
             for r in range(world_size)]
    stderrs = [p.communicate(timeout=timeout)[1] for p in procs]
    return [(p.returncode, stderr) for p, stderr in zip(procs, stderrs)]


@pytest.mark.parametrize('bad, message', [
    (['--stage=4'], 'stage must be 0, 1, 2 or 3'),
    (['--prefetch_blocks=-1'], '--prefetch_blocks must be 0 or more, got -1'),
    (['--gradient_accumulation_steps=1'], 'must be divisible by the data-parallel size dp=2'),
])
def test_bad_config_one_line_nonzero_on_every_rank(monkeypatch, capsys, bad, message):
    """Checked before the process group exists, so each rank is run here, in turn, as torchrun would start it."""
    from common.training import run_main
    for rank in range(2):
        monkeypatch.setattr(os, 'environ', dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE='2'))
        monkeypatch.setattr(sys, 'argv', ['zero.py'] + TINY + ['--gradient_accumulation_steps=2'] + bad)
        with pytest.raises(SystemExit) as exit_info:
            run_main(zero.main)
        assert exit_info.value.code == 1
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f'[rank {rank}] error: ') and message in lines[0], lines


def test_missing_dataset_one_line_nonzero_on_every_rank(tmp_path):
    for rank, (code, stderr) in enumerate(launch_ranks(TINY + [f'--out_dir={tmp_path}', '--dataset=no_such_data',
                                                               '--gradient_accumulation_steps=2'])):
        lines = [line for line in stderr.splitlines() if line.strip() and 'Warning' not in line]
        assert code is not None and code != 0, stderr
        assert len(lines) == 1 and lines[0].startswith(f'[rank {rank}] error: ') and \
            "data set 'no_such_data' not found" in lines[0], stderr


def test_resume_from_shards_of_different_iterations_is_one_line_on_every_rank(tmp_path):
    """A run stopped while saving can leave one rank's shard a save behind (each rank writes its own): resuming
    from that mix, or with a shard missing, stops every rank with one line (model.check_resume_files), not a model
    that never existed and not a hang; so does resuming another stage's shards."""
    args = TINY + [f'--out_dir={tmp_path}', '--gradient_accumulation_steps=2', '--max_iters=2']
    assert [code for code, _ in launch_ranks(args)] == [0, 0]

    def every_rank_says(messages, *extra):
        for rank, (code, stderr) in enumerate(launch_ranks(args + ['--init_from=resume', '--max_iters=4', *extra])):
            lines = [line for line in stderr.splitlines() if line.strip() and 'Warning' not in line]
            assert code is not None and code != 0, stderr
            assert len(lines) == 1 and lines[0].startswith(f'[rank {rank}] error: ') and messages[rank] in lines[0], \
                stderr

    every_rank_says(['saved with --stage=2 on 2 ranks, this run has --stage=3 on 2 ranks'] * 2, '--stage=3')
    shard = torch.load(tmp_path / 'zero_rank1.pt', weights_only=False)
    shard['iter_num'] -= 1  # rank 1's file from the save before (its contents need not change: only the iteration)
    torch.save(shard, tmp_path / 'zero_rank1.pt')
    every_rank_says(['different iterations (rank 0: 2, rank 1: 1;'] * 2)
    os.remove(tmp_path / 'zero_rank1.pt')
    every_rank_says(['rank(s) 1 found no checkpoint', 'no checkpoint at'])


def wire_runs(rank, world_size, out):
    """Every stage on a model whose collectives are large enough (~0.4 MB) that TCP's headers are noise."""
    from zero import main
    for stage in range(4):
        main(TINY + ['--n_embd=64', '--block_size=32', '--gradient_accumulation_steps=2', '--max_iters=1',
                     '--eval_interval=1', f'--stage={stage}', f'--out_dir={out}/s{stage}'])


def test_measured_wire_bytes_are_what_gloo_sends(tmp_path):
    """The bytes each rank's own sockets sent (measured while other traffic crosses the loopback interface)
    against what zero.py's calls send on gloo, which is not the ring formula for a reduce-scatter: stage 1's
    (gloo's reduce_scatter_tensor) is an all-reduce underneath, and stages 2-3 run that all-reduce in place
    themselves (reduce_scatter_of), 2(N-1)/N of the tensor either way. The all-gathers send the ring's (N-1)/N:
    gloo's ring in stage 1-2, and in stage 3 (all_gather_direct) each rank's chunk sent once to every other
    rank, N-1 chunks of 1/N. So the wire carries 1.5x the formula for ZeRO-1/2 (a reduce-scatter and an
    all-gather of the same bytes) and 4/3x for ZeRO-3 (one reduce-scatter, two all-gathers)."""
    with LoopbackFlood():
        spawn(wire_runs, 2, str(tmp_path))
    n = 2
    gloo = {'all_reduce': 2 * (n - 1) / n, 'scalars': 2 * (n - 1) / n, 'reduce_scatter': 2 * (n - 1) / n,
            'all_gather': (n - 1) / n}
    for stage in range(4):
        for r in measured_rows(tmp_path / f's{stage}', n):
            expected = sum(gloo[kind] * nbytes for kind, nbytes in r['collective_bytes_by_kind'].items())
            assert r['wire_bytes'] is not None, r['wire_bytes_note']
            assert 0.99 * expected <= r['wire_bytes'] <= 1.05 * expected + 4096, (stage, r['wire_bytes'], expected)
            ratio = r['wire_bytes'] / r['wire_bytes_formula']
            assert ratio == pytest.approx({0: 1.0, 1: 1.5, 2: 1.5, 3: 4 / 3}[stage], rel=0.05), (stage, ratio)


def measuring_calls(rank, world_size, out_dir):
    """In each spawned rank, every stage: the calls one unmeasured iteration (iter 1) and one measured iteration
    (iter 0, the run's first) make, counted: the Comm's by group and kind, the collectives and point-to-point
    calls that reach torch.distributed, and every call that only measures (a barrier, all_gather_object, a
    device synchronize, a clock, a sample of the bytes held)."""
    import contextlib
    from collections import Counter
    import torch.distributed as dist
    from common import distributed
    from common import reports
    from model import GPT, GPTConfig
    from types import SimpleNamespace
    from common.config import configure
    from common.training import get_lr, run_step
    from helpers import counting_patches, measuring_calls
    calls, seen = Counter(), {}
    patches = counting_patches(calls, [
        (dist, 'all_reduce', 'dist collective'), (distributed, 'all_gather_single', 'dist collective'),
        (distributed, 'reduce_scatter_single', 'dist collective'), (dist, 'isend', 'p2p'), (dist, 'irecv', 'p2p'),
        (reports, 'held_bytes', 'held-bytes sample')] + measuring_calls())
    for stage in range(4):
        cfg = configure(zero.config, TINY + [f'--out_dir={out_dir}/s{stage}', f'--stage={stage}', '--grad_clip=1.0'])
        os.makedirs(cfg.out_dir, exist_ok=True)
        torch.manual_seed(0)
        with torch.device('meta'):
            model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=96))
        z = zero.Zero(model, stage, rank, world_size, 0.1, (0.9, 0.99), 1e-8, 700, torch.float32,
                      distributed.Comm(None, 'dp'), 'cpu', prefetch_blocks=1)
        from common.checkpoints import init_params
        init_params(model.config, 0, z.set_param_values)
        gen = torch.Generator().manual_seed(rank)
        batches = [(torch.randint(0, 96, (2, 16), generator=gen),) * 2 for _ in range(2)]
        for iter_num in (1, 0):
            calls.clear()
            with contextlib.ExitStack() as stack:
                for p in patches:
                    stack.enter_context(p)
                step = lambda it: zero.train_step(z, model, batches, contextlib.nullcontext(), cfg.grad_clip,
                                                  get_lr(it, cfg), z.comm)
                run_step(SimpleNamespace(kind='zero', zero=z, comms=[z.comm], model=model, step=step), cfg,
                         iter_num, 0)  # as the loop runs a step: measured (observed) at iter 0, the first
            seen[(stage, iter_num)] = dict(calls)
    return seen


def test_an_unmeasured_step_makes_no_measuring_call(tmp_path):
    """Measuring off the hot path: an iteration that measure.measured_step does not name (every stage) makes no
    barrier, all_gather_object, synchronize, clock call or held-bytes sample, and no collective but the stage's
    own, each through the Comm: stage 0 all-reduces the gradients, 1-3 reduce-scatter and all-gather them (stage
    3's gathers are point-to-point sends and receives, two per gather on 2 ranks), 1-3 all-reduce the clip's
    squared norm, and every stage the loss. The measured iteration makes those measuring calls (so the patches
    do see them: put a barrier in train_step and this fails)."""
    own = {0: {'all_reduce', 'scalars'}, 1: {'reduce_scatter', 'all_gather', 'scalars'}}
    own.update({2: own[1], 3: own[1]})
    for rank, seen in enumerate(spawn(measuring_calls, 2, str(tmp_path))):
        for stage in range(4):
            unmeasured, measured = seen[(stage, 1)], seen[(stage, 0)]
            comm_kinds = {k for k in unmeasured if k.startswith('comm ')}
            assert comm_kinds == {f'comm dp {kind}' for kind in own[stage]}, (stage, rank, unmeasured)
            comm_calls = sum(unmeasured[k] for k in comm_kinds)
            assert unmeasured.get('dist collective', 0) + unmeasured.get('p2p', 0) // 2 == comm_calls, \
                (stage, rank, unmeasured)
            assert set(unmeasured) <= comm_kinds | {'dist collective', 'p2p'}, (stage, rank, unmeasured)
            assert (stage == 3) == ('p2p' in unmeasured), (stage, rank, unmeasured)
            assert measured['barrier'] >= 2 and measured['all_gather_object'] >= 1, (stage, rank, measured)
            assert measured['held-bytes sample'] >= 2, (stage, rank, measured)


def test_print_ds_config_round_trips(tmp_path, monkeypatch, capsys):
    """--print_ds_config prints the DeepSpeed JSON of the run; reading it back gives the same run."""
    import json
    from common.config import configure
    monkeypatch.setenv('WORLD_SIZE', '4')
    argv = ['--stage=3', '--dtype=bfloat16', '--batch_size=4', '--gradient_accumulation_steps=8', '--grad_clip=0.5',
            '--learning_rate=3e-4', '--beta2=0.95', '--weight_decay=0.05', '--adam_eps=1e-6', '--warmup_iters=7',
            '--lr_decay_iters=900', '--min_lr=2e-5']
    zero.main(argv + ['--print_ds_config=True'])
    ds = json.loads(capsys.readouterr().out)
    assert ds['gradient_accumulation_steps'] == 2 and ds['train_batch_size'] == 32  # per rank; 4 x 8 sequences
    path = tmp_path / 'ds.json'
    path.write_text(json.dumps(ds))
    back = deepspeed_config.apply_deepspeed_config(configure(zero.config, []), str(path), 4)
    want = configure(zero.config, argv)
    assert ds['scheduler']['type'] == 'WarmupCosineLR'  # DeepSpeed runs our warm-up and cosine too
    for key in ('stage', 'dtype', 'batch_size', 'gradient_accumulation_steps', 'grad_clip', 'learning_rate', 'beta1',
                'beta2', 'weight_decay', 'adam_eps', 'decay_lr', 'warmup_iters', 'lr_decay_iters', 'min_lr'):
        assert getattr(back, key) == pytest.approx(getattr(want, key)), key


def test_consolidate_bad_input_is_one_line(tmp_path):
    """consolidate.py on a directory with no sharded checkpoint, with a world's shards but not all of them, with
    shards of different iterations (a run stopped while saving), or with two runs' files on different world sizes
    (which file is whose said): one 'error:' line, a non-zero exit, no traceback."""
    stale, worlds = tmp_path / 'stale', tmp_path / 'worlds'
    # each rank's file: (its iteration, its world size); tmp_path: rank 1's missing; worlds: a run of 2 over one of 4
    for directory, ranks in ((tmp_path, [(4, 2)]), (stale, [(4, 2), (2, 2)]),
                             (worlds, [(4, 2), (4, 2), (3, 4), (3, 4)])):
        directory.mkdir(exist_ok=True)
        for rank, (iter_num, world) in enumerate(ranks):
            torch.save({'files': ('zero_rank{}.pt', world), 'iter_num': iter_num}, directory / f'zero_rank{rank}.pt')
    for directory, message in ((tmp_path / 'empty', 'holds none'), (tmp_path, 'zero_rank1.pt'),
                               (stale, 'different iterations (2, 4)'),
                               (worlds, 'several: zero_rank*.pt of a 2-file world (zero_rank0.pt, zero_rank1.pt), '
                                        'zero_rank*.pt of a 4-file world (zero_rank2.pt, zero_rank3.pt)')):
        directory.mkdir(exist_ok=True)
        proc = subprocess.run([sys.executable, 'consolidate.py', str(directory)], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode != 0 and 'Traceback' not in proc.stderr, proc.stderr
        assert proc.stderr.strip().startswith('error: consolidate:') and message in proc.stderr, proc.stderr
