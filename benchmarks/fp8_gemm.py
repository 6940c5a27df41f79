"""Would fp8 drafter weights pay? Time the drafter's four GEMMs per layer (the z-lab Qwen3-8B-DFlash-b16 body:
hidden 4096, 32/8 heads of 128, intermediate 12288) in bf16 and as ``torch._scaled_mm`` in fp8 (e4m3), at the row
counts a draft runs (16 per request: C = 1, 2, 8, 64), CUDA-graph timed on the GPU.

Why: at concurrency 1 the draft stage (~0.78 ms of a ~6 ms DDTree round on the stand-in) is mostly reading the
drafter's 2 GB of weights, and it is what keeps DDTree's efficiency (speed-up / acceptance) near 0.8: halving
those bytes is the one large lever left on the draft. Not wired into the engine (see docs/benchmarks.md).

Columns: bf16 ``F.linear``; fp8 with one scale per tensor (cuBLASLt); fp8 with a scale per row of the activations
and per output channel (CUTLASS); the eager per-row activation quantisation (abs-max, divide, cast) alone.

    python benchmarks/fp8_gemm.py --out $OUT/fp8_gemm.md
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ddtree.lab.bench.kernel_timing import time_ms  # the same graph timing as the tile sweep

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # (N, K)
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def graph_time_us(fn, calls: int = 50) -> float:
    """Mean microseconds per call of ``fn``, from a CUDA graph of ``calls`` calls (no launch overhead)."""
    return 1e3 * time_ms(fn, reps=calls)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x / scale).to(E4M3), scale


def time_gemm(m: int, n: int, k: int, dev: torch.device) -> tuple[float, float, float, float]:
    """(bf16, fp8 per tensor, fp8 per row, row quantisation) microseconds for x [m, k] @ w [n, k]^T."""
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    w_scale = w.abs().amax().float() / E4M3_MAX
    w_t = (w / w_scale).to(E4M3)
    w_col = w.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX
    w_r = (w / w_col).to(E4M3)
    w_col = w_col.t().contiguous()
    x_q, x_scale = quantize_rows(x)
    one = torch.ones((), device=dev)
    return (
        graph_time_us(lambda: F.linear(x, w)),
        graph_time_us(lambda: torch._scaled_mm(x_q, w_t.t(), scale_a=one, scale_b=w_scale,
                                               out_dtype=torch.bfloat16)),
        graph_time_us(lambda: torch._scaled_mm(x_q, w_r.t(), scale_a=x_scale, scale_b=w_col,
                                               out_dtype=torch.bfloat16)),
        graph_time_us(lambda: quantize_rows(x)),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,32,128,1024")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lines = ["| rows | GEMM | bf16 MB | bf16 us | fp8 per-tensor us | fp8 per-row us | row quantisation us |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    totals = []
    for m in (int(r) for r in args.rows.split(",")):
        total = [0.0, 0.0, 0.0]
        for name, (n, k) in SHAPES.items():
            times = time_gemm(m, n, k, dev)
            for i in range(3):
                total[i] += times[i]
            lines.append(f"| {m} | {name} | {n * k * 2 / 1e6:.0f} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
        totals.append(f"rows {m}: one drafter layer's GEMMs {total[0]:.1f} us in bf16, {total[1]:.1f} in fp8 per "
                      f"tensor ({total[0] / total[1]:.2f}x), {total[2]:.1f} in fp8 per row")
    text = "\n".join([f"fp8 vs bf16 GEMMs of the Qwen3-8B DFlash drafter's layer, {torch.cuda.get_device_name()}, "
                      f"torch {torch.__version__}", ""] + lines + [""] + totals) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
