"""First request vs second on a fresh engine (issue 22): does the start-up warm-up remove the first-use stalls?

One process = one fresh engine on the cost-faithful stand-in (``--shape``, default qwen3-8b, built from the demo
pair as ``benchmarks/gpu.py`` builds it), started with ``--warmup``; then, greedy, 128 new tokens per request:

- the start-up: stand-in build, engine build (fuse, KV), ``Engine.start()`` (the warm-up plan, then one tiny
  request), with the warm-up's own report (graphs, seconds, Triton compilations, estimated and measured memory);
- one sweep cell run first (4 requests at 2k context, DDTree b31, ``--cell-tokens`` new tokens each: several
  seconds a run), ``--cell-repeats`` times back to back, with the GPU's clocks and temperature read before
  (``nvidia-smi``; read only, nothing set) and the device time of each round's stages beside its wall time;
- each workload of the issue's table run twice back to back on the same prompts (all requests submitted at once):
  8 x 1k DDTree b15, 32 x 300 DDTree b4, 1 x 3k DDTree b31, 8 x 1k AR; wall time, tok/s, graph captures and
  Triton compilations inside each run;
- the sweep cell again, last, as often: same tok/s within the repeats' spread if no cell depends on what ran
  before it (median and min-max of each block; device stage time per round tells the GPU's share of a
  difference from the host's).

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


def timed(engine, prompts, tree, compiles: CompileLog, device, new_tokens: int | None = None) -> dict:
    """One run of ``prompts`` (all at once) with the captures and compilations that happened inside it."""
    captures = graph_captures(engine)
    synchronize(device)
    t0 = time.perf_counter()
    cell = run_cell(engine, prompts, tree, new_tokens or NEW_TOKENS)
    t1 = time.perf_counter()
    return {"wall_s": round(cell["wall_s"], 4), "tok_s": round(cell["tok_s"], 1),
            "accept_length": round(cell["accept_length"], 3), "errors": cell["errors"],
            "round_ms": cell["round_ms"], "stage_ms_per_round": cell["stage_ms_per_round"],
            "captures": graph_captures(engine) - captures, "compiles": compiles.between(t0, t1)}


def gpu_state() -> str | None:
    """SM / memory clocks, temperature, power and active throttle reasons (``nvidia-smi`` query; read only)."""
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,"
                               "clocks_throttle_reasons.active", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def cell_block(engine, prompts, compiles: CompileLog, device, repeats: int, new_tokens: int) -> dict:
    """The sweep cell ``repeats`` times back to back: each run, then the median and spread of tok/s."""
    state = gpu_state()
    runs = [timed(engine, prompts, CELL[3], compiles, device, new_tokens) for _ in range(repeats)]
    toks = sorted(r["tok_s"] for r in runs)
    median = toks[len(toks) // 2]
    return {"gpu_before": state, "gpu_after": gpu_state(), "runs": runs, "tok_s_median": median,
            "tok_s_min": toks[0], "tok_s_max": toks[-1],
            "spread_pct": round(100 * (toks[-1] - toks[0]) / max(median, 1e-9), 1),
            "captures": sum(r["captures"] for r in runs), "compiles": sum(r["compiles"]["count"] for r in runs)}


def recapture(engine, count: int, device) -> list[dict]:
    """Capture the first ``count`` planned round keys again (their shared draft, tree and layers stages too) with 2,
    1 and 0 eager passes before each new signature (``graph_capture.Recorder.eager_runs``; the recorder forgets
    what it met first), twice each: what one capture costs once nothing compiles, and where it goes (the
    recorder's clock per phase)."""
    graphs = engine.graphs
    recorder = graphs.recorder
    keys = [k for k in engine.warmup.plan.rounds if k in graphs.graphs][:count]
    rows = []
    kept = recorder.eager_runs
    for runs in (2, 1, 0, 2, 1, 0):
        for key in keys:
            if key in graphs.graphs:
                del graphs.graphs[key]
                graphs._drop(key)
        recorder.eager_runs = runs
        recorder.forget()
        before = {k: v for k, v in recorder.clock.seconds.items()}
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for key in keys:
            graphs.capture(key)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        phases = {k: round(v - before.get(k, 0.0), 3) for k, v in recorder.clock.seconds.items()
                  if v - before.get(k, 0.0) > 0}
        rows.append({"eager_runs": runs, "keys": len(keys), "seconds": round(seconds, 3),
                     "per_key_ms": round(1e3 * seconds / max(len(keys), 1), 1), "phases_s": phases,
                     "stage_graphs": graphs.stage_graphs()})
        print(f"recapture, {runs} eager runs: {len(keys)} round keys in {seconds:.2f} s "
              f"({rows[-1]['per_key_ms']} ms a key; {phases})", flush=True)
    recorder.eager_runs = kept
    return rows


def memory_stats(device) -> dict | None:
    """torch's allocator counters (allocated, reserved, their peaks): graph pools' blocks are reserved by torch."""
    if device.type != "cuda":
        return None
    s = torch.cuda.memory_stats(device)
    keys = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
            "reserved_bytes.all.peak", "segment.all.current")
    return {k: int(s.get(k, 0)) for k in keys}


