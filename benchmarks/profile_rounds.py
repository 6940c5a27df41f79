"""Where an engine round's device time goes, exact mode beside the default engine (torch.profiler over served rounds).

The engine's stage timer gives each stage's total; ``benchmarks/profile_step.py`` lists the kernels of eager
forwards. This runs the engine itself, CUDA graphs and all, on the same requests in both modes, and lists the
kernels of the rounds as served (count and device time per round, per mode, side by side), with each mode's round
wall time and the device time its kernels add up to: the difference is time the device did not run a kernel of
the round (launch gaps, host waits). Why: exact mode's price at 64 in flight was about 3 ms a round of which the
kernels measured alone explained 1 (docs/benchmarks.md, "Exact mode", fourth run).

Each (method, mode) runs once untimed (captures and compilations), then again with the profiler on from the moment
every request has its first token (the prefills are done) until the first request finishes (``--window all-rows``,
the default: every round in it holds every request, so the two modes' windows hold the same rows) or until the
last one does (``--window to-end``; rows leave as requests finish, so the modes' windows can differ); a window
without a round is reported as the cell's error. ``--concurrency`` requests at once, ``--context`` tokens each,
``--new-tokens`` each, greedy; writes ``OUT/profile_rounds.md`` and ``.json``. Times under the profiler are slower
than without it (its tracing adds host time per launch). The profiler is started once before the cells: its first
start in a process sets up CUDA tracing (CUPTI), and in an earlier version of this script the first cell profiled
had a window of other rows than the rest (the default engine's chain at C = 64: 6.3 rows a round in its window, the
exact one 28.6; docs/benchmarks.md, "Exact mode", ninth run); each window records how long its start took.

    python benchmarks/profile_rounds.py --out $OUT/prof --methods ar,ddtree-4 --concurrency 64 --context 1024
    python benchmarks/profile_rounds.py --out /tmp/p --device cpu --shape none --concurrency 2 --context 64  # dry run
"""

from __future__ import annotations

import argparse
import gc
import json
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ddtree.engine import Engine, EngineConfig, TreeSettings
from ddtree.lab.bench.inprocess import bench_requests, run_cell, synchronize
from ddtree.lab.bench.kernel_timing import kernel_times
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for

MODES = ("default", "exact")


def tree_of(method: str) -> TreeSettings:
    """``ar``, ``dflash`` or ``ddtree-<budget>``."""
    if method.startswith("ddtree-"):
        return TreeSettings(budget=int(method.split("-", 1)[1]))
    return TreeSettings(method=method)


class EmptyWindow(RuntimeError):
    """The profiling window held no decode round (:func:`decode_window`)."""


