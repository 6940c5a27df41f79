"""``ddtree report`` on synthetic run directories whose right answers were chosen by hand (report_synthetic.py)."""

from __future__ import annotations

import base64
import re
import shutil
from pathlib import Path

import pytest
import typer
from lab_helpers import md_section, md_table
from report_synthetic import CONFIG, make_run
from typer.testing import CliRunner

from ddtree.errors import ConfigError
from ddtree.lab.report import load_run, write_report
from ddtree.lab.report.analysis import knob_effects, recommend
from ddtree.lab.sweep.layout import RunLayout, atomic_write_json, read_json

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    root = make_run(tmp_path_factory.mktemp("report") / "synthetic-run")
    write_report(root)
    return root


def test_summary_sections_in_order(report_dir):
    md = (report_dir / "summary.md").read_text()
    titles = re.findall(r"^## (.+)$", md, flags=re.M)
    assert titles == ["Conclusions", "Recommendations", "Best setting per concurrency", "Results", "All cells",
                      "Latency", "Acceptance by depth", "Coding gate", "Failures", "Plots"]
    assert md.startswith("# Sweep report: synthetic-run\n")


def test_recommendations_name_winner_margin_and_spread(report_dir):
    table = md_table(md_section((report_dir / "summary.md").read_text(), "Recommendations"))
    assert table[0] == ["workload", "cell", "winner", "tok/s", "runner-up", "tok/s", "margin", "beyond spread?",
                        "vs AR", "vs DFlash"]
    rows = {row[0]: row for row in table[1:]}
    assert set(rows) == {"Latency", "Throughput", "Long context"}
    lat, thr, long_ = rows["Latency"], rows["Throughput"], rows["Long context"]
    # latency: 61 vs 60, runs [60, 62] vs [59, 61] overlap
    assert lat[1:7] == ["ctx 60, C=1", "ddtree b8", "61.0", "ddtree b8 k=4",
                        "60.0", "+1.0 (+1.7%)"]
    assert lat[7].startswith("no:") and lat[8:] == ["3.05x", "1.52x"]
    # throughput: 200 [199, 201] vs 170 [169, 171]
    assert thr[1:7] == ["ctx 60, C=8", "ddtree b4 k=4", "200.0", "ddtree b4",
                        "170.0", "+30.0 (+17.6%)"]
    assert thr[7].startswith("yes:") and thr[8:] == ["2.00x", "1.33x"]
    assert long_[1:7] == ["ctx 1024, C=1", "ddtree b8 k=4", "50.0", "ddtree b8",
                          "45.0", "+5.0 (+11.1%)"]
    assert long_[7].startswith("yes:")


def test_best_setting_per_concurrency(report_dir):
    table = md_table(md_section((report_dir / "summary.md").read_text(), "Best setting per concurrency"))
    assert table == [
        ["concurrency", "ctx 60", "ctx 1024"],
        ["C=1", "ddtree b8 (61.0)", "ddtree b8 k=4 (50.0)"],
        ["C=8", "ddtree b4 k=4 (200.0)", "dflash (140.0)"],
    ]


def test_users_table_sorted_with_gate_and_lossless(report_dir):
    table = md_table(md_section((report_dir / "summary.md").read_text(), "Results"))
    assert table[0] == ["config", "method", "budget", "top-k", "block", "window", "C=1 ctx 60 tok/s",
                        "C=1 ctx 1024 tok/s", "C=8 ctx 60 tok/s", "accept len", "vs AR (C=1)", "coding", "lossless"]
    assert [row[0] for row in table[1:]] == [
        "ddtree b8", "ddtree b8 k=4", "ddtree b4",
        "ddtree b4 k=4", "dflash", "ar",
    ]
    by_id = {row[0]: row for row in table[1:]}
    assert by_id["ddtree b8 k=4"][6:] == ["60.0", "50.0", "160.0", "3.80", "3.00x", "1/2 (1 trunc.)",
                                                         "yes 1/2, 1 near-tie"]
    assert by_id["ar"][-2:] == ["2/2", "reference"]
    assert by_id["dflash"][2:6] == ["-", "-", "trained", "none"]


def test_all_cells_marks_the_failed_cell(report_dir):
    table = md_table(md_section((report_dir / "summary.md").read_text(), "All cells"))
    row = next(r for r in table if r[0] == "ddtree b4")
    assert row[1:] == ["51.0 [51.0..51.0] a3.10", "170.0 [169.0..171.0] a3.10", "40.0 [40.0..40.0] a3.10", "failed"]
    failures = md_table(md_section((report_dir / "summary.md").read_text(), "Failures"))
    assert failures[1] == ["ddtree b4", "ctx1024-c8", "http", "HTTP 500: boom"]


