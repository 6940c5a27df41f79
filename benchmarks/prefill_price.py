"""Exact mode's price on a prefill step: the target's forward of prompt chunks in both modes, timed and profiled.

Why: at 64 requests of 1k tokens a cell's wall time is mostly its prefill phase (128 steps of 512 tokens before the
last first token), and exact mode's prefills ended 18-22 % later than the default engine's (docs/benchmarks.md,
"Exact mode", calls E-H of 2026-12-06), while every profile so far covered decode rounds only. This times one
target forward per chunk shape (rows x width from a start position, causal, as a prefill step runs it) from a CUDA
graph in each mode, and lists its kernels by family (Triton matmul, cuBLAS, attention, the rest) side by side.

Exact mode's cuBLAS choice (``KernelSet.exact_blas``) comes from the engine's own start-up check at the shapes of
``--max-batch`` requests with ``--prefill-chunk`` token steps, as an engine with those settings would run it.

    python benchmarks/prefill_price.py --out $OUT/prefill --chunks 1x512@0,1x512@512,1x2048@0
    python benchmarks/prefill_price.py --out /tmp/p --device cpu --chunks 1x32@0,1x32@32   # dry run, demo pair
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ddtree.engine import EngineConfig
from ddtree.engine.exact_check import check_target
from ddtree.engine.kernels import KernelSet
from ddtree.engine.prefill_budget import resolve_step_tokens
from ddtree.lab.bench.kernel_timing import kernel_times, load_standin_pair, time_ms
from ddtree.speculative.attention import TreeVisibility

FAMILIES = (("Triton matmul", ("_matmul", "_split_sum")), ("attention", ("attention", "flash", "fmha")),
            ("cuBLAS", ("gemm", "cutlass", "nvjet", "sm90_", "sm80_", "cublas")))


def family(name: str) -> str:
    low = name.lower()
    for label, keys in FAMILIES:
        if any(k in low for k in keys):
            return label
    return "other"


def parse_chunks(text: str) -> list[tuple[int, int, int]]:
    """``RxW@S,...`` -> [(rows, width, start)]."""
    out = []
    for part in text.split(","):
        shape, _, start = part.partition("@")
        rows, _, width = shape.partition("x")
        out.append((int(rows), int(width), int(start or 0)))
    return out


def step(target, kernels: KernelSet, cache, rows: int, width: int, start: int, dev: torch.device):
    """A closure running one prefill forward of ``rows`` prompts' tokens start .. start + width (slots 0 .. rows-1,
    causal, logits at each row's last token), as the engine's prefill step calls the target."""
    ids = torch.randint(0, target.config.vocab_size, (rows, width), device=dev)
    pos = (start + torch.arange(width, device=dev))[None].expand(rows, width).contiguous()
    slots = torch.arange(rows, device=dev)
    vis = torch.ones(width, width, dtype=torch.bool, device=dev).tril()[None].expand(rows, width, width).contiguous()
    visibility = TreeVisibility(torch.full((rows,), start, device=dev), vis, start + width)
    last = torch.full((rows, 1), width - 1, device=dev)
    return lambda: target(ids, pos, cache, slots, pos, visibility, kernels=kernels, logits_at=last)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run on the demo pair itself")
    ap.add_argument("--chunks", default="1x512@0,1x512@512,1x1024@0,1x2048@0,4x512@0")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    chunks = parse_chunks(args.chunks)
    target, drafter = load_standin_pair(dev)
    default = KernelSet.resolve(EngineConfig(gpu_kernels=cuda), target, drafter)
    exact = KernelSet.resolve(EngineConfig(gpu_kernels=cuda, exact=True), target, drafter)
    report: dict = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
                    "chunks": {}}
    if cuda:
        t = time.perf_counter()
        check = check_target(target, max_batch=args.max_batch, max_budget=64, max_block=16,
                             prefill_chunk=args.prefill_chunk, prefill_width=args.prefill_chunk, max_len=4096,
                             step_tokens=resolve_step_tokens(None, args.prefill_chunk, "cuda"))
        exact = replace(exact, exact_blas=check.trusted)
        report["exact_check"] = {"s": time.perf_counter() - t, **check.describe()}
        print(f"exact check {report['exact_check']['s']:.1f} s: {check.describe()}", flush=True)
    rows_max = max(r for r, _, _ in chunks)
    len_max = max(w + s for _, w, s in chunks)
    cache = target.allocate_cache(rows_max, len_max + 16)
    lines = ["| chunk (rows x tokens @ start) | default ms | exact ms | exact / default | Triton matmul | attention | "
             "cuBLAS | other |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    details = []
    for rows, width, start in chunks:
        name = f"{rows}x{width}@{start}"
        cell = {}
        for mode, kernels in (("default", default), ("exact", exact)):
            fn = step(target, kernels, cache, rows, width, start, dev)
            ms = time_ms(fn, reps=args.reps) if cuda else None
            for _ in range(2):
                fn()
            activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
            with profile(activities=activities) as prof:
                for _ in range(3):
                    fn()
                if cuda:
                    torch.cuda.synchronize()
            kernels_us = {k: (n / 3, us / 3) for k, (n, us) in kernel_times(prof, cuda, width=70).items()}
            fam: dict[str, float] = {}
            for k, (_, us) in kernels_us.items():
                fam[family(k)] = fam.get(family(k), 0.0) + us / 1e3
            cell[mode] = {"ms": ms, "families_ms": fam, "kernels": kernels_us}
        report["chunks"][name] = cell
        d, e = cell["default"], cell["exact"]
        ratio = f"{e['ms'] / d['ms']:.2f}" if cuda else "-"
        dms = f"{d['ms']:.2f}" if cuda else "-"
        ems = f"{e['ms']:.2f}" if cuda else "-"
        lines.append(f"| {name} | {dms} | {ems} | {ratio} | "
                     + " | ".join(f"{d['families_ms'].get(label, 0):.2f} / {e['families_ms'].get(label, 0):.2f}"
                                  for label in ("Triton matmul", "attention", "cuBLAS", "other")) + " |")
        print(lines[-1], flush=True)
        details += [f"### {name}", "", "| kernel | default: calls, ms | exact: calls, ms |", "| --- | --- | --- |"]
        names = sorted(set(d["kernels"]) | set(e["kernels"]),
                       key=lambda k: -max(d["kernels"].get(k, (0, 0))[1], e["kernels"].get(k, (0, 0))[1]))
        for k in names[:args.top]:
            dn, dus = d["kernels"].get(k, (0, 0.0))
            en, eus = e["kernels"].get(k, (0, 0.0))
            details.append(f"| `{k}` | {dn:.0f}, {dus / 1e3:.3f} | {en:.0f}, {eus / 1e3:.3f} |")
        details.append("")
    text = "\n".join(["Family columns: profiled device ms per forward, default / exact.", ""] + lines + [""] + details)
    (out_dir / "prefill_price.md").write_text(text + "\n")
    (out_dir / "prefill_price.json").write_text(json.dumps(report, indent=1))
    print(text)


if __name__ == "__main__":
    main()
