"""Can cuBLAS serve exact mode's o_proj and down projections? A probe of row-invariance by fixed row chunks.

torch's cuBLAS changes its reduction for these two weights with the row count (o_proj from 64 rows, down from 16:
``../shared/docs/gpu-facts.md``), so exact mode runs them on its Triton kernel, which costs most of exact mode's
price at C = 64 (docs/benchmarks.md, "Exact mode"). But below those thresholds cuBLAS gives every row the bits of the
row alone. So a call of M rows could run as ceil(M / c) chunks of c rows below the threshold, in one strided batched
GEMM (``torch.bmm`` over the chunks, the weight's batch stride 0): invariant if cuBLAS picks the same kernel for
every batch count. Or (``--pad``) a call of fewer than R rows could be padded to R rows: invariant if cuBLAS computes
every row count from R up the same way. This measures, on the running device:

- for each chunk size c (each pad R with ``--pad``), the first row count (1 .. 2048) whose rows differ from the rows alone
  (``exact_blas.check_row_invariance`` with the chunked matmul), and the same for plain ``F.linear``;
- microseconds per call (CUDA-graph replays, median) of ``F.linear``, exact mode's Triton ``linear`` and each
  chunked matmul, at 1 .. 2048 rows.

    python benchmarks/cublas_chunk_probe.py --out $OUT       # H200, Qwen3-8B's shapes, bf16
    python benchmarks/cublas_chunk_probe.py --out $OUT --pad
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.models import batch_invariant as bi
from ddtree.models.exact_blas import check_row_invariance, pinned_blas

SHAPES = {"o_proj": (4096, 4096), "down": (4096, 12288)}
CHUNKS = (8, 15, 16, 32, 48, 63)
PADS = (16, 32, 64, 65, 128, 129, 256)
COUNTS = (1, 2, 8, 15, 16, 17, 32, 48, 63, 64, 65, 128, 129, 256, 257, 512, 767, 1024, 1536, 2048)
PAD_COUNTS = tuple(range(1, 301)) + tuple(range(304, 2049, 16)) + (1088, 1089, 2047)
TIMED_ROWS = (1, 16, 64, 256, 1024, 2048)
PAD_TIMED_ROWS = (1, 8, 17, 68, 136, 272, 544, 1024, 1088, 1360, 1664)


def chunked(c: int):
    """x [M, K] @ w [N, K]^T as ceil(M / c) chunks of c rows (zero padding) in one batched GEMM."""
    def matmul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        m, k = x.shape
        chunks = -(-m // c)
        xp = x if chunks * c == m else F.pad(x, (0, 0, 0, chunks * c - m))
        out = torch.bmm(xp.view(chunks, c, k), w.t().expand(chunks, k, w.shape[0])).view(chunks * c, -1)[:m]
        return out if b is None else out + b
    return matmul


def padded(r: int):
    """x [M, K] @ w [N, K]^T as one ``F.linear`` of max(M, r) rows (zero rows below x's)."""
    def matmul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        return F.linear(x if m >= r else F.pad(x, (0, 0, 0, r - m)), w, b)[:m]
    return matmul


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--pad", action="store_true", help="pad small calls to R rows instead of chunking them")
    args = ap.parse_args()
    from triton.testing import do_bench_cudagraph

    dev = torch.device("cuda")
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "weights": {}}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
        entry: dict = {"first_failing": {}, "us": {}}
        if args.pad:
            matmuls = {"linear": F.linear, **{f"pad{r}": padded(r) for r in PADS}}
        else:
            matmuls = {"linear": F.linear, **{f"chunk{c}": chunked(c) for c in CHUNKS}}
        counts, timed_rows = (PAD_COUNTS, PAD_TIMED_ROWS) if args.pad else (COUNTS, TIMED_ROWS)
        for label, fn in matmuls.items():
            check = check_row_invariance({name: (w, None)}, counts, matmul=fn, pads=())
            entry["first_failing"][label] = check.first_failing[name]
        x = torch.randn(max(timed_rows), k, device=dev, dtype=torch.bfloat16)
        timed = {"linear": F.linear, "triton": bi.linear,
                 **{label: fn for label, fn in matmuls.items() if entry["first_failing"][label] is None}}
        with pinned_blas(dev):
            for label, fn in timed.items():
                entry["us"][label] = {m: round(do_bench_cudagraph(lambda fn=fn, xm=x[:m], w=w: fn(xm, w), rep=50) * 1e3, 1)
                                      for m in timed_rows}
        result["weights"][name] = entry
        print(name, "first failing row count:", entry["first_failing"], flush=True)
        for label, us in entry["us"].items():
            print(f"  {label:>8} us at rows {list(us)}: {list(us.values())}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("cublas_pad_probe.json" if args.pad else "cublas_chunk_probe.json")).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
