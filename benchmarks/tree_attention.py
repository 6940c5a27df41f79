"""Tune the tree-attention kernel's tiles on a GPU: time every (block_m, block_n, num_warps, num_stages) at the
verify shapes of the Qwen3-8B stand-in (32 query heads, 8 KV heads of 128, bf16) and print the best against the
current automatic choice.

Why: at 8k context a 129-node tree's attention is ~0.6 TFLOP over 36 layers, so the verify of large trees at long
context is bound by how well this kernel uses the tensor cores; the defaults were picked for small trees.

    python benchmarks/tree_attention.py --out $OUT/tree_attention.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from ddtree.engine.cuda_graphs import warm_up
from ddtree.models import tree_attention as ta


def case(t: int, kv_len: int, rows: int = 1, heads: int = 32, kv_heads: int = 8, d: int = 128):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(rows, heads, t, d, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(rows + 1, kv_heads, kv_len, d, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    vis = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(rows, t, t).contiguous()
    start = torch.full((rows,), kv_len - t, device=dev)
    return dict(q=q, k_cache=k, v_cache=v, slots=torch.arange(rows, device=dev), start=start, new_vis=vis,
                kv_len=kv_len)


def time_ms(fn, reps: int = 20) -> float:
    """Device time of one call, from a CUDA graph of ``reps`` calls (eager timing would measure Python launch
    overhead, ~0.1 ms a call, not the kernels)."""
    warm_up(fn)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / (3 * reps)


def load_baseline(path: str):
    """An older copy of the kernel module (e.g. ``git show REV:src/ddtree/models/tree_attention.py > FILE``) to time
    at its own defaults beside the current one; None if ``path`` is empty or missing."""
    import importlib.util
    import os

    if not path or not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("tree_attention_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tree_attention.json")
    # (T, context, rows): verify shapes of the stand-in's rounds, the ones that cost most first. T = budget + 1
    # (17: b16 and the chain's block), 1: plain decoding, R = 64: concurrency 64.
    ap.add_argument("--shapes", default="17:1024:1,129:8192:1,65:8192:1,17:8192:1,33:4096:1,65:4096:1,129:1024:1,"
                                        "1:1024:1,1:8192:1,9:1024:64,1:1024:64,16:1024:1")
    ap.add_argument("--baseline", default="", help="older tree_attention.py to time at its defaults")
    ap.add_argument("--time-budget", type=float, default=300.0)
    args = ap.parse_args()
    import time

    deadline = time.perf_counter() + args.time_budget
    baseline = load_baseline(args.baseline)
    grid = list(itertools.product((16, 32, 64, 128), (64, 128), (4, 8), (2, 3), (None, 4, 8, 16)))
    results = []
    print("| T | ctx | R | baseline ms | default ms | best ms | best (block_m, block_n, warps, stages, splits) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes.split(","):
        if time.perf_counter() > deadline:
            break
        t, ctx, rows = map(int, shape.split(":"))
        base_case = case(t, ctx, rows=rows)
        base = time_ms(lambda c=base_case: baseline.tree_attention(**c)) if baseline is not None else None
        c = {**base_case, "packed": ta.pack_visibility(base_case["new_vis"])}  # packed once per forward, as there
        default = time_ms(lambda c=c: ta.tree_attention(**c))
        timings = {}
        for config in grid:
            bm, bn, warps, stages, splits = config
            if bm > max(16, 2 ** math.ceil(math.log2(4 * t))) or time.perf_counter() > deadline:
                continue  # more rows per tile than the G * T = 4T folded rows (rounded up) need
            try:
                timings[config] = time_ms(
                    lambda c=c, bm=bm, bn=bn, w=warps, s=stages, sp=splits: ta.tree_attention(
                        **c, block_m=bm, block_n=bn, num_warps=w, num_stages=s, splits=sp))
            except Exception as exc:  # e.g. out of shared memory for the largest tiles
                timings[config] = float("inf")
                print(f"  T={t} ctx={ctx} {config}: {type(exc).__name__}", flush=True)
        if not timings:
            break
        best = min(timings, key=timings.get)
        results.append({"t": t, "context": ctx, "rows": rows, "baseline_ms": base, "default_ms": default,
                        "best_ms": timings[best], "best": best, "all": {str(k): v for k, v in timings.items()}})
        base_s = f"{base:.4f}" if base is not None else "-"
        print(f"| {t} | {ctx} | {rows} | {base_s} | {default:.4f} | {timings[best]:.4f} | {best} |", flush=True)
        with open(args.out, "w") as fh:  # after every shape, so a time-boxed run keeps what it measured
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
