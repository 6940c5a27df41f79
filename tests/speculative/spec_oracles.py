"""Plain-Python references for the spec tests: brute-force trees, a step-by-step walk, loop compaction."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ddtree import triton_runtime

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Parametrize a test with ``@pytest.mark.parametrize("kernel", KERNEL, indirect=True)`` (fixture in conftest.py):
# False runs the torch code, True the Triton kernel (through the interpreter on a CPU), each against the same
# reference.
KERNEL = [False, pytest.param(True, marks=pytest.mark.skipif(
    triton_runtime.triton is None or (DEVICE == "cpu" and not triton_runtime.INTERPRETED),
    reason="needs Triton, and without a GPU its interpreter"))]


def log_probs(logits: torch.Tensor) -> np.ndarray:
    """[R, L, V] float32 log-probs, normalised the way build_trees documents (logit minus logsumexp)."""
    x = logits.float()
    return (x - torch.logsumexp(x, dim=-1, keepdim=True)).numpy()


def depth_ranking(row: np.ndarray) -> list[int]:
    """Token ids of one depth, best first; equal log-probs by token id."""
    return sorted(range(len(row)), key=lambda t: (-float(row[t]), t))


def random_tree_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A small random batch for the oracle tests -> (logits [R, L, V], budgets [R], caps [R], depth limits [R],
    max_budget). Odd seeds draw small integer logits: many exact ties inside and across depths."""
    gen = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 5, (1,), generator=gen))
    depths = int(torch.randint(1, 4, (1,), generator=gen))
    vocab = int(torch.randint(2, 6, (1,), generator=gen))
    max_budget = int(torch.randint(1, 12, (1,), generator=gen))
    if seed % 2:
        logits = torch.randint(-2, 2, (rows, depths, vocab), generator=gen).float()
    else:
        logits = 3 * torch.randn(rows, depths, vocab, generator=gen)
    budgets = torch.randint(0, max_budget + 1, (rows,), generator=gen)
    caps = torch.randint(0, vocab + 1, (rows,), generator=gen)
    limits = torch.randint(1, depths + 1, (rows,), generator=gen)
    return logits, budgets, caps, limits, max_budget


def best_prefixes(lp: np.ndarray, budget: int, cap: int | None, depth_limit: int) -> list[tuple[tuple[int, ...], float]]:
    """Enumerate every prefix of one request and return the best ``budget`` as (tokens, float32 score), in order.

    lp: [L, V] float32. Order: score desc, depth asc, rank path lexicographic (ranks from depth_ranking).
    Probability-0 prefixes (score -inf) are never nodes.
    """
    depths, vocab = lp.shape
    rankings = [depth_ranking(lp[d]) for d in range(depths)]
    allowed = vocab if not cap else min(cap, vocab)
    entries = []
    for d in range(1, min(depth_limit, depths) + 1):
        for ranks in itertools.product(range(allowed), repeat=d):
            tokens = tuple(rankings[k][ranks[k]] for k in range(d))
            score = np.float32(0.0)
            for k, t in enumerate(tokens):
                score = np.float32(score + lp[k, t])
            if np.isfinite(score):
                entries.append((-float(score), d, ranks, tokens, float(score)))
    entries.sort(key=lambda e: (e[0], e[1], e[2]))
    return [(e[3], e[4]) for e in entries[:budget]]


def tree_prefixes(tokens: list[int], parents: list[int], valid: list[bool]) -> list[tuple[tuple[int, ...], int]]:
    """(token path from the root, node index) of each valid non-root node, in node order."""
    out = []
    for i in range(1, len(tokens)):
        if not valid[i]:
            continue
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        out.append((tuple(reversed(path)), i))
    return out


def walk_reference(tokens: list[int], parents: list[int], valid: list[bool], choices: list[int]) -> list[int]:
    """Accepted node indices, root first, by stepping down the tree one node at a time."""
    path = [0]
    while True:
        here = path[-1]
        nxt = [j for j in range(1, len(tokens)) if valid[j] and parents[j] == here and tokens[j] == choices[here]]
        assert len(nxt) <= 1, "siblings must carry distinct tokens"
        if not nxt:
            return path
        path.append(nxt[0])


def compact_reference(cache: torch.Tensor, slots: list[int], start: list[int], path: list[list[int]]) -> torch.Tensor:
    """compact_cache by a loop over requests and columns, reading from an untouched copy."""
    old = cache.clone()
    out = cache.clone()
    for r, slot in enumerate(slots):
        for p, node in enumerate(path[r]):
            out[:, slot, :, start[r] + p] = old[:, slot, :, start[r] + node]
    return out
