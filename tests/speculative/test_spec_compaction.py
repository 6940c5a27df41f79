"""compact_cache against a loop that copies one column at a time from an untouched copy."""

from __future__ import annotations

import pytest
import torch
from spec_oracles import DEVICE, KERNEL, compact_reference

from ddtree.speculative import build_trees, compact_cache, walk_trees


@pytest.mark.parametrize("kernel", KERNEL, indirect=True)
@pytest.mark.parametrize("seed", range(6))
def test_compaction_matches_loop_on_walked_trees(seed: int, kernel: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows, depths, vocab, budget = 4, 4, 3, 12
    layers, slots, heads, max_len, head_dim = 2, 6, 2, 40, 4
    trees = build_trees(2 * torch.randn(rows, depths, vocab, generator=gen), budget)
    choices = torch.randint(0, vocab, (rows, budget + 1), generator=gen)
    walk = walk_trees(trees, choices, depths)
    cache = torch.randn(layers, slots, heads, max_len, head_dim, generator=gen)
    slot_ids = torch.randperm(slots, generator=gen)[:rows]
    start = torch.randint(0, max_len - budget - 1, (rows,), generator=gen)
    expected = compact_reference(cache, slot_ids.tolist(), start.tolist(), walk.path.tolist())
    on = {"device": DEVICE} if kernel else {"device": "cpu"}
    cache = cache.to(**on)
    compact_cache(cache, slot_ids.to(**on), start.to(**on), walk.path.to(**on), kernel=kernel)
    assert torch.equal(cache.cpu(), expected)


@pytest.mark.parametrize("kernel", KERNEL, indirect=True)
def test_overlapping_moves_read_before_writing(kernel: bool) -> None:
    # Path 0, 2, 3, 5: node 2 moves to start+1 while node 3 moves to start+2 (node 2's old place) etc.
    dev = DEVICE if kernel else "cpu"
    cache = torch.arange(10.0, device=dev).view(1, 1, 1, 10, 1).repeat(1, 1, 1, 1, 2)
    compact_cache(cache, torch.tensor([0], device=dev), torch.tensor([1], device=dev),
                  torch.tensor([[0, 2, 3, 5, 5]], device=dev), kernel=kernel)
    assert cache[..., 0].flatten().tolist() == [0, 1, 3, 4, 6, 6, 6, 7, 8, 9]


def test_contiguous_fast_path_leaves_memory_untouched() -> None:
    cache = torch.randn(1, 2, 1, 8, 2)
    before = cache.clone()
    compact_cache(cache, torch.tensor([1]), torch.tensor([2]), torch.tensor([[0, 3, 4]]), contiguous=True)
    assert torch.equal(cache, before)
