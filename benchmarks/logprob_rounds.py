"""Log-probs and ``min_tokens`` under speculation on the GPU: are they the target's, and what do they cost?

Issue 25 asks that a speculative engine return the *target's* log-probs (taken from the verify forward's logits at
the accepted nodes) and honour ``min_tokens`` inside its rounds (the banned ids are masked on the device). The CPU
tests check both in fp32 against AR exactly; this script checks them on the H200 stand-in in bf16, where the
verify forward computes a position's logits with another row count than AR's decode step, so log-probs agree to
rounding only, and measures the price of the log-prob rounds (their ``[R, L + 1, V]`` fp32 log-softmax) and of the
``min_tokens`` masks. Per cell, greedy, 1k-token prompts from the held-out split:

- ``ar`` and ``ddtree`` (``--budget``) with ``logprobs=5``: tokens identical to AR's (fraction of requests), and at
  the positions before a request's first differing token, the largest absolute difference of the chosen token's
  log-prob and whether the top-5 ids agree;
- tok/s of ddtree at ``--concurrency`` with no log-probs, with ``logprobs=5`` and with ``min_tokens`` (EOS live,
  ``min_tokens = max_tokens // 2``: every output must have at least that many tokens).

    python benchmarks/logprob_rounds.py --out $OUT                    # H200: the Qwen3-8B stand-in, bf16
    python benchmarks/logprob_rounds.py --out /tmp/lp --shape none --context 64 --requests 2 --new-tokens 16

Writes ``OUT/logprob_rounds.json``; prints a short table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for


def build_engine(shape: str, device: torch.device, max_batch: int, max_len: int, budget: int) -> Engine:
    """The stand-in (or, with ``shape='none'``, the demo pair itself) in an engine with graphs and kernels."""
    from ddtree.assets import demo_drafter_path, demo_target_path
    from ddtree.models import load_drafter, load_target, load_tokenizer
    from ddtree.models.standin import load_standin

    tokenizer = load_tokenizer(demo_target_path())
    if shape == "none":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        target = load_target(demo_target_path(), dtype=dtype, device=device)
        drafter = load_drafter(demo_drafter_path(), dtype=dtype, device=device)
    else:
        target, drafter, _ = load_standin(shape, device=device)
    config = EngineConfig(max_batch=max_batch, max_len=max_len, max_budget=max(budget, 32), max_queue=4096,
                          device=str(device), cuda_graphs=device.type == "cuda")
    return Engine.from_models(target, drafter, tokenizer, config, model_name=f"standin-{shape}")


def run(engine: Engine, prompts: list[list[int]], tree: TreeSettings, sampling: SamplingParams,
        concurrency: int) -> tuple[list, float]:
    reqs = [GenerationRequest(prompt_token_ids=p, tree=tree, sampling=sampling) for p in prompts]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(reqs, max_in_flight=concurrency)
    wall = time.perf_counter() - t0
    bad = [o.error for o in outs if o.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"requests failed: {bad[:3]}")
    return outs, sum(len(o.token_ids) for o in outs) / wall


def compare_logprobs(ref: list, got: list) -> dict:
    """Per request: identical tokens?; over the positions before the first differing token: the largest
    |logprob(ref) - logprob(got)| of the chosen token and the share of positions whose top-5 ids agree."""
    identical, max_diff, top_same, top_n = 0, 0.0, 0, 0
    for a, b in zip(ref, got, strict=True):
        identical += a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=False):  # up to the first difference
            if la.token_id != lb.token_id:
                break
            max_diff = max(max_diff, abs(la.logprob - lb.logprob))
            top_same += [t for t, _ in la.top] == [t for t, _ in lb.top]
            top_n += 1
    return {"identical": identical, "requests": len(ref), "max_abs_logprob_diff": max_diff,
            "top5_same_share": top_same / max(top_n, 1), "positions_compared": top_n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="qwen3-8b", help="stand-in shape, or 'none' for the demo pair as is")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engine = build_engine(args.shape, device, args.concurrency, args.context + args.new_tokens + 16, args.budget)
    engine.start()
    prompts = prompts_for(held_out_token_stream(engine.tokenizer, 2 * args.context + 4096), args.context,
                          args.requests, salt=3)
    ar, dd = TreeSettings(method="ar"), TreeSettings(method="ddtree", budget=args.budget)
    n = args.new_tokens
    with_lp = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=5)
    plain = SamplingParams(max_tokens=n, ignore_eos=True)
    min_tok = SamplingParams(max_tokens=n, min_tokens=n // 2)
    c = args.concurrency
    for sampling in (plain, with_lp, min_tok):  # warm-up at the measured concurrency: every variant's graphs
        run(engine, prompts[:c], dd, sampling, c)
    run(engine, prompts[:1], ar, with_lp, 1)
    run(engine, prompts[:1], dd, with_lp, 1)
    ref, _ = run(engine, prompts, ar, with_lp, 1)  # compared, not timed
    got, _ = run(engine, prompts, dd, with_lp, 1)
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "shape": args.shape, "context": args.context,
                    "requests": args.requests, "budget": args.budget, "new_tokens": n,
                    "c1_ddtree_vs_ar": compare_logprobs(ref, got)}
    speeds: dict[str, dict] = {}
    variants = (("plain", plain), ("logprobs5", with_lp), ("min_tokens", min_tok))
    for rep in range(2):  # the variants alternate (forward, then backward) so an order effect shows as spread
        for name, sampling in variants if rep == 0 else variants[::-1]:
            outs, tok_s = run(engine, prompts, dd, sampling, args.concurrency)
            rounds = sum(o.stats.verify_rounds for o in outs)
            cell = speeds.setdefault(name, {"runs_tok_s": []})
            cell["runs_tok_s"].append(tok_s)
            cell["tok_s"] = sum(cell["runs_tok_s"]) / len(cell["runs_tok_s"])
            cell["accept_length"] = sum(o.stats.completion_tokens for o in outs) / max(1, rounds)
            cell["min_len"] = min(len(o.token_ids) for o in outs)
    report["concurrency"] = args.concurrency
    report["ddtree_speeds"] = speeds
    report["min_tokens_held"] = speeds["min_tokens"]["min_len"] >= n // 2
    engine.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logprob_rounds.json").write_text(json.dumps(report, indent=2))
    c = report["c1_ddtree_vs_ar"]
    print(f"C=1 ddtree b{args.budget} vs ar, logprobs=5: identical {c['identical']}/{c['requests']}, "
          f"max |dlogprob| {c['max_abs_logprob_diff']:.4f}, top-5 same {100 * c['top5_same_share']:.1f}% "
          f"of {c['positions_compared']} positions")
    print(f"C={args.concurrency} ddtree b{args.budget}: " + ", ".join(
        f"{k} {v['tok_s']:.1f} tok/s (runs {', '.join(f'{x:.0f}' for x in v['runs_tok_s'])}, accept {v['accept_length']:.2f}, min len {v['min_len']})"
        for k, v in speeds.items()))


if __name__ == "__main__":
    main()
