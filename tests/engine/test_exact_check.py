"""Exact mode's start-up check (ddtree.engine.exact_check, ddtree.models.exact_blas): the row counts a target
forward can run, and the check that sends a weight to cuBLAS only if its rows never change with the row count
(plain, or with small calls padded to a row count from which they no longer change).

References: hand-counted row counts of a small configuration; matmuls built to be row-invariant (one row at a
time) or not (a split-K that starts at 9 rows, as cuBLAS's down projection does on the H200, and one that changes
again at 40 rows).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.engine.exact_check import target_row_counts
from ddtree.errors import ConfigError
from ddtree.models import exact_blas


def test_row_counts_by_hand():
    # rounds: 1-2 requests x 1..4 tokens (budget 3 -> node bucket 3 + the root; block 4) = 1 2 3 4 6 8;
    # eager prefill, steps of 64: one row of 16 or 32 (padded), two rows of 16 or 32 -> 16 32 64; no prefill graphs
    got = target_row_counts(max_batch=2, max_budget=3, max_block=4, prefill_chunk=32, step_tokens=64,
                            prefill_width=None, max_len=64)
    assert got == [1, 2, 3, 4, 6, 8, 16, 32, 64]
    # steps of 32: two rows fit only at width 16 (2 x 16), so no 64
    assert target_row_counts(max_batch=2, max_budget=3, max_block=4, prefill_chunk=32, step_tokens=32,
                             prefill_width=None, max_len=64) == [1, 2, 3, 4, 6, 8, 16, 32]
    # graphed first chunks add rows bucket x width bucket (widths 16 and 32 here: already present) ...
    with_graphs = target_row_counts(max_batch=2, max_budget=3, max_block=4, prefill_chunk=32, step_tokens=64,
                                    prefill_width=32, max_len=64)
    assert set(got) <= set(with_graphs) and max(with_graphs) == 64
    # ... and a wider budget widens the rounds: budget 8 -> 9 tokens a request
    assert 18 in target_row_counts(max_batch=2, max_budget=8, max_block=4, prefill_chunk=32, step_tokens=32,
                                   prefill_width=None, max_len=64)


def _rows_alone(x, w, b=None):
    """Row-invariant by construction: every call multiplies one row (this CPU's own F.linear changes at 2 rows)."""
    return torch.cat([F.linear(x[i:i + 1], w, b) for i in range(x.shape[0])])


def _split_from_9(x, w, b=None):
    """A matmul whose reduction changes at 9 rows: two halves of K added, instead of one pass over K."""
    if x.shape[0] < 9:
        return _rows_alone(x, w, b)
    k = x.shape[1] // 2
    out = _rows_alone(x[:, :k], w[:, :k]) + _rows_alone(x[:, k:], w[:, k:])
    return out if b is None else out + b


def test_check_finds_the_first_changing_row_count_and_trusts_only_passing_shapes():
    gen = torch.Generator().manual_seed(0)
    weights = {"a": (torch.randn(24, 64, generator=gen), None),
               "b": (torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen))}
    counts = [1, 2, 8, 9, 17, 300]
    bad = exact_blas.check_row_invariance(weights, counts, distinct_rows=5, matmul=_split_from_9, pads=())
    assert bad.first_failing == {"a": 9, "b": 9}
    assert bad.trusted == ()
    good = exact_blas.check_row_invariance(weights, counts, distinct_rows=5, matmul=_rows_alone)
    assert good.first_failing == {"a": None, "b": None} and good.pad_rows == {}
    assert good.trusted == ((24, 64, 1), (40, 64, 1))
    info = good.describe()
    assert info["cublas"] == ["a", "b"] and info["row_counts_checked"] == 6 and info["max_rows"] == 300
    assert "rows differ from 9 rows" in bad.describe()["triton"]["a"]


def _split_from_9_and_40(x, w, b=None):
    """Halves of K added from 9 rows, quarters from 40: a second change of reduction further up."""
    if x.shape[0] < 40:
        return _split_from_9(x, w, b)
    k = x.shape[1] // 4
    out = sum(_rows_alone(x[:, i * k:(i + 1) * k], w[:, i * k:(i + 1) * k]) for i in range(4))
    return out if b is None else out + b


def test_a_failing_weight_passes_padded_to_the_first_pad_past_its_last_change():
    gen = torch.Generator().manual_seed(5)
    weights = {"a": (torch.randn(24, 64, generator=gen), torch.randn(24, generator=gen))}
    counts = [1, 2, 8, 9, 17, 33, 40, 64, 300]
    once = exact_blas.check_row_invariance(weights, counts, distinct_rows=5, matmul=_split_from_9)
    assert once.first_failing == {"a": 9} and once.pad_rows == {"a": 16}  # every call of 16+ rows: the halves
    assert once.trusted == ((24, 64, 16),)
    assert "padded to 16 rows" in once.describe()["cublas_padded"]["a"] and once.describe()["triton"] == {}
    twice = exact_blas.check_row_invariance(weights, counts, distinct_rows=5, matmul=_split_from_9_and_40,
                                            pads=(32, 16, 64))
    assert twice.first_failing == {"a": 9} and twice.pad_rows == {"a": 64}  # 16 and 32 still see the change at 40
    never = exact_blas.check_row_invariance(weights, counts, distinct_rows=5, matmul=_split_from_9_and_40,
                                            pads=(16, 32))
    assert never.pad_rows == {} and never.trusted == ()
    assert "rows differ from 9 rows" in never.describe()["triton"]["a"]


