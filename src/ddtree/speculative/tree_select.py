"""DDTree's node selection (steps 2-3 of :mod:`ddtree.speculative.tree`) as one Triton program per request.

Why: the torch loop of :func:`ddtree.speculative.tree.build_trees` launches a sort, a gather and a slice per depth and a
final sort over all depths, about 120 small kernels for L = 15; on an H200 under a CUDA graph, build + walk at one
request cost 0.32 ms at B = 8 and 0.80 ms at B = 512, mostly that loop. Here one launch does the whole selection,
and its work follows the tree that comes out rather than L * B.

Algorithm (one program per request r, with b = min(budget[r], max_budget) and the draft depths up to its limit)
------------------------------------------------------------------------------------------------------------
The program keeps ``best``: the b best prefixes of depths 1..d found so far, in the order of
:mod:`ddtree.speculative.tree` (score desc, depth asc, rank path lexicographic), as sorted int64 keys in registers.
Let ``g`` be the score of its b-th entry (-inf while it holds fewer). For depth d + 1:

* A depth-(d+1) prefix can only reach the final tree if its score is **strictly** above ``g``: ``best`` already
  holds b prefixes at least as good that are shallower (and win ties). Its parent then scores above ``g`` as well
  (log-probs are <= 0), so the parent is a depth-d entry of ``best``; with the parent's rank i among those entries
  and the token's rank j, ``(i + 1) * (j + 1) <= b`` (the pruning argument of tree.py).
* Candidates (i, j) are visited in bands ``j + 1 in [2^t, 2^(t+1))``, rows ``i < b_pad / 2^t``: each band is one
  block of b_pad lanes with i and j from shifts (no candidate table), and a band with no survivor ends the
  depth, since a survivor in band t + 1 implies one at (0, 2^(t+1) - 2) in band t.
* Survivors are compacted (a prefix sum, a scatter to a scratch buffer); each chunk of b_pad of them is sorted
  (``tl.sort``) and merged into ``best`` with one bitonic merge (the elementwise maximum of an ascending and a
  descending list holds the larger half), keeping the best b.
* The depth's new entries then get their rank k among depth-(d+1) entries of ``best``; their exact float32 score
  ``score(parent) + log_prob`` (the same addition as the torch loop), parent rank and token rank go to per-depth
  tables, and the key's tie bits are rewritten from (i, j) to k. No depth-(d+1) entry survives: the loop stops.

``best`` at the end is the tree: entry n is node n + 1, its parent the node of (depth - 1, parent rank), found in a
scratch "node of (depth, rank)" table (store, ``tl.debug_barrier()``, load). This is exactly what the torch loop
selects: the per-depth lists it sorts are the same prefixes (``best`` holds a prefix of each), and its final
stable sort over depth-major columns orders by (score, depth, per-depth rank), which is the key order here. For
random logits over a large vocabulary every depth-2 prefix scores below the b-th depth-1 token, so the program
stops after one band of depth 2. A real drafter's tree costs a few bands and sorted chunks per depth (most at
depth 2, where the threshold is still the b-th depth-1 token), fewer deeper as the threshold rises.

Keys
----
``ordered_bits(score) << 32 | tie``, the encoding of :mod:`ddtree.speculative.vocab_topk` (``ordered_keys``), with
``tie = (DMAX - depth) << 2*IB | (IMAX - a) << IB | (IMAX - c)`` below 2^31, IB = log2(b_pad): (a, c) = (parent
rank i, token rank j) for a depth's fresh candidates, (k, IMAX) once ranked (comparisons between two keys of one
depth always see the same form). Distinct prefixes get distinct keys, so no sort needs to be stable.

Contract and limits
-------------------
Outputs match the torch loop of ``build_trees`` bit for bit on the nodes that are valid there (the first
``budget[r]`` columns with a finite score); every other column is blank: score -inf, depth, parent and rank 0.
Up to :data:`MAX_BUDGET` (one program holds blocks of b_pad int64 keys: compiled for sm_90 it takes about
115 registers at b_pad 512 and 4 warps, 190 at 2048 and 8 warps, and spills at 4096) and at most ``2^(31 - 2 * IB) - 1``
depths (:func:`max_depths`: the tie bits; 8191 at B = 512, 511 at 2048). The launch reads nothing on the host
(graph capturable); scratch is sized from host ints only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ddtree.errors import ConfigError, ShapeError
from ddtree.triton_runtime import FP_FUSION, can_run, masked_if, tl, triton

MAX_BUDGET = 2048  # largest max_budget the kernel takes; build_trees keeps the torch loop above it


def _block(max_budget: int) -> int:
    """b_pad: lanes per block, the budget rounded up to a power of two (at least 2, what tl.sort takes)."""
    return max(2, 1 << (max_budget - 1).bit_length())


def _num_warps(block: int) -> int:
    """Warps per program: one warp holds a small budget's blocks (no shared-memory round trips); wider blocks
    get more lanes for the per-band gathers and the sort."""
    if block <= 32:
        return 1
    if block <= 128:
        return 2
    return 4 if block <= 512 else 8


def max_depths(max_budget: int) -> int:
    """Most draft depths the key's depth field holds for this budget."""
    index_bits = _block(max_budget).bit_length() - 1
    return (1 << (31 - 2 * index_bits)) - 1


