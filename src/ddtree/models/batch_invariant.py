"""Batch-invariant kernels for exact mode: a matmul and an attention whose result for one token row does not depend
on how many rows ride along, where the row sits in the batch, the tree around it or the key-length bucket.

Why: cuBLAS picks its kernel (and split-K) by row count and the tree-attention kernel picks its tiles and context
splits by rows and ``kv_len``, so the same token gets logits 1-2 ulps apart in AR decoding, a chain, a tree or a
batch of 64, and bf16 near-ties flip (docs/benchmarks.md, "Divergence"; ``../shared/docs/gpu-facts.md``). Here every
reduction has one fixed order per output element (docs/architecture.md, "Exact mode"):

Matmul (:func:`linear`, x [M, K] @ w [N, K]^T)
    BLOCK_K and a split count S per weight shape (:func:`matmul_tiles`, from (N, K) only, never from M) fix each
    output element's order: S equal K segments, each summed from zero in ascending K order, the segments added in
    ascending order, the bias last. How the programs are laid out may follow M (:func:`matmul_launch`): split
    programs writing fp32 partials that a second kernel adds in order, or fused programs that walk the segments
    themselves (same bits, as 0 + s == s), in row and column tiles of any size (a tensor-core dot's row depends on
    that row and the K step only; the H200 run compared every launch), with tiles loaded through pointers or,
    on Hopper, through tensor descriptors (the same loads, :data:`MATMUL_LAUNCHES`). M is not specialised on
    (``do_not_specialize``): a row's result depends on its own inputs and the weight only.

Attention (:func:`attention`, new tokens over a KV-cache slot)
    Keys are walked in *position* order, in tiles of ``ATTN_BLOCK_N`` positions at fixed multiples of it, and split at
    fixed multiples of ``ATTN_SPLIT_KEYS`` positions; a query at position p combines splits 0 .. p // ATTN_SPLIT_KEYS
    in ascending order. Key position j of query t is cache index j below ``start`` (the committed prefix) and
    ``start + anc[t, j - start]`` above it (the node's ancestor at depth ``j - start``: in a tree the ancestors are not
    contiguous in the cache, :func:`ancestor_map`). A program's rows (32 or 64, :func:`attention_block_m`) = queries
    x the G query heads of one KV head. Where its queries share their keys (prefix tiles; every tile of a chain or a
    prompt chunk) one K/V tile serves them all; in a tree's tiles above that each chunk of queries on one path reads
    its deepest member's tile, which holds every member's keys (:func:`tail_chunks`; a tensor-core dot's row depends
    only on that row and the tile, whatever the dot's row count, and keys past a member's position are masked).
    Masked keys are exact no-ops (p = exp2(-inf) = 0; the running max is guarded against -inf - -inf). The splits'
    states are merged in ascending order into a running max and rescaled sums with explicit fma
    (:func:`_merge_weights`), either by a combine kernel over stored fp32 partials (the split launch: a program per
    split, :func:`_split_state`, and a tree's splits from ``start`` up a program per chunk, :func:`_chunk_splits`)
    or, where the grid fills the device without splits (:func:`attention_fused`), by each program itself in one loop
    over its tiles, a tree's tail tiles one chunk at a time (the fused launch, :func:`_fused_program`); a chunk's
    tiles run on 16-row dots (G rows where G > 16) in both: the same arithmetic, so the same bits.

Example: a tree root(0) -> a(1), root -> b(2), a -> c(3) at start 5, written at cache indices 5..8 with positions
5, 6, 6, 7. Query c (position 7) walks positions 0..7 and reads cache indices 0 1 2 3 4 5 6 8: exactly the keys AR
decoding of the same tokens reads at positions 0..7 (cache 0..7), in the same tiles and splits.

Each kernel has a torch path for devices Triton cannot run on (:func:`linear_rows`, :func:`attention_rows`): one
token row at a time, so every call has the shapes of a single row and is invariant by construction (slow; the CPU
tests and CPU exact mode use it). On CUDA exact mode needs Triton.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ddtree.errors import ConfigError, ShapeError
from ddtree.triton_runtime import FP_FUSION, INTERPRETED, TensorDescriptor, tl, triton

# ---- constants (changing one changes exact mode's bits, never its invariance) --------------------------------------
MATMUL_MAX_BLOCK_N = 128
MATMUL_MAX_BLOCK_K = 64
# Split-K is chosen from the weight's shape so that about this many programs stream a weight at one tile of rows
# (decoding is bandwidth-bound: o_proj's 32 column tiles alone would leave most of an H200's 132 SMs idle).
MATMUL_TARGET_PROGRAMS = 160
MATMUL_MAX_SPLIT_K = 4  # 8 measured no faster at decode and slower on wide calls (H200)
MATMUL_MIN_K_BLOCKS_PER_SPLIT = 4
ATTN_BLOCK_M = 32  # folded rows (queries x query heads of one KV head) per attention program (64: attention_block_m)
# folded rows per program for trees of more than ATTN_LARGE_MIN_FOLDED folded rows whose grid then still launches
# fused (attention_block_m): a launch choice. The tail is gathered per chunk of queries, so wider programs read the
# shared prefix fewer times: a served 64-node tree at C = 8 102 against 135 us; at C = 1 (split launch) 50 against
# 36, and 128-row programs slower everywhere (H200, docs/benchmarks.md, "Exact mode", tenth run). From 64 folded
# rows up (a tree of 17-32 nodes at G = 4) since 2026-12-06: a served 17-node tree at C = 64 279 against 322 us in
# 32-row programs, 32 nodes 345 against 463, while at C = 8 (no fused 64-row grid) 32 rows stay (H200 and H100,
# docs/benchmarks.md, "Exact mode").
ATTN_LARGE_BLOCK_M = 64
ATTN_LARGE_MIN_FOLDED = 64
# Wide programs, off (ATTN_WIDE_MAX_PER_TILE 0): one program for a whole tree of 17-32 nodes at G = 4 (65-128 folded
# rows) where a call has ATTN_WIDE_MIN_PER_TILE to ATTN_WIDE_MAX_PER_TILE programs per query tile (rows x KV heads),
# run with ATTN_WIDE_WARPS warps (4 lost everywhere: the tenth run) and fused when ATTN_WIDE_FUSED. Why they stay
# off (H100, docs/benchmarks.md "Exact mode", calls E and G of 2026-12-06): a served 17-node tree's 68 rows fill 53 %
# of the program; at C = 16 it is faster fused (86 us against 93-95 in 64-row programs), at C = 8 slower (74 fused,
# 67 split, against 55), and DDTree 16 at C = 8 in the engine took 9-11 % longer exact rounds with them; C = 16 was not
# priced. Launch choices (the test compares their bits), kept for the tune and the price script.
ATTN_WIDE_BLOCK_M = 128
ATTN_WIDE_WARPS = 8
ATTN_WIDE_MIN_PER_TILE = 64
ATTN_WIDE_MAX_PER_TILE = 0
ATTN_WIDE_FUSED = True
# Small last tiles: where a call's queries fill several programs and the last holds at most ATTN_SMALL_TAIL_ROWS
# folded rows (DDTree 16's 17th node at G = 4: 4 rows in a 64- or 32-row program), that program runs as one of
# ATTN_SMALL_TAIL_ROWS rows (attention_small_tail): the same rows, without the padding rows' dots. 0: off. A launch
# choice (the tests compare its bits). A served 17-node tree with rows at different lengths (H100, docs/benchmarks.md
# "Exact mode", 2026-12-06 call K): C = 64 293 against 317 us, C = 8 71 against 73, C = 16 92 against 94, C = 1 the
# same; DDTree 16's exact verify stage in the engine did not move beyond its spread (call J).
ATTN_SMALL_TAIL_ROWS = 16
ATTN_SUM_COLS = 16  # columns of the ones matrix the tile's row sums are a dot with (a tensor-core dot's least N)
ATTN_BLOCK_N = 64  # key positions per tile
ATTN_SPLIT_KEYS = 256  # key positions per split (a multiple of ATTN_BLOCK_N); 512 served slower (benchmarks.md)
ATTN_FUSED_MIN_PROGRAMS = 256  # grids this large launch fused (attention_fused): about two per SM of an H200
# The attention kernel's launch (warps, software-pipeline stages): the same for every call, so never a source of a
# row's difference between calls; benchmarks/exact_attention_tune.py --sweep times the alternatives on the H200.
ATTN_NUM_WARPS = 4
ATTN_NUM_STAGES = 2
ATTN_FUSED_ONE_TOKEN_STAGES = 3  # attention_stages
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


class MatmulTiles(NamedTuple):
    """What fixes a weight's bits: BLOCK_K and the split count (the K segments, each summed from zero in
    ascending K order, the segments added in ascending order, the bias last). A function of (N, K) only."""

    block_k: int
    split_k: int  # K blocks divided into this many equal segments per output element


class MatmulLaunch(NamedTuple):
    """How one call runs (free to depend on the row count M: it does not change a bit, see :func:`linear`).

    ``fused``: one program per output tile walks all K segments itself (no partials in memory); else one program
    per (tile, segment) writes an fp32 partial and a second kernel sums them in ascending order (more programs for
    the few row tiles of a decode step). ``flat`` (fused only): the segments run as one pipelined K loop that adds
    its accumulator into the total at each segment's end (the same sums: a loop per segment drains and refills the
    software pipeline S times per tile). ``tma``: the tiles load through Hopper's tensor memory accelerator (host
    tensor descriptors) instead of masked pointer loads, the same dots in the same order; a fused launch then always
    runs the flat loop. A call whose tensors a descriptor cannot address (a base or row stride not a multiple of 16
    bytes) runs the pointer table's launch for its rows instead (:func:`linear`)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    fused: bool
    flat: bool = False
    tma: bool = False


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, n - 1).bit_length())


