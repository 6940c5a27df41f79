import json, torch
from ddtree.engine import Engine, EngineConfig
from ddtree.engine.cost_measure import engine_grid, measure_cost_curve
from ddtree.models.standin import load_benchmark_models
t, d, tok, _ = load_benchmark_models("none", torch.device("cpu"))
eng = Engine(t, d, tok, EngineConfig(max_batch=4, max_len=1024, max_budget=32, warmup="none", cost_curve="off"), model_name="demo")
grid = engine_grid(eng.parts)
c = measure_cost_curve(eng.runner, grid, device_name="cpu", model="demo (float32)")
print("grid", c.rows, c.budgets, c.kv_lens, "context", grid.context, "measure s", round(c.measure_seconds, 1))
for r in c.rows:
    for k in c.kv_lens:
        print(f"rows {r} kv {k}: AR {1e3*c.round_seconds(r, 0, k):.2f} ms, no tree {1e3*c.round_seconds(r, 0, k, keeps_context=True):.2f} ms, b1 {1e3*c.round_seconds(r, 1, k):.2f} ms")
json.dump(c.to_json(), open("/tmp/ctx_curve.json", "w"), indent=1)
