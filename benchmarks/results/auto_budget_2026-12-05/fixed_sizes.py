"""C=1 demo: fixed budgets 7, 15, 16, 31, 63 (prompts one after another): tok/s, accept, wall per round; the engine's
cost curve at one row beside them (measured at start, as auto's)."""
import sys, time
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for
ctx = int(sys.argv[1]); reps = int(sys.argv[2])
eng = Engine.from_config(EngineConfig(device="cpu", max_batch=4, max_len=1024, max_budget=64, warmup="none"))
eng.start()
stream = held_out_token_stream(eng.tokenizer, 40000)
prompts = prompts_for(stream, ctx, 4, salt=0)
def run(b):
    t0 = time.perf_counter(); toks = 0; rounds = 0; acc = []; ver = 0.0
    for p in prompts:
        out = eng.generate([GenerationRequest(prompt_token_ids=p, tree=TreeSettings(budget=b), sampling=SamplingParams(max_tokens=128, ignore_eos=True))])[0]
        toks += len(out.token_ids); rounds += out.stats.verify_rounds; acc.append(out.stats.accept_length)
        ver += sum(v for k, v in out.stats.stage_s.items() if k != "prefill")
    return toks / (time.perf_counter() - t0), sum(acc) / len(acc), rounds, ver / rounds * 1e3
run(16)
res = {}
for r in range(reps):
    for b in (7, 15, 16, 31, 63):
        res.setdefault(b, []).append(run(b))
for b, v in res.items():
    n = len(v)
    print(f"b{b:<3d} {sum(x[0] for x in v)/n:6.1f} tok/s accept {v[0][1]:.2f} rounds {v[0][2]} round stages {sum(x[3] for x in v)/n:.1f} ms")
eng.shutdown(drain_timeout=0)
