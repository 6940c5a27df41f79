"""The Triton node selection (``build_trees(..., fast_topk=True)``) against the torch loop and a brute-force oracle.

Without a GPU the kernel runs through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1; every test
here runs inside ``triton_runtime.cpu_interpreter()``), so shapes stay small. Each depth's candidates always come
from the torch vocabulary pass here (``depth_candidates`` with fast_topk=False), so both paths select from the same
float32 log-probs and must agree bit for bit: same nodes, parents, depths, tokens and scores.
"""

from __future__ import annotations

import inspect
import math
import re

import numpy as np
import pytest
import torch
from spec_oracles import best_prefixes, log_probs, random_tree_batch, tree_prefixes

from ddtree import triton_runtime
from ddtree.errors import ConfigError, ShapeError
from ddtree.speculative import Trees, build_trees, tree, tree_select

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    triton_runtime.triton is None or (DEVICE == "cpu" and not triton_runtime.INTERPRETED),
    reason="needs Triton, and without a GPU its interpreter (TRITON_INTERPRET=1 before import)",
)


@pytest.fixture(autouse=True)
def _selection_kernel_only(monkeypatch):
    """Kernels run on CPU tensors through the interpreter; the vocabulary pass stays on torch (see module doc)."""
    torch_pass = tree.depth_candidates
    monkeypatch.setattr(tree, "depth_candidates", lambda logits, width, fast_topk=False: torch_pass(logits, width))
    with triton_runtime.cpu_interpreter():
        yield


@pytest.fixture
def launches(monkeypatch) -> list[int]:
    """The max_budget of every select_nodes call build_trees makes."""
    calls: list[int] = []
    real = tree_select.select_nodes
    monkeypatch.setattr(tree_select, "select_nodes", lambda *args: calls.append(args[3]) or real(*args))
    return calls


def _assert_same_trees(logits, budget, topk=None, *, max_budget, depth_limit=None) -> Trees:
    args = dict(max_budget=max_budget, depth_limit=depth_limit)
    reference = build_trees(logits, budget, topk, **args)
    fused = build_trees(logits, budget, topk, fast_topk=True, **args)
    for field in Trees._fields:
        assert torch.equal(getattr(fused, field), getattr(reference, field)), field
    return fused


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _peaked_then_flat(vocab: int, depths: int, high: int) -> torch.Tensor:
    """[1, depths, vocab]: ``high`` equally likely tokens at depth 1 (the rest far below), flat deeper depths.

    The b-th depth-1 prefix is then a hopeless one, so nearly every child of the ``high`` good ones survives the
    first depth's threshold, and all children of a parent tie: (parent rank, token rank) decides their order."""
    logits = torch.zeros(1, depths, vocab)
    logits[0, 0, high:] = -30.0
    return logits


