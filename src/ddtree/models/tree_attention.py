"""Tree attention over the static KV cache as one Triton kernel (flash-decoding style, split over the context).

The dense path (:func:`ddtree.models.target.attend_over_cache`) gathers every batch row's K/V out of the cache,
expands a boolean ``[R, T, kv_len]`` mask and runs several kernels per layer. This kernel reads K/V straight from
the cache by slot and derives visibility from small per-row tensors instead:

Terms
-----
R        request rows in the batch; row r's K/V lives in cache slot ``slots[r]``.
T        new tokens per row (tree nodes, a chain block, a prompt chunk); new token t of row r was written at
         cache index ``start[r] + t`` before attention (the runner's ``tree_write_positions`` / prefill layout).
new_vis  [R, T, T] bool: new token t sees new token t' (a tree's ancestor visibility, or causal for chunks).
G        query heads per KV head (grouped-query attention); query head h reads KV head ``h // G``.

Visibility rule (identical to :func:`ddtree.speculative.build_attention_mask` with ``prefix_len = start`` and
``write_pos = start + arange(T)``): key p is visible to query t of row r iff ``p < start[r]`` (the committed
prefix), or ``p = start[r] + t'`` with ``new_vis[r, t, t']`` or ``t' == t`` (every query sees its own slot, so
padding queries never have an empty softmax). Keys at or past ``start[r] + T`` are never visible.

Example: start = 5, T = 4, a tree root(0) -> a(1), root -> b(2), a -> c(3); query c sees keys 0..4 (prefix),
5 (root), 6 (a) and 8 (itself), exactly the dense mask row ``1 1 1 1 1 1 1 0 1``.

Kernel layout
-------------
The G query heads sharing a KV head are folded into the query-row axis (``rows = G * T``; folded row m is head
``kv * G + m // T``, token ``m % T``), so each K/V tile loaded from the cache serves all of them. A row's keys
come in two parts with different costs: the committed prefix ``[first, start)`` (visible to every query; long) and
the T new keys ``[start, start + T)`` (visible per ``new_vis``; short). Programs form a grid
``row_tiles x (splits + 1) x (R * KV)``: programs ``0 .. splits - 1`` take BLOCK_M folded rows and an equal share
of the prefix's key blocks (computed on the device from ``start[r]``, so short rows never visit blocks they cannot
see), in one uniform loop whose only mask is a ``[BLOCK_N]`` range compare; program ``splits`` takes the new keys in
tiles of up to 64 that start at ``start``, reading visibility as bits (:class:`PackedVisibility`: one int64 word per
query per tile) and stopping after the last new key any row of its tile sees. Each writes fp32 partials (running
max, sum, unnormalised output) and a small combine kernel merges the ``splits + 1`` of them. With one split a
single program does both parts, normalises and writes the output itself. Keeping the masked new-token work out of
the prefix loop lets the prefix stream at full speed and runs the tree part beside it instead of after it. Every
size (grid, splits, scratch) comes from host ints (R, T, kv_len), so calls are CUDA-graph capturable.

When it runs: :meth:`ddtree.models.target.TargetModel.forward` given a
:class:`~ddtree.speculative.attention.TreeVisibility` (the visibility contract, which lives with the core) calls it
when the target :meth:`~ddtree.models.target.TargetModel.supports_tree_attention` (:func:`ddtree.triton_runtime.can_run`
on its weights and a head dim in ``SUPPORTED_HEAD_DIMS``); passing a dense mask is how a caller picks the dense path.
Launch shapes (tiles, splits) come from the device tuning tables of :mod:`ddtree.tuning`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

from ddtree import tuning
from ddtree.errors import ConfigError, ShapeError
from ddtree.speculative.attention import PackedVisibility, pack_visibility
from ddtree.triton_runtime import FP_FUSION, INTERPRETED, tl, triton
from ddtree.tuning import choose_splits, choose_tiles, sm_count

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BLOCK_N = (16, 32, 64, 128)
MAX_SPLITS = 32  # the most a caller may ask for (the tile sweep; the combine unrolls over splits + 1 partials)
# The launch shapes chosen among these (tiles per regime, splits of the context) are the H200's tuning tables in
# ddtree.tuning (choose_tiles, choose_splits), not this file's.


def supports_head_dim(head_dim: int) -> bool:
    """The kernel tiles the head dimension in one block: powers of two the MMA units handle well."""
    return head_dim in SUPPORTED_HEAD_DIMS


if triton is not None:

    @triton.jit
    def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """a @ b with fp32 accumulation. UPCAST multiplies in fp32 instead: only for bf16 under Triton 3.6's
        interpreter, whose dot multiplies bf16's raw 16-bit patterns as integers (products of bf16 values are exact
        in fp32, so the result equals the tensor-core one up to summation order)."""
        if UPCAST:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(a, b, input_precision=PRECISION)
        return out

    @triton.jit
    def _online_softmax_step(acc, m_i, l_i, q, k, v, visible, scale_log2, DOT_PRECISION: tl.constexpr,
                             DOT_UPCAST: tl.constexpr):
        """Fold one key tile into the running (acc [BLOCK_M, D], max m_i in log2 units, sum l_i); ``visible``
        [BLOCK_M, BLOCK_N] (or broadcastable) hides keys. Rows with nothing visible yet stay at zero."""
        qk = _dot(q, tl.trans(k.to(q.dtype)), DOT_UPCAST, DOT_PRECISION) * scale_log2
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), DOT_UPCAST, DOT_PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _attend_prefix(acc, m_i, l_i, q, k_base, v_base, stride_kp, stride_vp, block_lo, block_hi, first, start,
                       offs_n, offs_d, scale_log2, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                       BLOCK_N: tl.constexpr):
        """Key blocks [block_lo, block_hi) of the committed prefix: key p is visible to every row iff
        first <= p < start. One uniform loop (the two edge blocks are masked like the rest: a [BLOCK_N] compare)
        so the compiler pipelines the K/V loads across all of it."""
        for block in range(block_lo, block_hi):
            p_idx = block * BLOCK_N + offs_n
            key_ok = (p_idx >= first) & (p_idx < start)
            k = tl.load(k_base + p_idx[:, None] * stride_kp + offs_d[None, :], mask=key_ok[:, None], other=0.0)
            v = tl.load(v_base + p_idx[:, None] * stride_vp + offs_d[None, :], mask=key_ok[:, None], other=0.0)
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, key_ok[None, :], scale_log2,
                                                 DOT_PRECISION, DOT_UPCAST)
        return acc, m_i, l_i

    @triton.jit
    def _attend_new(acc, m_i, l_i, q, k_base, v_base, bits_ptr, stride_kp, stride_vp, stride_bt, start, T, t_idx,
                    row_ok, tile_last, offs_d, scale_log2, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                    TREE_BN: tl.constexpr):
        """The new tokens' keys ``start + j`` for j <= tile_last (the last key any row of the tile sees): key j is
        visible to query t iff bit j of the packed visibility row ``bits[t]`` is set (the diagonal is). Blocks
        start at ``start``, so block b's bits are one int64 word (TREE_BN <= 64) per query: no [M, N] gather."""
        offs_j = tl.arange(0, TREE_BN)
        for block in range(0, tl.cdiv(tile_last + 1, TREE_BN)):
            j = block * TREE_BN + offs_j
            key_ok = j < T
            p_idx = start + j
            k = tl.load(k_base + p_idx[:, None] * stride_kp + offs_d[None, :], mask=key_ok[:, None], other=0.0)
            v = tl.load(v_base + p_idx[:, None] * stride_vp + offs_d[None, :], mask=key_ok[:, None], other=0.0)
            word = tl.load(bits_ptr + t_idx * stride_bt + (block * TREE_BN) // 64, mask=row_ok, other=0)
            visible = ((word[:, None] >> (j % 64)[None, :].to(tl.int64)) & 1) != 0
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, visible & key_ok[None, :], scale_log2,
                                                 DOT_PRECISION, DOT_UPCAST)
        return acc, m_i, l_i

    # num_splits is not specialised (Triton would give 16 splits a variant of its own, divisible by 16): the kernel
    # only divides by it, and DIRECT already separates one split.
    @triton.jit(do_not_specialize=["num_splits"])
    def _tree_attention_split_kernel(
        q_ptr, k_ptr, v_ptr, slots_ptr, start_ptr, first_ptr, bits_ptr, last_ptr, out_ptr, part_m_ptr, part_l_ptr,
        part_acc_ptr,
        stride_qr, stride_qh, stride_qt,  # q [R, H, T, D], unit stride over D
        stride_ks, stride_kh, stride_kp,  # k cache [slots, KV, max_len, D], unit stride over D
        stride_vs, stride_vh, stride_vp,  # v cache
        stride_or, stride_oh, stride_ot,  # out [R, H, T, D]
        stride_br, stride_bt,  # bits [R, T, W] int64, unit stride over W
        stride_lr,  # last [R, T] int32, unit stride over T
        T, G, num_kv, num_splits, rows_padded, scale_log2,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TREE_BN: tl.constexpr,
        DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, HAS_FIRST: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_s = tl.program_id(1)  # < num_splits: a share of the prefix; == num_splits: the new tokens
        pid_rk = tl.program_id(2)
        r = pid_rk // num_kv
        kv = pid_rk % num_kv

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # folded rows g * T + t
        row_ok = rows < G * T
        g_idx = rows // T
        t_idx = rows % T
        head = kv * G + g_idx
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)

        q = tl.load(q_ptr + r * stride_qr + head[:, None] * stride_qh + t_idx[:, None] * stride_qt + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        slot = tl.load(slots_ptr + r)
        start = tl.load(start_ptr + r)
        k_base = k_ptr + slot * stride_ks + kv * stride_kh
        v_base = v_ptr + slot * stride_vs + kv * stride_vh

        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if DIRECT:  # one program does both parts
            new_split = 0
        else:
            new_split = num_splits
        if pid_s < num_splits:
            # Keys below `first` are hidden (a drafter's window); blocks wholly below it are never visited. This
            # program's share of the prefix blocks [first_block, cdiv(start, BLOCK_N)).
            if HAS_FIRST:
                first = tl.load(first_ptr + r)
            else:
                first = 0
            first_block = first // BLOCK_N
            n_blocks = tl.cdiv(start, BLOCK_N)
            per_split = tl.cdiv(n_blocks - first_block, num_splits)
            lo = first_block + pid_s * per_split
            hi = tl.minimum(lo + per_split, n_blocks)
            acc, m_i, l_i = _attend_prefix(acc, m_i, l_i, q, k_base, v_base, stride_kp, stride_vp, lo, hi, first,
                                           start, offs_n, offs_d, scale_log2, DOT_PRECISION, DOT_UPCAST, BLOCK_N)
        if pid_s == new_split:
            last = tl.load(last_ptr + r * stride_lr + t_idx, mask=row_ok, other=0)
            tile_last = tl.max(last, 0)
            acc, m_i, l_i = _attend_new(acc, m_i, l_i, q, k_base, v_base, bits_ptr + r * stride_br, stride_kp,
                                        stride_vp, stride_bt, start, T, t_idx, row_ok, tile_last, offs_d,
                                        scale_log2, DOT_PRECISION, DOT_UPCAST, TREE_BN)

        if DIRECT:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            out_ptrs = (out_ptr + r * stride_or + head[:, None] * stride_oh + t_idx[:, None] * stride_ot
                        + offs_d[None, :])
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            # [BLOCK_M] into the partials [R*KV, num_splits + 1, rows_padded]
            part = (pid_rk * (num_splits + 1) + pid_s) * rows_padded + rows
            tl.store(part_m_ptr + part, m_i)
            tl.store(part_l_ptr + part, l_i)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc)

    @triton.jit(do_not_specialize=["num_parts"])
    def _tree_attention_combine_kernel(
        out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, stride_or, stride_oh, stride_ot,
        T, G, num_kv, rows_padded, num_parts,
        UNROLL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        """Merge the ``num_parts`` (splits + 1) partials: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.

        Program (row tile, row x KV head, head-dim block). The split loop is unrolled over UNROLL >= num_parts
        slots (a compile-time constant) so the partials' loads are all in flight at once: a rolled loop waited for
        each split's load in turn, ~13 us for 16 splits at one decode token (benchmarks/profile_step.py on the
        H200). UNROLL is 2^k + 1 >= num_parts (the split count rounded up to a power of two, plus the new tokens'
        partial), its slots past num_parts masked off (they weigh 0), so split counts 2..16 compile 4 variants
        instead of 15 (the start-up warm-up compiles each) and power-of-two counts waste no slot."""
        pid_m = tl.program_id(0)
        pid_rk = tl.program_id(1)
        pid_d = tl.program_id(2)
        r = pid_rk // num_kv
        kv = pid_rk % num_kv
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < G * T
        head = kv * G + rows // T
        t_idx = rows % T
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        base = pid_rk * num_parts * rows_padded + rows

        m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for s in tl.static_range(UNROLL):
            m_max = tl.maximum(m_max, tl.load(part_m_ptr + base + s * rows_padded,
                                              mask=rows * 0 + s < num_parts, other=float("-inf")))
        m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        for s in tl.static_range(UNROLL):
            part = base + s * rows_padded
            live = rows * 0 + s < num_parts  # [BLOCK_M]
            # empty splits (m = -inf) and the slots past num_parts weigh 0
            w = tl.exp2(tl.load(part_m_ptr + part, mask=live, other=float("-inf")) - m_use)
            l_sum += w * tl.load(part_l_ptr + part, mask=live, other=0.0)
            acc += w[:, None] * tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                                        mask=live[:, None], other=0.0)
        out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
        out_ptrs = out_ptr + r * stride_or + head[:, None] * stride_oh + t_idx[:, None] * stride_ot + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, pos_ptr,
        stride_kr, stride_kh, stride_kt, stride_vr, stride_vh, stride_vt,  # k, v [R, KV, T, D], unit stride over D
        stride_cs, stride_ch, stride_cp,  # cache [slots, KV, max_len, D] (k and v caches share strides)
        stride_pr, T, HEAD_DIM: tl.constexpr,
    ):
        """Program (row r, new token t): k[r, :, t] and v[r, :, t] -> cache[slots[r], :, pos[r, t]], every KV head."""
        r = tl.program_id(0) // T
        t = tl.program_id(0) % T
        kv = tl.program_id(1)
        slot = tl.load(slots_ptr + r)
        pos = tl.load(pos_ptr + r * stride_pr + t)
        offs = tl.arange(0, HEAD_DIM)
        dst = slot * stride_cs + kv * stride_ch + pos * stride_cp + offs
        k = tl.load(k_ptr + r * stride_kr + kv * stride_kh + t * stride_kt + offs)
        v = tl.load(v_ptr + r * stride_vr + kv * stride_vh + t * stride_vt + offs)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty))


