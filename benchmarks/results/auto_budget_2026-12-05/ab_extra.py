"""C=1 demo, one engine: b16, auto, auto without the extrapolation past a row's verified size, alternating, prompts
one after another. Usage: python ab_extra.py CONTEXT REPEATS [PROMPTS].

Ran (2026-12-05, ab_extra_512.log) against a change that was then reverted, not on main: ``auto_budget.extrapolated``
(past the size a row's last read round verified, its curve at least that round's last doubling's gain E(v) -
E((v - 1) // 2), times ``EXTRAPOLATION = 0.5`` per further doubling, linear inside a doubling); the script sets
``EXTRAPOLATION`` to 0 for the "noextra" variant."""
import collections, sys, time
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine import auto_budget as ab
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for
ctx = int(sys.argv[1]); reps = int(sys.argv[2])
chosen = []
orig = ab.AutoChooser.choose
def spy(self, states, cost, **kw):
    out = orig(self, states, cost, **kw); chosen.append(out); return out
ab.AutoChooser.choose = spy
eng = Engine.from_config(EngineConfig(device="cpu", max_batch=4, max_len=1024, max_budget=64, warmup="none"))
eng.start()
stream = held_out_token_stream(eng.tokenizer, 40000)
prompts = prompts_for(stream, ctx, int(sys.argv[3]) if len(sys.argv) > 3 else 4, salt=0)
def run(tree):
    t0 = time.perf_counter(); toks = 0; acc = []; rounds = 0
    for p in prompts:
        out = eng.generate([GenerationRequest(prompt_token_ids=p, tree=tree, sampling=SamplingParams(max_tokens=128, ignore_eos=True))])[0]
        toks += len(out.token_ids); acc.append(out.stats.accept_length); rounds += out.stats.verify_rounds
    return toks / (time.perf_counter() - t0), sum(acc) / len(acc), rounds
run(TreeSettings(budget="auto"))  # measures the curve
on = ab.EXTRAPOLATION
tot = collections.defaultdict(list)
for r in range(reps):
    for name, tree, pe in [("b16", TreeSettings(budget=16), on), ("auto", TreeSettings(budget="auto"), on),
                           ("auto-noextra", TreeSettings(budget="auto"), 0.0)]:
        ab.EXTRAPOLATION = pe
        chosen.clear()
        tps, acc, rounds = run(tree)
        tot[name].append(tps)
        print(f"{name:13s} {tps:6.1f} tok/s accept {acc:.2f} rounds {rounds}", dict(sorted(collections.Counter(c[0] for c in chosen).items())) if chosen else "", flush=True)
for k, v in tot.items():
    print(k, round(sum(v) / len(v), 1), [round(x / y, 3) for x, y in zip(v, tot["b16"])])
eng.shutdown(drain_timeout=0)
