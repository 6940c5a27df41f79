"""benchmarks/gpu_report.py: merging device runs by whole (concurrency, context) group."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from benchmark_scripts import load_script, script_path

SCRIPT = script_path("gpu_report")


def _module():
    return load_script("gpu_report")


def _cell(conc: int, ctx: int, method: str, tok_s: float) -> dict:
    return {"concurrency": conc, "context": ctx, "method": method, "tok_s": tok_s, "decode_tok_s": tok_s,
            "accept_length": 1.0, "speedup_vs_ar": 1.0, "efficiency": 1.0, "stage_ms_per_round": {},
            "round_ms": 1.0, "peak_mem_gib": 1.0, "identical_to_ar": 1, "compared": 1}


def _report(cells: list[dict], skipped: list[dict] = (), device: str = "H200") -> dict:
    return {"device": device, "torch": "2.11", "shape": "qwen3-8b", "params_target": 7e9, "params_drafter": 1e9,
            "standin_build_s": 0.2, "graph_vs_eager_identical": True, "cells": cells, "skipped": list(skipped)}


def test_a_later_run_replaces_whole_groups_and_keeps_the_rest():
    old = _report([_cell(1, 60, "ar", 1.0), _cell(1, 60, "ddtree-b8", 2.0), _cell(1, 60, "ddtree-b16", 3.0),
                   _cell(8, 60, "ar", 4.0)], skipped=[{"concurrency": 8, "context": 1024, "method": "ar"}])
    new = _report([_cell(1, 60, "ar", 5.0), _cell(1, 60, "ddtree-b8", 6.0), _cell(8, 1024, "ar", 7.0)],
                  device="H200 again")
    merged = _module().merge_reports([("old", old), ("new", new)])
    got = {(c["concurrency"], c["context"], c["method"]): (c["tok_s"], c["source"]) for c in merged["cells"]}
    # (1, 60) comes wholly from the new run: its b16 (only in the old run) must not mix in
    assert got == {(1, 60, "ar"): (5.0, "new"), (1, 60, "ddtree-b8"): (6.0, "new"), (8, 60, "ar"): (4.0, "old"),
                   (8, 1024, "ar"): (7.0, "new")}
    assert [(c["concurrency"], c["context"]) for c in merged["cells"]] == [(1, 60), (1, 60), (8, 60), (8, 1024)]
    assert merged["sources"] == {"C1 ctx60": "new", "C8 ctx60": "old", "C8 ctx1024": "new"}
    assert merged["skipped"] == []  # measured by the later run
    assert merged["device"] == "H200 again"


def test_the_script_writes_both_files_and_names_an_unreadable_report(tmp_path):
    good = tmp_path / "run1_c1_gpu.json"
    good.write_text(json.dumps(_report([_cell(1, 60, "ar", 1.0), _cell(1, 60, "ddtree-b8", 2.5)])))
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(SCRIPT), str(good), "--out", str(out)], check=True, capture_output=True)
    assert json.loads((out / "gpu.json").read_text())["sources"] == {"C1 ctx60": "run1_c1"}
    assert "| 1 | 60 | ddtree-b8 | 2.5 |" in (out / "gpu.md").read_text()
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    result = subprocess.run([sys.executable, str(SCRIPT), str(bad), "--out", str(out)], capture_output=True, text=True)
    assert result.returncode != 0 and "broken.json" in result.stderr


def test_no_reports_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        _module().merge_reports([])


def test_extra_budgets_get_their_own_section_and_leave_the_matrix_alone(tmp_path):
    main = tmp_path / "run1_c1_gpu.json"
    main.write_text(json.dumps(_report([_cell(1, 60, "ar", 1.0), _cell(1, 60, "ddtree-b8", 2.5)])))
    extra = tmp_path / "run2_big_gpu.json"
    extra.write_text(json.dumps({**_report([_cell(1, 60, "ar", 1.2), _cell(1, 60, "ddtree-b512", 1.8)]),
                                 "hf_generate": {"tok_s": 13.5}}))
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(SCRIPT), str(main), "--extra", str(extra), "--out", str(out)], check=True,
                   capture_output=True)
    merged = json.loads((out / "gpu.json").read_text())
    assert [c["method"] for c in merged["cells"]] == ["ar", "ddtree-b8"]  # the matrix keeps its own AR
    assert [(c["method"], c["tok_s"]) for c in merged["extra"]["cells"]] == [("ar", 1.2), ("ddtree-b512", 1.8)]
    text = (out / "gpu.md").read_text()
    matrix, further = text.split("## Further budgets")
    assert "| 1 | 60 | ddtree-b8 | 2.5 |" in matrix and "ddtree-b512" not in matrix
    assert "| 1 | 60 | ddtree-b512 | 1.8 |" in further and "run2_big" in further
    assert merged["hf_generate"] == {"tok_s": 13.5, "source": "run2_big"}  # named once, at the top
    assert "Hugging Face generate" in matrix and "Hugging Face generate" not in further


def test_a_group_cut_short_by_the_time_box_does_not_replace_a_whole_one():
    old = _report([_cell(32, 8192, "ar", 1.0), _cell(32, 8192, "dflash", 2.0), _cell(32, 8192, "ddtree-b8", 3.0)])
    new = _report([_cell(64, 8192, "ar", 4.0), _cell(32, 8192, "ar", 5.0)],
                  skipped=[{"concurrency": 32, "context": 8192, "method": "dflash"},
                           {"concurrency": 32, "context": 8192, "method": "ddtree-b8"}])
    merged = _module().merge_reports([("old", old), ("new", new)])
    got = {(c["concurrency"], c["method"]): (c["tok_s"], c["source"]) for c in merged["cells"]}
    assert got == {(32, "ar"): (1.0, "old"), (32, "dflash"): (2.0, "old"), (32, "ddtree-b8"): (3.0, "old"),
                   (64, "ar"): (4.0, "new")}
    assert merged["skipped"] == []  # every skipped cell is measured in the group that stands
    # With nothing earlier, the partial group is what there is.
    alone = _module().merge_reports([("new", new)])
    assert {(c["concurrency"], c["method"]) for c in alone["cells"]} == {(64, "ar"), (32, "ar")}


def test_cut_short_groups_replace_each_other_and_skipped_follows_the_standing_group():
    skip = lambda method: {"concurrency": 32, "context": 8192, "method": method}  # noqa: E731
    first = _report([_cell(32, 8192, "ar", 1.0)], skipped=[skip("dflash"), skip("ddtree-b8")])
    second = _report([_cell(32, 8192, "ar", 2.0), _cell(32, 8192, "dflash", 3.0)], skipped=[skip("ddtree-b8")])
    merged = _module().merge_reports([("first", first), ("second", second)])
    # both cut short: the later one stands, and only its own skipped cell is reported (dflash it measured)
    assert [(c["method"], c["source"]) for c in merged["cells"]] == [("ar", "second"), ("dflash", "second")]
    assert merged["skipped"] == [skip("ddtree-b8")]
    # a whole group stands against a later partial one, whose skipped b16 that group never planned is not listed
    whole = _report([_cell(32, 8192, "ar", 4.0), _cell(32, 8192, "dflash", 5.0)])
    partial = _report([_cell(32, 8192, "ar", 6.0)], skipped=[skip("ddtree-b16")])
    merged = _module().merge_reports([("whole", whole), ("partial", partial)])
    assert {c["source"] for c in merged["cells"]} == {"whole"} and merged["skipped"] == []
    # a group no run measured keeps the latest run's skipped cells
    unmeasured = _report([], skipped=[{"concurrency": 64, "context": 60, "method": "ar"}])
    merged = _module().merge_reports([("whole", whole), ("unmeasured", unmeasured)])
    assert merged["skipped"] == [{"concurrency": 64, "context": 60, "method": "ar"}]


def test_merged_cells_leave_the_per_request_timelines_in_the_run_files():
    cell = {**_cell(8, 60, "ar", 1.0), "timeline": [[0.0, 0.01, 0.5]]}
    merged = _module().merge_reports([("run", _report([cell]))])
    assert "timeline" not in merged["cells"][0] and merged["cells"][0]["tok_s"] == 1.0
