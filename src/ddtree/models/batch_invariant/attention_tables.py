"""Exact mode's attention index tables, made on the device once a forward for all its layers.

:func:`ancestor_map` says where each new token's keys above the committed prefix live in the cache (a tree's
ancestors are not contiguous); :func:`tail_chunks` groups the queries of each program whose paths are prefixes of
one another so that one gathered key tile serves them all, and :func:`single_chunks` is the table with every query
alone (:func:`forward_tail` picks). Device ops only (graph-capturable); no kernel here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.models.batch_invariant.attention_rules import groups_tails, tail_layout


def ancestor_map(start: Tensor, positions: Tensor, new_vis: Tensor) -> tuple[Tensor, Tensor]:
    """Where each new token's keys above the prefix live: ``anc [R, T, T]`` int32, ``anc[r, t, d]`` = the new token
    (index into T) that query t sees at depth ``d`` (position ``start + d``), -1 if none; and ``chain [R, T]`` int32,
    1 where ``anc[r, t, d] == d`` for every depth up to t's own (its keys are contiguous in the cache, as in a chain
    or a prompt chunk). start [R]; positions [R, T] (a node's is ``start + depth``); new_vis [R, T, T] bool (the
    diagonal is added). A tree gives one visible node per depth; device ops only (graph-capturable)."""
    r, t = positions.shape
    idx = torch.arange(t, device=positions.device)
    vis = new_vis | (idx[:, None] == idx[None, :])
    depth = (positions - start[:, None]).clamp(0, max(t - 1, 0))  # [R, T]
    src = torch.where(vis, idx.to(torch.int32), -1)  # [R, Tq, Tk]: key node j where visible
    anc = torch.full((r, t, t), -1, dtype=torch.int32, device=positions.device)
    anc = anc.scatter_reduce(2, depth[:, None, :].expand(r, t, t), src, reduce="amax")
    up_to = idx[None, None, :] <= depth[:, :, None]  # [R, Tq, D]
    chain = ((anc == idx.to(torch.int32)) | ~up_to).all(-1).to(torch.int32)
    return anc.contiguous(), chain.contiguous()



def single_chunks(rows: int, tokens: int, group: int, device: torch.device, kv_heads: int = 1) -> Tensor:
    """:func:`tail_chunks`' table with every query a chunk of its own (the grouping is a speed choice: a query alone
    is always a valid chunk): for forwards whose queries do not branch and those whose calls take the split launch
    (:func:`groups_tails`), in a few ops instead of the grouping's ninety or so (18-20 against 123-183 us a forward
    in CUDA-graph replays, H100, docs/benchmarks.md "Exact mode", 2026-12-06 call D)."""
    qt, per = tail_layout(tokens, group, rows * kv_heads)
    p = -(-tokens // qt)
    width = 1 + qt * (1 + per)
    idx = torch.arange(p, device=device)[:, None] * qt + torch.arange(qt, device=device)  # [P, QT]
    own = torch.where(idx < tokens, idx, -1)
    table = torch.full((p, width), -1, dtype=torch.int32, device=device)
    table[:, 0] = (idx < tokens).sum(-1)
    table[:, 1::1 + per] = own  # the lead of chunk c
    table[:, 2::1 + per] = own  # its one member
    return table.expand(rows, p, width).contiguous()


def forward_tail(anc: Tensor, positions: Tensor, start: Tensor, group: int, kv_heads: int,
                 branches: bool = True) -> Tensor:
    """The tail table a forward passes to every layer's :func:`attention`: grouped (:func:`tail_chunks`) where
    its queries branch and its calls launch fused (:func:`groups_tails`), else a chunk per query
    (:func:`single_chunks`): a forward without branches (prefill chunks, chains, AR) has no tree query to group, and
    the split launch runs each query's chunk side by side. Arguments as :func:`tail_chunks`'; ``branches``:
    whether any query's visibility branches (``TreeVisibility.branches``)."""
    r, t = positions.shape
    if branches and groups_tails(r, t, group, kv_heads):
        return tail_chunks(anc, positions, start, group, kv_heads)
    return single_chunks(r, t, group, positions.device, kv_heads)


