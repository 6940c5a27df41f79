# Replays budget auto over a demo sweep's trace (cpu_pipeline.sh DIR) with the chooser as the working tree has it:
# auto / the best fixed budget (every budget 1-64 replayed) per cell, for both curves. Variants set auto_budget's
# constants: python3 eval_auto.py DIR base "nozero,ZERO=False"
import sys
from pathlib import Path
from ddtree.engine import auto_budget as ab
from ddtree.engine.cost_curve import load_curve
from ddtree.lab.replay import Trace, predict
from ddtree.lab.replay.auto import auto_anchors
from ddtree.lab.replay.throughput import predict_cells, SweepCells, cell_sequences
from ddtree.lab.bench.workload import load_tokenizer
D = sys.argv.pop(1)
trace = Trace.load(f'{D}/trace.safetensors')
cells = SweepCells.from_run(Path(f'{D}/results/demo-auto'))
seqs = cell_sequences([trace.sequence(s)[0] for s in range(trace.num_sequences)], cells.prompts(load_tokenizer(cells.tokenizer)[0]))
anchors = auto_anchors(trace, 64)
preds = predict(trace, [1,3,4,7,15,16,31,63,64])
def run(curve_name, label):
    curve = load_curve(f'{D}/{curve_name}.json')
    out = predict_cells(preds, curve, depth=trace.depth, contexts=cells.contexts, concurrency=cells.concurrency,
                        num_requests=cells.num_requests, max_tokens=128, sequences=seqs, auto=anchors)
    res = []
    for ctx in cells.contexts:
        for c in cells.concurrency:
            cs = [p for p in out if p.context == ctx and p.concurrency == c]
            fixed = max((p for p in cs if p.method == 'ddtree' and p.budget != 'auto'), key=lambda p: p.tok_s)
            a = next(p for p in cs if p.budget == 'auto')
            z = a.auto_budgets.get(0, 0) / sum(a.auto_budgets.values())
            res.append(f"{ctx}/{c}: {a.tok_s/fixed.tok_s:.3f}x {fixed.config.split('-')[1]} acc {a.accept_length:.2f} z{z:.0%}")
    print(f"{label:12s} {curve_name:13s}", " | ".join(res))
variants = sys.argv[1:] or ['base']
import importlib
for v in variants:
    importlib.reload(ab)
    for kv in v.split(',')[1:]:
        k, val = kv.split('=')
        setattr(ab, k, type(getattr(ab, k))(eval(val)))
    for c in ('engine_curve', 'curve_after'):
        run(c, v.split(',')[0])
