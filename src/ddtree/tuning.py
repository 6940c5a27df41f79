"""Device tuning tables of the Triton kernels: launch shapes and thresholds measured on the H200, kept apart from
the kernels they parametrise.

Why a module of its own, next to :mod:`ddtree.triton_runtime`: a kernel file holds what the kernel computes and the
limits of what it accepts (head dims, tile sizes it compiles, its largest split count); the numbers below are
choices among shapes it accepts, each with the run that measured it, and they change for another reason (a new
GPU, a new sweep) than the kernel does. Retuning for another device edits this file only; the kernel files
(:mod:`ddtree.models.tree_attention`, :mod:`ddtree.speculative.vocab_topk`) import it and keep no table of their
own. Nothing here reads a setting: every rule is a pure function of host ints (graph capturable).

Contents:

- tree attention (:mod:`ddtree.models.tree_attention`): :func:`choose_tiles` (tiles per regime),
  :func:`choose_splits` (context splits from the row programs' count) and their thresholds; :func:`sm_count`;
  the combine kernel's tile (``COMBINE_BLOCK_M``/``_D``, :func:`choose_combine_tile`).
- vocabulary top-k (:mod:`ddtree.speculative.vocab_topk`): :func:`kernel_takes` (which ``build_trees`` calls use
  the kernel: ``FAST_MAX_K``, ``FAST_MAX_WORK``), the default strategy threshold ``RUNNING_MAX_K`` and the
  "running" strategy's piece size, warps and occupancy target.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# ---- tree attention (ddtree.models.tree_attention) --------------------------------------------------------------

FALLBACK_SM_COUNT = 132  # H100/H200; only used to size splits when the device cannot be asked (interpreter)
WAVES = 2  # aim for this many programs per SM when splitting the context
# ...but give every split at least this many key blocks and make at most AUTO_MAX_SPLITS: a split of one block
# costs a program launch and a partial's round trip for ~1 us of work, and the combine unrolls over the splits.
# Measured on the H200 at one decode token, 1k context: 16 one-block splits spent 0.70 ms per step in attention over
# 36 layers.
MIN_BLOCKS_PER_SPLIT = 4
AUTO_MAX_SPLITS = 16  # what choose_splits picks at most (the kernel accepts up to tree_attention.MAX_SPLITS)
# Calls of several new tokens a row (T > 1: verifies, the drafter's blocks) over long contexts (at least
# LONG_CONTEXT keys) whose row programs are at most one per SM get at least LONG_CONTEXT_MIN_SPLITS splits even
# where WAVES asks fewer (docs/benchmarks.md, run 28, K/V beyond L2: T = 129 at 8k 85.3 -> 79.4 us, T = 65 at 4k
# 36.4 -> 34.2, 8 rows of T = 9 at 8k 103.2 -> 89.0, of T = 17 127.1 -> 120.5). Plain decoding (T = 1) lost with it
# (8 rows at 8k: 74.8 -> 81.1 us) and keeps WAVES (run 29).
LONG_CONTEXT = 4096
LONG_CONTEXT_MIN_SPLITS = 8
# A single request with a short context is latency-bound: a handful of programs with little work each. There,
# smaller row tiles and splits of two key blocks won (H200 sweep, run 10: T = 17 at 1k, 13.4 -> 10.3 us a layer).
LATENCY_BOUND_KV_LEN = 2048
# Tree attention's combine kernel (ddtree.models.tree_attention): its program's tile of [rows x head-dim columns]
# per partial, COMBINE_BLOCK_M x COMBINE_BLOCK_D below, or choose_combine_tile's where they are None. The kernel
# keeps all UNROLL partials' tiles in flight (their loads issued at once), each element with its fp32 value and its
# 64-bit address, so registers bound the tile: with COMBINE_WARPS warps a thread holds rows * cols / (32 * warps)
# elements of each partial, and keeping that times UNROLL at most COMBINE_REGISTER_ELEMS compiles without spilling
# for every UNROLL the kernel uses (benchmarks/combine_registers.py, the ptxas of Triton 3.6 and of 3.9 for sm_90,
# on a CPU: 16 x 16 at UNROLL 17 uses 128 registers; the tile used before the rule, 16 x 64 at decode's 16-row
# split tiles, spills 728 bytes of stack a thread at 17, and 64 x 64 10744 (3.6) or 8904 (3.9); the cost curves'
# dear rounds at 16-32 tree rows over 3-4k keys sat at 64 x 64 with 17 partials: docs/benchmarks.md, "Tree
# attention's combine tile").
COMBINE_WARPS = 4
COMBINE_REGISTER_ELEMS = 40
# The combine's rows and columns, overriding choose_combine_tile's (None: the rule's, the default); rows are capped at
# the split kernel's block_m. The rule replaced the split's rows x 64 columns (128, 64 here) on 2026-12-07 after the
# A/B on one H100 (benchmarks/results/combine_tile_2026-12-07/call.sh; docs/benchmarks.md, "Tree attention's
# combine tile on the H100"): 16 tree rows at one request over 4k keys 70.7 -> 14.9 us a call, 32 rows at 8k 84.6 ->
# 25.6, none of the ten shapes timed slower; the C = 1 / 4k cell's b31 round 10.3 -> 7.7 ms, 493 -> 611 tok/s.
# 128 and 64 give the old tile back (benchmarks/replay_h200.py --combine-block-m 128 --combine-block-d 64).
COMBINE_BLOCK_M: int | None = None
COMBINE_BLOCK_D: int | None = None


def choose_combine_tile(block_m: int, unroll: int, head_dim: int) -> tuple[int, int]:
    """(rows, columns) of one combine program for a split launch of ``block_m`` rows whose combine unrolls over
    ``unroll`` partials of ``head_dim`` columns: the largest tile (powers of two, rows in [16, min(64, block_m)],
    columns in [16, min(64, head_dim)]) whose elements per thread times ``unroll`` stay within
    ``COMBINE_REGISTER_ELEMS``, shrinking rows before columns (a row's columns are contiguous in the partials); 16 x 16 at least. Host ints."""
    rows, cols = min(block_m, 64), min(head_dim, 64)
    budget = COMBINE_REGISTER_ELEMS * 32 * COMBINE_WARPS
    while rows * cols * unroll > budget and (rows > 16 or cols > 16):
        if rows > 16:
            rows //= 2
        else:
            cols //= 2
    return rows, cols


class Tiles(NamedTuple):
    """One launch configuration of the tree-attention split kernel."""

    block_m: int  # folded query rows per program
    block_n: int  # prefix keys per tile
    num_warps: int
    num_stages: int
    min_blocks_per_split: int


def choose_tiles(requests: int, rows: int, kv_len: int, head_dim: int, elem_bytes: int = 2) -> Tiles:
    """Tiles for ``requests`` rows of ``rows = G * T`` folded queries over ``kv_len`` keys, from the H200 sweep of
    ``benchmarks/tree_attention.py`` (run 10, docs/benchmarks/gpu/run10_tree_attention_sweep.json):

    - one request, short context (latency-bound): 16-row tiles and two-block splits; past 128 folded rows (T > 32
      with Qwen3-8B's G = 4) 128-row tiles of 128 keys with 8 warps and splits of 512 keys;
    - otherwise one tile per 64 rows; three pipeline stages from 4k keys on (T = 129 at 8k: 98.9 -> 85.1 us);
    - plain decoding at one request (16 rows or fewer): 128-key tiles.

    The sweep ran bf16. Wider elements (fp32, ``elem_bytes`` 4) and head dims above 128 keep the untuned tiles:
    the tuned ones need more shared memory than an H200 has (fp32 with 128 x 128 tiles asked for 256 KiB)."""
    one_tile = min(64, max(16, _next_power_of_2(rows)))  # one row tile per 64 folded rows, at least 16
    if head_dim > 128 or elem_bytes > 2:
        return Tiles(one_tile, 64 if head_dim <= 128 else 32, 4, 2, MIN_BLOCKS_PER_SPLIT)
    if requests == 1 and kv_len <= LATENCY_BOUND_KV_LEN:
        if rows > 128:
            return Tiles(128, 128, 8, 2, 4)
        return Tiles(16, 64, 4, 2, 2)
    stages = 3 if kv_len >= 4096 else 2
    if requests == 1 and rows <= 16:
        return Tiles(16, 128, 4, stages, 2)
    return Tiles(one_tile, 64, 4, stages, MIN_BLOCKS_PER_SPLIT)


def choose_splits(row_programs: int, kv_len: int, block_n: int, sm_count: int,
                  min_blocks: int = MIN_BLOCKS_PER_SPLIT, multi_token: bool = False) -> int:
    """Context splits per (row, KV head, row tile) so that about ``WAVES * sm_count`` programs run (for a
    ``multi_token`` call, T > 1, at least ``LONG_CONTEXT_MIN_SPLITS`` at long contexts when the row programs are at
    most one per SM), with at least ``min_blocks`` of ``kv_len``'s key blocks per split and at most
    ``AUTO_MAX_SPLITS``. Host ints only: the same shapes always launch the same grid."""
    blocks = max(1, math.ceil(kv_len / block_n))
    wanted = max(1, math.ceil(WAVES * sm_count / row_programs))
    if multi_token and kv_len >= LONG_CONTEXT and row_programs <= sm_count:
        wanted = max(wanted, LONG_CONTEXT_MIN_SPLITS)
    return max(1, min(wanted, blocks // min_blocks, AUTO_MAX_SPLITS))


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` for :func:`choose_splits` (cached: a host query, harmless during
    graph capture); ``FALLBACK_SM_COUNT`` off CUDA (Triton's interpreter)."""
    if device.type != "cuda":
        return FALLBACK_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


# ---- vocabulary top-k (ddtree.speculative.vocab_topk) -----------------------------------------------------------

# build_trees uses the kernel (see kernel_takes) up to FAST_MAX_K candidates per depth, and above RUNNING_MAX_K only
# while rows x width stays within FAST_MAX_WORK. Measured on the H200 (CUDA graphs, L = 15 depths, so a request is
# 15 rows; build + walk against torch.topk + logsumexp): widths 8 and 16 win at R = 1 and 64 requests (V = 151936,
# R = 64, B = 16: 2.72 vs 3.07 ms, docs/benchmarks/gpu/run4_tree_ops.md); widths 31-128 win at R = 1 and 8 (0.08-0.80
# against 0.41-1.12 ms, run 31) and at V = 8192 up to R = 64, B = 128 (0.37 vs 0.93 ms, run 32). At V = 151936 the
# "sort" strategy's per-chunk sorts grow with rows x width: R = 32 wins at B = 32 and 64 (1.42 vs 1.87, 1.80 vs
# 2.04 ms) and loses at 128 (2.68 vs 2.07); R = 64 wins at 32 (2.70 vs 3.05) and loses at 64 (3.47 vs 3.24).
# Width 512 loses (R = 64: 10.8 vs 3.6 ms).
FAST_MAX_K = 128
FAST_MAX_WORK = 32768  # rows x width above RUNNING_MAX_K: 480 x 64 won, 960 x 64 and 480 x 128 lost (run 32)
RUNNING_MAX_K = 16  # strategy=None: "running" up to this k, "sort" above (larger k: not yet timed on the H200)
DEFAULT_CHUNK = 4096  # "extract" / "sort": vocabulary entries per first-stage program (38 per row at V = 151936)
# "running", to be tuned on the H200 with benchmarks/vocab_topk.py: entries per loop step (smaller pieces make each
# insertion cheaper and let more pieces be skipped; larger ones amortise the per-step reduction), a warp per this
# many entries (16 per lane: two 16-byte bf16 loads), and the warps per multiprocessor the splits aim for.
RUNNING_CHUNK = 512
RUNNING_ENTRIES_PER_WARP = 512
RUNNING_WARPS_PER_SM = 16


def kernel_takes(rows: int, k: int) -> bool:
    """Whether :func:`ddtree.speculative.tree.depth_candidates` should use the vocabulary top-k kernel for ``rows``
    rows of top ``k`` (host ints: graph capturable). The H200 measurements behind the limits are at
    :data:`FAST_MAX_K`."""
    return k <= FAST_MAX_K and (k <= RUNNING_MAX_K or rows * k <= FAST_MAX_WORK)
