"""Which cuBLAS front end runs a forward's matmuls, chosen by how many token rows the forward carries.

Why: torch sends a bf16 matmul to cuBLAS (``cublasGemmEx``) or to cuBLASLt, and the two pick different kernels
for the skinny shapes of decoding. On the H200, a whole Qwen3-8B-shaped target forward (runs 31-32,
``benchmarks/verify_rows.py --blas``, docs/benchmarks.md) took 0.15-0.2 ms less through cuBLASLt at 32 to 97
rows (a tree verify of budget 31 to 96), 0.35 ms less at 192, and about the same at 24, 128 and 136; 0.06 ms more
at 16 and 17 rows (the chain's verify, one request's draft block) and at 256; at 1 and 8 rows the two tie. A CUDA
graph keeps the kernels chosen when it was captured, so choosing per forward also holds for the engine's
replays. Off CUDA nothing changes.

The choice is torch's process-wide ``torch.backends.cuda.preferred_blas_library``, set for the forward and
restored after it: an engine runs its forwards on one thread. Matmuls that another thread runs meanwhile (a second
engine, a training step) may go through either library; both compute the same product, rounded differently in
the last bits, the same kind of difference that different row counts already make (cuBLAS picks other kernels;
docs/benchmarks.md reports the bf16 divergence from AR it causes). Autograd's backward runs after the forward
returns, under the caller's own choice.

Whether the rule applies is the caller's: ``KernelSet.blas_rule`` (``EngineConfig.blas_rule``; off for an A/B,
``benchmarks/gpu.py --no-blas-rule``) reaches :func:`blas_for_rows` as ``rule``. Nothing here is a setting.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Token rows (all requests' new tokens together) for which cuBLASLt ran the forward faster on the H200, or as fast;
# outside the range cuBLAS stays (slower through cuBLASLt at 16, 17 and 256 rows; erratic above: 384 faster, 512
# to 2048 the same).
LT_MIN_ROWS = 32
LT_MAX_ROWS = 192


def prefers_lt(rows: int, device: torch.device) -> bool:
    """Whether a forward of ``rows`` token rows on ``device`` runs its matmuls through cuBLASLt."""
    return device.type == "cuda" and LT_MIN_ROWS <= rows <= LT_MAX_ROWS


@contextmanager
def blas_for_rows(rows: int, device: torch.device, *, rule: bool = True) -> Iterator[None]:
    """Run the body's matmuls through the front end :func:`prefers_lt` picks for ``rows`` token rows; with
    ``rule=False`` (``KernelSet.blas_rule`` off) under torch's current choice, untouched."""
    if not (rule and prefers_lt(rows, device)):
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)
