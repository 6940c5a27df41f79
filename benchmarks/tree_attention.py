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

import torch

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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tree_attention.json")
    # Large trees at long context first: they are where the defaults matter most (run 7's sweep, time-boxed at
    # 100 s with the small shapes first, never reached them).
    ap.add_argument("--nodes", default="129,65,17,1")
    ap.add_argument("--contexts", default="8192,1024")
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    grid = list(itertools.product((16, 64, 128), (32, 64), (4, 8), (2, 3), (None, 4, 16)))
    results = []
    print("| T | ctx | default ms | best ms | best (block_m, block_n, warps, stages, splits) |")
    print("| --- | --- | --- | --- | --- |")
    for t, ctx in itertools.product(map(int, args.nodes.split(",")), map(int, args.contexts.split(","))):
        c = case(t, ctx, rows=args.rows)
        default = time_ms(lambda c=c: ta.tree_attention(**c))
        timings = {}
        for config in grid:
            bm, bn, warps, stages, splits = config
            if bm > 16 and bm > 4 * t * 4:  # far more rows per tile than the G * T folded rows
                continue
            try:
                timings[config] = time_ms(
                    lambda c=c, bm=bm, bn=bn, w=warps, s=stages, sp=splits: ta.tree_attention(
                        **c, block_m=bm, block_n=bn, num_warps=w, num_stages=s, splits=sp))
            except Exception as exc:  # e.g. out of shared memory for the largest tiles
                timings[config] = float("inf")
                print(f"  T={t} ctx={ctx} {config}: {type(exc).__name__}", flush=True)
        best = min(timings, key=timings.get)
        results.append({"t": t, "context": ctx, "default_ms": default, "best_ms": timings[best], "best": best,
                        "all": {str(k): v for k, v in timings.items()}})
        print(f"| {t} | {ctx} | {default:.4f} | {timings[best]:.4f} | {best} |", flush=True)
        with open(args.out, "w") as fh:  # after every shape, so a time-boxed run keeps what it measured
            json.dump({"device": torch.cuda.get_device_name(), "rows": args.rows, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
