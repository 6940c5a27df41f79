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

from ddtree import triton_runtime, tuning
from ddtree.errors import ConfigError, ShapeError
from ddtree.speculative import Trees, build_trees, vocab_topk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHIPPED_LIMITS = {"FAST_MAX_K": tuning.FAST_MAX_K, "FAST_MAX_WORK": tuning.FAST_MAX_WORK}  # before fixtures

pytestmark = pytest.mark.skipif(
    triton_runtime.triton is None or (DEVICE == "cpu" and not triton_runtime.INTERPRETED),
    reason="needs Triton, and without a GPU its interpreter (TRITON_INTERPRET=1 before import)",
)


@pytest.fixture(autouse=True)
def _kernel_allowed(monkeypatch, triton_kernels_on_cpu):
    """Let the kernel run on CPU tensors through the interpreter (a no-op on a GPU machine); the conftest fixture
    also lets the interpreter take the running strategy's data-dependent loop bounds."""
    monkeypatch.setattr(tuning, "FAST_MAX_K", 1 << 20)  # the trees below use the kernel at every width
    monkeypatch.setattr(tuning, "FAST_MAX_WORK", 1 << 62)  # and row count


def test_build_trees_uses_the_kernel_only_when_asked_and_up_to_fast_max_k(monkeypatch):
    calls = []
    real = vocab_topk.topk_logsumexp
    monkeypatch.setattr(vocab_topk, "topk_logsumexp", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(tuning, "FAST_MAX_K", 8)
    logits = torch.randn(2, 3, 300, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    narrow, wide = build_trees(logits, 8, fast_topk=True), build_trees(logits, 9, fast_topk=True)
    assert calls == [8]  # width 9 > FAST_MAX_K went to torch.topk
    assert torch.equal(narrow.tokens, wide.tokens[:, :9])
    default = build_trees(logits, 8)  # fast_topk=False: the torch path
    assert calls == [8]
    assert torch.equal(default.tokens, narrow.tokens)


def test_wide_lists_use_the_kernel_only_for_few_rows(monkeypatch):
    calls = []
    real = vocab_topk.topk_logsumexp
    monkeypatch.setattr(vocab_topk, "topk_logsumexp", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(tuning, "FAST_MAX_K", 128)
    monkeypatch.setattr(tuning, "FAST_MAX_WORK", 6 * 20)
    gen = torch.Generator().manual_seed(1)
    few, many = torch.randn(2, 3, 300, generator=gen).to(DEVICE), torch.randn(3, 3, 300, generator=gen).to(DEVICE)
    fast_few, fast_many = build_trees(few, 20, fast_topk=True), build_trees(many, 20, fast_topk=True)
    assert calls == [6]  # 9 rows x 20 > FAST_MAX_WORK went to torch.topk
    build_trees(many, 16, fast_topk=True)  # up to RUNNING_MAX_K the kernel takes any row count
    assert calls == [6, 9]
    assert torch.equal(fast_few.tokens, build_trees(few, 20).tokens)
    assert torch.equal(fast_many.tokens, build_trees(many, 20).tokens)


def test_kernel_limits_follow_the_h200_measurements(monkeypatch):
    """The shipped limits, at the shapes of run 32 (15 rows a request): kept where the kernel won, not where it
    lost."""
    for name, value in SHIPPED_LIMITS.items():
        monkeypatch.setattr(tuning, name, value)
    takes = tuning.kernel_takes
    assert takes(15, 128) and takes(8 * 15, 128) and takes(32 * 15, 64) and takes(64 * 15, 32)
    assert not takes(32 * 15, 128) and not takes(64 * 15, 64) and not takes(15, 129)
    assert takes(64 * 15, 16) and takes(10**6, 8)


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


# Every case with the default rule (the running list up to k = 16, "sort" above); the small-k cases also with the
# per-chunk strategies forced (the interpreter is too slow to force "extract" at k = 64), k = 64 with the running
# list forced.
STRATEGY_CASES = [(*case, None) for case in CASES] + [
    (*case, strategy) for case in CASES for strategy in (("extract", "sort") if case[3] <= 16 else ("running",))
]


@pytest.mark.parametrize(("dtype", "rows", "vocab", "k", "chunk", "ties", "strategy"), STRATEGY_CASES)
def test_matches_canonical_ranking_and_logsumexp(dtype, rows, vocab, k, chunk, ties, strategy) -> None:
    x = _logits(rows, vocab, dtype, seed=vocab + k, ties=ties)
    values, ids, lse = vocab_topk.topk_logsumexp(x, k, chunk=chunk, strategy=strategy)
    assert values.dtype == torch.float32 and ids.dtype == torch.long and lse.dtype == torch.float32
    assert values.shape == ids.shape == (rows, k) and lse.shape == (rows,)
    _check(x, k, values, ids, lse)


# The running top list's worst cases ----------------------------------------------------------------------------


def _shaped_rows(kind: str, rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows built to stress the running list: "ascending" (every piece beats the whole list), "descending" (only
    a split's first piece enters), "equal" (every piece ties the threshold), "ties" (long runs of equal values,
    many ties at the k-th place), "random". Row 0 also gets -inf entries; with 3+ rows the last one is all -inf."""
    gen = torch.Generator().manual_seed(seed)
    ramp = torch.arange(vocab, dtype=torch.float32) / 8  # exact in bf16 / fp16 only up to a point: ties appear
    x = {
        "ascending": ramp.expand(rows, vocab),
        "descending": -ramp.expand(rows, vocab),
        "equal": torch.full((rows, vocab), 0.75),
        "ties": torch.randint(-2, 2, (rows, vocab), generator=gen).float(),
        "random": 3 * torch.randn(rows, vocab, generator=gen),
    }[kind].clone()
    x[0, 1::4] = -math.inf
    if rows > 2:
        x[-1] = -math.inf
    return x.to(dtype).to(DEVICE)


RUNNING_CASES = [  # kind, dtype, rows, vocab, k, chunk, splits
    ("ascending", torch.float32, 2, 200, 16, 16, 1),  # every piece inserts K_PAD keys
    ("ascending", torch.bfloat16, 3, 200, 5, 32, 3),  # bf16 rounds the ramp: runs of ties that still ascend
    ("descending", torch.float32, 2, 200, 8, 16, 4),
    ("equal", torch.float16, 3, 100, 8, 16, 2),  # all equal: the lowest ids, whatever the split
    ("equal", torch.float32, 2, 100, 3, 16, 5),
    ("ties", torch.float32, 3, 300, 7, 32, 4),  # far more than k tokens tie at the k-th value
    ("ties", torch.bfloat16, 2, 300, 16, 16, 3),
    ("random", torch.float32, 2, 40, 4, 64, None),  # vocab < chunk: one partial piece
    ("random", torch.float16, 2, 130, 3, 16, 3),  # vocab not a multiple of chunk (9 pieces, the last of 2)
    ("random", torch.float32, 3, 64, 4, 16, 3),  # 4 pieces, 2 per split: the third split owns none
    ("random", torch.bfloat16, 2, 50, 2, 16, 8),  # more splits than pieces; a piece of 2 in-vocabulary entries
    ("random", torch.float32, 3, 1000, 1, 64, 5),  # k = 1
    ("random", torch.float32, 2, 150, 16, 16, 10),  # every split owns one piece of the k_pad size
]


@pytest.mark.parametrize(("kind", "dtype", "rows", "vocab", "k", "chunk", "splits"), RUNNING_CASES)
def test_running_list_worst_cases_match_the_canonical_ranking(kind, dtype, rows, vocab, k, chunk, splits) -> None:
    x = _shaped_rows(kind, rows, vocab, dtype, seed=vocab + k)
    values, ids, lse = vocab_topk.topk_logsumexp(x, k, strategy="running", chunk=chunk, splits=splits)
    _check(x, k, values, ids, lse)


def test_running_list_follows_the_worked_example() -> None:
    """The module docstring's example: k = 2, pieces of 4, one split; equal 9s enter by id."""
    x = torch.tensor([[3.0, 9, 1, 7, 2, 5, 6, 0, 7, 1, 8, 2, 9, 0, 0, 9]], device=DEVICE)
    values, ids, _ = vocab_topk.topk_logsumexp(x, 2, strategy="running", chunk=4, splits=1)
    assert ids.tolist() == [[1, 12]] and values.tolist() == [[9.0, 9.0]]


@pytest.mark.parametrize(("chunk", "splits"), [(16, 1), (16, 2), (32, 3), (64, 1), (128, 2), (256, 7)])
def test_running_list_gives_the_same_answer_for_every_chunk_and_split(chunk, splits) -> None:
    x = _logits(2, 700, torch.bfloat16, seed=chunk + splits, ties=False)
    _check(x, 10, *vocab_topk.topk_logsumexp(x, 10, strategy="running", chunk=chunk, splits=splits))


def test_default_splits_fill_the_gpu_and_never_exceed_the_pieces() -> None:
    """An H200 (132 SMs), one-warp programs, V = 151936 in pieces of 512 (297): a single request's 15 rows get
    MAX_SPLITS programs each, 64 requests' 960 rows a few (all resident at once), never more splits than pieces."""
    assert vocab_topk.default_splits(15, 297, 1, 132) == vocab_topk.MAX_SPLITS == 32
    assert vocab_topk.default_splits(960, 297, 1, 132) == 2  # 1920 one-warp programs: ~15 per SM, not 22
    assert vocab_topk.default_splits(960, 297, 8, 132) == 1
    assert vocab_topk.default_splits(10_000, 297, 1, 132) == 1
    assert vocab_topk.default_splits(1, 5, 1, 132) == 5


def test_an_all_minus_inf_row_gives_the_lowest_ids_and_minus_inf_normaliser() -> None:
    x = torch.full((2, 300), -math.inf, device=DEVICE)
    x[0, 7] = 1.5
    values, ids, lse = vocab_topk.topk_logsumexp(x, 4, chunk=128)
    assert ids.tolist() == [[7, 0, 1, 2], [0, 1, 2, 3]]
    assert values[0, 0].item() == 1.5 and values[0, 1:].eq(-math.inf).all() and values[1].eq(-math.inf).all()
    assert lse.tolist() == [1.5, -math.inf]


@pytest.mark.parametrize("strategy", ["running", "extract", "sort"])
def test_negative_zero_ties_with_zero(strategy) -> None:
    x = torch.tensor([[-1.0, -0.0, 0.0, -0.0, -2.0]], device=DEVICE)
    _, ids, _ = vocab_topk.topk_logsumexp(x, 3, strategy=strategy)
    assert ids.tolist() == [[1, 2, 3]]


def test_running_list_takes_a_negative_zero_from_a_later_piece() -> None:
    """Zeros of both signs in different pieces and splits: a -0.0 ranks as +0.0 wherever it sits (by id: 3, 17,
    then 40 and 50 stay out)."""
    x = torch.full((1, 64), -5.0, device=DEVICE)
    x[0, [3, 40]] = 0.0
    x[0, [17, 50]] = -0.0
    x[0, 9] = 1.0
    _, ids, _ = vocab_topk.topk_logsumexp(x, 3, strategy="running", chunk=16, splits=2)
    assert ids.tolist() == [[9, 3, 17]]


@pytest.mark.parametrize("strategy", ["sort", "running"])
def test_extra_merge_passes_give_the_same_answer(strategy) -> None:
    """Force the multi-pass merge (16 lists merged two at a time) that only k = 512 uses at full vocabulary."""
    x = _logits(2, 1000, torch.float32, seed=11, ties=True)
    splits = 16 if strategy == "running" else None
    values, ids, lse = vocab_topk.topk_logsumexp(x, 8, strategy=strategy, chunk=64, splits=splits, merge_block=16)
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
    with pytest.raises(ShapeError, match="logits must be \\[rows, vocab\\]"):
        vocab_topk.topk_logsumexp(x[0], 1)
    with pytest.raises(ShapeError, match="float32, bfloat16 or float16"):
        vocab_topk.topk_logsumexp(x.double(), 1)
    with pytest.raises(ConfigError, match="chunk must be a power of two >= 8"):
        vocab_topk.topk_logsumexp(x, 5, chunk=4)
    with pytest.raises(ConfigError, match="merge_block must be a power of two >= 16"):
        vocab_topk.topk_logsumexp(x, 5, merge_block=8)
    with pytest.raises(ConfigError, match="strategy must be one of running, extract, sort"):
        vocab_topk.topk_logsumexp(x, 2, strategy="heap")
    with pytest.raises(ConfigError, match="splits applies to strategy 'running' only"):
        vocab_topk.topk_logsumexp(x, 2, strategy="sort", splits=2)
    with pytest.raises(ConfigError, match=r"splits must be an int in \[1, 65535\] \(a CUDA grid dimension\), got 0"):
        vocab_topk.topk_logsumexp(x, 2, splits=0)
    with pytest.raises(ConfigError, match="warps must be 1, 2, 4, 8 or 16, got 3"):
        vocab_topk.topk_logsumexp(x, 2, warps=3)
    with pytest.raises(ConfigError, match="and <= 65536, got 131072"):
        vocab_topk.topk_logsumexp(x, 2, chunk=131072)
    with pytest.raises(ShapeError, match="out ids must be"):
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


class _LaunchLog:
    """Stands in for a Triton kernel object and records each launch (``kernel[grid]``) under ``name``."""

    def __init__(self, kernel, name: str, log: list[str]) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize(("max_budget", "first_stage"), [(24, "_chunk_topk_kernel"), (16, "_running_topk_kernel")])
def test_kernel_trees_equal_torch_path_trees(monkeypatch, max_budget, first_stage) -> None:
    """Real-valued logits (no ties): the same nodes in the same order; scores agree to float32 rounding of the
    normaliser (the kernel and torch.logsumexp sum in different orders). Width 24 takes the "sort" first stage,
    width 16 the running list, here over pieces of 16 in 3 splits per row (not one piece of 512)."""
    monkeypatch.setattr(tuning, "RUNNING_CHUNK", 16)
    monkeypatch.setattr(vocab_topk, "MAX_SPLITS", 3)
    monkeypatch.setattr(vocab_topk, "_sm_count", lambda device: 132)  # as on an H200: MAX_SPLITS splits
    gen = torch.Generator().manual_seed(2)
    logits = (2 * torch.randn(2, 3, 300, generator=gen)).to(DEVICE)
    logits[1, 1] = -math.inf  # a depth with no usable token
    budgets, caps = torch.tensor([max_budget, 5], device=DEVICE), torch.tensor([0, 3], device=DEVICE)
    calls, launches = [], []
    real = vocab_topk.topk_logsumexp
    monkeypatch.setattr(vocab_topk, "topk_logsumexp", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    for name in ("_running_topk_kernel", "_chunk_topk_kernel"):
        monkeypatch.setattr(vocab_topk, name, _LaunchLog(getattr(vocab_topk, name), name, launches))
    fused = build_trees(logits, budgets, caps, max_budget=max_budget, fast_topk=True)
    reference = build_trees(logits, budgets, caps, max_budget=max_budget, fast_topk=False)
    assert calls == [max_budget] and launches == [first_stage]  # the kernel built the first tree only
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
@pytest.mark.parametrize(("k", "knobs"), [
    (16, {}),  # the running list with its defaults
    (16, {"strategy": "running", "chunk": 256, "splits": 1}),
    (16, {"strategy": "running", "chunk": 2048, "splits": 7}),
    (8, {"strategy": "extract"}),
    (16, {"strategy": "sort"}),
    (512, {}),  # "sort" and one extra merge pass
])
def test_full_vocabulary_on_cuda_matches_torch(k, knobs) -> None:
    """The shapes the engine uses: V = 151936, bf16 (plenty of exact ties), 30 rows, one all -inf."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(30, 151936, generator=gen, device="cuda").to(torch.bfloat16)
    x[-1] = -math.inf
    values, ids, lse = vocab_topk.topk_logsumexp(x, k, **knobs)
    xf = x.float()
    ref_values, _ = torch.topk(xf, k, dim=-1)
    assert torch.equal(values, ref_values)
    assert torch.equal(xf.gather(1, ids), values)
    # canonical: ids ascending within every run of equal values
    same = values[:, 1:] == values[:, :-1]
    assert bool((ids[:, 1:] > ids[:, :-1])[same].all())
    # The GPU's approximate exp2 and the summation order: 2.9e-6 relative measured with one program per row.
    torch.testing.assert_close(lse, torch.logsumexp(xf, -1), rtol=5e-6, atol=2e-6)
