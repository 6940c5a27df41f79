"""The choice of cuBLAS front end by a forward's row count (``ddtree.models.gemm_backend``).

The switch itself needs a CUDA build; here torch's setter is replaced by a recorder, so what is tested is which
library the body runs under and that the previous choice comes back, even after an exception."""

from __future__ import annotations

import pytest
import torch

from ddtree.models import gemm_backend

CUDA = torch.device("cuda")  # a device object only: nothing runs on it


@pytest.fixture
def preference(monkeypatch):
    """torch's process-wide preference, as a recorder: [current] plus every value set."""
    state = {"now": "cublas", "set": []}

    def preferred(backend=None):
        if backend is not None:
            state["now"] = backend
            state["set"].append(backend)
        return state["now"]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    return state


def test_lt_for_the_measured_range_on_cuda_only():
    rows = [1, 16, 17, 31, 32, 64, 65, 129, 192, 193, 2048]
    assert [gemm_backend.prefers_lt(r, CUDA) for r in rows] == [r in range(32, 193) for r in rows]
    assert not gemm_backend.prefers_lt(64, torch.device("cpu"))


def test_the_body_runs_under_cublaslt_and_the_choice_is_restored(preference):
    with gemm_backend.blas_for_rows(64, CUDA):
        assert preference["now"] == "cublaslt"
    assert preference["now"] == "cublas" and preference["set"] == ["cublaslt", "cublas"]


def test_restored_after_an_exception(preference):
    with pytest.raises(RuntimeError), gemm_backend.blas_for_rows(64, CUDA):
        raise RuntimeError("boom")
    assert preference["now"] == "cublas"


def test_outside_the_range_off_cuda_or_disabled_nothing_is_touched(preference):
    for rows, device in ((16, CUDA), (1024, CUDA), (64, torch.device("cpu"))):
        with gemm_backend.blas_for_rows(rows, device):
            pass
    with gemm_backend.blas_for_rows(64, CUDA, rule=False):  # KernelSet.blas_rule off
        pass
    assert preference["set"] == []


def test_the_target_forward_asks_by_all_its_new_tokens(monkeypatch):
    """The target's forward picks the library for all requests' new tokens together (R x T), as its GEMMs see
    them."""
    from contextlib import nullcontext

    from ddtree.assets import demo_target_path
    from ddtree.engine.kernels import KernelSet
    from ddtree.models import load_target
    from ddtree.models import target as target_module
    from ddtree.speculative.attention import TreeVisibility

    asked = []
    monkeypatch.setattr(target_module, "blas_for_rows", lambda rows, device, *, rule: asked.append(
        (rows, device.type, rule)) or nullcontext())
    target = load_target(demo_target_path(), dtype=torch.float32, device="cpu")
    cache = target.allocate_cache(2, 64)
    ids = torch.zeros(2, 5, dtype=torch.long)
    pos = torch.arange(5).expand(2, 5)
    tree = TreeVisibility(torch.zeros(2, dtype=torch.long), torch.ones(2, 5, 5, dtype=torch.bool).tril(), 5)
    with torch.no_grad():
        target(ids, pos, cache, torch.arange(2), pos, tree)
        target(ids, pos, cache, torch.arange(2), pos, tree, kernels=KernelSet.torch(blas_rule=False))
    assert asked == [(10, "cpu", True), (10, "cpu", False)]  # the rule applies unless the KernelSet turns it off
