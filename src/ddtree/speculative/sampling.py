"""The target's choice at every tree node: greedy argmax or a seeded sample, batched and without a host sync.

Why this is lossless
--------------------
The walk (:mod:`ddtree.speculative.walk`) commits, at each accepted node, the token the target drew there: the child's
token when it matches, otherwise the draw itself as the bonus. Every draw is an independent sample of the target's
(tempered, filtered) distribution for that node's prefix, so the committed sequence is distributed exactly as if
the target had sampled it token by token; the draft only decides how many draws one forward pass can use.

Randomness
----------
Each node gets one uniform u in (0, 1] from a counter-based hash, so the same request, seed and counters give the
same draws whatever batch the request sits in and wherever its row lands, and no generator state lives anywhere.
Two ways to key it:

- ``step`` [R] (a per-request round counter that never repeats): u = hash(seed, step, node index).
- ``step`` [R, N] (a counter per node): u = hash(seed, step[r, n]) with no node index. Passing each node's
  output index (tokens generated so far + the node's depth) makes the draw for output position k the same at
  every node of that depth and in every round shape, so a seeded request produces the same tokens whether it is
  decoded plainly or by any tree. Still lossless: the walk commits one node per depth, so committed positions use
  distinct counters, i.e. independent uniforms.

The hash is murmur3's 32-bit finalizer (``fmix32``) chained over the 32-bit halves of seed and step, then applied
to ``2 * lane`` and ``2 * lane + 1`` (lane = node index, or 0 with per-node steps); the two 32-bit words make a
53-bit uniform. All integer arithmetic stays below 2**63 (32-bit values times 16-bit constant halves), so it is
exact on every backend with no reliance on signed overflow. Only [R, N] numbers are hashed.

The token is the inverse CDF at u over vocabulary order: the first token whose cumulative probability reaches
``u * total``. It is found in two levels so no [R, N, V] float64 array is ever made: float64 sums of blocks of
``BLOCK`` tokens, a cumulative sum and binary search over the blocks, then the same inside the chosen block. With
u > 0 and "reaches" (``searchsorted`` left), a zero-probability token is never chosen; the remainder inside the
block is clamped to the block's mass, so float64 rounding cannot step outside the block either.

Filtering follows Hugging Face's order: temperature, then top-k (keep the k largest logits; equal logits keep the
lower token id first), then top-p on the renormalized rest (keep the smallest best-first set whose mass reaches
top_p; the best token is always kept).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.errors import ShapeError

_MASK32 = 0xFFFFFFFF
BLOCK = 1024  # tokens per block of the two-level inverse CDF (the whole vocabulary when it is smaller)


def _mul32(x: Tensor, constant: int) -> Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32), split so no int64 product overflows."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _fmix32(x: Tensor) -> Tensor:
    """murmur3's finalizer: a bijection of [0, 2**32) with full avalanche (every input bit flips ~half the output)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def counter_uniform(seed: Tensor, step: Tensor, nodes: int) -> Tensor:
    """[R, nodes] float64 uniforms in (0, 1], a pure function of the seed and counters (see the module docstring).

    seed: [R] long (any int64; the bits are what count). step: [R] long (draws keyed by (seed, step, node index))
    or [R, nodes] long (keyed by (seed, step[r, n]) alone).
    """
    seed, step = seed.long().unsqueeze(1), step.long()  # seed [R, 1]
    if step.dim() == 1:
        step, lane = step.unsqueeze(1), torch.arange(nodes, device=seed.device)  # [R, 1], [nodes]
    else:
        lane = torch.zeros(nodes, dtype=torch.long, device=seed.device)
    state = _fmix32((seed & _MASK32) ^ 0x9E3779B9)
    for word in ((seed >> 32) & _MASK32, step & _MASK32, (step >> 32) & _MASK32):
        state = _fmix32(state ^ word)  # [R, 1] or [R, nodes]
    high = _fmix32(state ^ (2 * lane))  # [R, nodes], 32 random bits
    low = _fmix32(state ^ (2 * lane + 1)) >> 11  # 21 more bits
    return (high * 2**21 + low + 1).double() * 2.0**-53


