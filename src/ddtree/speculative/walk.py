"""The verification walk: which draft nodes the target accepts, batched and without a host sync.

Terms
-----
choice     the target's token at a node: argmax (greedy) or a sample (see :mod:`ddtree.speculative.sampling`) of its
           next-token distribution given the node's prefix.
accepted   the root, and every node whose token equals its parent's choice while the parent is accepted.
bonus      the choice at the deepest accepted node: the one token the target adds beyond the tree.

Starting at the root, follow the child whose token equals the current node's choice; stop when no child matches.
Siblings carry distinct tokens (``build_trees`` guarantees it), so the accepted nodes form one root path.

Instead of stepping down the tree (L dependent gathers), every node is judged at once: node i is accepted iff it
is valid and every node on its ancestor path (``visibility`` row i, root excluded) matches its parent's choice.
For the example tree of :mod:`ddtree.speculative.tree` (root, a, ac, b, bc) and choices root->a, a->d: node 1 (a)
matches, node 2 (ac) fails (a chose d), so path = [0, 1], num_accepted = 2, new_tokens = [a, d], bonus = d.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ddtree.errors import ConfigError, ShapeError
from ddtree.speculative.tree import Trees
from ddtree.triton_runtime import FP_FUSION, can_run, tl, triton


class WalkResult(NamedTuple):
    """Outcome of one verification round for every request."""

    path: Tensor  # [R, L + 1] accepted node indices, root first; padded by repeating the last accepted index
    num_accepted: Tensor  # [R] long, nodes on the path including the root (>= 1)
    new_tokens: Tensor  # [R, L + 1] tokens of path[1:n] then the bonus; padded with the bonus
    bonus: Tensor  # [R] long, the choice at the last accepted node


def accepted_nodes(trees: Trees, choices: Tensor) -> Tensor:
    """[R, N] bool: the nodes the target accepts given its choice at every node (choices: [R, N] long)."""
    parent = trees.parents.clamp(min=0)
    matches = (trees.tokens == torch.gather(choices, 1, parent)) & trees.valid  # [R, N]
    matches[:, 0] = True
    # Node i fails if any node on its path (itself and its ancestors) fails to match.
    broken = (trees.visibility & ~matches.unsqueeze(1)).any(dim=2)  # [R, N]
    return trees.valid & ~broken


def walk_trees(trees: Trees, choices: Tensor, max_depth: int, *, kernel: bool = False) -> WalkResult:
    """Walk every tree along the target's choices.

    trees: from :func:`ddtree.speculative.build_trees` (any tree with distinct sibling tokens and depths <= max_depth).
    choices: [R, N] long, the target's choice at every node (padding nodes' entries are ignored).
    max_depth: L, static; sizes ``path`` and ``new_tokens`` as [R, L + 1].
    kernel: walk with one Triton program per request where it can run (the caller's choice, the engine's
        ``gpu_kernels``): the ~15 small kernels below cost ~45 us under a CUDA graph on an H200, the one launch a
        few. Same results (it steps down the tree instead of judging every node at once).
    """
    if choices.shape != trees.tokens.shape:
        raise ShapeError(f"choices must have the trees' shape {tuple(trees.tokens.shape)}, got {tuple(choices.shape)}")
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise ConfigError(f"max_depth must be an int >= 0 (the draft depth L), got {max_depth!r}")
    rows, n = trees.tokens.shape
    device = choices.device
    choices = choices.long()
    if kernel and can_run(choices) and rows > 0:
        return _walk_kernel_launch(trees, choices, max_depth)
    ok = accepted_nodes(trees, choices)  # [R, N], a root path
    num_accepted = ok.sum(dim=1)  # [R]
    # Place each accepted node at its depth; rejected ones go to a discarded column.
    slot = torch.where(ok, trees.depths, max_depth + 1)
    path = torch.zeros(rows, max_depth + 2, dtype=torch.long, device=device)
    path.scatter_(1, slot, torch.arange(n, device=device).expand(rows, n))
    path = path[:, : max_depth + 1]
    column = torch.arange(max_depth + 1, device=device).unsqueeze(0)
    last = torch.gather(path, 1, (num_accepted - 1).unsqueeze(1))  # [R, 1]
    path = torch.where(column < num_accepted.unsqueeze(1), path, last)
    bonus = torch.gather(choices, 1, last).squeeze(1)  # [R]
    path_tokens = torch.gather(trees.tokens, 1, path)  # [R, L + 1]
    shifted = torch.cat([path_tokens[:, 1:], bonus.unsqueeze(1)], 1)
    new_tokens = torch.where(column < (num_accepted - 1).unsqueeze(1), shifted, bonus.unsqueeze(1))
    return WalkResult(path, num_accepted, new_tokens, bonus)


def _walk_kernel_launch(trees: Trees, choices: Tensor, max_depth: int) -> WalkResult:
    rows, n = trees.tokens.shape
    device = choices.device
    tokens, parents = trees.tokens.long().contiguous(), trees.parents.long().contiguous()
    valid = trees.valid.contiguous().view(torch.uint8)
    choices = choices.contiguous()
    width = max_depth + 1
    path = torch.empty(rows, width, dtype=torch.long, device=device)
    new_tokens = torch.empty(rows, width, dtype=torch.long, device=device)
    num_accepted = torch.empty(rows, dtype=torch.long, device=device)
    bonus = torch.empty(rows, dtype=torch.long, device=device)
    block = triton.next_power_of_2(n)
    _walk_kernel[(rows,)](tokens, parents, valid, choices, path, new_tokens, num_accepted, bonus, n, max_depth,
                          BLOCK=block, WIDTH=triton.next_power_of_2(width), enable_fp_fusion=FP_FUSION,
                          num_warps=1 if block <= 64 else 4)
    return WalkResult(path, num_accepted, new_tokens, bonus)


if triton is not None:

    @triton.jit
    def _walk_kernel(tok_ptr, par_ptr, valid_ptr, choice_ptr, path_ptr, new_ptr, count_ptr, bonus_ptr, n, max_depth,
                     BLOCK: tl.constexpr, WIDTH: tl.constexpr):
        """Program r: step down request r's tree from the root, max_depth times: the next node is the valid child of
        the current one whose token is the current node's choice (siblings' tokens are distinct: at most one).

        What is written at step d is always the current node's choice before the step: the accepted token when a
        child matches, the bonus once none does (the current node then stays put, so later steps repeat it)."""
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        inside = offs < n
        tok = tl.load(tok_ptr + r * n + offs, mask=inside, other=-1)
        par = tl.load(par_ptr + r * n + offs, mask=inside, other=-2)
        ok = tl.load(valid_ptr + r * n + offs, mask=inside, other=0) != 0
        lanes = tl.arange(0, WIDTH)
        path = tl.zeros([WIDTH], dtype=tl.int64)
        new = tl.zeros([WIDTH], dtype=tl.int64)
        cur = tl.zeros([], dtype=tl.int64)
        count = tl.full([], 1, dtype=tl.int64)
        alive = tl.full([], 1, dtype=tl.int1)
        choice = tl.load(choice_ptr + r * n)
        for d in range(max_depth):
            hit = ok & (par == cur) & (tok == choice)
            nxt = tl.min(tl.where(hit, offs, BLOCK), 0)
            found = alive & (nxt < BLOCK)
            new = tl.where(lanes == d, choice, new)
            cur = tl.where(found, nxt.to(tl.int64), cur)
            count += found.to(tl.int64)
            alive = found
            path = tl.where(lanes == d + 1, cur, path)
            choice = tl.load(choice_ptr + r * n + cur)
        new = tl.where(lanes == max_depth, choice, new)
        width = max_depth + 1
        tl.store(path_ptr + r * width + lanes, path, mask=lanes < width)
        tl.store(new_ptr + r * width + lanes, new, mask=lanes < width)
        tl.store(count_ptr + r, count)
        tl.store(bonus_ptr + r, choice)
