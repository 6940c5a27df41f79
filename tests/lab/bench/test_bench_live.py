"""``run_bench`` against a real ``ddtree`` server (real engine, tiny random pair) on loopback.

The engine runs in this process, so its own counters are an independent reference for what the benchmark
measured: the tokens and verify rounds it reports must be exactly what the engine did.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from ddtree.lab.bench import Workload, run_bench
from ddtree.lab.client import BenchTarget, OpenAIClient
from ddtree.lab.engines import CounterAcceptance


def _bench(live, workload, out_dir=None, **target):
    return asyncio.run(run_bench(BenchTarget(url=live.url, **target), workload, out_dir=out_dir,
                                 config={"method": "ddtree", "budget": 4}, progress=False,
                                 tokenizer=live.tokenizer))


def test_bench_cells_against_live_server(live_ddtree, tmp_path):
    engine = live_ddtree.engine
    before = engine.snapshot()
    workload = Workload(contexts=(24, 80), concurrency=(1, 3), output_tokens=12, num_requests=4, warmup=False)
    cells = _bench(live_ddtree, workload, tmp_path, extra_body={"ddtree": {"budget": 4}})
    after = engine.snapshot()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["ctx24-c1.json", "ctx24-c3.json", "ctx80-c1.json",
                                                         "ctx80-c3.json"]
    records = []
    for cell in cells:
        assert cell["engine"] == "ddtree"  # auto-detected
        assert cell["env"]["server_info"]["model"] == "tiny"
        assert json.loads((tmp_path / f"ctx{cell['workload']['context']}-c{cell['workload']['concurrency']}.json")
                          .read_text()) == cell
        context = cell["workload"]["context"]
        for r in cell["runs"][0]["requests"]:
            assert r["error"] is None
            assert r["prompt_tokens"] == context  # the server's own count of the prompt we built
            assert r["completion_tokens"] == 12 and r["finish_reason"] == "length"  # ignore_eos, fixed length
            assert r["ttft_s"] is not None and r["ttft_s"] <= r["latency_s"]
            assert len(r["itl_s"]) <= 11 and all(x >= 0 for x in r["itl_s"])
            records.append(r)
        s = cell["summary"]
        assert s["completed"] == 4 and s["errors"] == 0 and s["accept_source"] == "per_request"
        assert s["output_tok_s"] > 0 and s["accept_length"] >= 1.0
    # the engine's counters moved by exactly what the records say (nothing else ran: no warm-up)
    assert after.generation_tokens_total - before.generation_tokens_total == sum(r["completion_tokens"]
                                                                                 for r in records)
    assert after.verify_rounds_total - before.verify_rounds_total == sum(r["spec_verify_ct"] for r in records)
    assert after.prompt_tokens_total - before.prompt_tokens_total == sum(r["prompt_tokens"] for r in records)


def test_warmup_runs_at_the_cell_concurrency_and_is_not_measured(live_ddtree):
    engine = live_ddtree.engine
    before = engine.snapshot()
    workload = Workload(contexts=(20,), concurrency=(3,), output_tokens=20, num_requests=5, warmup=True)
    [cell] = _bench(live_ddtree, workload)
    after = engine.snapshot()
    measured = sum(r["completion_tokens"] for r in cell["runs"][0]["requests"])
    assert measured == 5 * 20
    # a warm-up shaped like the run (five requests of the full 20 tokens) ran too, but is not in the cell
    assert after.generation_tokens_total - before.generation_tokens_total == measured + 5 * 20
    assert sum(after.requests_total.values()) - sum(before.requests_total.values()) == 10
    assert len(cell["runs"][0]["requests"]) == 5


def test_chat_endpoint_counts_the_template(live_ddtree):
    workload = Workload(contexts=(30,), concurrency=(2,), output_tokens=8, num_requests=2, warmup=False)
    [cell] = _bench(live_ddtree, workload, endpoint="chat")
    tokenizer = live_ddtree.tokenizer
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                             tokenize=False)
    overhead = len(tokenizer(rendered)["input_ids"]) - len(tokenizer("x")["input_ids"])
    assert overhead > 3
    for r in cell["runs"][0]["requests"]:
        assert r["error"] is None and r["prompt_tokens_sent"] == 30
        assert r["prompt_tokens"] == pytest.approx(30 + overhead, abs=2)  # template tokens around the content
        assert r["completion_tokens"] == 8


def test_counter_acceptance_matches_per_request_stats_on_ddtree(live_ddtree):
    """The Prometheus path (used when a server gives no per-request stats) agrees with the per-request one."""

    async def go():
        async with OpenAIClient(BenchTarget(url=live_ddtree.url)) as client:
            before = await client.scrape()
            completions = []
            for prompt in ([3, 4, 5, 6], [7, 8, 9, 10, 11]):
                body = await client.body(prompt=prompt, max_tokens=10, stream=True, ignore_eos=True,
                                         extra={"ddtree": {"budget": 6}})
                completions.append(await client.complete(body))
            after = await client.scrape()
            return before, after, completions

    before, after, completions = asyncio.run(go())
    assert all(c.error is None for c in completions)
    per_request = sum(c.completion_tokens for c in completions) / sum(c.spec_verify_ct for c in completions)
    assert CounterAcceptance("ddtree").from_counters(before, after) == pytest.approx(per_request)


def test_bad_tree_settings_fail_each_request_with_the_servers_message(live_ddtree):
    workload = Workload(contexts=(16,), concurrency=(2,), output_tokens=4, num_requests=2, warmup=False)
    [cell] = _bench(live_ddtree, workload, extra_body={"ddtree": {"budget": 10_000}})
    assert cell["summary"]["errors"] == 2
    assert all(r["error"].startswith("HTTP 400:") and "budget" in r["error"] for r in cell["runs"][0]["requests"])
