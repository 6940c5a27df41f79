"""Fixtures of the spec tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def kernel(request, triton_kernels_on_cpu) -> bool:
    """``@pytest.mark.parametrize("kernel", spec_oracles.KERNEL, indirect=True)``: the op's torch code (False) or
    its Triton kernel (True, through the interpreter on a CPU)."""
    return request.param
