"""Budget auto's choices traced on the demo pair on the CPU with overlapped rounds (as CUDA runs them), one run of
C prompts of 60 tokens, 64 new tokens, four waves after two warm-up waves, the curve engine start measures on the CPU
grid: per choice the rows, the rows with a curve, their curve lengths, the chosen and best size, each candidate's mean
E over the rows and its price T (ms). Usage: PYTHONPATH=src python trace_auto_cpu.py C OUT.json"""
import json
import sys

import torch

from ddtree.engine import Engine, EngineConfig, TreeSettings, auto_budget
from ddtree.lab.bench.inprocess import run_cell
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for
from ddtree.models.standin import load_benchmark_models

conc = int(sys.argv[1]) if len(sys.argv) > 1 else 16
target, drafter, tok, dtype = load_benchmark_models("none", torch.device("cpu"))
cfg = EngineConfig(device="cpu", max_batch=conc, max_len=60 + 64 + 16, max_budget=32, warmup="none",
                   cost_curve="auto", overlap_rounds=True)
eng = Engine(target, drafter, tok, cfg, model_name="standin-none")
eng.start()
log = []
real = auto_budget.AutoChooser.choose
def choose(self, states, cost, *, explore=True):
    size, best = real(self, states, cost, explore=explore)
    auto = [s for s in states if s.tree.auto]
    curves = [self.row_curve(s) for s in auto]
    prior = auto_budget.mean_curve([c for c in curves if c])
    rows = [auto_budget.RowCurve(c or prior) for c in curves]
    vals = {b: round(sum(r.expected(b) for r in rows) / len(rows), 3) for b in self.candidates} if prior else {}
    costs = {b: round(cost(b) * 1e3, 2) for b in self.candidates}
    log.append({"E": vals, "T": costs, "gains": round(self.gain[0] / max(self.gain[1], 1e-9), 3),
                "mean_seen_len": sum(len(s.auto_seen) for s in auto) / len(auto), "rows": len(states), "with_curve": sum(bool(s.auto_curve) for s in auto),
                "curve_lens": sorted({len(s.auto_curve) for s in auto}), "size": size, "best": best,
                "explore": explore, "prev": self.previous})
    return size, best
auto_budget.AutoChooser.choose = choose
stream = held_out_token_stream(tok, 60 * 2 + 4096)
prompts = prompts_for(stream, 60, conc * 4, salt=60)
tree = TreeSettings(method="ddtree", budget="auto")
run_cell(eng, prompts[: conc * 2], tree, 64, concurrency=conc)
log.clear()
res = run_cell(eng, prompts, tree, 64, concurrency=conc)
print(res["auto_budgets"])
json.dump(log, open(sys.argv[2], "w"))
small = [e for e in log if e["size"] < 7]
print(len(log), "choices;", len(small), "below 7")
for i, e in enumerate(log[:60]):
    print(i, e["size"], e["best"], e["rows"], e["with_curve"], e["curve_lens"], e["E"], e["T"], e["gains"])
eng.shutdown(drain_timeout=0)
