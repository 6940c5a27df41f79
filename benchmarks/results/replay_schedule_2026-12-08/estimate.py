"""How far replay's schedule change (git 37416dc) moves the predictions recorded for the H100 matrix, estimated on
this machine: each recorded cell's cost curve, replayed by the loop before the change (git 729d916) and after it,
over synthetic commits at the cell's measured acceptance (each request's mean drawn within +-20 % of it, so
requests finish at different rounds as real ones do). Budget auto is left out: it needs the trace's anchors, which
the runs did not keep. An estimate of the shift, not a prediction of the cells: the real traces' commits are not
these.

    python benchmarks/results/replay_schedule_2026-12-08/estimate.py docs/benchmarks/replay_schedule_2026-12-08/estimate.md
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from ddtree.engine.cost_curve import load_curve
from ddtree.lab.replay import throughput as after

BEFORE_COMMIT = "729d916"
RUNS = [  # (the run's replay_h200.py JSON, its cost curve)
    ("docs/benchmarks/replay_auto_2026-12-07/h100_replay_auto.json", "docs/benchmarks/replay_auto_2026-12-07/h100_cost_curve.json"),
    ("docs/benchmarks/matrix_2026-12-07/short.json", "docs/benchmarks/matrix_2026-12-07/short_cost_curve.json"),
    ("docs/benchmarks/matrix_2026-12-07/long1.json", "docs/benchmarks/matrix_2026-12-07/long1_cost_curve.json"),
    ("docs/benchmarks/matrix_2026-12-08/h100_long32.json", "docs/benchmarks/matrix_2026-12-08/h100_long32_cost_curve.json"),
    ("docs/benchmarks/matrix_2026-12-08/h100_long64.json", "docs/benchmarks/matrix_2026-12-08/h100_long64_cost_curve.json"),
]


def before_module():
    """replay.throughput as it was at BEFORE_COMMIT."""
    text = subprocess.run(["git", "show", f"{BEFORE_COMMIT}:src/ddtree/lab/replay/throughput.py"], check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "throughput_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("throughput_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["throughput_before"] = module
    spec.loader.exec_module(module)
    return module


def commits_for(accept: float, n: int, max_tokens: int, seed: int, cap: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        mean = max(1.0, accept * (0.8 + 0.4 * rng.random()))
        seq, done = [], 1
        while done < max_tokens:
            c = min(cap, max(1, int(mean) + (1 if rng.random() < mean - int(mean) else 0)))
            seq.append(c)
            done += c
        out.append(seq)
    return out


def main() -> None:
    before = before_module()
    lines = ["| cell | method | measured tok/s | recorded prediction (error) | synthetic, before | synthetic, after | shift | error shifted |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for doc_path, curve_path in RUNS:
        doc = json.loads(Path(doc_path).read_text())
        curve = load_curve(Path(curve_path))
        prompts = {(c["context"], c["concurrency"]): c["prompts"] for c in doc["cells"]}
        for row in doc["comparison"]:
            if row["prefill_points"] != "graphed" or row["method"] == "ddtree-auto":
                continue
            method = row["method"]
            budget = 0 if method == "ar" else 15 if method == "dflash" else int(method.split("-b")[1])
            ctx, conc = row["context"], row["concurrency"]
            n = prompts[(ctx, conc)]
            commits = commits_for(row["measured_accept"], n, doc["args"]["new_tokens"], ctx + conc, budget + 1)
            kw = dict(context=ctx, concurrency=conc, max_tokens=doc["args"]["new_tokens"], budget=budget,
                      prefill_chunk=doc["args"]["prefill_chunk"])
            tok = []
            for module in (before, after):
                round_s, prefill_s, _, _ = module.simulate_cell(curve, commits, **kw)
                tok.append(n * kw["max_tokens"] / (round_s + prefill_s))
            shift = tok[1] / tok[0] - 1
            shifted = (1 + row["error"]) * (1 + shift) - 1
            lines.append(f"| {ctx} C={conc} | {method} | {row['measured_tok_s']} | {row['predicted_tok_s']} "
                         f"({row['error']:+.1%}) | {tok[0]:.0f} | {tok[1]:.0f} | {shift:+.1%} | {shifted:+.1%} |")
    Path(sys.argv[1]).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