def available(log_probs: Tensor, max_budget: int) -> bool:
    """Whether :func:`select_nodes` can run here: a Triton kernel can run on ``log_probs``
    (:func:`ddtree.triton_runtime.can_run`), it is float32, and the budget and depth count are within the limits."""
    return (
        log_probs.dtype == torch.float32
        and 1 <= max_budget <= MAX_BUDGET
        and 1 <= log_probs.shape[1] <= max_depths(max_budget)
        and can_run(log_probs)
    )


def select_nodes(
    log_probs: Tensor, budget: Tensor, depth_limit: Tensor | None, max_budget: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ``max_budget`` best prefixes of every request, as ``build_trees`` selects them (one kernel launch).

    log_probs: [R, L, W] float32, each depth's candidate log-probs best first (``depth_candidates``, caps applied
        as -inf), W = min(max_budget, vocab). budget: [R] long, nodes per request (values above max_budget act as
        max_budget). depth_limit: [R] long deepest allowed depth, or None. max_budget: the static B (1..MAX_BUDGET).

    Returns (sel_score [R, B] float32, sel_depth [R, B] long (depth - 1), sel_parent [R, B] long (node index of the
    parent, 0 = root), sel_rank [R, B] long (token rank within its depth's candidate list)); columns past a
    request's budget or without a finite score are blank (-inf, 0, 0, 0), the rest equal the torch loop's.
    """
    if triton is None:
        raise ConfigError("select_nodes needs Triton; install it or build trees with fast_topk=False")
    if log_probs.dim() != 3 or log_probs.dtype != torch.float32:
        raise ShapeError(f"log_probs must be a float32 [requests, depths, width] tensor, got {log_probs.dtype} "
                         f"{list(log_probs.shape)}")
    rows, depths, width = log_probs.shape
    if isinstance(max_budget, bool) or not isinstance(max_budget, int) or not 1 <= max_budget <= MAX_BUDGET:
        raise ConfigError(f"max_budget must be an int in [1, {MAX_BUDGET}], got {max_budget!r}; larger budgets "
                          "take the torch path (build_trees with fast_topk=False)")
    if not 1 <= width <= max_budget:
        raise ShapeError(f"log_probs width {width} must be in [1, max_budget = {max_budget}] (min(budget, vocab))")
    if not 1 <= depths <= max_depths(max_budget):
        raise ShapeError(f"{depths} draft depths exceed the kernel's {max_depths(max_budget)} at max_budget "
                         f"{max_budget}; use fast_topk=False")
    device = log_probs.device
    for name, t in (("budget", budget), ("depth_limit", depth_limit)):
        if t is not None and (t.shape != (rows,) or t.dtype != torch.long or t.device != device):
            raise ShapeError(f"{name} must be a long tensor of shape [{rows}] on {device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
    if log_probs.stride(2) != 1:
        log_probs = log_probs.contiguous()
    b = max_budget
    out = (
        torch.empty(rows, b, dtype=torch.float32, device=device),
        torch.empty(rows, b, dtype=torch.long, device=device),
        torch.empty(rows, b, dtype=torch.long, device=device),
        torch.empty(rows, b, dtype=torch.long, device=device),
    )
    if rows == 0:
        return out
    block = _block(b)
    index_bits = block.bit_length() - 1
    # Scratch, written before it is read within each program: per-depth tables indexed by (depth, rank) and the
    # survivor buffer (at most one block per band).
    score_table = torch.empty(rows, depths, b, dtype=torch.float32, device=device)
    pair_table = torch.empty(rows, depths, b, dtype=torch.int32, device=device)
    node_table = torch.empty(rows, depths, b, dtype=torch.int32, device=device)
    survivors = torch.empty(rows, (index_bits + 1) * block, dtype=torch.long, device=device)
    limit = budget if depth_limit is None else depth_limit  # any [R] long tensor; unread without HAS_LIMIT
    _select_kernel[(rows,)](
        log_probs, log_probs.stride(0), log_probs.stride(1), depths, width, b,
        budget, budget.stride(0), limit, limit.stride(0),
        score_table, pair_table, node_table, survivors, *out,
        BLOCK=block, IB=index_bits, IMAX=block - 1, DMAX=max_depths(b), HAS_LIMIT=depth_limit is not None,
        enable_fp_fusion=FP_FUSION, num_warps=_num_warps(block),
    )
    return out


if triton is not None:
    from ddtree.speculative.vocab_topk import ordered_keys

    _NONE = tl.constexpr(-(2**63))  # an empty slot of `best`: below every real key

    @triton.jit
    def _key(score, depth, a, c, IB: tl.constexpr, IMAX: tl.constexpr, DMAX: tl.constexpr):
        """Keys of prefixes at 0-based ``depth`` with tie fields (a, c) (module docstring); all int32 but score."""
        tie = ((DMAX - depth) << (2 * IB)) | ((IMAX - a) << IB) | (IMAX - c)
        return ordered_keys(score, 0x7FFFFFFF - tie)

    @triton.jit
    def _depth_of(key, IB: tl.constexpr, DMAX: tl.constexpr):
        return DMAX - ((key & 0x7FFFFFFF) >> (2 * IB)).to(tl.int32)

    @triton.jit
    def _field_a(key, IB: tl.constexpr, IMAX: tl.constexpr):
        return IMAX - ((key >> IB) & IMAX).to(tl.int32)

    @triton.jit
    def _field_c(key, IMAX: tl.constexpr):
        return IMAX - (key & IMAX).to(tl.int32)

    @triton.jit
    def _score_bits_at(best, slot, lanes):
        """The ordered score bits of ``best[slot]`` (int64; an empty slot or slot out of range: below all)."""
        return tl.max(tl.where(lanes == slot, best, _NONE), 0) >> 32

    @triton.jit
    def _select_kernel(
        lp_ptr, lp_row_stride, lp_depth_stride, depths, width, max_budget,
        budget_ptr, budget_stride, limit_ptr, limit_stride,
        score_ptr, pair_ptr, node_ptr, surv_ptr,
        out_score_ptr, out_depth_ptr, out_parent_ptr, out_rank_ptr,
        BLOCK: tl.constexpr, IB: tl.constexpr, IMAX: tl.constexpr, DMAX: tl.constexpr, HAS_LIMIT: tl.constexpr,
    ):
        """Program r: request r's selection (module docstring). ``best`` is ascending: slot BLOCK - 1 is node 1."""
        r = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        b = tl.minimum(tl.maximum(tl.load(budget_ptr + r * budget_stride), 0), max_budget).to(tl.int32)
        n_depths = depths
        if HAS_LIMIT:
            n_depths = tl.minimum(tl.maximum(tl.load(limit_ptr + r * limit_stride), 0), depths).to(tl.int32)
        lp_row = lp_ptr + r * lp_row_stride
        table = r * depths * max_budget  # this request's (depth, rank) tables start here
        surv = surv_ptr + r * ((IB + 1) * BLOCK)
        kept = lanes >= BLOCK - b  # the b best slots of `best`

        # Depth 1: the candidate list itself, read back to front so that `best` is ascending; rank = token rank.
        rank = BLOCK - 1 - lanes
        x = tl.load(lp_row + rank, mask=masked_if(n_depths > 0, rank < width), other=float("-inf"))
        fresh = kept & (x > float("-inf"))
        best = tl.where(fresh, _key(x, 0, rank, IMAX, IB, IMAX, DMAX), _NONE)
        tl.store(score_ptr + table + rank, x, mask=fresh)
        tl.store(pair_ptr + table + rank, rank, mask=fresh)
        parents = tl.sum(fresh.to(tl.int32), 0)  # depth-d entries of `best`: the next depth's parents
        bar = _score_bits_at(best, BLOCK - b, lanes)
        tl.debug_barrier()

        depth = parents * 0 + 1  # 0-based depth being added (an int32 tensor: loop-carried)
        while (depth < n_depths) & (parents > 0):
            lp_d = lp_row + depth * lp_depth_stride
            parent_scores = score_ptr + table + (depth - 1) * max_budget
            # Survivors band by band (j + 1 in [2^t, 2^(t+1))), compacted into `surv`.
            count = parents * 0
            band = parents * 0
            found = parents
            while (found > 0) & (band <= IB):
                i = lanes >> band
                j = (1 << band) - 1 + (lanes & ((1 << band) - 1))
                inside = (i < parents) & (j < width) & ((i + 1) * (j + 1) <= b)
                score = tl.load(parent_scores + i, mask=inside, other=float("-inf")) + tl.load(
                    lp_d + j, mask=inside, other=float("-inf"))
                key = _key(score, depth, i, j, IB, IMAX, DMAX)
                alive = inside & (score > float("-inf")) & ((key >> 32) > bar)
                slot = count + tl.cumsum(alive.to(tl.int32), 0) - 1
                tl.store(surv + slot, key, mask=alive)
                found = tl.sum(alive.to(tl.int32), 0)
                count += found
                band += 1
            tl.debug_barrier()
            parents = count  # 0 unless this depth has survivors
            if count > 0:
                # Merge the survivors into `best`, one sorted chunk of BLOCK at a time.
                start = count * 0
                while start < count:
                    chunk = tl.load(surv + start + lanes, mask=start + lanes < count, other=_NONE)
                    chunk = tl.sort(chunk, descending=True)
                    best = tl.bitonic_merge(tl.maximum(best, chunk))  # the BLOCK largest, ascending
                    best = tl.where(kept, best, _NONE)
                    start += BLOCK
                # Rank the depth's entries, record them, and rewrite their tie fields to (rank, IMAX).
                fresh = (best != _NONE) & (_depth_of(best, IB, DMAX) == depth)
                rank = tl.cumsum(fresh.to(tl.int32), 0, reverse=True) - 1  # entries of this depth at or above
                i = _field_a(best, IB, IMAX)
                j = _field_c(best, IMAX)
                score = tl.load(parent_scores + i, mask=fresh, other=0.0) + tl.load(
                    lp_d + j, mask=fresh, other=0.0)
                here = table + depth * max_budget + rank
                tl.store(score_ptr + here, score, mask=fresh)
                tl.store(pair_ptr + here, (i << 16) | j, mask=fresh)
                ranked = ((best >> (2 * IB)) << (2 * IB)) | ((IMAX - rank).to(tl.int64) << IB)
                best = tl.where(fresh, ranked, best)
                parents = tl.sum(fresh.to(tl.int32), 0)
                bar = _score_bits_at(best, BLOCK - b, lanes)
                tl.debug_barrier()
            depth += 1

        # Nodes: slot s of `best` is node BLOCK - s; parents through the (depth, rank) -> node table.
        real = best != _NONE
        node = BLOCK - lanes  # 1-based node index of each slot
        depth = tl.where(real, _depth_of(best, IB, DMAX), 0)
        rank = tl.where(real, _field_a(best, IB, IMAX), 0)
        here = table + depth * max_budget + rank
        tl.store(node_ptr + here, node, mask=real)
        tl.debug_barrier()
        pair = tl.load(pair_ptr + here, mask=real, other=0)
        score = tl.load(score_ptr + here, mask=real, other=float("-inf"))
        has_parent = real & (depth > 0)
        parent = tl.load(node_ptr + table + (depth - 1) * max_budget + (pair >> 16), mask=has_parent, other=0)
        out = r * max_budget + node - 1
        inside = node <= max_budget
        tl.store(out_score_ptr + out, score, mask=inside)
        tl.store(out_depth_ptr + out, depth.to(tl.int64), mask=inside)
        tl.store(out_parent_ptr + out, parent.to(tl.int64), mask=inside)
        tl.store(out_rank_ptr + out, (pair & 0xFFFF).to(tl.int64), mask=inside)


# ---- a selection's prefixes and expected lengths (budget "auto": ddtree.engine.auto_budget) -------------------------
# The best tree of n nodes is the first n nodes of the best tree of any larger size (nodes come best-first and a
# parent precedes its children), so one selection at the largest size a round may want gives both the tree it
# verifies and the expected accepted length of every smaller one.

def expected_lengths(scores: Tensor) -> Tensor:
    """``scores [R, W + 1]`` (a tree's float32 cumulative log-probs in node order, root first, padding -inf) ->
    ``E [R, W]`` float32: ``E[:, n - 1]`` = 1 + the sum of the first ``n`` node probabilities, the expected tokens
    a round of the best ``n``-node tree commits under the drafter's factorised surrogate. No host sync."""
    probs = torch.exp(scores[:, 1:].to(torch.float32))  # exp(-inf) = 0: invalid nodes add nothing
    return 1.0 + torch.cumsum(probs, dim=1)


def prefix_trees(trees: Any, n: int, budget: Tensor) -> Any:
    """The first ``n`` nodes of ``trees`` (a :class:`ddtree.speculative.tree.Trees` built at a larger budget), nodes
    past each row's ``budget [R]`` made padding exactly as ``build_trees`` at ``max_budget = n - 1`` marks them
    (token 0, parent 0, depth 0, score -inf, no visibility). A valid node's ancestors precede it, so they stay."""
    rows = trees.tokens.shape[0]
    node = torch.arange(n, device=budget.device).expand(rows, n)
    valid = trees.valid[:, :n] & (node <= budget.unsqueeze(1))
    body = torch.where(valid, torch.stack([trees.tokens[:, :n], trees.parents[:, :n], trees.depths[:, :n]]), 0)
    tokens, parents, depths = body.unbind(0)
    scores = torch.where(valid, trees.scores[:, :n], -math.inf)
    vis = trees.visibility[:, :n, :n] & valid.unsqueeze(2) & valid.unsqueeze(1)
    return trees._replace(tokens=tokens, parents=parents, depths=depths, valid=valid, visibility=vis, scores=scores)
