"""The report and the recommendations over classified lossless gates: identical / near-tie / real per config, real
(or unclassified) divergences fail the gate and leave the rankings, near-ties pass with a note, and results of the
old schema (no classes) are still read."""

from __future__ import annotations

import re
from pathlib import Path

from report_synthetic import gate_result, make_run

from ddtree.lab.humaneval import EVAL_SCHEMA as HUMANEVAL_SCHEMA
from ddtree.lab.report import load_run, write_report
from ddtree.lab.report.analysis import recommend
from ddtree.lab.sweep.layout import EVAL_SCHEMA, RunLayout, atomic_write_json

B8 = "ddtree-b8-knone-bstrained-wnone"  # the latency winner (61.0 tok/s) of the synthetic run
B4K4 = "ddtree-b4-k4-bstrained-wnone"  # the throughput winner (200.0)


def _table(md: str, title: str) -> list[list[str]]:
    section = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", md, flags=re.S | re.M)
    assert section
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[:1] + rows[2:]]


def test_the_sweep_and_the_gate_write_the_same_schema():
    assert EVAL_SCHEMA == HUMANEVAL_SCHEMA == "ddtree.eval.humaneval/2"


def test_real_and_unclassified_divergences_leave_the_recommendations(tmp_path: Path):
    root = make_run(tmp_path / "run")
    layout = RunLayout(root)
    atomic_write_json(layout.eval_path(B8), gate_result([True, True], identical=1, differing=("HumanEval/0",),
                                                        kinds=("real",)))
    atomic_write_json(layout.eval_path(B4K4), gate_result([True, True], identical=1, differing=("HumanEval/1",),
                                                          schema="ddtree.eval.humaneval/1"))  # old: no classes
    results = load_run(root)
    gates = {c.config_id: c.gate for c in results.configs}
    assert (gates[B8].verdict, gates[B8].real, gates[B8].near_tie, gates[B8].real_tasks) == (
        "failed", 1, 0, ("HumanEval/0",))
    assert (gates[B4K4].verdict, gates[B4K4].real, gates[B4K4].passes) == ("unclassified", None, False)
    recs = {r.workload.key: r for r in recommend(results)}
    assert recs["latency"].winner.config.config_id == "ddtree-b8-k4-bstrained-wnone"  # b8 (61.0) left out
    assert set(recs["latency"].excluded) == {B8, B4K4}
    assert recs["throughput"].winner.config.config_id == "ddtree-b4-knone-bstrained-wnone"  # b4 k=4 left out
    assert all(B8 not in [r.config.config_id for r in rec.ranking] for rec in recs.values())

    paths = write_report(root)
    md = paths.summary.read_text()
    assert "Not ranked (failed the lossless gate: real or unclassified divergences from AR, see the coding gate): "\
           "ddtree b8, ddtree b4 k=4." in md
    assert "Lossless check FAILED: real divergences from AR's greedy outputs (a gap no rounding explains) for " \
           "ddtree b8 (HumanEval/0); left out of the recommendations." in md
    assert "ddtree b4 k=4 (HumanEval/1) (not classified" in md
    gate = {row[0]: row for row in _table(md, "Coding gate")}
    assert gate["config"][7:] == ["lossless", "near-tie", "real", "real divergences", "near-tie tasks",
                                  "unclassified differing tasks"]
    assert gate["ddtree b8"][7:] == ["NO 1/2, 1 real, 0 near-tie", "0", "1", "HumanEval/0", "-", "-"]
    assert gate["ddtree b4 k=4"][7:] == ["NO 1/2 (unclassified)", "-", "-", "-", "-", "HumanEval/1"]
    assert gate["ddtree b8 k=4"][7:] == ["yes 1/2, 1 near-tie", "1", "0", "-", "HumanEval/1", "-"]
    results_table = {row[0]: row for row in _table(md, "Results")}
    assert results_table["ddtree b8"][-1] == "NO 1/2, 1 real, 0 near-tie"


def test_drifting_identical_outputs_get_a_bullet(tmp_path: Path):
    root = make_run(tmp_path / "run")
    gate = gate_result([True, True], identical=2, kinds=())
    gate["lossless"]["drifting"] = [{"task_id": "HumanEval/1", "drift": 0.9, "position": 4}]
    atomic_write_json(RunLayout(root).eval_path(B8), gate)
    results = load_run(root)
    g = next(c.gate for c in results.configs if c.config_id == B8)
    assert (g.verdict, g.passes, g.drifting_tasks) == ("identical", True, ("HumanEval/1",))
    md = write_report(root).summary.read_text()
    assert "Log-prob drift: outputs identical to AR's" in md and "ddtree b8 (HumanEval/1)" in md
