"""Exact mode's effect and price on the Qwen3-8B stand-in (issue 27): greedy outputs identical to AR at C=1, tok/s.

Two engines side by side on the same models (the default engine and ``EngineConfig.exact``), bf16, 256 new tokens,
greedy, and each cell run on both in turn (exact first), so a time-boxed run leaves both modes' numbers for the same
cells:

- identity: AR at C=1 (1k context) is each mode's reference; every other 1k cell (AR at C=64, the DFlash chain and
  DDTree at budgets 4-63 at C=1, 8 and 64) runs the reference prompts first among its own, and the count of those
  whose tokens equal the reference's is reported (4k cells: against AR at C=1 at 4k);
- price: tok/s (completion tokens over the cell's wall time, prefill included), decode tok/s and round time, and
  where the wall time went (mean time to first token, when the last prefill finished, each stage's ms a round).

Every cell is warmed up once on the same engine (graph capture and Triton compiles out of the timed run: one prompt
of 32 tokens at C=1, C prompts of 256 tokens otherwise; the engines start with ``warmup="none"``), then timed. Cells
run in priority order; one that would start past the time budget is recorded as skipped. The 4k cells run on a
second pair of one-slot engines. Writes ``OUT/exact_mode.json`` after every cell; prints a table.

    python benchmarks/exact_mode.py --out $OUT --time-budget 330                    # H200, the stand-in
    python benchmarks/exact_mode.py --out /tmp/x --shape none --device cpu --quick   # a dry run on a CPU
    python benchmarks/exact_mode.py --out $OUT --cells ddtree:8:64:1024,dflash:0:64:1024   # those cells only

``--repeats N`` times each cell N times per mode, the modes alternating, and reports each mode's median tok/s with
the range of the N exact / default pairs (the C = 64 cells' ratios moved by several points between single runs).

``--cells`` keeps the plan's cells named ``method:budget:concurrency:context``, in the plan's order, after the
AR reference at C=1 (always run: the identity needs it); the 4k engines start only when a 4k cell is kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ddtree.engine import Engine, EngineConfig, TreeSettings
from ddtree.lab.bench.inprocess import run_cell, synchronize
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for

MODES = ("exact", "default")


def _tree(method: str, budget: int = 0) -> TreeSettings:
    return TreeSettings(method=method, budget=budget) if method == "ddtree" else TreeSettings(method=method)


def plan(quick: bool) -> list[tuple[str, int, int, int, dict[str, int]]]:
    """Cells in priority order: (method, budget, concurrency, context, prompts per mode)."""
    if quick:
        both = {"exact": 3, "default": 3}
        return [("ar", 0, 1, 1024, both), ("dflash", 0, 1, 1024, both), ("ddtree", 16, 1, 1024, both),
                ("ddtree", 8, 4, 1024, {"exact": 4, "default": 4}), ("ar", 0, 1, 4096, {"exact": 1, "default": 1})]
    c1 = {"exact": 32, "default": 32}
    c64 = {"exact": 64, "default": 64}
    c4k = {"exact": 4, "default": 4}
    return [
        ("ar", 0, 1, 1024, {"exact": 32, "default": 8}),  # the references (default's identity on its first 8)
        ("dflash", 0, 1, 1024, c1), ("ddtree", 16, 1, 1024, c1),
        ("ar", 0, 64, 1024, c64), ("dflash", 0, 64, 1024, c64), ("ddtree", 8, 64, 1024, c64),
        ("ddtree", 63, 1, 1024, c1),
        ("ar", 0, 1, 4096, c4k), ("dflash", 0, 1, 4096, c4k), ("ddtree", 32, 1, 4096, c4k),
        ("ddtree", 4, 64, 1024, c64),
        ("dflash", 0, 8, 1024, c1), ("ddtree", 4, 8, 1024, c1), ("ddtree", 16, 8, 1024, c1), ("ddtree", 63, 8, 1024, c1),
        ("ddtree", 16, 64, 1024, c64), ("ddtree", 4, 1, 1024, c1), ("ddtree", 32, 1, 1024, c1),
    ]


def cell_label(cell: tuple) -> str:
    method, budget, conc, ctx, _ = cell
    return f"{method}:{budget}:{conc}:{ctx}"


def select(cells: list, wanted: str | None) -> list:
    """The reference cell, then the cells ``wanted`` names (``--cells``), in plan order; unknown names fail."""
    if not wanted:
        return cells
    names = [w.strip() for w in wanted.split(",") if w.strip()]
    known = {cell_label(c) for c in cells}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--cells: {', '.join(unknown)} not in the plan ({', '.join(sorted(known))})")
    return [cells[0]] + [c for c in cells[1:] if cell_label(c) in names]


def run_cells(engines: dict, stream, cells, new_tokens: int, deadline: float, report: dict, out: Path,
              repeats: int = 1) -> None:
    """Each cell on both engines, the modes alternating ``repeats`` times (exact, default, exact, ...: a drift of
    the machine during the cell then falls on both), each mode's row holding its median tok/s and every repeat's
    (``tok_s_repeats``); the other readings are the first repeat's."""
    refs: dict[tuple[str, int], dict[int, list[int]]] = {}  # (mode, context) -> AR at C=1 per prompt index
    for method, budget, conc, ctx, counts in cells:
        rows: dict[str, dict] = {}
        for rep in range(repeats):
            for mode in MODES:
                row = _one_run(engines, stream, refs, report, mode, method, budget, conc, ctx, counts, new_tokens,
                               deadline, warm=rep == 0)
                if row is None:
                    continue
                if mode not in rows:
                    rows[mode] = row
                    report["cells"].append(row)
                else:
                    rows[mode]["tok_s_repeats"].append(row["tok_s"])
                    rows[mode]["tok_s"] = statistics.median(rows[mode]["tok_s_repeats"])
                rows[mode]["identical_to_ar_c1"] = min(rows[mode]["identical_to_ar_c1"], row["identical_to_ar_c1"])
                print(json.dumps(row), flush=True)
                out.write_text(json.dumps(report, indent=1))