def test_conclusions(report_dir):
    bullets = [line[2:] for line in md_section((report_dir / "summary.md").read_text(), "Conclusions").splitlines()
               if line.startswith("- ")]
    assert bullets[0].startswith("Latency (ctx 60, C=1): **ddtree b8** at 61.0 tok/s, +1.7%")
    assert "within the run-to-run spread" in bullets[0]
    assert "beyond the run-to-run spread" in bullets[1] and "beyond the run-to-run spread" in bullets[2]
    text = "\n".join(bullets)
    assert "budget mattered" in text and "topk barely mattered" in text
    assert "Anomaly: the best DDTree setting lost to the DFlash chain at ctx 1024 C=8 (0.86x)" in text
    assert "1 answer(s) were truncated at max_tokens (HumanEval/1)" in text
    assert ("Lossless check passed with a note: outputs differ from AR only at numeric near-ties (the two tokens' AR "
            "log-probs within 0.5 nats, what bf16 rounding can flip) for ddtree b8 k=4 (HumanEval/1)") in text
    assert "1 cell(s) failed" in text


def test_knob_effects_match_a_hand_computation():
    # budget at fixed topk=4: (60,1) 50 vs 60, (60,8) 200 vs 160, (1024,1) 40 vs 50, (1024,8) 120 vs 110;
    # topk=none: 51 vs 61, 170 vs 150, 40 vs 45 (1024,8 failed for b4-knone) -> 7 comparisons
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        results = load_run(make_run(Path(tmp) / "r"))
        effects = {e.knob: e for e in knob_effects(results)}
    changes = sorted([10 / 60, 40 / 200, 10 / 50, 10 / 120, 10 / 61, 20 / 170, 5 / 45])
    assert effects["budget"].comparisons == 7
    assert effects["budget"].median_change_pct == pytest.approx(100 * changes[3])
    assert effects["budget"].best_value == 8  # wins 4 of 7
    assert effects["budget"].accept_by_value == {4: pytest.approx(3.05), 8: pytest.approx(3.85)}
    assert effects["budget"].mattered and not effects["topk"].mattered
    assert set(effects) == {"budget", "topk"}  # block size and window were not varied


def test_plots_are_pngs_and_html_embeds_them(report_dir):
    pngs = sorted((report_dir / "plots").glob("*.png"))
    assert [p.name for p in pngs] == ["acceptance_by_depth.png", "acceptance_vs_budget.png", "pareto.png",
                                      "speedup_vs_context.png", "throughput_vs_concurrency.png"]
    for png in pngs:
        assert png.read_bytes().startswith(PNG) and png.stat().st_size > 5000
    page = (report_dir / "report.html").read_text()
    embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert sorted(base64.b64decode(e) for e in embedded) == sorted(p.read_bytes() for p in pngs)
    # self-contained: nothing fetched from elsewhere
    assert not re.search(r'(src|href)="(?!data:)', page)
    # recommendations, best, results, all cells, latency, acceptance, gate, failures (no launches)
    assert page.count("<table>") == 8
    assert "<b>ddtree b8</b>" in page  # markdown bold became HTML
    md = (report_dir / "summary.md").read_text()
    assert "![Throughput vs concurrency](plots/throughput_vs_concurrency.png)" in md


def test_single_runs_say_the_spread_is_unknown(tmp_path):
    root = make_run(tmp_path / "r")
    layout = RunLayout(root)
    for path in layout.configs_dir.glob("*/bench/*.json"):
        data = read_json(path)
        data["runs"] = data["runs"][:1]
        data["summary"]["output_tok_s_spread"] = {"min": data["summary"]["output_tok_s"],
                                                  "max": data["summary"]["output_tok_s"], "std": 0.0, "n": 1}
        atomic_write_json(path, data)
    recs = recommend(load_run(root))
    assert [r.spread for r in recs] == ["unknown", "unknown", "unknown"]
    assert "spread not measured" in recs[0].spread_detail


def test_a_run_without_manifest_is_still_reported(tmp_path):
    root = make_run(tmp_path / "r", failures=False)
    (root / "manifest.json").unlink()
    paths = write_report(root)
    md = paths.summary.read_text()
    assert "## Failures" not in md
    results = load_run(root)
    assert [c.config_id for c in results.configs] == sorted(p.config_id for p in CONFIG.points())


def test_report_cli(tmp_path):
    from ddtree.lab.sweep.cli import register

    app = typer.Typer()
    register(app)
    root = make_run(tmp_path / "r")
    shutil.rmtree(root / "configs" / "ar")  # a partial run: AR missing entirely
    result = CliRunner().invoke(app, ["report", str(root)])
    assert result.exit_code == 0, result.output
    assert (root / "report.html").is_file() and "summary.md" in result.output
    table = md_table(md_section((root / "summary.md").read_text(), "Results"))
    assert next(r for r in table if r[0] == "ar")[6] == "-"  # listed from the manifest, but unmeasured
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no configs"):
        write_report(empty)


def test_plain_decoding_winning_is_called_out(tmp_path):
    from report_synthetic import bench_cell

    from ddtree.lab.report.analysis import conclusions

    root = make_run(tmp_path / "r")
    layout = RunLayout(root)
    atomic_write_json(layout.bench_path("ar", 60, 1), bench_cell({"config_id": "ar"}, 60, 1, (100.0, 100.0), 1.0))
    text = "\n".join(conclusions(load_run(root)))
    assert ("Anomaly: no speculative setting beat plain decoding at ctx 60, C=1 (best speculative: "
            "ddtree b8, 0.61x AR, acceptance 3.90)") in text
    assert text.startswith("Latency (ctx 60, C=1): **ar** at 100.0 tok/s")
