"""Why does budget auto pick small trees at 4 rows on the CPU demo? Log the choice's inputs."""
import collections, json, sys
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine import auto_budget as ab
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for

log = []
orig = ab.choose_budget
def spy(rows, opts, cost, **kw):
    b = orig(rows, opts, cost, **kw)
    log.append({"n": len(rows), "opts": list(opts), "cost": [round(cost(o) * 1e3, 1) for o in opts],
                "obj": [round(ab.objective(rows, o, cost), 1) for o in opts],
                "E": [round(x, 2) for x in (rows[0].curve[:63] if rows[0].curve else ())][::4], "chosen": b})
    return b
ab.choose_budget = spy
import ddtree.engine.scheduler as sch
sch.auto_budget.choose_budget = spy
eng = Engine.from_config(EngineConfig(device="cpu", max_batch=4, max_len=1024, max_budget=64, warmup="none"))
eng.start()
tok = eng.tokenizer
stream = held_out_token_stream(tok, 40000)
c = int(sys.argv[1]); ctx = int(sys.argv[2])
prompts = prompts_for(stream, ctx, c, salt=0)
reqs = [GenerationRequest(prompt_token_ids=p, tree=TreeSettings(budget="auto"), sampling=SamplingParams(max_tokens=128, ignore_eos=True)) for p in prompts]
outs = eng.generate(reqs)
eng.shutdown(drain_timeout=0)
cnt = collections.Counter(e["chosen"] for e in log)
print("chosen", dict(cnt), "accept", [round(o.stats.accept_length, 2) for o in outs])
for e in log[5::max(1, len(log)//6)]:
    print(json.dumps(e))