def matmul_tiles(n: int, k: int) -> MatmulTiles:
    """The bit-fixing part of a weight [n, k]'s configuration (of the weight's shape only, never of the rows)."""
    block_n = min(MATMUL_MAX_BLOCK_N, _pow2_at_least(n, 16))
    block_k = min(MATMUL_MAX_BLOCK_K, _pow2_at_least(k, 16))
    n_tiles = -(-n // block_n)
    k_blocks = -(-k // block_k)
    split = 1
    while (n_tiles * split < MATMUL_TARGET_PROGRAMS and split * 2 <= MATMUL_MAX_SPLIT_K
           and k_blocks % (split * 2) == 0 and k_blocks // (split * 2) >= MATMUL_MIN_K_BLOCKS_PER_SPLIT):
        split *= 2
    return MatmulTiles(block_k, split)


# The launch tables by row count, from benchmarks/exact_matmul_tune.py on the H200 (CUDA-graph replays). Every
# launch gives the same bits (the run's check and tests/models/test_batch_invariant.py); only BLOCK_K and the split
# count (matmul_tiles) fix them. Pointer loads (any GPU): split programs with small row tiles where few row tiles
# would leave SMs idle (decode, small verifies), 128 x 128 fused tiles with 8 warps in one K loop (MatmulLaunch.flat)
# where the call is compute-bound (2026-12-01/02).
MATMUL_POINTER_LAUNCHES: tuple[tuple[int, MatmulLaunch], ...] = (  # (up to this many rows, launch)
    (16, MatmulLaunch(16, 64, 4, 4, fused=False)),
    (128, MatmulLaunch(64, 64, 4, 4, fused=False)),
    (767, MatmulLaunch(64, 128, 4, 3, fused=False)),
)
MATMUL_POINTER_WIDE_LAUNCH = MatmulLaunch(128, 128, 8, 4, fused=True, flat=True)
# Tensor-descriptor loads (Hopper's TMA, where Triton has them): split programs of 64 x 128 tiles from 17 rows, the
# flat launch from 193 rows (64 x 128 tiles up to 256 rows, 128 x 128 with 8 warps up to 512, 128 x 256 with 8 warps
# past it). us per call at 128 / 320 / 512 / 1024 rows, H200 (docs/benchmarks.md, "Exact mode", tenth run): o_proj
# 17 / 28 / 30 / 50 and down 37 / 77 / 84 / 137, against the pointer table's 23 / 35 / 54 / 78 and 53 / 95 / 140 /
# 216, cuBLAS 14 / 19 / 25 / 45 and 35 / 48 / 70 / 130. The edges are whole waves of 132 SMs at N = 4096: a 128 x 128
# launch fills them once up to 512 rows, 64 x 128 up to 256; past those they ran a second wave (down at 544 rows:
# 159 us in 64 x 128 tiles against 128 in 128 x 256, at 512 82 in 128 x 128 against 92; H100, 2026-12-06, call A of
# "prefill price"). Weights of one K segment (an LM head of a large vocabulary) keep the pointer table: the
# descriptor launches were timed on 4-segment weights only.
MATMUL_LAUNCHES: tuple[tuple[int, MatmulLaunch], ...] = (
    MATMUL_POINTER_LAUNCHES[0],
    (128, MatmulLaunch(64, 128, 4, 4, fused=False, tma=True)),
    (192, MatmulLaunch(64, 128, 4, 3, fused=False, tma=True)),
    (256, MatmulLaunch(64, 128, 4, 4, fused=True, flat=True, tma=True)),
    (512, MatmulLaunch(128, 128, 8, 4, fused=True, flat=True, tma=True)),
)
MATMUL_WIDE_LAUNCH = MatmulLaunch(128, 256, 8, 3, fused=True, flat=True, tma=True)


def matmul_launch(n: int, k: int, m: int, tma: bool = True) -> MatmulLaunch:
    """The launch of x [m, k] @ w [n, k]^T for m rows (:data:`MATMUL_LAUNCHES`; without tensor descriptors, or
    for a weight of one K segment, :data:`MATMUL_POINTER_LAUNCHES`). Any choice here gives the same bits."""
    one_segment = matmul_tiles(n, k).split_k == 1
    table, wide = ((MATMUL_LAUNCHES, MATMUL_WIDE_LAUNCH) if tma and not one_segment
                   else (MATMUL_POINTER_LAUNCHES, MATMUL_POINTER_WIDE_LAUNCH))
    for rows, launch in table:
        if m <= rows:
            if one_segment and launch.block_m < 64:  # no SMs to fill with splits: full tiles
                return table[1][1]
            return launch
    return wide


def tma_loads(x: Tensor) -> bool:
    """Whether calls on x may load through tensor descriptors: Triton has them, and the device is a Hopper or later
    NVIDIA GPU (compute capability 9+; not ROCm) with 16-bit x (what the H200 runs measured; fp32 keeps the pointer table), or
    Triton's interpreter runs (the CPU tests, any dtype)."""
    if TensorDescriptor is None:
        return False
    if x.device.type != "cuda":
        return INTERPRETED
    return (torch.version.hip is None and x.element_size() == 2
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


if triton is not None:

    @triton.jit
    def _dot(a, b, acc, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """acc + a @ b in fp32. EMULATE (Triton's interpreter only): an fp32 broadcast product summed over K with
        ``tl.sum``, because the interpreter's ``tl.dot`` is numpy's BLAS matmul, whose result for a row changes with
        the row's place in the tile (and whose bf16 dot multiplies raw bit patterns). On a GPU the tensor-core dot
        runs; its rows are independent of each other for one instruction K-step (tile shapes do not enter: the
        GPU test compares them)."""
        if EMULATE:
            out = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        else:
            out = tl.dot(a, b, acc, input_precision=PRECISION)
        return out

    @triton.jit
    def _k_step(acc, x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, k0, BLOCK_K: tl.constexpr,
                EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """acc + x[rm, k0 : k0 + BLOCK_K] @ w[rn, k0 : k0 + BLOCK_K]^T (K past the end loads 0)."""
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        return _dot(x, tl.trans(w), acc, EMULATE, PRECISION)

    @triton.jit
    def _segment(x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, k_lo, k_hi, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """One K segment's fp32 sum from zero, its K blocks in ascending order: [BLOCK_M, BLOCK_N]."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            acc = _k_step(acc, x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, k0, BLOCK_K, EMULATE,
                          PRECISION)
        return acc

    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLITS: tl.constexpr, FUSED: tl.constexpr, FLAT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """FUSED (grid: row tiles x column tiles): total = ((seg_0 + seg_1) + ...) + seg_{S-1}, then the bias, and
        store. Otherwise (grid x SPLITS): seg_{pid} -> part[split, m, n] in fp32 (:func:`_split_sum_kernel` adds
        them in the same order), or with one split the bias and the store directly."""
        pid_m = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1).to(tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        if FUSED or SPLITS == 1:
            if FLAT and SPLITS > 1:
                # seg_s summed from zero in ascending K order, then total = seg_0 (not 0 + seg_0: -0 stays -0) and
                # total + seg_s at the end of each later segment: the bits of the loop per segment below
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                per_split = k_per_split // BLOCK_K
                for kb in range(0, SPLITS * per_split):
                    acc = _k_step(acc, x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, kb * BLOCK_K,
                                  BLOCK_K, EMULATE, PRECISION)
                    if (kb + 1) % per_split == 0:
                        total = tl.where(kb + 1 == per_split, acc, total + acc)
                        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            else:
                total = _segment(x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, 0,
                                 tl.minimum(k_per_split, K), BLOCK_M, BLOCK_N, BLOCK_K, EMULATE, PRECISION)
                for s in range(1, SPLITS):  # a loop, not unrolled: the inner K loop stays one pipelined loop
                    k_lo = s * k_per_split
                    total = total + _segment(x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, k_lo,
                                             tl.minimum(k_lo + k_per_split, K), BLOCK_M, BLOCK_N, BLOCK_K, EMULATE,
                                             PRECISION)
            if HAS_BIAS:
                total = total + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], total.to(out_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])
        else:
            pid_s = tl.program_id(2).to(tl.int64)
            k_lo = pid_s * k_per_split
            acc = _segment(x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, k_lo,
                           tl.minimum(k_lo + k_per_split, K), BLOCK_M, BLOCK_N, BLOCK_K, EMULATE, PRECISION)
            part = part_ptr + (pid_s * M + rm[:, None]) * N + rn[None, :]
            tl.store(part, acc, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _matmul_tma_kernel(x_desc, w_desc, out_desc, b_ptr, part_ptr, M, N, k_per_split, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, FUSED: tl.constexpr,
                           HAS_BIAS: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """:func:`_matmul_kernel`'s sums with its tiles loaded by tensor descriptors (rows and columns past the end
        load 0 and are not stored). FUSED (grid: row tiles x column tiles; the flat loop): seg_s from zero in
        ascending K order, total = seg_0, then total + seg_s at each later segment's end, the bias last. Otherwise
        (grid x SPLITS): seg_{pid} -> part[split, m, n] in fp32 for :func:`_split_sum_kernel`."""
        off_m = tl.program_id(0) * BLOCK_M
        off_n = tl.program_id(1) * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        per_split = k_per_split // BLOCK_K
        if FUSED:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kb in range(0, SPLITS * per_split):
                x = x_desc.load([off_m, kb * BLOCK_K])
                w = w_desc.load([off_n, kb * BLOCK_K])
                acc = _dot(x, tl.trans(w), acc, EMULATE, PRECISION)
                if (kb + 1) % per_split == 0:
                    total = tl.where(kb + 1 == per_split, acc, total + acc)
                    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if HAS_BIAS:
                rn = off_n + tl.arange(0, BLOCK_N)
                total = total + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            out_desc.store([off_m, off_n], total.to(out_desc.dtype))
        else:
            pid_s = tl.program_id(2)
            for kb in range(pid_s * per_split, (pid_s + 1) * per_split):
                x = x_desc.load([off_m, kb * BLOCK_K])
                w = w_desc.load([off_n, kb * BLOCK_K])
                acc = _dot(x, tl.trans(w), acc, EMULATE, PRECISION)
            rm = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
            rn = off_n + tl.arange(0, BLOCK_N)
            part = part_ptr + (pid_s * M + rm[:, None]) * N + rn[None, :]
            tl.store(part, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _split_sum_kernel(part_ptr, b_ptr, out_ptr, M, N, stride_om, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
        """out[m, n] = ((part[0] + part[1]) + ...) + bias, splits in ascending order, one element per lane."""
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mn = M.to(tl.int64) * N  # one split's elements (int64: SPLITS x M x N passes 2^31 for an LM head)
        ok = idx < mn
        m = idx // N
        n = idx % N
        total = tl.load(part_ptr + idx, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLITS):
            total = total + tl.load(part_ptr + s * mn + idx, mask=ok, other=0.0)
        if HAS_BIAS:
            total = total + tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + n, total.to(out_ptr.dtype.element_ty), mask=ok)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, tiles: MatmulTiles | None = None,
           launch: MatmulLaunch | None = None, wave_rows: int | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` with a fixed reduction order per output element: x [..., K], weight [N, K],
    bias [N] -> [..., N] in x's dtype (fp32 accumulation). Triton; CUDA tensors or the interpreter.

    ``tiles`` (default :func:`matmul_tiles`) fixes the bits; ``launch`` (default :func:`matmul_launch` of the row
    count) only how the programs are laid out: a segment's sum is the same in a split program or a fused one, and
    0 + s == s, so a row's bits do not depend on M. Both overrides exist for the tuning script and the tests. A
    ``tma`` launch whose tensors a descriptor cannot address (:func:`_descriptors_fit`) runs the pointer table's
    launch for these rows instead: the same bits.

    Whole waves (default launch only): a call of the wide launch with more rows than one wave of its tiles fills
    (``wave_rows``, default :func:`matmul_wave_rows` of the device) runs as two launches, the whole waves' rows wide
    and the rest at the launch of their own row count, so the last tiles do not take a second wave of the whole
    tile time with most SMs idle (DDTree 16 at 64 in flight verifies 1088 rows: 144 tiles of 128 x 256 on 132 SMs).
    Rows never meet in a matmul, so the split leaves every row's bits as they were."""
    if triton is None:
        raise ConfigError("batch_invariant.linear needs Triton; use linear_rows")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ShapeError(f"batch_invariant.linear: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ShapeError(f"batch_invariant.linear: bias {tuple(bias.shape)} for weight {tuple(weight.shape)}")
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    tiles = tiles or matmul_tiles(n, k)
    if launch is not None:
        _linear_into(x2, weight, bias, out, tiles, launch)
        return out.reshape(*lead, n)
    tma = tma_loads(x2)
    head = _whole_waves(n, k, m, tma, matmul_wave_rows(n, k, x2.device, tma) if wave_rows is None else wave_rows)
    if head:
        _linear_into(x2[:head], weight, bias, out[:head], tiles, matmul_launch(n, k, head, tma=tma))
    if head < m:
        _linear_into(x2[head:], weight, bias, out[head:], tiles, matmul_launch(n, k, m - head, tma=tma))
    return out.reshape(*lead, n)


_SM_COUNTS: dict[int, int] = {}


def matmul_wave_rows(n: int, k: int, device: torch.device, tma: bool = True) -> int:
    """Rows whose tiles of the wide launch fill the device's SMs once (one program an SM: the wide launch's shared
    memory): ``block_m`` x (SMs // column tiles); 0 off CUDA or where one row of tiles is wider than the device."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    wide = matmul_launch(n, k, 1 << 30, tma=tma)
    return wide.block_m * (_SM_COUNTS[index] // -(-n // wide.block_n))


def _whole_waves(n: int, k: int, m: int, tma: bool, wave_rows: int) -> int:
    """How many of a call's m rows :func:`linear` runs as whole waves of the wide launch (0: the call runs as one
    launch): where m takes the wide launch, is past one wave, and its rest past the whole waves takes a launch of
    its own (the rest wide would be one more wave of the whole tile time either way)."""
    wide = matmul_launch(n, k, 1 << 30, tma=tma)
    if wave_rows <= 0 or m <= wave_rows or matmul_launch(n, k, m, tma=tma) != wide:
        return 0
    head = m // wave_rows * wave_rows
    if head == m or matmul_launch(n, k, m - head, tma=tma) == wide:
        return 0
    return head


def _linear_into(x2: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor, tiles: MatmulTiles,
                 launch: MatmulLaunch) -> None:
    """x2 [M, K] @ weight [N, K]^T (+ bias) into out [M, N] (row stride free, unit column stride) at ``launch``."""
    m, n, k = x2.shape[0], weight.shape[0], weight.shape[1]
    k_blocks = -(-k // tiles.block_k)
    if k_blocks % tiles.split_k:
        raise ConfigError(f"batch_invariant.linear: {k_blocks} K blocks do not divide into {tiles.split_k} splits")
    k_per_split = (k_blocks // tiles.split_k) * tiles.block_k
    stores_out = launch.fused or tiles.split_k == 1  # a split launch stores partials through pointers
    if launch.tma and not _descriptors_fit(x2, weight, *((out,) if stores_out else ())):
        launch = matmul_launch(n, k, m, tma=False)
    fused = launch.fused or tiles.split_k == 1
    part = out if fused else torch.empty((tiles.split_k, m, n), dtype=torch.float32, device=x2.device)
    precision = "ieee" if x2.dtype == torch.float32 else "tf32"
    grid = (-(-m // launch.block_m), -(-n // launch.block_n), 1 if fused else tiles.split_k)
    if launch.tma:
        descriptor = TensorDescriptor.from_tensor
        w_desc = descriptor(weight, [launch.block_n, tiles.block_k])
        _matmul_tma_kernel[grid](descriptor(x2, [launch.block_m, tiles.block_k]), w_desc,
                                 # a split launch never stores through it: any descriptor does where out has none
                                 descriptor(out, [launch.block_m, launch.block_n])
                                 if fused or _descriptors_fit(out) else w_desc,
                                 weight if bias is None else bias, part, m, n, k_per_split,
                                 BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=tiles.block_k,
                                 SPLITS=tiles.split_k, FUSED=fused, HAS_BIAS=bias is not None, EMULATE=INTERPRETED,
                                 PRECISION=precision, enable_fp_fusion=FP_FUSION, num_warps=launch.num_warps,
                                 num_stages=launch.num_stages)
    else:
        _matmul_kernel[grid](x2, weight, weight if bias is None else bias, out, part, m, n, k, x2.stride(0),
                             weight.stride(0), out.stride(0), k_per_split,
                             BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=tiles.block_k,
                             SPLITS=tiles.split_k, FUSED=fused, FLAT=launch.flat, HAS_BIAS=bias is not None,
                             EMULATE=INTERPRETED,
                             PRECISION=precision, enable_fp_fusion=FP_FUSION, num_warps=launch.num_warps,
                             num_stages=launch.num_stages)
    if not fused:
        block = 1024
        _split_sum_kernel[(-(-(m * n) // block),)](part, weight if bias is None else bias, out, m, n, out.stride(0),
                                                    SPLITS=tiles.split_k, HAS_BIAS=bias is not None, BLOCK=block,
                                                    enable_fp_fusion=FP_FUSION, num_warps=4)


def _descriptors_fit(*tensors: Tensor) -> bool:
    """Whether a TMA descriptor can address each 2-D tensor: base and row stride multiples of 16 bytes, unit
    column stride (the hardware's rule), and Triton's host descriptors import."""
    if TensorDescriptor is None:
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in tensors)


def linear_rows(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The torch path: ``F.linear`` one row at a time (every call has one row, so a row's result cannot depend on
    the others). x [..., K] -> [..., N]."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
    rows = [F.linear(x2[i:i + 1], weight, bias) for i in range(x2.shape[0])]
    return torch.cat(rows, 0).reshape(*x.shape[:-1], weight.shape[0])


# ---- attention --------------------------------------------------------------------------------------------------

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


def tail_rows(group: int) -> int:
    """Rows of a tail tile's dot in the fused launch: at least a tensor-core tile (16), at least G."""
    return _pow2_at_least(group, 16)


def tail_layout(tokens: int, group: int, per_tile: int = 1) -> tuple[int, int]:
    """(queries per attention program QT, queries per tail chunk) for ``tokens`` new tokens of ``group`` query
    heads per KV head in a call of ``per_tile`` = rows x KV heads programs per query tile: the shape
    :func:`tail_chunks` lays its table out in."""
    return attention_block_m(tokens, group, per_tile) // group, tail_rows(group) // _pow2_at_least(group, 1)


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


if triton is not None:

    @triton.jit
    def _key_index(j, start, pos_q, anc_row_ptr):
        """(cache index [BLOCK_N] int64, visible [BLOCK_N]) of the keys one tree query reads at positions j: cache
        index j below start, the ancestor's slot above it; not visible past pos_q or where it has no ancestor at that
        depth."""
        above = j >= start
        anc = tl.load(anc_row_ptr + (j - start), mask=above & (j <= pos_q), other=-1)
        idx = tl.where(above, start + anc, j).to(tl.int64)
        ok = (j <= pos_q) & ((~above) | (anc >= 0))
        return idx, ok

    @triton.jit
    def _shared_tile(base, stride_p, offs_d, j, max_pos):
        """The K or V tile [BLOCK_N, D] at positions j [BLOCK_N] that every query of a program reads alike (contiguous
        in the cache: prefix tiles, every tile of a chain or prompt chunk), loaded up to ``max_pos``, 0 past it."""
        return tl.load(base + j[:, None].to(tl.int64) * stride_p + offs_d[None, :], mask=(j <= max_pos)[:, None],
                       other=0.0)

    @triton.jit
    def _tile_update(q, k, v, vis, m_i, l_i, acc, ones, scale_log2, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """One key tile of the online softmax for rows q [M, D] over k, v [BLOCK_N, D] (visible [M, BLOCK_N]) ->
        (m, l, acc): the arithmetic every tile of every launch does, so that a row's bits follow from its own keys
        (a tensor-core dot's row depends on that row and the tile only, whatever M)."""
        scores = _dot(q, tl.trans(k.to(q.dtype)), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), EMULATE,
                      PRECISION)
        p, alpha, l_i, m_new = _softmax_step(scores, vis, m_i, l_i, ones, scale_log2, EMULATE, PRECISION)
        return m_new, l_i, _dot(p, v.to(q.dtype), acc * alpha[:, None], EMULATE, PRECISION)

    @triton.jit
    def _softmax_step(scores, vis, m_i, l_i, ones, scale_log2, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """One key tile of the online softmax, the same code for the shared and the per-query tiles (their bits must
        agree): -> (p, alpha, l, m) with p the tile's unnormalised probabilities in the dot's dtype, alpha the
        rescale of what came before, l [BLOCK_M, ATTN_SUM_COLS] the running sum (every column alike) and m the
        running max (masked keys: exp2(-inf) = 0, -inf - -inf guarded).

        The row sum is a dot with a ones matrix, not ``tl.sum(p, 1)``: a reduction over the tile follows the
        register layout the dot left it in, and that layout follows the program's row count (64-row programs gave
        chain rows 1 ulp off a 32-row program's, H200, 2026-12-01), while a tensor-core dot's row depends on that
        row and the tile only (measured on the H200 for 32- and 64-row programs: G = 4, D = 128, bf16, Triton 3.6).
        It sums the same bf16 weights P @ V uses; max is exact in any order."""
        qk = tl.where(vis, scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None]).to(ones.dtype)
        return p, alpha, _dot(p, ones, l_i * alpha[:, None], EMULATE, PRECISION), m_new

    @triton.jit
    def _split_state(q, k_base, v_base, row_ok, pos_row, max_pos, split, stride_kp, stride_vp, scale_log2, offs_d,
                     offs_n, ones, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     TILES_PER_SPLIT: tl.constexpr, SUM_COLS: tl.constexpr, EMULATE: tl.constexpr,
                     PRECISION: tl.constexpr):
        """The online softmax of a program's rows over the key tiles of one split, from zero, in ascending position
        order -> (m [BLOCK_M] running max, l [BLOCK_M] sum, acc [BLOCK_M, HEAD_DIM] unnormalised), fp32; the split
        launch stores it per split (the fused launch, :func:`_fused_program`, does the same arithmetic in one loop).

        Only for splits whose keys every query of the program reads alike: all of a chain's or a prompt chunk's, a
        tree's wholly below ``start // BLOCK_N``. A tree's splits from there up run one chunk of queries on one path
        per program (:func:`_chunk_splits`), so that its chunks run side by side and not one after another."""
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M, SUM_COLS], dtype=tl.float32)
        tile_lo = split * TILES_PER_SPLIT
        for tile in range(tile_lo, tl.minimum(tile_lo + TILES_PER_SPLIT, max_pos // BLOCK_N + 1)):
            j = tile * BLOCK_N + offs_n
            k = _shared_tile(k_base, stride_kp, offs_d, j, max_pos)
            v = _shared_tile(v_base, stride_vp, offs_d, j, max_pos)
            m_i, l_i, acc = _tile_update(q, k, v, (j[None, :] <= pos_row[:, None]) & row_ok[:, None], m_i, l_i, acc,
                                         ones, scale_log2, EMULATE, PRECISION)
        return m_i, tl.max(l_i, 1), acc  # l's columns are equal

    @triton.jit
    def _chunk_lanes(q_ptr, pos_ptr, chunk_ptr, r, kv, T, G, stride_qr, stride_qh, stride_qt, offs_d,
                     TAIL_ROWS: tl.constexpr, CHUNK: tl.constexpr):
        """The rows of one tail chunk (:func:`tail_chunks`, ``chunk_ptr`` at its lead): TAIL_ROWS lanes, each member's
        G heads, padded -> (lane_ok, member t [TAIL_ROWS], head, its position, q [TAIL_ROWS, D], the lead, its
        position)."""
        lane = tl.arange(0, TAIL_ROWS)
        slot = lane // G
        member = tl.load(chunk_ptr + 1 + slot, mask=slot < CHUNK, other=-1)
        lane_ok = (slot < CHUNK) & (member >= 0)
        t_l = tl.where(lane_ok, member, 0)
        head_l = kv * G + lane % G
        lead = tl.load(chunk_ptr)
        pos_lead = tl.load(pos_ptr + r * T + lead)
        pos_l = tl.load(pos_ptr + r * T + t_l, mask=lane_ok, other=-1)
        q_g = tl.load(q_ptr + r * stride_qr + head_l[:, None] * stride_qh + t_l[:, None] * stride_qt + offs_d[None, :],
                      mask=lane_ok[:, None], other=0.0)
        return lane_ok, t_l, head_l, pos_l, q_g, lead, pos_lead

    @triton.jit
    def _chunk_tile(q_g, k_base, v_base, anc_lead, j, start, pos_lead, pos_l, lane_ok, m_g, l_g, acc_g, stride_kp,
                    stride_vp, offs_d, ones, scale_log2, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """One key tile (positions j) of a tail chunk on its members' rows: the lead's keys (:func:`_key_index`: the
        shared ones below start, its ancestors above) gathered once, each member masked past its own position."""
        idx, seen = _key_index(j, start, pos_lead, anc_lead)
        k = tl.load(k_base + idx[:, None] * stride_kp + offs_d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(v_base + idx[:, None] * stride_vp + offs_d[None, :], mask=seen[:, None], other=0.0)
        vis = seen[None, :] & (j[None, :] <= pos_l[:, None]) & lane_ok[:, None]
        return _tile_update(q_g, k, v, vis, m_g, l_g, acc_g, ones, scale_log2, EMULATE, PRECISION)

    @triton.jit
    def _chunk_splits(q_ptr, k_base, v_base, anc_base, pos_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, chunk_ptr, r, kv,
                      start, stride_kp, stride_vp, stride_qr, stride_qh, stride_qt, T, G, num_kv, num_splits,
                      scale_log2, offs_d, offs_n, ones, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                      TILES_PER_SPLIT: tl.constexpr, SUM_COLS: tl.constexpr, TAIL_ROWS: tl.constexpr,
                      CHUNK: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """The split launch's tree tail: one chunk of queries on one path (:func:`tail_chunks`) on TAIL_ROWS rows, each
        split from the one holding ``start // BLOCK_N`` to its lead's last, from zero, stored as its members' partials
        (members whose position reaches the split). Its tiles below ``start`` load the shared keys, those above it the
        lead's ancestors (:func:`_key_index`), which hold every member's keys up to its own position (the rest are
        masked, exact no-ops): the tile arithmetic of :func:`_split_state` and of the fused launch's
        :func:`_tail_chunk`, so the same bits.

        Why a program per chunk: at one request a tree's split launch has few programs (a 64-node tree: 8 query
        tiles x 8 KV heads), and a query tile's chunks one after another made the split that holds the tail the
        launch's longest program (each chunk a gathered K and V tile and two dots of the whole tile's rows); here
        they run side by side, each re-reading the split's few shared tiles below start."""
        TPS: tl.constexpr = TILES_PER_SPLIT
        lane_ok, t_l, head_l, pos_l, q_g, lead, pos_lead = _chunk_lanes(
            q_ptr, pos_ptr, chunk_ptr, r, kv, T, G, stride_qr, stride_qh, stride_qt, offs_d, TAIL_ROWS, CHUNK)
        anc_lead = anc_base + lead * T
        last_tile = pos_lead // BLOCK_N
        # up to the lead's last split, never past the partials' (kv_len > every position is the contract; a breach
        # must not write into the next head's partials)
        for s in range((start // BLOCK_N) // TPS, tl.minimum(last_tile // TPS + 1, num_splits)):
            m_g = tl.full([TAIL_ROWS], float("-inf"), dtype=tl.float32)
            l_g = tl.zeros([TAIL_ROWS, SUM_COLS], dtype=tl.float32)
            acc_g = tl.zeros([TAIL_ROWS, HEAD_DIM], dtype=tl.float32)
            for tile in range(s * TPS, tl.minimum(s * TPS + TPS, last_tile + 1)):
                m_g, l_g, acc_g = _chunk_tile(q_g, k_base, v_base, anc_lead, tile * BLOCK_N + offs_n, start, pos_lead,
                                              pos_l, lane_ok, m_g, l_g, acc_g, stride_kp, stride_vp, offs_d, ones,
                                              scale_log2, EMULATE, PRECISION)
            part = ((r * T + t_l) * (num_kv * G) + head_l) * num_splits + s
            keep = lane_ok & (s * (TPS * BLOCK_N) <= pos_l)
            tl.store(part_m_ptr + part, m_g, mask=keep)
            tl.store(part_l_ptr + part, tl.max(l_g, 1), mask=keep)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc_g, mask=keep[:, None])

    @triton.jit
    def _merge_weights(m_run, m_s):
        """The weights of one merge step of the splits, in ascending split order: -> (m, w_run, w_s) with
        m = max(m_run, m_s) and w = 2^(m_x - m); the caller forms ``fma(x_run, w_run, x_s * w_s)`` for l and acc
        (explicit fma: the fused and the combine kernel must round alike, and a compiler's own contraction need not
        be the same in both). An empty split (m_s = -inf: no visible key) merges as an exact no-op; -inf - -inf is
        guarded."""
        m = tl.maximum(m_run, m_s)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        return m, tl.exp2(m_run - m_use), tl.exp2(m_s - m_use)

    @triton.jit
    def _merge_split(m_run, l_run, acc_run, m_s, l_s, acc_s, take):
        """The running state after merging one split's (m_s, l_s [rows], acc_s [rows, D]) into it, in rows ``take``
        (:func:`_merge_weights`; the combine kernel's arithmetic)."""
        m_new, w_run, w_s = _merge_weights(m_run, m_s)
        l_run = tl.where(take, tl.fma(l_run, w_run, l_s * w_s), l_run)
        acc_run = tl.where(take[:, None], tl.fma(acc_run, w_run[:, None], acc_s * w_s[:, None]), acc_run)
        return tl.where(take, m_new, m_run), l_run, acc_run

    @triton.jit
    def _tail_chunk(q_ptr, k_base, v_base, anc_base, pos_ptr, out_ptr, state_ptr, chunk_ptr, r, kv, pid_q, prog, start,
                    shared_hi, stride_kp, stride_vp, stride_qr, stride_qh, stride_qt, stride_or, stride_oh, stride_ot,
                    T, G, scale_log2, offs_d, offs_n, ones, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                    QT: tl.constexpr, BLOCK_N: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, SUM_COLS: tl.constexpr,
                    TAIL_ROWS: tl.constexpr, CHUNK: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """One tail chunk (:func:`tail_chunks`: up to CHUNK queries on one path, ``chunk_ptr`` at its lead) on
        TAIL_ROWS rows (each member's G heads, padded): the lead's tail tiles (from ``shared_hi``) gathered once,
        each member's rows resumed from its state in program ``prog``'s part of ``state_ptr``
        (:func:`_fused_program`) and masked past its own position, its last split merged, its output stored.

        A member's rows take the bits they would alone: its visible keys are the lead's at those positions, keys past
        its position are exact no-ops (p = 0), and it merges each split at the split edge after it (or at the end),
        as a query alone does at its end; nothing is merged for it after that."""
        TPS: tl.constexpr = TILES_PER_SPLIT
        width = 2 * HEAD_DIM + 4
        lane = tl.arange(0, TAIL_ROWS)
        lane_ok, t_l, head_l, pos_l, q_g, lead, pos_lead = _chunk_lanes(
            q_ptr, pos_ptr, chunk_ptr, r, kv, T, G, stride_qr, stride_qh, stride_qt, offs_d, TAIL_ROWS, CHUNK)
        sg = state_ptr + (prog * ROWS + (t_l - pid_q * QT) * G + lane % G) * width  # ROWS: the launch's rows a program
        acc_g = tl.load(sg[:, None] + offs_d[None, :], mask=lane_ok[:, None], other=0.0)
        acc_run_g = tl.load(sg[:, None] + HEAD_DIM + offs_d[None, :], mask=lane_ok[:, None], other=0.0)
        m_g = tl.load(sg + 2 * HEAD_DIM, mask=lane_ok, other=float("-inf"))
        l_g = tl.load(sg + 2 * HEAD_DIM + 1, mask=lane_ok, other=0.0)[:, None] + tl.zeros([TAIL_ROWS, SUM_COLS],
                                                                                          dtype=tl.float32)
        m_run_g = tl.load(sg + 2 * HEAD_DIM + 2, mask=lane_ok, other=float("-inf"))
        l_run_g = tl.load(sg + 2 * HEAD_DIM + 3, mask=lane_ok, other=0.0)
        anc_lead = anc_base + lead * T
        for tile in range(shared_hi, pos_lead // BLOCK_N + 1):
            if (tile % TPS == 0) & (tile > 0):
                take = lane_ok & ((tile // TPS - 1) * (TPS * BLOCK_N) <= pos_l)
                m_run_g, l_run_g, acc_run_g = _merge_split(m_run_g, l_run_g, acc_run_g, m_g, tl.max(l_g, 1), acc_g,
                                                           take)
                m_g = tl.full([TAIL_ROWS], float("-inf"), dtype=tl.float32)
                l_g = tl.zeros([TAIL_ROWS, SUM_COLS], dtype=tl.float32)
                acc_g = tl.zeros([TAIL_ROWS, HEAD_DIM], dtype=tl.float32)
            m_g, l_g, acc_g = _chunk_tile(q_g, k_base, v_base, anc_lead, tile * BLOCK_N + offs_n, start, pos_lead,
                                          pos_l, lane_ok, m_g, l_g, acc_g, stride_kp, stride_vp, offs_d, ones,
                                          scale_log2, EMULATE, PRECISION)
        take = lane_ok & ((pos_l // BLOCK_N) // TPS == (pos_lead // BLOCK_N) // TPS)  # else merged at its edge
        m_run_g, l_run_g, acc_run_g = _merge_split(m_run_g, l_run_g, acc_run_g, m_g, tl.max(l_g, 1), acc_g, take)
        out = acc_run_g / tl.where(l_run_g > 0.0, l_run_g, 1.0)[:, None]
        tl.store(out_ptr + r * stride_or + head_l[:, None] * stride_oh + t_l[:, None] * stride_ot + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=lane_ok[:, None])

    @triton.jit
    def _split_edge(tile, row_ok, pos_row, m_run, l_run, acc_run, m_i, l_i, acc, BLOCK_N: tl.constexpr,
                    TPS: tl.constexpr):
        """The fused loop at split edge ``tile`` (its first tile, > 0): split ``tile // TPS - 1``'s state merged into
        the running one in the rows whose position reaches it (:func:`_merge_split`), and restarted from zero ->
        (m_run, l_run, acc_run, m_i, l_i, acc)."""
        take = row_ok & ((tile // TPS - 1) * (TPS * BLOCK_N) <= pos_row)
        m_run, l_run, acc_run = _merge_split(m_run, l_run, acc_run, m_i, tl.max(l_i, 1), acc, take)
        return (m_run, l_run, acc_run, tl.full(m_i.shape, float("-inf"), dtype=tl.float32), tl.zeros_like(l_i),
                tl.zeros_like(acc))

    @triton.jit
    def _store_output(out_ptr, r, head, t, row_ok, pos_row, n_tiles, m_run, l_run, acc_run, m_i, l_i, acc,
                      stride_or, stride_oh, stride_ot, offs_d, BLOCK_N: tl.constexpr, TPS: tl.constexpr):
        """A fused program's rows without a tail: the last split merged (in the rows whose position reaches it),
        then out = acc / l stored."""
        take = row_ok & (((n_tiles - 1) // TPS) * (TPS * BLOCK_N) <= pos_row)
        m_run, l_run, acc_run = _merge_split(m_run, l_run, acc_run, m_i, tl.max(l_i, 1), acc, take)
        out = acc_run / tl.where(l_run > 0.0, l_run, 1.0)[:, None]
        tl.store(out_ptr + r * stride_or + head[:, None] * stride_oh + t[:, None] * stride_ot + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _store_state(st, acc, acc_run, m_i, l_i, m_run, l_run, HEAD_DIM: tl.constexpr):
        """Rows' state at ``st`` [rows] (row starts, fp32, width 2 x HEAD_DIM + 4): acc, acc_run, m, l, m_run,
        l_run, for the tail chunks to resume (:func:`_tail_chunk`)."""
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(st[:, None] + offs_d[None, :], acc)
        tl.store(st[:, None] + HEAD_DIM + offs_d[None, :], acc_run)
        tl.store(st + 2 * HEAD_DIM, m_i)
        tl.store(st + 2 * HEAD_DIM + 1, tl.max(l_i, 1))
        tl.store(st + 2 * HEAD_DIM + 2, m_run)
        tl.store(st + 2 * HEAD_DIM + 3, l_run)

    @triton.jit
    def _fused_program(q, k_base, v_base, anc_base, tail_base, pos_ptr, out_ptr, state_ptr, r, t, row_ok, head,
                       pos_row, max_pos, all_chain, start, kv, pid_q, pid_rk, stride_kp, stride_vp, stride_qr,
                       stride_qh, stride_qt, q_ptr, stride_or, stride_oh, stride_ot, T, G, scale_log2, offs_d, offs_n,
                       ones, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, QT: tl.constexpr,
                       BLOCK_N: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, SUM_COLS: tl.constexpr,
                       TAIL_ROWS: tl.constexpr, CHUNK: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """The fused launch's program: every split of its rows in one loop over the key tiles, merged in ascending
        order, and the output stored. The bits of the split launch (:func:`_split_state` per split, then the
        combine kernel): the same tile arithmetic (:func:`_tile_update`) from the same zero state at each split's
        first tile, the same merge (:func:`_merge_split`) in the rows whose position reaches the split.

        One loop, not a loop per split: the loads stay software-pipelined across split edges (a loop per split
        drains the pipeline every ATTN_SPLIT_KEYS / ATTN_BLOCK_N tiles). Tiles the program's queries read alike (all
        of a chain's or a prompt chunk's; below ``start // BLOCK_N`` in a tree) run on all BLOCK_M rows at once. A
        tree's tiles above that, where each query reads its own ancestors, run one chunk of queries on one path at a
        time (:func:`tail_chunks`, :func:`_tail_chunk`) on TAIL_ROWS rows (its members' G heads, padded): the program
        stores its rows' state to ``state_ptr`` (fp32, exact; ROWS a program, the launch's rows, which a small last
        tile's BLOCK_M is below) and each chunk resumes its members' rows from there, so a tail tile costs one gather
        and a dot of TAIL_ROWS rows per chunk, not one of BLOCK_M rows per query."""
        TPS: tl.constexpr = TILES_PER_SPLIT
        n_tiles = max_pos // BLOCK_N + 1
        shared_hi = tl.where(all_chain != 0, n_tiles, tl.minimum(n_tiles, start // BLOCK_N))
        m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_run = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M, SUM_COLS], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for tile in range(0, shared_hi):
            if (tile % TPS == 0) & (tile > 0):  # split tile // TPS - 1 ends here: merge it, start the next from zero
                m_run, l_run, acc_run, m_i, l_i, acc = _split_edge(tile, row_ok, pos_row, m_run, l_run, acc_run, m_i,
                                                                   l_i, acc, BLOCK_N, TPS)
            j = tile * BLOCK_N + offs_n
            k = _shared_tile(k_base, stride_kp, offs_d, j, max_pos)
            v = _shared_tile(v_base, stride_vp, offs_d, j, max_pos)
            m_i, l_i, acc = _tile_update(q, k, v, (j[None, :] <= pos_row[:, None]) & row_ok[:, None], m_i, l_i, acc,
                                         ones, scale_log2, EMULATE, PRECISION)
        if shared_hi == n_tiles:  # no tail: the last split, then the output
            _store_output(out_ptr, r, head, t, row_ok, pos_row, n_tiles, m_run, l_run, acc_run, m_i, l_i, acc,
                          stride_or, stride_oh, stride_ot, offs_d, BLOCK_N, TPS)
        else:
            # state rows [ROWS, 2 * HEAD_DIM + 4] of this program: acc, acc_run, m, l, m_run, l_run
            width = 2 * HEAD_DIM + 4
            prog = (pid_rk * tl.num_programs(0) + pid_q).to(tl.int64)
            _store_state(state_ptr + (prog * ROWS + tl.arange(0, BLOCK_M)) * width, acc, acc_run, m_i, l_i, m_run,
                         l_run, HEAD_DIM)
            tl.debug_barrier()  # the rows' state is read back by other threads of this program
            for c in range(0, tl.load(tail_base)):
                _tail_chunk(q_ptr, k_base, v_base, anc_base, pos_ptr, out_ptr, state_ptr, tail_base + 1 + c * (1 + CHUNK),
                            r, kv, pid_q, prog, start, shared_hi, stride_kp, stride_vp, stride_qr, stride_qh, stride_qt,
                            stride_or, stride_oh, stride_ot, T, G, scale_log2, offs_d, offs_n, ones, HEAD_DIM, ROWS,
                            QT, BLOCK_N, TILES_PER_SPLIT, SUM_COLS, TAIL_ROWS, CHUNK, EMULATE, PRECISION)

    @triton.jit
    def _program_rows(q_ptr, pos_ptr, r, t, head, row_ok, T, stride_qr, stride_qh, stride_qt, offs_d):
        """A query tile's rows: (q [BLOCK_M, D], position [BLOCK_M] (-1 past T), the tile's last position)."""
        q = tl.load(q_ptr + r * stride_qr + head[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        pos_row = tl.load(pos_ptr + r * T + t, mask=row_ok, other=-1)
        return q, pos_row, tl.max(pos_row, 0)

    @triton.jit
    def _attention_program(
        q_ptr, k_ptr, v_ptr, slots_ptr, start_ptr, pos_ptr, anc_ptr, chain_ptr, tail_ptr, out_ptr, part_m_ptr,
        part_l_ptr, part_acc_ptr, state_ptr, stride_qr, stride_qh, stride_qt, stride_ks, stride_kh, stride_kp,
        stride_vs, stride_vh, stride_vp, stride_or, stride_oh, stride_ot, pid_q, pid_s, pid_rk, T, G, num_kv,
        num_splits, scale_log2, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, QT: tl.constexpr,
        BLOCK_N: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, SUM_COLS: tl.constexpr, TAIL_ROWS: tl.constexpr,
        CHUNK: tl.constexpr, FUSED: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """One program's rows (query tile pid_q, row x KV head pid_rk; BLOCK_M of them, where the launch's programs
        have ROWS): split pid_s's state stored as partials, or (FUSED) every split up to the program's last position
        merged in ascending order and the output stored. In the split launch ``pid_s >= num_splits`` names the query
        tile's tail chunk ``pid_s - num_splits`` (:func:`_chunk_splits`; none for a tile of chains), and the tile's
        own programs store only the splits wholly below key tile ``start // BLOCK_N`` (split ``start // BLOCK_N //
        TILES_PER_SPLIT`` on are the chunks') where its queries form a tree."""
        r = (pid_rk // num_kv).to(tl.int64)
        kv = pid_rk % num_kv
        rows = tl.arange(0, BLOCK_M)
        qi = rows // G  # query within the tile (query-major folding)
        t = pid_q * QT + qi
        row_ok = (qi < QT) & (t < T)
        head = kv * G + rows % G
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + r)
        start = tl.load(start_ptr + r)
        all_chain = tl.min(tl.load(chain_ptr + r * T + t, mask=row_ok, other=1), 0)
        k_base = k_ptr + slot * stride_ks + kv * stride_kh
        v_base = v_ptr + slot * stride_vs + kv * stride_vh
        anc_base = anc_ptr + r * T * T
        tail_base = tail_ptr + (r * tl.num_programs(0) + pid_q) * (1 + QT * (1 + CHUNK))  # tail_chunks' table
        # made in fp32 and cast: Triton 3.6's interpreter has no bf16 constant (``tl.full`` in bf16 fails there)
        ones = tl.full([BLOCK_N, SUM_COLS], 1.0, dtype=tl.float32).to(q_ptr.dtype.element_ty)
        if FUSED:
            q, pos_row, max_pos = _program_rows(q_ptr, pos_ptr, r, t, head, row_ok, T, stride_qr, stride_qh,
                                                stride_qt, offs_d)
            _fused_program(q, k_base, v_base, anc_base, tail_base, pos_ptr, out_ptr, state_ptr, r, t, row_ok, head,
                           pos_row, max_pos, all_chain, start, kv, pid_q, pid_rk, stride_kp, stride_vp, stride_qr,
                           stride_qh, stride_qt, q_ptr, stride_or, stride_oh, stride_ot, T, G, scale_log2, offs_d,
                           offs_n, ones, HEAD_DIM, BLOCK_M, ROWS, QT, BLOCK_N, TILES_PER_SPLIT, SUM_COLS, TAIL_ROWS,
                           CHUNK, EMULATE, PRECISION)
        elif pid_s >= num_splits:
            if (all_chain == 0) & (pid_s - num_splits < tl.load(tail_base)):
                _chunk_splits(q_ptr, k_base, v_base, anc_base, pos_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                              tail_base + 1 + (pid_s - num_splits) * (1 + CHUNK), r, kv, start, stride_kp, stride_vp,
                              stride_qr, stride_qh, stride_qt, T, G, num_kv, num_splits, scale_log2, offs_d, offs_n,
                              ones, HEAD_DIM, BLOCK_N, TILES_PER_SPLIT, SUM_COLS, TAIL_ROWS, CHUNK, EMULATE, PRECISION)
        elif (all_chain != 0) | (pid_s < (start // BLOCK_N) // TILES_PER_SPLIT):
            q, pos_row, max_pos = _program_rows(q_ptr, pos_ptr, r, t, head, row_ok, T, stride_qr, stride_qh,
                                                stride_qt, offs_d)
            m_i, l_i, acc = _split_state(q, k_base, v_base, row_ok, pos_row, max_pos, pid_s, stride_kp, stride_vp,
                                         scale_log2, offs_d, offs_n, ones, HEAD_DIM, BLOCK_M, BLOCK_N, TILES_PER_SPLIT,
                                         SUM_COLS, EMULATE, PRECISION)
            _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, r, t, head, row_ok, m_i, l_i, acc, pid_s, T, G,
                            num_kv, num_splits, offs_d, HEAD_DIM)

    @triton.jit
    def _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, r, t, head, row_ok, m_i, l_i, acc, split, T, G, num_kv,
                        num_splits, offs_d, HEAD_DIM: tl.constexpr):
        """One split's state of a program's rows as partials [R, T, H, splits] (+ D): written for every valid row,
        read by the combine only for splits up to its position."""
        part = ((r * T + t) * (num_kv * G) + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])

    @triton.jit(do_not_specialize=["T"])
    def _attention_kernel(
        q_ptr, k_ptr, v_ptr, slots_ptr, start_ptr, pos_ptr, anc_ptr, chain_ptr, tail_ptr, out_ptr, part_m_ptr,
        part_l_ptr, part_acc_ptr, state_ptr, stride_qr, stride_qh, stride_qt, stride_ks, stride_kh, stride_kp,
        stride_vs, stride_vh, stride_vp, stride_or, stride_oh, stride_ot, T, G, num_kv, num_splits, scale_log2,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, QT: tl.constexpr, BLOCK_N: tl.constexpr,
        TILES_PER_SPLIT: tl.constexpr, SUM_COLS: tl.constexpr, TAIL_ROWS: tl.constexpr, CHUNK: tl.constexpr,
        SMALL_M: tl.constexpr, SMALL: tl.constexpr, FUSED: tl.constexpr, EMULATE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Grid (query tiles, splits + chunk slots (QT where T > 1) or 1 if FUSED, rows x KV heads):
        :func:`_attention_program`. Where SMALL, the last query tile of a call with several runs in a program of
        SMALL_M rows if its rows fit them (:func:`attention_small_tail`): the same rows, each with the same tile
        arithmetic, without the padding rows of a BLOCK_M-row program."""
        pid_q = tl.program_id(0)
        small = False
        if SMALL:  # the call's last tile, where its rows fit SMALL_M (a branch per program, one launch)
            small = (pid_q > 0) & ((T - pid_q * QT) * G <= SMALL_M)
        if small:
            _attention_program(
                q_ptr, k_ptr, v_ptr, slots_ptr, start_ptr, pos_ptr, anc_ptr, chain_ptr, tail_ptr, out_ptr, part_m_ptr,
                part_l_ptr, part_acc_ptr, state_ptr, stride_qr, stride_qh, stride_qt, stride_ks, stride_kh, stride_kp,
                stride_vs, stride_vh, stride_vp, stride_or, stride_oh, stride_ot, pid_q, tl.program_id(1),
                tl.program_id(2), T, G, num_kv, num_splits, scale_log2, HEAD_DIM, SMALL_M, BLOCK_M, QT, BLOCK_N,
                TILES_PER_SPLIT, SUM_COLS, TAIL_ROWS, CHUNK, FUSED, EMULATE, PRECISION)
        else:
            _attention_program(
                q_ptr, k_ptr, v_ptr, slots_ptr, start_ptr, pos_ptr, anc_ptr, chain_ptr, tail_ptr, out_ptr, part_m_ptr,
                part_l_ptr, part_acc_ptr, state_ptr, stride_qr, stride_qh, stride_qt, stride_ks, stride_kh, stride_kp,
                stride_vs, stride_vh, stride_vp, stride_or, stride_oh, stride_ot, pid_q, tl.program_id(1),
                tl.program_id(2), T, G, num_kv, num_splits, scale_log2, HEAD_DIM, BLOCK_M, BLOCK_M, QT, BLOCK_N,
                TILES_PER_SPLIT, SUM_COLS, TAIL_ROWS, CHUNK, FUSED, EMULATE, PRECISION)

    @triton.jit(do_not_specialize=["T"])
    def _attention_combine_kernel(
        out_ptr, pos_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, stride_or, stride_oh, stride_ot, T, H, num_splits,
        HEAD_DIM: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    ):
        """Program (row x token, head): the stored split states 0 .. pos // SPLIT_KEYS merged in ascending order into a
        running max and rescaled sums (:func:`_merge_weights`, the fused launch's arithmetic), then out = acc / l
        (the same splits whatever the call's kv_len)."""
        rt = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        r = rt // T
        t = rt % T
        offs_d = tl.arange(0, HEAD_DIM)
        pos = tl.load(pos_ptr + rt)
        n = tl.minimum(pos // SPLIT_KEYS + 1, num_splits)
        base = (rt * H + h) * num_splits
        m_run = float("-inf")
        l_run = 0.0
        acc_run = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for s in range(0, n):
            m_new, w_run, w_s = _merge_weights(m_run, tl.load(part_m_ptr + base + s))
            l_run = tl.fma(l_run, w_run, tl.load(part_l_ptr + base + s) * w_s)
            acc_run = tl.fma(acc_run, w_run, tl.load(part_acc_ptr + (base + s) * HEAD_DIM + offs_d) * w_s)
            m_run = m_new
        out = acc_run / tl.where(l_run > 0.0, l_run, 1.0)
        tl.store(out_ptr + r * stride_or + h * stride_oh + t * stride_ot + offs_d, out.to(out_ptr.dtype.element_ty))


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


def attention_block_m(tokens: int, group: int, per_tile: int = 1) -> int:
    """Folded rows per attention program for ``tokens`` new tokens of ``group`` query heads per KV head, in a call
    of ``per_tile`` programs per query tile (rows x KV heads): 64 where that puts every token of a row in one program
    (a chain of 16 or a tree of 9-16 nodes at G = 4: each program reads its keys once, not twice);
    :data:`ATTN_LARGE_BLOCK_M` for more than :data:`ATTN_LARGE_MIN_FOLDED` folded rows where that grid still
    launches fused (:func:`attention_fused`: a tree of 64 at C = 8 or of 17 at C = 64, whose programs then read the
    shared prefix half or two thirds as often); else :data:`ATTN_BLOCK_M`. A launch choice, not a bit-fixing one:
    a tensor-core dot's row depends on that row and the tile only, and the tile's reductions are dots or maxima
    (:func:`_softmax_step`); the GPU tests compare chain rows and tree nodes in 64-row programs with their AR steps
    in 32-row ones."""
    folded = tokens * group
    if folded <= ATTN_BLOCK_M:
        return ATTN_BLOCK_M
    if folded <= 64:
        return 64
    if folded <= ATTN_WIDE_BLOCK_M and ATTN_WIDE_MIN_PER_TILE <= per_tile <= ATTN_WIDE_MAX_PER_TILE:
        return ATTN_WIDE_BLOCK_M
    if folded > ATTN_LARGE_MIN_FOLDED and attention_fused(-(-tokens // (ATTN_LARGE_BLOCK_M // group)) * per_tile):
        return ATTN_LARGE_BLOCK_M
    return ATTN_BLOCK_M


def attention_small_tail(tokens: int, group: int, per_tile: int = 1) -> bool:
    """Whether a call's last query tile runs in a program of :data:`ATTN_SMALL_TAIL_ROWS` rows: where its queries
    fill more than one program of :func:`attention_block_m` rows and the last holds at most that many folded rows
    (the kernel tests the same per program). A launch choice, never a bit-fixing one (a tensor-core dot's row
    depends on that row and the tile only)."""
    qt = tail_layout(tokens, group, per_tile)[0]
    last = tokens - (-(-tokens // qt) - 1) * qt  # queries in the last tile
    return bool(ATTN_SMALL_TAIL_ROWS) and tokens > qt and last * group <= ATTN_SMALL_TAIL_ROWS


def launches_fused(tokens: int, group: int, per_tile: int) -> bool:
    """Whether a call of ``tokens`` new tokens of ``group`` query heads per KV head in ``per_tile`` = rows x KV
    heads programs per query tile launches fused: by its grid's size (:func:`attention_fused`), or in wide programs
    where :data:`ATTN_WIDE_FUSED`. A launch choice, never a bit-fixing one."""
    if attention_block_m(tokens, group, per_tile) == ATTN_WIDE_BLOCK_M and ATTN_WIDE_FUSED:
        return True
    return attention_fused(-(-tokens // tail_layout(tokens, group, per_tile)[0]) * per_tile)


def attention_warps(block_m: int) -> int:
    """Warps a program of ``block_m`` folded rows runs: :data:`ATTN_WIDE_WARPS` for wide programs, else
    :data:`ATTN_NUM_WARPS`. A launch choice."""
    return ATTN_WIDE_WARPS if block_m >= ATTN_WIDE_BLOCK_M else ATTN_NUM_WARPS


def attention_fused(programs: int) -> bool:
    """Whether the fused launch serves a call whose grid without splits has ``programs`` programs (query tiles x
    rows x KV heads): where they alone fill the device (:data:`ATTN_FUSED_MIN_PROGRAMS`), splits only add partials
    to write and read back (a chain at C = 64 over 1k keys wrote 134 MB and read 84 MB of them for 34 MB of K/V);
    below it the splits are what spread a long context over the SMs. A launch choice, never a bit-fixing one."""
    return programs >= ATTN_FUSED_MIN_PROGRAMS


def groups_tails(rows: int, tokens: int, group: int, kv_heads: int) -> bool:
    """Whether a forward of ``rows`` x ``tokens`` tree queries should group its tails (:func:`tail_chunks`) rather
    than give each query a chunk of its own (:func:`single_chunks`): where its calls launch fused
    (:func:`attention_fused`), whose programs run their chunks one after another. The split launch runs each chunk
    as a program of its own (:func:`_chunk_splits`), so there the grouping's ninety or so small ops a forward buy
    little. A speed choice: both tables give the same bits."""
    return launches_fused(tokens, group, rows * kv_heads)


def attention_stages(fused: bool, tokens: int) -> int:
    """Software-pipeline stages of a launch: :data:`ATTN_FUSED_ONE_TOKEN_STAGES` for the fused launch of one token
    per row (AR at C = 64: 75 against 85 us, H200, docs/benchmarks.md "Exact mode"), else :data:`ATTN_NUM_STAGES`
    (3 stages cost chains and trees 18-160 us there). A launch choice: the H200 run compared the bits."""
    return ATTN_FUSED_ONE_TOKEN_STAGES if fused and tokens == 1 else ATTN_NUM_STAGES


def supports_head_dim(head_dim: int) -> bool:
    """Head dims the Triton attention takes (one power-of-two block, at least a tensor-core tile)."""
    return head_dim in SUPPORTED_HEAD_DIMS


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, start: Tensor, positions: Tensor,
              anc: Tensor, chain: Tensor, kv_len: int, *, tail: Tensor | None = None,
              split_keys: int = ATTN_SPLIT_KEYS, fused: bool | None = None, num_stages: int | None = None) -> Tensor:
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
    if not supports_head_dim(d):
        raise ConfigError(f"batch_invariant.attention takes head_dim in {SUPPORTED_HEAD_DIMS}, got {d}")
    if split_keys % ATTN_BLOCK_N:
        raise ConfigError(f"batch_invariant.attention: split_keys {split_keys} is not a multiple of {ATTN_BLOCK_N}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ShapeError("batch_invariant.attention: the KV cache must have unit stride over head_dim")
    kv = k_cache.shape[1]
    g = h // kv
    if g > ATTN_BLOCK_M:
        raise ConfigError(f"batch_invariant.attention: {g} query heads per KV head exceed {ATTN_BLOCK_M}")
    block_m = attention_block_m(t, g, r * kv)
    qt, chunk = tail_layout(t, g, r * kv)
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
        fused = launches_fused(t, g, r * kv)
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
        q, k_cache, v_cache, slots, start, positions, anc, chain, tail.contiguous(), out, part_m, part_l, part_acc, state,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        t, g, kv, splits, scale_log2,
        HEAD_DIM=d, BLOCK_M=block_m, QT=qt, BLOCK_N=ATTN_BLOCK_N, TILES_PER_SPLIT=split_keys // ATTN_BLOCK_N,
        SUM_COLS=ATTN_SUM_COLS, TAIL_ROWS=tail_rows(g), CHUNK=chunk, SMALL_M=ATTN_SMALL_TAIL_ROWS or ATTN_SUM_COLS,
        SMALL=attention_small_tail(t, g, r * kv), FUSED=fused, EMULATE=INTERPRETED,
        PRECISION=precision, enable_fp_fusion=FP_FUSION, num_warps=attention_warps(block_m),
        num_stages=num_stages or attention_stages(fused, t),
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
