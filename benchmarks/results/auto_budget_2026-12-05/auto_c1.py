"""C=1 demo: b16 vs auto, 4 prompts one after another, alternating repeats: wall, accept, rounds, chosen sizes."""
import collections, sys, time
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine import auto_budget as ab
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for
ctx = int(sys.argv[1]); reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
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
    t0 = time.perf_counter(); toks = 0; acc = []; stages = collections.Counter(); rounds = 0
    for p in prompts:
        out = eng.generate([GenerationRequest(prompt_token_ids=p, tree=tree, sampling=SamplingParams(max_tokens=128, ignore_eos=True))])[0]
        toks += len(out.token_ids); acc.append(out.stats.accept_length); rounds += out.stats.verify_rounds
        for k, v in out.stats.stage_s.items(): stages[k] += v
    wall = time.perf_counter() - t0
    return toks / wall, sum(acc) / len(acc), rounds, {k: round(v / rounds * 1e3, 1) for k, v in stages.items()}, wall / rounds * 1e3
run(TreeSettings(budget=16))
for r in range(reps):
    for name, tree in [("b16", TreeSettings(budget=16)), ("auto", TreeSettings(budget="auto"))]:
        chosen.clear()
        tps, acc, rounds, st, ms = run(tree)
        print(f"{name:5s} {tps:6.1f} tok/s accept {acc:.2f} rounds {rounds} wall/round {ms:.1f} ms stages/round {st}",
              dict(collections.Counter(c[0] for c in chosen)) if chosen else "", flush=True)
eng.shutdown(drain_timeout=0)
