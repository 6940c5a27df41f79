"""``run_bench`` against servers that answer like SGLang and vLLM (recorded-format streams and metrics)."""

from __future__ import annotations

import asyncio
import json

import pytest
from lab_helpers import FIXTURES, ReplayConfig, read_sse_fixture

from ddtree.lab.bench import CELL_SCHEMA, RUN_SUMMARY_KEYS, Workload, run_bench


def _metrics(engine: str) -> list[str]:
    return [(FIXTURES / f"{engine}_metrics_{when}.txt").read_text() for when in ("before", "after")]


def _bench(url, workload, tokenizer, out_dir=None, **target):
    from ddtree.lab.client import BenchTarget

    return asyncio.run(run_bench(BenchTarget(url=url, **target), workload, out_dir=out_dir,
                                 config={"label": "recorded"}, progress=False, tokenizer=tokenizer))


def test_vllm_cell_from_recorded_stream_and_counters(replay_server, tiny_tokenizer, tmp_path):
    replay = replay_server(ReplayConfig(owned_by="vllm", stream=read_sse_fixture("vllm_completions_stream.txt"),
                                        metrics=_metrics("vllm")))
    workload = Workload(contexts=(48,), concurrency=(4,), output_tokens=12, num_requests=8)
    [cell] = _bench(replay.url, workload, tiny_tokenizer, out_dir=tmp_path)

    assert cell["schema"] == CELL_SCHEMA and cell["engine"] == "vllm" and cell["config"] == {"label": "recorded"}
    assert json.loads((tmp_path / "ctx48-c4.json").read_text()) == cell
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ctx48-c4.json"]  # no temporary files left behind

    w = cell["workload"]
    assert (w["context"], w["concurrency"], w["num_requests"], w["endpoint"]) == (48, 4, 8, "completions")
    assert w["prompt_lengths"] == [48] * 8
    # the warm-up ran first, shaped like the run (8 requests of 12 tokens at concurrency 4); then the 8 measured
    assert len(replay.bodies) == 8 + 8
    assert [b["max_tokens"] for b in replay.bodies] == [12] * 8 + [12] * 8
    for body in replay.bodies:
        assert isinstance(body["prompt"], list) and len(body["prompt"]) == 48  # token ids, exact length
        assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["stream"] is True
        assert "return_spec_tokens_details" not in body
    assert len({tuple(b["prompt"]) for b in replay.bodies}) == 16  # warm-up prompts are not reused

    [run] = cell["runs"]
    assert set(run["summary"]) == set(RUN_SUMMARY_KEYS)
    for r in run["requests"]:
        assert r["error"] is None
        assert (r["prompt_tokens"], r["prompt_tokens_sent"], r["completion_tokens"]) == (64, 48, 12)
        assert r["itl_source"] == "usage" and r["chunks"] == 6
        # chunk sizes 1, 3, 1, 4, 1, 2: the first token is TTFT, the rest give per-token entries
        itl = r["itl_s"]
        assert len(itl) == 11
        assert itl[0] == itl[1] == itl[2] and itl[4] == itl[5] == itl[6] == itl[7] and itl[9] == itl[10]
        # five gaps of at least the replay's 20 ms pause, all before the stream ended; a loaded machine may
        # deliver two chunks together, which moves a pause from the gaps into TTFT but never loses it
        assert 5 * 0.02 * 0.95 <= r["ttft_s"] + sum(itl) and sum(itl) <= r["latency_s"] - r["ttft_s"] + 1e-9
        assert r["ttft_s"] > 0 and r["finish_reason"] == "length"
    s = cell["summary"]
    assert s["accept_source"] == "prometheus"
    assert s["accept_length"] == pytest.approx(1 + 250 / 100)  # from the counter fixtures' differences
    assert s["completed"] == 8 and s["errors"] == 0
    assert s["output_tok_s"] == pytest.approx(8 * 12 / s["duration_s"])
    assert replay.scrapes[0] == 2  # one scrape before the run (after the warm-up) and one after


def test_sglang_acceptance_from_per_request_spec_details(replay_server, tiny_tokenizer):
    replay = replay_server(ReplayConfig(owned_by="sglang", stream=read_sse_fixture("sglang_completions_stream.txt"),
                                        metrics=_metrics("sglang")))
    workload = Workload(contexts=(32,), concurrency=(2,), output_tokens=16, num_requests=4, warmup=False)
    [cell] = _bench(replay.url, workload, tiny_tokenizer)
    assert cell["engine"] == "sglang"
    assert all(b["return_spec_tokens_details"] is True for b in replay.bodies)
    s = cell["summary"]
    assert (s["accept_source"], s["accept_length"]) == ("per_request", pytest.approx(16 / 5))
    for r in cell["runs"][0]["requests"]:
        assert (r["spec_verify_ct"], r["accept_length"], r["completion_tokens"]) == (5, 3.2, 16)
        # no per-chunk usage: the 16 tokens are spread over the 6 text chunks by re-tokenizing them
        assert r["itl_source"] == "tokenizer" and r["chunks"] == 6
        assert 5 <= len(r["itl_s"]) < 16 and all(x > 0 for x in r["itl_s"])


def test_sglang_acceptance_from_counters_over_each_repeat(replay_server, tiny_tokenizer):
    before, after = _metrics("sglang")
    replay = replay_server(ReplayConfig(owned_by="sglang",
                                        stream=read_sse_fixture("sglang_completions_stream_nospec.txt"),
                                        metrics=[before, after, before, after]))
    workload = Workload(contexts=(32,), concurrency=(4,), output_tokens=16, num_requests=8, repeats=2)
    [cell] = _bench(replay.url, workload, tiny_tokenizer)
    assert len(cell["runs"]) == 2 and cell["workload"]["prompt_lengths"] == [32] * 16
    for run in cell["runs"]:
        assert run["summary"]["accept_source"] == "prometheus"
        assert run["summary"]["accept_length"] == pytest.approx(128 / 40)
    spread = cell["summary"]["output_tok_s_spread"]
    speeds = [run["summary"]["output_tok_s"] for run in cell["runs"]]
    assert spread["n"] == 2 and spread["min"] == min(speeds) and spread["max"] == max(speeds)
    assert cell["summary"]["output_tok_s"] == pytest.approx(sum(speeds) / 2)


def test_explicit_engine_overrides_detection(replay_server, tiny_tokenizer):
    replay = replay_server(ReplayConfig(owned_by="vllm", stream=read_sse_fixture("vllm_completions_stream.txt")))
    workload = Workload(contexts=(16,), concurrency=(1,), output_tokens=12, num_requests=1, warmup=False)
    [cell] = _bench(replay.url, workload, tiny_tokenizer, engine="openai")
    assert cell["engine"] == "openai" and cell["summary"]["accept_length"] is None


def test_request_errors_are_recorded_per_request(tiny_tokenizer):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workload = Workload(contexts=(16,), concurrency=(2,), output_tokens=4, num_requests=3, warmup=False)
    [cell] = _bench(f"http://127.0.0.1:{port}", workload, tiny_tokenizer, model="m", engine="vllm", timeout_s=5)
    s = cell["summary"]
    assert s["errors"] == 3 and s["completed"] == 0
    assert all(r["error"] for r in cell["runs"][0]["requests"])
