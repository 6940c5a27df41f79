"""Budget auto's choices on the demo pair (CPU, fp32) with the curve `cost_curve="auto"` measures at engine start
(the engine grid: budgets 0, 4, 16, 64), two requests of 64-token held-out prompts in flight, 128 new tokens each,
against budget 16 on the same prompts. Prints the curve at budgets 0-63 and, per request, the acceptance and the
rounds per chosen budget. Run from the repository root: python benchmarks/results/auto_budget_2026-12-02/probe_b1.py
"""

import time

from ddtree.engine import Engine, EngineConfig
from ddtree.engine.api import GenerationRequest, SamplingParams, TreeSettings
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for

engine = Engine.from_config(EngineConfig(device="cpu", max_batch=4, max_len=1024, max_budget=64, warmup="none",
                                         cost_curve="auto"))
engine.start()
curve = engine.cost_curve
print("curve", engine.cost_curve_source.info()["source"], "budgets", curve.budgets)
for rows in (1, 2):
    print(f"  {rows} rows, 200 keys, ms:", {b: round(curve.round_seconds(rows, b, 200 + b) * 1e3, 1)
                                          for b in (0, 1, 3, 7, 15, 31, 63)})
prompts = prompts_for(held_out_token_stream(engine.tokenizer, 4096), 64, 2, salt=1)
for budget in ("auto", 16):
    t0 = time.perf_counter()
    outs = engine.generate([GenerationRequest(prompt_token_ids=list(p), tree=TreeSettings(method="ddtree", budget=budget),
                                              sampling=SamplingParams(max_tokens=128, ignore_eos=True)) for p in prompts])
    print(f"budget {budget}: {time.perf_counter() - t0:.2f} s;",
          "; ".join(f"request {i}: accept {o.stats.accept_length:.2f}, rounds per budget {o.stats.auto_budgets}"
                    for i, o in enumerate(outs)))
engine.shutdown(drain_timeout=0)
