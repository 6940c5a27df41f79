# What budget auto and the fixed budgets would do at one request over 4k keys if the cost curve had no step at
# 16-32 tree rows (the combine's spill: docs/benchmarks.md, "Tree attention's combine tile"), replayed on this CPU
# (2026-12-07). The trace is cpu_c1_4k.py's (the demo pair, fp32, over the matrix's C = 1 / 4k prompts); the
# curve is the H100's (long1_cost_curve.json) as measured, and the same with each point of budget >= 15 at 4096
# keys and 1-4 rows priced at b7's there plus the b7-to-b step at 512 keys (where the launches have no 17-partial
# 64-row combine). A prediction of what removing the step could give, not a measurement.
#   python3 benchmarks/results/matrix_2026-12-07/cpu_c1_4k.py TRACE_DIR 4096 base   # the trace, once
#   python3 benchmarks/results/combine_tile_2026-12-07/cpu_no_step.py TRACE_DIR
import dataclasses
import sys
from pathlib import Path

from ddtree.engine.cost_curve import load_curve
from ddtree.lab.replay import Trace, predict
from ddtree.lab.replay.auto import auto_anchors
from ddtree.lab.replay.throughput import predict_cells

trace = Trace.load(Path(sys.argv[1]) / "trace_c1_4096.safetensors")
measured = load_curve(Path("docs/benchmarks/matrix_2026-12-07/long1_cost_curve.json"))


def without_step(curve):
    """The curve with each point of budget >= 15 at 4096 keys and 1-4 rows priced at b7's plus the b7-to-b step at
    512 keys (reads through CostCurve.point; the write uses its flattened index)."""
    seconds = list(curve.seconds)
    k4, k512, b7 = curve.kv_lens.index(4096), curve.kv_lens.index(512), curve.budgets.index(7)
    for r, rows in enumerate(curve.rows):
        for b, budget in enumerate(curve.budgets):
            if rows <= 4 and budget >= 15:
                step = curve.point(r, b, k512) - curve.point(r, b7, k512)
                seconds[(r * len(curve.budgets) + b) * len(curve.kv_lens) + k4] = curve.point(r, b7, k4) + step
    return dataclasses.replace(curve, seconds=tuple(seconds))


preds = predict(trace, [3, 7, 15, 31])
seqs = {(4096, 1): list(range(trace.num_sequences))}
for name, curve in (("measured curve", measured), ("without the step", without_step(measured))):
    at = [f"b{b} {curve.round_seconds(1, b, 4096) * 1e3:.1f} ms" for b in (7, 15, 31)]
    cells = predict_cells(preds, curve, depth=trace.block_size - 1, contexts=[4096], concurrency=[1],
                          num_requests={1: trace.num_sequences}, max_tokens=256, sequences=seqs,
                          prefill_chunk=2048, auto=auto_anchors(trace, 32))
    fixed = max((p for p in cells if isinstance(p.budget, int) and p.budget > 0), key=lambda p: p.tok_s)
    auto = next(p for p in cells if p.budget == "auto")
    row = " | ".join(f"{p.config} {p.tok_s:.0f}" for p in cells)
    print(f"{name}: {' '.join(at)}\n  {row}\n  auto / best fixed ({fixed.config}) {auto.tok_s / fixed.tok_s:.3f}x; "
          f"auto sizes {dict(sorted(auto.auto_budgets.items()))}", flush=True)
