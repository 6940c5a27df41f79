"""Tree attention over the static KV cache as one Triton kernel (flash-decoding style, split over the context).

The dense path (:func:`ddtree.models.target.attend_over_cache`) gathers every batch row's K/V out of the cache,
expands a boolean ``[R, T, kv_len]`` mask and runs several kernels per layer. This kernel reads K/V straight from
the cache by slot and derives visibility from two small tensors instead:

Terms
-----
R        request rows in the batch; row r's K/V lives in cache slot ``slots[r]``.
T        new tokens per row (tree nodes, a chain block, a prompt chunk); new token t of row r was written at
         cache index ``start[r] + t`` before attention (the runner's ``tree_write_positions`` / prefill layout).
new_vis  [R, T, T] bool: new token t sees new token t' (a tree's ancestor visibility, or causal for chunks).
G        query heads per KV head (grouped-query attention); query head h reads KV head ``h // G``.

Visibility rule (identical to :func:`ddtree.spec.build_attention_mask` with ``prefix_len = start`` and
``write_pos = start + arange(T)``): key p is visible to query t of row r iff ``p < start[r]`` (the committed
prefix), or ``p = start[r] + t'`` with ``new_vis[r, t, t']`` or ``t' == t`` (every query sees its own slot, so
padding queries never have an empty softmax). Keys at or past ``start[r] + T`` are never visible.

Example: start = 5, T = 4, a tree root(0) -> a(1), root -> b(2), a -> c(3); query c sees keys 0..4 (prefix),
5 (root), 6 (a) and 8 (itself), exactly the dense mask row ``1 1 1 1 1 1 1 0 1``.

Kernel layout
-------------
The G query heads sharing a KV head are folded into the query-row axis (``rows = G * T``; folded row m is head
``kv * G + m // T``, token ``m % T``), so each K/V tile loaded from the cache serves all of them. Programs form a
grid ``row_tiles x splits x (R * KV)``: a program takes BLOCK_M folded rows and one contiguous share of row r's
key blocks ``[0, start[r] + T)``; the share is computed on the device from ``start[r]``, so short rows never visit
key blocks they cannot see and every split of a row gets an equal share. Blocks wholly inside the committed prefix
run without a mask; only the blocks that hold new tokens gather ``new_vis``. With one split the program normalises
and writes the output itself; otherwise it writes fp32 partials (running max, sum, unnormalised output) and a
small combine kernel merges the splits. Every size (grid, splits, scratch) comes from host ints (R, T, kv_len), so
calls are CUDA-graph capturable.

When it runs: :meth:`ddtree.models.target.TargetModel.forward` given ``attn_mask=None`` and ``tree=`` calls it
when the target :meth:`~ddtree.models.target.TargetModel.supports_tree_attention` (:func:`ddtree.triton_runtime.can_run`
on its weights and a head dim in ``SUPPORTED_HEAD_DIMS``); passing a mask is how a caller picks the dense path.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ddtree.errors import ConfigError
from ddtree.triton_runtime import INTERPRETED, tl, triton

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BLOCK_N = (16, 32, 64, 128)
_FALLBACK_SM_COUNT = 132  # H100/H200; only used to size splits when the device cannot be asked (interpreter)
_WAVES = 2  # aim for this many programs per SM when splitting the context
# ...but give every split at least this many key blocks and make at most MAX_SPLITS: a split of one block costs a
# program launch and a partial's round trip for ~1 us of work, and the combine unrolls over the splits. Measured on
# the H200 at one decode token, 1k context: 16 one-block splits spent 0.70 ms per step in attention over 36 layers.
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 16


class TreeVisibility(NamedTuple):
    """What the kernel needs instead of a dense mask (a NamedTuple so graphs and compile accept it).

    The new tokens must have been written at ``start + arange(T)`` (tree rounds and prefill chunks are)."""

    start: Tensor  # [R] long, committed cache length of each row = cache index of its new token 0
    new_vis: Tensor  # [R, T, T] bool, new token t sees new token t'
    kv_len: int  # static bound >= max(start) + T; sizes the context split (host int, no sync)


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
    def _attend_blocks(acc, m_i, l_i, q, k_base, v_base, vis_base, stride_kp, stride_vp, stride_vist,
                       block_lo, block_hi, first, start, end, t_idx, row_ok, offs_n, offs_d, scale_log2,
                       MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                       BLOCK_N: tl.constexpr):
        """Online-softmax accumulation over key blocks [block_lo, block_hi) of one row tile.

        acc [BLOCK_M, D] fp32, m_i/l_i [BLOCK_M] fp32 (running max in log2 units, running sum), q [BLOCK_M, D].
        MASKED=False only for blocks wholly inside the visible prefix [first, start) (every key visible to every
        row); masked blocks also hide keys below ``first``."""
        for block in range(block_lo, block_hi):
            p_idx = block * BLOCK_N + offs_n  # [BLOCK_N] cache indices
            if MASKED:
                key_ok = p_idx < end
                k = tl.load(k_base + p_idx[:, None] * stride_kp + offs_d[None, :], mask=key_ok[:, None], other=0.0)
                v = tl.load(v_base + p_idx[:, None] * stride_vp + offs_d[None, :], mask=key_ok[:, None], other=0.0)
            else:
                k = tl.load(k_base + p_idx[:, None] * stride_kp + offs_d[None, :])
                v = tl.load(v_base + p_idx[:, None] * stride_vp + offs_d[None, :])
            qk = _dot(q, tl.trans(k.to(q.dtype)), DOT_UPCAST, DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
            if MASKED:
                j = p_idx - start  # index among the new tokens
                is_new = (j >= 0) & key_ok
                vis_ok = row_ok[:, None] & is_new[None, :]
                seen = tl.load(vis_base + t_idx[:, None] * stride_vist + j[None, :], mask=vis_ok, other=0)
                visible = ((p_idx < start) & (p_idx >= first))[None, :] | (
                    is_new[None, :] & ((seen != 0) | (j[None, :] == t_idx[:, None])))
                qk = tl.where(visible & row_ok[:, None], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at zero
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(qk - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), DOT_UPCAST, DOT_PRECISION)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _tree_attention_split_kernel(
        q_ptr, k_ptr, v_ptr, slots_ptr, start_ptr, first_ptr, vis_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
        stride_qr, stride_qh, stride_qt,  # q [R, H, T, D], unit stride over D
        stride_ks, stride_kh, stride_kp,  # k cache [slots, KV, max_len, D], unit stride over D
        stride_vs, stride_vh, stride_vp,  # v cache
        stride_or, stride_oh, stride_ot,  # out [R, H, T, D]
        stride_visr, stride_vist,  # new_vis [R, T, T] as uint8, unit stride over t'
        T, G, num_kv, num_splits, rows_padded, scale_log2,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, HAS_FIRST: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_s = tl.program_id(1)
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
        end = start + T  # keys [0, end) may be visible
        k_base = k_ptr + slot * stride_ks + kv * stride_kh
        v_base = v_ptr + slot * stride_vs + kv * stride_vh
        vis_base = vis_ptr + r * stride_visr

        # Keys below `first` are hidden (a drafter's window); blocks wholly below it are never visited.
        if HAS_FIRST:
            first = tl.load(first_ptr + r)
        else:
            first = 0
        # This split's share of the row's key blocks [first_block, n_blocks); blocks [clean_lo, full_blocks) lie
        # wholly inside the visible prefix [first, start) and run unmasked.
        first_block = first // BLOCK_N
        n_blocks = tl.cdiv(end, BLOCK_N)
        per_split = tl.cdiv(n_blocks - first_block, num_splits)
        lo = first_block + pid_s * per_split
        hi = tl.minimum(lo + per_split, n_blocks)
        full_blocks = start // BLOCK_N
        clean_lo = tl.minimum(tl.cdiv(first, BLOCK_N), full_blocks)

        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_FIRST:  # the block holding `first` (partly hidden), if it is not also a block of new tokens
            acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, k_base, v_base, vis_base, stride_kp, stride_vp,
                                           stride_vist, lo, tl.minimum(hi, clean_lo), first, start, end, t_idx,
                                           row_ok, offs_n, offs_d, scale_log2, True, DOT_PRECISION, DOT_UPCAST,
                                           BLOCK_N)
        acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, k_base, v_base, vis_base, stride_kp, stride_vp,
                                       stride_vist, tl.maximum(lo, clean_lo), tl.minimum(hi, full_blocks), first,
                                       start, end, t_idx, row_ok, offs_n, offs_d, scale_log2, False, DOT_PRECISION,
                                       DOT_UPCAST, BLOCK_N)
        acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, k_base, v_base, vis_base, stride_kp, stride_vp,
                                       stride_vist, tl.maximum(lo, full_blocks), hi, first, start, end, t_idx,
                                       row_ok, offs_n, offs_d, scale_log2, True, DOT_PRECISION, DOT_UPCAST, BLOCK_N)

        if DIRECT:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            out_ptrs = (out_ptr + r * stride_or + head[:, None] * stride_oh + t_idx[:, None] * stride_ot
                        + offs_d[None, :])
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            part = (pid_rk * num_splits + pid_s) * rows_padded + rows  # [BLOCK_M] into [R*KV, splits, rows_padded]
            tl.store(part_m_ptr + part, m_i)
            tl.store(part_l_ptr + part, l_i)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc)

    @triton.jit
    def _tree_attention_combine_kernel(
        out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, stride_or, stride_oh, stride_ot,
        T, G, num_kv, rows_padded,
        SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        """Merge the splits' partials: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.

        Program (row tile, row x KV head, head-dim block). The split loop is unrolled (SPLITS is a compile-time
        constant) so the partials' loads are all in flight at once: a rolled loop waited for each split's load in
        turn, ~13 us for 16 splits at one decode token (benchmarks/profile_step.py on the H200)."""
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
        base = pid_rk * SPLITS * rows_padded + rows

        m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            m_max = tl.maximum(m_max, tl.load(part_m_ptr + base + s * rows_padded))
        m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            part = base + s * rows_padded
            w = tl.exp2(tl.load(part_m_ptr + part) - m_use)  # empty splits (m = -inf) weigh 0
            l_sum += w * tl.load(part_l_ptr + part)
            acc += w[:, None] * tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :])
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
        raise ConfigError(f"write_kv: k/v {tuple(k.shape)}/{tuple(v.shape)} and caches {tuple(k_cache.shape)}/"
                          f"{tuple(v_cache.shape)} must match")
    if k_cache.shape[1] != kv or k_cache.shape[3] != d or write_pos.shape != (r, t) or slots.shape != (r,):
        raise ConfigError(f"write_kv: k {tuple(k.shape)} does not fit cache {tuple(k_cache.shape)}, write_pos "
                          f"{tuple(write_pos.shape)}, slots {tuple(slots.shape)}")
    if not supports_head_dim(d):
        raise ConfigError(f"write_kv supports head_dim in {SUPPORTED_HEAD_DIMS}, got {d}; use KVCache.write")
    if r == 0 or t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride(-1) != 1 or write_pos.stride(-1) != 1:
        raise ConfigError("write_kv: the caches and write_pos need unit stride over their last dim")
    _write_kv_kernel[(r * t, kv)](
        k, v, k_cache, v_cache, slots, write_pos,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), write_pos.stride(0), t,
        HEAD_DIM=d, num_warps=1,
    )


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached: a host query, harmless during graph capture)."""
    if device.type != "cuda":
        return _FALLBACK_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def choose_splits(row_programs: int, kv_len: int, block_n: int, sm_count: int) -> int:
    """Context splits per (row, KV head, row tile) so that about ``_WAVES * sm_count`` programs run, with at least
    ``MIN_BLOCKS_PER_SPLIT`` of ``kv_len``'s key blocks per split and at most ``MAX_SPLITS``. Host ints only: the same
    shapes always launch the same grid."""
    blocks = max(1, math.ceil(kv_len / block_n))
    wanted = max(1, math.ceil(_WAVES * sm_count / row_programs))
    return max(1, min(wanted, blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))


