"""train.py: it learns, the logged loss is the global-batch mean, a killed run resumes bit-for-bit, checkpoints are
atomic, and bad input is one line on stderr and a non-zero exit before any work."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import model as M
from common import checkpoints
from common import training
from common.config import TRAIN_DEFAULTS, configure, model_config
from common.data import EVAL_STREAM, TRAIN_STREAM, get_batch, load_dataset
from helpers import (REPO, TINY, assert_same_losses, check, eval_losses, read_log, refusals_of, run_script,
                     train_losses)

TRAIN = 'train.py'


def test_overfits_one_batch():
    """The model and optimizer of train.py drive the loss on one fixed batch close to zero."""
    data, vocab = load_dataset('stdlib_char')
    x, y = get_batch(data['train'], 0, TRAIN_STREAM, 0, 4, 16)
    torch.manual_seed(0)
    model = M.GPT(M.GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=vocab, bias=False))
    optimizer = model.configure_optimizers(0.0, 1e-2, (0.9, 0.99), 'cpu')
    first = None
    for _ in range(150):
        _, loss = model(x, y)
        first = first if first is not None else loss.item()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert first > 3.0 and loss.item() < 0.1, (first, loss.item())


def test_train_logs_and_learns(tmp_path):
    out = str(tmp_path / 'run')
    proc = check(run_script(TRAIN, TINY + [f'--out_dir={out}', '--max_iters=60', '--eval_interval=30',
                                          '--log_interval=10', '--learning_rate=1e-2', '--sample_at_end=True']))
    rows = read_log(out)
    train_rows = [r for r in rows if 'loss' in r]
    evals = [r for r in rows if 'val_loss' in r]
    assert [r['iter'] for r in train_rows] == [0, 6, 12, 18, 24, 30, 36, 42, 48, 54]  # ~10 lines a run
    assert [r['iter'] for r in evals] == [0, 30, 60]
    for r in train_rows:
        assert set(r) >= {'iter', 'loss', 'lr', 'ms', 'tokens_per_sec', 'mfu', 'peak_mem_bytes'}
    # the iteration's own learning rate: warm-up to 1e-2 over the default 50 iterations, then cosine decay
    # towards min_lr 2e-4 at iteration 1250 (4 iterations into it at 54)
    warmed = {it: 1e-2 * (it + 1) / 51 for it in range(0, 50, 6)}
    assert {r['iter']: r['lr'] for r in train_rows} == pytest.approx(
        {**warmed, 54: 2e-4 + 0.5 * (1 + math.cos(math.pi * 4 / 1200)) * (1e-2 - 2e-4)}, rel=1e-12)
    vocab = load_dataset('stdlib_char')[1]
    assert abs(evals[0]['val_loss'] - torch.log(torch.tensor(float(vocab))).item()) < 0.2
    assert evals[-1]['val_loss'] < evals[0]['val_loss'] - 1.0, evals
    assert torch.load(os.path.join(out, 'ckpt.pt'), weights_only=False)['iter_num'] == 60
    assert '(no sample after 60 iterations; to sample: python sample.py' in proc.stdout  # too short to be worth it


def test_learning_rate_schedule_is_nanogpts():
    """Linear warm-up over warmup_iters, cosine decay to min_lr at lr_decay_iters, min_lr after (nanoGPT's
    get_lr), at train.py's defaults, worked by hand: the cosine's midpoint is halfway between the two rates."""
    cfg = SimpleNamespace(decay_lr=True, learning_rate=2e-3, min_lr=2e-4, warmup_iters=50,
                                   lr_decay_iters=1250)
    by_hand = {0: 2e-3 / 51, 49: 2e-3 * 50 / 51, 50: 2e-3, 650: 1.1e-3, 1250: 2e-4, 5000: 2e-4}
    assert {it: training.get_lr(it, cfg) for it in by_hand} == pytest.approx(by_hand, rel=1e-12)
    cfg.decay_lr = False
    assert training.get_lr(0, cfg) == training.get_lr(650, cfg) == 2e-3


def test_the_end_of_run_sample_prints_what_the_model_generates(capsys):
    """After a run of 100 iterations or more, print_sample prints 200 generated characters and the command."""
    import contextlib
    torch.manual_seed(0)
    vocab = load_dataset('stdlib_char')[1]
    model = M.GPT(M.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=vocab))
    cfg = SimpleNamespace(max_iters=100, dataset='stdlib_char', device='cpu', out_dir='out')
    training.print_sample(model, cfg, contextlib.nullcontext())
    out = capsys.readouterr().out
    text = out.split('---------- a sample ----------\n')[1].split('\n------------------------------')[0]
    assert len(text) == 201 and 'sample more with: python sample.py --out_dir=out' in out  # '\n' + 200


def test_logged_loss_is_the_global_batch_mean(tmp_path):
    """2 micro-steps of 4 sequences and 1 micro-step of 8 are the same global batch: same losses, same model."""
    common = TINY + ['--max_iters=8', '--eval_interval=8', '--log_interval=1']
    a, b = str(tmp_path / 'accum'), str(tmp_path / 'whole')
    check(run_script(TRAIN, common + [f'--out_dir={a}', '--batch_size=4', '--gradient_accumulation_steps=2']))
    check(run_script(TRAIN, common + [f'--out_dir={b}', '--batch_size=8', '--gradient_accumulation_steps=1']))
    la, lb = train_losses(a), train_losses(b)
    assert la.keys() == lb.keys() and len(la) == 8
    for it in la:
        assert abs(la[it] - lb[it]) <= 1e-5 * abs(lb[it]), (it, la[it], lb[it])


def test_kill_and_resume_is_bit_identical(tmp_path):
    """SIGKILL a run after a checkpoint at iteration k, resume it: every loss from k on equals the uninterrupted
    run's exactly (CPU, float32)."""
    common = TINY + ['--max_iters=300', '--eval_interval=20', '--log_interval=1', '--dropout=0.1']
    full, killed = str(tmp_path / 'full'), str(tmp_path / 'killed')
    check(run_script(TRAIN, common + [f'--out_dir={full}']))

    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    proc = subprocess.Popen([sys.executable, TRAIN] + common + [f'--out_dir={killed}'], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt_path, k = os.path.join(killed, 'ckpt.pt'), None
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(ckpt_path):  # atomic rename: whatever is there is a whole checkpoint
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed: make it longer"
    k = torch.load(ckpt_path, weights_only=False)['iter_num']
    assert 0 < k < 300
    check(run_script(TRAIN, common + [f'--out_dir={killed}', '--init_from=resume']))

    expected, resumed = train_losses(full), train_losses(killed)
    assert resumed.keys() == expected.keys()
    assert all(resumed[i] == expected[i] for i in expected if i >= k), k  # bit for bit
    evals = lambda d: [(r['iter'], r['val_loss']) for r in read_log(d) if 'val_loss' in r]
    assert evals(killed) == evals(full)


def test_failed_checkpoint_write_keeps_the_old_one(tmp_path, monkeypatch):
    path = str(tmp_path / 'ckpt.pt')
    checkpoints.save_checkpoint({'iter_num': 1, 'w': torch.arange(4)}, path)
    real_save = torch.save

    def broken_save(obj, f, *args, **kwargs):
        with open(f, 'wb') as fh:
            fh.write(b'half a checkpoint')  # bytes hit the disk, then the write dies
        raise OSError('disk full')

    monkeypatch.setattr(torch, 'save', broken_save)
    with pytest.raises(OSError):
        checkpoints.save_checkpoint({'iter_num': 2, 'w': torch.arange(8)}, path)
    monkeypatch.setattr(torch, 'save', real_save)
    old = torch.load(path, weights_only=False)
    assert old['iter_num'] == 1 and torch.equal(old['w'], torch.arange(4))
    assert os.listdir(tmp_path) == ['ckpt.pt']  # no temporary file left behind


def one_line_error(proc, *words):
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error:'), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize('args, words', [
    (['--batch_sise=4'], ["'batch_sise'"]),
    (['--batch_size=four'], ["'batch_size'", 'int']),
])
def test_bad_config_is_one_line_and_nonzero_exit(tmp_path, args, words):
    proc = run_script(TRAIN, TINY + [f'--out_dir={tmp_path}'] + args)
    one_line_error(proc, *words)
    assert not os.path.exists(os.path.join(tmp_path, 'log.jsonl'))  # before any work


