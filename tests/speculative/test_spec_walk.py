"""walk_trees against a plain step-by-step walk, on built trees, chains and hand-made trees."""

from __future__ import annotations

import pytest
import torch
from spec_oracles import DEVICE, KERNEL, walk_reference

from ddtree.errors import ShapeError
from ddtree.speculative import Trees, build_chain, build_trees, walk_trees
from ddtree.speculative.tree import ancestor_visibility


def _check_walk(trees: Trees, choices: torch.Tensor, max_depth: int, kernel: bool = False) -> None:
    if kernel:
        trees = Trees(*(t.to(DEVICE) for t in trees))
        choices = choices.to(DEVICE)
    result = walk_trees(trees, choices, max_depth, kernel=kernel)
    if kernel:
        trees = Trees(*(t.cpu() for t in trees))
        result = type(result)(*(t.cpu() for t in result))
    for r in range(trees.tokens.shape[0]):
        tokens, choice = trees.tokens[r].tolist(), choices[r].tolist()
        path = walk_reference(tokens, trees.parents[r].tolist(), trees.valid[r].tolist(), choice)
        n = len(path)
        bonus = choice[path[-1]]
        assert int(result.num_accepted[r]) == n
        assert result.path[r].tolist() == path + [path[-1]] * (max_depth + 1 - n)
        assert int(result.bonus[r]) == bonus
        assert result.new_tokens[r].tolist() == [tokens[i] for i in path[1:]] + [bonus] * (max_depth + 2 - n)


@pytest.mark.parametrize("kernel", KERNEL, indirect=True)
@pytest.mark.parametrize("seed", range(20))
def test_walk_matches_reference_on_built_trees(seed: int, kernel: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows, depths, vocab, max_budget = 6, 4, 3, 14
    logits = 2 * torch.randn(rows, depths, vocab, generator=gen)
    budgets = torch.randint(0, max_budget + 1, (rows,), generator=gen)
    trees = build_trees(logits, budgets, max_budget=max_budget, root_tokens=torch.randint(0, vocab, (rows,)))
    # A small vocabulary makes long accepted paths common; biasing choices towards tokens 0/1 mixes both.
    choices = torch.randint(0, vocab, (rows, max_budget + 1), generator=gen)
    _check_walk(trees, choices, depths, kernel)


@pytest.mark.parametrize("kernel", KERNEL, indirect=True)
def test_walk_accepts_the_whole_chain_and_nothing(kernel: bool) -> None:
    logits = torch.tensor([[[0.0, 5.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 5.0]]]).repeat(2, 1, 1).to(DEVICE)
    chain = build_chain(logits)  # tokens root, 1, 0, 2
    everything = torch.tensor([[1, 0, 2, 1], [2, 0, 2, 1]], device=DEVICE)  # request 1 rejects at the root
    result = walk_trees(chain, everything, 3, kernel=kernel)
    assert result.num_accepted.tolist() == [4, 1]
    assert result.path.tolist() == [[0, 1, 2, 3], [0, 0, 0, 0]]
    assert result.new_tokens.tolist() == [[1, 0, 2, 1], [2, 2, 2, 2]]
    assert result.bonus.tolist() == [1, 2]


@pytest.mark.parametrize("kernel", KERNEL, indirect=True)
def test_walk_on_hand_made_tree_with_padding_that_would_match(kernel: bool) -> None:
    # root -> a(1) -> c(2); root -> b(3); node 4 is padding whose token/parent would match if not masked.
    tokens = torch.tensor([[9, 1, 3, 2, 5]])
    parents = torch.tensor([[-1, 0, 1, 0, 1]])
    depths = torch.tensor([[0, 1, 2, 1, 0]])
    valid = torch.tensor([[True, True, True, True, False]])
    trees = Trees(tokens, parents, depths, valid, ancestor_visibility(parents, valid, 2),
                  torch.zeros(1, 5))
    for choice in ([1, 5, 0, 0, 0], [2, 3, 0, 0, 0], [1, 3, 7, 0, 0], [4, 0, 0, 0, 0]):
        _check_walk(trees, torch.tensor([choice]), 2, kernel)


def test_walk_rejects_mismatched_shapes() -> None:
    trees = build_trees(torch.randn(2, 3, 4), 3)
    with pytest.raises(ShapeError, match="choices must have the trees' shape"):
        walk_trees(trees, torch.zeros(2, 3, dtype=torch.long), 3)
