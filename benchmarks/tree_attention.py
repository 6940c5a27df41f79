"""Tune the tree-attention kernel's tiles on a GPU: time every (block_m, block_n, num_warps, num_stages) at the
verify shapes of the Qwen3-8B stand-in (32 query heads, 8 KV heads of 128, bf16) and print the best against the
current automatic choice.

Why: at 8k context a 129-node tree's attention is ~0.6 TFLOP over 36 layers, so the verify of large trees at long
context is bound by how well this kernel uses the tensor cores; the defaults were picked for small trees.

Each timed call reads its own copy of the K/V cache (enough copies for ~3x the L2), as a layer of the engine reads
keys the L2 no longer holds; ``--l2-resident`` repeats one copy (runs 7-26 did, and run 26 shows it misleads).

    python benchmarks/tree_attention.py --out $OUT/tree_attention.json
    python benchmarks/tree_attention.py --out $OUT/ta.json --shapes 8:4096:1,16:4096:1,32:4096:2,16:4096:4,32:4096:4 \
        --combine-tiles rule,16x32 --block-m 64 --block-n 64 --warps 4 --stages 3 --splits none   # combine
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from ddtree import tuning
from ddtree.lab.bench.kernel_timing import time_ms
from ddtree.models import tree_attention as ta


def case(t: int, kv_len: int, rows: int = 1, heads: int = 32, kv_heads: int = 8, d: int = 128,
         copies: int = 1) -> list[dict]:
    """One verify shape's inputs, ``copies`` times over with distinct K/V caches (the queries, slots and
    visibility are shared): :func:`time_ms` cycles through them so that a timed call reads its keys from HBM, as
    the engine's 36 layers do, instead of from the L2 cache the previous call left them in."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(rows, heads, t, d, device=dev, dtype=torch.bfloat16, generator=gen)
    vis = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(rows, t, t).contiguous()
    start = torch.full((rows,), kv_len - t, device=dev)
    cases = []
    for _ in range(copies):
        k = torch.randn(rows + 1, kv_heads, kv_len, d, device=dev, dtype=torch.bfloat16, generator=gen)
        cases.append(dict(q=q, k_cache=k, v_cache=torch.randn_like(k), slots=torch.arange(rows, device=dev),
                          start=start, new_vis=vis, kv_len=kv_len))
    return cases