@pytest.mark.parametrize('args, words', [
    (['--learning_rate=fast'], ["'learning_rate'", 'float']),
    (['--compile=1'], ["'compile'", 'bool']),
    (['--dtype=float8'], ['dtype']),
    (['--dataset=no_such_data'], ['no_such_data', 'not found']),
    (['--init_from=resume'], ['no checkpoint']),
    (['--init_from=bert'], ['init_from']),
    (['--n_head=3'], ['divisible']),
    (['config/no_such_file.py'], ['not found']),
])
def test_bad_input_messages(tmp_path, args, words):
    """The same checks in-process (faster): each raises SystemExit with one line naming the problem."""
    import train
    with pytest.raises(SystemExit) as e:
        train.main(TINY + [f'--out_dir={tmp_path / "o"}'] + args)
    assert isinstance(e.value.code, str) and '\n' not in e.value.code
    for word in words:
        assert word in e.value.code, e.value.code


def test_unknown_key_in_config_file(tmp_path):
    import train
    bad = tmp_path / 'bad.py'
    bad.write_text("n_layer = 2\nlearnig_rate = 1e-3\n")
    with pytest.raises(SystemExit, match="'learnig_rate' .*did you mean learning_rate\\?"):
        train.main([str(bad)])


def test_every_shipped_config_sets_only_valid_keys():
    import glob
    import train
    for path in sorted(glob.glob(os.path.join(REPO, 'config', '*.py'))):
        cfg = configure(train.config, [path])
        model_config(cfg, 50304)  # and describes a valid model


def test_cpu_default_config_is_the_default():
    import train
    assert vars(configure(train.config, [os.path.join(REPO, 'config', 'train_stdlib_char.py')])) == train.config


def test_block_size_too_large():
    import numpy as np
    with pytest.raises(SystemExit, match='block_size 16 is too large'):
        get_batch(np.zeros(17, dtype=np.uint16), 0, 0, 0, 2, 16)


