"""Exact mode's matmul against cuBLAS on the Qwen3-8B stand-in's five weights, and which launches keep its bits.

For each weight (q/k/v 4096->6144, o_proj 4096->4096, gate/up 4096->24576, down 12288->4096, LM head 4096->151936),
bf16, random data, at 1, 8, 64, 320, 1024 and 2048 rows:

- time (CUDA events, median, several weight copies rotated so the L2 does not hold the weight) of torch's cuBLAS
  and of ``batch_invariant.linear`` under each split count S and each launch (split programs or fused, tile shape,
  warps);
- bits: every launch of one S against the default launch's rows computed at 2048 rows (so every row at every row
  count and every launch), per S;
- cuBLAS: every row of ``F.linear(x[:M])`` against that row computed alone, for every M in 1..2048 (the check
  exact mode runs before trusting cuBLAS for a weight), and the graph-captured call against the eager one.

Times are of CUDA-graph replays (the engine replays graphs; eager timing here measures Python launch cost).

Prints a small table; writes ``OUT/exact_matmul_tune.json``.

    python benchmarks/exact_matmul_tune.py --out $OUT             # H200
    python benchmarks/exact_matmul_tune.py --out $OUT --weights o_proj,down --splits 1,4 --cublas-rows 0 \
        --launches split64x128w4,split64x64w4,fused128x128w8,split64x32w4,split16x32w2,split16x16w1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.models import batch_invariant as bi

WEIGHTS = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
           "lm_head": (151936, 4096)}
ROWS = (1, 8, 64, 320, 1024, 2048)
LAUNCHES = {
    "split64x128w4": bi.MatmulLaunch(64, 128, 4, 3, fused=False),
    "split64x64w4": bi.MatmulLaunch(64, 64, 4, 4, fused=False),
    "split16x128w4": bi.MatmulLaunch(16, 128, 4, 3, fused=False),
    "split16x64w4": bi.MatmulLaunch(16, 64, 4, 4, fused=False),
    "fused64x128w4": bi.MatmulLaunch(64, 128, 4, 3, fused=True),
    "fused64x64w4": bi.MatmulLaunch(64, 64, 4, 4, fused=True),
    "fused128x128w8": bi.MatmulLaunch(128, 128, 8, 3, fused=True),
    "fused128x256w8": bi.MatmulLaunch(128, 256, 8, 3, fused=True),
    # one K loop over the segments (MatmulLaunch.flat)
    "flat128x128w8": bi.MatmulLaunch(128, 128, 8, 3, fused=True, flat=True),
    "flat128x128w8s4": bi.MatmulLaunch(128, 128, 8, 4, fused=True, flat=True),
    "flat64x128w4": bi.MatmulLaunch(64, 128, 4, 3, fused=True, flat=True),
    # wider tiles for the 500-1100 rows of verifies at C = 64 (at 1024 rows the flat 128 x 128 launch ran at 59-61 %
    # of cuBLAS's speed: docs/benchmarks.md, "Exact mode", seventh run); slower with pointer loads (tenth run). Those that fit the
    # interpreter give the split launch's bits on the CPU; 256-row or 256-column tiles of 8 warps exceed its
    # emulated dot.
    "flat128x256w8": bi.MatmulLaunch(128, 256, 8, 3, fused=True, flat=True),
    "flat256x128w8": bi.MatmulLaunch(256, 128, 8, 3, fused=True, flat=True),
    "flat128x128w4s4": bi.MatmulLaunch(128, 128, 4, 4, fused=True, flat=True),
    "flat64x256w4": bi.MatmulLaunch(64, 256, 4, 3, fused=True, flat=True),
    # the flat launch with its tiles loaded by tensor descriptors (Hopper's TMA; MatmulLaunch.tma; tenth run)
    "tma128x128w8s4": bi.MatmulLaunch(128, 128, 8, 4, fused=True, flat=True, tma=True),
    "tma128x256w8s3": bi.MatmulLaunch(128, 256, 8, 3, fused=True, flat=True, tma=True),
    "tma128x256w8s4": bi.MatmulLaunch(128, 256, 8, 4, fused=True, flat=True, tma=True),
    "tma256x128w8s3": bi.MatmulLaunch(256, 128, 8, 3, fused=True, flat=True, tma=True),
    "tma64x128w4s4": bi.MatmulLaunch(64, 128, 4, 4, fused=True, flat=True, tma=True),
    "tma64x256w4s3": bi.MatmulLaunch(64, 256, 4, 3, fused=True, flat=True, tma=True),
    # split programs loading through tensor descriptors, for the 16-320 rows of decode and small verifies
    "tmasplit16x64w4": bi.MatmulLaunch(16, 64, 4, 4, fused=False, tma=True),
    "tmasplit64x64w4": bi.MatmulLaunch(64, 64, 4, 4, fused=False, tma=True),
    "tmasplit64x128w4": bi.MatmulLaunch(64, 128, 4, 4, fused=False, tma=True),
    "tmasplit64x128w4s3": bi.MatmulLaunch(64, 128, 4, 3, fused=False, tma=True),
    "tmasplit32x128w4": bi.MatmulLaunch(32, 128, 4, 4, fused=False, tma=True),
    "tmasplit128x128w8": bi.MatmulLaunch(128, 128, 8, 4, fused=False, tma=True),
    # narrow column tiles: enough programs to stream a weight at one row tile without split-K (S = 1)
    "split64x32w4": bi.MatmulLaunch(64, 32, 4, 4, fused=False),
    "split16x32w2": bi.MatmulLaunch(16, 32, 2, 4, fused=False),
    "split16x16w1": bi.MatmulLaunch(16, 16, 1, 4, fused=False),
}
DEFAULT = "default"  # not a launch: batch_invariant.linear's own choice per call (its table and whole waves)
SPLITS_OF = {"o_proj": "1,2,4,8", "down": "1,2,4,8"}  # the others: S1 and their default only


def _time(fn, reps: int = 20) -> float:
    """Median ms of one replay of a CUDA graph of fn() (the engine replays graphs: no launch overhead)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return sorted(times)[len(times) // 2]


def _graph_equals_eager(w: torch.Tensor, rows: tuple[int, ...]) -> list[int]:
    """Row counts where F.linear captured in a CUDA graph gives other bits than eager F.linear."""
    x = torch.randn(max(rows), w.shape[1], device=w.device, dtype=w.dtype)
    bad = []
    for m in rows:
        eager = F.linear(x[:m], w)
        out = torch.empty_like(eager)
        graph = torch.cuda.CUDAGraph()
        F.linear(x[:m], w)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out.copy_(F.linear(x[:m], w))
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, eager):
            bad.append(m)
    return bad


