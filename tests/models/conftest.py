"""The models tests never need autograd unless they ask for it (keeps them fast)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield
