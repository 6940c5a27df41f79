"""Exact DDTree draft trees, built for a whole batch with tensor ops and no host sync.

Vocabulary
----------
R          requests in the batch (one tree each).
L          draft depths, ``block_size - 1``; the drafter gives a distribution q_d for every depth d = 1..L.
V          vocabulary size.
B          node budget: draft nodes per tree, the root not counted. ``max_budget`` is the static B of a call
           (the engine's preallocated limit); each request may use fewer (``budget[r] <= max_budget``).
N          ``max_budget + 1``: nodes per tree including the root (node 0).
K          per-depth candidate cap: only the K most probable tokens of a depth may appear at that depth.
           ``None``/0 means no cap, which is ``min(B, V)`` because no deeper rank can reach the best B.
prefix     a token sequence (t_1..t_d) with score ``sum_i log q_i(t_i)``; the node for it sits at depth d.
rank       a token's 1-based position in its depth's candidate list (best first).

A tree is the B highest-scoring prefixes (the optimum of the drafter's factorized surrogate for expected
acceptance, Ringel & Romano). Because a prefix never scores above its parent, that set is prefix-closed.

Worked example (B = 4, L = 2, two likely tokens per depth)::

    q_1: a 0.6, b 0.3          q_2: c 0.7, d 0.2
    prefixes by score: a (.6) > ac (.42) > b (.3) > bc (.21) > ad (.12) > ...

    node  token  parent  depth  score        visibility (row sees column)
     0    root     -1      0    log 1            0: 1 . . . .
     1    a         0      1    log .6           1: 1 1 . . .
     2    c         1      2    log .42          2: 1 1 1 . .
     3    b         0      1    log .3           3: 1 . . 1 .
     4    c         3      2    log .21          4: 1 . . 1 1

Algorithm (all requests at once, a static loop over the L depths)
---------------------------------------------------------------
1. Per depth, the top K' = min(B, V) tokens by logit (``torch.topk`` over the vocabulary: the only pass over V),
   their log-probs (logit minus the row's logsumexp), ranks past a request's cap K masked to -inf.
2. Depth 1 keeps its K' tokens. For depth d >= 2: if a depth-d prefix belongs to the best B of its depth, its
   parent is the i-th best depth-(d-1) prefix and its token the j-th best at depth d, then the i * j prefixes
   (parent among the i best) x (token among the j best) all score at least as much and precede it in the order
   below, so i * j <= B. Only those pairs are candidates: a static list of about B ln B pairs per B. We keep the
   best B of each depth (a stable sort of the candidates), then the best B over all depths.
3. Scores accumulate in float32 in depth order: ``score(child) = score(parent) + log q_d(token)``.

With ``fast_topk`` and a tensor a Triton kernel can run on (CUDA; budgets up to ``tree_select.MAX_BUDGET``), steps
2-3 are one launch of :func:`ddtree.speculative.tree_select.select_nodes` instead of a sort per depth: per request it
merges each depth's candidates into a running best-B list, keeping only those that beat its B-th entry, so its
work follows the tree rather than L * B. It selects the same nodes, scores and order as this loop, which stays the
default and the reference.

Ties (deterministic, and consistent with the pruning argument above, so the result is exact even with ties)
----------------------------------------------------------------------------------------------------------
Prefixes are totally ordered by (score descending, depth ascending, rank path lexicographic ascending), where
the rank path lists the token's rank at every depth. Within a depth's candidate list, tokens with equal log-prob
are ranked by token id ascending. Node order in a tree is exactly this order, so a parent always precedes its
children (equal scores put the shallower prefix first). One thing is left to ``torch.topk``: when more than K'
tokens of a depth tie at the K'-th largest logit, which of them enter the candidate list. That choice cannot
change the tree's scores, only which of several equally likely tokens appear.

Padding nodes (``valid`` False: past a request's budget, deeper than its depth limit, or with probability 0)
carry token 0, parent 0, depth 0, score -inf and an all-False visibility row and column.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ddtree import tuning
from ddtree.errors import ConfigError, ShapeError
from ddtree.speculative import tree_select, vocab_topk


class Trees(NamedTuple):
    """A batch of draft trees, nodes in descending-score order (a NamedTuple so compile and graphs accept it)."""

    tokens: Tensor  # [R, N] long; node 0 is the root (root_tokens if given, else 0)
    parents: Tensor  # [R, N] long; root -1, padding 0; parent index < child index
    depths: Tensor  # [R, N] long; root 0
    valid: Tensor  # [R, N] bool; root always True
    visibility: Tensor  # [R, N, N] bool; [r, i, j]: j is i or an ancestor of i (valid nodes only)
    scores: Tensor  # [R, N] float32 cumulative draft log-prob; root 0, padding -inf


def candidate_count(budget: int, width: int) -> int:
    """Number of (parent rank i, token rank j) pairs with i <= budget, j <= width and i * j <= budget."""
    return sum(min(width, budget // i) for i in range(1, budget + 1))


def candidate_pairs(budget: int, width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The static candidate list of step 2, 0-based, ordered by parent rank then token rank.

    Built on ``device`` from ``arange`` arithmetic only (no host-to-device copy), so it is legal inside a CUDA
    graph capture and costs a handful of tiny kernels.

    Returns (parent_rank, token_rank), each [C] long with C = candidate_count(budget, width).
    """
    count = candidate_count(budget, width)
    i = torch.arange(1, budget + 1, device=device)
    per_parent = torch.clamp(budget // i, max=width)  # [budget] pairs with parent rank i
    ends = torch.cumsum(per_parent, 0)  # [budget]
    flat = torch.arange(count, device=device)
    parent = torch.searchsorted(ends, flat, right=True)  # [C] 0-based parent rank
    token = flat - (ends - per_parent)[parent]  # [C] 0-based token rank
    return parent, token


def _as_row_tensor(value: int | Tensor | None, rows: int, device: torch.device, name: str) -> Tensor | None:
    """A per-request [R] long tensor from a scalar or [R] tensor (shapes checked; values are the caller's)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.dim() == 0:
            return value.to(device=device, dtype=torch.long).expand(rows)
        if value.shape != (rows,):
            raise ShapeError(f"{name} must be a scalar or have shape [{rows}] (one per request), got {tuple(value.shape)}")
        return value.to(device=device, dtype=torch.long)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int or a tensor, got {value!r}")
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value}")
    return torch.full((rows,), value, dtype=torch.long, device=device)


def _resolve_max_budget(budget: int | Tensor, max_budget: int | None) -> int:
    if max_budget is None:
        if isinstance(budget, Tensor):
            # A host sync: the engine always passes max_budget, this default is for scripts and tests.
            max_budget = int(budget.max())
        else:
            max_budget = budget
    if isinstance(max_budget, bool) or not isinstance(max_budget, int) or max_budget < 0:
        raise ConfigError(f"max_budget must be an int >= 0, got {max_budget!r}")
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > max_budget:
        raise ConfigError(f"budget {budget} exceeds max_budget {max_budget}; raise max_budget or lower the budget")
    return max_budget


def _check_logits(draft_logits: Tensor) -> None:
    if draft_logits.dim() != 3:
        raise ShapeError(f"draft_logits must be [requests, depths, vocab], got shape {tuple(draft_logits.shape)}")
    if draft_logits.shape[2] < 1:
        raise ShapeError("draft_logits has an empty vocabulary dimension")
    if not draft_logits.is_floating_point():
        raise ShapeError(f"draft_logits must be floating point, got {draft_logits.dtype}")


def _root_tokens(root_tokens: Tensor | None, rows: int, device: torch.device) -> Tensor:
    if root_tokens is None:
        return torch.zeros(rows, dtype=torch.long, device=device)
    if root_tokens.shape != (rows,):
        raise ShapeError(f"root_tokens must have shape [{rows}], got {tuple(root_tokens.shape)}")
    return root_tokens.to(device=device, dtype=torch.long)


def depth_candidates(draft_logits: Tensor, width: int, fast_topk: bool = False) -> tuple[Tensor, Tensor]:
    """Per depth, the ``width`` most likely tokens and their log-probs, best first, equal log-probs by token id.

    draft_logits: [R, L, V] logits or log-probs. Returns (log_probs [R, L, width] float32, tokens [R, L, width]).
    The only work proportional to V. With ``fast_topk``, a width and row count the kernel is faster for
    (:func:`ddtree.tuning.kernel_takes`: up to ``FAST_MAX_K``, wide lists only for few rows) and a tensor
    it can read (:func:`ddtree.speculative.vocab_topk.available`: CUDA), one Triton pass over each row gives the top
    ``width`` already in canonical order and the float32 logsumexp; otherwise (the default and the reference,
    wider candidate lists, CPU) ``torch.topk``, two re-ranking sorts and ``torch.logsumexp``. Both give the same
    tokens in the same order; log-probs agree to float32 rounding of the normaliser.
    """
    rows, depths, vocab = draft_logits.shape
    if fast_topk and tuning.kernel_takes(rows * depths, width) and vocab_topk.available(draft_logits):
        top, tok, log_norm = vocab_topk.topk_logsumexp(draft_logits.reshape(rows * depths, vocab), width)
        top, tok, log_norm = top.view(rows, depths, width), tok.view(rows, depths, width), log_norm.view(rows, depths)
    else:
        top, tok = torch.topk(draft_logits, width, dim=-1, sorted=True)  # [R, L, width], in the input dtype
        top = top.float()
        # Re-rank the chosen tokens by (log-prob desc, token id asc): topk's order among equal values is unspecified.
        tok, by_id = torch.sort(tok, dim=-1)
        top = torch.gather(top, -1, by_id)
        top, by_value = torch.sort(top, dim=-1, descending=True, stable=True)
        tok = torch.gather(tok, -1, by_value)
        # The normaliser in float32 even for half-precision logits (a bf16 logsumexp would be off by ~0.01).
        logits = draft_logits if draft_logits.dtype == torch.float32 else draft_logits.float()
        log_norm = torch.logsumexp(logits, dim=-1)
    log_probs = top - log_norm.unsqueeze(-1)  # [R, L, width]
    # An all -inf row gives NaN; such a depth has no usable token (NaN would sort first). One kernel.
    log_probs = torch.nan_to_num(log_probs, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    return log_probs, tok


def ancestor_visibility(parents: Tensor, valid: Tensor, max_depth: int) -> Tensor:
    """[R, N, N] bool: row i sees column j iff j is i or an ancestor of i, both valid.

    parents: [R, N] long (root -1, every other node's parent earlier); valid: [R, N] bool; max_depth: deepest
    node's depth (static). Ancestors by pointer doubling: with the ancestors at hops 0..m-1 known and ``jump``
    the ancestor at hop m, one gather gives hops m..2m-1, so depth 15 takes 4 rounds instead of 15 (fewer
    kernel launches per tree). The root is made its own parent, so every hop is a real node index (no clamps,
    no discard column): past the root a chain repeats the root, which is an ancestor of every valid node anyway.
    """
    rows, n = parents.shape
    device = parents.device
    hops = torch.arange(n, device=device).expand(rows, n).unsqueeze(2)  # [R, N, 1]: hop 0 is the node itself
    jump = parents.clamp(min=0)  # [R, N]: the ancestor at hop m = 1; the root's is itself
    while hops.shape[2] < max_depth + 1:
        m = hops.shape[2]
        further = torch.gather(jump, 1, hops.reshape(rows, n * m)).reshape(rows, n, m)
        hops = torch.cat([hops, further], 2)  # hops 0 .. 2m - 1
        if 2 * m < max_depth + 1:
            jump = torch.gather(jump, 1, jump)  # hop 2m
    vis = torch.zeros(rows, n, n, dtype=torch.bool, device=device).scatter_(2, hops, True)
    return vis & valid.unsqueeze(2) & valid.unsqueeze(1)


def build_trees(
    draft_logits: Tensor,
    budget: int | Tensor,
    topk: int | Tensor | None = None,
    *,
    max_budget: int | None = None,
    depth_limit: Tensor | None = None,
    root_tokens: Tensor | None = None,
    fast_topk: bool = False,
    fast_select: bool | None = None,
) -> Trees:
    """The ``budget`` most probable draft prefixes of every request, as flat trees in descending-score order.

    draft_logits: [R, L, V] drafter logits (or log-probs) for depths 1..L; log_softmax is applied inside.
    budget: int or [R] long, draft nodes per request (0 = root only, i.e. plain decoding for that request).
    topk: int or [R] long per-depth candidate cap; None or 0 = no cap.
    max_budget: static B; N = B + 1 columns. Defaults to ``budget`` (an int) or ``budget.max()`` (a host sync:
        pass it explicitly inside a round).
    depth_limit: [R] long, deepest allowed depth per request (e.g. its block_size - 1 when shorter than L).
    root_tokens: [R] long token of node 0 (the last committed token).
    fast_topk: take each depth's candidates from the fused Triton top-k + logsumexp kernel where it can run
        (see :func:`depth_candidates`) and select the nodes with the Triton kernel of
        :mod:`ddtree.speculative.tree_select` (step 2-3 above). The same candidates and nodes either way; scores differ
        only by the float32 rounding of the normaliser.
    fast_select: the node selection's own choice (the engine passes ``KernelSet.vocab_topk`` and
        ``KernelSet.tree_select``); None = as ``fast_topk``.

    Budget values above ``max_budget`` behave as ``max_budget``; nodes that would need a probability-0 token are
    left invalid, so a tree can hold fewer than its budget.
    """
    _check_logits(draft_logits)
    rows, depths, vocab = draft_logits.shape
    device = draft_logits.device
    b = _resolve_max_budget(budget, max_budget)
    n = b + 1
    budget_r = _as_row_tensor(budget, rows, device, "budget")  # [R]
    cap_r = _as_row_tensor(topk, rows, device, "topk")  # [R] or None
    width = min(b, vocab)  # K'

    root = _root_tokens(root_tokens, rows, device)
    if b == 0 or depths == 0:
        blank = torch.zeros(rows, b, dtype=torch.long, device=device)
        return _assemble(root, blank.bool(), blank, blank, blank, blank.float(), max_depth=0)

    if depth_limit is not None:
        if depth_limit.shape != (rows,):
            raise ShapeError(f"depth_limit must have shape [{rows}], got {tuple(depth_limit.shape)}")
        depth_limit = depth_limit.to(device=device, dtype=torch.long)

    log_probs, cand_tokens = depth_candidates(draft_logits, width, fast_topk)  # [R, L, K'] each
    if cap_r is not None:
        rank = torch.arange(width, device=device)
        capped = (cap_r > 0).unsqueeze(1) & (rank.unsqueeze(0) >= cap_r.unsqueeze(1))  # [R, K']
        log_probs = log_probs.masked_fill(capped.unsqueeze(1), -math.inf)
    node_ids = torch.arange(1, n, device=device).expand(rows, b)

    if (fast_topk if fast_select is None else fast_select) and tree_select.available(log_probs, b):
        # Steps 2-3 in one Triton launch (tree_select); the same nodes as the loop below wherever they are valid.
        sel_score, sel_depth, sel_parent, sel_rank = tree_select.select_nodes(log_probs, budget_r, depth_limit, b)
        sel_token = torch.gather(cand_tokens.reshape(rows, depths * width), 1, sel_depth * width + sel_rank)
        valid = (node_ids <= budget_r.unsqueeze(1)) & torch.isfinite(sel_score)  # [R, B]
        return _assemble(root, valid, sel_token, sel_parent, sel_depth + 1, sel_score, max_depth=depths)

    # Step 2: the best B prefixes of every depth (kept_score [R, B], best first), remembering for depths >= 2
    # which candidate pair each came from.
    pad = b - width
    kept_score = torch.nn.functional.pad(log_probs[:, 0], (0, pad), value=-math.inf)
    all_score, all_choice = [kept_score], []
    if depths > 1:
        cand_parent, cand_rank = candidate_pairs(b, width, device)  # [C], i-major so a stable sort keeps lex order
        cand_log_probs = log_probs[:, 1:, cand_rank]  # [R, L - 1, C]
    for d in range(1, depths):
        cand = kept_score[:, cand_parent] + cand_log_probs[:, d - 1]  # [R, C]
        cand, order = torch.sort(cand, dim=1, descending=True, stable=True)
        kept_score = cand[:, :b]
        all_score.append(kept_score)
        all_choice.append(order[:, :b])  # candidate index of each kept prefix
    # kept_parent: the parent's index in the previous depth's kept list (-1 at depth 1: the root);
    # kept_rank: the token's rank in its depth's candidate list. Both [R, L, B].
    first_rank = torch.nn.functional.pad(torch.arange(width, device=device), (0, pad)).expand(rows, 1, b)
    first_parent = torch.full((rows, 1, b), -1, dtype=torch.long, device=device)
    if depths > 1:
        choice = torch.stack(all_choice, 1)  # [R, L - 1, B]
        flat_parent = torch.cat([first_parent, cand_parent[choice]], 1).reshape(rows, depths * b)
        flat_rank = torch.cat([first_rank, cand_rank[choice]], 1)
    else:
        flat_parent, flat_rank = first_parent.reshape(rows, b), first_rank
    flat_score = torch.stack(all_score, 1)  # [R, L, B]
    if depth_limit is not None:
        too_deep = torch.arange(1, depths + 1, device=device).unsqueeze(0) > depth_limit.unsqueeze(1)
        flat_score = flat_score.masked_fill(too_deep.unsqueeze(2), -math.inf)
    flat_score = flat_score.reshape(rows, depths * b)

    # Best B over all depths: stable sort over depth-major columns = (score desc, depth asc, rank path lex).
    sel_score, sel = torch.sort(flat_score, dim=1, descending=True, stable=True)
    sel_score, sel = sel_score[:, :b], sel[:, :b]  # [R, B] column of node 1..B
    node_of = torch.zeros(rows, depths * b, dtype=torch.long, device=device).scatter_(1, sel, node_ids)
    sel_depth = sel // b  # depth - 1
    parent_col = (sel_depth - 1) * b + torch.gather(flat_parent, 1, sel)
    sel_parent = torch.where(sel_depth == 0, 0, torch.gather(node_of, 1, parent_col.clamp(min=0)))
    sel_rank = torch.gather(flat_rank.reshape(rows, depths * b), 1, sel)
    sel_token = torch.gather(cand_tokens.reshape(rows, depths * width), 1, sel_depth * width + sel_rank)
    valid = (node_ids <= budget_r.unsqueeze(1)) & torch.isfinite(sel_score)  # [R, B]
    return _assemble(root, valid, sel_token, sel_parent, sel_depth + 1, sel_score, max_depth=depths)


def _assemble(
    root: Tensor,  # [R]
    valid: Tensor,  # [R, B] bool, the non-root nodes
    tokens: Tensor,  # [R, B] long
    parents: Tensor,  # [R, B] long
    depths: Tensor,  # [R, B] long
    scores: Tensor,  # [R, B] float32
    *,
    max_depth: int,
) -> Trees:
    """Prepend the root column, blank the padding nodes and add the visibility matrix.

    The three long fields go through one stack / where / cat (fewer kernel launches than one of each per field).
    """
    rows = root.shape[0]
    body = torch.where(valid, torch.stack([tokens, parents, depths]), 0)  # [3, R, B]
    head = torch.stack([root, torch.full_like(root, -1), torch.zeros_like(root)]).unsqueeze(2)  # [3, R, 1]
    tokens, parents, depths = torch.cat([head, body], 2).unbind(0)  # [R, N] each
    scores = torch.cat([torch.zeros(rows, 1, device=root.device), torch.where(valid, scores, -math.inf)], 1)
    valid = torch.cat([torch.ones(rows, 1, dtype=torch.bool, device=root.device), valid], 1)
    return Trees(tokens, parents, depths, valid, ancestor_visibility(parents, valid, max_depth), scores)


def build_chain(
    draft_logits: Tensor,
    *,
    depth_limit: Tensor | None = None,
    root_tokens: Tensor | None = None,
    max_budget: int | None = None,
) -> Trees:
    """The DFlash chain: the drafter's top-1 token at every depth (``build_trees`` with B = L and K = 1).

    draft_logits: [R, L, V]. Node i (1 <= i <= L) is the depth-i token; ``max_budget`` (default L, at least L)
    pads the trees to the engine's static width; depth_limit ([R]) shortens individual chains. Equal top logits
    pick the lowest token id, like ``build_trees``.
    """
    _check_logits(draft_logits)
    rows, depths, _ = draft_logits.shape
    device = draft_logits.device
    b = depths if max_budget is None else max_budget
    if isinstance(b, bool) or not isinstance(b, int) or b < depths:
        raise ConfigError(f"max_budget for a chain must be an int >= the {depths} draft depths, got {max_budget!r}")
    n = b + 1
    logits = draft_logits if draft_logits.dtype == torch.float32 else draft_logits.float()
    top, top_token = torch.max(logits, dim=-1)  # [R, L]; ties: first (lowest) index
    step = top - torch.logsumexp(logits, dim=-1)  # [R, L]
    node_depth = torch.arange(n, device=device).clamp(max=depths).expand(rows, n)
    valid = torch.arange(n, device=device).expand(rows, n) <= depths
    if depth_limit is not None:
        if depth_limit.shape != (rows,):
            raise ShapeError(f"depth_limit must have shape [{rows}], got {tuple(depth_limit.shape)}")
        valid = valid & (node_depth <= depth_limit.to(device).unsqueeze(1))
    pad = n - 1 - depths
    tokens = torch.cat([_root_tokens(root_tokens, rows, device).unsqueeze(1),
                        torch.nn.functional.pad(top_token, (0, pad))], 1)
    # Accumulate depth by depth in float32 (torch.cumsum may accumulate in float64 on CPU) so scores match
    # build_trees bit for bit.
    running = [torch.zeros(rows, device=device)]
    for d in range(depths):
        running.append(running[-1] + step[:, d])
    scores = torch.nn.functional.pad(torch.stack(running, 1), (0, pad), value=-math.inf)
    valid = valid & torch.isfinite(scores)  # a probability-0 top token (all -inf logits) ends the chain
    valid = torch.cumprod(valid.long(), 1).bool()
    parents = torch.arange(-1, n - 1, device=device).expand(rows, n)
    tokens = torch.where(valid, tokens, 0)
    parents = torch.where(valid | (parents < 0), parents, 0)
    node_depth = torch.where(valid, node_depth, 0)
    scores = torch.where(valid, scores, -math.inf)
    visibility = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device)) & valid.unsqueeze(2) & valid.unsqueeze(1)
    return Trees(tokens, parents, node_depth, valid, visibility, scores)
