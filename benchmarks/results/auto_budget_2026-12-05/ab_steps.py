"""Budget auto with and without the engine's step lift against b16, interleaved: each repeat runs the four prompts
with every config, the order rotated every repeat. Usage: python ab_steps.py CONTEXT CONCURRENCY REPEATS.

Ran (2026-12-05, ab_steps.log; interleaved.py over the same change: interleaved_steps.log) against a change that
was then reverted, not on main: ``AutoChooser`` kept engine-wide decayed (sum, count) per candidate c of what the
tree of c nodes committed beyond the tree of the candidate below it, over every row's rounds that verified c
(``step_update``, the observed lengths' counterfactual), and ``row_curve`` raised a row's curve past the size its
last round verified to at least E(verified) plus those mean steps, linearly between candidates (``lifted``; a step
needed a decayed count of ``STEP_MIN_COUNT = 1`` to count, and this script set it to inf to turn the lift off)."""
import math, statistics, sys, time
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine import auto_budget as ab
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for
ctx, conc, reps = (int(a) for a in sys.argv[1:4])
eng = Engine.from_config(EngineConfig(device="cpu", max_batch=4, max_len=1024, max_budget=64, warmup="none"))
eng.start()
stream = held_out_token_stream(eng.tokenizer, 40000)
prompts = prompts_for(stream, ctx, 4, salt=0)
on = ab.STEP_MIN_COUNT
def req(p, tree):
    return GenerationRequest(prompt_token_ids=p, tree=tree, sampling=SamplingParams(max_tokens=128, ignore_eos=True))
def run(name):
    tree = TreeSettings(budget=16) if name == "b16" else TreeSettings(budget="auto")
    ab.STEP_MIN_COUNT = math.inf if name == "auto-nolift" else on
    t0 = time.perf_counter(); toks = 0
    if conc == 1:
        for p in prompts:
            toks += len(eng.generate([req(p, tree)])[0].token_ids)
    else:
        toks += sum(len(o.token_ids) for o in eng.generate([req(p, tree) for p in prompts]))
    return toks, time.perf_counter() - t0
run("auto")
names = ["b16", "auto", "auto-nolift"]
tot = {k: [0, 0.0] for k in names}; ratios = {k: [] for k in names}
for r in range(reps):
    order = names[r % 3:] + names[:r % 3]
    this = {}
    for k in order:
        toks, secs = run(k); tot[k][0] += toks; tot[k][1] += secs; this[k] = toks / secs
    for k in names:
        ratios[k].append(this[k] / this["b16"])
for k in names:
    v = tot[k][0] / tot[k][1]
    print(f"ctx {ctx} C={conc} {k:12s} {v:6.1f} tok/s, / b16 {v / (tot['b16'][0] / tot['b16'][1]):.3f} "
          f"(per repeat median {statistics.median(ratios[k]):.3f}, {min(ratios[k]):.3f}-{max(ratios[k]):.3f})", flush=True)
eng.shutdown(drain_timeout=0)
