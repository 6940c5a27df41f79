"""The fused top-k + logsumexp kernel against plain-Python rankings and torch.logsumexp, and trees built with it.

Without a GPU the kernel runs through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1; every test
here runs inside ``triton_runtime.cpu_interpreter()``), so the shapes stay tiny. The reference ranking is a Python sort by (value desc, token id asc): the canonical order the
kernel promises, including which of several tied tokens enter at the k-th place (the lowest ids).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from spec_oracles import best_prefixes, random_tree_batch, tree_prefixes

from ddtree import triton_runtime
from ddtree.errors import ConfigError
from ddtree.spec import Trees, build_trees, vocab_topk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    triton_runtime.triton is None or (DEVICE == "cpu" and not triton_runtime.INTERPRETED),
    reason="needs Triton, and without a GPU its interpreter (TRITON_INTERPRET=1 before import)",
)


@pytest.fixture(autouse=True)
def _kernel_allowed(monkeypatch):
    """Let the kernel run on CPU tensors through the interpreter (a no-op on a GPU machine)."""
    monkeypatch.setattr(vocab_topk, "FAST_MAX_K", 1 << 20)  # the trees below use the kernel at every width
    with triton_runtime.cpu_interpreter():
        yield


def test_build_trees_uses_the_kernel_only_when_asked_and_up_to_fast_max_k(monkeypatch):
    calls = []
    real = vocab_topk.topk_logsumexp
    monkeypatch.setattr(vocab_topk, "topk_logsumexp", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(vocab_topk, "FAST_MAX_K", 8)
    logits = torch.randn(2, 3, 300, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    narrow, wide = build_trees(logits, 8, fast_topk=True), build_trees(logits, 9, fast_topk=True)
    assert calls == [8]  # width 9 > FAST_MAX_K went to torch.topk
    assert torch.equal(narrow.tokens, wide.tokens[:, :9])
    default = build_trees(logits, 8)  # fast_topk=False: the torch path
    assert calls == [8]
    assert torch.equal(default.tokens, narrow.tokens)


def _canonical_top(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda t: (-row[t], t))[:k]


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int, ties: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if ties:  # a handful of distinct values: long runs of equal logits, many ties at the k-th place
        x = torch.randint(-4, 4, (rows, vocab), generator=gen).float()
    else:
        x = 3 * torch.randn(rows, vocab, generator=gen)
    x[0, ::3] = -math.inf  # -inf entries among finite ones
    if rows > 2:
        x[-1] = -math.inf  # a row with no finite logit
    return x.to(dtype).to(DEVICE)


def _check(x: torch.Tensor, k: int, values: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor) -> None:
    xf = x.float().cpu()
    for r, row in enumerate(xf.tolist()):
        expected = _canonical_top(row, k)
        assert ids[r].tolist() == expected, f"row {r}"
        assert torch.equal(values[r].cpu(), xf[r, expected]), f"row {r}"
    expected_lse = torch.logsumexp(xf, dim=-1)
    torch.testing.assert_close(lse.cpu(), expected_lse, rtol=2e-6, atol=2e-6)


CASES = [  # dtype, rows, vocab, k, chunk (None: the default), ties
    (torch.float32, 3, 1000, 1, None, True),
    (torch.float32, 3, 1000, 1, 256, False),
    (torch.bfloat16, 3, 1000, 8, 256, True),  # 4 chunks, the last one partial
    (torch.float32, 3, 1000, 8, None, False),
    (torch.float16, 2, 777, 5, 128, True),  # k not a power of two, 7 chunks
    (torch.bfloat16, 2, 1000, 64, 512, True),
    (torch.float32, 1, 700, 64, None, False),
]


# Every case with the default rule; the small-k cases also with each strategy forced: repeated maximum, tl.topk
# (the interpreter is too slow to force them at k = 64).
STRATEGY_CASES = [(*case, None) for case in CASES] + [
    (*case, extract) for case in CASES if case[3] <= 16 for extract in (True, False)
]


@pytest.mark.parametrize(("dtype", "rows", "vocab", "k", "chunk", "ties", "extract"), STRATEGY_CASES)
def test_matches_canonical_ranking_and_logsumexp(dtype, rows, vocab, k, chunk, ties, extract) -> None:
    x = _logits(rows, vocab, dtype, seed=vocab + k, ties=ties)
    values, ids, lse = vocab_topk.topk_logsumexp(x, k, chunk=chunk, extract=extract)
    assert values.dtype == torch.float32 and ids.dtype == torch.long and lse.dtype == torch.float32
    assert values.shape == ids.shape == (rows, k) and lse.shape == (rows,)
    _check(x, k, values, ids, lse)


def test_an_all_minus_inf_row_gives_the_lowest_ids_and_minus_inf_normaliser() -> None:
    x = torch.full((2, 300), -math.inf, device=DEVICE)
    x[0, 7] = 1.5
    values, ids, lse = vocab_topk.topk_logsumexp(x, 4, chunk=128)
    assert ids.tolist() == [[7, 0, 1, 2], [0, 1, 2, 3]]
    assert values[0, 0].item() == 1.5 and values[0, 1:].eq(-math.inf).all() and values[1].eq(-math.inf).all()
    assert lse.tolist() == [1.5, -math.inf]


def test_negative_zero_ties_with_zero() -> None:
    x = torch.tensor([[-1.0, -0.0, 0.0, -0.0, -2.0]], device=DEVICE)
    _, ids, _ = vocab_topk.topk_logsumexp(x, 3)
    assert ids.tolist() == [[1, 2, 3]]


def test_extra_merge_passes_give_the_same_answer() -> None:
    """Force the multi-pass merge (16 chunks merged two at a time) that only k = 512 uses at full vocabulary."""
    x = _logits(2, 1000, torch.float32, seed=11, ties=True)
    values, ids, lse = vocab_topk.topk_logsumexp(x, 8, chunk=64, merge_block=16)
    _check(x, 8, values, ids, lse)


def test_writes_every_output_element_and_nothing_past_k() -> None:
    x = _logits(3, 500, torch.bfloat16, seed=5, ties=True)
    k = 5
    values_buf = torch.full((3, k + 3), math.nan, device=DEVICE)
    ids_buf = torch.full((3, k + 3), -7, dtype=torch.long, device=DEVICE)
    lse_buf = torch.full((3, 2), math.nan, device=DEVICE)
    out = (values_buf[:, :k], ids_buf[:, :k], lse_buf[:, 0])
    returned = vocab_topk.topk_logsumexp(x, k, chunk=128, out=out)
    assert all(a is b for a, b in zip(returned, out, strict=True))
    _check(x, k, *out)
    assert values_buf[:, k:].isnan().all() and ids_buf[:, k:].eq(-7).all() and lse_buf[:, 1].isnan().all()


def test_rejects_bad_arguments() -> None:
    x = torch.randn(2, 10, device=DEVICE)
    with pytest.raises(ConfigError, match=r"k must be an int in \[1, vocab = 10\]"):
        vocab_topk.topk_logsumexp(x, 11)
    with pytest.raises(ConfigError, match="k must be"):
        vocab_topk.topk_logsumexp(x, 0)
    with pytest.raises(ConfigError, match="logits must be \\[rows, vocab\\]"):
        vocab_topk.topk_logsumexp(x[0], 1)
    with pytest.raises(ConfigError, match="float32, bfloat16 or float16"):
        vocab_topk.topk_logsumexp(x.double(), 1)
    with pytest.raises(ConfigError, match="chunk must be a power of two >= 8"):
        vocab_topk.topk_logsumexp(x, 5, chunk=4)
    with pytest.raises(ConfigError, match="merge_block must be a power of two >= 16"):
        vocab_topk.topk_logsumexp(x, 5, merge_block=8)
    with pytest.raises(ConfigError, match="out ids must be"):
        vocab_topk.topk_logsumexp(x, 2, out=(torch.empty(2, 2, device=DEVICE), torch.empty(2, 2, device=DEVICE),
                                             torch.empty(2, device=DEVICE)))


def test_available_follows_device_and_dtype() -> None:
    x = torch.randn(2, 5, device=DEVICE)
    assert vocab_topk.available(x)
    assert vocab_topk.available(x.half()) and vocab_topk.available(x.bfloat16())
    assert not vocab_topk.available(x.double())
    assert not vocab_topk.available(x.long())


def test_cpu_tensors_need_the_interpreter_and_the_test_context() -> None:
    x = torch.randn(2, 5)
    assert vocab_topk.available(x) == triton_runtime.INTERPRETED
    with triton_runtime.cpu_interpreter(False):  # as outside cpu_interpreter()
        assert not vocab_topk.available(x)


# Trees built with the kernel ------------------------------------------------------------------------------------


def _kernel_log_probs(logits: torch.Tensor) -> np.ndarray:
    """log q = logit - the kernel's own logsumexp, float32: what build_trees subtracts on the kernel path."""
    rows, depths, vocab = logits.shape
    _, _, lse = vocab_topk.topk_logsumexp(logits.reshape(rows * depths, vocab), 1)
    return (logits.float() - lse.view(rows, depths, 1)).cpu().numpy()