def copies_beyond_l2(kv_len: int, rows: int, kv_heads: int = 8, d: int = 128) -> int:
    """K/V copies whose bytes read together are ~3x the GPU's L2 (60 MiB as torch reports an H200's), at most 64: a
    4k-context call at one row reads 16.8 MB, which an L2 holds, so repeating one call times L2 reads (run 26 tuned
    decode tiles that way and the engine did not get faster). Calls read slots 0..rows-1 of a case's rows + 1
    (runs 27-29 counted the unread scratch slot too, so at one row they cycled through ~1.6x the L2)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    per_call = 2 * rows * kv_heads * kv_len * d * 2  # K and V, bf16
    return max(1, min(64, math.ceil(3 * l2 / per_call)))


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
    # The tile grid, each a comma list ("none" among the splits: choose_splits' count for those tiles).
    ap.add_argument("--block-m", default="16,32,64,128")
    ap.add_argument("--block-n", default="64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--splits", default="none,4,8,16")
    ap.add_argument("--combine-tiles", default="",
                    help="also time the default launch with the combine over these tiles, ROWSxCOLUMNS per program "
                         "(rows capped at the split's block_m) or rule (tuning.choose_combine_tile's): the "
                         "combine-tile column")
    ap.add_argument("--l2-resident", action="store_true",
                    help="time one K/V copy over and over (runs 7-26 did; it favours tiles that only win from L2)")
    args = ap.parse_args()
    import time

    deadline = time.perf_counter() + args.time_budget
    baseline = load_baseline(args.baseline)

    def ints(text: str) -> list[int | None]:
        return [None if item == "none" else int(item) for item in text.split(",")]

    grid = list(itertools.product(ints(args.block_m), ints(args.block_n), ints(args.warps), ints(args.stages),
                                  ints(args.splits)))
    results = []
    print("| T | ctx | R | baseline ms | default ms | default, combine tile: ms | best ms | best (block_m, block_n, warps, "
          "stages, splits) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes.split(","):
        if time.perf_counter() > deadline:
            break
        t, ctx, rows = map(int, shape.split(":"))
        base_cases = case(t, ctx, rows=rows, copies=1 if args.l2_resident else copies_beyond_l2(ctx, rows))
        packed = ta.pack_visibility(base_cases[0]["new_vis"])  # packed once per forward, as there
        cs = [{**c, "packed": packed} for c in base_cases]
        # The baseline gets the packed visibility too (a module from before packing existed gets none), so both
        # columns time the attention alone.
        base_cs = cs if baseline is not None and hasattr(baseline, "pack_visibility") else base_cases
        base = time_ms([lambda c=c: baseline.tree_attention(**c) for c in base_cs]) if baseline is not None else None
        default = time_ms([lambda c=c: ta.tree_attention(**c) for c in cs])
        combine = {}
        q, k_cache = cs[0]["q"], cs[0]["k_cache"]  # the launch these calls plan, from the case's own shapes
        plan = ta.plan_launch(rows, q.shape[1], k_cache.shape[1], t, q.shape[3], ctx, q.element_size(),
                              tuning.sm_count(q.device))
        split_m = plan.block_m
        for tile in filter(None, args.combine_tiles.split(",")):
            if tile == "rule":
                cm, cd = tuning.choose_combine_tile(split_m, max(plan.combine_splits, 1), q.shape[3])
            else:
                cm, cd = (int(v) for v in tile.split("x"))
            try:
                combine[tile] = time_ms([lambda c=c, m=min(cm, split_m), d=cd: ta.tree_attention(
                    **c, combine_block_m=m, combine_block_d=d) for c in cs])
            except Exception as exc:  # a tile the kernel does not take: named, not timed
                print(f"  T={t} ctx={ctx} combine tile {tile}: {type(exc).__name__}: {exc}", flush=True)
        timings = {}
        for config in grid:
            bm, bn, warps, stages, splits = config
            if bm > max(16, 2 ** math.ceil(math.log2(4 * t))) or time.perf_counter() > deadline:
                continue  # more rows per tile than the G * T = 4T folded rows (rounded up) need
            try:
                timings[config] = time_ms([
                    lambda c=c, bm=bm, bn=bn, w=warps, s=stages, sp=splits: ta.tree_attention(
                        **c, block_m=bm, block_n=bn, num_warps=w, num_stages=s, splits=sp) for c in cs])
            except Exception as exc:  # e.g. out of shared memory for the largest tiles
                timings[config] = float("inf")
                print(f"  T={t} ctx={ctx} {config}: {type(exc).__name__}", flush=True)
        if not timings:
            if time.perf_counter() > deadline:
                break
            continue  # no tile of the grid fits this shape
        best = min(timings, key=timings.get)
        results.append({"t": t, "context": ctx, "rows": rows, "kv_copies": len(cs), "baseline_ms": base,
                        "default_ms": default, "combine_ms": combine, "best_ms": timings[best], "best": best,
                        "all": {str(k): v for k, v in timings.items()}})
        base_s = f"{base:.4f}" if base is not None else "-"
        comb = ", ".join(f"{m}: {v:.4f}" for m, v in combine.items()) or "-"
        print(f"| {t} | {ctx} | {rows} | {base_s} | {default:.4f} | {comb} | {timings[best]:.4f} | {best} |",
              flush=True)
        with open(args.out, "w") as fh:  # after every shape, so a time-boxed run keeps what it measured
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