def _one_run(engines: dict, stream, refs: dict, report: dict, mode: str, method: str, budget: int, conc: int,
             ctx: int, counts: dict, new_tokens: int, deadline: float, warm: bool) -> dict | None:
    """One timed run of a cell on one mode's engine (warmed up first where ``warm``) -> its row, or None where it
    was skipped (past the deadline, no engine) or failed (recorded in the report)."""
    key = {"mode": mode, "method": method, "budget": budget, "concurrency": conc, "context": ctx}
    engine = engines.get((mode, ctx > 1024))
    if engine is None or time.perf_counter() > deadline:
        report["skipped"].append(key)
        return None
    count = counts[mode]
    prompts = prompts_for(stream, ctx, 64, salt=ctx)[:count]  # the same first prompts in every cell
    tree = _tree(method, budget)
    try:
        if warm and conc == 1:
            run_cell(engine, prompts[:1], tree, min(32, new_tokens), concurrency=1)
        elif warm:
            run_cell(engine, prompts[:conc], tree, new_tokens, concurrency=conc)
        res = run_cell(engine, prompts, tree, new_tokens, concurrency=conc)
    except Exception as exc:  # a failing cell is recorded; the others still run
        report["cell_errors"].append({**key, "error": f"{type(exc).__name__}: {exc}"[:1000]})
        print(f"cell {key} failed: {exc}", flush=True)
        return None
    if method == "ar" and conc == 1 and (mode, ctx) not in refs:
        refs[(mode, ctx)] = dict(enumerate(res["tokens"]))
    ref = refs.get((mode, ctx), {})
    same = [res["tokens"][i] == ref[i] for i in range(len(prompts)) if i in ref]
    first_diff = [i for i in range(len(prompts)) if i in ref and res["tokens"][i] != ref[i]][:5]
    return {**key, "prompts": count, "tok_s": res["tok_s"], "tok_s_repeats": [res["tok_s"]], "decode_tok_s": res["decode_tok_s"],
            "accept_length": res["accept_length"], "round_ms": res["round_ms"], "wall_s": res["wall_s"],
            # where the wall time went: the prompts' prefills (every first token by prefills_done_s) and the
            # stages of a decode round, device time per round (run_cell's stage timer)
            "ttft_s_mean": res["ttft_s_mean"], "prefills_done_s": max(t[1] for t in res["timeline"]),
            "stage_ms_per_round": {k: round(v, 3) for k, v in res["stage_ms_per_round"].items()},
            "identical_to_ar_c1": sum(same), "compared": len(same), "differing_prompts": first_diff,
            "errors": res["errors"][:3]}