def write_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, write_pos: Tensor, k: Tensor, v: Tensor) -> None:
    """Store new K/V in one kernel: k, v [R, KV, T, D] -> cache[slots[r], :, write_pos[r, t]] (one layer's
    ``[slots, KV, max_len, D]`` caches), what :meth:`ddtree.models.kv_cache.KVCache.write` does with two indexing
    kernels (~3.5 us each, 72 per Qwen3-8B step on the H200: 0.25 ms of a 5.8 ms decode step).

    Positions are not bounds-checked on the device (that would sync): the engine only writes below ``max_len``."""
    if triton is None:
        raise ConfigError("write_kv needs Triton; use KVCache.write")
    r, kv, t, d = k.shape
    if v.shape != k.shape or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ShapeError(f"write_kv: k/v {tuple(k.shape)}/{tuple(v.shape)} and caches {tuple(k_cache.shape)}/"
                         f"{tuple(v_cache.shape)} must match")
    if k_cache.shape[1] != kv or k_cache.shape[3] != d or write_pos.shape != (r, t) or slots.shape != (r,):
        raise ShapeError(f"write_kv: k {tuple(k.shape)} does not fit cache {tuple(k_cache.shape)}, write_pos "
                         f"{tuple(write_pos.shape)}, slots {tuple(slots.shape)}")
    if not supports_head_dim(d):
        raise ShapeError(f"write_kv supports head_dim in {SUPPORTED_HEAD_DIMS}, got {d}; use KVCache.write")
    if r == 0 or t == 0:
        return
    slots = slots.contiguous()  # the kernel reads slots[r] at unit stride (a no-op for the engine's inputs)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride(-1) != 1 or write_pos.stride(-1) != 1:
        raise ShapeError("write_kv: the caches and write_pos need unit stride over their last dim")
    _write_kv_kernel[(r * t, kv)](
        k, v, k_cache, v_cache, slots, write_pos,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), write_pos.stride(0), t,
        HEAD_DIM=d, enable_fp_fusion=FP_FUSION, num_warps=1,
    )


