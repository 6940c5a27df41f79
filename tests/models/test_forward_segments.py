"""TargetModel.forward_segments: a tree batch and a prompt chunk in one forward give what two forwards give.

Reference: the same target's :meth:`~ddtree.models.target.TargetModel.forward` run once per segment on a copy of
the cache. In fp32 the flat token-wise ops change only the matmuls' row count (agreement to rounding); in exact
mode (the one-row-at-a-time torch path, bf16) every segment's states, logits and cache entries are bit-identical.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from ddtree import speculative, triton_runtime
from ddtree.engine.kernels import KernelSet
from ddtree.errors import ShapeError
from ddtree.models.target import Segment
from ddtree.speculative.attention import TreeVisibility

PREFIX = 9  # tokens already in slot 0 before its tree round
CHUNK_START = 5  # tokens already in slot 1 before its chunk


def _tree_segment(gen: torch.Generator, vocab: int) -> Segment:
    """Two rows (slots 0 and 2) of a 4-node tree: root -> a, root -> b, a -> c."""
    parents = [-1, 0, 0, 1]
    vis = torch.zeros(4, 4, dtype=torch.bool)
    for i, p in enumerate(parents):
        vis[i, i] = True
        while p >= 0:
            vis[i, p] = True
            p = parents[p]
    depth = torch.tensor([0, 1, 1, 2])
    start = torch.tensor([PREFIX, 3])
    ids = torch.randint(0, vocab, (2, 4), generator=gen)
    write = start[:, None] + torch.arange(4)
    return Segment(ids, start[:, None] + depth, torch.tensor([0, 2]), write,
                   TreeVisibility(start, vis.expand(2, 4, 4).clone(), 32), None)


def _chunk_segment(gen: torch.Generator, vocab: int, width: int = 16, valid: int = 11) -> Segment:
    """One row (slot 1) of a causal chunk of ``valid`` tokens padded to ``width``."""
    start = torch.tensor([CHUNK_START])
    ids = torch.randint(0, vocab, (1, width), generator=gen)
    positions = start[:, None] + torch.arange(width)
    vis = speculative.causal_visibility(width, torch.tensor([valid]))
    return Segment(ids, positions, torch.tensor([1]), positions, TreeVisibility(start, vis, 32, branches=False),
                   torch.tensor([[valid - 1]]))


def _filled_cache(target, gen: torch.Generator):
    """A cache whose slots 0..2 hold random committed prefixes (K/V written by real forwards)."""
    cache = target.allocate_cache(4, 64)
    for slot, n in ((0, PREFIX), (1, CHUNK_START), (2, 3)):
        ids = torch.randint(0, target.config.vocab_size, (1, n), generator=gen)
        pos = torch.arange(n)[None]
        target(ids, pos, cache, torch.tensor([slot]), pos,
               TreeVisibility(torch.tensor([0]), speculative.causal_visibility(n, torch.tensor([n])), 32, branches=False))
    return cache


def _run(target, kernels, dtype):
    target = copy.deepcopy(target).to(dtype)
    gen = torch.Generator().manual_seed(3)
    cache = _filled_cache(target, gen)
    tree, chunk = _tree_segment(gen, target.config.vocab_size), _chunk_segment(gen, target.config.vocab_size)
    layers = (0, target.config.num_layers - 1)
    alone_cache = copy.deepcopy(cache)
    alone = [target(s.input_ids, s.positions, alone_cache, s.slots, s.write_pos, s.visibility, kernels=kernels,
                    logits_at=s.logits_at, hidden_layers=layers, head=False) for s in (tree, chunk)]
    together = target.forward_segments([tree, chunk], cache, kernels=kernels, hidden_layers=layers)
    return target, alone, together, alone_cache, cache


def test_fp32_segments_equal_separate_forwards(tiny_pair):
    target, alone, together, alone_cache, cache = _run(tiny_pair[0], None, torch.float32)
    for a, t in zip(alone, together, strict=True):
        assert t.normed.shape == a.normed.shape and t.hidden.shape == a.hidden.shape
        torch.testing.assert_close(t.normed, a.normed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(t.hidden, a.hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(target.head_logits(t.normed), target.head_logits(a.normed), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.k, alone_cache.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v, alone_cache.v, rtol=1e-5, atol=1e-5)


def test_exact_segments_are_bit_identical_to_separate_forwards(tiny_pair):
    kernels = replace(KernelSet.torch(), exact=True, tree_attention=True, exact_blas=())
    target, alone, together, alone_cache, cache = _run(tiny_pair[0], kernels, torch.bfloat16)
    for a, t in zip(alone, together, strict=True):
        assert torch.equal(t.normed, a.normed)
        assert torch.equal(t.hidden, a.hidden)
        assert torch.equal(target.head_logits(t.normed, kernels=kernels), target.head_logits(a.normed, kernels=kernels))
    assert torch.equal(cache.k, alone_cache.k) and torch.equal(cache.v, alone_cache.v)


@pytest.mark.skipif(not triton_runtime.INTERPRETED, reason="needs Triton's interpreter")
def test_exact_segments_are_bit_identical_through_the_triton_kernels(triton_kernels_on_cpu):
    """The same through exact mode's Triton kernels (the interpreter, fp32, a head dim the kernels take): the
    segments' matmuls then run over all the rows at once, and must still give each row its own bits."""
    pytest.importorskip("triton")
    from model_helpers import random_target

    kernels = replace(KernelSet.torch(), exact=True, tree_attention=True, exact_blas=())
    target, alone, together, alone_cache, cache = _run(random_target(seed=5, head_dim=16, num_layers=2), kernels,
                                                       torch.float32)
    for a, t in zip(alone, together, strict=True):
        assert torch.equal(t.normed, a.normed) and torch.equal(t.hidden, a.hidden)
    assert torch.equal(cache.k, alone_cache.k) and torch.equal(cache.v, alone_cache.v)


def test_a_wrong_segment_changes_the_other_segments_nothing_and_its_own_everything(tiny_pair):
    """Guard for the tests above: the chunk's rows really attend (a shifted chunk start changes its states) and
    the segments are independent (the tree's states do not move)."""
    target = tiny_pair[0]
    gen = torch.Generator().manual_seed(3)
    cache = _filled_cache(target, gen)
    tree, chunk = _tree_segment(gen, target.config.vocab_size), _chunk_segment(gen, target.config.vocab_size)
    base = target.forward_segments([tree, chunk], copy.deepcopy(cache))
    vis = chunk.visibility
    shifted = chunk._replace(visibility=TreeVisibility(vis.start - 2, vis.new_vis, vis.kv_len, branches=False),
                             write_pos=chunk.write_pos - 2)
    moved = target.forward_segments([tree, shifted], copy.deepcopy(cache))
    torch.testing.assert_close(moved[0].normed, base[0].normed, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(moved[1].normed, base[1].normed, atol=1e-3)


def test_no_segment_is_refused(tiny_pair):
    with pytest.raises(ShapeError, match="at least one segment"):
        tiny_pair[0].forward_segments([], tiny_pair[0].allocate_cache(1, 8))