def test_linear_padded_runs_one_call_of_at_least_the_pad():
    seen = []

    def recorder(x, w, b=None):
        seen.append(tuple(x.shape))
        return F.linear(x, w, b)

    gen = torch.Generator().manual_seed(6)
    w, b = torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen)
    x = torch.randn(2, 3, 16, generator=gen)
    out = exact_blas.linear_padded(x, w, b, 16, matmul=recorder)
    assert seen == [(16, 16)] and out.shape == (2, 3, 8)
    assert torch.equal(out, recorder(torch.cat([x.reshape(6, 16), torch.zeros(10, 16)]), w, b)[:6].reshape(2, 3, 8))
    exact_blas.linear_padded(x, w, b, 4, matmul=recorder)  # 6 rows >= 4: no padding
    assert seen[-1] == (6, 16)


@pytest.mark.parametrize("row", [-1, 12, 0])
def test_check_sees_one_changed_row_anywhere(row):
    """One row of one product off by an ulp from 17 rows on (the last row: past the last whole repeat of the 5
    distinct rows; row 12: inside the repeats; row 0), with the rows compared against the rows alone in blocks."""
    def one_row_off(x, w, b=None):
        out = _rows_alone(x, w, b)
        if x.shape[0] >= 17:
            out[row, 3] = torch.nextafter(out[row, 3], torch.tensor(float("inf")))
        return out

    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(3))
    check = exact_blas.check_row_invariance({"w": (w, None)}, [1, 9, 16, 17, 300], distinct_rows=5,
                                            matmul=one_row_off)
    assert check.first_failing == {"w": 17}


def test_check_out_of_memory_names_the_setting_to_lower():
    def big(x, w, b=None):
        if x.shape[0] > 100:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")
        return _rows_alone(x, w, b)

    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ConfigError, match=r"gate_up \(\[24, 64\]\) at up to 300 rows.*lower prefill_chunk"):
        exact_blas.check_row_invariance({"gate_up": (w, None)}, [1, 50, 300], distinct_rows=5, matmul=big)


def test_a_shape_shared_by_a_failing_weight_is_not_trusted():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 32, generator=gen)

    seen = []

    def flaky(x, weight, b=None):  # the second weight checked runs the non-invariant kernel
        if x.shape[0] == 1 and not any(weight is v for v in seen):
            seen.append(weight)
        return _rows_alone(x, weight, b) if weight is seen[0] else _split_from_9(x, weight, b)

    pair = {"first": (w, None), "second": (w.clone(), None)}
    check = exact_blas.check_row_invariance(pair, [1, 16], matmul=flaky, distinct_rows=4, pads=())
    assert all(not torch.equal(v, w) for v in seen)  # random weights of the shape, not the model's own values
    assert check.first_failing == {"first": None, "second": 16}
    assert check.trusted == ()
    # padded, the second passes at 16: the shape goes to cuBLAS at the larger pad of its two weights
    seen.clear()
    padded = exact_blas.check_row_invariance(pair, [1, 16, 20], matmul=flaky, distinct_rows=4, pads=(16,))
    assert padded.pad_rows == {"second": 16} and padded.trusted == ((16, 32, 16),)


def test_engine_info_reports_exact_mode(tiny_engine_factory):
    engine = tiny_engine_factory(exact=True, max_len=128)
    assert engine.info()["exact"] == {"on": True, "check": None}  # the CPU runs the row-at-a-time path: no check
    assert engine.runner.kernels.exact_blas == ()


def test_exact_mode_runs_with_the_torch_kernels(tiny_engine_factory):
    """``gpu_kernels=False`` with exact mode: the torch kernel set keeps exact_blas a tuple (it once set every
    field False, and the first exact forward failed iterating it), and its DDTree output is plain decoding's."""
    from ddtree.engine import GenerationRequest, SamplingParams, TreeSettings

    def run(engine, tree):
        req = GenerationRequest(prompt_token_ids=[3, 5, 7, 9, 11], tree=tree,
                                sampling=SamplingParams(max_tokens=12, ignore_eos=True))
        return engine.generate([req])[0].token_ids

    exact = tiny_engine_factory(exact=True, gpu_kernels=False, max_len=128)
    assert exact.runner.kernels.exact_blas == ()
    plain = tiny_engine_factory(max_len=128)
    assert run(exact, TreeSettings(budget=8)) == run(plain, TreeSettings(method="ar"))


def test_exact_forward_sends_only_trusted_shapes_to_torch(monkeypatch):
    from ddtree.models import exact_forward

    calls, pads = [], []
    monkeypatch.setattr(exact_forward.bi, "linear", lambda x, w, b=None: calls.append(tuple(w.shape)) or x @ w.T)
    padded = exact_blas.linear_padded
    monkeypatch.setattr(exact_forward.exact_blas, "linear_padded",
                        lambda x, w, b, rows: pads.append((tuple(w.shape), rows)) or padded(x, w, b, rows))
    ops = exact_forward._Ops(triton=True, blas=((24, 16, 1), (12, 16, 8)))
    x = torch.randn(3, 16)
    trusted, small, other = torch.randn(24, 16), torch.randn(12, 16), torch.randn(8, 16)
    assert torch.equal(ops.linear(x, trusted), F.linear(x, trusted))  # torch's matmul, as the check measured it
    ops.linear(x, small)
    assert pads == [((24, 16), 1), ((12, 16), 8)]  # each trusted shape at its pad
    ops.linear(x, other)
    assert calls == [(8, 16)]  # the rest through the Triton kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pinned_blas_runs_cublas_and_restores_the_choice():
    before = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")  # what the default engine's rule sets at 32-192 rows
        with exact_blas.pinned_blas(torch.device("cuda")):
            assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublas
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
    finally:
        torch.backends.cuda.preferred_blas_library(before)