CASES = {
    # name: (logits, budget, topk, max_budget, depth_limit)
    "integer_logits_mixed_budgets_caps_limits": lambda: (
        torch.randint(-2, 2, (4, 4, 12), generator=_gen(1)).float(), torch.tensor([8, 3, 0, 11]),
        torch.tensor([0, 2, 5, 1]), 8, torch.tensor([4, 2, 1, 3])),
    "limits_zero_and_past_the_depths": lambda: (
        torch.randn(3, 3, 10, generator=_gen(2)), torch.tensor([5, 5, 5]), None, 5, torch.tensor([0, 7, 2])),
    "vocab_smaller_than_budget": lambda: (
        3 * torch.randn(2, 3, 5, generator=_gen(3)), torch.tensor([16, 9]), torch.tensor([0, 3]), 16, None),
    "single_depth": lambda: (torch.randint(-1, 2, (3, 1, 9), generator=_gen(4)).float(), 8, None, 8, None),
    "two_depths_budget_2": lambda: (torch.randint(-1, 1, (3, 2, 4), generator=_gen(5)).float(), 2, None, 2, None),
    "budget_1": lambda: (torch.randn(2, 3, 6, generator=_gen(6)), torch.tensor([1, 0]), None, 1, None),
    "budget_as_scalar_tensor": lambda: (torch.randn(2, 3, 20, generator=_gen(7)), torch.tensor(5), None, 8, None),
    "several_sorted_chunks_per_depth": lambda: (_peaked_then_flat(40, 3, 4), 16, None, 16, None),
    "grouped_ties_budget_64": lambda: (
        -(torch.arange(90).float() // 3).expand(2, 5, 90) + torch.randint(0, 2, (2, 5, 90), generator=_gen(8)),
        torch.tensor([64, 40]), torch.tensor([0, 20]), 64, None),
    "random_budget_64": lambda: (2 * torch.randn(3, 5, 100, generator=_gen(9)), 64, None, 64, None),
    # Depth 3's best prefix (.486) beats only the 3rd-best prefix so far (b, .4): the threshold is the b-th entry.
    "threshold_is_the_budget_th_entry": lambda: (
        torch.tensor([[[0.6, 0.4], [0.9, 0.1], [0.9, 0.1]]]).log(), 3, None, 3, None),
    "budget_512_small_vocab": lambda: (
        2 * torch.randn(2, 4, 40, generator=_gen(10)), torch.tensor([512, 100]), torch.tensor([0, 7]), 512, None),
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if "512" in c else c for c in CASES]  # 512: ~8 s interpreted
)
def test_trees_equal_the_torch_loop(case: str, launches: list[int]) -> None:
    logits, budget, topk, max_budget, depth_limit = CASES[case]()
    logits, budget, topk, depth_limit = (t.to(DEVICE) if isinstance(t, torch.Tensor) else t
                                         for t in (logits, budget, topk, depth_limit))
    _assert_same_trees(logits, budget, topk, max_budget=max_budget, depth_limit=depth_limit)
    assert launches == [max_budget]


@pytest.mark.parametrize("seed", range(24))
def test_trees_equal_the_torch_loop_on_random_small_batches(seed: int) -> None:
    """Integer logits (ties everywhere), real ones, all-equal ones and ones with -inf holes; per-request budgets
    (0 and above max_budget), caps and depth limits (0 and past L) drawn at random."""
    gen = _gen(100 + seed)
    draw = lambda high: int(torch.randint(1, high + 1, (1,), generator=gen))  # noqa: E731
    rows, depths, vocab, max_budget = draw(4), draw(5), draw(30), [1, 2, 3, 5, 8, 13, 16, 33][draw(8) - 1]
    shape = (rows, depths, vocab)
    logits = [torch.randint(-2, 2, shape, generator=gen).float(), 3 * torch.randn(shape, generator=gen),
              torch.zeros(shape), torch.randn(shape, generator=gen)][seed % 4]
    if seed % 4 == 3:
        logits = torch.where(torch.rand(shape, generator=gen) < 0.4, -math.inf, logits)
    budget = torch.randint(0, max_budget + 3, (rows,), generator=gen)
    topk = torch.randint(0, vocab + 1, (rows,), generator=gen) if seed % 3 else None
    depth_limit = torch.randint(0, depths + 2, (rows,), generator=gen) if seed % 2 else None
    logits, budget, topk, depth_limit = (t if t is None else t.to(DEVICE) for t in (logits, budget, topk, depth_limit))
    _assert_same_trees(logits, budget, topk, max_budget=max_budget, depth_limit=depth_limit)


def test_dead_depths_and_an_empty_request() -> None:
    logits = torch.randn(3, 4, 7, generator=_gen(11))
    logits[0, 1] = -math.inf  # request 0: nothing below depth 1
    logits[1, 0] = -math.inf  # request 1: no tree at all
    logits[2, 3, 2:] = -math.inf  # request 2: one token left at depth 4
    trees = _assert_same_trees(logits.to(DEVICE), 8, max_budget=8)
    assert trees.depths[0].max() == 1 and trees.valid[1].sum() == 1


