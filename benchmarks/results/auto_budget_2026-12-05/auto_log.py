"""Per auto round at C=1: choice, the row's curve at 7/15/31/63, the rising cost there, then what the round committed."""
import sys, json
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine import auto_budget as ab
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for
ctx = int(sys.argv[1])
log = []
orig_choose, orig_read = ab.AutoChooser.choose, ab.AutoChooser.read_row
def choose(self, states, cost, **kw):
    out = orig_choose(self, states, cost, **kw)
    s = [x for x in states if x.tree.auto][0]
    c = self.row_curve(s)
    up = ab.rising(cost, ab.options(self.candidates, 0))
    e = {b: round(c[min(b, len(c)) - 1], 2) if c else None for b in (7, 15, 31, 63)}
    log.append({"pick": out, "E": e, "ms": {b: round(up(b) * 1e3, 1) for b in (7, 15, 31, 63)}, "explore": kw.get("explore")})
    return out
def read(self, state, committed, reported, path, verified):
    log.append({"read": committed, "verified": verified})
    return orig_read(self, state, committed, reported, path, verified)
ab.AutoChooser.choose, ab.AutoChooser.read_row = choose, read
eng = Engine.from_config(EngineConfig(device="cpu", max_batch=4, max_len=1024, max_budget=64, warmup="none"))
eng.start()
stream = held_out_token_stream(eng.tokenizer, 40000)
prompts = prompts_for(stream, ctx, 4, salt=0)
for p in prompts[:2]:
    log.append({"request": True})
    out = eng.generate([GenerationRequest(prompt_token_ids=p, tree=TreeSettings(budget="auto"), sampling=SamplingParams(max_tokens=128, ignore_eos=True))])[0]
for e in log:
    print(json.dumps(e))
eng.shutdown(drain_timeout=0)
