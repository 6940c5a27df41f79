"""Synthetic sweep run directories with numbers chosen by hand, so report tests know the right answers.

The files follow the bench cell (``ddtree.bench.cell/1``) and HumanEval (``ddtree.eval.humaneval/2``) formats and
are laid out with the sweep's own :class:`RunLayout` and :class:`Manifest`, exactly as a real sweep writes them.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ddtree.lab.sweep.grid import SweepConfig
from ddtree.lab.sweep.layout import BENCH_SCHEMA, EVAL_SCHEMA, RunLayout, atomic_write_json
from ddtree.lab.sweep.manifest import Manifest

CONFIG = SweepConfig(
    name="synthetic",
    budgets=(4, 8),
    topks=(4, None),
    contexts=(60, 1024),
    concurrency=(1, 8),
    output_tokens=64,
    repeats=2,
    gate_tasks=("HumanEval/0", "HumanEval/1"),
)

# tok/s per config and cell as (run 1, run 2): chosen so that
#  - latency (ctx 60, C=1): ddtree-b8-knone wins by 1 tok/s over ddtree-b8-k4, inside the spread;
#  - throughput (ctx 60, C=8): ddtree-b4-k4 wins by 30 tok/s, beyond the spread;
#  - long context (ctx 1024, C=1): ddtree-b8-k4 wins by 5 tok/s, beyond the spread;
#  - top-k barely matters except at C=8; budget matters (b8 better at C=1, b4 better at C=8);
#  - DDTree loses to the DFlash chain at ctx 1024, C=8.
SPEEDS: dict[str, dict[tuple[int, int], tuple[float, float]]] = {
    "ar": {(60, 1): (20, 20), (60, 8): (100, 100), (1024, 1): (18, 18), (1024, 8): (90, 90)},
    "dflash-bstrained-wnone": {(60, 1): (40, 40), (60, 8): (150, 150), (1024, 1): (35, 35), (1024, 8): (140, 140)},
    "ddtree-b4-k4-bstrained-wnone": {(60, 1): (50, 50), (60, 8): (199, 201), (1024, 1): (40, 40), (1024, 8): (120, 120)},
    "ddtree-b4-knone-bstrained-wnone": {(60, 1): (51, 51), (60, 8): (169, 171), (1024, 1): (40, 40), (1024, 8): (119, 119)},
    "ddtree-b8-k4-bstrained-wnone": {(60, 1): (59, 61), (60, 8): (160, 160), (1024, 1): (50, 50), (1024, 8): (110, 110)},
    "ddtree-b8-knone-bstrained-wnone": {(60, 1): (60, 62), (60, 8): (150, 150), (1024, 1): (45, 45), (1024, 8): (109, 109)},
}
ACCEPT = {
    "ar": 1.0,
    "dflash-bstrained-wnone": 2.5,
    "ddtree-b4-k4-bstrained-wnone": 3.0,
    "ddtree-b4-knone-bstrained-wnone": 3.1,
    "ddtree-b8-k4-bstrained-wnone": 3.8,
    "ddtree-b8-knone-bstrained-wnone": 3.9,
}


def bench_cell(config: dict, context: int, concurrency: int, runs: tuple[float, ...], accept: float) -> dict:
    def summary(tok_s: float) -> dict:
        return {
            "output_tok_s": tok_s, "decode_tok_s_mean": tok_s / concurrency, "decode_tok_s_p50": tok_s / concurrency,
            "ttft_s_mean": 0.05, "ttft_s_p50": 0.05, "tpot_s_mean": concurrency / tok_s, "itl_s_p50": 0.01,
            "itl_s_p90": 0.02, "e2e_s_p50": 1.0, "e2e_s_p90": 1.1, "e2e_s_p99": 1.2, "accept_length": accept,
            "accept_source": "ddtree", "errors": 0, "completed": 2 * concurrency, "duration_s": 2.0,
        }

    mean = statistics.fmean(runs)
    top = summary(mean)
    top["output_tok_s_spread"] = {
        "min": min(runs), "max": max(runs), "std": statistics.pstdev(runs), "n": len(runs),
    }
    return {
        "schema": BENCH_SCHEMA,
        "config": config,
        "engine": "ddtree",
        "workload": {"context": context, "concurrency": concurrency, "output_tokens": 64, "num_requests": 2 * concurrency,
                     "repeats": len(runs), "seed": 0, "endpoint": "completions", "prompt_lengths": [context] * 2},
        "runs": [{"requests": [], "summary": summary(r)} for r in runs],
        "summary": top,
        "env": {"ddtree_version": "0.1.0", "time": 0.0, "url": "http://127.0.0.1:1"},
    }


def gate_result(passed: list[bool], *, truncated: tuple[int, ...] = (), identical: int | None = None,
                differing: tuple[str, ...] = (), kinds: tuple[str, ...] | None = None,
                schema: str = EVAL_SCHEMA) -> dict:
    """A gate result; ``kinds``: the class of each ``differing`` task (``near_tie`` / ``real``), None for a
    lossless object without classes (schema /1)."""
    tasks = []
    for i, ok in enumerate(passed):
        reason = "passed" if ok else ("truncated" if i in truncated else "failed: AssertionError")
        tasks.append({"task_id": f"HumanEval/{i}", "passed": ok, "reason": reason,
                      "finish_reason": "length" if i in truncated else "stop", "completion": "x", "code": "x"})
    lossless = None
    if identical is not None:
        lossless = {"baseline": "ar", "identical": identical, "compared": len(passed),
                    "differing_tasks": list(differing)}
        if kinds is not None:
            lossless.update(near_tie=kinds.count("near_tie"), real=kinds.count("real"), near_tie_margin=0.5,
                            divergences=[{"task_id": t, "kind": k, "position": 3, "gap": 0.1 if k == "near_tie" else 4.0}
                                         for t, k in zip(differing, kinds, strict=True)])
    return {
        "schema": schema, "pass_at_1": sum(passed) / len(passed), "passed": sum(passed), "total": len(passed),
        "truncated": len(truncated), "wrong": len(passed) - sum(passed) - len(truncated), "errors": 0, "tasks": tasks,
        "lossless": lossless,
    }


def make_run(root: Path, *, failures: bool = True) -> Path:
    """A finished synthetic run: every cell of :data:`SPEEDS`, a gate per config, one failed config cell."""
    layout = RunLayout(root)
    manifest = Manifest.open(layout, CONFIG, {"mode": "inprocess", "description": "synthetic"}, resume=False)
    for point in CONFIG.points():
        cid = point.config_id
        atomic_write_json(layout.config_path(cid), {"point": point.to_dict()})
        for (ctx, conc), runs in SPEEDS[cid].items():
            if failures and cid == "ddtree-b4-knone-bstrained-wnone" and (ctx, conc) == (1024, 8):
                layout.record_failure(cid, "ctx1024-c8", {"kind": "http", "error": "HTTP 500: boom\ntraceback"})
                continue
            atomic_write_json(layout.bench_path(cid, ctx, conc), bench_cell(point.to_dict(), ctx, conc, runs, ACCEPT[cid]))
        if cid == "ar":
            gate = gate_result([True, True])
        elif cid == "ddtree-b8-k4-bstrained-wnone":
            gate = gate_result([True, False], truncated=(1,), identical=1, differing=("HumanEval/1",),
                               kinds=("near_tie",))
        else:
            gate = gate_result([True, True], identical=2)
        atomic_write_json(layout.eval_path(cid), gate)
    manifest.finish("finished")
    return root
