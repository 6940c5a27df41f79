"""Positions and attention masks against masks written out by loops."""

from __future__ import annotations

import torch

from ddtree.speculative import (
    additive_mask,
    build_attention_mask,
    build_trees,
    causal_visibility,
    tree_positions,
    tree_write_positions,
)


def test_positions_use_depth_and_writes_use_flat_index() -> None:
    trees = build_trees(torch.tensor([[[0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]]).log().repeat(2, 1, 1), 4)
    start = torch.tensor([7, 20])
    assert tree_positions(start, trees.depths).tolist() == [[7, 8, 9, 8, 9], [20, 21, 22, 21, 22]]
    assert tree_write_positions(start, 5).tolist() == [[7, 8, 9, 10, 11], [20, 21, 22, 23, 24]]


def test_causal_visibility_masks_padding() -> None:
    vis = causal_visibility(3, torch.tensor([3, 2, 0]))
    assert vis[0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert vis[1].int().tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 0]]
    assert not vis[2].any()


def test_tree_mask_matches_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    trees = build_trees(torch.randn(3, 3, 4, generator=gen), torch.tensor([6, 2, 0]), max_budget=6)
    prefix_len = torch.tensor([5, 0, 9])
    write = tree_write_positions(prefix_len, 7)
    kv_len = 18
    mask = build_attention_mask(prefix_len, write, trees.visibility, kv_len)
    for r in range(3):
        for t in range(7):
            for p in range(kv_len):
                seen = p < prefix_len[r] or p == write[r, t] or any(
                    bool(trees.visibility[r, t, u]) and int(write[r, u]) == p for u in range(7)
                )
                assert bool(mask[r, t, p]) == seen, (r, t, p)


def test_shared_write_position_keeps_the_visible_token() -> None:
    # Two padding tokens share position 3; token 0 sees token 2 (also at 3) but not token 1.
    write = torch.tensor([[2, 3, 3]])
    vis = torch.tensor([[[True, False, True], [False, True, False], [False, False, True]]])
    mask = build_attention_mask(torch.tensor([1]), write, vis, 5)
    assert mask[0].int().tolist() == [[1, 0, 1, 1, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 0]]


def test_additive_mask_is_zero_or_finite_minimum() -> None:
    mask = torch.tensor([[True, False]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        add = additive_mask(mask, dtype)
        assert add.dtype == dtype
        assert add.tolist() == [[0.0, torch.finfo(dtype).min]]
        scores = torch.softmax(torch.zeros(1, 2, dtype=torch.float32) + add.float(), -1)
        assert scores.tolist() == [[1.0, 0.0]]
