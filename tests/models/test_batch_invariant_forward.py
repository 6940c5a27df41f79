"""The target's exact-mode forward (ddtree.models.exact_forward): a tree verify's logits at the nodes of the path
AR decoding takes are bit-identical to AR's own, and a request's logits do not change beside another request.

Reference: the same forward run as plain decoding (a prompt prefill, then one token a step), which is how AR
computes. In bf16 (where rounding differences show) through the torch path, and through the Triton kernels in the
interpreter (fp32, a head dim the kernel takes).
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import random_target

from ddtree import speculative, triton_runtime
from ddtree.models import exact_forward
from ddtree.speculative.attention import TreeVisibility

PARENTS = (-1, 0, 0, 1, 3, 2, 4)  # the path AR follows: nodes 0, 1, 3, 4, 6
PATH = (0, 1, 3, 4, 6)
PROMPT = (5, 17, 3, 88, 41, 9, 60, 2, 33)


def _tree(parents):
    t = len(parents)
    vis = torch.zeros(t, t, dtype=torch.bool)
    depth = []
    for i in range(t):
        j, d = i, -1
        while j >= 0:
            vis[i, j] = True
            j, d = parents[j], d + 1
        depth.append(d)
    return vis, torch.tensor(depth)


def _step(target, cache, ids, slot, start, new_vis, depth, kv_len, triton):
    """One exact forward of one row: ids [T] at start, visibility new_vis [T, T], depths [T] -> logits [T, V]."""
    t = len(ids)
    s = torch.tensor([start])
    args = (target, torch.tensor([ids]), s[:, None] + depth[None], cache, torch.tensor([slot]),
            speculative.tree_write_positions(s, t), TreeVisibility(s, new_vis[None], kv_len), None, ())
    logits = exact_forward.forward(*args, triton=triton).logits
    # the CUDA-graph runner's split (layers, then the head in the next graph) gives the same bits
    split = exact_forward.forward(*args, triton=triton, head=False)
    assert split.logits is None
    assert torch.equal(exact_forward.head_logits(target, split.normed, triton=triton), logits)
    return logits[0]


def _check(target, triton):
    cache = target.allocate_cache(3, 128)
    p = len(PROMPT)
    causal = torch.tril(torch.ones(p, p, dtype=torch.bool))
    # AR in slot 0: prefill the prompt, then decode the tree's path tokens one at a time
    tokens = [11, 23, 45, 67, 89, 12, 34]  # node i's token
    ar = [_step(target, cache, list(PROMPT), 0, 0, causal, torch.arange(p), 64, triton)[-1]]
    for d in range(len(PATH)):
        one = torch.ones(1, 1, dtype=torch.bool)
        ar.append(_step(target, cache, [tokens[PATH[d]]], 0, p + d, one, torch.zeros(1, dtype=torch.long),
                        64 if d % 2 else 128, triton)[0])
    # the tree in slot 1 over the same prompt (prefilled in two chunks this time)
    _step(target, cache, list(PROMPT[:4]), 1, 0, causal[:4, :4], torch.arange(4), 64, triton)
    _step(target, cache, list(PROMPT[4:]), 1, 4, causal[:p - 4, :p - 4], torch.arange(p - 4), 128, triton)
    vis, depth = _tree(PARENTS)
    tree = _step(target, cache, tokens, 1, p, vis, depth, 64, triton)
    for d, node in enumerate(PATH):
        assert torch.equal(tree[node], ar[d + 1]), f"node {node} (depth {d}) differs from AR's logits"
    # the same tree beside another request (a different slot, start and tree), two rows in one call
    other_vis, other_depth = _tree((-1, 0, 1))
    _step(target, cache, [7, 8], 2, 0, torch.tril(torch.ones(2, 2, dtype=torch.bool)), torch.arange(2), 64, triton)
    t = len(PARENTS)
    pad_vis = torch.zeros(2, t, t, dtype=torch.bool)
    pad_vis[0] = vis
    pad_vis[1, :3, :3] = other_vis
    depths = torch.zeros(2, t, dtype=torch.long)
    depths[0], depths[1, :3] = depth, other_depth
    start = torch.tensor([p, 2])
    ids = torch.tensor([tokens, [1, 2, 3, 0, 0, 0, 0]])
    logits = exact_forward.forward(target, ids, start[:, None] + depths, cache, torch.tensor([1, 2]),
                                   speculative.tree_write_positions(start, t),
                                   TreeVisibility(start, pad_vis, 128), None, (), triton=triton).logits
    assert torch.equal(logits[0], tree)


def test_exact_forward_tree_equals_ar_bf16_torch_path():
    target = random_target(seed=4).to(torch.bfloat16)
    _check(target, triton=False)


@pytest.mark.skipif(not triton_runtime.INTERPRETED, reason="needs Triton's interpreter")
def test_exact_forward_tree_equals_ar_triton(triton_kernels_on_cpu):
    pytest.importorskip("triton")
    target = random_target(seed=5, head_dim=16, num_layers=2)
    _check(target, triton=True)


def test_exact_forward_close_to_the_plain_forward():
    """Exact mode changes rounding only: the torch path's logits match the plain decoder's in fp32."""
    target = random_target(seed=6)
    p = len(PROMPT)
    causal = torch.tril(torch.ones(p, p, dtype=torch.bool))
    cache = target.allocate_cache(1, 64)
    got = _step(target, cache, list(PROMPT), 0, 0, causal, torch.arange(p), 64, False)
    ref = target.forward_train(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
