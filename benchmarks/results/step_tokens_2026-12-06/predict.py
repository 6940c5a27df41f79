"""Replay's closed-loop model (ddtree.lab.replay.throughput.simulate_cell) on the H200 curve of 2026-12-02, C = 64,
256 requests of 256 tokens, prefill chunk 512, steps of 512 against 2048 tokens. Acceptance is a constant per round
(AR 1, b7 3.98: that run's measured b7 at 1k), not a trace: a prediction of what the step size alone changes.

    .venv/bin/python benchmarks/results/step_tokens_2026-12-06/predict.py
"""

from ddtree.engine.cost_curve import load_curve
from ddtree.lab.replay.throughput import simulate_cell

curve = load_curve("docs/benchmarks/replay_h200_2026-12-02/cost_curve.json")
for name, accept, budget in (("ar", 1.0, 0), ("b7", 3.98, 7)):
    per_round = [int((i + 1) * accept) - int(i * accept) for i in range(400)]
    for ctx in (60, 1024):
        for step in (512, 2048):
            r, p, n, _ = simulate_cell(curve, [per_round] * 256, context=ctx, concurrency=64, max_tokens=256,
                                       budget=budget, prefill_chunk=512, step_tokens=step)
            print(f"{name} ctx {ctx} steps {step}: {256 * 256 / (r + p):.0f} tok/s, rounds {r:.2f} s, prefill {p:.2f} s, "
                  f"{n} rounds")