def _cublas_check(w: torch.Tensor, max_rows: int) -> list[int]:
    """Row counts in 1..max_rows where some row of F.linear(x[:M]) differs from that row alone."""
    x = torch.randn(max_rows, w.shape[1], device=w.device, dtype=w.dtype)
    alone = torch.cat([F.linear(x[i:i + 1], w) for i in range(max_rows)])
    bad = []
    for m in range(1, max_rows + 1):
        if not torch.equal(F.linear(x[:m], w), alone[:m]):
            bad.append(m)
    return bad


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--weights", default=",".join(WEIGHTS))
    ap.add_argument("--splits", default="auto")
    ap.add_argument("--cublas-rows", type=int, default=2048)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts to time (at most 2048)")
    ap.add_argument("--launches", default=",".join(LAUNCHES), help="names of LAUNCHES to time (the bits reference, "
                    f"split64x128w4, is always computed), and {DEFAULT!r}: linear's own launch choice per call")
    args = ap.parse_args(argv)
    wanted = args.launches.split(",")
    rows = tuple(int(v) for v in args.rows.split(","))
    if not rows or min(rows) < 1 or max(rows) > 2048:
        ap.error(f"--rows: counts in 1..2048, got {args.rows}")
    unknown = [name for name in wanted if name not in LAUNCHES and name != DEFAULT]
    if unknown:
        ap.error(f"--launches: unknown {unknown}; known: {list(LAUNCHES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": rows, "weights": {}}
    t0 = time.perf_counter()
    for name in args.weights.split(","):
        n, k = WEIGHTS[name]
        copies = max(1, -(-(256 << 20) // (n * k * 2)))  # >= 256 MiB of weights rotated: past the 60 MB L2
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(2048, k, device=dev, dtype=torch.bfloat16)
        entry = {"shape": [n, k], "default_tiles": bi.matmul_tiles(n, k)._asdict(), "cublas_ms": {}, "triton_ms": {},
                 "bits": {}, "errors": {}}
        for m in rows:
            entry["cublas_ms"][m] = _time(lambda m=m, x=x, ws=ws: [F.linear(x[:m], w) for w in ws]) / copies
        k_blocks = -(-k // 64)
        splits = SPLITS_OF.get(name, f"1,{bi.matmul_tiles(n, k).split_k}") if args.splits == "auto" else args.splits
        for s in sorted({int(v) for v in splits.split(",")}):
            if k_blocks % s or k_blocks // s < 4:
                continue
            tiles = bi.MatmulTiles(64, s)
            ref = bi.linear(x, ws[0], tiles=tiles, launch=LAUNCHES["split64x128w4"])
            same = True
            for lname, launch in [(DEFAULT, None), *LAUNCHES.items()]:
                if lname not in wanted or launch is not None and launch.block_n > n:
                    continue
                key = f"S{s}/{lname}"
                try:
                    for m in rows:
                        y = bi.linear(x[:m], ws[0], tiles=tiles, launch=launch)
                        if not torch.equal(y, ref[:m]):
                            same = False
                            entry["bits"][f"{key}@{m}"] = "differs"
                    entry["triton_ms"][key] = {
                        m: _time(lambda m=m, x=x, ws=ws, t=tiles, la=launch: [bi.linear(x[:m], w, tiles=t, launch=la) for w in ws])
                        / copies
                        for m in rows}
                except Exception as exc:  # a launch that does not compile (shared memory) is recorded
                    entry["errors"][key] = f"{type(exc).__name__}: {exc}"[:300]
            entry["bits"][f"S{s}"] = "all launches and row counts identical" if same else "DIFFER"
            print(name, f"S{s}", entry["bits"][f"S{s}"], f"{time.perf_counter() - t0:.0f}s", flush=True)
        if args.cublas_rows:
            entry["cublas_rows_changing"] = _cublas_check(ws[0], args.cublas_rows)
            entry["cublas_graph_differs_at"] = _graph_equals_eager(ws[0], (1, 8, 17, 64, 65, 320, 1024, 2048))
        report["weights"][name] = entry
        (out / "exact_matmul_tune.json").write_text(json.dumps(report, indent=1))
        del ws
        torch.cuda.empty_cache()
    report["total_s"] = time.perf_counter() - t0
    (out / "exact_matmul_tune.json").write_text(json.dumps(report, indent=1))
    print("| weight | rows | cuBLAS us | best Triton us (S/launch) | default S Triton us (best launch) | cuBLAS rows changing |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, e in report["weights"].items():
        s_def = e["default_tiles"]["split_k"]
        bad = e.get("cublas_rows_changing", [])
        for m in rows:
            cands = [(v[m], key) for key, v in e["triton_ms"].items()]
            best = min(cands) if cands else (float("nan"), "-")
            own = [(v[m], key) for key, v in e["triton_ms"].items() if key.startswith(f"S{s_def}/")]
            ob = min(own) if own else (float("nan"), "-")
            print(f"| {name} | {m} | {e['cublas_ms'][m] * 1e3:.0f} | {best[0] * 1e3:.0f} ({best[1]}) | "
                  f"{ob[0] * 1e3:.0f} ({ob[1]}) | {len(bad)} from {bad[0] if bad else '-'} |")
    for name, e in report["weights"].items():
        print(name, {k: v for k, v in e["bits"].items() if "@" not in k}, "errors:", list(e["errors"]))


if __name__ == "__main__":
    main()
