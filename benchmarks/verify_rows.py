"""What one verify forward of the target costs against the number of tree nodes it carries, on the GPU (CUDA
graphs, the Qwen3-8B stand-in): T = 1 (plain decoding) up to 257 nodes, at given contexts.

Why: a DDTree tree of budget B verifies B + 1 rows (the root is the last round's bonus token), so the powers of
two that users sweep (16, 32, 64, 128) put 17, 33, 65 and 129 rows through the GEMMs. In run 30 a verify at
context 60 cost 0.01 / 0.31 / 0.47 / 1.05 ms more than the chain's 16 rows for 17 / 33 / 65 / 129 rows, while a
linear-layers-only forward grew ~0.1 ms from 8 to 64 tokens (`gpu-facts.md`). This times the forward alone at
each row count (16 against 17, 32 against 33, ...) to say how much of that is the row count crossing a GEMM tile.

    python benchmarks/verify_rows.py --out $OUT/verify_rows.json --contexts 60,4096

``--device cpu`` is a dry run on the demo pair itself (eager, no stand-in), for the script's test.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ddtree.engine import EngineConfig
from ddtree.engine.kernels import KernelSet
from ddtree.lab.bench.kernel_timing import (  # the kernel scripts' stand-in and graph timing
    load_standin_pair,
    time_ms,
)
from ddtree.speculative.attention import TreeVisibility

DEFAULT_ROWS = "1,16,17,32,33,48,63,64,65,96,127,128,129,256,257"


def _timer(fn, cuda: bool, reps: int) -> float:
    """ms per call: from a CUDA graph of ``reps`` calls on a GPU (the engine replays graphs; eager timing would
    measure Python launches), from plain calls on a CPU."""
    if cuda:
        return time_ms(fn, reps)
    fn()
    begin = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - begin) * 1e3 / reps


@torch.inference_mode()
def measure(contexts: list[int], rows: list[int], device: str = "cuda", reps: int = 10, *,
            blas_rule: bool = True) -> dict:
    """{context: {T: ms}} for a causal chain of T new tokens after a committed context (a tree's visibility costs
    the same in the kernel: it reads per-query bits either way)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    target, drafter = load_standin_pair(dev)
    kernels = KernelSet.resolve(EngineConfig(gpu_kernels=cuda, blas_rule=blas_rule), target, drafter)
    hidden_layers = tuple(drafter.config.target_layer_ids)  # a verify also hands the drafter its features
    cache = target.allocate_cache(1, max(contexts) + max(rows) + 16)
    slots = torch.zeros(1, dtype=torch.long, device=dev)
    results: dict[int, dict[int, float]] = {}
    for ctx in contexts:
        ids = torch.randint(0, target.config.vocab_size, (1, ctx), device=dev)
        pos = torch.arange(ctx, device=dev)[None]
        vis = torch.ones(ctx, ctx, dtype=torch.bool, device=dev).tril()[None]
        target(ids, pos, cache, slots, pos, TreeVisibility(slots, vis, ctx), kernels=kernels)  # the context's K/V
        start = torch.tensor([ctx], device=dev)
        results[ctx] = {}
        for t in rows:
            x = torch.randint(0, target.config.vocab_size, (1, t), device=dev)
            p = ctx + torch.arange(t, device=dev)[None]
            tree = TreeVisibility(start, torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None], ctx + t)

            def forward(x=x, p=p, tree=tree):  # every node's logits (logits_at None), as a verify needs
                target(x, p, cache, slots, p, tree, kernels=kernels, hidden_layers=hidden_layers)

            results[ctx][t] = _timer(forward, cuda, reps)
            print(f"context {ctx}, {t} rows: {results[ctx][t]:.3f} ms", flush=True)
    return results


def table(results: dict[int, dict[int, float]]) -> str:
    contexts = list(results)
    rows = list(next(iter(results.values())))
    lines = ["| rows | " + " | ".join(f"ms at context {c}" for c in contexts) + " |",
             "| --- | " + " | ".join("---" for _ in contexts) + " |"]
    for t in rows:
        lines.append(f"| {t} | " + " | ".join(f"{results[c][t]:.3f}" for c in contexts) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="verify_rows.json")
    ap.add_argument("--contexts", default="60,4096")
    ap.add_argument("--rows", default=DEFAULT_ROWS, help="comma list of new tokens a forward carries")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--blas", choices=("rule", "cublas", "cublaslt"), default="rule",
                    help="the library for every matmul, or the engine's choice by row count (ddtree.models."
                         "gemm_backend, KernelSet.blas_rule)")
    args = ap.parse_args(argv)
    if args.blas != "rule":  # cuBLAS and cuBLASLt pick different kernels for the skinny shapes of decoding
        torch.backends.cuda.preferred_blas_library(args.blas)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(t) for t in args.rows.split(",")]
    results = measure(contexts, rows, args.device, args.reps, blas_rule=args.blas == "rule")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run, demo pair)"
    with open(args.out, "w") as fh:
        ms = {str(c): {str(t): v for t, v in r.items()} for c, r in results.items()}
        json.dump({"device": device, "blas": args.blas, "ms": ms}, fh, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()
