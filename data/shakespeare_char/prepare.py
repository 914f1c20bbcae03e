"""
Tiny Shakespeare (about 1.1M characters) as characters, as in nanoGPT.

    python data/shakespeare_char/prepare.py
    python train.py config/train_shakespeare_char.py

Downloads input.txt once (this needs the network; offline it stops with one line saying so), then writes
train.bin and val.bin (uint16 character ids, 90/10 split) and meta.pkl (the vocabulary) beside this file.
"""
import importlib.util
import os
import urllib.request

URL = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt'
HERE = os.path.dirname(os.path.abspath(__file__))


def load_module(path):
    """Import a prepare.py by its path (data/ is not a package): the writers live in one place each."""
    spec = importlib.util.spec_from_file_location(os.path.basename(os.path.dirname(path)) + '_prepare', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def download(url, path):
    """The text at url, cached at path. Offline: SystemExit with one line naming the URL and what to do."""
    if not os.path.exists(path):
        print(f"downloading {url}")
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                data = response.read()
        except OSError as e:  # URLError, timeouts, DNS failures are all OSErrors
            raise SystemExit(f"error: could not download {url} ({e}); put the file at {path} by hand, "
                             f"or use the offline default data set (python train.py)")
        with open(path, 'wb') as f:
            f.write(data)
    with open(path, encoding='utf-8') as f:
        return f.read()


if __name__ == '__main__':
    stdlib_char = load_module(os.path.join(HERE, '..', 'stdlib_char', 'prepare.py'))
    stdlib_char.write_char_dataset(download(URL, os.path.join(HERE, 'input.txt')), HERE)
