"""data/*/prepare.py round trips (offline: tiktoken's BPE is replaced by a small Encoding built here) and the batch
rule: get_batch is a pure function, and the ranks' micro-batch slices put together are the global batch."""
import importlib.util
import os
import pickle
import urllib.error
import urllib.request

import numpy as np
import pytest
import tiktoken
import torch

from common.data import EVAL_STREAM, TRAIN_STREAM, get_batch, get_codec, load_dataset, micro_batch_rows
from helpers import REPO

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20


def load(name):
    path = os.path.join(REPO, 'data', name, 'prepare.py')
    spec = importlib.util.spec_from_file_location(f'{name}_prepare_test', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_bpe():
    """A byte-level BPE in tiktoken's own format: the 256 bytes plus a few merges, GPT-2's split pattern."""
    ranks = {bytes([i]): i for i in range(256)}
    for merge in (b'ee', b'pe', b'ak', b'spe', b'peak', b' s', b' speak', b'in', b'en'):
        ranks[merge] = len(ranks)
    pat = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding('small_bpe', pat_str=pat, mergeable_ranks=ranks,
                             special_tokens={'<|endoftext|>': len(ranks)})


def read_split(out_dir, split):
    return np.fromfile(os.path.join(out_dir, f'{split}.bin'), dtype=np.uint16)


def test_char_dataset_round_trip(tmp_path):
    load('stdlib_char').write_char_dataset(TEXT, str(tmp_path))
    with open(tmp_path / 'meta.pkl', 'rb') as f:
        meta = pickle.load(f)
    assert meta['vocab_size'] == len(set(TEXT))
    ids = np.concatenate([read_split(tmp_path, 'train'), read_split(tmp_path, 'val')])
    assert ''.join(meta['itos'][int(i)] for i in ids) == TEXT
    assert len(read_split(tmp_path, 'train')) == int(0.9 * len(TEXT))


def test_stdlib_text_is_deterministic_and_skips_tests(tmp_path, monkeypatch):
    prep = load('stdlib_char')
    a, b = prep.stdlib_text(20_000), prep.stdlib_text(20_000)
    assert a == b and len(a) == 20_000
    # on a standard library of our own: the .py files in path order, none under a test or site-packages folder
    files = {'b.py': 'B', 'a/x.py': 'X', 'a/notes.txt': 'N', 'test/t.py': 'T', 'a/tests/u.py': 'U',
             'site-packages/s.py': 'S', 'c/d/e.py': 'E'}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(prep.sysconfig, 'get_paths', lambda: {'stdlib': str(tmp_path)})
    assert prep.stdlib_text(100) == 'XBE' and prep.stdlib_text(2) == 'XB'


def test_bpe_dataset_round_trip(tmp_path):
    enc = small_bpe()
    load('shakespeare').write_bpe_dataset(TEXT, str(tmp_path), enc)
    train, val = read_split(tmp_path, 'train'), read_split(tmp_path, 'val')
    assert enc.decode(train.tolist()) + enc.decode(val.tolist()) == TEXT
    assert len(train) + len(val) < len(TEXT)  # the merges were used
    assert not os.path.exists(tmp_path / 'meta.pkl')


def test_gpt2_encoding_offline_is_one_clear_error(monkeypatch):
    def offline(name):
        raise ConnectionError('no network')
    monkeypatch.setattr(tiktoken, 'get_encoding', offline)
    with pytest.raises(SystemExit, match="could not load tiktoken's GPT-2 encoding"):
        load('shakespeare').gpt2_encoding()
    with pytest.raises(SystemExit, match='GPT-2 encoding is not available'):
        get_codec(None)


def test_download_offline_is_one_clear_error_and_cache_is_used(tmp_path, monkeypatch):
    prep = load('shakespeare_char')

    def offline(*args, **kwargs):
        raise urllib.error.URLError('Name or service not known')
    monkeypatch.setattr(urllib.request, 'urlopen', offline)
    with pytest.raises(SystemExit) as e:
        prep.download(prep.URL, str(tmp_path / 'input.txt'))
    assert e.value.code.startswith('error: could not download') and '\n' not in e.value.code
    (tmp_path / 'input.txt').write_text(TEXT)
    assert prep.download(prep.URL, str(tmp_path / 'input.txt')) == TEXT  # cached: no network needed


def test_text_prepare_char_and_gpt2(tmp_path, monkeypatch):
    src = tmp_path / 'src'
    src.mkdir()
    (src / 'b.txt').write_text(TEXT[:700])
    (src / 'a.txt').write_text(TEXT[700:])
    prep = load('text')
    prep.main(['--input', str(src / '*.txt'), '--tokenizer', 'char', '--out', str(tmp_path / 'char')])
    with open(tmp_path / 'char' / 'meta.pkl', 'rb') as f:
        itos = pickle.load(f)['itos']
    ids = np.concatenate([read_split(tmp_path / 'char', s) for s in ('train', 'val')])
    assert ''.join(itos[int(i)] for i in ids) == TEXT[700:] + '\n' + TEXT[:700]  # sorted file order

    enc = small_bpe()
    monkeypatch.setattr(tiktoken, 'get_encoding', lambda name: enc)
    prep.main(['--input', str(src / '*.txt'), '--tokenizer', 'gpt2', '--out', str(tmp_path / 'bpe')])
    decoded = ''.join(enc.decode(read_split(tmp_path / 'bpe', s).tolist()) for s in ('train', 'val'))
    assert decoded == TEXT[700:] + '\n' + TEXT[:700]
    with pytest.raises(SystemExit, match='no files match'):
        prep.main(['--input', str(tmp_path / 'nothing' / '*.txt')])


def test_missing_dataset_names_the_command():
    with pytest.raises(SystemExit, match="'no_such_dataset' not found .*see data/"):
        load_dataset('no_such_dataset')
    if not os.path.exists(os.path.join(REPO, 'data', 'shakespeare', 'train.bin')):  # not prepared on this machine
        with pytest.raises(SystemExit, match='make it with: python data/shakespeare/prepare.py'):
            load_dataset('shakespeare')


def test_get_batch_is_pure_and_shifted():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = get_batch(tokens, 1, TRAIN_STREAM, 5, 8, 16)
    x2, y2 = get_batch(tokens, 1, TRAIN_STREAM, 5, 8, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, x[:, :1] + torch.arange(16))  # each row is one contiguous window of the data
    assert not torch.equal(x, get_batch(tokens, 1, TRAIN_STREAM, 6, 8, 16)[0])  # another step, another batch
    assert not torch.equal(x, get_batch(tokens, 1, EVAL_STREAM, 5, 8, 16)[0])  # eval never reuses training


@pytest.mark.parametrize('dp_size', [1, 2, 4])
def test_rank_slices_concatenate_to_the_global_batch(dp_size):
    from types import SimpleNamespace
    cfg = SimpleNamespace(batch_size=3, gradient_accumulation_steps=4)
    tokens = np.random.default_rng(0).integers(0, 60000, 5000).astype(np.uint16)
    global_rows = cfg.batch_size * cfg.gradient_accumulation_steps
    x_all, y_all = get_batch(tokens, 7, TRAIN_STREAM, 3, global_rows, 16)
    parts = [get_batch(tokens, 7, TRAIN_STREAM, 3, global_rows, 16, micro_batch_rows(cfg, rank, dp_size, micro))
             for rank in range(dp_size) for micro in range(cfg.gradient_accumulation_steps // dp_size)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x_all)
    assert torch.equal(torch.cat([p[1] for p in parts]), y_all)


def _load_fresh_copy(repo_copy, barrier, results):
    """One rank of a fresh checkout: import the copy's common/data.py and load the default data set, which the copy
    does not have yet. Puts the sizes it read (or its error) in results."""
    spec = importlib.util.spec_from_file_location('dataset_of_copy', os.path.join(repo_copy, 'common', 'data.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    barrier.wait()  # every rank arrives at once, as torchrun starts them
    try:
        data, vocab_size = module.load_dataset('stdlib_char')
        results.put((len(data['train']), len(data['val']), vocab_size))
    except BaseException as e:
        results.put(repr(e))


def test_ranks_of_a_fresh_checkout_prepare_the_data_once(tmp_path):
    """4 ranks start together on a copy with no data, three times: every one reads the whole data set (one
    prepares while the others wait; files appear whole, by rename), none sees a missing or empty file."""
    import multiprocessing as mp
    import shutil
    want = load_dataset('stdlib_char')
    want = (len(want[0]['train']), len(want[0]['val']), want[1])
    ctx = mp.get_context('fork')  # quick to start: the children have torch imported already
    for attempt in range(3):
        repo_copy = tmp_path / f'copy{attempt}'
        os.makedirs(repo_copy / 'data' / 'stdlib_char')
        shutil.copytree(os.path.join(REPO, 'common'), repo_copy / 'common')  # the helper files (load_dataset)
        shutil.copy(os.path.join(REPO, 'data', 'stdlib_char', 'prepare.py'), repo_copy / 'data' / 'stdlib_char')
        barrier, results = ctx.Barrier(4), ctx.Queue()
        ranks = [ctx.Process(target=_load_fresh_copy, args=(str(repo_copy), barrier, results)) for _ in range(4)]
        for p in ranks:
            p.start()
        got = [results.get(timeout=120) for _ in ranks]
        for p in ranks:
            p.join(10)
        assert got == [want] * 4
        assert sorted(os.listdir(repo_copy / 'data' / 'stdlib_char')) == \
            ['.prepare.lock', 'meta.pkl', 'prepare.py', 'train.bin', 'val.bin']
