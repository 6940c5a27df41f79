"""A synthetic cost-curve round against real requests on the same engine, back to back (docs/benchmarks.md, Replay predicts tok/s)."""
import dataclasses, time
from ddtree.engine import Engine
from ddtree.engine.config import EngineConfig
from ddtree.engine.api import GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine.cost_measure import CostGrid, measure_cost_curve
from ddtree.lab.bench.workload import build_prompts
e = Engine.from_config(EngineConfig(device="cpu", cpu_threads=1, max_batch=4, max_len=4096, max_budget=64))
e.start()
p = build_prompts(e.tokenizer, 64, 2, phase="x", seed=0, context=64, concurrency=1, text="code")
def real():
    outs = e.generate([GenerationRequest(prompt_token_ids=list(q.ids), tree=TreeSettings(method="ddtree", budget=4), sampling=SamplingParams(max_tokens=128, ignore_eos=True)) for q in p], max_in_flight=1)
    o = outs[0]; n = o.stats.verify_rounds
    return {k: round(v / n * 1e3, 1) for k, v in o.stats.stage_s.items()}
print("real", real())
c = measure_cost_curve(e.runner, CostGrid((1,), (4,), (64, 128), 16, repeats=5), device_name="cpu", model="x")
print("synthetic after real (engine thread idle)", [round(x*1e3,1) for x in c.seconds])
print("real", real())
e.shutdown(drain_timeout=0)
