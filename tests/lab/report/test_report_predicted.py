"""``ddtree report`` puts replay's predicted tok/s beside the measured, with the error, on a synthetic run whose
measured numbers were chosen by hand (report_synthetic.py)."""

from __future__ import annotations

from lab_helpers import md_section, md_table
from report_synthetic import make_run

from ddtree.lab.report import load_run, write_report
from ddtree.lab.report.predicted import load_predicted
from ddtree.lab.sweep.layout import atomic_write_json

PREDICTED = {
    "schema": "ddtree.replay.tok_s/1",
    "model": "closed loop (test)",
    "prefill_modelled": True,
    "trace": {"block_size": 16, "draft_window": None},
    "cost_curve": {"device": "cpu", "model": "synthetic"},
    "cells": [
        {"method": "ar", "budget": None, "topk": None, "context": 60, "concurrency": 1, "tok_s": 22.0},
        {"method": "ddtree", "budget": 4, "topk": 4, "context": 60, "concurrency": 8, "tok_s": 190.0},
        # measured cell failed: the prediction stands alone
        {"method": "ddtree", "budget": 4, "topk": None, "context": 1024, "concurrency": 8, "tok_s": 100.0,
         "extrapolated": True},
        # a setting the run never measured matches no config
        {"method": "ddtree", "budget": 64, "topk": None, "context": 60, "concurrency": 1, "tok_s": 50.0},
    ],
}


def test_predicted_beside_measured_with_the_error(tmp_path):
    root = make_run(tmp_path / "run")
    atomic_write_json(root / "predicted.json", PREDICTED)
    results = load_run(root)
    predicted = load_predicted(results)
    errors = {(c.config_id, c.context, c.concurrency): c.error_pct for c in predicted.cells}
    assert errors == {("ar", 60, 1): 10.0, ("ddtree-b4-k4-bstrained-wnone", 60, 8): -5.0,
                      ("ddtree-b4-knone-bstrained-wnone", 1024, 8): None}
    assert predicted.mean_abs_error_pct() == 7.5

    write_report(root)
    md = (root / "summary.md").read_text()
    section = md_section(md, "Predicted vs measured")
    assert "mean |error| 7.5% over 2 cells" in section
    table = md_table(section)
    assert table[0] == ["config", "cell", "measured tok/s", "predicted tok/s", "error"]
    label = results.label
    assert table[1:] == [
        [label("ar"), "ctx 60 C=1", "20.0", "22.0", "+10.0%"],
        [label("ddtree-b4-k4-bstrained-wnone"), "ctx 60 C=8", "200.0", "190.0", "-5.0%"],
        [label("ddtree-b4-knone-bstrained-wnone"), "ctx 1024 C=8", "-", "100.0*", "-"],
    ]
    assert "Predicted vs measured" in (root / "report.html").read_text()


def test_no_file_no_section_and_a_foreign_file_is_ignored(tmp_path):
    root = make_run(tmp_path / "run")
    assert load_predicted(load_run(root)) is None
    atomic_write_json(root / "predicted.json", {"schema": "something/1"})
    assert load_predicted(load_run(root)) is None
    write_report(root)
    assert "## Predicted vs measured" not in (root / "summary.md").read_text()
