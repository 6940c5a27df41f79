"""The bench against the SGLang and vLLM doubles: acceptance from every source equals the double's ground truth,
and renaming the fields (SGLang's old names only, new names only) changes nothing the report reads."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from doubles.script import Script
from doubles.sglang_server import SGLangDouble
from doubles.vllm_server import VLLMDouble
from lab_helpers import ThreadedUvicorn

from ddtree.lab.bench import Workload, run_bench
from ddtree.lab.client import BenchTarget
from ddtree.lab.engines import depth_curve
from ddtree.lab.sweep.launcher import LaunchedServer

WORKLOAD = Workload(contexts=(16,), concurrency=(2,), output_tokens=12, num_requests=4, repeats=2)


def _bench(url: str, engine: str) -> dict:
    cells = asyncio.run(run_bench(BenchTarget(url=url, engine=engine), WORKLOAD, out_dir=None,
                                  config={"config_id": "x"}, progress=False))
    assert len(cells) == 1
    return cells[0]


def _served(double):
    server = ThreadedUvicorn(double.app())
    return server


def _ready(url: str) -> None:
    for _ in range(10):  # the doubles refuse the first generation (not ready yet)
        if httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200:
            return
    raise AssertionError("double never became ready")


def _measured(double, run: int) -> tuple[int, int, int, list[float]]:
    """(tokens, rounds, accepted drafts, depth curve) of measured run ``run``: requests after the readiness
    probe (1) and the warm-up (4), 4 per run."""
    part = double.requests[5 + 4 * run: 5 + 4 * (run + 1)]
    hist = [0] * max(len(t.hist) for t in part)
    for t in part:
        for n, c in enumerate(t.hist):
            hist[n] += c
    return sum(t.tokens for t in part), sum(t.rounds for t in part), sum(t.accepted for t in part), depth_curve(hist)


@pytest.mark.parametrize("names", ["new", "old", "both"])
def test_sglang_per_request_stats_under_any_field_names(names):
    double = SGLangDouble(names=names)
    with _served(double) as server:
        _ready(server.url)
        cell = _bench(server.url, "sglang")
    assert len(double.requests) == 1 + 4 + 2 * 4
    for run in (0, 1):
        tokens, rounds, _, curve = _measured(double, run)
        s = cell["runs"][run]["summary"]
        assert (s["accept_source"], s["spec_fields"], s["depth_source"]) == ("per_request", "sglext", "histogram")
        assert s["accept_length"] == pytest.approx(tokens / rounds)  # SGLang's: completion tokens / verify rounds
        assert s["accept_by_depth"] == pytest.approx(curve)
        assert curve[0] > curve[-1] > 0  # a real curve, not a constant


def test_renamed_sglang_fields_change_nothing_the_report_reads():
    summaries = {}
    for names in ("new", "old"):
        double = SGLangDouble(names=names)  # each double starts its script at the same place
        with _served(double) as server:
            _ready(server.url)
            cell = _bench(server.url, "sglang")
        summaries[names] = cell["summary"]
    keys = ("accept_length", "accept_source", "spec_fields", "accept_by_depth", "depth_source", "completed")
    assert {k: summaries["new"][k] for k in keys} == {k: summaries["old"][k] for k in keys}


def test_sglang_server_info_over_a_flushed_run_when_nothing_else_reports():
    double = SGLangDouble(serve_metrics=False, report_details=False, script=Script(accepted=(4, 0, 1, 0, 0, 2, 6)))
    with _served(double) as server:
        _ready(server.url)
        cell = _bench(server.url, "sglang")
    for run in (0, 1):
        tokens, rounds, _, _ = _measured(double, run)
        s = cell["runs"][run]["summary"]
        assert s["accept_source"] == "server_info"
        # the average since the flush before this run: the warm-up and the other run are left out
        assert s["accept_length"] == pytest.approx(tokens / rounds)
        assert s["accept_by_depth"] is None  # no source gives the depth here, and none is invented
    tokens, rounds, _, _ = _measured(double, 1)
    since_start = double.truth.tokens / double.truth.rounds
    assert since_start != pytest.approx(tokens / rounds)  # without the flush the reading would be wrong


def test_vllm_counters_and_per_position_depth_equal_ground_truth():
    double = VLLMDouble(script=Script(accepted=(3, 1, 0, 2, 3, 5), drafts_per_round=7))
    with _served(double) as server:
        _ready(server.url)
        cell = _bench(server.url, "vllm")
    for run in (0, 1):
        _, rounds, accepted, curve = _measured(double, run)
        s = cell["runs"][run]["summary"]
        assert (s["accept_source"], s["depth_source"]) == ("prometheus", "per_position_counters")
        assert s["accept_length"] == pytest.approx(1 + accepted / rounds)  # vLLM's: 1 + accepted / drafts
        assert s["accept_by_depth"] == pytest.approx(curve)
        assert len(curve) == 5  # the script never accepts past position 4


def test_doubles_answer_health_before_they_can_generate(tmp_path):
    for double in (SGLangDouble(health_503=0, generate_503=3), VLLMDouble(generate_503=3)):
        with _served(double) as server:
            port = int(server.url.rsplit(":", 1)[1])
            launched = LaunchedServer("true", port=port, log_path=tmp_path / "log")
            with httpx.Client(base_url=server.url, trust_env=False) as client:
                assert client.get("/health").status_code == 200
                assert launched._probe(client).startswith("one-token generation answered 503")
