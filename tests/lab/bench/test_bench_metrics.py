"""Benchmark arithmetic: per-token ITL, token attribution, run and cell summaries (vs numpy and plain loops)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.lab.bench.metrics import (
    RUN_SUMMARY_KEYS,
    attribute_tokens,
    per_token_itl,
    percentile,
    request_record,
    summarize_cell,
    summarize_run,
    token_events,
)
from ddtree.lab.client import Completion


def test_itl_worked_example():
    itl = per_token_itl([0.10, 0.15, 0.17], [1, 3, 1])
    assert itl == pytest.approx([0.05 / 3] * 3 + [0.02])


def test_speculative_stream_itl_is_per_token_not_per_chunk():
    # A speculative server committing 5 tokens every 50 ms: the honest ITL is 10 ms for every token. Counting
    # chunks as tokens would give 50 ms (per chunk) or a 50 ms gap plus four zeros (per token, naive).
    times = [0.2 + 0.05 * i for i in range(20)]
    itl = per_token_itl(times, [5] * 20)
    assert len(itl) == 19 * 5
    assert percentile(itl, 50) == pytest.approx(0.01) and percentile(itl, 90) == pytest.approx(0.01)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 2.0), st.integers(1, 16)), min_size=1, max_size=40))
def test_itl_invariants(events):
    # events: (gap since the previous event, tokens in this event); brute-force: walk token by token.
    times, tokens, t = [], [], 0.0
    for gap, k in events:
        t += gap
        times.append(t)
        tokens.append(k)
    itl = per_token_itl(times, tokens)
    expected = []
    for i in range(1, len(times)):
        for _ in range(tokens[i]):
            expected.append((times[i] - times[i - 1]) / tokens[i])
    assert itl == pytest.approx(expected)
    assert len(itl) == sum(tokens) - tokens[0]
    assert math.isclose(sum(itl), times[-1] - times[0], rel_tol=1e-9, abs_tol=1e-9)


def test_itl_rejects_empty_events():
    with pytest.raises(ValueError):
        per_token_itl([0.0, 1.0], [1, 0])
    with pytest.raises(ValueError):
        per_token_itl([0.0], [1, 2])


def test_attribute_tokens_matches_the_tokenizer_on_token_aligned_chunks(tiny_tokenizer):
    # Chunks cut at token boundaries of a real text: re-tokenizing the cumulative text recovers each chunk's
    # token count (as long as the cut does not change the tokenization, which the test checks first).
    text = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    sizes = [1, 3, 2, 5, 1]
    sizes.append(len(ids) - sum(sizes))
    assert sizes[-1] > 0
    chunks, start = [], 0
    for k in sizes:
        chunks.append(tiny_tokenizer.decode(ids[start:start + k]))
        start += k
    running = ""
    for chunk, end in zip(chunks, np.cumsum(sizes), strict=True):
        running += chunk
        assert len(tiny_tokenizer.encode(running, add_special_tokens=False)) == end, "cut changes tokenization"
    assert attribute_tokens(chunks, len(ids), tiny_tokenizer) == sizes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=12), min_size=1, max_size=30), st.integers(0, 200))
def test_attribute_tokens_by_characters_sums_to_total(texts, total):
    shares = attribute_tokens(texts, total)
    assert sum(shares) == total and all(s >= 0 for s in shares)
    if total >= len(texts):
        assert all(s >= 1 for s in shares)


def test_token_events_from_continuous_usage_are_exact():
    c = Completion(chunk_times=[0.1, 0.2, 0.25, 0.3, 0.4], chunk_texts=["a", "bcd", "", "ef", ""],
                   chunk_usage=[1, 4, 4, 6, 6], completion_tokens=6)
    assert token_events(c) == ([0.1, 0.2, 0.3], [1, 3, 2], "usage")


def test_token_events_without_chunk_usage_fall_back_and_say_so(tiny_tokenizer):
    c = Completion(chunk_times=[0.1, 0.2, 0.3], chunk_texts=["ab", "cdef", ""], chunk_usage=[None, None, 6],
                   completion_tokens=6)
    times, tokens, source = token_events(c)
    assert (times, tokens, source) == ([0.1, 0.2], [2, 4], "chars")
    assert token_events(c, tiny_tokenizer)[2] == "tokenizer"
    assert sum(token_events(c, tiny_tokenizer)[1]) == 6


def _record(n, ttft, latency, itl, rounds=None, error=None):
    return {"completion_tokens": n, "ttft_s": ttft, "latency_s": latency, "itl_s": itl, "spec_verify_ct": rounds,
            "error": error}


def test_summarize_run_against_numpy():
    rng = np.random.default_rng(0)
    records = []
    for _ in range(9):
        n = int(rng.integers(2, 50))
        ttft = float(rng.uniform(0.01, 0.5))
        itl = list(rng.uniform(0.001, 0.05, size=n - 1))
        records.append(_record(n, ttft, ttft + sum(itl), itl, rounds=int(rng.integers(1, n + 1))))
    records.append(_record(None, None, None, [], error="HTTP 500: boom"))
    s = summarize_run(records, 2.0)
    ok = records[:-1]
    assert set(s) == set(RUN_SUMMARY_KEYS)
    assert (s["errors"], s["completed"], s["duration_s"]) == (1, 9, 2.0)
    assert s["output_tok_s"] == pytest.approx(sum(r["completion_tokens"] for r in ok) / 2.0)
    decode = [(r["completion_tokens"] - 1) / (r["latency_s"] - r["ttft_s"]) for r in ok]
    assert s["decode_tok_s_mean"] == pytest.approx(np.mean(decode))
    assert s["decode_tok_s_p50"] == pytest.approx(np.percentile(decode, 50))
    assert s["tpot_s_mean"] == pytest.approx(np.mean([1 / d for d in decode]))
    assert s["ttft_s_p50"] == pytest.approx(np.percentile([r["ttft_s"] for r in ok], 50))
    all_itl = [x for r in ok for x in r["itl_s"]]
    for q in (50, 90):
        assert s[f"itl_s_p{q}"] == pytest.approx(np.percentile(all_itl, q))
    for q in (50, 90, 99):
        assert s[f"e2e_s_p{q}"] == pytest.approx(np.percentile([r["latency_s"] for r in ok], q))
    assert s["accept_source"] == "per_request"
    assert s["accept_length"] == pytest.approx(sum(r["completion_tokens"] for r in ok)
                                               / sum(r["spec_verify_ct"] for r in ok))


def test_summarize_run_acceptance_falls_back_to_counters():
    records = [_record(10, 0.1, 0.5, [0.04] * 9), _record(10, 0.1, 0.5, [0.04] * 9, rounds=4)]
    s = summarize_run(records, 1.0, counter_accept_length=2.5)
    assert (s["accept_length"], s["accept_source"]) == (2.5, "prometheus")
    s = summarize_run(records, 1.0)
    assert (s["accept_length"], s["accept_source"]) == (None, None)


def test_summarize_run_all_failed():
    s = summarize_run([_record(None, None, None, [], error="x")] * 3, 1.0)
    assert s["errors"] == 3 and s["completed"] == 0 and s["output_tok_s"] == 0.0 and s["ttft_s_p50"] is None


def test_summarize_cell_averages_and_spread():
    runs = [summarize_run([_record(10, 0.1, 0.1 + 0.9 * k, [0.1 * k] * 9)], 1.0 * k) for k in (1, 2, 4)]
    cell = summarize_cell(runs)
    speeds = [r["output_tok_s"] for r in runs]
    assert cell["output_tok_s"] == pytest.approx(np.mean(speeds))
    assert cell["output_tok_s_spread"] == {"min": min(speeds), "max": max(speeds),
                                           "std": pytest.approx(np.std(speeds, ddof=1)), "n": 3}
    assert cell["e2e_s_p50"] == pytest.approx(np.mean([r["e2e_s_p50"] for r in runs]))
    one = summarize_cell(runs[:1])
    assert one["output_tok_s_spread"]["std"] == 0.0 and one["output_tok_s_spread"]["n"] == 1
    with pytest.raises(ValueError):
        summarize_cell([])


def test_request_record_from_a_streamed_completion():
    c = Completion(text="abcdef", finish_reason="length", prompt_tokens=60, completion_tokens=6, latency_s=0.5,
                   chunk_times=[0.1, 0.2, 0.4, 0.45], chunk_texts=["a", "bcd", "ef", ""],
                   chunk_usage=[1, 4, 6, 6], spec_verify_ct=3, accept_length=2.0)
    r = request_record(c, 60)
    assert r["ttft_s"] == 0.1 and r["chunks"] == 3 and r["itl_source"] == "usage"
    assert r["itl_s"] == pytest.approx([0.1 / 3] * 3 + [0.1, 0.1])
    assert (r["prompt_tokens"], r["completion_tokens"], r["spec_verify_ct"], r["finish_reason"]) == (60, 6, 3, "length")