def test_profile_writes_a_trace_perfetto_opens(tmp_path):
    """--profile=2: two steps under torch.profiler, written as Chrome-trace JSON with the model's matmuls in it."""
    proc = check(run_script(TRAIN, TINY + [f'--out_dir={tmp_path}', '--max_iters=4', '--profile=2']))
    trace = tmp_path / 'trace_rank0.json'
    assert 'ui.perfetto.dev' in proc.stdout
    events = json.load(open(trace))['traceEvents']
    assert any(e.get('name', '').startswith('aten::') and 'mm' in e['name'] for e in events)
    assert any(e.get('name', '').startswith('ProfilerStep#') for e in events)  # the steps are marked


class _RankOfMany:
    """What estimate_loss sees on rank `rank` of `size` data-parallel ranks; the all-reduce is left out, so the
    ranks' results add up to the whole (the test plays every rank in turn)."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def all_reduce(self, x):
        pass


@pytest.mark.parametrize('batch_size, accumulation, dp_size', [(12, 1, 1), (4, 3, 1), (4, 3, 3), (3, 4, 4),
                                                                 (1, 12, 4)])
def test_eval_loss_is_equal_for_every_split_of_the_batch(batch_size, accumulation, dp_size):
    """Evaluation batch k is the global batch of (seed, k) whatever the split: a global batch of 12 sequences
    evaluated in one process, as 3 or 12 micro-batches, or over 3 and 4 data-parallel ranks, gives one loss.
    (The mean of a per-sequence loss computed here, apart from estimate_loss, is the reference.)"""
    data, vocab = load_dataset('stdlib_char')
    torch.manual_seed(0)
    model = M.GPT(M.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=vocab)).eval()
    cfg = SimpleNamespace(batch_size=batch_size, gradient_accumulation_steps=accumulation, eval_iters=2,
                            seed=7, block_size=16, device='cpu')
    got = {'train': 0.0, 'val': 0.0}
    for rank in range(dp_size):
        losses = training.estimate_loss(lambda x, y: model(x, y)[1], data, cfg, _RankOfMany(rank, dp_size))
        for split, loss in losses.items():
            got[split] += loss
    for split in ('train', 'val'):
        batches = [get_batch(data[split], 7, EVAL_STREAM, k, 12, 16) for k in range(2)]
        want = torch.stack([model(x, y)[1] for x, y in batches]).mean().item()
        assert got[split] == pytest.approx(want, rel=1e-6), (split, got[split], want)


def test_val_loss_of_ddp_on_3_ranks_equals_train_py_with_another_split(tmp_path):
    """End to end: train.py with one micro-batch of 12 and train_ddp.py on 3 ranks with 4 x 3 micro-batches log
    the same training and evaluation losses (so they would keep the same best checkpoint)."""
    common = TINY + ['--max_iters=2', '--eval_interval=2', '--eval_iters=2', '--log_interval=1']
    one = str(tmp_path / 'one')
    check(run_script(TRAIN, common + ['--batch_size=12', '--gradient_accumulation_steps=1', f'--out_dir={one}']))
    ddp = str(tmp_path / 'ddp')
    check(run_script('train_ddp.py', common + ['--batch_size=4', '--gradient_accumulation_steps=3',
                                               f'--out_dir={ddp}'], nproc=3))
    assert_same_losses(train_losses(ddp), train_losses(one))
    assert_same_losses(eval_losses(ddp), eval_losses(one))


def test_torchrun_summary_carries_the_error_and_plain_python_says_single_process(tmp_path):
    """Under torchrun the user's last screen is torchrun's failure summary: it must carry the rank's one line
    (with the flag to change), not only an exit code. Started with plain python, a distributed script says it
    runs as one process and gives the torchrun command."""
    proc = run_script('train_ddp.py', TINY + ['--gradient_accumulation_steps=3', f'--out_dir={tmp_path}'], nproc=2)
    assert proc.returncode != 0
    summary = proc.stderr[proc.stderr.index('Root Cause'):]
    assert 'error: gradient_accumulation_steps (3) must be divisible' in summary, summary
    assert '--gradient_accumulation_steps=4' in summary, summary
    proc = check(run_script('train_ddp.py', TINY + ['--max_iters=0', f'--out_dir={tmp_path}']))
    assert 'running as a single process' in proc.stdout and 'torchrun --standalone --nproc_per_node=N ' \
        'train_ddp.py' in proc.stdout, proc.stdout


def test_train_py_spells_out_the_shared_config():
    """train.py keeps nanoGPT's full config block; the other scripts take the same keys from
    TRAIN_DEFAULTS. The two must never drift apart."""
    import train
    declared = {k: train.config[k] for k in TRAIN_DEFAULTS}
    assert declared == TRAIN_DEFAULTS
    own = set(train.config) - set(TRAIN_DEFAULTS) - set(M.GPTConfig.__dataclass_fields__)
    assert own == set(), own


def test_consolidate_py_s_help_exits_0_and_a_wrong_call_does_not():
    """consolidate.py takes no config keys: --help prints its usage and exits 0 (as every script's does, which
    README says); called without its folder, the same line is an error."""
    usage = 'usage: python consolidate.py OUT_DIR [DEST_DIR]'
    assert usage in check(run_script('consolidate.py', ['--help'])).stdout
    proc = run_script('consolidate.py', [])
    assert proc.returncode != 0 and usage in proc.stderr


@pytest.mark.parametrize('script', ['train.py', 'zero.py', 'pipeline.py'])
def test_help_lists_every_key_with_its_default_and_words(script):
    """`python X.py --help` prints every key the script accepts (its idea's first), its default and the comment
    where the key is declared, and exits 0 without training."""
    import importlib
    proc = check(run_script(script, ['--help']))
    module = importlib.import_module(script[:-3])
    listed = [line.split('=')[0].strip()[2:] for line in proc.stdout.splitlines() if line.startswith('  --')]
    assert sorted(listed) == sorted(module.config), proc.stdout  # each once
    assert "--batch_size=8" in proc.stdout and 'sequences per micro-step' in proc.stdout
    if script == 'zero.py':  # the idea's keys before the shared ones
        assert listed.index('stage') < listed.index('batch_size'), listed


def test_train_py_trains_a_mixture_of_experts_and_logs_its_load(tmp_path):
    """python train.py --n_expert=4 --n_expert_active=2: it learns, and beside each step's row it logs the MoE
    layers' aux loss and tokens per expert (every token-slot counted: k x a micro-batch's tokens a layer)."""
    out = str(tmp_path / 'moe')
    proc = check(run_script(TRAIN, TINY + [f'--out_dir={out}', '--max_iters=30', '--eval_interval=30',
                                          '--log_interval=10', '--learning_rate=1e-2', '--n_expert=4',
                                          '--n_expert_active=2']))
    rows = read_log(out)
    moe_rows = [r for r in rows if 'aux' in r]
    assert [r['iter'] for r in moe_rows] == [r['iter'] for r in rows if 'loss' in r] == list(range(0, 30, 3))
    for r in moe_rows:
        assert 1.0 <= r['aux'] <= 4.0  # 1 when balanced, n_expert when one expert takes every token
        assert [sum(layer) for layer in r['tokens_per_expert']] == [2 * 4 * 16] * 2  # k x batch x block, x2
    assert 'moe aux' in proc.stdout and 'load max/mean' in proc.stdout
    evals = eval_losses(out)
    assert evals[30][1] < evals[0][1] - 0.8, evals  # from ~ln(vocab) at init
    import train
    cfg = configure(train.config, ['--n_expert=4', '--n_expert_active=5'])
    with pytest.raises(SystemExit, match=r'^error: n_expert_active \(top-k, 5\) must be 1 to n_expert \(4\)'):
        model_config(cfg, 40)  # top-k > n_expert: one line


def test_a_new_run_starts_its_own_log_and_a_resume_continues_it(tmp_path):
    """log.jsonl once held five runs' iteration-0 rows: a second run into the same out_dir replaces the first's
    rows; a resume appends to them."""
    import train
    from helpers import TINY, read_log
    flags = TINY + [f'--out_dir={tmp_path}', '--max_iters=2', '--eval_interval=2', '--log_interval=1']
    train.main(flags)
    train.main(flags)
    assert [r['iter'] for r in read_log(tmp_path) if 'loss' in r] == [0, 1]
    train.main(flags + ['--init_from=resume', '--max_iters=4'])
    rows = [r for r in read_log(tmp_path) if 'loss' in r]
    assert [r['iter'] for r in rows] == [0, 1, 2, 3]
    # beside the peak resident set (mostly torch itself), what the run added to the process's start
    assert all(0 < r['mem_added_bytes'] < r['peak_mem_bytes'] for r in rows), rows


def test_a_resume_takes_dropout_and_checkpointing_from_its_flags(tmp_path):
    """The checkpoint gives the architecture; dropout and activation checkpointing, which no weight depends on,
    are this run's flags (a resume with --activation_checkpointing=True had silently not checkpointed)."""
    import train
    flags = TINY + [f'--out_dir={tmp_path}', '--max_iters=1', '--eval_interval=1', '--sample_at_end=False']
    train.main(flags)
    cfg = configure(train.config, flags + ['--init_from=resume', '--dropout=0.1',
                                                    '--activation_checkpointing=True'])
    model = checkpoints.init_model(cfg, None, os.path.join(tmp_path, 'ckpt.pt'))[0]
    assert model.config.dropout == 0.1 and model.config.activation_checkpointing, model.config
    assert model.transformer.drop.p == 0.1 and model.config.n_embd == 16


