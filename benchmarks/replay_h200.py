"""Replay's predicted tok/s against measured cells on the GPU (issue 23: "within 10 % of measured").

One process, one engine on the Qwen3-8B stand-in (bf16, CUDA graphs, ``EngineConfig.cost_curve="auto"``: the cost
curve measured at start, its prefill points through the prefill graphs where the scheduler replays one):

1. **measured**: the cells of ``--contexts`` x ``--concurrency`` for AR, the DFlash chain and DDTree at
   ``--budgets`` through the lab's in-process matrix (``ddtree.lab.bench.matrix.run_matrix``, as
   ``benchmarks/gpu.py`` runs them: each cell warmed up, timed, retimed after a first-use cost);
2. **trace**: ``ddtree.lab.replay.record_trace`` on the same engine over the first ``--trace-prompts`` prompts of
   each cell (the cell's own prompts, ``prompts_for`` with the matrix's salt);
3. **predicted**: ``ddtree.lab.replay.predict`` (acceptance per round of every sequence) and
   ``ddtree.lab.replay.throughput.predict_cells`` (the closed-loop model of the engine's loop) with the engine's
   curve, and again with the same curve's prefill points measured eagerly (how the curve was measured before;
   ``--no-eager`` leaves it out) and without its prefill points after a context ("no context": every chunk priced
   as a prompt's first, as before them), so the effect of each is shown on its own.

Writes ``OUT/replay_h200.json`` (cells measured, predicted, the errors, both curves) and prints a table.

    python benchmarks/replay_h200.py --out $OUT --contexts 60,1024 --concurrency 64 --budgets 4,7 --waves 4
    python benchmarks/replay_h200.py --out /tmp/x --device cpu --shape none --contexts 64 --concurrency 2 \
        --budgets 4 --waves 1 --new-tokens 24 --trace-prompts 2        # a dry run of the script on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from ddtree import tuning
from ddtree.engine import Engine, EngineConfig, auto_budget
from ddtree.engine.cost_curve import save_curve
from ddtree.engine.cost_measure import CostGrid, measure_cost_curve
from ddtree.engine.options import int_list
from ddtree.lab.bench.matrix import CompileLog, MatrixPlan, cell_prompts, run_matrix
from ddtree.lab.bench.workload import held_out_token_stream
from ddtree.lab.replay.auto import auto_anchors
from ddtree.lab.replay.predict import predict
from ddtree.lab.replay.throughput import cell_sequences, curve_overlap, curve_prefill_every, predict_cells
from ddtree.lab.replay.trace import record_trace
from ddtree.models import load_tokenizer
from ddtree.models.standin import load_demo_benchmark_pair


def measured_name(config: str) -> str:
    """replay's setting label -> the matrix's method name (``ddtree-b4-knone`` -> ``ddtree-b4``)."""
    if config.startswith("ddtree-bauto"):
        return "ddtree-auto"
    return config.rsplit("-k", 1)[0] if config.startswith("ddtree") else config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--contexts", default="60,1024")
    ap.add_argument("--concurrency", default="64")
    ap.add_argument("--budgets", default="4,7")
    ap.add_argument("--auto", action="store_true", help="also budget auto: measured in every cell, and predicted by "
                    "replaying the engine's chooser (ddtree.lab.replay.auto)")
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--trace-prompts", type=int, default=64, help="prompts of each cell the trace records")
    ap.add_argument("--time-budget", type=float, default=400.0, help="seconds after which no measured cell starts")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script (--shape none)")
    ap.add_argument("--combine-block-m", type=int, default=None,
                    help="ddtree.tuning.COMBINE_BLOCK_M for this engine (tree attention's combine rows per program; "
                         "the cost curve is cached per value; 128 with --combine-block-d 64: the tile before the rule)")
    ap.add_argument("--combine-block-d", type=int, default=None,
                    help="ddtree.tuning.COMBINE_BLOCK_D for this engine (the combine's head-dim columns per program)")
    ap.add_argument("--combine-rule", action="store_true",
                    help="the combine's tile from tuning.choose_combine_tile (both overrides None: the default since "
                         "2026-12-07, kept so the earlier runs' commands still run)")
    ap.add_argument("--no-eager", dest="eager", action="store_false",
                    help="leave out the second prediction with the prefill points measured eagerly (saves its time)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    contexts = list(int_list(args.contexts, name="--contexts"))
    concurrency = list(int_list(args.concurrency, name="--concurrency"))
    budgets = list(int_list(args.budgets, name="--budgets"))
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.combine_rule:
        tuning.COMBINE_BLOCK_M = tuning.COMBINE_BLOCK_D = None
    if args.combine_block_m is not None:
        tuning.COMBINE_BLOCK_M = args.combine_block_m  # read by every launch plan, the warm-up's and the graphs'
    if args.combine_block_d is not None:
        tuning.COMBINE_BLOCK_D = args.combine_block_d
    target, drafter, pair_dir = load_demo_benchmark_pair(args.shape, device, torch.bfloat16 if cuda else torch.float32)
    tokenizer = load_tokenizer(pair_dir)
    config = EngineConfig(max_batch=max(concurrency), max_len=max(contexts) + args.new_tokens + 64,
                          max_budget=max(*budgets, 32), prefill_chunk=args.prefill_chunk, max_queue=4096,
                          cuda_graphs=cuda, warmup="none", cost_curve="auto", device=args.device)
    engine = Engine(target, drafter, tokenizer, config, model_name=f"standin-{args.shape}")
    engine.start()
    curve = engine.cost_curve
    save_curve(curve, out / "cost_curve.json")
    print(f"engine ready in {time.perf_counter() - t_start:.1f} s; curve {engine.cost_curve_source.info()}", flush=True)
    print("prefill points (graphed where the scheduler would):",
          dict(zip(curve.prefill_tokens, [round(s * 1e3, 2) for s in curve.prefill_seconds], strict=True)), flush=True)

    stream = held_out_token_stream(tokenizer, max(contexts) * 2 + 4096)
    plan = MatrixPlan(contexts=tuple(contexts), concurrency=tuple(concurrency), budgets=tuple(budgets),
                      new_tokens=args.new_tokens, waves=args.waves, auto=args.auto).validated()
    report: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__, "shape": args.shape,
                    "args": vars(args), "cells": [], "skipped": []}
    run_matrix(engine, stream, plan, report, compiles=CompileLog(), deadline=t_start + args.time_budget,
               on_row=lambda row: print(f"measured {row['context']} C={row['concurrency']} {row['method']}: "
                                        f"{row['tok_s']} tok/s, accept {row['accept_length']}, round "
                                        f"{row['round_ms']} ms", flush=True))
    print(f"matrix done at {time.perf_counter() - t_start:.1f} s", flush=True)

    # the same curve with its prefill points eager: how the engine measured them before
    curve_eager = None
    if args.eager:
        eager = measure_cost_curve(engine.runner, CostGrid(rows=(1,), budgets=(0,), kv_lens=(64,),
                                                           block_size=engine.trained_block_size,
                                                           prefill_tokens=curve.prefill_tokens, repeats=3),
                                   device_name=curve.device, model=curve.model)
        curve_eager = dataclasses.replace(curve, prefill_seconds=eager.prefill_seconds)
        print("prefill points, eager:",
              dict(zip(curve.prefill_tokens, [round(s * 1e3, 2) for s in eager.prefill_seconds], strict=True)), flush=True)

    cells = {(ctx, conc): cell_prompts(stream, plan, ctx, conc) for ctx in contexts for conc in concurrency}
    traced = [p for ps in cells.values() for p in ps[: args.trace_prompts]]
    traced = list({tuple(p): list(p) for p in traced}.values())
    t_trace = time.perf_counter()
    top_m = max([max(budgets) + 1, *(auto_budget.candidates(config.max_budget) if args.auto else ())])
    trace = record_trace(engine, traced, args.new_tokens, top_m=top_m)
    trace_s = time.perf_counter() - t_trace
    print(f"trace: {trace.num_sequences} sequences in {trace_s:.1f} s", flush=True)
    engine.shutdown(drain_timeout=0)
    preds = predict(trace, budgets)
    seqs = cell_sequences([trace.sequence(s)[0] for s in range(trace.num_sequences)], cells)
    depth = trace.block_size - 1
    common = dict(depth=depth, contexts=contexts, concurrency=concurrency, num_requests={c: len(cells[contexts[0], c]) for c in concurrency},
                  max_tokens=args.new_tokens, sequences=seqs, prefill_chunk=args.prefill_chunk,
                  auto=auto_anchors(trace, config.max_budget) if args.auto else None)
    predicted = {"graphed": predict_cells(preds, curve, **common)}
    if curve_eager is not None:
        predicted["eager"] = predict_cells(preds, curve_eager, **common)
    if curve.prefill_context:  # every chunk priced as a prompt's first, as before the points after a context
        flat = dataclasses.replace(curve, prefill_context=0, prefill_context_seconds=())
        predicted["no context"] = predict_cells(preds, flat, **common)
        print(f"prefill points after {curve.prefill_context} keys:",
              dict(zip(curve.prefill_tokens, [round(s * 1e3, 2) for s in curve.prefill_context_seconds],
                       strict=True)), flush=True)
    by_cell = {(c["context"], c["concurrency"], c["method"]): c for c in report["cells"]}
    rows = []
    for which, cells_out in predicted.items():
        for p in cells_out:
            m = by_cell.get((p.context, p.concurrency, measured_name(p.config)))
            if m is None:
                continue
            rows.append({"prefill_points": which, "context": p.context, "concurrency": p.concurrency,
                         "method": m["method"], "measured_tok_s": m["tok_s"], "predicted_tok_s": round(p.tok_s, 1),
                         "error": round(p.tok_s / m["tok_s"] - 1, 4), "measured_accept": m["accept_length"],
                         "replayed_accept": round(p.accept_length, 3), "measured_wall_s": m["wall_s"],
                         "predicted_round_s": round(p.round_seconds, 3),
                         "predicted_prefill_s": round(p.prefill_seconds, 3), "predicted_rounds": p.rounds,
                         "measured_round_ms": m["round_ms"], "stage_ms_per_round": m["stage_ms_per_round"],
                         "extrapolated": p.extrapolated,
                         "measured_auto_budgets": m.get("auto_budgets") or None,
                         "replayed_auto_budgets": p.auto_budgets})
    # the loop's schedule rules as the engine ran (its defaults on this device; git log of replay.throughput: the
    # model has placed steps and rows as the engine's scheduler does since 2026-12-08)
    loop = {"prefill_every": curve_prefill_every(curve, config.prefill_every),
            "overlap_rounds": curve_overlap(curve, config.overlap_rounds)}
    doc = {**report, "trace": {**trace.metadata(), "record_s": round(trace_s, 1)}, "comparison": rows, "loop": loop,
           "curve": curve.to_json(), "curve_eager_prefill": curve_eager.to_json() if curve_eager else None,
           "total_s": round(time.perf_counter() - t_start, 1)}
    for cell in doc["cells"]:
        cell.pop("timeline", None)
    (out / "replay_h200.json").write_text(json.dumps(doc, indent=1))
    print("| prefill points | ctx | C | method | measured tok/s | predicted | error | accept measured / replayed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['prefill_points']} | {r['context']} | {r['concurrency']} | {r['method']} | {r['measured_tok_s']} "
              f"| {r['predicted_tok_s']} | {r['error']:+.1%} | {r['measured_accept']} / {r['replayed_accept']} |")
    for r in rows:
        if r["replayed_auto_budgets"] is not None and r["prefill_points"] == "graphed":
            print(f"auto {r['context']} C={r['concurrency']}: sizes measured {r['measured_auto_budgets']}, replayed "
                  f"{r['replayed_auto_budgets']}")
    print(f"total {doc['total_s']} s")


if __name__ == "__main__":
    main()
