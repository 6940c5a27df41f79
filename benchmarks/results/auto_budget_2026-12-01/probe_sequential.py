"""Budget auto over four requests in a row at C = 1 (as a sweep cell runs them): the choice's inputs per round."""
import collections, json, sys
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine import auto_budget as ab
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for
log = []
orig = ab.choose_budget
def spy(rows, opts, cost, **kw):
    b = orig(rows, opts, cost, **kw)
    log.append({"opts": list(opts), "cost": [round(cost(o) * 1e3, 1) for o in opts],
                "obj": [round(ab.objective(rows, o, cost), 1) for o in opts],
                "E": [round(rows[0].expected(o), 2) for o in opts], "prev": kw.get("previous"), "chosen": b})
    return b
ab.choose_budget = spy
eng = Engine.from_config(EngineConfig(device="cpu", max_batch=4, max_len=1024, max_budget=64, warmup="none"))
eng.start()
stream = held_out_token_stream(eng.tokenizer, 40000)
ctx = int(sys.argv[1])
prompts = prompts_for(stream, ctx, 4, salt=0)
for i, p in enumerate(prompts):
    start = len(log)
    out = eng.generate([GenerationRequest(prompt_token_ids=p, tree=TreeSettings(budget="auto"), sampling=SamplingParams(max_tokens=128, ignore_eos=True))])[0]
    part = log[start:]
    print(i, "chosen", dict(collections.Counter(e["chosen"] for e in part)), "accept", round(out.stats.accept_length, 2))
    for e in part[::6]:
        print("   ", json.dumps(e))
eng.shutdown(drain_timeout=0)