@pytest.mark.parametrize("seed", range(16))
def test_kernel_trees_match_the_brute_force_oracle(seed: int) -> None:
    """Same random batches as test_spec_tree (ties included); ties at the K'-th place too, the kernel's are canonical."""
    logits, budgets, caps, limits, max_budget = random_tree_batch(seed)
    rows = logits.shape[0]
    logits, budgets, caps, limits = (t.to(DEVICE) for t in (logits, budgets, caps, limits))
    assert vocab_topk.available(logits)
    trees = build_trees(logits, budgets, caps, max_budget=max_budget, depth_limit=limits, fast_topk=True)
    lp = _kernel_log_probs(logits)
    for r in range(rows):
        expected = best_prefixes(lp[r], int(budgets[r]), int(caps[r]), int(limits[r]))
        valid = trees.valid[r].tolist()
        got = tree_prefixes(trees.tokens[r].tolist(), trees.parents[r].tolist(), valid)
        assert [p for p, _ in got] == [p for p, _ in expected], f"request {r}"
        assert [trees.scores[r, i].item() for _, i in got] == [s for _, s in expected], f"request {r}"
        assert valid == [True] * (len(expected) + 1) + [False] * (max_budget - len(expected))


def test_kernel_trees_equal_torch_path_trees(monkeypatch) -> None:
    """Real-valued logits (no ties): the same nodes in the same order; scores agree to float32 rounding of the
    normaliser (the kernel and torch.logsumexp sum in different orders)."""
    gen = torch.Generator().manual_seed(2)
    logits = (2 * torch.randn(2, 3, 300, generator=gen)).to(DEVICE)
    logits[1, 1] = -math.inf  # a depth with no usable token
    budgets, caps = torch.tensor([24, 5], device=DEVICE), torch.tensor([0, 3], device=DEVICE)
    calls = []
    real = vocab_topk.topk_logsumexp
    monkeypatch.setattr(vocab_topk, "topk_logsumexp", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    fused = build_trees(logits, budgets, caps, max_budget=24, fast_topk=True)
    reference = build_trees(logits, budgets, caps, max_budget=24, fast_topk=False)
    assert calls == [24]  # the kernel built the first tree only
    for field in ("tokens", "parents", "depths", "valid", "visibility"):
        assert torch.equal(getattr(fused, field), getattr(reference, field)), field
    torch.testing.assert_close(fused.scores, reference.scores, rtol=1e-6, atol=1e-5)
    assert fused.valid[1].sum() == 4 and fused.depths[1].max() == 1  # the 3 capped depth-1 tokens: depth 2 is dead


def test_half_precision_kernel_trees_equal_float32_kernel_trees() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(2, 3, 200, generator=gen)).to(torch.bfloat16).to(DEVICE)  # plenty of exact ties
    half = build_trees(logits, torch.tensor([9, 16], device=DEVICE), 3, max_budget=16, fast_topk=True)
    full = build_trees(logits.float(), torch.tensor([9, 16], device=DEVICE), 3, max_budget=16, fast_topk=True)
    for field in Trees._fields:
        assert torch.equal(getattr(half, field), getattr(full, field)), field


@pytest.mark.gpu
def test_full_vocabulary_on_cuda_matches_torch() -> None:
    """The shapes the engine uses: V = 151936, bf16, k = 16 and 512 (one extra merge pass)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(30, 151936, generator=gen, device="cuda").to(torch.bfloat16)
    for k in (16, 512):
        values, ids, lse = vocab_topk.topk_logsumexp(x, k)
        xf = x.float()
        ref_values, _ = torch.topk(xf, k, dim=-1)
        assert torch.equal(values, ref_values)
        assert torch.equal(xf.gather(1, ids), values)
        # canonical: ids ascending within every run of equal values
        same = values[:, 1:] == values[:, :-1]
        assert bool((ids[:, 1:] > ids[:, :-1])[same].all())
        torch.testing.assert_close(lse, torch.logsumexp(xf, -1), rtol=2e-6, atol=2e-6)