def tail_chunks(anc: Tensor, positions: Tensor, start: Tensor, group: int, kv_heads: int = 1) -> Tensor:
    """Which queries of each attention program share the gathered K/V tiles above ``start`` (``tail [R, P, 1 + QT x
    (1 + C)]`` int32, P query tiles of QT queries, C = :func:`tail_layout`'s chunk size): per program the number
    of chunks, then per chunk its lead (the query whose ancestors are gathered) and up to C members (-1 pads).

    Why: above ``start`` each tree query reads its own ancestors, so the kernel gathers a tile per query. But a query
    whose path is a prefix of another's (an ancestor in the tree) reads exactly the other's keys at every position
    it sees; the keys past its own position are masked (p = 0) whatever they hold. So one gathered tile of the lead,
    the deepest member, serves every member: a path of 16 nodes at G = 4 (C = 4) gathers 4 tiles for its 16 queries
    instead of 16, and the fused launch's tail dots carry C queries' heads instead of one query's (a tensor-core
    dot's row depends on that row and the tile only). Chunks: each query belongs to one leaf below it (the lowest-numbered leaf of its
    program whose path holds it), a leaf's queries sorted by depth and cut into runs of C; all within one program.
    The test of "u's path is a prefix of t's" compares the two paths at every depth up to u's, so any visibility
    :func:`ancestor_map` takes is grouped correctly (a node alone when nothing shares its path; of two queries with
    equal paths, the lower index under the higher). For finite K/V: a member's masked keys hold the lead's values,
    and p = 0 times an infinite V is NaN (as in a chain's shared tiles already).

    anc [R, T, T], positions [R, T], start [R] as :func:`ancestor_map` takes and makes; ``kv_heads``: the
    target's KV heads (the programs' layout depends on the grid: :func:`attention_block_m`); device ops only, no
    host sync (graph-capturable). Once per forward: every layer's attention reads the same table."""
    r, t = positions.shape
    if t <= 1 or r == 0:  # nothing to group
        return single_chunks(r, t, group, positions.device, kv_heads)
    qt, per = tail_layout(t, group, r * kv_heads)
    p = -(-t // qt)
    tp = p * qt
    dev = positions.device
    depth = (positions - start[:, None]).clamp(0, t - 1)
    real = torch.arange(tp, device=dev) < t  # [TP]: padding queries of the last tile
    a = torch.nn.functional.pad(anc, (0, 0, 0, tp - t), value=-2).view(r, p, qt, t)  # [R, P, QT, D]
    d = torch.nn.functional.pad(depth, (0, tp - t)).view(r, p, qt)
    on_path = torch.arange(t, device=dev) <= d[..., None]  # [R, P, QT, D]: the depths of each query's path
    # prefix[u, v]: u's path, to u's depth, is v's path there (u is v or an ancestor of v)
    prefix = ((a[:, :, :, None, :] == a[:, :, None, :, :]) | ~on_path[:, :, :, None, :]).all(-1)
    ok = real.view(p, qt)
    prefix &= ok[None, :, :, None] & ok[None, :, None, :]
    local = torch.arange(qt, device=dev)
    # below[u, v]: v lies under u. Two queries with equal paths (a visibility that is not a tree: a node seeing a
    # node of its own depth) lie under each other; the higher index is taken as the lower one's, so one is a leaf.
    below = prefix & (local[:, None] != local[None, :]) & ~(prefix.transpose(-1, -2) & (local[:, None] > local[None, :]))
    leaf = ~below.any(-1) & ok  # [R, P, QT]
    owner = torch.where(prefix & leaf[:, :, None, :], local, qt).amin(-1)  # [R, P, QT]; qt for padding
    owner = torch.where(ok & (owner == qt), local, owner)  # never left without one (a query alone is a chunk)
    key = torch.where(ok, (owner * t + d) * qt + local, qt * t * qt + local)
    order = key.argsort(-1)  # [R, P, QT]: by leaf, then depth
    s_owner = owner.gather(-1, order)
    s_ok = ok.expand(r, p, qt).gather(-1, order)
    first = torch.ones_like(s_owner, dtype=torch.bool)
    first[..., 1:] = s_owner[..., 1:] != s_owner[..., :-1]
    lead_at = torch.where(first, local, 0).cummax(-1).values
    rank = local - lead_at
    begins = s_ok & (rank % per == 0)
    chunk = torch.where(s_ok, begins.cumsum(-1) - 1, qt)  # [R, P, QT]; padding -> a dropped chunk
    members = torch.full((r, p, qt + 1, per), -1, dtype=torch.int64, device=dev)
    query = order + (torch.arange(p, device=dev) * qt)[:, None]  # index into T
    members.view(r, p, -1).scatter_(-1, chunk * per + rank % per, torch.where(s_ok, query, -1))
    members = members[:, :, :qt]
    s_depth = d.gather(-1, order)
    lead = torch.full((r, p, qt + 1), -1, dtype=torch.int64, device=dev)
    lead.scatter_reduce_(-1, chunk, torch.where(s_ok, s_depth * tp + query, -1), reduce="amax")
    lead = torch.where(lead[:, :, :qt] >= 0, lead[:, :, :qt] % tp, -1)
    count = begins.sum(-1, keepdim=True)
    table = torch.cat([lead[..., None], members], -1).flatten(-2)  # [R, P, QT x (1 + C)]
    return torch.cat([count, table], -1).to(torch.int32).contiguous()
