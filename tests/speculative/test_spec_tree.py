"""build_trees / build_chain against a brute-force enumeration of every prefix, plus structural properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from spec_oracles import best_prefixes, depth_ranking, log_probs, random_tree_batch, tree_prefixes

from ddtree.errors import ConfigError, ShapeError
from ddtree.speculative import Trees, build_chain, build_trees
from ddtree.speculative.tree import candidate_count, candidate_pairs


def _boundary_tied(lp: np.ndarray, width: int) -> bool:
    """True when some depth has equal log-probs at ranks width and width + 1 (torch.topk picks which enters)."""
    vocab = lp.shape[1]
    if width >= vocab:
        return False
    for row in lp:
        ranked = depth_ranking(row)
        if row[ranked[width - 1]] == row[ranked[width]]:
            return True
    return False


def _check_against_oracle(logits: torch.Tensor, trees: Trees, budgets, caps, limits, max_budget: int) -> None:
    lp = log_probs(logits)
    vocab = lp.shape[2]
    for r in range(logits.shape[0]):
        expected = best_prefixes(lp[r], budgets[r], caps[r], limits[r])
        tokens, parents = trees.tokens[r].tolist(), trees.parents[r].tolist()
        valid, scores = trees.valid[r].tolist(), trees.scores[r].tolist()
        got = tree_prefixes(tokens, parents, valid)
        got_scores = [scores[i] for _, i in got]
        # Scores are float32 sums in depth order on both sides: compare exactly.
        assert got_scores == [s for _, s in expected], f"request {r}"
        if not _boundary_tied(lp[r], min(max_budget, vocab)):
            assert [p for p, _ in got] == [p for p, _ in expected], f"request {r}"
        # Valid nodes come first, in order, and exactly min(budget, available) of them.
        assert valid[: len(expected) + 1] == [True] * (len(expected) + 1)
        assert not any(valid[len(expected) + 1 :])


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_random_batches(seed: int) -> None:
    logits, budgets, caps, limits, max_budget = random_tree_batch(seed)
    trees = build_trees(logits, budgets, caps, max_budget=max_budget, depth_limit=limits)
    _check_against_oracle(logits, trees, budgets.tolist(), caps.tolist(), limits.tolist(), max_budget)


def test_probability_zero_tokens_are_never_nodes() -> None:
    logits = torch.tensor([[[0.0, -math.inf, 1.0], [-math.inf, -math.inf, -math.inf]]])
    trees = build_trees(logits, 5)
    assert trees.valid[0].tolist() == [True, True, True, False, False, False]
    assert trees.tokens[0, 1:3].tolist() == [2, 0]
    assert trees.depths[0].tolist() == [0, 1, 1, 0, 0, 0]


def test_worked_example_from_the_docstring() -> None:
    probs = torch.tensor([[[0.6, 0.3, 0.05, 0.05], [0.05, 0.05, 0.7, 0.2]]])
    trees = build_trees(probs.log(), 4, root_tokens=torch.tensor([3]))
    assert trees.tokens[0].tolist() == [3, 0, 2, 1, 2]
    assert trees.parents[0].tolist() == [-1, 0, 1, 0, 3]
    assert trees.depths[0].tolist() == [0, 1, 2, 1, 2]
    expected_vis = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]]
    assert trees.visibility[0].int().tolist() == expected_vis
    torch.testing.assert_close(trees.scores[0, 1:].exp(), torch.tensor([0.6, 0.42, 0.3, 0.21]))


def test_candidate_pairs_are_exactly_the_products_within_budget() -> None:
    for budget, width in [(1, 1), (7, 3), (16, 16), (30, 5)]:
        parent, token = candidate_pairs(budget, width, torch.device("cpu"))
        pairs = list(zip(parent.tolist(), token.tolist(), strict=True))
        expected = [(i - 1, j - 1) for i in range(1, budget + 1) for j in range(1, width + 1) if i * j <= budget]
        assert pairs == expected
        assert candidate_count(budget, width) == len(expected)


def test_per_request_settings_do_not_leak_between_requests() -> None:
    """A request's tree is the same alone and in a batch with different budgets, caps and depth limits."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 50, generator=gen)
    budgets, caps, limits = torch.tensor([0, 3, 12, 20]), torch.tensor([0, 1, 4, 0]), torch.tensor([5, 2, 5, 4])
    batch = build_trees(logits, budgets, caps, max_budget=20, depth_limit=limits)
    for r in range(4):
        alone = build_trees(logits[r : r + 1], budgets[r : r + 1], caps[r : r + 1], max_budget=20,
                            depth_limit=limits[r : r + 1])
        for field in Trees._fields:
            assert torch.equal(getattr(batch, field)[r], getattr(alone, field)[0]), (r, field)


def test_chain_equals_tree_with_top1_cap() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(-3, 3, (3, 6, 7), generator=gen).float()  # ties: lowest token id wins in both
    limits = torch.tensor([6, 3, 1])
    chain = build_chain(logits, depth_limit=limits, root_tokens=torch.tensor([5, 6, 1]), max_budget=9)
    tree = build_trees(logits, 6, 1, max_budget=9, depth_limit=limits, root_tokens=torch.tensor([5, 6, 1]))
    for field in Trees._fields:
        assert torch.equal(getattr(chain, field), getattr(tree, field)), field