def test_the_chunked_case_really_has_more_survivors_than_a_block() -> None:
    """Premise of "several_sorted_chunks_per_depth": depth 2 has more candidates above the first threshold than
    the kernel's block, so they are merged in several sorted chunks."""
    lp = log_probs(_peaked_then_flat(40, 3, 4))[0]  # [L, V]
    budget = 16
    first = np.sort(lp[0])[::-1][:budget]
    second = np.sort(lp[1])[::-1]
    survivors = sum(first[i] + second[j] > first[-1] for i in range(budget) for j in range(budget // (i + 1)))
    assert survivors > tree_select._block(budget)


@pytest.mark.parametrize("seed", range(8))
def test_kernel_trees_match_the_brute_force_oracle(seed: int) -> None:
    """Same random batches as test_spec_tree (integer logits for odd seeds: ties inside and across depths)."""
    logits, budgets, caps, limits, max_budget = random_tree_batch(seed)
    trees = build_trees(logits.to(DEVICE), budgets.to(DEVICE), caps.to(DEVICE), max_budget=max_budget,
                        depth_limit=limits.to(DEVICE), fast_topk=True)
    lp = log_probs(logits)
    for r in range(logits.shape[0]):
        expected = best_prefixes(lp[r], int(budgets[r]), int(caps[r]), int(limits[r]))
        valid = trees.valid[r].tolist()
        got = tree_prefixes(trees.tokens[r].tolist(), trees.parents[r].tolist(), valid)
        # Which of several tokens tied at the K'-th logit enter is torch.topk's choice: compare scores, and token
        # paths where the vocabulary fits the width. Scores to float32 rounding: with fast_topk on a GPU the
        # vocabulary kernel's logsumexp (the normaliser) is not bit-equal to torch's (vocab_topk's docstring).
        assert [trees.scores[r, i].item() for _, i in got] == pytest.approx([s for _, s in expected], rel=1e-6,
                                                                            abs=1e-6), f"request {r}"
        if logits.shape[2] <= max_budget:
            assert [p for p, _ in got] == [p for p, _ in expected], f"request {r}"
        assert valid == [True] * (len(expected) + 1) + [False] * (max_budget - len(expected))


def test_select_nodes_blanks_what_is_not_a_node() -> None:
    """Columns past a request's budget or without a finite score are (-inf, 0, 0, 0); the others are the tree's
    nodes: depth - 1, parent node, and the token's rank in its depth's candidate list."""
    logits = torch.randint(-2, 1, (3, 2, 6), generator=_gen(12)).float()
    logits[0, 0, 1:] = -math.inf
    logits[0, 1, 2:] = -math.inf  # request 0: only 3 prefixes have a finite score
    budget = torch.tensor([6, 2, 0])
    reference = build_trees(logits, budget, max_budget=6)
    lp, tokens = tree.depth_candidates(logits, 6)
    out = tree_select.select_nodes(lp.to(DEVICE), budget.to(DEVICE), None, 6)
    score, depth, parent, rank = (t.cpu() for t in out)
    assert score.dtype == torch.float32 and depth.dtype == parent.dtype == rank.dtype == torch.long
    node = reference.valid[:, 1:]
    assert node.sum(1).tolist() == [3, 2, 0]
    assert torch.equal(score, reference.scores[:, 1:])  # -inf where not a node
    assert torch.equal(torch.where(node, depth + 1, 0), reference.depths[:, 1:])
    assert torch.equal(torch.where(node, parent, 0), reference.parents[:, 1:])
    token = torch.gather(tokens.reshape(3, -1), 1, depth * 6 + rank)
    assert torch.equal(torch.where(node, token, 0), reference.tokens[:, 1:])
    assert not torch.stack([depth, parent, rank])[:, ~node].any()


def test_build_trees_uses_the_kernel_only_when_asked_and_within_its_limits(monkeypatch, launches) -> None:
    logits = torch.randn(2, 3, 30, generator=_gen(13)).to(DEVICE)
    default = build_trees(logits, 12)
    assert launches == []  # fast_topk=False: the torch loop
    fused = build_trees(logits, 12, fast_topk=True)
    assert launches == [12]
    monkeypatch.setattr(tree_select, "MAX_BUDGET", 8)
    above = build_trees(logits, 12, fast_topk=True)
    assert launches == [12]  # 12 > MAX_BUDGET: the torch loop
    for field in Trees._fields:
        assert torch.equal(getattr(fused, field), getattr(default, field)), field
        assert torch.equal(getattr(above, field), getattr(default, field)), field


def test_limits_follow_the_key_fields() -> None:
    assert tree_select.max_depths(512) == 2**13 - 1  # 2 * 9 index bits, 13 depth bits below 2**31
    assert tree_select.max_depths(tree_select.MAX_BUDGET) >= 31  # block size 32 drafters at the largest budget
    lp = torch.zeros(1, 2, 4, device=DEVICE)
    assert tree_select.available(lp, 4)
    assert not tree_select.available(lp, tree_select.MAX_BUDGET + 1)
    assert not tree_select.available(lp.double(), 4)
    with triton_runtime.cpu_interpreter(active=False):
        assert tree_select.available(lp, 4) == lp.is_cuda


def test_rejects_bad_arguments() -> None:
    lp = torch.zeros(2, 3, 4, device=DEVICE)
    budget = torch.tensor([4, 4], device=DEVICE)
    with pytest.raises(ShapeError, match="float32"):
        tree_select.select_nodes(lp.double(), budget, None, 4)
    with pytest.raises(ConfigError, match="max_budget"):
        tree_select.select_nodes(lp, budget, None, 0)
    with pytest.raises(ConfigError, match="max_budget"):
        tree_select.select_nodes(lp, budget, None, tree_select.MAX_BUDGET + 1)
    with pytest.raises(ShapeError, match="width 4"):
        tree_select.select_nodes(lp, budget, None, 3)
    with pytest.raises(ShapeError, match="budget must be a long tensor of shape \\[2\\]"):
        tree_select.select_nodes(lp, budget[:1], None, 4)
    with pytest.raises(ShapeError, match="depth_limit"):
        tree_select.select_nodes(lp, budget, budget.int(), 4)


# float("-inf") literals in the kernel are fine; float(tensor) is not.
HOST_READS = re.compile(r'\.item\(|\.tolist\(|\bint\(|\bfloat\((?!")|\bbool\(|\.cpu\(|\.numpy\(|nonzero|\.synchronize\(')


def test_module_reads_nothing_on_the_host() -> None:
    assert HOST_READS.findall(inspect.getsource(tree_select)) == []
    assert HOST_READS.findall('a.item() + int(b) + c.tolist() + float(d) + float("-inf")') == [
        ".item(", "int(", ".tolist(", "float(",
    ]


@pytest.mark.gpu
def test_engine_shapes_on_cuda_match_the_torch_loop_eager_and_graphed() -> None:
    """V = 151936, L = 15, bf16 logits (ties): random ones (the kernel stops at depth 2) and peaked ones (deep
    trees); R = 1 and 64, B = 16 and 512; the fused build replayed from a CUDA graph gives the same trees."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, budget in ((1, 512), (64, 16), (8, 512)):
        logits = torch.randn(rows, 15, 151936, generator=gen, device="cuda")
        logits[rows // 2:] *= 6.0  # peaked rows: a few likely tokens per depth
        logits = logits.to(torch.bfloat16)
        budgets = torch.full((rows,), budget, device="cuda")
        _assert_same_trees(logits, budgets, max_budget=budget)
        out: list[Trees] = []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            build_trees(logits, budgets, max_budget=budget, fast_topk=True)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.append(build_trees(logits, budgets, max_budget=budget, fast_topk=True))
        graph.replay()
        torch.cuda.synchronize()
        eager = build_trees(logits, budgets, max_budget=budget)
        for field in Trees._fields:
            assert torch.equal(getattr(out[0], field), getattr(eager, field)), (rows, budget, field)
