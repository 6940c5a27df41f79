"""First request vs second on a fresh engine (issue 22): does the start-up warm-up remove the first-use stalls?

One process = one fresh engine on the cost-faithful stand-in (``--shape``, default qwen3-8b, built from the demo
pair as ``benchmarks/gpu.py`` builds it), started with ``--warmup``; then, greedy, 128 new tokens per request:

- the start-up: stand-in build, engine build (fuse, KV), ``Engine.start()`` (the warm-up plan, then one tiny
  request), with the warm-up's own report (graphs, seconds, Triton compilations, estimated and measured memory);
- one sweep cell run first (``--cell``: 4 requests at 2k context, DDTree b31);
- each workload of the issue's table run twice back to back on the same prompts (all requests submitted at once):
  8 x 1k DDTree b15, 32 x 300 DDTree b4, 1 x 3k DDTree b31, 8 x 1k AR; wall time, tok/s, graph captures and
  Triton compilations inside each run;
- the sweep cell again, last: same tok/s within noise if no cell depends on what ran before it.

Cold vs warm Triton cache is two processes (Triton keeps compiled kernels in memory too)::

    TRITON_CACHE_DIR=$OUT/triton python benchmarks/first_request.py --out $OUT/cold   # empty cache dir
    TRITON_CACHE_DIR=$OUT/triton python benchmarks/first_request.py --out $OUT/warm   # the same dir again

Writes ``OUT/first_request.json`` and prints a markdown table. ``--device cpu --shape none`` is a dry run of the
script on the demo pair (no graphs: the plan is empty).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

T_PROCESS = time.perf_counter()

import torch  # noqa: E402

from ddtree.engine import Engine, EngineConfig, TreeSettings  # noqa: E402
from ddtree.lab.bench.inprocess import run_cell, synchronize  # noqa: E402
from ddtree.lab.bench.matrix import CompileLog, graph_captures  # noqa: E402
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for  # noqa: E402

NEW_TOKENS = 128
WORKLOADS = (  # name, requests, context, tree (the table)
    ("8 requests, 1k context, DDTree b15", 8, 1024, TreeSettings(budget=15)),
    ("32 requests, 300 context, b4", 32, 300, TreeSettings(budget=4)),
    ("1 request, 3k context, b31", 1, 3072, TreeSettings(budget=31)),
    ("8 requests, 1k context, AR", 8, 1024, TreeSettings(method="ar")),
)
CELL = ("sweep cell: 4 requests, 2k context, DDTree b31", 4, 2048, TreeSettings(budget=31))


def timed(engine, prompts, tree, compiles: CompileLog, device) -> dict:
    """One run of ``prompts`` (all at once) with the captures and compilations that happened inside it."""
    captures = graph_captures(engine)
    synchronize(device)
    t0 = time.perf_counter()
    cell = run_cell(engine, prompts, tree, NEW_TOKENS)
    t1 = time.perf_counter()
    return {"wall_s": round(cell["wall_s"], 4), "tok_s": round(cell["tok_s"], 1),
            "accept_length": round(cell["accept_length"], 3), "errors": cell["errors"],
            "captures": graph_captures(engine) - captures, "compiles": compiles.between(t0, t1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--shape", default="qwen3-8b", help="stand-in shape, or 'none' for the demo pair as is")
    ap.add_argument("--warmup", default="4,31", help="EngineConfig.warmup (default tree b15: fast + 4,31 covers "
                                                     "every workload's budget)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="dry run: contexts / 16, 8 new tokens, at most 4 requests")
    args = ap.parse_args(argv)
    global WORKLOADS, CELL, NEW_TOKENS
    if args.quick:
        WORKLOADS = tuple((n, min(c, 4), ctx // 16, t) for n, c, ctx, t in WORKLOADS)
        CELL = (CELL[0], CELL[1], CELL[2] // 16, CELL[3])
        NEW_TOKENS = 8
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # the warm-up's progress
    compiles = CompileLog()
    listening = compiles.install()
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    from ddtree.models import load_tokenizer
    from ddtree.models.standin import load_demo_benchmark_pair

    t_load = time.perf_counter()
    target, drafter, tokenizer_dir = load_demo_benchmark_pair(args.shape, device,
                                                             torch.bfloat16 if cuda else torch.float32)
    tokenizer = load_tokenizer(tokenizer_dir)
    synchronize(device)
    t_built = time.perf_counter()
    contexts = [w[2] for w in (*WORKLOADS, CELL)]
    config = EngineConfig(max_batch=args.max_batch, max_len=max(contexts) + NEW_TOKENS + 16, max_budget=32,
                          prefill_chunk=args.prefill_chunk, max_queue=4096, warmup=args.warmup,
                          default_tree=TreeSettings(budget=15))
    free_before = torch.cuda.mem_get_info(device)[0] if cuda else None
    engine = Engine(target, drafter, tokenizer, config, model_name=f"standin-{args.shape}")
    t_engine = time.perf_counter()
    engine.start()
    t_ready = time.perf_counter()
    report: dict = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "shape": args.shape, "warmup": args.warmup, "config": {k: v for k, v in config.__dict__.items()
                                                                if k != "default_tree"},
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache (Triton's default)"),
        "compile_log": listening,
        "startup": {"imports_s": round(t_load - T_PROCESS, 2), "standin_build_s": round(t_built - t_load, 2),
                    "engine_build_s": round(t_engine - t_built, 2), "start_s": round(t_ready - t_engine, 2),
                    "process_to_ready_s": round(t_ready - T_PROCESS, 2),
                    "compiles_during_start": compiles.between(t_engine, t_ready),
                    "free_before_engine_bytes": free_before},
        "engine_warmup": engine.info()["warmup"],
        "kv_bytes": engine.runner.kv_bytes,
    }
    # written now and again at the end: a run cut short still leaves its start-up numbers
    (out_dir / "first_request.json").write_text(json.dumps(report, indent=1, default=str))
    stream = held_out_token_stream(tokenizer, sum(w[1] * w[2] for w in (*WORKLOADS, CELL)) + 8192)
    cell_prompts = prompts_for(stream, CELL[2], CELL[1], salt=99)
    report["cell_first"] = timed(engine, cell_prompts, CELL[3], compiles, device)
    rows = []
    for i, (name, count, context, tree) in enumerate(WORKLOADS):
        prompts = prompts_for(stream, context, count, salt=i)
        first = timed(engine, prompts, tree, compiles, device)
        second = timed(engine, prompts, tree, compiles, device)
        rows.append({"workload": name, "first": first, "second": second,
                     "ratio": round(first["wall_s"] / max(second["wall_s"], 1e-9), 3)})
        print(f"{name}: {first['wall_s']:.3f} s then {second['wall_s']:.3f} s", flush=True)
    report["workloads"] = rows
    report["cell_last"] = timed(engine, cell_prompts, CELL[3], compiles, device)
    report["engine_warmup_end"] = engine.info()["warmup"]
    report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device) if cuda else None
    engine.shutdown()
    compiles.uninstall()
    (out_dir / "first_request.json").write_text(json.dumps(report, indent=1, default=str))
    print(render(report))


def render(report: dict) -> str:
    s, w = report["startup"], report["engine_warmup"]
    lines = [f"Device {report['device']}, torch {report['torch']}, shape {report['shape']}, --warmup "
             f"{report['warmup']}, Triton cache {report['triton_cache_dir']}", "",
             f"start-up: process to ready {s['process_to_ready_s']} s (stand-in build {s['standin_build_s']} s, "
             f"engine build {s['engine_build_s']} s, start {s['start_s']} s); warm-up {w['seconds']} s, "
             f"{w['graphs_done']} graphs ({w['round_keys']} round keys, {w['prefill_keys']} prefill keys), "
             f"Triton {w['triton_compiled']} compiled + {w['triton_disk_hits']} from disk, graph memory "
             f"{(w['graph_bytes'] or 0) / 2**30:.2f} GiB measured / {w['estimated_graph_bytes'] / 2**30:.2f} GiB "
             "estimated", "",
             "| workload | first time | second time | ratio | captures / compiles in the first |",
             "| --- | --- | --- | --- | --- |"]
    for r in report["workloads"]:
        lines.append(f"| {r['workload']} | {r['first']['wall_s']:.2f} s | {r['second']['wall_s']:.2f} s | "
                     f"{r['ratio']:.2f}x | {r['first']['captures']} / {r['first']['compiles']['count']} |")
    a, b = report["cell_first"], report["cell_last"]
    lines += ["", f"{CELL[0]}: first {a['tok_s']} tok/s ({a['captures']} captures, {a['compiles']['count']} "
                  f"compiles), last {b['tok_s']} tok/s", f"misses after warm-up: {report['engine_warmup_end']['misses']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
