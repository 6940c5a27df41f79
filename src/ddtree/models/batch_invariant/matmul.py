"""Exact mode's matmul: ``F.linear`` whose result for one row does not depend on the other rows (the package docstring).

What fixes the bits is a function of the weight's shape only (:func:`matmul_tiles`: BLOCK_K and the split count);
how the programs are laid out may follow the row count (:func:`matmul_launch`, the launch tables timed on the H200
and H100) and never changes a bit. :func:`linear` runs the Triton kernels (:mod:`.matmul_kernels`);
:func:`linear_rows` is the torch path, one row a call, for devices Triton cannot run on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ddtree.errors import ConfigError, ShapeError
from ddtree.triton_runtime import FP_FUSION, INTERPRETED, TensorDescriptor, triton

if triton is not None:
    from ddtree.models.batch_invariant.matmul_kernels import (
        _matmul_kernel,
        _matmul_tma_kernel,
        _split_sum_kernel,
    )

# ---- constants (changing one changes exact mode's bits, never its invariance) --------------------------------------
MATMUL_MAX_BLOCK_N = 128
MATMUL_MAX_BLOCK_K = 64
# Split-K is chosen from the weight's shape so that about this many programs stream a weight at one tile of rows
# (decoding is bandwidth-bound: o_proj's 32 column tiles alone would leave most of an H200's 132 SMs idle).
MATMUL_TARGET_PROGRAMS = 160
MATMUL_MAX_SPLIT_K = 4  # 8 measured no faster at decode and slower on wide calls (H200)
MATMUL_MIN_K_BLOCKS_PER_SPLIT = 4


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



def pow2_at_least(n: int, lo: int) -> int:
    """The least power of two >= n and >= lo: a tile's extent (the matmul's BLOCK_N/BLOCK_K, attention's tail rows)."""
    return max(lo, 1 << max(0, n - 1).bit_length())


def matmul_tiles(n: int, k: int) -> MatmulTiles:
    """The bit-fixing part of a weight [n, k]'s configuration (of the weight's shape only, never of the rows)."""
    block_n = min(MATMUL_MAX_BLOCK_N, pow2_at_least(n, 16))
    block_k = min(MATMUL_MAX_BLOCK_K, pow2_at_least(k, 16))
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