def test_a_resume_says_where_its_command_describes_another_model(tmp_path, capsys):
    """Resumed with the run's own flags: no note. Without them (the n_embd and dropout defaults here): one line
    that the model's shape is the checkpoint's and its dropout this command's, each beside the other's."""
    import train
    flags = TINY + [f'--out_dir={tmp_path}', '--max_iters=1', '--eval_interval=1', '--sample_at_end=False']
    train.main(flags + ['--dropout=0.1'])
    resume = lambda argv: checkpoints.init_model(configure(train.config, argv + ['--init_from=resume']),
                                                 None, os.path.join(tmp_path, 'ckpt.pt'))[0]
    capsys.readouterr()
    assert resume(flags + ['--dropout=0.1']).config.n_embd == 16 and 'note' not in capsys.readouterr().out
    assert resume(flags + ['--dropout=0.1', '--block_size=8']) and 'note' not in capsys.readouterr().out
    model = resume([f'--out_dir={tmp_path}', '--n_layer=2', '--n_head=4', '--block_size=16'])  # (n_embd: 128)
    out = capsys.readouterr().out
    assert model.config.n_embd == 16 and model.config.dropout == 0.0, model.config
    assert out.count('\n') == 1 and out.startswith('note: resuming with '), out
    assert "n_embd=16 (the checkpoint's; this command says 128)" in out, out
    assert "dropout=0.0 (this command's; the run had 0.1)" in out, out
    # (the default batch_size, 8: another global batch, which a consolidated expert_parallel.py run resumed
    # in train.py had taken without a word: its default accumulation is 4, train.py's 2)
    assert ("a global batch of 16 sequences (this command's; the run had 8: --batch_size=4 "
            "--gradient_accumulation_steps=2)") in out, out
    # flags that alone describe no model (3 heads in the default 128 wide): compared as they are, not refused
    assert resume([f'--out_dir={tmp_path}', '--n_head=3', '--block_size=16']).config.n_head == 4
    assert capsys.readouterr().out == (
        "note: resuming with n_layer=2 (the checkpoint's; this command says 4), n_head=4 (the checkpoint's; "
        "this command says 3), n_embd=16 (the checkpoint's; this command says 128), dropout=0.0 (this "
        "command's; the run had 0.1), a global batch of 16 sequences (this command's; the run had 8: "
        "--batch_size=4 --gradient_accumulation_steps=2)\n")


