import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: model.py, ...
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # helpers.py


@pytest.fixture(scope='session', autouse=True)
def stdlib_char():
    """The default data set, made once (offline) before any test that trains."""
    from common.data import load_dataset
    load_dataset('stdlib_char')
    return 'stdlib_char'
