"""GPU tests: every test here is marked ``gpu`` and skipped without a CUDA device."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # the shared helpers in gpu_harness.py


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (printed, so a failure can be replayed: ``LSERVE_TEST_SEED=<seed>``)."""
    s = int(os.environ.get("LSERVE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(s)
    print(f"seed={s}")
    return s