def decode_window(engine: Engine, prompts, tree: TreeSettings, new_tokens: int, cuda: bool,
                  window: str = "all-rows") -> dict:
    """Every prompt at once; the profiler runs from the moment every request has its first token (the prefills
    are done) to the first request's end (``window`` "all-rows") or the last one's ("to-end"), so the kernels are
    the decode rounds'. Rounds in the window: the rounds the engine reads in it (its ``_collect``, once a round),
    with their mean rows (to the end, requests that finish leave the batch)."""
    state = {"first": 0, "done": 0, "tokens": 0, "rounds": 0, "rows": 0, "profiling": False}
    lock, all_first, all_done = threading.Lock(), threading.Event(), threading.Event()
    first_done = threading.Event()
    collect = engine._collect

    def counted(flight):  # the engine thread reads each round once
        with lock:
            if state["profiling"]:
                state["rounds"] += 1
                state["rows"] += len(flight.states)
        return collect(flight)

    def on_chunk(chunk) -> None:
        with lock:
            if state["profiling"] and chunk.token_ids:
                state["tokens"] += len(chunk.token_ids)
            if chunk.token_ids and chunk.request_id not in seen:
                seen.add(chunk.request_id)
                state["first"] += 1
                if state["first"] == len(prompts):
                    all_first.set()
            if chunk.finished:
                state["done"] += 1
                first_done.set()
                if state["done"] == len(prompts):
                    all_done.set()

    seen: set[str] = set()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    engine._collect = counted
    try:
        for req in bench_requests(prompts, tree, new_tokens):
            engine.submit(req, on_chunk)
        if not all_first.wait(600):
            raise RuntimeError("the requests' first tokens did not all arrive")
        asked = time.perf_counter()
        with profile(activities=activities) as prof:
            with lock:
                state["profiling"] = True
                t0 = time.perf_counter()
                started_early = not first_done.is_set()
            if not (first_done if window == "all-rows" else all_done).wait(600):
                raise RuntimeError("the requests did not finish")
            with lock:
                state["profiling"] = False
                wall = time.perf_counter() - t0
            synchronize(engine.device)
        if not all_done.wait(600):
            raise RuntimeError("the requests did not all finish")
    finally:
        del engine._collect  # the class's method again
    if state["rounds"] == 0 or window == "all-rows" and not started_early:
        raise EmptyWindow(f"no decode round ran while all {len(prompts)} requests were decoding (the first ones "
                          f"finished before the last one's first token, or before the profiler started); raise "
                          f"--new-tokens (now {new_tokens}) or --prefill-chunk, or pass --prefill-every 1")
    rounds = state["rounds"]
    kernels = kernel_times(prof, cuda, width=80)
    return {"window": window, "start_ms": 1e3 * (t0 - asked), "rounds": rounds, "mean_rows": state["rows"] / rounds,
            "tokens": state["tokens"], "wall_s": wall,
            "round_ms": 1e3 * wall / rounds,
            "tok_s": state["tokens"] / max(wall, 1e-9),
            "kernel_ms_per_round": sum(us for _, us in kernels.values()) / rounds / 1e3, "kernels": kernels}


def profiled_cell(engine: Engine, prompts, tree: TreeSettings, new_tokens: int, cuda: bool,
                  window: str = "all-rows") -> dict:
    run_cell(engine, prompts, tree, new_tokens)  # captures and compilations, untimed
    synchronize(engine.device)
    return decode_window(engine, prompts, tree, new_tokens, cuda, window)


