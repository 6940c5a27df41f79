"""Engine detection and acceptance readers, on recorded-format SGLang / vLLM / ddtree objects and metrics."""

from __future__ import annotations

import asyncio
import json

import pytest
from lab_helpers import FIXTURES, ReplayConfig, load_json_fixture, read_sse_fixture

from ddtree.lab.client import BenchTarget, OpenAIClient
from ddtree.lab.engines import CounterAcceptance, parse_metrics, spec_stats


def test_spec_stats_from_sglang_sglext():
    assert spec_stats(load_json_fixture("sglang_chat_response.json")) == (15, 4.0)


def test_spec_stats_from_sglang_choice_meta_info():
    assert spec_stats(load_json_fixture("sglang_completion_meta_info.json")) == (4, 3.0)


def test_spec_stats_from_sglang_stream_usage_chunk():
    chunks = [json.loads(p) for p in read_sse_fixture("sglang_completions_stream.txt") if p != "[DONE]"]
    found = [spec_stats(c) for c in chunks]
    assert found[:-1] == [(None, None)] * (len(chunks) - 1)
    assert found[-1] == (5, 3.2)


def test_spec_stats_from_ddtree_objects():
    # The ddtree server's shapes: a "ddtree" stats object and SGLang-style meta_info on the choice.
    body = {"choices": [{"text": "x", "meta_info": {"spec_verify_ct": 7, "spec_accept_length": 2.0}}],
            "ddtree": {"verify_rounds": 7, "accept_length": 2.0, "completion_tokens": 14}}
    assert spec_stats(body) == (7, 2.0)
    assert spec_stats({"ddtree": {"verify_rounds": 3, "accept_length": 1.5}}) == (3, 1.5)


def test_spec_stats_absent_in_plain_openai_objects():
    chunks = [json.loads(p) for p in read_sse_fixture("vllm_completions_stream.txt") if p != "[DONE]"]
    assert all(spec_stats(c) == (None, None) for c in chunks)


def test_parse_metrics_sums_label_sets_and_drops_created():
    m = parse_metrics((FIXTURES / "vllm_metrics_before.txt").read_text())
    assert m["vllm:spec_decode_num_drafts_total"] == 150.0  # engine 0 (100) + engine 1 (50)
    assert m["vllm:spec_decode_num_accepted_tokens_total"] == 290.0
    assert m["vllm:generation_tokens_total"] == 8000.0
    assert m["vllm:e2e_request_latency_seconds_count"] == 12.0
    assert not any(name.endswith("_created") for name in m)


def test_vllm_acceptance_is_one_plus_accepted_over_drafts():
    before = parse_metrics((FIXTURES / "vllm_metrics_before.txt").read_text())
    after = parse_metrics((FIXTURES / "vllm_metrics_after.txt").read_text())
    # drafts: (160 - 100) + (90 - 50) = 100; accepted: (380 - 200) + (160 - 90) = 250
    assert CounterAcceptance("vllm").from_counters(before, after) == pytest.approx(3.5)
    assert CounterAcceptance("vllm").from_counters(after, after) is None  # no drafts in the interval


def test_sglang_acceptance_is_tokens_over_verify_calls():
    before = parse_metrics((FIXTURES / "sglang_metrics_before.txt").read_text())
    after = parse_metrics((FIXTURES / "sglang_metrics_after.txt").read_text())
    # generation tokens 1128 - 1000 = 128 over 440 - 400 = 40 verify calls; the cumulative gauge (2.8) is ignored
    assert CounterAcceptance("sglang").from_counters(before, after) == pytest.approx(3.2)


def test_counter_acceptance_needs_the_engine_counters():
    sglang = parse_metrics((FIXTURES / "sglang_metrics_after.txt").read_text())
    assert CounterAcceptance("vllm").from_counters(sglang, sglang) is None
    assert CounterAcceptance("openai").from_counters(sglang, sglang) is None


@pytest.mark.parametrize("owner", ["vllm", "sglang"])
def test_detect_engine_from_models_owner(replay_server, owner):
    replay = replay_server(ReplayConfig(owned_by=owner, stream=[]))

    async def detect() -> str:
        async with OpenAIClient(BenchTarget(url=replay.url)) as client:
            return await client.detect_engine()

    assert asyncio.run(detect()) == owner


def test_detect_engine_from_metric_prefix(replay_server):
    text = (FIXTURES / "vllm_metrics_before.txt").read_text()
    replay = replay_server(ReplayConfig(owned_by="someone", stream=[], metrics=[text]))

    async def detect() -> str:
        async with OpenAIClient(BenchTarget(url=replay.url)) as client:
            return await client.detect_engine()

    assert asyncio.run(detect()) == "vllm"


def test_detect_engine_unknown_is_openai(replay_server):
    replay = replay_server(ReplayConfig(owned_by="someone", stream=[]))

    async def detect() -> str:
        async with OpenAIClient(BenchTarget(url=replay.url + "/v1/")) as client:
            return await client.detect_engine()

    assert asyncio.run(detect()) == "openai"