def _filtered_out(scaled: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """[R, N, V] bool, True for tokens top-k or top-p removes. scaled: [R, N, V] tempered logits.

    Decided in best-first order, returned in vocabulary order, so the draw below is the same inverse CDF over
    vocabulary order whether or not the batch needed filtering (a request's samples never depend on its batch).
    """
    vocab = scaled.shape[-1]
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)
    k = top_k.long().view(-1, 1, 1)
    outside_k = (k > 0) & (rank >= k)  # [R, 1, V]
    probs = torch.softmax(ordered.masked_fill(outside_k, -torch.inf), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    p = top_p.float().view(-1, 1, 1)
    # top_p == 1 is "off" exactly: float32 cumulative mass can reach 1.0 before the last tokens.
    removed = outside_k | ((p < 1) & (mass_before >= p))  # [R, N, V] best-first
    return torch.zeros_like(removed).scatter_(-1, order, removed)


def sample_choices(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    seed: Tensor,
    step: Tensor,
    *,
    any_filter: bool = True,
) -> Tensor:
    """The target's choice at every node: argmax where temperature == 0, else a seeded filtered sample.

    logits: [R, N, V] target logits at every node; temperature: [R] float (0 = greedy); top_p: [R] float in
    (0, 1]; top_k: [R] long (0 = off); seed: [R] long; step: [R] long per-request counter that never repeats
    for a request, or [R, N] long per-node counter (e.g. tokens generated so far + node depth: the output index
    the node's draw would fill; see the module docstring). Returns [R, N] long.

    any_filter: host-known. Pass False when no row uses top-p < 1 or top-k > 0 to skip the vocabulary sort.
    For an all-greedy batch the caller can use ``logits.argmax(-1)`` directly (the same result).
    """
    if logits.dim() != 3:
        raise ShapeError(f"logits must be [requests, nodes, vocab], got shape {tuple(logits.shape)}")
    rows, nodes, vocab = logits.shape
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if value.shape != (rows,):
            raise ShapeError(f"{name} must have shape [{rows}] (one per request), got {tuple(value.shape)}")
    if step.shape not in ((rows,), (rows, nodes)):
        raise ShapeError(f"step must have shape [{rows}] or [{rows}, {nodes}], got {tuple(step.shape)}")
    greedy = temperature <= 0  # [R]
    scale = torch.where(greedy, 1.0, temperature.float()).view(-1, 1, 1)
    scaled = logits.float() / scale
    if any_filter:
        scaled = scaled.masked_fill(_filtered_out(scaled, top_p, top_k), -torch.inf)
    sampled = _inverse_cdf(torch.softmax(scaled, dim=-1), counter_uniform(seed, step, nodes))
    return torch.where(greedy.view(-1, 1), logits.argmax(dim=-1), sampled)


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """The first token whose cumulative probability reaches u * total, in two levels (see the module docstring).

    probs: [R, N, V] float32, non-negative, positive total; u: [R, N] float64 in (0, 1]. Returns [R, N] long.
    """
    rows, nodes, vocab = probs.shape
    size = min(BLOCK, vocab)
    blocks = -(-vocab // size)
    probs = torch.nn.functional.pad(probs, (0, blocks * size - vocab)).view(rows, nodes, blocks, size)
    block_mass = probs.sum(dim=-1, dtype=torch.float64)  # [R, N, blocks]
    block_cdf = torch.cumsum(block_mass, dim=-1)
    target = (u * block_cdf[..., -1]).unsqueeze(-1)  # [R, N, 1], in (0, total]
    block = torch.searchsorted(block_cdf, target).clamp(max=blocks - 1)  # [R, N, 1]; its mass is > 0
    before = torch.gather(block_cdf, -1, block) - torch.gather(block_mass, -1, block)
    inside = torch.gather(probs, 2, block.unsqueeze(-1).expand(rows, nodes, 1, size)).squeeze(2)  # [R, N, size]
    inside_cdf = torch.cumsum(inside, dim=-1, dtype=torch.float64)
    # Rounding may leave the remainder a hair outside (0, block mass]; either edge is a positive-mass token.
    rest = torch.minimum(target - before, inside_cdf[..., -1:]).clamp(min=torch.finfo(torch.float64).tiny)
    token = torch.searchsorted(inside_cdf, rest).clamp(max=size - 1)  # [R, N, 1]
    return (block * size + token).squeeze(-1)
