"""Time one round's tree bookkeeping: build_trees (per-depth top-k over the vocabulary included) + walk_trees.

    python benchmarks/tree_ops.py --device cpu --out tree_ops_cpu.json
    python benchmarks/tree_ops.py --device cuda --out tree_ops_h200.json            # eager
    python benchmarks/tree_ops.py --device cuda --cuda-graph --out tree_ops_graph.json  # captured, replayed

For every (requests R, budget B) cell: random float logits [R, L, V] (L = 15, V = 151936 by default) and random
target choices, a few warm-up runs, then the median (and min/max) of timed runs; CUDA runs are timed with CUDA
events around the whole build + walk, and build alone is timed the same way. ``--cuda-graph`` captures build + walk
in one CUDA graph and times replays (how the engine runs a round). Prints a markdown table and writes JSON with the
environment. Runs on torch >= 2.4 (no newer APIs), CPU or CUDA.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ddtree.spec import build_trees, walk_trees

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Milliseconds for one call: CUDA events on GPU, perf_counter on CPU."""
    if device.type == "cuda":

        def time_cuda(fn: Callable[[], object]) -> float:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end)

        return time_cuda

    def time_cpu(fn: Callable[[], object]) -> float:
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3

    return time_cpu


def _graphed(fn: Callable[[], object], warmup: int) -> Callable[[], object]:
    """Capture fn (static inputs closed over) in a CUDA graph after warm-up on a side stream; return replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure(rows: int, budget: int, args: argparse.Namespace, device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(rows * 1000 + budget)
    logits = torch.randn(rows, args.depths, args.vocab, generator=gen, device=device).to(DTYPES[args.dtype])
    choices = torch.randint(0, args.vocab, (rows, budget + 1), generator=gen, device=device)
    # The engine passes budgets as a [R] tensor and the static max_budget: do the same.
    budgets = torch.full((rows,), budget, dtype=torch.long, device=device)

    def build() -> object:
        return build_trees(logits, budgets, max_budget=budget)

    def round_() -> object:
        return walk_trees(build(), choices, args.depths)

    timer = _timer(device)
    results = {}
    for name, fn in (("build", build), ("build_walk", round_)):
        if args.cuda_graph:
            fn = _graphed(fn, args.warmup)
        for _ in range(args.warmup):
            fn()
        samples = [timer(fn) for _ in range(args.repeats)]
        results[name] = {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples)}
    return {"rows": rows, "budget": budget, **{f"{k}_{m}": v[m] for k, v in results.items() for m in v}}


def environment(device: torch.device, args: argparse.Namespace) -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "cuda_graph": bool(args.cuda_graph),
        "depths": args.depths,
        "vocab": args.vocab,
        "dtype": args.dtype,
        "warmup": args.warmup,
        "repeats": args.repeats,
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def markdown(records: list[dict], env: dict) -> str:
    lines = [
        f"device {env.get('gpu', env['device'])}, torch {env['torch']}, L = {env['depths']}, V = {env['vocab']}, "
        f"{env['dtype']} logits, {'CUDA graph replay' if env['cuda_graph'] else 'eager'}; median of "
        f"{env['repeats']} runs after {env['warmup']} warm-up (ms)",
        "",
        "| R | B | build | build + walk | min | max |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        lines.append(
            f"| {r['rows']} | {r['budget']} | {r['build_median_ms']:.3f} | {r['build_walk_median_ms']:.3f} | "
            f"{r['build_walk_min_ms']:.3f} | {r['build_walk_max_ms']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--out", type=Path, default=None, help="write the records and environment as JSON here")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 64, 256, 512])
    parser.add_argument("--depths", type=int, default=15, help="L = block_size - 1")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cuda-graph", action="store_true", help="time CUDA graph replays (CUDA only)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.cuda_graph and device.type != "cuda":
        parser.error("--cuda-graph needs --device cuda")
    env = environment(device, args)
    records = []
    with torch.no_grad():
        for rows in args.rows:
            for budget in args.budgets:
                records.append(measure(rows, budget, args, device))
                print(f"R={rows} B={budget}: {records[-1]['build_walk_median_ms']:.3f} ms", flush=True)
    table = markdown(records, env)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"environment": env, "records": records, "table": table}, indent=2))


if __name__ == "__main__":
    main()