# A resume's model is the checkpoint's whatever the command's flags say: each script's refusals judge that
# model. (script, the grid its rank 0's file says it was cut on, flags, the model key, a value the flags' model
# cannot run, one it can)
RESUMES = [('tensor_parallel', {'tp': 2, 'ranks': 2}, ['--tp=2'], 'n_head', 3, 4),
           ('context_parallel', None, ['--cp=2', '--cp_attention=ulysses'], 'n_head', 3, 4),
           ('pipeline', {'pp': 2, 'virtual_stages': 1}, ['--pp=2', '--n_microbatches=2'], 'n_layer', 3, 4),
           ('expert_parallel', {'ep': 2, 'ranks': 2}, ['--ep=2', '--n_expert_active=1'], 'n_expert', 3, 4),
           ('parallel_4d', dict(pp=1, cp=1, tp=2, ep=1, virtual_stages=1, ranks=2), ['--tp=2'], 'n_head', 3, 4)]


@pytest.mark.parametrize('script, grid, flags, key, bad, good', RESUMES, ids=[r[0] for r in RESUMES])
def test_a_resume_is_checked_against_the_model_it_resumes(tmp_path, script, grid, flags, key, bad, good):
    """A checkpoint of a model the script can run, resumed with flags that describe one it cannot: no refusal
    (the flags' model is not the one that runs). The other way round: refused, naming the checkpoint's value
    and where it comes from, before any work (context_parallel.py's ulysses had run into a reshape traceback)."""
    import importlib
    module = importlib.import_module(script)
    check = refusals_of(script)
    file = getattr(module, 'STAGE_FILE', getattr(module, 'RANK_FILE', 'ckpt.pt')).format(0)  # rank 0's

    def resume(saved, says):
        torch.save({'model_args': {key: saved}, 'config': {key: saved}, 'grid': grid},
                   os.path.join(tmp_path, file))
        argv = TINY + flags + [f'--{key}={says}', '--init_from=resume', f'--out_dir={tmp_path}']
        return check(configure(module.config, argv), 2)
    resume(good, bad)  # passes
    with pytest.raises(SystemExit) as e:
        resume(bad, good)
    assert e.value.code.startswith('error: ') and f"{key} ({bad})" in e.value.code, e.value.code
    assert e.value.code.endswith(f"(resuming with {key}={bad} (the checkpoint's; this command says {good}))")


@pytest.mark.parametrize('script, flags', [('tensor_parallel', ['--tp=2']),
                                           ('context_parallel', ['--cp=2', '--cp_attention=ulysses'])])
def test_a_gpt2_start_is_checked_against_the_gpt2(tmp_path, script, flags):
    """init_from=<a GPT-2> builds the GPT-2's shape whatever the command's flags say: the checks judge that
    shape, from its config.json (no weights read) or, for the hub's names, the four known sizes (offline).
    tp=2 and ulysses over 2 ranks had met a 3-head GPT-2 in a split or reshape traceback (the scripts that
    start no GPT-2: the next test)."""
    import importlib
    import json
    module = importlib.import_module(script)
    gpt2 = tmp_path / 'gpt2_tiny'
    gpt2.mkdir()

    def start(init_from, n_head_saved, n_head_flag):
        (gpt2 / 'config.json').write_text(json.dumps(dict(
            model_type='gpt2', n_positions=32, vocab_size=96, n_layer=2, n_head=n_head_saved, n_embd=12,
            layer_norm_epsilon=1e-5, activation_function='gelu_new')))
        argv = TINY + flags + [f'--n_head={n_head_flag}', f'--init_from={init_from}', f'--out_dir={tmp_path}']
        return refusals_of(script)(configure(module.config, argv), 2)
    start(gpt2, 4, 3)  # the command's 3 heads are not what runs: passes
    for init_from, says in ((gpt2, 'n_head=3'), ('gpt2-xl', 'n_head=25')):
        with pytest.raises(SystemExit) as e:
            start(init_from, 3, 4)
        assert e.value.code.startswith('error: ') and f"(init_from={init_from} has " in e.value.code, e.value.code
        assert says in e.value.code.split('(init_from=')[1], e.value.code