def _check_inputs(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, start: Tensor, new_vis: Tensor,
                  kv_len: int) -> None:
    if q.dim() != 4:
        raise ShapeError(f"tree_attention: q must be [R, H, T, D], got shape {tuple(q.shape)}")
    r, h, t, d = q.shape
    if not supports_head_dim(d):
        raise ShapeError(f"tree_attention supports head_dim in {SUPPORTED_HEAD_DIMS}, got {d}; "
                         "use the dense masked path for this model")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ShapeError(f"tree_attention: q dtype must be float32, float16 or bfloat16, got {q.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[-1] != d:
        raise ShapeError(f"tree_attention: k/v cache must both be [slots, KV, max_len, {d}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    kv = k_cache.shape[1]
    if h % kv != 0:
        raise ShapeError(f"tree_attention: {h} query heads are not a multiple of {kv} KV heads")
    if slots.shape != (r,) or start.shape != (r,):
        raise ShapeError(f"tree_attention: slots and start must be [{r}], got {tuple(slots.shape)} and "
                         f"{tuple(start.shape)}")
    if new_vis.shape != (r, t, t):
        raise ShapeError(f"tree_attention: new_vis must be [{r}, {t}, {t}], got {tuple(new_vis.shape)}")
    if not t <= kv_len <= k_cache.shape[2]:
        raise ShapeError(f"tree_attention: kv_len={kv_len} must lie in [T={t}, cache max_len={k_cache.shape[2]}]")


class Launch(NamedTuple):
    """The launch of one :func:`tree_attention` call: everything Triton compiles a variant for, from host ints.

    Why a value of its own: the engine's start-up warm-up (:mod:`ddtree.engine.warmup`) must know, without a
    device, which kernel variants a shape needs, so that it can plan them and share one CUDA graph between keys
    that launch identically (the key length reaches the kernels only through these numbers)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    splits: int  # context splits; 1 = direct (no combine)
    row_tiles: int
    combine_splits: int  # the combine's unrolled partial count (2^k + 1 >= splits + 1; 0 when direct)
    combine_block_m: int  # folded query rows per combine program (divides the split's block_m)
    combine_block_d: int  # head-dim columns per combine program (divides head_dim)


def plan_launch(requests: int, heads: int, kv_heads: int, tokens: int, head_dim: int, kv_len: int,
                elem_bytes: int, sms: int, *, block_n: int | None = None, splits: int | None = None,
                block_m: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, combine_block_m: int | None = None,
                combine_block_d: int | None = None) -> Launch:
    """The tiles and splits :func:`tree_attention` launches for R = ``requests`` rows of T = ``tokens`` new
    tokens over ``kv_len`` keys (``ddtree.tuning``'s tables unless overridden), validated. Pure (host ints)."""
    rows = heads // kv_heads * tokens
    tiles = choose_tiles(requests, rows, kv_len, head_dim, elem_bytes)
    block_n = tiles.block_n if block_n is None else block_n
    block_m = tiles.block_m if block_m is None else block_m
    num_warps = tiles.num_warps if num_warps is None else num_warps
    num_stages = tiles.num_stages if num_stages is None else num_stages
    if block_n not in SUPPORTED_BLOCK_N:
        raise ConfigError(f"tree_attention: block_n must be one of {SUPPORTED_BLOCK_N}, got {block_n}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ConfigError(f"tree_attention: block_m must be a power of two >= 16, got {block_m}")
    row_tiles = math.ceil(rows / block_m)
    if splits is None:
        splits = choose_splits(requests * kv_heads * row_tiles, kv_len, block_n, sms, tiles.min_blocks_per_split,
                               multi_token=tokens > 1)
    if not 1 <= splits <= MAX_SPLITS:
        raise ConfigError(f"tree_attention: splits must be in [1, {MAX_SPLITS}], got {splits}")
    # splits rounded up to a power of two, plus the new tokens' partial: power-of-two split counts are exact
    combine = 0 if splits == 1 else (1 << (splits - 1).bit_length()) + 1
    rule_m, rule_d = tuning.choose_combine_tile(block_m, max(combine, 1), head_dim)
    if combine_block_m is None:
        combine_block_m = rule_m if tuning.COMBINE_BLOCK_M is None else min(block_m, tuning.COMBINE_BLOCK_M)
    if combine_block_d is None:
        combine_block_d = rule_d if tuning.COMBINE_BLOCK_D is None else min(head_dim, tuning.COMBINE_BLOCK_D)
    if combine_block_m < 16 or combine_block_m & (combine_block_m - 1) or combine_block_m > block_m:
        raise ConfigError(f"tree_attention: combine_block_m must be a power of two in [16, block_m = {block_m}], "
                          f"got {combine_block_m}")
    if combine_block_d < 16 or combine_block_d & (combine_block_d - 1) or combine_block_d > head_dim:
        raise ConfigError(f"tree_attention: combine_block_d must be a power of two in [16, head_dim = {head_dim}], "
                          f"got {combine_block_d}")
    return Launch(block_m, block_n, num_warps, num_stages, splits, row_tiles, combine, combine_block_m,
                  combine_block_d)


def _int_class(value: int) -> str:
    """How Triton (3.x) specialises an integer argument: equal to 1 (a constant), divisible by 16, or neither."""
    return "1" if value == 1 else ("16" if value % 16 == 0 else "")


def variants(launch: Launch, tokens: int, head_dim: int, *, has_first: bool) -> tuple[tuple, ...]:
    """The Triton variants (one per kernel) a launch compiles, as hashable keys: its constexprs, warps and stages,
    and the specialisation of the integer arguments that vary with the call (T and the visibility strides, which
    follow T; the split count is ``do_not_specialize``: see the kernel). The other integer arguments are the
    model's strides and head counts, fixed per engine; pointers and dtypes are fixed per engine too."""
    words = -(-tokens // 64)
    split = ("split", launch.block_m, launch.block_n, min(launch.block_n, 64), launch.splits == 1, has_first,
             launch.num_warps, launch.num_stages, head_dim, _int_class(tokens), _int_class(tokens * words),
             _int_class(words))
    if launch.splits == 1:
        return (split,)
    return split, ("combine", launch.combine_splits, launch.combine_block_m, launch.combine_block_d, head_dim,
                   _int_class(tokens))


def _launcher(kernel, grid: tuple[int, int, int], compile_only: bool):
    """``kernel[grid]``, or its binding and compilation without a launch (``JITFunction.warmup``)."""
    return functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]


def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, start: Tensor, new_vis: Tensor,
                   kv_len: int, *, first: Tensor | None = None, packed: PackedVisibility | None = None,
                   block_n: int | None = None, splits: int | None = None, block_m: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None, combine_unroll: int | None = None,
                   combine_block_m: int | None = None, combine_block_d: int | None = None,
                   compile_only: bool = False) -> Tensor:
    """Attention of the new tokens over their rows' cache slots under the tree visibility rule (module docstring).

    q [R, H, T, D] (fp32/fp16/bf16, D in 64/128/256); k_cache, v_cache [slots, KV, max_len, D] (one layer of the
    :class:`~ddtree.models.kv_cache.KVCache`, new tokens already written at ``start + t``); slots [R] long;
    start [R] long; new_vis [R, T, T] bool; kv_len: host int >= max(start) + T (not checked: that would sync);
    first [R] long (optional, each <= its start): prefix keys below it are hidden too (a DFlash draft window);
    packed: ``pack_visibility(new_vis)`` if the caller already has it (a forward packs once for all layers).
    Softmax in fp32 with scale 1/sqrt(D). Returns [R, H, T, D] in q's dtype (a transposed view of
    [R, T, H, D] memory).

    ``block_n`` (prefix keys per tile), ``splits`` (prefix splits per row; with more than one the new tokens'
    keys get a program of their own), ``block_m`` (folded query rows per program, a power of two >= 16),
    ``num_warps`` and ``num_stages`` override :func:`choose_tiles`; tests use them to exercise the combine with
    tiny contexts, ``benchmarks/tree_attention.py`` to tune them on a GPU; ``combine_unroll`` (>= splits + 1)
    overrides the combine's unrolled slots (``benchmarks/first_request.py --combine-check`` times the exact count
    against the bucketed one); ``combine_block_m`` and ``combine_block_d`` the combine's rows and head-dim columns per
    program (``ddtree.tuning.choose_combine_tile`` unless set there or here).
    ``compile_only``: bind (and compile, unless
    a Triton hook intercepts it: :mod:`ddtree.engine.precompile`) both kernels' variants for these inputs without
    launching them; the result is then uninitialised."""
    _check_inputs(q, k_cache, v_cache, slots, start, new_vis, kv_len)
    if triton is None:
        raise ConfigError("tree_attention needs Triton; install it or use the dense masked path")
    r, h, t, d = q.shape
    kv = k_cache.shape[1]
    g = h // kv
    launch = plan_launch(r, h, kv, t, d, kv_len, max(q.element_size(), k_cache.element_size()), sm_count(q.device),
                         block_n=block_n, splits=splits, block_m=block_m, num_warps=num_warps,
                         num_stages=num_stages, combine_block_m=combine_block_m, combine_block_d=combine_block_d)
    block_m, block_n, num_warps, num_stages, splits, row_tiles = launch[:6]
    if q.stride(-1) != 1:
        q = q.contiguous()
    # The kernel reads slots[r], start[r], first[r] at unit stride; views of a packed buffer need a copy (no-ops for
    # the engine's own inputs, which are contiguous rows).
    slots, start = slots.contiguous(), start.contiguous()
    if first is not None:
        if first.shape != (r,):
            raise ShapeError(f"tree_attention: first must be [{r}], got {tuple(first.shape)}")
        first = first.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ShapeError("tree_attention: the KV cache must have unit stride over head_dim")
    if packed is None:
        packed = pack_visibility(new_vis)
    bits, last = packed.bits.contiguous(), packed.last.contiguous()
    if bits.shape != (r, t, -(-t // 64)) or last.shape != (r, t):
        raise ShapeError(f"tree_attention: packed visibility {tuple(bits.shape)}/{tuple(last.shape)} does not "
                         f"fit new_vis {tuple(new_vis.shape)}; use pack_visibility(new_vis)")
    # [R, H, T, D] as a view of [R, T, H, D] memory: the layers' ``out.transpose(1, 2).flatten(-2)`` for o_proj
    # is then free instead of a copy kernel per layer (0.1 ms of a 17-node verify on the H200).
    out = torch.empty((r, t, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    rows_padded = row_tiles * block_m
    direct = splits == 1
    if direct:  # the partial buffers are never touched; pass out as a typed placeholder
        part_m = part_l = part_acc = out
    else:
        part_m = torch.empty((r * kv, splits + 1, rows_padded), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((r * kv, splits + 1, rows_padded, d), dtype=torch.float32, device=q.device)
    scale_log2 = d**-0.5 * math.log2(math.e)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays exact; halves ignore the setting
    _launcher(_tree_attention_split_kernel, (row_tiles, 1 if direct else splits + 1, r * kv), compile_only)(
        q, k_cache, v_cache, slots, start, start if first is None else first, bits, last, out, part_m, part_l,
        part_acc,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        bits.stride(0), bits.stride(1), last.stride(0),
        t, g, kv, splits, rows_padded, scale_log2,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, TREE_BN=min(block_n, 64), DIRECT=direct, DOT_PRECISION=precision,
        DOT_UPCAST=INTERPRETED and q.dtype == torch.bfloat16, HAS_FIRST=first is not None,
        enable_fp_fusion=FP_FUSION, num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        if combine_unroll is not None and combine_unroll < splits + 1:
            raise ConfigError(f"tree_attention: combine_unroll must be >= splits + 1 = {splits + 1}, got "
                              f"{combine_unroll}")
        block_d, combine_m = launch.combine_block_d, launch.combine_block_m
        _launcher(_tree_attention_combine_kernel, (rows_padded // combine_m, r * kv, d // block_d), compile_only)(
            out, part_m, part_l, part_acc, out.stride(0), out.stride(1), out.stride(2),
            t, g, kv, rows_padded, splits + 1, UNROLL=combine_unroll or launch.combine_splits, HEAD_DIM=d, BLOCK_D=block_d,
            BLOCK_M=combine_m, enable_fp_fusion=FP_FUSION, num_warps=tuning.COMBINE_WARPS,
        )
    return out
