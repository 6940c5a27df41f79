"""KV-cache compaction after a verification round: move the accepted nodes' K/V next to the committed prefix.

During verification, node i of request r wrote its K/V at cache position ``start[r] + i`` (flat node order, not
depth). The accepted nodes form a root path whose node indices increase but usually skip (e.g. nodes 0, 1, 4, 9),
so their K/V must move to ``start[r] + 0, 1, 2, 3`` before the next round appends after them. Source and
destination ranges overlap (node 4 moves to position start + 2 while node 2's old slot may be another source), so
every accepted column is read before any is written: one gather into a temporary, one scatter back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.errors import ConfigError


def compact_cache(cache: Tensor, slots: Tensor, start: Tensor, path: Tensor, *, contiguous: bool = False) -> None:
    """Move ``path``'s K/V columns to ``start .. start + P - 1`` of each request's slot, in place.

    cache: [layers, slots, heads, max_len, head_dim], a K or a V cache.
    slots: [R] long, the cache slot of each request.
    start: [R] long, the position where this round wrote node 0 (node i lives at start + i).
    path: [R, P] long node indices (``WalkResult.path``); columns past the accepted count repeat the last node,
        so they land on positions that held rejected nodes and are overwritten next round.
    contiguous: host-known fast path for chain and plain-decoding batches, where path[r, i] == i always: the
        accepted nodes are already in place, so nothing is read or written.

    The caller keeps ``start + N <= max_len``; positions are not bounds-checked on the device (that would sync).
    """
    if contiguous:
        return
    if cache.dim() != 5:
        raise ConfigError(f"cache must be [layers, slots, heads, max_len, head_dim], got shape {tuple(cache.shape)}")
    rows = path.shape[0]
    if slots.shape != (rows,) or start.shape != (rows,) or path.dim() != 2:
        raise ConfigError(
            f"slots and start must be [R] and path [R, P] with the same R; got slots {tuple(slots.shape)}, "
            f"start {tuple(start.shape)}, path {tuple(path.shape)}"
        )
    width = path.shape[1]
    slot_index = slots.long().unsqueeze(1).expand(rows, width)  # [R, P]
    source = start.long().unsqueeze(1) + path.long()  # [R, P]
    target = start.long().unsqueeze(1) + torch.arange(width, device=path.device)  # [R, P]
    # Advanced indices split by a slice put the index dimensions first: moved is [R, P, layers, heads, head_dim].
    moved = cache[:, slot_index, :, source]  # a copy: every source is read before any write below
    cache[:, slot_index, :, target] = moved
