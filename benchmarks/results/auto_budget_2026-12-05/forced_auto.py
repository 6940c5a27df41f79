"""C=1 demo: auto rounds forced to one size (AutoChooser.choose patched to return it), sizes interleaved prompt by
prompt, beside fixed budgets of the same sizes: stage seconds per round (prefill excluded), accept, and the fallback
curve's price of each size at one row. Usage: python forced_auto.py CONTEXT REPEATS."""
import collections, sys, time
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine import auto_budget as ab
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for
ctx = int(sys.argv[1]); reps = int(sys.argv[2])
force = {"size": None}
orig = ab.AutoChooser.choose
def choose(self, states, cost, **kw):
    out = orig(self, states, cost, **kw)  # keeps the chooser's bookkeeping (and measures the curve once)
    if force["size"] is not None:
        prices.update({b: cost(b) for b in (1, 3, 7, 15, 31, 63)})
        return force["size"], force["size"]
    return out
prices = {}
ab.AutoChooser.choose = choose
eng = Engine.from_config(EngineConfig(device="cpu", max_batch=4, max_len=1024, max_budget=64, warmup="none"))
eng.start()
stream = held_out_token_stream(eng.tokenizer, 40000)
prompts = prompts_for(stream, ctx, 4, salt=0)
def one(p, tree):
    out = eng.generate([GenerationRequest(prompt_token_ids=p, tree=tree, sampling=SamplingParams(max_tokens=128, ignore_eos=True))])[0]
    return sum(v for k, v in out.stats.stage_s.items() if k != "prefill"), out.stats.verify_rounds, len(out.token_ids)
one(prompts[0], TreeSettings(budget="auto"))  # the fallback curve
acc = collections.defaultdict(lambda: [0.0, 0, 0])
for r in range(reps):
    for p in prompts:
        for b in (7, 15, 31, 63):
            for kind in ("auto", "fixed"):
                force["size"] = b if kind == "auto" else None
                s, n, t = one(p, TreeSettings(budget="auto") if kind == "auto" else TreeSettings(budget=b))
                a = acc[(kind, b)]; a[0] += s; a[1] += n; a[2] += t
force["size"] = None
for (kind, b), (s, n, t) in sorted(acc.items()):
    print(f"{kind:5s} b{b:<3d} stages/round {s / n * 1e3:6.1f} ms  tokens/round {t / n:5.2f}  curve {prices.get(b, 0) * 1e3:6.1f} ms")
eng.shutdown(drain_timeout=0)
