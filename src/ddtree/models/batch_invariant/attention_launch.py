"""Exact mode's attention: the new tokens of each row over their slot's keys in position order (the package docstring).

:func:`attention` checks its arguments, picks the launch (:mod:`.attention_rules`) and runs the Triton kernels
(:mod:`.attention_kernels`) over the tables of :mod:`.attention_tables`; :func:`attention_rows` is the torch path,
one query a call, for devices Triton cannot run on.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ddtree.errors import ConfigError, ShapeError
from ddtree.models.batch_invariant import attention_rules as rules
from ddtree.models.batch_invariant.attention_tables import tail_chunks
from ddtree.triton_runtime import FP_FUSION, INTERPRETED, triton

if triton is not None:
    from ddtree.models.batch_invariant.attention_kernels import _attention_combine_kernel, _attention_kernel


def _check_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, start: Tensor, positions: Tensor,
                     anc: Tensor) -> None:
    if q.dim() != 4:
        raise ShapeError(f"batch_invariant.attention: q must be [R, H, T, D], got {tuple(q.shape)}")
    r, h, t, d = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[-1] != d:
        raise ShapeError(f"batch_invariant.attention: k/v caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} "
                          f"must both be [slots, KV, max_len, {d}]")
    if h % k_cache.shape[1]:
        raise ShapeError(f"batch_invariant.attention: {h} query heads are not a multiple of {k_cache.shape[1]}")
    if slots.shape != (r,) or start.shape != (r,) or positions.shape != (r, t) or anc.shape != (r, t, t):
        raise ShapeError(f"batch_invariant.attention: slots {tuple(slots.shape)}, start {tuple(start.shape)}, "
                          f"positions {tuple(positions.shape)}, anc {tuple(anc.shape)} do not fit q {tuple(q.shape)}")



def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, start: Tensor, positions: Tensor,
              anc: Tensor, chain: Tensor, kv_len: int, *, tail: Tensor | None = None,
              split_keys: int = rules.ATTN_SPLIT_KEYS, fused: bool | None = None,
              num_stages: int | None = None) -> Tensor:
    """Attention of the new tokens over their slots' keys in position order (module docstring).

    q [R, H, T, D]; k_cache, v_cache [slots, KV, max_len, D] (new tokens already written at ``start + t``);
    slots, start [R] long; positions [R, T] long (``start + depth``); anc, chain: :func:`ancestor_map`; kv_len: host
    bound > every position (sizes the split grid only: a query's result does not depend on it); tail:
    :func:`tail_chunks` of these (made here when None; a forward makes it once for all its layers). Softmax in fp32
    with scale 1/sqrt(D). Returns [R, H, T, D] in q's dtype (a view of [R, T, H, D] memory).

    ``fused``: one program per query tile walks all of its splits and stores the output (no fp32 partials written
    and read back), or one program per split and a combine kernel; None: :func:`launches_fused`. The same bits
    either way (both merge the split states with :func:`_merge_weights`). ``num_stages`` (default
    :func:`attention_stages`): the software pipeline's depth, for the tuning script; a launch choice too."""
    if triton is None:
        raise ConfigError("batch_invariant.attention needs Triton; use attention_rows")
    _check_attention(q, k_cache, v_cache, slots, start, positions, anc)
    r, h, t, d = q.shape
    if not rules.supports_head_dim(d):
        raise ConfigError(f"batch_invariant.attention takes head_dim in {rules.SUPPORTED_HEAD_DIMS}, got {d}")
    if split_keys % rules.ATTN_BLOCK_N:
        raise ConfigError(f"batch_invariant.attention: split_keys {split_keys} is not a multiple of "
                          f"{rules.ATTN_BLOCK_N}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ShapeError("batch_invariant.attention: the KV cache must have unit stride over head_dim")
    kv = k_cache.shape[1]
    g = h // kv
    if g > rules.ATTN_BLOCK_M:
        raise ConfigError(f"batch_invariant.attention: {g} query heads per KV head exceed {rules.ATTN_BLOCK_M}")
    block_m = rules.attention_block_m(t, g, r * kv)
    qt, chunk = rules.tail_layout(t, g, r * kv)
    if q.stride(-1) != 1:
        q = q.contiguous()
    slots, start, positions = slots.contiguous(), start.contiguous(), positions.contiguous()
    anc, chain = anc.contiguous(), chain.contiguous()
    out = torch.empty((r, t, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    if r == 0 or t == 0:
        return out
    if tail is None:
        tail = tail_chunks(anc, positions, start, g, kv)
    if tail.shape != (r, -(-t // qt), 1 + qt * (1 + chunk)) or tail.dtype != torch.int32:
        raise ShapeError(f"batch_invariant.attention: tail {tuple(tail.shape)} {tail.dtype} is not tail_chunks' "
                         f"table for {t} tokens of {g} query heads per KV head in {r} rows x {kv} KV heads")
    splits = max(1, math.ceil(kv_len / split_keys))
    q_tiles = -(-t // qt)
    if fused is None:
        fused = rules.launches_fused(t, g, r * kv)
    # The two launches agree only while kv_len exceeds every position (the contract above): the split launch has
    # ceil(kv_len / split_keys) splits, the fused one walks a program's splits up to its last position.
    if fused:  # no partials: each program merges its splits itself; ``out`` stands in for the partials' pointers,
        # which the FUSED kernel never reads or writes (its partial stores are compiled out). A tree's programs park
        # their rows' state in ``state`` for the tail by chunk (_tail_chunk); one token is always a chain.
        part_m = part_l = part_acc = out
        state = torch.empty((1 if t == 1 else q_tiles * r * kv * block_m, 2 * d + 4), dtype=torch.float32,
                            device=q.device)
    else:
        part_m = torch.empty((r, t, h, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((r, t, h, splits, d), dtype=torch.float32, device=q.device)
        state = out  # the split launch keeps its tail tiles in registers
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    scale_log2 = d**-0.5 * math.log2(math.e)
    # the split launch's tree tails: a program per chunk (at most QT a query tile) after the splits; one token is
    # always a chain (ancestor_map flags it 1), so its tiles' own programs store every split
    chunk_programs = 0 if fused or t == 1 else qt
    _attention_kernel[(q_tiles, 1 if fused else splits + chunk_programs, r * kv)](
        q, k_cache, v_cache, slots, start, positions, anc, chain, tail.contiguous(), out, part_m, part_l, part_acc,
        state,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        t, g, kv, splits, scale_log2,
        HEAD_DIM=d, BLOCK_M=block_m, QT=qt, BLOCK_N=rules.ATTN_BLOCK_N,
        TILES_PER_SPLIT=split_keys // rules.ATTN_BLOCK_N, SUM_COLS=rules.ATTN_SUM_COLS, TAIL_ROWS=rules.tail_rows(g),
        CHUNK=chunk, SMALL_M=rules.ATTN_SMALL_TAIL_ROWS or rules.ATTN_SUM_COLS,
        SMALL=rules.attention_small_tail(t, g, r * kv), FUSED=fused, EMULATE=INTERPRETED,
        PRECISION=precision, enable_fp_fusion=FP_FUSION, num_warps=rules.attention_warps(block_m),
        num_stages=num_stages or rules.attention_stages(fused, t),
    )
    if not fused:
        _attention_combine_kernel[(r * t, h)](
            out, positions, part_m, part_l, part_acc, out.stride(0), out.stride(1), out.stride(2), t, h, splits,
            HEAD_DIM=d, SPLIT_KEYS=split_keys, enable_fp_fusion=FP_FUSION, num_warps=1,
        )
    return out


def attention_rows(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, start: Tensor, positions: Tensor,
                   anc: Tensor) -> Tensor:
    """The torch path of :func:`attention`: one query at a time over exactly its ``position + 1`` keys gathered in
    position order (shapes depend on the position alone). Reads the small index tensors on the host: CPU use only.
    Same arguments and result as :func:`attention` (chain and kv_len are not needed)."""
    _check_attention(q, k_cache, v_cache, slots, start, positions, anc)
    r_count, h, t_count, d = q.shape
    kv = k_cache.shape[1]
    g = h // kv
    out = torch.empty((r_count, t_count, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    starts, slot_ids, pos, ancs = start.tolist(), slots.tolist(), positions.tolist(), anc.tolist()
    for r in range(r_count):
        s0, slot = starts[r], slot_ids[r]
        for t in range(t_count):
            depth = pos[r][t] - s0
            above = [s0 + a for a in ancs[r][t][:depth + 1] if a >= 0]
            idx = torch.tensor(list(range(s0)) + above, dtype=torch.long, device=q.device)
            k = k_cache[slot][:, idx].to(q.dtype)  # [KV, n, D]
            v = v_cache[slot][:, idx].to(q.dtype)
            qg = q[r, :, t].reshape(kv, g, d)
            scores = torch.matmul(qg, k.transpose(-1, -2)).float() * d**-0.5  # [KV, G, n]
            probs = torch.softmax(scores, dim=-1).to(v.dtype)
            out[r, :, t] = torch.matmul(probs, v).reshape(h, d)
    return out