def test_the_done_line_names_only_what_the_run_left(tmp_path, capsys):
    """--max_iters=0 saves no checkpoint (iteration 0 is never saved): the closing line had named a ckpt.pt
    that was not there. A run that saved one names it."""
    import train
    for max_iters, named in ((0, False), (2, True)):
        train.main(TINY + [f'--out_dir={tmp_path}', f'--max_iters={max_iters}', '--eval_interval=2'])
        done = capsys.readouterr().out.splitlines()[-1]
        assert done.startswith(f"done; outputs in {tmp_path}/: log.jsonl") and ('ckpt.pt' in done) == named, done


@pytest.mark.parametrize('script, flags', [('pipeline', ['--pp=5']), ('parallel_4d', ['--tp=8']),
                                           ('expert_parallel', ['--ep=2'])])
def test_a_script_that_starts_no_gpt2_says_so_first(script, flags):
    """pipeline.py, parallel_4d.py and expert_parallel.py start no GPT-2: init_from=gpt2 is refused as that,
    before a check judges the GPT-2's shape (pp=5 or tp=8 would not divide its 12 layers or heads)."""
    import importlib
    module = importlib.import_module(script)
    check = refusals_of(script)
    with pytest.raises(SystemExit) as e:
        check(configure(module.config, TINY + flags + ['--init_from=gpt2']), 8)
    assert e.value.code.startswith("error: init_from must be 'scratch' or 'resume' here, got 'gpt2'"), e.value.code


def test_a_gpt2_directory_without_weights_is_one_line(tmp_path):
    """train.py reads a GPT-2 through transformers, the sharded scripts from its safetensors file: a directory
    with a config.json and no weights is one line either way (train.py's was transformers' traceback)."""
    pytest.importorskip('transformers', reason='train.py reads a GPT-2 through Hugging Face transformers')
    import json
    from common import hf
    (tmp_path / 'config.json').write_text(json.dumps(dict(
        model_type='gpt2', n_positions=32, vocab_size=96, n_layer=2, n_head=4, n_embd=16)))
    for read in (hf.from_pretrained, hf.open_gpt2):
        with pytest.raises(SystemExit) as e:
            read(str(tmp_path))
        assert e.value.code.startswith(f"error: init_from={tmp_path}: ") and 'model.safetensors' in e.value.code
        assert '\n' not in e.value.code, e.value.code


def test_a_gpt2_is_read_from_the_cache_first_and_a_download_says_so(tmp_path, monkeypatch, capsys):
    """init_from=gpt2 asks Hugging Face's cache first, with no network (offline, huggingface_hub retries for
    ~28 s before it fails: a cached GPT-2 must not wait for that); only a model not cached is downloaded, and the
    run says so before it waits. Both readers: hf.open_gpt2 (huggingface_hub, the sharded scripts) and
    hf.from_pretrained (transformers, train.py), each library's call replaced by one that records what it was
    asked. And the libraries' own answer for a model not in the cache is an OSError, the miss cache_first takes."""
    transformers = pytest.importorskip('transformers', reason='the GPT-2 readers need Hugging Face transformers')
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError
    from common import hf
    empty = dict(cache_dir=str(tmp_path / 'empty'), local_files_only=True)
    for ask in (lambda: huggingface_hub.hf_hub_download('gpt2', 'config.json', **empty),
                lambda: transformers.GPT2LMHeadModel.from_pretrained('gpt2', **empty)):
        with pytest.raises(OSError):
            ask()
    with pytest.raises(SystemExit) as e:  # (a name the hub cannot have: one line, where it was a traceback)
        hf.open_gpt2('gpt2 medium')
    assert e.value.code.startswith("error: init_from=gpt2 medium: Repo id must use alphanumeric chars")
    shape = transformers.GPT2Config(n_positions=16, vocab_size=32, n_layer=1, n_head=2, n_embd=8)
    hub, asked = tmp_path / 'hub', []
    hub.mkdir()
    shape.to_json_file(str(hub / 'config.json'))
    (hub / 'model.safetensors').write_bytes(b'')  # (open_gpt2 reads the weights later, one at a time)

    def download(repo, filename, local_files_only=False, cached=(), online=True):
        asked.append(local_files_only)
        if (local_files_only and filename not in cached) or not (local_files_only or online):
            raise LocalEntryNotFoundError(f"{filename}: not {'in the cache' if local_files_only else 'reached'}")
        return str(hub / filename)
    downloading = "downloading gpt2 from the Hugging Face hub (once: later runs read its cache)\n"
    for cached, online, want, said in (
            (('config.json', 'model.safetensors'), False, [True, True], ''),  # cached: offline is no matter
            (('config.json',), True, [True, True, False, False], downloading),  # half cached: both fetched
            ((), False, [True, False], downloading)):  # offline, not cached: the library's line
        monkeypatch.setattr(huggingface_hub, 'hf_hub_download',
                            lambda *a, **k: download(*a, **k, cached=cached, online=online))
        asked.clear()
        if online or cached:
            assert hf.open_gpt2('gpt2')[0].n_layer == 1
        else:
            with pytest.raises(SystemExit) as e:
                hf.open_gpt2('gpt2')
            assert e.value.code == "error: init_from=gpt2: config.json: not reached", e.value.code
        assert asked == want and capsys.readouterr().out == said, (cached, asked)

    def from_pretrained(name, local_files_only=False):
        asked.append(local_files_only)
        if local_files_only:
            raise OSError("gpt2 is not in the cache")
        return transformers.GPT2LMHeadModel(shape)
    monkeypatch.setattr(transformers.GPT2LMHeadModel, 'from_pretrained', from_pretrained)
    asked.clear()
    assert hf.from_pretrained('gpt2').config.n_layer == 1
    assert asked == [True, False] and capsys.readouterr().out == downloading


