"""Which of the target's matmuls torch's cuBLAS already computes row-invariantly, measured on the running device.

Why: exact mode needs every token row computed the same way whatever the row count, and its own Triton matmul
(:func:`ddtree.models.batch_invariant.linear`) guarantees that by construction, at 90-95 % of cuBLAS's speed on wide
calls with tensor-descriptor loads on the H200 and 58-60 % without (docs/benchmarks.md, "Exact mode"). But cuBLAS changes its reduction (split-K) with the row count only for
some weight shapes: on the H200 (torch 2.11, cuBLAS 13) the fused q/k/v and gate/up projections gave bit-identical
rows at every row count 1..2048, while o_proj and down changed from 25 and 9 rows (``../shared/docs/gpu-facts.md``).
That is a property of the device, the library version and the shape, not a promise, so it is *checked* at engine
start for every row count the engine can run (:func:`check_row_invariance`), and only the weights that pass go to
cuBLAS; the rest stay on the Triton kernel.

The check: a random weight of the shape (and a random bias where the layer has one) and ``D`` distinct random
rows computed one at a time (``F.linear`` of one row, as a single decode step of one request computes them) are the
reference; for every row count M, ``F.linear`` of M rows (row i a copy of reference row ``i mod D``) must equal the
references bit for bit at every position. Kernel choice depends on the shapes (and bias, dtype, layout), not on the
values, so the result holds for every weight of that shape; random values are what make a changed reduction show.
Not the model's own weights: where those are structured, a changed reduction can leave the bits alone by accident
(the Qwen3-8B stand-in's zero-padded o_proj and down passed with its layer 0's weights, 2026-12-01), which says
nothing about the next weight of that shape.

A weight that fails gets a second chance by padding: cuBLAS changes its reduction where few rows leave the device
idle (split-K for narrow outputs against the reduction), so from some row count R up it may compute every row count
the same way. Then a call of fewer than R rows padded with zero rows to R (:func:`linear_padded`) gives each row the
bits of every larger call, and the weight goes to cuBLAS padded. The check tries the pads of :data:`PAD_ROWS` in
turn, each against rows computed alone *padded* (so the reference is the R-row call) at every row count.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ddtree.errors import ConfigError

log = logging.getLogger("ddtree.exact")

DISTINCT_ROWS = 256  # reference rows computed alone; larger row counts repeat them
# Pads tried, smallest first, for a weight whose plain calls change with the row count. A pad is paid by every call
# of fewer rows (a decode step pays R rows), so the list stops where that outweighs what cuBLAS saves on wide calls:
# on the H100 (docs/benchmarks.md, "Exact mode", 2026-12-06 pads) o_proj passed padded to 32 and cost 10.7 us at one
# row (64: 11.9, 128: 17.2) against the Triton matmul's 8.8, while down passed only at 256, at 56.6 us a decode row
# against Triton's 39.2 (+0.6 ms a decode round over 36 layers) and slower than Triton up to about 200 rows.
PAD_ROWS = (16, 32, 64)


BLAS_LIBRARY = "cublas"  # the library the check measures and exact mode's forward then runs


@contextlib.contextmanager
def pinned_blas(device: torch.device) -> Iterator[None]:
    """torch's matmuls on :data:`BLAS_LIBRARY` inside the block (the check and exact mode's forward alike), the
    process-wide choice restored after it: the default engine's rule (``models.gemm_backend``) switches to cuBLASLt
    for some row counts, whose kernels the check did not measure. Like that rule it is one process-wide setting, so
    a second engine's forward on another thread at the same moment could still switch it; a graph replays the
    kernels it captured either way. Off CUDA nothing changes."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(BLAS_LIBRARY)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def linear_padded(x: Tensor, weight: Tensor, bias: Tensor | None = None, rows: int = 1,
                  matmul: Callable[..., Tensor] = F.linear) -> Tensor:
    """``matmul(x, weight, bias)`` (x [..., K] -> [..., N]) as one call of at least ``rows`` rows: x's rows
    flattened and, if fewer, followed by zero rows, whose products are dropped."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m >= rows:
        return matmul(x2.contiguous(), weight, bias).reshape(*lead, weight.shape[0])
    return matmul(F.pad(x2, (0, 0, 0, rows - m)), weight, bias)[:m].reshape(*lead, weight.shape[0])


@dataclass(frozen=True)
class BlasCheck:
    """The check's result: per named weight, the first row count whose rows differ from the rows alone (None:
    none of ``row_counts`` did, so that shape goes to cuBLAS), and for weights that failed but passed padded, the
    pad (calls of fewer rows padded to it: :func:`linear_padded`)."""

    first_failing: Mapping[str, int | None]
    shapes: Mapping[str, tuple[int, int]]  # name -> (N, K)
    row_counts: int  # how many distinct row counts were checked
    max_rows: int
    seconds: float
    library: str  # torch and CUDA versions the result holds for
    pad_rows: Mapping[str, int] = field(default_factory=dict)  # name -> pad, for weights that passed only padded

    def _passed(self, name: str) -> bool:
        return self.first_failing[name] is None or name in self.pad_rows

    @property
    def trusted(self) -> tuple[tuple[int, int, int], ...]:
        """(N, K, pad) of the shapes whose cuBLAS matmul passed (a shape of several weights passes only if all did;
        pad 1: unpadded; a shape's pad is the largest its weights needed: a pass at R implies one at every larger
        pad, whose calls are calls of at least R rows)."""
        failed = {self.shapes[n] for n in self.first_failing if not self._passed(n)}
        pads: dict[tuple[int, int], int] = {}
        for n in self.first_failing:
            if self._passed(n) and self.shapes[n] not in failed:
                pads[self.shapes[n]] = max(pads.get(self.shapes[n], 1), self.pad_rows.get(n, 1))
        return tuple(sorted((*shape, pad) for shape, pad in pads.items()))

    def describe(self) -> dict:
        return {"cublas": sorted(n for n, m in self.first_failing.items() if m is None),
                "cublas_padded": {n: f"calls padded to {r} rows (plain calls differ from {self.first_failing[n]})"
                                  for n, r in sorted(self.pad_rows.items())},
                "triton": {n: f"rows differ from {m} rows" for n, m in self.first_failing.items()
                           if not self._passed(n)},
                "row_counts_checked": self.row_counts, "max_rows": self.max_rows,
                "seconds": round(self.seconds, 3), "library": self.library}


@torch.inference_mode()
def check_row_invariance(weights: Mapping[str, tuple[Tensor, Tensor | None]], row_counts: Iterable[int], *,
                         distinct_rows: int = DISTINCT_ROWS, seed: int = 0,
                         matmul: Callable[..., Tensor] = F.linear, pads: Iterable[int] | None = None) -> BlasCheck:
    """Check ``matmul`` (``F.linear``, what exact mode then calls) for the shape of each named (weight [N, K], bias
    [N] or None; their shapes, dtype and device are used, with random values) at every row count in ``row_counts``
    against its rows computed alone (module docstring). A weight stops at its first failing row count; one that
    failed is checked again padded to each of ``pads`` (default :data:`PAD_ROWS`) in turn, smallest first, until one
    passes."""
    counts = sorted({int(m) for m in row_counts if m > 0})
    t0 = time.perf_counter()
    first: dict[str, int | None] = {}
    pad_rows: dict[str, int] = {}
    shapes: dict[str, tuple[int, int]] = {}
    if not counts:
        raise ValueError("check_row_invariance needs at least one row count")
    max_rows = counts[-1]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, (weight, bias) in weights.items():
        try:
            with pinned_blas(weight.device):
                first[name] = _first_failing(weight, bias, counts, gen, distinct_rows, matmul)
                for r in sorted(set(PAD_ROWS if pads is None else pads)) if first[name] is not None else ():
                    padded = functools.partial(linear_padded, rows=r, matmul=matmul)
                    if _first_failing(weight, bias, counts, gen, distinct_rows, padded) is None:
                        pad_rows[name] = r
                        break
        except torch.OutOfMemoryError as exc:  # the engine's own shapes are too large for the device: say which
            n, k = weight.shape
            need = max_rows * (n + k) * weight.element_size() / 2**30
            raise ConfigError(f"exact mode's start-up check ran out of device memory checking {name} ([{n}, {k}]) at "
                              f"up to {max_rows} rows (about {need:.1f} GiB for its input and product): a target "
                              f"forward can carry that many token rows (a prefill step of max_batch rows padded to "
                              f"the widest, up to prefill_chunk tokens); lower prefill_chunk or max_batch") from exc
        shapes[name] = tuple(weight.shape)
    result = BlasCheck(first_failing=first, shapes=shapes, row_counts=len(counts), max_rows=max_rows,
                       seconds=time.perf_counter() - t0, library=f"torch {torch.__version__}, CUDA {torch.version.cuda}",
                       pad_rows=pad_rows)
    info = result.describe()
    log.info("exact mode: cuBLAS row-invariant for %s at %d row counts up to %d (%.2f s), padded for %s; Triton for %s",
             info["cublas"], len(counts), max_rows, result.seconds, info["cublas_padded"], info["triton"])
    return result


def _first_failing(weight: Tensor, bias: Tensor | None, counts: list[int], gen: torch.Generator, distinct_rows: int,
                   matmul: Callable[..., Tensor]) -> int | None:
    n, k = weight.shape
    max_rows = counts[-1]
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device=weight.device, dtype=weight.dtype)
    b = None if bias is None else torch.randn(n, generator=gen).to(device=bias.device, dtype=bias.dtype)
    d = min(distinct_rows, max_rows)
    base = torch.randn(d, k, generator=gen).to(device=w.device, dtype=w.dtype)
    alone = torch.cat([matmul(base[i:i + 1], w, b) for i in range(d)])  # [D, N]
    reps = -(-max_rows // d)
    x = base.repeat(reps, 1)[:max_rows]
    for m in counts:
        # against the rows alone without a [max_rows, N] copy of them beside the product (at 64 rows x a
        # 4096-token prefill step that copy of gate/up's product alone is 13 GB)
        out = matmul(x[:m], w, b)
        if not _equals_repeated(out, alone):
            return m
        del out
    return None


def _equals_repeated(out: Tensor, alone: Tensor, block_rows: int = 8192) -> bool:
    """Whether ``out`` [M, N] equals ``alone`` [D, N] repeated down its rows (row i against row i mod D), compared
    about ``block_rows`` rows at a time (whole repeats of D), so no [M, N] copy is made."""
    d, n = alone.shape
    step = max(1, block_rows // d) * d
    for i in range(0, out.shape[0], step):
        part = out[i:i + step]
        full = part.shape[0] // d * d
        if full and not torch.equal(part[:full].reshape(-1, d, n), alone.expand(full // d, d, n)):
            return False
        if full < part.shape[0] and not torch.equal(part[full:], alone[:part.shape[0] - full]):
            return False
    return True