def table(report: dict) -> str:
    by = {(r["method"], r["budget"], r["concurrency"], r["context"], r["mode"]): r for r in report["cells"]}
    lines = ["| cell | default tok/s | round ms | =AR | exact tok/s | round ms | =AR | exact / default |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    seen = []
    for r in report["cells"]:
        cell = (r["method"], r["budget"], r["concurrency"], r["context"])
        if cell in seen:
            continue
        seen.append(cell)
        d, e = by.get((*cell, "default")), by.get((*cell, "exact"))
        name = f"{cell[0]}{' ' + str(cell[1]) if cell[1] else ''}, C={cell[2]}, {cell[3] // 1024}k"

        def part(x):
            return (f"{x['tok_s']:.0f} | {x['round_ms']:.2f} | {x['identical_to_ar_c1']}/{x['compared']}" if x
                    else "- | - | -")

        ratio = f"{100 * e['tok_s'] / d['tok_s']:.0f} %" if d and e else "-"
        pairs = list(zip(e["tok_s_repeats"], d["tok_s_repeats"], strict=False)) if d and e else []
        if len(pairs) > 1:  # each repeat's exact run against the default run that followed it
            each = sorted(100 * x / y for x, y in pairs)
            ratio += f" ({each[0]:.0f}-{each[-1]:.0f} % in {len(pairs)} pairs)"
        lines.append(f"| {name} | {part(d)} | {part(e)} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-8b", help="stand-in shape, or 'none' for the demo pair as is")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--time-budget", type=float, default=330.0, help="seconds from start after which no cell starts")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of each cell per mode, the modes alternating; "
                    "a mode's tok/s is the median")
    ap.add_argument("--cells", default=None, help="only these cells (method:budget:concurrency:context,...), "
                    "after the AR reference")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "exact_mode.json"
    t0 = time.perf_counter()
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    from ddtree.models.standin import load_benchmark_models

    target, drafter, tokenizer, dtype = load_benchmark_models(args.shape, device)
    synchronize(device)
    cells = select(plan(args.quick), args.cells)
    stream = held_out_token_stream(tokenizer, 4096 * 2 + 4096)
    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "shape": args.shape, "new_tokens": args.new_tokens, "dtype": str(dtype), "cells": [], "skipped": [],
              "cell_errors": [], "engines": {}}
    engines: dict[tuple[str, bool], Engine] = {}
    short = [c for c in cells if c[3] <= 1024]
    for mode in MODES:
        for long in (False, True):
            group = [c for c in cells if (c[3] > 1024) == long]
            if long and not group:  # no 4k cell kept: no 4k engine
                continue
            group = group or short
            config = EngineConfig(max_batch=max(c[2] for c in group), max_len=max(c[3] for c in group) + args.new_tokens
                                  + 16, max_budget=64, max_queue=4096, exact=mode == "exact", warmup="none")
            t = time.perf_counter()
            try:  # a mode that fails to build is recorded, and the other still runs
                engine = Engine(target, drafter, tokenizer, config, model_name=f"standin-{args.shape}-{mode}")
                engine.start()
                engines[(mode, long)] = engine
                report["engines"][f"{mode}{'-4k' if long else ''}"] = {"build_s": time.perf_counter() - t,
                                                                        "exact": engine.info()["exact"]}
            except Exception as exc:
                report["engines"][f"{mode}{'-4k' if long else ''}"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                print(f"engine {mode} failed: {exc}", flush=True)
    print(json.dumps(report["engines"]), flush=True)
    if args.repeats < 1:
        ap.error(f"--repeats: at least 1, got {args.repeats}")
    report["repeats"] = args.repeats
    run_cells(engines, stream, cells, args.new_tokens, t0 + args.time_budget, report, out, repeats=args.repeats)
    for engine in engines.values():
        engine.shutdown(drain_timeout=0)
    report["total_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(report, indent=1))
    print(table(report))


if __name__ == "__main__":
    main()
