"""Where exact mode's price goes at C = 64: device time per round by kernel family, exact against default.

The Qwen3-8B stand-in, bf16, both engines (``EngineConfig.exact`` on and off) at 64 slots and a 1k context, CUDA
graphs; for each cell (the DFlash chain and DDTree at C = 64, 64 prompts, greedy) one warm-up run, then one run
under ``torch.profiler`` (CUDA activity: the kernels inside graph replays). Kernel device time is summed by family
and divided by the run's verify rounds; the run's own stage times per round (``run_cell``) are printed beside it.

Families: exact matmul (``_matmul_kernel``, ``_split_sum_kernel``), exact attention (``_attention_kernel``,
``_attention_combine_kernel``), default tree attention (``_tree_attention_*``), cuBLAS GEMMs, everything else.

    python benchmarks/exact_profile.py --out $OUT            # H200
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ddtree.engine import Engine, EngineConfig, TreeSettings
from ddtree.lab.bench.inprocess import run_cell, synchronize
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for

FAMILIES = (  # (family, substrings of a kernel's name), first match wins
    ("exact matmul", ("_matmul_kernel", "_split_sum_kernel")),
    ("exact attention", ("_attention_kernel", "_attention_combine_kernel")),
    ("tree attention", ("_tree_attention",)),
    ("cuBLAS", ("gemm", "nvjet", "cutlass", "xmma", "sm90_")),
)
CELLS = (("dflash", 0), ("ddtree", 8), ("ar", 0))


def family(name: str) -> str:
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other"


def _kernels(engine, prompts, tree, new_tokens: int, activity) -> tuple[dict, dict[str, float]]:
    """One profiled run: (run_cell's result, device us per kernel name)."""
    from torch.profiler import profile

    with profile(activities=[activity]) as prof:
        res = run_cell(engine, prompts, tree, new_tokens, concurrency=len(prompts))
    by_kernel: dict[str, float] = {}
    for evt in prof.events():
        us = getattr(evt, "device_time", None) or getattr(evt, "cuda_time", 0.0)
        if evt.device_type == torch.autograd.DeviceType.CUDA and us:
            by_kernel[evt.name] = by_kernel.get(evt.name, 0.0) + us
    return res, by_kernel


def profile_cell(engine, prompts, tree, new_tokens: int, activity) -> dict:
    """Kernel time of the decode rounds alone: a run of ``new_tokens`` minus a run of one token (its prefill and
    first token), over the batch's rounds (completion tokens / accepted length / prompts)."""
    run_cell(engine, prompts, tree, new_tokens, concurrency=len(prompts))  # warm: graphs and compiles
    _, short = _kernels(engine, prompts, tree, 1, activity)
    res, full = _kernels(engine, prompts, tree, new_tokens, activity)
    rounds = max(1.0, (new_tokens - 1) / res["accept_length"])  # decode rounds of the batch
    by_kernel = {k: full.get(k, 0.0) - short.get(k, 0.0) for k in full}
    by_family: dict[str, float] = {}
    for name, us in by_kernel.items():
        by_family[family(name)] = by_family.get(family(name), 0.0) + us
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]
    return {"rounds": rounds, "round_ms": res["round_ms"], "stage_ms_per_round": res["stage_ms_per_round"],
            "family_ms_per_round": {k: v / 1e3 / rounds for k, v in sorted(by_family.items())},
            "top_kernels_ms_per_round": {k[:90]: v / 1e3 / rounds for k, v in top}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--new-tokens", type=int, default=129)
    ap.add_argument("--prompts", type=int, default=64, help="prompts = slots = concurrency")
    ap.add_argument("--shape", default="qwen3-8b", help="stand-in shape, or 'none' for the demo pair (a CPU dry run)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity

    dev = torch.device(args.device)
    activity = ProfilerActivity.CUDA if dev.type == "cuda" else ProfilerActivity.CPU
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    from ddtree.models import load_tokenizer
    from ddtree.models.standin import load_demo_benchmark_pair

    target, drafter, tok_dir = load_demo_benchmark_pair(args.shape, dev, dtype)
    tokenizer = load_tokenizer(tok_dir)
    synchronize(dev)
    stream = held_out_token_stream(tokenizer, 4096 * 3)
    prompts = prompts_for(stream, 1024, args.prompts, salt=1024)[:args.prompts]
    report: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__, "cells": {}}
    for mode in ("exact", "default"):
        config = EngineConfig(max_batch=args.prompts, max_len=1024 + args.new_tokens + 32, max_budget=16, max_queue=4096,
                              exact=mode == "exact", warmup="none")
        engine = Engine(target, drafter, tokenizer, config, model_name=f"standin-{mode}")
        engine.start()
        for method, budget in CELLS:
            tree = TreeSettings(method=method, budget=budget) if method == "ddtree" else TreeSettings(method=method)
            name = f"{mode} {method}{' ' + str(budget) if budget else ''} C={args.prompts}"
            row = profile_cell(engine, prompts, tree, args.new_tokens, activity)
            report["cells"][name] = row
            fams = " | ".join(f"{k} {v:.2f}" for k, v in row["family_ms_per_round"].items())
            stages = " | ".join(f"{k} {v:.2f}" for k, v in row["stage_ms_per_round"].items())
            print(f"{name}: round {row['round_ms']:.2f} ms, {row['rounds']} rounds; kernels/round: {fams}; "
                  f"stages: {stages}", flush=True)
            for k, v in list(row["top_kernels_ms_per_round"].items())[:6]:
                print(f"    {v:6.3f} ms  {k}", flush=True)
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "exact_profile.json").write_text(json.dumps(report, indent=1))
        engine.shutdown(drain_timeout=0)
        del engine
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