@pytest.mark.parametrize('flag, message', [
    ('--batch_size=0', '--batch_size must be at least 1, got 0'),
    ('--gradient_accumulation_steps=0', '--gradient_accumulation_steps must be at least 1, got 0'),
    ('--log_interval=0', '--log_interval must be at least 1'), ('--eval_iters=0', '--eval_iters must be at least 1'),
    ('--n_head=0', '--n_head must be at least 1'), ('--grad_clip=-1.0', '--grad_clip must be 0 or more, got -1.0'),
    ('--learning_rate=-0.002', '--learning_rate must be 0 or more'), ('--min_lr=-1e-4', '--min_lr must be 0 or more'),
    ('--max_iters=-1', '--max_iters must be 0 or more'), ('--seed=-1', '--seed must be 0 or more'),
    ('--dropout=1.5', '--dropout must be in [0, 1), got 1.5'),
    ('--n_expert=4', 'moe_every (3) > n_layer (2): no MoE layer')])
def test_a_value_no_script_can_run_is_one_line(flag, message):
    """Values that would divide by zero, reshape to nothing, or (a negative clip or learning rate) make the
    loss climb without a word (seen: val loss 4.53 -> 7.09 with --grad_clip=-1): refused by configure, which
    every script calls first."""
    import train
    with pytest.raises(SystemExit) as e:
        configure(train.config, TINY + ['--moe_every=3', flag])
    assert e.value.code == f"error: {message}" or e.value.code.startswith(f"error: {message}"), e.value.code
    configure(train.config, TINY + ['--moe_every=3'])  # (the flags without it pass)


def test_a_resume_that_cannot_continue_the_run_is_refused(tmp_path, capsys):
    """A checkpoint past --max_iters (the loop never stopped, overwriting the checkpoint at every evaluation),
    or a data set with more tokens than the model (a resume without the run's config file takes the default
    data set): one line. --eval_only evaluates once wherever the checkpoint is; a float16 resume of a float32
    checkpoint starts a fresh loss scaler (it raised); another data set with no more tokens is said in the
    note."""
    import train
    flags = TINY + [f'--out_dir={tmp_path}', '--max_iters=3', '--eval_interval=3', '--sample_at_end=False']
    train.main(flags)
    ckpt = os.path.join(tmp_path, 'ckpt.pt')
    with pytest.raises(SystemExit) as e:
        train.main(flags + ['--init_from=resume', '--max_iters=2'])
    assert e.value.code == (f"error: init_from=resume: {ckpt} is at iteration 3, past --max_iters=2: pass a "
                            "--max_iters of 3 or more (or --eval_only=True)")
    cfg = configure(train.config, flags + ['--init_from=resume'])
    with pytest.raises(SystemExit) as e:
        checkpoints.init_model(cfg, 97, ckpt)
    assert e.value.code == ("error: init_from=resume: --dataset=stdlib_char has 97 tokens, the checkpoint's "
                            "model 96 (the run trained on --dataset=stdlib_char)"), e.value.code
    capsys.readouterr()
    cfg.dataset = 'shakespeare_char'
    checkpoints.init_model(cfg, 65, ckpt)
    assert "dataset='shakespeare_char' (this command's; the run had 'stdlib_char')" in capsys.readouterr().out
    train.main(flags + ['--init_from=resume', '--eval_only=True', '--max_iters=10', '--eval_interval=4'])
    assert [r['iter'] for r in read_log(tmp_path) if 'val_loss' in r] == [0, 3]  # (3: evaluated once again)
    train.main(flags + ['--init_from=resume', '--max_iters=4', '--dtype=float16'])
    assert [r['iter'] for r in read_log(tmp_path) if 'loss' in r] == [0, 1, 2, 3]