def test_large_budget_random_logits_match_oracle_scores() -> None:
    """B well above the per-depth pruning bound's small cases (B = 40, L = 3, V = 6: every rank pair matters)."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 3, 6, generator=gen)
    trees = build_trees(logits, 40)
    _check_against_oracle(logits, trees, [40, 40], [0, 0], [3, 3], 40)


def test_rejects_bad_arguments_with_actionable_messages() -> None:
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ShapeError, match="draft_logits must be"):
        build_trees(logits[0], 4)
    with pytest.raises(ConfigError, match="budget 9 exceeds max_budget 4"):
        build_trees(logits, 9, max_budget=4)
    with pytest.raises(ShapeError, match=r"topk must be a scalar or have shape \[2\]"):
        build_trees(logits, 4, torch.tensor([1, 2, 3]))
    with pytest.raises(ConfigError, match="max_budget for a chain"):
        build_chain(logits, max_budget=2)


def test_a_shape_violation_is_a_shape_error_that_value_error_handlers_still_catch() -> None:
    """Shapes are the calling code's bug, settings the user's: two classes, both ValueErrors (callers that catch
    bad values keep working), neither a subclass of the other."""
    from ddtree.errors import DDTreeError

    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError) as shape:
        build_trees(logits[0], 4)
    with pytest.raises(ValueError) as setting:
        build_trees(logits, 9, max_budget=4)
    assert type(shape.value) is ShapeError and type(setting.value) is ConfigError
    assert isinstance(shape.value, DDTreeError) and not isinstance(shape.value, ConfigError)
    assert not isinstance(setting.value, ShapeError)


@st.composite
def tree_inputs(draw):
    rows = draw(st.integers(1, 3))
    depths = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 7))
    max_budget = draw(st.integers(0, 24))
    values = st.one_of(st.integers(-3, 3).map(float), st.floats(-8, 8, width=32), st.just(-math.inf))
    logits = torch.tensor(draw(st.lists(values, min_size=rows * depths * vocab, max_size=rows * depths * vocab)))
    budgets = torch.tensor(draw(st.lists(st.integers(0, max_budget), min_size=rows, max_size=rows)))
    caps = torch.tensor(draw(st.lists(st.integers(0, vocab + 1), min_size=rows, max_size=rows)))
    limits = torch.tensor(draw(st.lists(st.integers(0, depths), min_size=rows, max_size=rows)))
    return logits.reshape(rows, depths, vocab), budgets, caps, limits, max_budget


@settings(max_examples=150, deadline=None)
@given(tree_inputs())
def test_tree_properties(inputs) -> None:
    logits, budgets, caps, limits, max_budget = inputs
    trees = build_trees(logits, budgets, caps, max_budget=max_budget, depth_limit=limits)
    lp = log_probs(logits)
    rows, n = trees.tokens.shape
    assert n == max_budget + 1
    for r in range(rows):
        tokens, parents, depths = trees.tokens[r].tolist(), trees.parents[r].tolist(), trees.depths[r].tolist()
        valid, scores, vis = trees.valid[r].tolist(), trees.scores[r].tolist(), trees.visibility[r].tolist()
        assert valid[0] and parents[0] == -1 and depths[0] == 0 and scores[0] == 0.0
        assert sum(valid) - 1 <= int(budgets[r])
        assert valid == sorted(valid, reverse=True), "valid nodes first"
        children = {}
        for i in range(1, n):
            if not valid[i]:
                assert not any(vis[i]) and not any(row[i] for row in vis), "padding invisible"
                assert scores[i] == -math.inf
                continue
            p = parents[i]
            assert 0 <= p < i and valid[p], "parent valid and earlier: prefix-closed"
            assert depths[i] == depths[p] + 1 <= int(limits[r])
            assert scores[i] <= scores[i - 1], "descending score order"
            assert scores[i] == float(np.float32(scores[p] + lp[r, depths[i] - 1, tokens[i]]))
            assert math.isfinite(scores[i])
            children.setdefault(p, []).append(tokens[i])
            ancestors, j = set(), i
            while j >= 0:
                ancestors.add(j)
                j = parents[j]
            assert [j for j in range(n) if vis[i][j]] == sorted(ancestors)
        for sibling_tokens in children.values():
            assert len(sibling_tokens) == len(set(sibling_tokens)), "siblings carry distinct tokens"
            if int(caps[r]) > 0:
                assert len(sibling_tokens) <= int(caps[r])


def test_half_precision_logits_give_the_float32_tree() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(3, 4, 40, generator=gen)).to(torch.bfloat16)  # bf16: plenty of exact ties
    half = build_trees(logits, torch.tensor([9, 0, 16]), 3, max_budget=16)
    full = build_trees(logits.float(), torch.tensor([9, 0, 16]), torch.tensor(3), max_budget=16)
    for field in Trees._fields:
        assert torch.equal(getattr(half, field), getattr(full, field)), field