def combine_check(device) -> list[dict]:
    """Tree attention with the combine unrolled over exactly splits + 1 partials against the bucketed unroll
    (2^k + 1 slots, the extra ones masked): 8 rows x 16 tokens over 2048 keys with Qwen3-8B's heads in bf16, at
    split counts whose partial count is not 2^k + 1 (3, 6, 12); median microseconds of ``triton.testing.do_bench``,
    each variant timed twice in alternating order, and the largest difference between the two outputs."""
    from triton.testing import do_bench

    from ddtree.models.tree_attention import tree_attention

    r, t, h, kv, d, length = 8, 16, 32, 8, 128, 2048
    gen = torch.Generator(device=device).manual_seed(0)
    k = torch.randn((r + 1, kv, length, d), device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(k.shape, device=device, dtype=torch.bfloat16, generator=gen)
    q = torch.randn((r, t, h, d), device=device, dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    slots = torch.arange(r, device=device)
    start = torch.full((r,), length - t, dtype=torch.long, device=device)
    vis = torch.tril(torch.ones((t, t), dtype=torch.bool, device=device)).expand(r, t, t).contiguous()
    rows = []
    for splits in (3, 6, 12):
        calls = {name: (lambda u=unroll, n=splits: tree_attention(q, k, v, slots, start, vis, length, splits=n,
                                                                  combine_unroll=u))
                 for name, unroll in (("exact", splits + 1), ("bucketed", None))}
        outs = {name: f().float() for name, f in calls.items()}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(2):
            for name, f in calls.items():
                times[name].append(round(do_bench(f, warmup=25, rep=200, return_mode="median") * 1e3, 2))
        rows.append({"splits": splits, "exact_us": times["exact"], "bucketed_us": times["bucketed"],
                     "max_abs_diff": float((outs["exact"] - outs["bucketed"]).abs().max())})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--shape", default="qwen3-8b", help="stand-in shape, or 'none' for the demo pair as is")
    ap.add_argument("--warmup", default="4,31", help="EngineConfig.warmup (default tree b15: fast + 4,31 covers "
                                                     "every workload's budget)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--combine-check", action="store_true", help="after the run, time the combine's unroll "
                                                                  "bucketing against the exact unroll")
    ap.add_argument("--recapture", type=int, default=0, help="after the run, capture this many planned round "
                    "keys again with 2, 1 and 0 eager passes (what a capture costs once nothing compiles)")
    ap.add_argument("--eager-runs", type=int, default=None, help="eager passes before each capture in the warm-up "
                    "(graph_capture.Recorder.eager_runs; default the engine's)")
    ap.add_argument("--profile-build", action="store_true", help="cProfile the stand-in build and tokenizer load "
                    "(OUT/build_profile.txt: the 40 largest cumulative entries)")
    ap.add_argument("--no-workloads", action="store_true", help="start-up only: no workloads, no sweep cell")
    ap.add_argument("--cell-repeats", type=int, default=3)
    ap.add_argument("--cell-tokens", type=int, default=512, help="new tokens per request in the sweep cell")
    ap.add_argument("--quick", action="store_true", help="dry run: contexts / 16, 8 new tokens, at most 4 requests")
    args = ap.parse_args(argv)
    global WORKLOADS, CELL, NEW_TOKENS
    if args.quick:
        WORKLOADS = tuple((n, min(c, 4), ctx // 16, t) for n, c, ctx, t in WORKLOADS)
        CELL = (CELL[0], CELL[1], CELL[2] // 16, CELL[3])
        NEW_TOKENS = 8
        args.cell_tokens = 8
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # the warm-up's progress
    compiles = CompileLog()
    listening = compiles.install()
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    from ddtree.models import load_tokenizer
    from ddtree.models.standin import load_demo_benchmark_pair

    t_init = time.perf_counter()
    if cuda:  # the CUDA context on its own, so that the stand-in's build time is the build's
        torch.empty(1, device=device)
        synchronize(device)
    t_load = time.perf_counter()
    profile = None
    if args.profile_build:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    target, drafter, tokenizer_dir = load_demo_benchmark_pair(args.shape, device,
                                                             torch.bfloat16 if cuda else torch.float32)
    synchronize(device)
    t_pair = time.perf_counter()
    tokenizer = load_tokenizer(tokenizer_dir)
    t_built = time.perf_counter()
    if profile is not None:
        import io
        import pstats

        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
        (out_dir / "build_profile.txt").write_text(text.getvalue())
    contexts = [w[2] for w in (*WORKLOADS, CELL)]
    config = EngineConfig(max_batch=args.max_batch, max_len=max(max(contexts) + NEW_TOKENS, CELL[2] + args.cell_tokens) + 16,
                          max_budget=32,
                          prefill_chunk=args.prefill_chunk, max_queue=4096, warmup=args.warmup,
                          default_tree=TreeSettings(budget=15))
    free_before = torch.cuda.mem_get_info(device)[0] if cuda else None
    memory_before = memory_stats(device)
    engine = Engine(target, drafter, tokenizer, config, model_name=f"standin-{args.shape}")
    if args.eager_runs is not None and engine.graphs is not None:
        engine.graphs.recorder.eager_runs = args.eager_runs
    t_engine = time.perf_counter()
    engine.start()
    t_ready = time.perf_counter()
    report: dict = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "shape": args.shape, "warmup": args.warmup, "config": {k: v for k, v in config.__dict__.items()
                                                                if k != "default_tree"},
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache (Triton's default)"),
        "compile_log": listening,
        "startup": {"imports_s": round(t_init - T_PROCESS, 2), "cuda_init_s": round(t_load - t_init, 2),
                    "standin_build_s": round(t_built - t_load, 2), "pair_s": round(t_pair - t_load, 2),
                    "tokenizer_s": round(t_built - t_pair, 2),
                    "engine_build_s": round(t_engine - t_built, 2), "start_s": round(t_ready - t_engine, 2),
                    "process_to_ready_s": round(t_ready - T_PROCESS, 2),
                    "compiles_during_start": compiles.between(t_engine, t_ready),
                    "free_before_engine_bytes": free_before},
        "engine_warmup": engine.info()["warmup"],
        "memory_before_engine": memory_before, "memory_ready": memory_stats(device),
        "kv_bytes": engine.runner.kv_bytes,
    }
    # written now and again at the end: a run cut short still leaves its start-up numbers
    (out_dir / "first_request.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"ready in {t_ready - T_PROCESS:.1f} s (start {t_ready - t_engine:.1f} s); capture phases "
          f"{report['engine_warmup'].get('capture')}; stage graphs {report['engine_warmup'].get('stage_graphs')}",
          flush=True)
    if args.no_workloads:
        engine.shutdown()
        compiles.uninstall()
        return
    stream = held_out_token_stream(tokenizer, sum(w[1] * w[2] for w in (*WORKLOADS, CELL)) + 8192)
    cell_prompts = prompts_for(stream, CELL[2], CELL[1], salt=99)
    report["cell_first"] = cell_block(engine, cell_prompts, compiles, device, args.cell_repeats, args.cell_tokens)
    rows = []
    for i, (name, count, context, tree) in enumerate(WORKLOADS):
        prompts = prompts_for(stream, context, count, salt=i)
        first = timed(engine, prompts, tree, compiles, device)
        second = timed(engine, prompts, tree, compiles, device)
        rows.append({"workload": name, "first": first, "second": second,
                     "ratio": round(first["wall_s"] / max(second["wall_s"], 1e-9), 3)})
        print(f"{name}: {first['wall_s']:.3f} s then {second['wall_s']:.3f} s", flush=True)
    report["workloads"] = rows
    report["cell_last"] = cell_block(engine, cell_prompts, compiles, device, args.cell_repeats, args.cell_tokens)
    report["engine_warmup_end"] = engine.info()["warmup"]
    report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device) if cuda else None
    if args.recapture and cuda:
        report["recapture"] = recapture(engine, args.recapture, device)
    engine.shutdown()
    compiles.uninstall()
    if args.combine_check and cuda:
        report["combine_check"] = combine_check(device)
    (out_dir / "first_request.json").write_text(json.dumps(report, indent=1, default=str))
    print(render(report))
    for row in report.get("combine_check", []):
        print(f"combine check, {row['splits']} splits: exact unroll {row['exact_us']} us, bucketed "
              f"{row['bucketed_us']} us, max |diff| {row['max_abs_diff']}")


def render(report: dict) -> str:
    s, w = report["startup"], report["engine_warmup"]
    lines = [f"Device {report['device']}, torch {report['torch']}, shape {report['shape']}, --warmup "
             f"{report['warmup']}, Triton cache {report['triton_cache_dir']}", "",
             f"start-up: process to ready {s['process_to_ready_s']} s (imports {s['imports_s']} s, CUDA context "
             f"{s.get('cuda_init_s')} s, stand-in build {s['standin_build_s']} s, "
             f"engine build {s['engine_build_s']} s, start {s['start_s']} s); warm-up {w['seconds']} s, "
             f"{w['graphs_done']} graphs ({w['round_keys']} round keys, {w['prefill_keys']} prefill keys), "
             f"Triton {w['triton_compiled']} compiled + {w['triton_disk_hits']} from disk, graph memory "
             f"{(w['reserved_delta_bytes'] or 0) / 2**30:.2f} GiB reserved by torch during the warm-up "
             f"({(w['allocated_delta_bytes'] or 0) / 2**30:.2f} GiB allocated; driver free memory "
             f"{(w['graph_bytes'] or 0) / 2**30:.2f} GiB) / {w['estimated_graph_bytes'] / 2**30:.2f} GiB estimated; "
             f"precompiled {w.get('precompiled')}", "",
             "capture phases: " + ", ".join(f"{k} {v['count']} ({v['seconds']:.1f} s)"
                                            for k, v in (w.get("capture") or {}).items()), "",
             "| workload | first time | second time | ratio | captures / compiles in the first |",
             "| --- | --- | --- | --- | --- |"]
    for r in report["workloads"]:
        lines.append(f"| {r['workload']} | {r['first']['wall_s']:.2f} s | {r['second']['wall_s']:.2f} s | "
                     f"{r['ratio']:.2f}x | {r['first']['captures']} / {r['first']['compiles']['count']} |")
    lines.append("")
    for name in ("cell_first", "cell_last"):
        c = report[name]
        lines.append(f"{CELL[0]} {name[5:]}: median {c['tok_s_median']} tok/s (min {c['tok_s_min']}, max "
                     f"{c['tok_s_max']}, spread {c['spread_pct']}%; runs {[r['tok_s'] for r in c['runs']]}; "
                     f"{c['captures']} captures, {c['compiles']} compiles; GPU {c['gpu_before']})")
    lines.append(f"misses after warm-up: {report['engine_warmup_end']['misses']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
