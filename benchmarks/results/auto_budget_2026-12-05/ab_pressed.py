"""C=1 demo, one engine: b16, auto, auto without the pressed exploration, alternating, prompts one after another.

Ran (2026-12-05, ab512.log, ab64.log) against a change that was then reverted, not on main: ``auto_budget.pressed``
(a read round whose accepted path took a node of rank above verified // 2 marks its row pressed) and, in
``AutoChooser.choose``, exploration of the next candidate once its evidence fell below
``EXPLORE_PRESSED_EVIDENCE = 0.6`` (about 5 rounds) while most auto rows were pressed, else below
``EXPLORE_EVIDENCE`` as on main. Usage: python ab_pressed.py CONTEXT REPEATS."""
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
prompts = prompts_for(stream, ctx, 4, salt=0)
def run(tree):
    t0 = time.perf_counter(); toks = 0; acc = []; rounds = 0
    for p in prompts:
        out = eng.generate([GenerationRequest(prompt_token_ids=p, tree=tree, sampling=SamplingParams(max_tokens=128, ignore_eos=True))])[0]
        toks += len(out.token_ids); acc.append(out.stats.accept_length); rounds += out.stats.verify_rounds
    return toks / (time.perf_counter() - t0), sum(acc) / len(acc), rounds
run(TreeSettings(budget="auto"))  # measures the curve
on = ab.EXPLORE_PRESSED_EVIDENCE
tot = collections.defaultdict(list)
for r in range(reps):
    for name, tree, pe in [("b16", TreeSettings(budget=16), on), ("auto", TreeSettings(budget="auto"), on),
                           ("auto-nopress", TreeSettings(budget="auto"), ab.EXPLORE_EVIDENCE)]:
        ab.EXPLORE_PRESSED_EVIDENCE = pe
        chosen.clear()
        tps, acc, rounds = run(tree)
        tot[name].append(tps)
        print(f"{name:13s} {tps:6.1f} tok/s accept {acc:.2f} rounds {rounds}", dict(sorted(collections.Counter(c[0] for c in chosen).items())) if chosen else "", flush=True)
for k, v in tot.items():
    print(k, round(sum(v) / len(v), 1), [round(x / y, 3) for x, y in zip(v, tot["b16"])])
eng.shutdown(drain_timeout=0)
