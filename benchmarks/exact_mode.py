"""Exact mode's effect and price on the Qwen3-8B stand-in (issue 27): greedy outputs identical to AR at C=1, tok/s.

For the default engine and the exact-mode engine (``EngineConfig.exact``) in turn, bf16, 256 new tokens, greedy:

- identity: AR at C=1 is the reference; every cell (AR at C=64, the DFlash chain and DDTree at budgets 4-63 at
  C=1, 8, 64) runs the reference prompts among its own, and the fraction of those whose tokens equal AR's is
  reported;
- price: tok/s (completion tokens over the cell's wall time, prefill included) and decode tok/s of AR, the chain and
  the best DDTree budget at C=1 (1k and 4k context) and C=64 (1k), default against exact.

Every cell is run once to warm up (graph capture, Triton compiles) and once timed. Time-boxed: cells run in
priority order and those that would not fit are recorded as skipped. Writes ``OUT/exact_mode.json``; prints a table.

    python benchmarks/exact_mode.py --out $OUT                                        # H200, the stand-in
    python benchmarks/exact_mode.py --out /tmp/x --shape none --device cpu --quick   # a dry run on a CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from ddtree.engine import Engine, EngineConfig, TreeSettings
from ddtree.lab.bench.inprocess import run_cell, synchronize
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for

C1_BUDGETS = (4, 8, 16, 32, 63)
C8_BUDGETS = (4, 16, 63)
C64_BUDGETS = (4, 8, 16)


def _tree(method: str, budget: int = 0) -> TreeSettings:
    return TreeSettings(method=method, budget=budget) if method == "ddtree" else TreeSettings(method=method)


def plan(quick: bool, refs: int) -> list[tuple[str, int, int, int, int]]:
    """Cells in priority order: (method, budget, concurrency, context, prompts)."""
    if quick:
        return [("ar", 0, 1, 1024, refs), ("dflash", 0, 1, 1024, refs), ("ddtree", 16, 1, 1024, refs),
                ("ddtree", 16, 8, 1024, 8)]
    cells = [("ar", 0, 1, 1024, refs), ("dflash", 0, 1, 1024, refs)]
    cells += [("ddtree", b, 1, 1024, refs) for b in C1_BUDGETS]
    cells += [("ar", 0, 64, 1024, 64), ("dflash", 0, 64, 1024, 64)]
    cells += [("ddtree", b, 64, 1024, 64) for b in C64_BUDGETS]
    cells += [("ar", 0, 1, 4096, 2), ("dflash", 0, 1, 4096, 2), ("ddtree", 32, 1, 4096, 2)]
    cells += [("dflash", 0, 8, 1024, 16)] + [("ddtree", b, 8, 1024, 16) for b in C8_BUDGETS]
    return cells


def run_mode(name: str, engine, stream, cells, new_tokens: int, deadline: float, report: dict, out: Path) -> None:
    ref: dict[int, list[int]] = {}  # AR at C=1 per prompt index (1k context)
    for method, budget, conc, ctx, count in cells:
        key = {"mode": name, "method": method, "budget": budget, "concurrency": conc, "context": ctx}
        if time.perf_counter() > deadline:
            report["skipped"].append(key)
            continue
        prompts = prompts_for(stream, ctx, 64, salt=ctx)[:count]  # the same first prompts in every cell
        tree = _tree(method, budget)
        warm = prompts[:conc] if conc > 1 else prompts[:1]
        run_cell(engine, warm, tree, new_tokens, concurrency=conc)
        res = run_cell(engine, prompts, tree, new_tokens, concurrency=conc)
        if method == "ar" and conc == 1 and ctx == 1024:
            ref = dict(enumerate(res["tokens"]))
        same = [res["tokens"][i] == ref[i] for i in range(len(prompts)) if i in ref and ctx == 1024]
        row = {**key, "prompts": count, "tok_s": res["tok_s"], "decode_tok_s": res["decode_tok_s"],
               "accept_length": res["accept_length"], "round_ms": res["round_ms"], "wall_s": res["wall_s"],
               "identical_to_ar_c1": sum(same), "compared": len(same), "errors": res["errors"][:3]}
        report["cells"].append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps(report, indent=1))


def table(report: dict) -> str:
    lines = ["| mode | method | budget | C | ctx | tok/s | decode tok/s | accept | identical to AR C=1 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["cells"]:
        lines.append(f"| {r['mode']} | {r['method']} | {r['budget']} | {r['concurrency']} | {r['context']} | "
                     f"{r['tok_s']:.1f} | {r['decode_tok_s']:.1f} | {r['accept_length']:.2f} | "
                     f"{r['identical_to_ar_c1']}/{r['compared']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-8b", help="stand-in shape, or 'none' for the demo pair as is")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--refs", type=int, default=4, help="prompts of the C=1 cells (AR at C=1 is the reference)")
    ap.add_argument("--modes", default="exact,default")
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds for the cells of all modes")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "exact_mode.json"
    t0 = time.perf_counter()
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    from ddtree.models import load_tokenizer
    from ddtree.models.standin import load_demo_benchmark_pair

    dtype = torch.bfloat16 if cuda else torch.float32
    target, drafter, tokenizer_dir = load_demo_benchmark_pair(args.shape, device, dtype)
    tokenizer = load_tokenizer(tokenizer_dir)
    synchronize(device)
    cells = plan(args.quick, args.refs)
    stream = held_out_token_stream(tokenizer, 4096 * 2 + 4096)
    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "shape": args.shape, "new_tokens": args.new_tokens, "dtype": str(dtype), "cells": [], "skipped": []}
    modes = args.modes.split(",")
    max_len = max(c[3] for c in cells) + args.new_tokens + 16
    per_mode = args.time_budget / len(modes)
    for i, mode in enumerate(modes):
        config = EngineConfig(max_batch=max(c[2] for c in cells), max_len=max_len, max_budget=64, max_queue=4096,
                              exact=mode == "exact")
        engine = None
        try:  # a mode that fails is recorded, and the other still runs
            engine = Engine(target, drafter, tokenizer, config, model_name=f"standin-{args.shape}-{mode}")
            engine.start()
            run_mode(mode, engine, stream, cells, args.new_tokens, t0 + per_mode * (i + 1), report, out)
        except Exception as exc:
            report.setdefault("mode_errors", {})[mode] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"mode {mode} failed: {exc}", flush=True)
        if engine is not None:
            engine.shutdown(drain_timeout=0)
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    report["total_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(report, indent=1))
    print(table(report))


if __name__ == "__main__":
    main()
