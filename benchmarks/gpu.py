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

Writes ``OUT/gpu.json`` and ``OUT/gpu.md``; prints the markdown table.

    python benchmarks/gpu.py --out $OUT              # stand-in (Qwen3-8B body) built from the demo pair
    python benchmarks/gpu.py --out /tmp/x --shape none --quick   # the demo pair itself, a few cells
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.models import gemm_backend

BUDGETS = (8, 16, 32, 64, 128, 256, 512)


def held_out_token_stream(tokenizer, min_tokens: int) -> list[int]:
    """Held-out stdlib source (never trained on), tokenized, concatenated to at least ``min_tokens`` tokens."""
    from ddtree.train.corpus import load_corpus

    corpus = load_corpus()
    ids: list[int] = []
    for f in corpus.held_out:
        ids.extend(tokenizer.encode(f.text, add_special_tokens=False))
        if len(ids) >= min_tokens:
            break
    while len(ids) < min_tokens:  # small held-out split: wrap around (prompts still differ by offset)
        ids = ids + ids
    return ids


def prompts_for(stream: list[int], context: int, count: int, salt: int) -> list[list[int]]:
    """``count`` prompts of exactly ``context`` tokens, each from a different offset of the held-out stream."""
    step = max(1, (len(stream) - context) // max(count, 1))
    out = []
    for i in range(count):
        off = (salt * 7919 + i * step) % max(1, len(stream) - context)
        out.append(stream[off : off + context])
    return out


def mean_in_flight(timeline: list[list[float]], wall: float) -> float:
    """Requests in flight averaged over the cell's wall time, from the (submitted, first token, finished) timeline.
    Below C it says how much of the cell the closed loop spent filling up or draining: a method whose requests take
    different times (speculative decoding: acceptance varies with the text) drains for longer than AR, whose
    fixed-length requests all finish together."""
    events = sorted([(s, 1) for s, _, _ in timeline] + [(f, -1) for _, _, f in timeline])
    area, in_flight, last = 0.0, 0, 0.0
    for t, step in events:
        area += in_flight * (t - last)
        in_flight, last = in_flight + step, t
    return area / max(wall, 1e-9)


def run_cell(engine, prompts, tree: TreeSettings, new_tokens: int | list[int], *,
             concurrency: int | None = None) -> dict:
    """Every prompt, at most ``concurrency`` in flight (a closed loop of that many clients, vLLM's and SGLang's
    ``--max-concurrency``: the next request starts as one finishes); None = all at once. With more prompts than
    the concurrency, acceptance averages over texts and the throughput is the loop's, not one batch's drain to
    its slowest request. ``new_tokens``: one count for every prompt, or one per prompt."""
    counts = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    reqs = [GenerationRequest(prompt_token_ids=p, tree=tree, sampling=SamplingParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, counts, strict=True)]
    submitted: dict[int, float] = {}
    submit = engine.submit

    def recording_submit(req, *args, **kwargs):  # when generate() hands each request over (the closed loop's clock)
        submitted[id(req)] = time.perf_counter()
        return submit(req, *args, **kwargs)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.submit = recording_submit  # an instance attribute: generate() calls self.submit
    try:
        outs = engine.generate(reqs, max_in_flight=concurrency)
    finally:
        del engine.submit
    wall = time.perf_counter() - t0
    # Per request (submitted, first token, finished), seconds from the cell's start: where its wall time went.
    timeline = [[round(submitted[id(r)] - t0, 4), round(submitted[id(r)] - t0 + (o.stats.ttft_s or 0.0), 4),
                 round(submitted[id(r)] - t0 + (o.stats.latency_s or 0.0), 4)] for r, o in zip(reqs, outs, strict=True)]
    errors = [o.error for o in outs if o.finish_reason == "error"]
    completion = sum(len(o.token_ids) for o in outs)
    rounds = sum(o.stats.verify_rounds for o in outs)
    stage = {}
    for o in outs:
        for k, v in o.stats.stage_s.items():
            stage[k] = stage.get(k, 0.0) + v
    per_round = {k: 1e3 * v / max(rounds, 1) for k, v in stage.items() if k != "prefill"}
    decode = [(len(o.token_ids) - 1) / max(o.stats.latency_s - o.stats.ttft_s, 1e-9) for o in outs]
    # Tokens after the first over the time after the first, summed over requests: a request's decoding speed
    # without its prefill (at concurrency 1 the speed speculative decoding changes; prefill is the same code).
    decode_tok_s = sum(len(o.token_ids) - 1 for o in outs) / max(
        sum(o.stats.latency_s - o.stats.ttft_s for o in outs), 1e-9)
    # Wall time of a decode round as a request sees it; minus the stages' device time it is the host's share.
    round_ms = statistics.mean(1e3 * (o.stats.latency_s - o.stats.ttft_s) / max(o.stats.verify_rounds, 1) for o in outs)
    return {
        "tok_s": completion / wall,
        "decode_tok_s_per_request": statistics.mean(decode),
        "decode_tok_s": decode_tok_s,
        "accept_length": completion / max(rounds, 1),
        "wall_s": wall,
        "ttft_s_mean": statistics.mean(o.stats.ttft_s or 0.0 for o in outs),
        "stage_ms_per_round": per_round,
        "round_ms": round_ms,
        "errors": errors,
        "tokens": [o.token_ids for o in outs],
        "timeline": timeline,
    }


class CompileLog:
    """Every Triton compilation in this process (``triton.knobs.compilation.listener``): when, which kernel, whether
    the on-disk cache had it, and how long it took. Why: runs 32-35 lost 10-55% of some C >= 8 cells' tok/s in the
    first gpu.py process on a fresh machine, with equal device time per round; a kernel specialization first met
    inside a timed cell (at a cache-length bucket the warm-up never reached: run 37) compiles there, and only the
    first process pays, since the next finds it in Triton's disk cache."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, bool, float]] = []  # (perf_counter, kernel, cache hit, seconds)

    def install(self) -> bool:
        """Listen from now on; False where there is no Triton with ``knobs`` (3.4+): then nothing is recorded."""
        try:
            from triton import knobs
        except ImportError:  # no Triton (a CPU build), or one older than 3.4
            return False
        knobs.compilation.listener = self
        return True

    def uninstall(self) -> None:
        try:
            from triton import knobs
        except ImportError:
            return
        if knobs.compilation.listener is self:
            knobs.compilation.listener = None

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        spent = times.ir_initialization + sum(d for _, d in times.lowering_stages) + times.store_results
        self.events.append((time.perf_counter(), str(metadata.get("name", "?")), bool(cache_hit), spent / 1e6))

    def between(self, start: float, end: float) -> dict:
        """Compilations in [start, end): count, how many the disk cache served, seconds, kernels compiled."""
        hits = [e for e in self.events if start <= e[0] < end]
        return {"count": len(hits), "disk_hits": sum(e[2] for e in hits), "s": round(sum(e[3] for e in hits), 3),
                "kernels": sorted({e[1] for e in hits if not e[2]})[:12]}


def graph_captures(engine) -> int:
    """Round and prefill graphs captured so far (a capture inside a timed cell is a first-use cost too)."""
    return sum(g.captures for g in (engine.graphs, engine.prefill_graphs) if g is not None)


def warm_up_lengths(concurrency: int, longest: int) -> list[int]:
    """New tokens per warm-up prompt: ``concurrency`` prompts whose lengths fall in groups, so that as they finish
    the batch passes through every power-of-two row count the cell's drain will (the round graphs are captured
    per row bucket: C, C/2, ..., 1), then one more prompt, which arrives when the first group finishes (a single
    prompt's prefill while others decode, as in the cell's closed loop) and, as long as the longest, stays to the
    end. Prompt i belongs to group ``i.bit_length()``: after the groups above g finish, 2^g prompts remain with
    the extra one, within the bucket of 2^(g+1) rows, and the extra one alone at last.

    Why: graphs are captured on first use, and a warm-up whose prompts all finish together (the previous one)
    left the smaller buckets to be captured inside the timed cell. Now only ``--warm-up short``: it covers the
    row buckets but not the cache lengths a full batch reaches late, so captures and Triton compilations were
    left inside the timed cells (run 37, docs/benchmarks.md, session 10); the default runs the cell itself."""
    if concurrency == 1:
        return [longest]
    groups = (concurrency - 1).bit_length()
    lengths = [longest * (groups - i.bit_length() + 1) // (groups + 1) for i in range(concurrency)]
    return lengths + [longest]


def plan_cells(contexts, concurrency, budgets, max_verify_tokens):
    """Cells in priority order: the headline (C=1, 1k) first, then the concurrencies and contexts in the order
    given on the command line (so a time-boxed run measures what was listed first)."""
    cells = []
    for conc in concurrency:
        for ctx in contexts:
            methods = [("ar", 0), ("dflash", 0)] + [
                ("ddtree", b) for b in budgets if conc * (b + 1) <= max_verify_tokens
            ]
            cells.append((conc, ctx, methods))
    cells.sort(key=lambda c: (c[0] != 1 or c[1] != 1024, concurrency.index(c[0]), contexts.index(c[1])))
    return cells


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
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    del hf
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
    ap.add_argument("--prefill-chunk", type=int, default=2048,
                    help="EngineConfig.prefill_chunk; the cache keeps this many positions of headroom per slot, so "
                         "1024 lets C=64 at 8k fit one H200")
    ap.add_argument("--waves", type=int, default=4,
                    help="at concurrency C > 1 a cell runs waves * C prompts, C in flight at a time (the drain at "
                         "the end, fewer than C in flight, weighs less the more waves)")
    ap.add_argument("--warm-up", choices=("cell", "short"), default="cell",
                    help="untimed run before each cell: 'cell' runs it once in full (one prompt at C = 1), so every "
                         "graph bucket it reaches (rows x cache length) is captured before the clock starts; 'short' "
                         "is sessions 8-9's staggered short prompts, which left captures inside the cells")
    ap.add_argument("--no-retime", dest="retime", action="store_false",
                    help="keep a timed cell that captured a graph or compiled a kernel (by default it runs again)")
    ap.add_argument("--no-blas-rule", action="store_true",
                    help="cuBLAS for every matmul (ddtree.models.gemm_backend off), for an A/B of the rule")
    args = ap.parse_args(argv)
    compiles = CompileLog()
    listening = compiles.install()
    try:
        _run(args, compiles, listening)
    finally:
        compiles.uninstall()


def _run(args: argparse.Namespace, compiles: CompileLog, listening: bool) -> None:
    gemm_backend.enabled = not args.no_blas_rule
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type != "cuda":  # dry run: make the CUDA-only calls no-ops
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        torch.cuda.reset_peak_memory_stats = lambda *a, **k: None  # type: ignore[assignment]
        torch.cuda.max_memory_allocated = lambda *a, **k: 0  # type: ignore[assignment]
        torch.cuda.get_device_name = lambda *a, **k: "cpu"  # type: ignore[assignment]

    from ddtree.assets import demo_drafter_path, demo_target_path
    from ddtree.models import load_drafter, load_target, load_tokenizer

    tokenizer = load_tokenizer(demo_target_path())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_target(demo_target_path(), dtype=dtype, device=device)
    drafter = load_drafter(demo_drafter_path(), dtype=dtype, device=device)
    t_build = time.perf_counter()
    if args.shape != "none":
        from ddtree.models.standin import build_standin, standin_shape

        target, drafter = build_standin(target, drafter, standin_shape(args.shape))
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t_build
    contexts = [int(x) for x in args.contexts.split(",")]
    concurrency = [int(x) for x in args.concurrency.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]
    if args.quick:
        contexts, concurrency, budgets = [60, 1024], [1, 8], [16, 64]
    max_len = max(contexts) + args.new_tokens + 16
    config = EngineConfig(max_batch=max(concurrency), max_len=max_len, max_budget=max(*budgets, 32),
                          prefill_chunk=args.prefill_chunk, max_queue=4096, cuda_graphs=True, gpu_kernels=not args.no_kernels,
                          prefill_graphs=not args.no_prefill_graphs, draft_fp8=args.draft_fp8)
    engine = Engine.from_models(target, drafter, tokenizer, config, model_name=f"standin-{args.shape}")
    engine.start()
    eager = Engine.from_models(target, drafter, tokenizer, EngineConfig(**{**config.__dict__, "cuda_graphs": False,
                                                                            "max_batch": 2}), model_name="eager")
    eager.start()
    stream = held_out_token_stream(tokenizer, max(contexts) * 2 + 4096)
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "shape": args.shape,
              "gpu_kernels": not args.no_kernels, "prefill_chunk": args.prefill_chunk,
              "draft_fp8": args.draft_fp8, "blas_rule": not args.no_blas_rule, "compile_log": listening,
              "standin_build_s": build_s, "params_target": sum(p.numel() for p in target.parameters()),
              "params_drafter": sum(p.numel() for p in drafter.parameters()), "cells": [], "skipped": []}

    # 1. graph replay == eager on a short greedy run (bf16; reported, not asserted)
    probe = prompts_for(stream, min(1024, max(contexts)), 2, salt=99)
    tree = TreeSettings(method="ddtree", budget=32)
    g = run_cell(engine, probe, tree, min(64, args.new_tokens))
    e = run_cell(eager, probe, tree, min(64, args.new_tokens))
    report["graph_vs_eager_identical"] = g["tokens"] == e["tokens"]
    eager.shutdown(drain_timeout=0)
    del eager

    # 2. the matrix
    deadline = t_start + args.time_budget
    for conc, ctx, methods in plan_cells(contexts, concurrency, budgets, args.max_verify_tokens):
        prompts = prompts_for(stream, ctx, args.c1_prompts if conc == 1 else args.waves * conc, salt=ctx + conc)
        ar_tokens = None
        ar_tok_s = None
        for method, budget in methods:
            name = method if method != "ddtree" else f"ddtree-b{budget}"
            if time.perf_counter() > deadline:
                report["skipped"].append({"concurrency": conc, "context": ctx, "method": name})
                continue
            tree = TreeSettings(method=method, budget=max(budget, 1))
            t_warm, captures_before = time.perf_counter(), graph_captures(engine)
            if args.warm_up == "short":  # sessions 8-9: staggered short prompts, the row buckets only
                longest = min(args.new_tokens, max(args.new_tokens if ctx <= 60 else 24, 16 * conc.bit_length()))
                lengths = warm_up_lengths(conc, longest)
                run_cell(engine, prompts[:len(lengths)], tree, lengths, concurrency=conc)
            else:  # the cell once, untimed: every graph and kernel it will meet exists before the clock starts
                run_cell(engine, prompts[:1] if conc == 1 else prompts, tree, args.new_tokens, concurrency=conc)
            t_warm_end, captures_warm = time.perf_counter(), graph_captures(engine)
            t_cell, captures_cell = t_warm_end, captures_warm
            torch.cuda.reset_peak_memory_stats()
            cell = run_cell(engine, prompts, tree, args.new_tokens, concurrency=conc)
            t_end = time.perf_counter()
            first_use = {"compiles": compiles.between(t_cell, t_end), "captures": graph_captures(engine) - captures_cell}
            retimed = None
            if args.retime and (first_use["captures"] or first_use["compiles"]["count"]):
                # The timed run met a graph bucket or kernel specialization its untimed run had not (the closed
                # loop's arrivals differ from run to run, most at a process's first cell): time it once more.
                # Compilations served by the disk cache count too: cheap, but they mark a shape new to the run.
                retimed = {"tok_s": round(cell["tok_s"], 1), "wall_s": round(cell["wall_s"], 4), **first_use}
                t_cell, captures_cell = time.perf_counter(), graph_captures(engine)
                torch.cuda.reset_peak_memory_stats()
                cell = run_cell(engine, prompts, tree, args.new_tokens, concurrency=conc)
                t_end = time.perf_counter()
            if method == "ar":
                ar_tokens, ar_tok_s = cell["tokens"], cell["tok_s"]
            same = [a == b for a, b in zip(ar_tokens or [], cell["tokens"], strict=False)]
            speedup = cell["tok_s"] / ar_tok_s if ar_tok_s else None
            row = {
                "concurrency": conc, "context": ctx, "method": name, "budget": budget,
                "tok_s": round(cell["tok_s"], 1), "accept_length": round(cell["accept_length"], 3),
                "speedup_vs_ar": round(speedup, 3) if speedup else None,
                "efficiency": round(speedup / cell["accept_length"], 3) if speedup else None,
                "decode_tok_s_per_request": round(cell["decode_tok_s_per_request"], 1),
                "decode_tok_s": round(cell["decode_tok_s"], 1), "prompts": len(prompts),
                "ttft_s_mean": round(cell["ttft_s_mean"], 4),
                "stage_ms_per_round": {k: round(v, 3) for k, v in cell["stage_ms_per_round"].items()},
                "round_ms": round(cell["round_ms"], 3),
                "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "identical_to_ar": sum(same), "compared": len(same), "errors": cell["errors"][:3],
                "wall_s": round(cell["wall_s"], 4), "timeline": cell["timeline"],
                "mean_in_flight": round(mean_in_flight(cell["timeline"], cell["wall_s"]), 2),
                # First-use costs: Triton compilations and graph captures in the warm-up and in the timed cell.
                "compiles": {"warm_up": compiles.between(t_warm, t_warm_end), "cell": compiles.between(t_cell, t_end)},
                "captures": {"warm_up": captures_warm - captures_before,
                             "cell": graph_captures(engine) - captures_cell},
                "retimed": retimed,  # the first timed run, when it met first-use costs and was run again
            }
            report["cells"].append(row)
            print(json.dumps(row), flush=True)
            _write(out_dir, report)
    report["compiles_total"] = compiles.between(t_start, time.perf_counter())
    report["graph_captures"] = engine.graphs.captures if engine.graphs is not None else 0
    report["prefill_graph_captures"] = engine.prefill_graphs.captures if engine.prefill_graphs is not None else 0
    engine.shutdown(drain_timeout=0)
    del engine
    import gc

    gc.collect()
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


def summary_lines(cells: list[dict]) -> list[str]:
    """Per (C, context): DDTree's best budget against the chain and AR, on tok/s and on decode tok/s (the issue's
    targets: >= 1.3x the chain at C = 1, >= the chain and >= AR at every C)."""
    groups: dict[tuple[int, int], dict[str, dict]] = {}
    for c in cells:
        groups.setdefault((c["concurrency"], c["context"]), {})[c["method"]] = c
    out = ["", "| C | ctx | best DDTree | tok/s vs chain | tok/s vs AR | decode vs chain | decode vs AR |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for (conc, ctx), methods in groups.items():
        trees = [c for name, c in methods.items() if name.startswith("ddtree")]
        if not trees:
            continue
        best = max(trees, key=lambda c: c["tok_s"])
        ratios = []
        for key in ("tok_s", "decode_tok_s"):
            for base in ("dflash", "ar"):
                ref = methods.get(base, {}).get(key)
                ratios.append(f"{best.get(key, 0) / ref:.2f}x" if ref else "-")
        out.append(f"| {conc} | {ctx} | {best['method']} | " + " | ".join(ratios) + " |")
    return out


def render_markdown(report: dict) -> str:
    lines = [
        f"Device: {report['device']}, torch {report['torch']}, stand-in shape `{report['shape']}` "
        f"(target {report['params_target'] / 1e9:.2f} B params, drafter {report['params_drafter'] / 1e9:.2f} B), "
        f"built in {report['standin_build_s']:.1f} s; graph replay == eager: {report.get('graph_vs_eager_identical')}",
        "",
        "tok/s: all completion tokens over the cell's wall time (prefill included; C in flight); decode tok/s: "
        "a request's tokens after its first over its time after its first (no prefill); in flight: requests in "
        "flight averaged over the cell (below C: filling up and draining).",
        "",
        "| C | ctx | method | tok/s | decode tok/s | accept | speed-up | efficiency | draft / tree / verify / commit ms "
        "| round ms | in flight | peak GiB | =AR |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in report["cells"]:
        st = c["stage_ms_per_round"]
        split = " / ".join(f"{st.get(k, 0):.2f}" for k in ("draft", "tree", "verify", "commit"))
        lines.append(
            f"| {c['concurrency']} | {c['context']} | {c['method']} | {c['tok_s']} | {c.get('decode_tok_s', '-')} | "
            f"{c['accept_length']} | "
            f"{c['speedup_vs_ar']} | {c['efficiency']} | {split} | {c.get('round_ms', '-')} | "
            f"{c.get('mean_in_flight', '-')} | {c['peak_mem_gib']} | "
            f"{c['identical_to_ar']}/{c['compared']} |"
        )
    lines += summary_lines(report["cells"])
    first_use = [c for c in report["cells"] if c.get("retimed")
                 or c.get("captures", {}).get("cell") or c.get("compiles", {}).get("cell", {}).get("count")]
    if first_use:
        lines += ["", "First-use costs met by timed runs (Triton compilations, graph captures; a retimed cell's "
                  "table row is its second run):"]
        for c in first_use:
            runs = ([("first run", c["retimed"]["tok_s"], c["retimed"]["compiles"], c["retimed"]["captures"])]
                    if c.get("retimed") else [])
            runs.append(("reported run", c["tok_s"], c["compiles"]["cell"], c["captures"]["cell"]))
            lines.append(f"- C{c['concurrency']}/{c['context']}/{c['method']}: " + "; ".join(
                f"{label} {tok_s} tok/s, {comp['count']} compilations ({comp['disk_hits']} from disk, {comp['s']} s"
                f"{': ' + ', '.join(comp['kernels']) if comp['kernels'] else ''}), {caps} captures"
                for label, tok_s, comp, caps in runs))
    if report.get("skipped"):
        lines += ["", f"Skipped (time box): {len(report['skipped'])} cells: "
                  + ", ".join(f"C{s['concurrency']}/{s['context']}/{s['method']}" for s in report["skipped"][:40])]
    if "hf_generate" in report:
        lines += ["", f"Hugging Face generate (same target, batch 1): {report['hf_generate']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
