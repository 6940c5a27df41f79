"""Time one round's tree bookkeeping: build_trees (per-depth top-k over the vocabulary included) + walk_trees.

    python benchmarks/tree_ops.py --device cpu --out tree_ops_cpu.json
    python benchmarks/tree_ops.py --device cuda --out tree_ops_h200.json            # eager
    python benchmarks/tree_ops.py --device cuda --cuda-graph --out tree_ops_graph.json  # captured, replayed
    python benchmarks/tree_ops.py --device cuda --cuda-graph --no-triton  # also time the torch vocabulary pass
    python benchmarks/tree_ops.py --device cpu --count-ops --rows 1 64 --budgets 512 16 --vocab 1024

For every (requests R, budget B) cell: random float logits [R, L, V] (L = 15, V = 151936 by default) and random
target choices, a few warm-up runs, then the median (and min/max) of timed runs; CUDA runs are timed with CUDA
events around the whole build + walk, and build alone is timed the same way. ``--cuda-graph`` captures build + walk
in one CUDA graph and times replays (how the engine runs a round). On CUDA build_trees takes its vocabulary pass
from the fused Triton top-k + logsumexp kernel (``build_trees(..., fast_topk=True)``, ``ddtree.speculative.vocab_topk``);
``--no-triton`` times every cell a second time with ``fast_topk=False`` (the torch path) and prints both. ``--count-ops`` counts, per build and
per walk, the aten ops that run (views excluded; on CUDA the GPU kernels launched, Triton ones included, from the
profiler). Prints a markdown table and writes JSON with the environment. Runs on torch >= 2.4 (no newer APIs), CPU
or CUDA.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddtree import triton_runtime, tuning
from ddtree.speculative import build_trees, vocab_topk, walk_trees

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


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that run (views launch nothing and are skipped; Triton launches are not aten ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object], device: torch.device) -> int:
    """GPU kernels launched by one call on CUDA (profiler), aten ops (views excluded) on CPU."""
    fn()  # warm-up: Triton compilation and lazy initialisation stay out of the count
    if device.type == "cuda":
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    with _OpCounter() as counter:
        fn()
    return sum(counter.ops.values())


def measure(rows: int, budget: int, args: argparse.Namespace, device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(rows * 1000 + budget)
    logits = torch.randn(rows, args.depths, args.vocab, generator=gen, device=device).to(DTYPES[args.dtype])
    choices = torch.randint(0, args.vocab, (rows, budget + 1), generator=gen, device=device)
    # The engine passes budgets as a [R] tensor and the static max_budget: do the same.
    budgets = torch.full((rows,), budget, dtype=torch.long, device=device)

    timer = _timer(device)
    # The engine's choice on CUDA (EngineConfig.gpu_kernels); on CPU the kernel cannot run and the torch path does.
    fast_default = device.type == "cuda"
    record: dict = {"rows": rows, "budget": budget,
                    "triton": fast_default and tuning.kernel_takes(rows * args.depths, min(budget, args.vocab))
                    and vocab_topk.available(logits)}
    variants = [("", fast_default)] + ([("torch_", False)] if args.no_triton else [])
    for prefix, fast_topk in variants:

        def build(fast_topk: bool = fast_topk) -> object:
            return build_trees(logits, budgets, max_budget=budget, fast_topk=fast_topk)

        def round_(build: Callable[[], object] = build, kernel: bool = fast_topk) -> object:
            return walk_trees(build(), choices, args.depths, kernel=kernel)

        if args.count_ops:
            record[f"{prefix}build_ops"] = count_ops(build, device)
            record[f"{prefix}walk_ops"] = count_ops(functools.partial(walk_trees, build(), choices, args.depths,
                                                                      kernel=fast_topk), device)
        for name, fn in (("build", build), ("build_walk", round_)):
            if args.cuda_graph:
                fn = _graphed(fn, args.warmup)
            for _ in range(args.warmup):
                fn()
            samples = [timer(fn) for _ in range(args.repeats)]
            record[f"{prefix}{name}_median_ms"] = statistics.median(samples)
            record[f"{prefix}{name}_min_ms"] = min(samples)
            record[f"{prefix}{name}_max_ms"] = max(samples)
    return record


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
        "triton": triton_runtime.triton.__version__ if triton_runtime.triton is not None else None,
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def markdown(records: list[dict], env: dict) -> str:
    """The table; with --no-triton two more columns (the torch vocabulary pass), with --count-ops op counts."""
    torch_cols = "torch_build_median_ms" in records[0]
    op_cols = "build_ops" in records[0]
    header = ["R", "B", "vocab pass", "build", "build + walk", "min", "max"]
    if torch_cols:
        header += ["build (torch)", "build + walk (torch)"]
    if op_cols:
        header += ["ops build", "ops walk"] + (["ops build (torch)"] if torch_cols else [])
    lines = [
        f"device {env.get('gpu', env['device'])}, torch {env['torch']}, triton {env['triton']}, L = {env['depths']}, "
        f"V = {env['vocab']}, {env['dtype']} logits, {'CUDA graph replay' if env['cuda_graph'] else 'eager'}; median "
        f"of {env['repeats']} runs after {env['warmup']} warm-up (ms); ops: "
        f"{'GPU kernels' if env['device'].startswith('cuda') else 'aten ops, views excluded'}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(" ---: " for _ in header) + "|",
    ]
    for r in records:
        cells = [str(r["rows"]), str(r["budget"]), "triton" if r["triton"] else "torch", f"{r['build_median_ms']:.3f}",
                 f"{r['build_walk_median_ms']:.3f}", f"{r['build_walk_min_ms']:.3f}", f"{r['build_walk_max_ms']:.3f}"]
        if torch_cols:
            cells += [f"{r['torch_build_median_ms']:.3f}", f"{r['torch_build_walk_median_ms']:.3f}"]
        if op_cols:
            cells += [str(r["build_ops"]), str(r["walk_ops"])] + ([str(r["torch_build_ops"])] if torch_cols else [])
        lines.append("| " + " | ".join(cells) + " |")
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
    parser.add_argument("--no-triton", action="store_true",
                        help="also time every cell with the torch vocabulary pass (build_trees(fast_topk=False))")
    parser.add_argument("--count-ops", action="store_true",
                        help="count GPU kernels (CUDA) or aten ops (CPU) of one build and one walk")
    parser.add_argument("--fast-max-k", type=int, default=None,
                        help="widest vocabulary pass the Triton kernel takes, at any row count (tuning.FAST_MAX_K, "
                             "and no FAST_MAX_WORK limit: to time wider ones against torch's)")
    args = parser.parse_args(argv)
    if args.fast_max_k is not None:
        tuning.FAST_MAX_K, tuning.FAST_MAX_WORK = args.fast_max_k, 1 << 62
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
