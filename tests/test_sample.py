"""sample.py: from a checkpoint with no model flags, it prints exactly what the checkpoint's model generates."""
import os

import pytest
import torch

import model as M
from common.data import get_codec
from helpers import TINY, check, run_script


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp('sample') / 'run')
    check(run_script('train.py', TINY + [f'--out_dir={out}', '--max_iters=20', '--eval_interval=20',
                                        '--learning_rate=1e-2', '--n_kv_head=2', '--pos=rope']))
    return out


def expected_samples(out, start, n, max_new_tokens, seed, top_k):
    """What sample.py should print: the checkpoint's model, generated in-process with the same seed."""
    torch.manual_seed(seed)
    ckpt = torch.load(os.path.join(out, 'ckpt.pt'), weights_only=False)
    model = M.GPT(M.GPTConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    model.eval()
    encode, decode = get_codec(ckpt['config']['dataset'])
    x = torch.tensor([encode(start)])
    return [decode(model.generate(x, max_new_tokens, 0.8, top_k)[0].tolist()) for _ in range(n)]


def test_sample_from_checkpoint_needs_no_model_flags(trained):
    proc = check(run_script('sample.py', [f'--out_dir={trained}', '--start=def ', '--num_samples=2',
                                          '--max_new_tokens=40', '--seed=3', '--device=cpu']))
    header, _, printed = proc.stdout.partition('\n')
    assert header.startswith(f"loaded {trained}/ckpt.pt: iteration 20, best val loss "), header
    samples = printed.split('---------------\n')
    assert samples[-1] == '' and len(samples) == 3
    want = expected_samples(trained, 'def ', 2, 40, 3, 200)
    assert [s[:-1] for s in samples[:2]] == want  # print adds the newline
    assert want[0] != want[1] and all(s.startswith('def ') and len(s) == 44 for s in want)


def test_sample_prompt_from_file(trained, tmp_path):
    prompt = tmp_path / 'prompt.txt'
    prompt.write_text('import os\n')
    proc = check(run_script('sample.py', [f'--out_dir={trained}', f'--start=FILE:{prompt}', '--num_samples=1',
                                          '--max_new_tokens=10', '--top_k=0', '--device=cpu']))
    assert proc.stdout.partition('\n')[2].split('---------------\n')[0][:-1] == expected_samples(trained, 'import os\n', 1, 10, 1337,
                                                                             None)[0]


def test_sample_errors(tmp_path):
    import sample
    (tmp_path / 'zero_rank0.pt').write_bytes(b'')  # a sharded checkpoint's file, and no ckpt.pt
    for args, words in [([f'--out_dir={tmp_path}'], f'join it first: python consolidate.py {tmp_path}'),
                        ([f'--out_dir={tmp_path}/none'], 'no checkpoint'), (['--num_sample=2'], "'num_sample'"),
                        (['--start=FILE:/no/such/file'], 'not found'), (['--init_from=bert'], 'init_from'),
                        # (a negative temperature had sampled greedily, 0 samples or tokens printed nothing)
                        (['--temperature=-1'], '--temperature must be 0 or more'),
                        (['--top_k=-1'], '--top_k must be 0 or more'),
                        (['--num_samples=0'], '--num_samples must be at least 1'),
                        (['--max_new_tokens=0'], '--max_new_tokens must be at least 1')]:
        with pytest.raises(SystemExit) as e:
            sample.main(args)
        assert words in e.value.code, e.value.code


def test_bad_files_and_devices_are_one_line(trained, tmp_path, capsys):
    """A checkpoint that is truncated or not one, a prompt file that is not UTF-8, an export onto a file
    (transformers logs and saves nothing: it had said 'saved'), a device this torch lacks, a seed past 64
    bits: one line each, where they were tracebacks; a char-level model whose meta.pkl is not here is refused
    (it fell back to GPT-2's BPE, 50,257 ids for its vocabulary); characters outside the vocabulary are named."""
    import shutil
    import sample
    whole = open(os.path.join(trained, 'ckpt.pt'), 'rb').read()
    (tmp_path / 'cut').mkdir(), (tmp_path / 'other').mkdir()
    (tmp_path / 'cut' / 'ckpt.pt').write_bytes(whole[:1000])
    torch.save([1, 2], tmp_path / 'other' / 'ckpt.pt')
    (tmp_path / 'latin1.txt').write_bytes(b'caf\xe9')
    (tmp_path / 'a_file').write_text('')
    moved = tmp_path / 'moved'
    shutil.copytree(trained, moved)
    ckpt = torch.load(moved / 'ckpt.pt', weights_only=False)
    ckpt['config']['dataset'] = 'no_such_set'
    torch.save(ckpt, moved / 'ckpt.pt')
    for args, words in [([f'--out_dir={tmp_path}/cut'], 'ckpt.pt is not a checkpoint this can read'),
                        ([f'--out_dir={tmp_path}/other'], 'ckpt.pt is not a checkpoint this can read'),
                        ([f'--out_dir={trained}', f'--start=FILE:{tmp_path}/latin1.txt'], 'is not UTF-8 text'),
                        ([f'--out_dir={trained}', f'--export_hf={tmp_path}/a_file'], 'is a file: name a directory'),
                        ([f'--out_dir={moved}'], "vocabulary is not GPT-2's BPE, and"),
                        (['--device=cuda:0'] * (not torch.cuda.is_available()) or ['--device=gpu'],
                         "--device"),
                        (['--seed=99999999999999999999'], '--seed must be below 2**63')]:
        with pytest.raises(SystemExit) as e:
            sample.main(args)
        assert e.value.code.startswith('error: ') and words in e.value.code, e.value.code
    sample.main([f'--out_dir={trained}', '--start=ab日c', '--num_samples=1', '--max_new_tokens=2'])
    assert "note: the prompt's '日' is not in the model's vocabulary: left out" in capsys.readouterr().out


def test_export_hf_loads_in_auto_model_with_the_same_logits(tmp_path):
    """python sample.py --export_hf=DIR on a train.py checkpoint: AutoModelForCausalLM.from_pretrained(DIR)
    computes the checkpoint's logits."""
    transformers = pytest.importorskip('transformers', reason='transformers is not installed (it is optional)')
    out, hf_dir = str(tmp_path / 'run'), str(tmp_path / 'hf')
    check(run_script('train.py', TINY + [f'--out_dir={out}', '--max_iters=5', '--eval_interval=5']))
    proc = check(run_script('sample.py', [f'--out_dir={out}', f'--export_hf={hf_dir}', '--device=cpu']))
    assert 'AutoModelForCausalLM.from_pretrained' in proc.stdout
    ckpt = torch.load(os.path.join(out, 'ckpt.pt'), weights_only=False)
    ours = M.GPT(M.GPTConfig(**ckpt['model_args']))
    ours.load_state_dict(ckpt['model'])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    idx = torch.randint(0, ours.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours.eval()(idx)[0]
        torch.testing.assert_close(theirs(idx).logits, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_llama_export_is_refused_where_gpt2_weights_load(tmp_path):
    """train.py --init_from=DIR of a LLaMA's export had read it as a GPT-2 (GPT2LMHeadModel: a KeyError
    traceback); the sharded scripts refused it in one line: so does train.py now."""
    pytest.importorskip('transformers', reason='transformers is not installed (it is optional)')
    from common import hf
    import train
    llama = M.GPT(M.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=32, norm='rmsnorm',
                              mlp='swiglu', pos='rope', bias=False))
    hf.to_hf(llama).save_pretrained(tmp_path / 'llama')
    import sample
    for main in (train.main, sample.main):  # (sample.py takes a save_pretrained directory too)
        with pytest.raises(SystemExit) as e:
            main([f'--init_from={tmp_path / "llama"}', f'--out_dir={tmp_path / "out"}'])
        assert e.value.code == f"error: init_from={tmp_path / 'llama'} is a 'llama' model; only GPT-2 weights " \
            "load here (a LLaMA goes through hf.from_hf)", e.value.code


def test_export_hf_of_a_mixed_layout_is_one_line(trained, tmp_path):
    """The fixture's model mixes GPT-2's norm and MLP with RoPE: no Hugging Face class holds it."""
    pytest.importorskip('transformers', reason='transformers is not installed (it is optional)')
    proc = run_script('sample.py', [f'--out_dir={trained}', f'--export_hf={tmp_path / "hf"}', '--device=cpu'])
    assert proc.returncode == 1 and proc.stderr.strip().count('\n') == 0, proc.stderr
    assert proc.stderr.startswith('error: --export_hf:') and 'GPT-2 layout' in proc.stderr


def test_a_checkpoint_older_than_the_rank_files_beside_it_is_named(tmp_path, capsys):
    """A sharded run after the one consolidated into ckpt.pt: sampling says the checkpoint is the older run and
    how to join the newer one (it once sampled "iteration 50" while the shards held a new 20-iteration run)."""
    import shutil
    import sample
    ckpt = tmp_path / 'ckpt.pt'
    ckpt.write_bytes(b'')
    sample.warn_if_older_than_shards(str(ckpt))
    assert capsys.readouterr().out == ''  # nothing newer beside it
    for rank in range(2):
        shutil.copy(ckpt, tmp_path / f'zero_rank{rank}.pt')
    os.utime(ckpt, (1, 1))  # (written long before)
    sample.warn_if_older_than_shards(str(ckpt))
    out = capsys.readouterr().out
    assert 'older than the rank files beside it (zero_rank0.pt, zero_rank1.pt)' in out, out
    assert f'python consolidate.py {tmp_path}' in out
