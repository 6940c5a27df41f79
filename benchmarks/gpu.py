"""GPU benchmark of the engine on the cost-faithful Qwen3-8B stand-in (issue 9).

One run (at most ~9 minutes on an H200, time-boxed: cells are run in priority order and any that would not fit are
recorded as skipped) measures, greedy, 256 new tokens per request:

- AR, the DFlash chain and DDTree at budgets 8 .. 512 for concurrency 1, 8, 32, 64 and contexts 60 .. 8192
  (concurrency C: at most C requests in flight, the next starting as one finishes, over ``--waves`` x C prompts;
  at C = 1 ``--c1-prompts`` one after another)
  (large budgets only where the verify batch stays within ``--max-verify-tokens``: past that the forward is
  compute-bound and every extra node costs, see ``shared/docs/gpu-facts.md``);
- tokens/s, acceptance length, speed-up over our AR, efficiency (speed-up / acceptance), stage split of a round,
  peak memory; greedy outputs compared with AR's (bf16 divergence rate);
- graph replay vs eager equality on a short run, and Hugging Face ``generate`` on the same target once.

A preset over the lab's in-process harness: the prompts are ``ddtree.lab.bench.workload.prompts_for``'s held-out
windows, every cell is warmed up, timed and (after a first-use cost) timed again by ``ddtree.lab.bench.matrix``,
and each run is ``ddtree.lab.bench.inprocess.run_cell``: the engine's own closed loop (``Engine.generate`` with
``max_in_flight = C``), with submission, first-token and finish times taken from the engine's ``RequestStats``.
This script loads the models, builds the stand-in and the engines, and adds the graph-vs-eager probe and the
Hugging Face reference. Writes ``OUT/gpu.json`` and ``OUT/gpu.md`` (and ``OUT/cost_curve.json``, the cost curve
the engine measured or read at start, when it has one); prints the markdown table.

    python benchmarks/gpu.py --out $OUT              # stand-in (Qwen3-8B body) built from the demo pair
    python benchmarks/gpu.py --out /tmp/x --shape none --quick   # the demo pair itself, a few cells
    python benchmarks/gpu.py --out /tmp/x --shape none --quick --device cpu --no-hf   # a dry run on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from ddtree.engine import Engine, EngineConfig, TreeSettings
from ddtree.engine.config import resolve_prefill_every
from ddtree.engine.cost_curve import save_curve
from ddtree.engine.options import int_list
from ddtree.lab.bench.inprocess import run_cell, synchronize
from ddtree.lab.bench.matrix import WARM_UPS, CompileLog, MatrixPlan, render_markdown, run_matrix
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for

BUDGETS = (8, 16, 32, 64, 128, 256, 512)


def hf_generate_reference(target, tokenizer_len: int, context: int, new_tokens: int, device) -> dict:
    """Hugging Face ``generate`` (default cache) on the same weights, batch 1, greedy."""
    import transformers

    cfg = transformers.Qwen3Config(**{k: v for k, v in target.config.to_hf_dict().items()
                                      if k not in ("architectures", "torch_dtype", "dtype")})
    with torch.device(device):
        hf = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    # Our parameter names are transformers' without the "model." prefix (the LM head keeps its name).
    ours = {(k if k.startswith("lm_head.") else f"model.{k}"): v for k, v in target.state_dict().items()}
    missing, unexpected = hf.load_state_dict(ours, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    hf.eval()
    ids = torch.randint(0, tokenizer_len, (1, context), device=device)
    hf.generate(ids, max_new_tokens=4, do_sample=False)
    synchronize(torch.device(device))
    t0 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    synchronize(torch.device(device))
    wall = time.perf_counter() - t0
    del hf
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"tok_s": (out.shape[1] - context) / wall, "context": context, "new_tokens": new_tokens,
            "missing_keys": len(missing), "unexpected_keys": len(unexpected)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--shape", default="qwen3-8b", help="stand-in shape, or 'none' for the demo pair as is")
    ap.add_argument("--contexts", default="60,1024,4096,8192")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--auto", action="store_true", help='also DDTree with budget "auto" in every cell (the engine '
                    "measures its cost curve at start: EngineConfig.cost_curve auto)")
    ap.add_argument("--cost-curve", default=None, help="EngineConfig.cost_curve (off|auto|path); default auto with "
                    "--auto (off: budget auto measures its own curve at its first round), else off")
    ap.add_argument("--no-chain", dest="chain", action="store_false", help="leave the DFlash chain out of every cell")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-verify-tokens", type=int, default=4096)
    ap.add_argument("--time-budget", type=float, default=500.0, help="seconds for the matrix")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    ap.add_argument("--no-kernels", action="store_true", help="EngineConfig(gpu_kernels=False): the torch path")
    ap.add_argument("--c1-prompts", type=int, default=3, help="prompts run one after another in concurrency-1 cells")
    ap.add_argument("--no-prefill-graphs", action="store_true", help="EngineConfig(prefill_graphs=False)")
    ap.add_argument("--draft-fp8", action="store_true", help="EngineConfig(draft_fp8=True): fp8 drafter projections")
    ap.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk,
                    help="EngineConfig.prefill_chunk: tokens of one prompt a prefill step takes, and the cache "
                         "headroom every slot keeps (runs up to git ec91f7b used 2048; 1024 let C=64 at 8k fit one "
                         "H200 then)")
    ap.add_argument("--prefill-step-tokens", type=int, default=EngineConfig.prefill_step_tokens,
                    help="EngineConfig.prefill_step_tokens: a prefill step's size across its prompts, padding "
                         "included (default: the engine's, 2048 on CUDA)")
    ap.add_argument("--mixed-chunk", type=int, default=EngineConfig.mixed_chunk,
                    help="EngineConfig.mixed_chunk: prompt tokens a decode round carries for arriving requests "
                         "(0: prefill steps of their own only)")
    ap.add_argument("--prefill-every", type=int, default=EngineConfig.prefill_every,
                    help="EngineConfig.prefill_every: while requests decode, arrivals start prefilling at most once "
                         "every N rounds (sharing one step); default: the engine's (3 on CUDA)")
    ap.add_argument("--waves", type=int, default=4,
                    help="at concurrency C > 1 a cell runs waves * C prompts, C in flight at a time (the drain at "
                         "the end, fewer than C in flight, weighs less the more waves)")
    ap.add_argument("--warm-up", choices=WARM_UPS, default="cell",
                    help="untimed run before each cell: 'cell' runs it once in full (one prompt at C = 1), so every "
                         "graph bucket it reaches (rows x cache length) is captured before the clock starts; 'short' "
                         "is the older warm-up, a few staggered short prompts, which left captures inside the cells")
    ap.add_argument("--no-retime", dest="retime", action="store_false",
                    help="keep a timed cell that captured a graph or compiled a kernel (by default it runs again)")
    ap.add_argument("--no-blas-rule", action="store_true",
                    help="EngineConfig(blas_rule=False): cuBLAS for every matmul, for an A/B of the rule")
    ap.add_argument("--engine-warmup", default="none",
                    help="EngineConfig.warmup of the measured engine (none|fast|full|budgets); none by default: every "
                         "cell warms itself up (--warm-up), as the runs recorded before the start-up plan did")
    args = ap.parse_args(argv)
    compiles = CompileLog()
    listening = compiles.install()
    try:
        _run(args, compiles, listening)
    finally:
        compiles.uninstall()


def _run(args: argparse.Namespace, compiles: CompileLog, listening: bool) -> None:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    device = torch.device(args.device)
    cuda = device.type == "cuda"  # anything else is a dry run of the script (the demo pair, fp32)

    from ddtree.assets import demo_drafter_path, demo_target_path
    from ddtree.models import load_drafter, load_target, load_tokenizer

    tokenizer = load_tokenizer(demo_target_path())
    dtype = torch.bfloat16 if cuda else torch.float32
    target = load_target(demo_target_path(), dtype=dtype, device=device)
    drafter = load_drafter(demo_drafter_path(), dtype=dtype, device=device)
    t_build = time.perf_counter()
    if args.shape != "none":
        from ddtree.models.standin import build_standin, standin_shape

        target, drafter = build_standin(target, drafter, standin_shape(args.shape))
    synchronize(device)
    build_s = time.perf_counter() - t_build
    contexts = list(int_list(args.contexts, name="--contexts"))
    concurrency = list(int_list(args.concurrency, name="--concurrency"))
    budgets = list(int_list(args.budgets, name="--budgets"))
    if args.quick:
        contexts, concurrency, budgets = [60, 1024], [1, 8], [16, 64]
    plan = MatrixPlan(contexts=tuple(contexts), concurrency=tuple(concurrency), budgets=tuple(budgets),
                      new_tokens=args.new_tokens, max_verify_tokens=args.max_verify_tokens,
                      c1_prompts=args.c1_prompts, waves=args.waves, warm_up=args.warm_up,
                      retime=args.retime, auto=args.auto, chain=args.chain).validated()
    max_len = max(contexts) + args.new_tokens + 16
    config = EngineConfig(max_batch=max(concurrency), max_len=max_len, max_budget=max(*budgets, 32),
                          prefill_chunk=args.prefill_chunk, prefill_step_tokens=args.prefill_step_tokens,
                          mixed_chunk=args.mixed_chunk, prefill_every=args.prefill_every, max_queue=4096,
                          cuda_graphs=True, gpu_kernels=not args.no_kernels,
                          prefill_graphs=not args.no_prefill_graphs, draft_fp8=args.draft_fp8,
                          blas_rule=not args.no_blas_rule, warmup=args.engine_warmup,
                          cost_curve=args.cost_curve or ("auto" if args.auto else "off"))
    engine = Engine(target, drafter, tokenizer, config, model_name=f"standin-{args.shape}")
    engine.start()
    if engine.cost_curve is not None:  # the curve budget auto divided by: `ddtree replay predict --cost-curve` reads it
        save_curve(engine.cost_curve, out_dir / "cost_curve.json")
    eager = Engine(target, drafter, tokenizer, dataclasses.replace(config, cuda_graphs=False, max_batch=2, warmup="none"),
                   model_name="eager")
    eager.start()
    stream = held_out_token_stream(tokenizer, max(contexts) * 2 + 4096)
    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "shape": args.shape,
              "gpu_kernels": not args.no_kernels, "prefill_chunk": args.prefill_chunk,
              "prefill_step_tokens": engine.config.prefill_step_tokens,
              "mixed_chunk": args.mixed_chunk,
              "prefill_every": resolve_prefill_every(args.prefill_every, "cuda" if cuda else "cpu"),
              "draft_fp8": args.draft_fp8, "blas_rule": not args.no_blas_rule, "compile_log": listening,
              "standin_build_s": build_s, "params_target": sum(p.numel() for p in target.parameters()),
              "params_drafter": sum(p.numel() for p in drafter.parameters()),
              "cost_curve": engine.cost_curve_source.info(), "cells": [], "skipped": []}

    # 1. graph replay == eager on a short greedy run (bf16; reported, not asserted)
    probe = prompts_for(stream, min(1024, max(contexts)), 2, salt=99)
    tree = TreeSettings(method="ddtree", budget=32)
    g = run_cell(engine, probe, tree, min(64, args.new_tokens))
    e = run_cell(eager, probe, tree, min(64, args.new_tokens))
    report["graph_vs_eager_identical"] = g["tokens"] == e["tokens"]
    eager.shutdown(drain_timeout=0)
    del eager

    # 2. the matrix (ddtree.lab.bench.matrix: warm-up, timed run, retime, one row per cell)
    def on_row(row: dict) -> None:
        print(json.dumps(row), flush=True)
        _write(out_dir, report)

    run_matrix(engine, stream, plan, report, compiles=compiles, deadline=t_start + args.time_budget, on_row=on_row)
    report["compiles_total"] = compiles.between(t_start, time.perf_counter())
    report["graph_captures"] = engine.graphs.captures if engine.graphs is not None else 0
    report["prefill_graph_captures"] = engine.prefill_graphs.captures if engine.prefill_graphs is not None else 0
    if engine.graphs is not None:  # mixed rounds' layer graphs, captured lazily inside the cells
        report["mixed_graph_captures"] = engine.graphs.mixed_captures
        report["mixed_graph_capture_s"] = round(engine.graphs.mixed_capture_s, 3)
    # rounds whose riders took a prefill step: their mixed graph not captured and captures past their share
    report["mixed_deferred_rounds"] = engine.snapshot().mixed_deferred_total
    engine.shutdown(drain_timeout=0)
    del engine
    import gc

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if not args.no_hf and time.perf_counter() < t_start + args.time_budget + 60:
        try:
            report["hf_generate"] = hf_generate_reference(target, len(tokenizer), 1024, 64, device)
        except Exception as exc:  # the reference is optional; record why it did not run
            report["hf_generate"] = {"error": f"{type(exc).__name__}: {exc}"}
    report["total_s"] = time.perf_counter() - t_start
    _write(out_dir, report)
    print(render_markdown(report))


def _write(out_dir: Path, report: dict) -> None:
    tmp = out_dir / "gpu.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out_dir / "gpu.json")
    (out_dir / "gpu.md").write_text(render_markdown(report))


if __name__ == "__main__":
    sys.exit(main())