def test_an_evaluation_leaves_the_checkpoint_and_a_lost_stream_is_said(tmp_path, capsys):
    """--eval_only on a resume writes nothing (a helper's audit: train.py evaluating a 2-rank DDP checkpoint
    rewrote it with one random stream, and the run's resume on 2 ranks no longer continued it, without a
    word). And a resume whose checkpoint holds another number of streams than the run has ranks says that
    dropout cannot continue exactly."""
    import train
    flags = TINY + [f'--out_dir={tmp_path}', '--max_iters=2', '--eval_interval=2', '--dropout=0.1']
    train.main(flags)
    ckpt = os.path.join(tmp_path, 'ckpt.pt')
    before = os.stat(ckpt)
    train.main(flags + ['--init_from=resume', '--eval_only=True', '--always_save_checkpoint=True'])
    after = os.stat(ckpt)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # (a save renames anew)
    state = checkpoints.rng_state()
    saved = {'rng_states': [state, state], 'rng_state': state['cpu'], 'cuda_rng_state': None}
    capsys.readouterr()
    checkpoints.restore_rng(saved, 0, 2, 1337, 0)  # the same world: silent
    assert capsys.readouterr().out == ''
    checkpoints.restore_rng(saved, 0, 1, 1337, 0)
    assert capsys.readouterr().out.startswith("note: the checkpoint holds the random streams of 2 rank(s), this "
                                              "run has 1: rank 0 continues the saved rank 0's (with dropout on")


def test_a_resume_says_where_a_later_checkpoint_sits_beside_it(tmp_path, capsys):
    """A ckpt.pt joined by consolidate.py and trained on, beside the sharded run's rank files (which zero.py
    resumes first), or the other way round: the resume goes back to the older state, and says so in one line
    naming the later files. Files of the same iteration (the run's own rank files) and not ours say nothing."""
    import train
    flags = TINY + [f'--out_dir={tmp_path}', '--max_iters=2', '--eval_interval=2', '--sample_at_end=False']
    train.main(flags)
    for name, it in (('zero_rank0.pt', 2), ('zero_rank1.pt', 2), ('notes.pt', None)):
        torch.save({'iter_num': it} if it else [1, 2], os.path.join(tmp_path, name))
    resume = lambda: checkpoints.init_model(configure(train.config, flags + ['--init_from=resume']),
                                            None, os.path.join(tmp_path, 'ckpt.pt'))
    capsys.readouterr()
    resume()
    assert capsys.readouterr().out == ''
    torch.save({'iter_num': 4}, os.path.join(tmp_path, 'zero_rank1.pt'))
    resume()
    assert capsys.readouterr().out == (
        f"note: resuming {tmp_path}/ckpt.pt at iteration 2; later checkpoints beside it: zero_rank1.pt "
        f"(iteration 4), another layout's run (its own script resumes it; python consolidate.py {tmp_path} joins "
        "rank files into ckpt.pt)\n")
    os.makedirs(os.path.join(tmp_path, 'ckpt_dcp'))  # train_fsdp.py's sharded checkpoint: its iteration in extras.pt
    torch.save({'iter_num': 6}, os.path.join(tmp_path, 'ckpt_dcp', 'extras.pt'))
    resume()
    assert "later checkpoints beside it: ckpt_dcp/ (iteration 6), zero_rank1.pt (iteration 4)," in capsys.readouterr().out
    extras = os.path.join(tmp_path, 'ckpt_dcp', 'extras.pt')  # train_fsdp.py resuming its folder: not itself
    assert checkpoints.later_checkpoints_note(str(tmp_path), extras, 6) is None
    assert 'beside it: ckpt.pt (iteration 2), zero_rank0.pt (iteration 2)' in checkpoints.later_checkpoints_note(str(tmp_path), extras, 1)


def test_a_busy_cpu_gets_one_line_on_what_to_expect(monkeypatch):
    """On 2 busy cores torch's 2 threads made train.py 20x slower than idle (OMP_NUM_THREADS=1: 2x): one line
    says so before the run; an idle CPU, one thread, or a GPU gets none."""
    from common import training
    busy = training.cpu_busy_elsewhere(0.05)  # the real reading: a share of the cores
    assert busy is None or 0 <= busy <= os.cpu_count()
    monkeypatch.setattr(torch, 'get_num_threads', lambda: 2)
    monkeypatch.setattr(os, 'cpu_count', lambda: 2)
    monkeypatch.setattr(training, 'cpu_busy_elsewhere', lambda: 1.9)
    note = training.busy_cpu_note('cpu')
    assert note.startswith('note: this CPU is busy (1.9 of its 2 cores running other work)'), note
    assert 'OMP_NUM_THREADS=1' in note and note.count('\n') == 1 and training.busy_cpu_note('cuda') is None
    monkeypatch.setattr(training, 'cpu_busy_elsewhere', lambda: 0.1)
    assert training.busy_cpu_note('cpu') is None


def test_an_errors_first_sentence_keeps_a_path_whole():
    """training.first_sentence, the one-line errors of sample.py, consolidate.py and the GPT-2 readers: an
    exception's first line up to a full stop before a capital; a '. ' inside a path is not one (it had cut
    "No such file or directory: 'runs. old/ckpt.pt'" to "... 'runs")."""
    missing = "[Errno 2] No such file or directory: 'runs. old/ckpt.pt'"
    assert training.first_sentence(OSError(missing)) == missing
    sentences = OSError("Not in the cache. Check your connection.\nMore")
    assert training.first_sentence(sentences) == "Not in the cache"
    assert training.first_sentence(ValueError('')) == ''