def start_profiler_once(cuda: bool) -> None:
    """One short profile before any window: the first start in a process sets up the profiler's CUDA tracing
    (CUPTI), which must not delay a window's start."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities):
        torch.zeros(1, device="cuda" if cuda else "cpu").add_(1)
        synchronize(torch.device("cuda" if cuda else "cpu"))


def table(report: dict, top: int) -> str:
    lines = []
    for method, modes in report["cells"].items():
        d, e = modes.get("default"), modes.get("exact")
        if not d or not e or "error" in d or "error" in e:
            lines += [f"### {method}: {(d or {}).get('error') or (e or {}).get('error') or 'a mode is missing'}", ""]
            continue
        lines += [f"### {method}, C = {report['concurrency']}, context {report['context']}", "",
                  f"window: {d.get('window', 'to-end')}, profiler started {d.get('start_ms', 0):.0f} / "
                  f"{e.get('start_ms', 0):.0f} ms after the last first token (default / exact)", "",
                  f"decode under the profiler, default: {d['tok_s']:.0f} tok/s, round {d['round_ms']:.2f} ms wall, "
                  f"kernels {d['kernel_ms_per_round']:.2f} ms a round ({d['rounds']} rounds of {d['mean_rows']:.1f} "
                  f"rows); exact: {e['tok_s']:.0f} tok/s, round {e['round_ms']:.2f} ms wall, kernels "
                  f"{e['kernel_ms_per_round']:.2f} ms a round ({e['rounds']} rounds of {e['mean_rows']:.1f} rows)",
                  "",
                  "| kernel | default: per round | ms | exact: per round | ms | exact - default, ms |",
                  "| --- | --- | --- | --- | --- | --- |"]
        names = set(d["kernels"]) | set(e["kernels"])

        def per_round(cell, name):
            n, us = cell["kernels"].get(name, (0, 0.0))
            return n / cell["rounds"], us / cell["rounds"] / 1e3

        rows = sorted(names, key=lambda k: -max(per_round(d, k)[1], per_round(e, k)[1]))[:top]
        for name in rows:
            (dn, dms), (en, ems) = per_round(d, name), per_round(e, name)
            lines.append(f"| `{name}` | {dn:.1f} | {dms:.3f} | {en:.1f} | {ems:.3f} | {ems - dms:+.3f} |")
        lines.append("")
    return "\n".join(lines)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-8b", help="stand-in shape, or 'none' for the demo pair as is")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", default="ar,ddtree-4")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--window", choices=("all-rows", "to-end"), default="all-rows",
                    help="profile until the first request finishes (every round holds every request) or the last")
    ap.add_argument("--top", type=int, default=24)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="EngineConfig.prefill_chunk (default: every prompt in one step, at most 4096 tokens: the KV "
                         "cache grows with it)")
    ap.add_argument("--prefill-every", type=int, default=None,
                    help="EngineConfig.prefill_every (default: the engine's, 3 on CUDA: while others decode a prefill "
                         "step runs at most every 3 rounds, so at C = 64 with 1k prompts in 512-token steps the first "
                         "requests finish before the last one's first token; 1 opens the all-rows window)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()

    from ddtree.models import load_tokenizer
    from ddtree.models.standin import load_demo_benchmark_pair

    target, drafter, tokenizer_dir = load_demo_benchmark_pair(args.shape, device,
                                                             torch.bfloat16 if cuda else torch.float32)
    tokenizer = load_tokenizer(tokenizer_dir)
    prompts = prompts_for(held_out_token_stream(tokenizer, 2 * args.context + 4096), args.context,
                          args.concurrency, salt=3)
    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "shape": args.shape, "concurrency": args.concurrency, "context": args.context,
              "new_tokens": args.new_tokens, "window": args.window, "cells": {}}
    start_profiler_once(cuda)
    for mode in MODES:
        config = EngineConfig(max_batch=args.concurrency, max_len=args.context + args.new_tokens + 80, max_budget=64,
                              max_queue=4096, exact=mode == "exact", warmup="none",
                              prefill_chunk=args.prefill_chunk or min(args.concurrency * args.context, 4096),
                              prefill_every=args.prefill_every)
        engine = Engine(target, drafter, tokenizer, config, model_name=f"standin-{args.shape}-{mode}")
        engine.start()
        try:
            for method in args.methods.split(","):
                try:
                    cell = profiled_cell(engine, prompts, tree_of(method), args.new_tokens, cuda, args.window)
                except EmptyWindow as exc:  # recorded; the other cells still run
                    report["cells"].setdefault(method, {})[mode] = {"error": str(exc)}
                    print(f"{method} {mode}: {exc}", flush=True)
                    continue
                report["cells"].setdefault(method, {})[mode] = cell
                print(f"{method} {mode}: decode {cell['tok_s']:.0f} tok/s, round {cell['round_ms']:.2f} ms, kernels "
                      f"{cell['kernel_ms_per_round']:.2f} ms a round", flush=True)
        finally:
            engine.shutdown(drain_timeout=0)
            del engine  # the next mode's engine sizes its KV cache from what this one leaves free
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                held = torch.cuda.memory_allocated(device) / 2**30
                report.setdefault("gib_after_shutdown", {})[mode] = round(held, 2)
                print(f"{mode}: {held:.2f} GiB still allocated after the engine's shutdown", flush=True)
    report["total_s"] = time.perf_counter() - t0
    (out_dir / "profile_rounds.json").write_text(json.dumps(report, indent=1))
    text = table(report, args.top)
    (out_dir / "profile_rounds.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
