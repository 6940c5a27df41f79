# Budget auto at one request over 4k keys under the H100's prices, replayed on this CPU (2026-12-07): the matrix's
# C = 1 / 4k cell ran auto at 0.961x b31 on the H100 (b7 in 57 % of its row-rounds). The stand-in computes the demo
# pair's function, so a trace of the demo pair (fp32, CPU) over the cell's own prompts (matrix.cell_prompts, the
# stream of the part that ran it) replays that cell; auto is replayed by the engine's chooser with the curve the
# H100 engine measured (docs/benchmarks/matrix_2026-12-07/long1_cost_curve.json).
#   python3 cpu_c1_4k.py TRACE_DIR [CONTEXT] [variant "name,CONST=value,..." ...]
import importlib
import sys
import time
from pathlib import Path

import torch

from ddtree.engine import auto_budget as ab
from ddtree.engine.cost_curve import load_curve
from ddtree.lab.bench.matrix import MatrixPlan, cell_prompts
from ddtree.lab.bench.workload import held_out_token_stream
from ddtree.lab.replay import Trace, predict
from ddtree.lab.replay.auto import auto_anchors
from ddtree.lab.replay.throughput import predict_cells
from ddtree.lab.replay.trace import record_trace
from ddtree.models import load_tokenizer
from ddtree.models.standin import load_demo_benchmark_pair

out = Path(sys.argv[1])
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
variants = sys.argv[3:] or ["base"]
out.mkdir(parents=True, exist_ok=True)
path = out / f"trace_c1_{ctx}.safetensors"
plan = MatrixPlan(contexts=(4096, 8192), concurrency=(1, 8), budgets=(3, 15, 31), waves=4, auto=True)
if not path.exists():
    torch.set_num_threads(2)
    target, drafter, pair_dir = load_demo_benchmark_pair("none", torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(pair_dir)
    stream = held_out_token_stream(tokenizer, max(plan.contexts) * 2 + 4096)  # the long1 part's stream
    prompts = cell_prompts(stream, plan, ctx, 1)
    t0 = time.perf_counter()
    record_trace((target, drafter, tokenizer), prompts, 256, top_m=32, out=path)
    print(f"trace of {len(prompts)} prompts in {time.perf_counter() - t0:.0f} s", flush=True)
trace = Trace.load(path)
curve = load_curve(Path("docs/benchmarks/matrix_2026-12-07/long1_cost_curve.json"))
preds = predict(trace, [3, 7, 15, 31])
seqs = {(ctx, 1): list(range(trace.num_sequences))}
for v in variants:
    importlib.reload(ab)
    for kv in v.split(",")[1:]:
        k, val = kv.split("=")
        setattr(ab, k, type(getattr(ab, k))(eval(val)))
    cells = predict_cells(preds, curve, depth=trace.block_size - 1, contexts=[ctx], concurrency=[1],
                          num_requests={1: trace.num_sequences}, max_tokens=256, sequences=seqs,
                          prefill_chunk=2048, auto=auto_anchors(trace, 32))
    row = " | ".join(f"{p.config} {p.tok_s:.0f} ({p.accept_length:.2f})" for p in cells)
    auto = next(p for p in cells if p.budget == "auto")
    print(f"{v.split(',')[0]:10s} {row} | auto sizes {dict(sorted(auto.auto_budgets.items()))}", flush=True)