def _check_inputs(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, start: Tensor, new_vis: Tensor,
                  kv_len: int) -> None:
    if q.dim() != 4:
        raise ConfigError(f"tree_attention: q must be [R, H, T, D], got shape {tuple(q.shape)}")
    r, h, t, d = q.shape
    if not supports_head_dim(d):
        raise ConfigError(f"tree_attention supports head_dim in {SUPPORTED_HEAD_DIMS}, got {d}; "
                          "use the dense masked path for this model")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigError(f"tree_attention: q dtype must be float32, float16 or bfloat16, got {q.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[-1] != d:
        raise ConfigError(f"tree_attention: k/v cache must both be [slots, KV, max_len, {d}], got "
                          f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    kv = k_cache.shape[1]
    if h % kv != 0:
        raise ConfigError(f"tree_attention: {h} query heads are not a multiple of {kv} KV heads")
    if slots.shape != (r,) or start.shape != (r,):
        raise ConfigError(f"tree_attention: slots and start must be [{r}], got {tuple(slots.shape)} and "
                          f"{tuple(start.shape)}")
    if new_vis.shape != (r, t, t):
        raise ConfigError(f"tree_attention: new_vis must be [{r}, {t}, {t}], got {tuple(new_vis.shape)}")
    if not t <= kv_len <= k_cache.shape[2]:
        raise ConfigError(f"tree_attention: kv_len={kv_len} must lie in [T={t}, cache max_len={k_cache.shape[2]}]")


def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, start: Tensor, new_vis: Tensor,
                   kv_len: int, *, first: Tensor | None = None, block_n: int | None = None, splits: int | None = None,
                   block_m: int | None = None, num_warps: int = 4, num_stages: int = 2) -> Tensor:
    """Attention of the new tokens over their rows' cache slots under the tree visibility rule (module docstring).

    q [R, H, T, D] (fp32/fp16/bf16, D in 64/128/256); k_cache, v_cache [slots, KV, max_len, D] (one layer of the
    :class:`~ddtree.models.kv_cache.KVCache`, new tokens already written at ``start + t``); slots [R] long;
    start [R] long; new_vis [R, T, T] bool; kv_len: host int >= max(start) + T (not checked: that would sync);
    first [R] long (optional, each <= its start): prefix keys below it are hidden too (a DFlash draft window).
    Softmax in fp32 with scale 1/sqrt(D). Returns [R, H, T, D] in q's dtype.

    ``block_n`` (keys per tile), ``splits`` (context splits per row), ``block_m`` (folded query rows per program,
    a power of two >= 16) override the automatic choice; tests use them to exercise the combine with tiny contexts,
    ``benchmarks/tree_attention.py`` to tune them with ``num_warps`` and ``num_stages`` on a GPU."""
    _check_inputs(q, k_cache, v_cache, slots, start, new_vis, kv_len)
    if triton is None:
        raise ConfigError("tree_attention needs Triton; install it or use the dense masked path")
    r, h, t, d = q.shape
    kv = k_cache.shape[1]
    g = h // kv
    rows = g * t
    if block_n is None:
        block_n = 64 if d <= 128 else 32
    if block_n not in SUPPORTED_BLOCK_N:
        raise ConfigError(f"tree_attention: block_n must be one of {SUPPORTED_BLOCK_N}, got {block_n}")
    if block_m is None:
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
    if block_m < 16 or block_m & (block_m - 1):
        raise ConfigError(f"tree_attention: block_m must be a power of two >= 16, got {block_m}")
    row_tiles = math.ceil(rows / block_m)
    if splits is None:
        splits = choose_splits(r * kv * row_tiles, kv_len, block_n, _sm_count(q.device))
    if not 1 <= splits <= MAX_SPLITS:
        raise ConfigError(f"tree_attention: splits must be in [1, {MAX_SPLITS}], got {splits}")

    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ConfigError("tree_attention: the KV cache must have unit stride over head_dim")
    vis = new_vis.contiguous().view(torch.uint8)
    out = torch.empty((r, h, t, d), dtype=q.dtype, device=q.device)
    rows_padded = row_tiles * block_m
    direct = splits == 1
    if direct:  # the partial buffers are never touched; pass out as a typed placeholder
        part_m = part_l = part_acc = out
    else:
        part_m = torch.empty((r * kv, splits, rows_padded), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((r * kv, splits, rows_padded, d), dtype=torch.float32, device=q.device)
    scale_log2 = d**-0.5 * math.log2(math.e)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays exact; halves ignore the setting
    if first is not None and first.shape != (r,):
        raise ConfigError(f"tree_attention: first must be [{r}], got {tuple(first.shape)}")
    _tree_attention_split_kernel[(row_tiles, splits, r * kv)](
        q, k_cache, v_cache, slots, start, start if first is None else first, vis, out, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        vis.stride(0), vis.stride(1),
        t, g, kv, splits, rows_padded, scale_log2,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, DIRECT=direct, DOT_PRECISION=precision,
        DOT_UPCAST=INTERPRETED and q.dtype == torch.bfloat16, HAS_FIRST=first is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        block_d = min(d, 64)
        _tree_attention_combine_kernel[(row_tiles, r * kv, d // block_d)](
            out, part_m, part_l, part_acc, out.stride(0), out.stride(1), out.stride(2),
            t, g, kv, rows_padded, SPLITS=splits, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=4,
        )
    return out
