"""Does the fp8 drafter (``EngineConfig.draft_fp8``) cost acceptance? Acceptance per round of the DFlash chain and
DDTree with the drafter in the model dtype and in fp8, on a stand-in built from the demo pair, over held-out prompts.

Why on the CPU in fp32: acceptance is a property of the drafter's numerics, and an fp32 target has no bf16 near-ties
(docs/benchmarks.md), so the two runs differ only by the drafter; on the GPU, three prompts of a bf16 run move
acceptance by up to 20% between runs that change nothing but summation order. The ``small`` stand-in has the
padded structure of the Qwen3-8B one (zero-padded hidden dims, random unreachable heads and channels) at a size a
CPU runs.

    python benchmarks/fp8_acceptance.py --out docs/benchmarks/fp8_acceptance_cpu.json    # ~12 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ddtree.assets import demo_drafter_path, demo_target_path
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for  # gpu.py's prompts
from ddtree.models import load_drafter, load_target, load_tokenizer
from ddtree.models.standin import build_standin, standin_shape

METHODS = (("dflash", 1), ("ddtree", 8), ("ddtree", 16), ("ddtree", 64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tok = load_tokenizer(demo_target_path())
    prompts = prompts_for(held_out_token_stream(tok, 12000), args.context, args.prompts, salt=11)
    results: dict[str, float] = {}
    for fp8 in (False, True):
        target = load_target(demo_target_path(), dtype=torch.float32, device="cpu")
        drafter = load_drafter(demo_drafter_path(), dtype=torch.float32, device="cpu")
        target, drafter = build_standin(target, drafter, standin_shape(args.shape))
        config = EngineConfig(max_batch=2, max_len=args.context + args.tokens + 48, max_budget=64, draft_fp8=fp8)
        engine = Engine.from_models(target, drafter, tok, config, model_name=args.shape)
        engine.start()
        for method, budget in METHODS:
            t0 = time.time()
            reqs = [GenerationRequest(prompt_token_ids=p, tree=TreeSettings(method=method, budget=budget),
                                      sampling=SamplingParams(max_tokens=args.tokens, ignore_eos=True))
                    for p in prompts]
            outs = engine.generate(reqs, max_in_flight=2)
            rounds = sum(o.stats.verify_rounds for o in outs)
            tokens = sum(len(o.token_ids) - 1 for o in outs)  # the first token comes from the prefill
            name = f"{'fp8' if fp8 else 'fp32'} {method}{'' if method == 'dflash' else f'-b{budget}'}"
            results[name] = round(tokens / rounds, 3)
            print(f"{name}: acceptance {results[name]} ({time.time() - t0:.0f} s)", flush=True)
        engine.shutdown(drain_timeout=0)
    report = {"shape": args.shape, "context": args.context, "prompts": args.prompts, "tokens": args.tokens,
              "acceptance_per_round": results}
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
