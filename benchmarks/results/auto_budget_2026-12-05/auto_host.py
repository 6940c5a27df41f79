"""Host time of budget auto's bookkeeping per round at C=1 (choose, read_row, the scheduler's _auto_choice)."""
import sys, time, collections
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine import auto_budget as ab
from ddtree.engine.scheduler import Scheduler
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for
ctx = int(sys.argv[1])
spent = collections.defaultdict(lambda: [0.0, 0])
def timed(cls, name):
    real = getattr(cls, name)
    def f(*a, **k):
        t = time.perf_counter(); out = real(*a, **k); s = spent[name]; s[0] += time.perf_counter() - t; s[1] += 1; return out
    setattr(cls, name, f)
for cls, name in [(ab.AutoChooser, "choose"), (ab.AutoChooser, "read_row"), (Scheduler, "_auto_choice"),
                  (Scheduler, "_collect"), (Scheduler, "_launch"), (Scheduler, "_emit_results")]:
    timed(cls, name)
eng = Engine.from_config(EngineConfig(device="cpu", max_batch=4, max_len=1024, max_budget=64, warmup="none"))
eng.start()
stream = held_out_token_stream(eng.tokenizer, 40000)
prompts = prompts_for(stream, ctx, 4, salt=0)
for tree in (TreeSettings(budget="auto"), TreeSettings(budget=16), TreeSettings(budget="auto")):
    spent.clear()
    t0 = time.perf_counter(); rounds = 0
    for p in prompts:
        out = eng.generate([GenerationRequest(prompt_token_ids=p, tree=tree, sampling=SamplingParams(max_tokens=128, ignore_eos=True))])[0]
        rounds += out.stats.verify_rounds
    print(tree.budget, f"wall {time.perf_counter() - t0:.2f} s, {rounds} rounds;",
          {k: f"{v[0] / rounds * 1e3:.2f} ms/round ({v[1]} calls)" for k, v in spent.items()}, flush=True)
eng.shutdown(drain_timeout=0)
