"""Position ids and attention masks for verifying trees (and plain causal blocks) in one target forward.

Terms
-----
T          new tokens in this forward (tree nodes, a chain block, or prompt chunk tokens), per request.
write_pos  [R, T] cache index where each new token's K/V is written (tree node i: ``start + i``).
position   [R, T] RoPE position of each new token (tree node i: ``start + depth_i``; never the flat index).
prefix_len [R] committed cache positions 0 .. prefix_len - 1, visible to every new token.

For the example tree of :mod:`ddtree.spec.tree` with start = 7 and prefix_len = 7, node 4 (prefix "b c") is
written at cache index 11, has RoPE position 9, and sees keys 0..6 (the prefix), 7 (root) and 10 (node 3, "b").

``build_attention_mask`` returns a boolean ``[R, T, kv_len]`` mask (True = may attend), the form SDPA takes;
``additive_mask`` turns it into 0 / finite-minimum floats for eager attention. A flex_attention ``mask_mod`` can
read the same tensor (``mask[b, q, kv]``), so no third format is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.errors import ConfigError


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
        raise ConfigError(f"new_visibility must be [{rows}, {t}, {t}], got {tuple(new_visibility.shape)}")
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
