"""Are the default engine's greedy divergences from AR only numeric? The lossless gate's classifier, in-process.

On the GPU the target's bf16 forward is not batch-invariant, so greedy DDTree outputs can differ from AR's at
near-ties (issue 27). This script runs, greedy over the same held-out prompts (``ignore_eos``, every request
``--new-tokens`` long), in one process:

- AR with the top ``--top`` log-probs of every emitted token: the reference;
- DDTree at each of ``--budgets``, also recording its tokens (and log-probs, like the lab's gate);
- a deliberately broken verify: DDTree at ``--broken-budget`` on a second engine whose tree positions are shifted by
  ``--broken-shift`` for tree node ``--broken-node`` (a wrong RoPE position, a bug serving ports of DDTree have
  shipped), captured into that engine's own CUDA graphs;

and classifies every output that differs from AR's at its first differing token with the gate's own classifier
(:func:`ddtree.lab.humaneval.divergence.classify`, margin ``--margin`` nats, by default the bf16 or fp32 one, and
the drift of both runs' log-probs of the same tokens, since every run records them): numeric near-tie or real
divergence.
Expected: the healthy configs show only near-ties (bf16) or no difference at all (fp32 on the CPU), the broken one
real divergences. Prints a table and every real divergence; writes ``OUT/divergence_gate.json``.

    python benchmarks/divergence_gate.py --out $OUT                                 # H200, Qwen3-8B stand-in
    python benchmarks/divergence_gate.py --out /tmp/g --device cpu --quick          # smoke test: demo pair, fp32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.lab.humaneval.divergence import (
    DEFAULT_NEAR_TIE_MARGIN,
    FP32_NEAR_TIE_MARGIN,
    TOP_LOGPROBS,
    TokenTrace,
    TopEntry,
    check_margin,
    classify,
)


def held_out_prompts(tokenizer: Any, context: int, count: int) -> list[list[int]]:
    """``count`` prompts of exactly ``context`` tokens from different offsets of the held-out stdlib split (never
    trained on), wrapped around when the split is short."""
    from ddtree.train.corpus import load_corpus

    ids: list[int] = []
    for f in load_corpus().held_out:
        ids.extend(tokenizer.encode(f.text, add_special_tokens=False))
        if len(ids) >= 2 * context * count:
            break
    while len(ids) < context * (count + 1):
        ids = ids + ids
    step = max(1, (len(ids) - context) // count)
    return [ids[i * step: i * step + context] for i in range(count)]


def trace_of(output: Any, tokenizer: Any) -> TokenTrace:
    """An engine output's tokens (as ``tokenizer.decode([id])``, the server's spelling), ids and log-probs."""
    names: dict[int, str] = {}

    def name(i: int) -> str:
        if i not in names:
            names[i] = tokenizer.decode([i], skip_special_tokens=False)
        return names[i]

    entries = output.logprobs
    return TokenTrace(
        tokens=tuple(name(i) for i in output.token_ids), token_ids=tuple(output.token_ids),
        logprobs=None if entries is None else tuple(e.logprob for e in entries),
        top=None if entries is None else tuple(tuple(TopEntry(name(i), lp, i) for i, lp in e.top) for e in entries))


def run_config(engine: Engine, prompts: list[list[int]], tree: TreeSettings, new_tokens: int, top: int,
               concurrency: int) -> tuple[list[Any], float]:
    sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=top)
    requests = [GenerationRequest(prompt_token_ids=p, tree=tree, sampling=sampling) for p in prompts]
    t0 = time.perf_counter()
    outputs = engine.generate(requests, max_in_flight=concurrency)
    wall = time.perf_counter() - t0
    failed = [o.error for o in outputs if o.error]
    if failed:
        raise SystemExit(f"{len(failed)} request(s) failed: {failed[:3]}")
    return outputs, wall


def shifted_tree_positions(node: int, shift: int):
    """The broken verify: ``ddtree.speculative.tree_positions`` with node ``node``'s position moved by ``shift``
    (tests/lab/humaneval/test_divergence_gate.py installs the same double through monkeypatch)."""
    from ddtree import speculative

    original = speculative.tree_positions

    def shifted(start: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        positions = original(start, depths)
        if positions.shape[1] > node:
            positions = positions.clone()
            positions[:, node] += shift
        return positions

    return shifted


def shift_tree_position(node: int, shift: int) -> None:
    """Install :func:`shifted_tree_positions` (the engine's runner calls it through the module, so graphs
    captured afterwards carry the bug)."""
    from ddtree import speculative

    speculative.tree_positions = shifted_tree_positions(node, shift)


def prefix_drift(base: TokenTrace, other: TokenTrace) -> float:
    """The largest difference of the two runs' log-probs of the same token over their common token prefix (how
    far the verify's numbers move from AR's: rounding on a healthy engine, more under a bug)."""
    if base.logprobs is None or other.logprobs is None:
        return 0.0
    drift = 0.0
    for a, b, x, y in zip(base.token_ids or (), other.token_ids or (), base.logprobs, other.logprobs, strict=False):
        if a != b:
            break
        if x is not None and y is not None:
            drift = max(drift, abs(x - y))
    return drift


def classify_config(name: str, ref: list[TokenTrace], runs: list[TokenTrace], margin: float) -> dict[str, Any]:
    divergences = []
    for i, (base, other) in enumerate(zip(ref, runs, strict=True)):
        div = classify(base, other, margin=margin, texts_differ=False)
        if div is not None:
            divergences.append({"prompt": i, **div.to_json()})
            if div.kind == "real":
                print(div.warning(f"{name} prompt {i}"), flush=True)
    near = [d for d in divergences if d["kind"] == "near_tie"]
    return {"requests": len(runs), "identical": len(runs) - len(divergences), "near_tie": len(near),
            "max_drift": max((prefix_drift(b, o) for b, o in zip(ref, runs, strict=True)), default=0.0),
            "real": len(divergences) - len(near), "near_tie_gaps": sorted(round(d["gap"], 4) for d in near),
            "divergences": divergences}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "divergence_gate_out"))
    ap.add_argument("--shape", default="qwen3-8b", help="stand-in shape, or 'none' for the demo pair as is")
    ap.add_argument("--device", default="cuda", help="cuda (bf16), or cpu (fp32) for a smoke test")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=256, help="greedy tokens per request")
    ap.add_argument("--budgets", default="31,63")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight (max_in_flight)")
    ap.add_argument("--top", type=int, default=TOP_LOGPROBS, help="AR's top log-probs per token")
    ap.add_argument("--margin", type=float, default=None,
                    help=f"near-tie margin in nats (default: {DEFAULT_NEAR_TIE_MARGIN} for bf16 on cuda, "
                         f"{FP32_NEAR_TIE_MARGIN} for fp32 on cpu)")
    ap.add_argument("--broken-budget", type=int, default=31, help="budget of the broken-verify run (0: none)")
    ap.add_argument("--broken-node", type=int, default=1, help="tree node whose position is shifted")
    ap.add_argument("--broken-shift", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="demo pair, 4 prompts of 64 tokens, 32 new, budgets 4,8")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    default_margin = DEFAULT_NEAR_TIE_MARGIN if dtype == torch.bfloat16 else FP32_NEAR_TIE_MARGIN
    margin = check_margin(default_margin if args.margin is None else args.margin)
    if args.quick:
        args.shape, args.prompts, args.context, args.new_tokens, args.budgets = "none", 4, 64, 32, "4,8"
        args.broken_budget = min(args.broken_budget, 8) if args.broken_budget else 0
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    from ddtree.models import load_tokenizer
    from ddtree.models.standin import load_demo_benchmark_pair

    t0 = time.perf_counter()
    target, drafter, tokenizer_dir = load_demo_benchmark_pair(args.shape, device, dtype)
    tokenizer = load_tokenizer(tokenizer_dir)
    max_budget = max([*budgets, args.broken_budget, 32])  # 32: room for the engine's default tree (budget 16)
    config = EngineConfig(max_batch=max(args.concurrency, 1), max_len=args.context + args.new_tokens + 64,
                          max_budget=max_budget, max_queue=max(64, args.prompts))
    prompts = held_out_prompts(tokenizer, args.context, args.prompts)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."), "shape": args.shape, "prompts": len(prompts),
        "context": args.context, "new_tokens": args.new_tokens, "concurrency": args.concurrency, "top": args.top,
        "margin": margin, "broken": {"budget": args.broken_budget, "node": args.broken_node,
                                     "shift": args.broken_shift}, "configs": {}}
    rows: list[tuple[str, dict[str, Any], float]] = []
    with Engine.from_models(target, drafter, tokenizer, config, model_name=f"standin-{args.shape}") as engine:
        report["load_s"] = round(time.perf_counter() - t0, 1)
        ar_out, ar_wall = run_config(engine, prompts, TreeSettings(method="ar"), args.new_tokens, args.top,
                                     args.concurrency)
        ref = [trace_of(o, tokenizer) for o in ar_out]
        rows.append(("ar", {"requests": len(ref), "identical": len(ref), "near_tie": 0, "real": 0, "max_drift": 0.0,
                            "near_tie_gaps": [], "divergences": []}, ar_wall))
        for budget in budgets:
            outs, wall = run_config(engine, prompts, TreeSettings(method="ddtree", budget=budget), args.new_tokens,
                                    args.top, args.concurrency)
            name = f"ddtree-b{budget}"
            rows.append((name, classify_config(name, ref, [trace_of(o, tokenizer) for o in outs], margin), wall))
    if args.broken_budget:
        shift_tree_position(args.broken_node, args.broken_shift)  # a fresh engine: its graphs carry the bug
        with Engine.from_models(target, drafter, tokenizer, config, model_name="broken") as broken:
            outs, wall = run_config(broken, prompts, TreeSettings(method="ddtree", budget=args.broken_budget),
                                    args.new_tokens, args.top, args.concurrency)
        name = f"broken-ddtree-b{args.broken_budget}"
        rows.append((name, classify_config(name, ref, [trace_of(o, tokenizer) for o in outs], margin), wall))
    lines = [f"{report['device']}, {report['dtype']}, shape {args.shape}: {len(prompts)} prompts of {args.context} "
             f"tokens, {args.new_tokens} greedy tokens each, C={args.concurrency}; AR top-{args.top} log-probs, "
             f"near-tie margin {margin} nats; broken: node {args.broken_node} position +{args.broken_shift}", "",
             "| config | requests | identical | near-tie | real | near-tie gaps (nats) | max drift (nats) | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, res, wall in rows:
        res["wall_s"] = round(wall, 2)
        report["configs"][name] = res
        gaps = ", ".join(f"{g:.3g}" for g in res["near_tie_gaps"][:8]) or "-"
        lines.append(f"| {name} | {res['requests']} | {res['identical']} | {res['near_tie']} | {res['real']} | "
                     f"{gaps} | {res['max_drift']:.3g} | {wall:.1f} |")
    healthy = [res for name, res, _ in rows if name.startswith("ddtree")]
    broken_rows = [res for name, res, _ in rows if name.startswith("broken")]
    report["healthy_only_near_ties"] = all(r["real"] == 0 for r in healthy)
    report["broken_reports_real"] = bool(broken_rows) and all(r["real"] > 0 for r in broken_rows)
    lines += ["", f"healthy configs: {'only near-ties' if report['healthy_only_near_ties'] else 'REAL divergences'}; "
              f"broken verify: {'real divergences reported' if report['broken_reports_real'] else 'NO real divergence'}"]
    (out_dir / "divergence_gate.json").write_text(json.dumps(report, indent=1))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
