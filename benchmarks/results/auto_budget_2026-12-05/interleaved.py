"""Budget auto against fixed b16 on the demo pair, interleaved so that the machine's drift lands on both alike: each
repeat runs the four prompts with b16 then with auto (C = 1: one after another; C = 4: all at once), the order of
the two flipped every repeat; tok/s of each config over all repeats, and the ratio per repeat. The engine's fallback
curve is measured before (an untimed auto request). Usage: python interleaved.py CONTEXT CONCURRENCY REPEATS."""
import statistics, sys, time
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for
ctx, conc, reps = (int(a) for a in sys.argv[1:4])
eng = Engine.from_config(EngineConfig(device="cpu", max_batch=4, max_len=1024, max_budget=64, warmup="none"))
eng.start()
stream = held_out_token_stream(eng.tokenizer, 40000)
prompts = prompts_for(stream, ctx, 4, salt=0)
def req(p, tree):
    return GenerationRequest(prompt_token_ids=p, tree=tree, sampling=SamplingParams(max_tokens=128, ignore_eos=True))
def run(tree):
    t0 = time.perf_counter(); toks = 0
    if conc == 1:
        for p in prompts:
            toks += len(eng.generate([req(p, tree)])[0].token_ids)
    else:
        toks += sum(len(o.token_ids) for o in eng.generate([req(p, tree) for p in prompts]))
    return toks, time.perf_counter() - t0
run(TreeSettings(budget="auto"))
configs = {"b16": TreeSettings(budget=16), "auto": TreeSettings(budget="auto")}
tot = {k: [0, 0.0] for k in configs}; ratios = []
for r in range(reps):
    order = ["b16", "auto"] if r % 2 == 0 else ["auto", "b16"]
    this = {}
    for k in order:
        toks, secs = run(configs[k]); tot[k][0] += toks; tot[k][1] += secs; this[k] = toks / secs
    ratios.append(this["auto"] / this["b16"])
b16, auto = (tot[k][0] / tot[k][1] for k in ("b16", "auto"))
print(f"ctx {ctx} C={conc} {reps} repeats: b16 {b16:.1f} tok/s, auto {auto:.1f} tok/s, auto / b16 {auto / b16:.3f} "
      f"(per repeat: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f})", flush=True)
eng.shutdown(drain_timeout=0)
