"""Position ids and attention masks for verifying trees (and plain causal blocks) in one target forward.

Terms
-----
T          new tokens in this forward (tree nodes, a chain block, or prompt chunk tokens), per request.
write_pos  [R, T] cache index where each new token's K/V is written (tree node i: ``start + i``).
position   [R, T] RoPE position of each new token (tree node i: ``start + depth_i``; never the flat index).
prefix_len [R] committed cache positions 0 .. prefix_len - 1, visible to every new token.

For the example tree of :mod:`ddtree.speculative.tree` with start = 7 and prefix_len = 7, node 4 (prefix "b c") is
written at cache index 11, has RoPE position 9, and sees keys 0..6 (the prefix), 7 (root) and 10 (node 3, "b").

``build_attention_mask`` returns a boolean ``[R, T, kv_len]`` mask (True = may attend), the form SDPA takes;
``additive_mask`` turns it into 0 / finite-minimum floats for eager attention. A flex_attention ``mask_mod`` can
read the same tensor (``mask[b, q, kv]``), so no third format is needed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ddtree.errors import ShapeError


def tree_positions(start: Tensor, depths: Tensor) -> Tensor:
    """RoPE positions of tree nodes: start + depth. start: [R] long; depths: [R, N] long -> [R, N] long."""
    return start.long().unsqueeze(1) + depths


def tree_write_positions(start: Tensor, n: int) -> Tensor:
    """Cache indices where a round's n new tokens are written: start + i. start: [R] -> [R, n] long."""
    return start.long().unsqueeze(1) + torch.arange(n, device=start.device)


def causal_visibility(n: int, valid_len: Tensor) -> Tensor:
    """[R, n, n] bool lower-triangular visibility for chain/prefill blocks; rows and columns >= valid_len[r] off.

    valid_len: [R] long, the real tokens of each request's block (the rest is padding).
    """
    index = torch.arange(n, device=valid_len.device)
    real = index.unsqueeze(0) < valid_len.unsqueeze(1)  # [R, n]
    causal = index.unsqueeze(1) >= index.unsqueeze(0)  # [n, n]
    return causal.unsqueeze(0) & real.unsqueeze(2) & real.unsqueeze(1)


def build_attention_mask(prefix_len: Tensor, write_pos: Tensor, new_visibility: Tensor, kv_len: int) -> Tensor:
    """Boolean attention mask over the cache for a batch of new tokens.

    prefix_len: [R] long; write_pos: [R, T] long (< kv_len); new_visibility: [R, T, T] bool, new token t sees
    new token t'. Returns [R, T, kv_len] bool: key p is visible to query t iff p < prefix_len, or some t' with
    write_pos[t'] == p has new_visibility[t, t'], or p == write_pos[t] (every query sees its own slot, so no row
    is empty and SDPA yields no NaN for padding queries).
    """
    rows, t = write_pos.shape
    if new_visibility.shape != (rows, t, t):
        raise ShapeError(f"new_visibility must be [{rows}, {t}, {t}], got {tuple(new_visibility.shape)}")
    device = write_pos.device
    keys = torch.arange(kv_len, device=device)
    prefix = (keys.unsqueeze(0) < prefix_len.unsqueeze(1)).unsqueeze(1)  # [R, 1, kv_len]
    mask = torch.zeros(rows, t, kv_len, dtype=torch.uint8, device=device).masked_fill_(prefix, 1)
    index = write_pos.long().unsqueeze(1).expand(rows, t, t)
    # amax, not plain scatter: two new tokens may share a write position (padding), and the visible one wins.
    mask = mask.scatter_reduce(2, index, new_visibility.to(torch.uint8), reduce="amax")
    own = write_pos.long().unsqueeze(2)  # [R, T, 1]
    mask = mask.scatter(2, own, 1)
    return mask.bool()


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean mask -> additive float mask: 0 where visible, the dtype's finite minimum elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


# ---- the tree-attention kernel's visibility contract (ddtree.models.tree_attention reads these) ----------------
class PackedVisibility(NamedTuple):
    """``new_vis`` as the kernel reads it: one bit per (query, key) and each query's last visible key.

    Bits instead of a [T, T] byte gather: a tile of 64 new keys is one int64 word per query row (a [BLOCK_M] load
    and shifts in registers), which also frees the registers a [BLOCK_M, BLOCK_N] pointer gather held."""

    bits: Tensor  # [R, T, ceil(T / 64)] int64: bit j % 64 of word j // 64 of query t = new_vis[t, j] or j == t
    last: Tensor  # [R, T] int32: the largest such j (a tile of queries visits the new keys up to its max only)


class TreeVisibility(NamedTuple):
    """What the kernel needs instead of a dense mask (a NamedTuple so graphs and compile accept it).

    The new tokens must have been written at ``start + arange(T)`` (tree rounds and prefill chunks are)."""

    start: Tensor  # [R] long, committed cache length of each row = cache index of its new token 0
    new_vis: Tensor  # [R, T, T] bool, new token t sees new token t'
    kv_len: int  # static bound >= max(start) + T; sizes the context split (host int, no sync)
    packed: PackedVisibility | None = None  # pack_visibility(new_vis), once per forward instead of once per layer
    # whether the new tokens may branch (a tree round); False, known on the host, for prefill chunks: exact mode then
    # gives each query its own tail chunk instead of grouping them (ddtree.models.batch_invariant.tail_chunks), in a
    # few ops instead of about fifty (a speed choice: the bits are the same either way). Rounds keep True: their
    # stage graphs are shared between chain and tree rounds (runner.STAGE_SHAPE_FIELDS), and AR's one token is
    # never grouped; a True round is grouped only where its calls launch fused (batch_invariant.groups_tails)
    branches: bool = True

    def with_packed(self) -> TreeVisibility:
        """This visibility with :func:`pack_visibility` computed (a forward packs once and reuses it per layer)."""
        return self if self.packed is not None else self._replace(packed=pack_visibility(self.new_vis))


def pack_visibility(new_vis: Tensor) -> PackedVisibility:
    """[R, T, T] bool -> :class:`PackedVisibility` (the diagonal set: every query sees its own key)."""
    r, t, _ = new_vis.shape
    idx = torch.arange(t, device=new_vis.device)
    vis = new_vis | (idx[:, None] == idx[None, :])
    words = -(-t // 64)
    # Bytes first (two bytes of scratch per bit, not sixteen: 31 short prompts beside a 1118-token one in a prefill
    # step are 82 MB, not 660), then eight bytes per int64 word, least significant first (little-endian, as CUDA,
    # x86 and ARM store them).
    padded = torch.zeros((r, t, words * 64), dtype=torch.uint8, device=new_vis.device)
    padded[..., :t] = vis
    shifts = torch.arange(8, device=new_vis.device, dtype=torch.uint8)
    # Distinct powers of two: the sum is the bitwise OR.
    packed_bytes = (padded.view(r, t, words * 8, 8) << shifts).sum(-1, dtype=torch.uint8)
    bits = packed_bytes.view(torch.int64)  # [R, T, words]
    last = torch.where(vis, idx, -1).amax(-1).to(torch.int32)
    return PackedVisibility(bits, last)
