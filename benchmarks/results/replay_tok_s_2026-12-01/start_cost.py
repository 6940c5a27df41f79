"""Engine-start cost of cost_curve auto on the CPU demo (the declared default grid), then the cached second start."""
import json, tempfile, time
from pathlib import Path
from ddtree.engine import Engine
from ddtree.engine.config import EngineConfig
from ddtree.engine.cost_measure import attach_curve, engine_grid
for cfg in (EngineConfig(device="cpu", cpu_threads=1, cost_curve="auto", max_batch=4),
            EngineConfig(device="cpu", cpu_threads=1, cost_curve="auto")):
    e = Engine.from_config(cfg)
    d = Path(tempfile.mkdtemp())
    print(engine_grid(e.parts), flush=True)
    t = time.perf_counter(); src = attach_curve(e, cache_dir=d); first = time.perf_counter() - t
    t = time.perf_counter(); src2 = attach_curve(e, cache_dir=d); second = time.perf_counter() - t
    print(json.dumps({"max_batch": cfg.max_batch, "first_s": round(first, 2), "source": src.source,
                      "cached_s": round(second, 4), "cached_source": src2.source}), flush=True)
