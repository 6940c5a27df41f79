"""Percentiles, goodput, the Pareto front and the depth curve against hand-computed values, and the report's
depth conclusion and demo note on synthetic runs."""

from __future__ import annotations

import pytest
from report_synthetic import make_run

from ddtree.lab.bench.metrics import summarize_run
from ddtree.lab.engines import depth_curve, depth_curve_from_positions
from ddtree.lab.report import load_run, write_report
from ddtree.lab.report.analysis import depth_bullets, recommend
from ddtree.lab.report.latency import cell_goodput, meets_slo, pareto_front
from ddtree.lab.sweep.layout import RunLayout, atomic_write_json, read_json


def _req(ttft: float, latency: float, tokens: int = 11, error: str | None = None) -> dict:
    return {"ttft_s": ttft, "latency_s": latency, "completion_tokens": tokens, "itl_s": [], "spec_verify_ct": None,
            "error": error}


def test_percentiles_against_hand_computed_values():
    # TTFTs 0.1 .. 0.5: p50 = 0.3, p90 = 0.46 (0.4 + 0.6 * 0.1), p99 = 0.496
    records = [_req(t, t + 1.0) for t in (0.5, 0.1, 0.3, 0.2, 0.4)]
    s = summarize_run(records, 2.0)
    assert (s["ttft_s_p50"], s["ttft_s_p90"], s["ttft_s_p99"]) == pytest.approx((0.3, 0.46, 0.496))
    assert s["e2e_s_p99"] == pytest.approx(1.496)
    assert s["tpot_s_p50"] == pytest.approx(0.1)  # every request: 1.0 s over 10 tokens after the first


def test_goodput_against_hand_computed_values():
    # itl (per-request mean) = (latency - ttft) / 10
    reqs = [_req(0.1, 1.1), _req(0.6, 1.6), _req(0.1, 3.1), _req(0.1, 0.5, error="boom")]
    slo = {"ttft_ms": 500, "itl_ms": 150}
    assert [meets_slo(r, slo) for r in reqs] == [True, False, False, False]  # ttft too late; itl 300 ms; error
    runs = [{"requests": reqs, "summary": {"duration_s": 2.0}}, {"requests": reqs[:2], "summary": {"duration_s": 0.5}}]
    g = cell_goodput(runs, slo)
    assert (g.mean, g.min, g.max, g.met, g.total) == (pytest.approx(1.25), 0.5, 2.0, 2, 6)
    assert meets_slo(_req(0.1, 0.1, tokens=1), {"itl_ms": 1}) and not meets_slo(_req(0.1, 2.0), {"e2e_ms": 1999})


def test_pareto_front_on_a_constructed_set():
    points = [(10, 100), (20, 80), (15, 70), (5, 120), (10, 90), (20, 80)]
    assert pareto_front(points) == [3, 0, 1, 5]  # (5,120), (10,100), (20,80) twice; (15,70), (10,90) dominated


def test_depth_curves_by_hand():
    assert depth_curve([2, 1, 1]) == [0.5, 0.25]
    assert depth_curve([0, 0, 4, 0]) == [1.0, 1.0]
    assert depth_curve_from_positions({0: 8, 1: 4, 2: 0}, 10) == [0.8, 0.4]


def _with_depth(root, curves: dict[str, list[float]], trained: int) -> None:
    layout = RunLayout(root)
    for path in layout.configs_dir.glob("*/bench/*.json"):
        cid = path.parent.parent.name
        data = read_json(path)
        data["summary"]["accept_by_depth"] = curves.get(cid.split("-")[0], curves.get(cid))
        data["env"]["server_info"] = {"engine": {"limits": {"trained_block_size": trained}}}
        atomic_write_json(path, data)


def test_flat_acceptance_past_the_trained_depth_is_concluded(tmp_path):
    root = make_run(tmp_path / "r", failures=False)
    # trained block size 4 -> depth 3; the trees drafted to depth 5 but depths 4-5 add 0.1 of 2.0 accepted
    _with_depth(root, {"ddtree": [0.9, 0.6, 0.4, 0.06, 0.04], "dflash": [0.8, 0.5, 0.3]}, trained=4)
    bullets = depth_bullets(load_run(root))
    assert len(bullets) == 1 and bullets[0].startswith("Acceptance past the drafter's trained depth (3) is flat")
    assert "added at most 0.10 tokens per round (5% of the accepted drafts" in bullets[0]
    _with_depth(root, {"ddtree": [0.9, 0.6, 0.4, 0.3, 0.2], "dflash": [0.8, 0.5, 0.3]}, trained=4)
    assert depth_bullets(load_run(root))[0].startswith("Depths past the drafter's trained depth (3) still accepted")
    paths = write_report(root)
    md = paths.summary.read_text()
    assert "| ddtree b8 | 3.90 | ddtree | 0.90 | 0.60 | 0.40 | 0.30 | 0.20 |" in md
    assert (root / "plots" / "acceptance_by_depth.png").is_file() and (root / "plots" / "pareto.png").is_file()


def test_slo_turns_recommendations_to_goodput(tmp_path):
    root = make_run(tmp_path / "r", failures=False)
    layout = RunLayout(root)
    for path in layout.configs_dir.glob("*/bench/*.json"):
        data = read_json(path)
        fast = path.parent.parent.name == "ddtree-b4-k4-bstrained-wnone"  # only it meets the SLO
        for run in data["runs"]:
            run["requests"] = [_req(0.1 if fast else 0.9, 1.0)] * 4
        atomic_write_json(path, data)
    latency = recommend(load_run(root, slo={"ttft_ms": 500}))[0]
    assert latency.metric == "goodput" and latency.winner.config.config_id == "ddtree-b4-k4-bstrained-wnone"
    assert latency.winner.goodput == pytest.approx(2.0)  # 4 requests in a 2 s run
    assert recommend(load_run(root))[0].winner.config.config_id == "ddtree-b8-knone-bstrained-wnone"  # tok/s
    md = write_report(root, slo={"ttft_ms": 500}).summary.read_text()
    assert "SLO: TTFT <= 500 ms; recommendations rank on goodput" in md


def test_demo_pair_runs_say_what_the_gate_checks(tmp_path):
    root = make_run(tmp_path / "r", failures=False)
    for path in RunLayout(root).configs_dir.glob("*/bench/*.json"):
        data = read_json(path)
        data["env"]["model"] = "ddtree-demo"
        atomic_write_json(path, data)
    md = write_report(root).summary.read_text()
    assert "too small to solve HumanEval" in md and "checks losslessness" in md
    other = make_run(tmp_path / "o", failures=False)
    assert "too small to solve HumanEval" not in write_report(other).summary.read_text()
