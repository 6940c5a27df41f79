"""The divergence classifier on hand-made token / log-prob sequences, and the lossless comparison that uses it."""

from __future__ import annotations

import json
import logging

import pytest

from ddtree.errors import ConfigError
from ddtree.lab.humaneval import (
    EVAL_SCHEMA,
    TokenTrace,
    TopEntry,
    classify,
    compare_with_baseline,
    first_difference,
)
from ddtree.lab.humaneval.divergence import DEFAULT_NEAR_TIE_MARGIN


def trace(tokens: list[str], tops: list[dict[str, float]] | None = None, ids: list[int] | None = None,
          top_ids: list[dict[str, int]] | None = None) -> TokenTrace:
    """A trace whose chosen log-prob is the token's entry in its top dict (the greedy choice is the top)."""
    if tops is None:
        return TokenTrace(tuple(tokens), None if ids is None else tuple(ids))
    top = tuple(tuple(TopEntry(t, lp, None if top_ids is None else top_ids[k][t])
                      for t, lp in sorted(d.items(), key=lambda kv: -kv[1])) for k, d in enumerate(tops))
    return TokenTrace(tuple(tokens), None if ids is None else tuple(ids), tuple(d[t] for t, d in zip(tokens, tops, strict=True)),
                      top)


# a baseline of five tokens; at every position the top-3 (log-probs by hand: position 2 is a near-tie)
BASE_TOKENS = ["def", " f", "(", "x", "):"]
BASE_TOPS = [
    {"def": -0.01, "class": -5.0, "import": -6.0},
    {" f": -0.5, " g": -1.5, " h": -2.0},
    {"(": -0.40, ":": -0.61, "[": -3.2},
    {"x": -0.2, "y": -2.2, "a": -3.0},
    {"):": -0.05, ",": -3.5, ")": -4.0},
]
BASE = trace(BASE_TOKENS, BASE_TOPS)


def test_identical_traces_have_no_divergence():
    assert first_difference(BASE, trace(BASE_TOKENS)) is None
    assert classify(BASE, trace(BASE_TOKENS), texts_differ=False) is None


def test_first_difference_at_zero_outside_the_top_n_is_real():
    div = classify(BASE, trace(["print", "(", "x"]))
    assert div is not None and div.kind == "real" and div.position == 0
    assert div.baseline_token == "def" and div.other_token == "print"
    assert div.other_logprob is None and div.baseline_logprob == -0.01
    assert div.gap == pytest.approx(-0.01 - (-6.0))  # at least own - the lowest listed
    assert "not among the baseline's top 3" in div.reason
    assert div.baseline_next == tuple(BASE_TOKENS) and div.other_next == ("print", "(", "x")


def test_first_difference_in_the_middle_within_the_margin_is_a_near_tie():
    other = trace(["def", " f", ":", "\n"])
    assert first_difference(BASE, other) == 2
    div = classify(BASE, other)
    assert div is not None and div.kind == "near_tie" and div.position == 2
    assert (div.baseline_token, div.other_token) == ("(", ":")
    assert div.gap == pytest.approx(0.21) and div.margin == DEFAULT_NEAR_TIE_MARGIN
    assert div.baseline_next == ("(", "x", "):") and div.other_next == (":", "\n")


def test_a_listed_token_beyond_the_margin_is_real_and_the_margin_is_a_setting():
    other = trace(["def", " f", "[", "0"])
    div = classify(BASE, other)
    assert div is not None and div.kind == "real" and div.gap == pytest.approx(2.8)
    assert div.other_logprob == -3.2 and "> margin 0.5" in div.reason
    wide = classify(BASE, other, margin=3.0)
    assert wide is not None and wide.kind == "near_tie"
    narrow = classify(BASE, trace(["def", " f", ":"]), margin=0.2)  # gap 0.21 > 0.2
    assert narrow is not None and narrow.kind == "real"
    for bad in (-0.1, float("nan"), "0.5", True):
        with pytest.raises(ConfigError, match="near_tie_margin"):
            classify(BASE, other, margin=bad)


def test_first_difference_at_the_last_token():
    div = classify(BASE, trace(["def", " f", "(", "x", ","]))
    assert div is not None and div.position == 4 and div.kind == "real"  # gap 3.45
    assert div.gap == pytest.approx(3.45)
    assert div.baseline_next == ("):",) and div.other_next == (",",)


def test_one_output_a_prefix_of_the_other_is_real():
    shorter = classify(BASE, trace(BASE_TOKENS[:3]))
    assert shorter is not None and shorter.kind == "real" and shorter.position == 3
    assert shorter.other_token is None and shorter.baseline_token == "x" and "other run ended" in shorter.reason
    longer = classify(trace(BASE_TOKENS[:3], BASE_TOPS[:3]), trace(BASE_TOKENS))
    assert longer is not None and longer.kind == "real" and longer.position == 3
    assert longer.baseline_token is None and longer.other_token == "x" and "baseline ended" in longer.reason
    assert longer.baseline_next == () and longer.other_next == ("x", "):")


def test_ids_decide_when_both_traces_carry_them():
    # two different tokens that print the same string (a split UTF-8 sequence): equal by string, not by id
    base = trace(["a", "\ufffd"], [{"a": -0.1, "b": -3.0}, {"\ufffd": -0.3}], ids=[1, 7],
                 top_ids=[{"a": 1, "b": 2}, {"\ufffd": 7}])
    other = trace(["a", "\ufffd"], ids=[1, 8])
    assert first_difference(base, trace(["a", "\ufffd"])) is None
    assert first_difference(base, other) == 1
    div = classify(base, other)
    assert div is not None and div.kind == "real" and "not among" in div.reason


def test_a_baseline_without_log_probs_cannot_show_a_tie():
    div = classify(trace(BASE_TOKENS), trace(["def", " f", ":"]))
    assert div is not None and div.kind == "real" and "no log-probs" in div.reason


def test_equal_tokens_with_different_texts_are_reported():
    div = classify(BASE, trace(BASE_TOKENS), texts_differ=True)
    assert div is not None and div.kind == "real" and div.position is None


def test_trace_json_round_trip_and_bad_records():
    withids = trace(["a", "b"], [{"a": -0.1, "b": -2.0}, {"b": -0.2}], ids=[3, 4],
                    top_ids=[{"a": 3, "b": 4}, {"b": 4}])
    for t in (BASE, withids, trace(["x"])):
        assert TokenTrace.from_json(json.loads(json.dumps(t.to_json()))) == t
    with pytest.raises(ConfigError, match="3 entries for 2 tokens"):
        TokenTrace(("a", "b"), (1, 2, 3))
    with pytest.raises(ConfigError, match="malformed token trace"):
        TokenTrace.from_json({"tokens": ["a"], "top_logprobs": [[["a"]]]})


def _result(tasks: list[tuple[str, str, TokenTrace | None]]) -> dict:
    return {"schema": EVAL_SCHEMA, "tasks": [
        {"task_id": tid, "reason": "failed", "completion": text, "reasoning": None,
         "trace": None if tr is None else tr.to_json()} for tid, text, tr in tasks]}


def test_compare_with_baseline_counts_identical_near_tie_and_real(tmp_path, caplog):
    baseline = tmp_path / "ar.json"
    baseline.write_text(json.dumps(_result([("T/0", "def f(x):", BASE), ("T/1", "def f(x):", BASE),
                                            ("T/2", "def f(x):", BASE)])))
    run = _result([("T/0", "def f(x):", trace(BASE_TOKENS)), ("T/1", "def f:\n", trace(["def", " f", ":", "\n"])),
                   ("T/2", "def f[0", trace(["def", " f", "[", "0"])), ("T/9", "x", None)])
    with caplog.at_level(logging.WARNING, logger="ddtree.lab.humaneval"):
        lossless = compare_with_baseline(run, baseline)
    assert {k: lossless[k] for k in ("identical", "near_tie", "real", "compared", "verdict", "differing_tasks")} == {
        "identical": 1, "near_tie": 1, "real": 1, "compared": 3, "verdict": "failed",
        "differing_tasks": ["T/1", "T/2"]}
    assert [d["kind"] for d in lossless["divergences"]] == ["near_tie", "real"]
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("REAL DIVERGENCE in T/2 at token 2: baseline '(x):' (log-prob -0.4000) vs '[0' "
                           "(baseline log-prob -3.2000)")
    only_ties = compare_with_baseline(_result([("T/1", "def f:\n", trace(["def", " f", ":", "\n"]))]), baseline)
    assert only_ties["verdict"] == "near_ties" and only_ties["real"] == 0


def test_a_schema_1_baseline_is_read_and_its_differences_are_real(tmp_path):
    baseline = tmp_path / "old.json"
    baseline.write_text(json.dumps({"schema": "ddtree.eval.humaneval/1", "tasks": [
        {"task_id": "T/0", "reason": "failed", "completion": "a", "reasoning": None},
        {"task_id": "T/1", "reason": "failed", "completion": "b", "reasoning": None}]}))
    lossless = compare_with_baseline(_result([("T/0", "a", trace(["a"])), ("T/1", "c", trace(["c"]))]), baseline)
    assert (lossless["identical"], lossless["real"], lossless["verdict"]) == (1, 1, "failed")
    assert "no token trace" in lossless["divergences"][0]["reason"]
    baseline.write_text(json.dumps({"schema": "ddtree.bench.cell/1"}))
    with pytest.raises(ConfigError, match="not a humaneval result"):
        compare_with_baseline(_result([]), baseline)


def _with_logprobs(tokens: list[str], logprobs: list[float]) -> TokenTrace:
    return TokenTrace(tuple(tokens), None, tuple(logprobs))


def test_drift_of_the_same_tokens_log_probs_makes_a_tie_real():
    # position 2 is a near-tie by its gap (0.21); the other run's own log-probs of the shared tokens say whether it
    # computed the same distribution: within the margin (rounding) or not (a different computation)
    close = _with_logprobs(["def", " f", ":"], [-0.01, -0.5 + 1e-3, -0.61 - 2e-3])
    div = classify(BASE, close)
    assert div is not None and div.kind == "near_tie" and div.drift == pytest.approx(2e-3) and div.drift_position == 2
    drifted = _with_logprobs(["def", " f", ":"], [-0.01, -1.3, -0.61])  # token 1's log-prob moved by 0.8
    div = classify(BASE, drifted)
    assert div is not None and div.kind == "real" and div.drift == pytest.approx(0.8) and div.drift_position == 1
    assert "differ by 0.8 nats at token 1" in div.reason
    own = _with_logprobs(["def", " f", ":"], [-0.01, -0.5, -0.01])  # at k: its own token 0.6 more likely than AR's
    div = classify(BASE, own)
    assert div is not None and div.kind == "real" and div.drift_position == 2
    tied = TokenTrace(BASE.tokens[:2] + (":",), None, (-0.01, -0.5, -0.40 - 2e-3))
    exact_tie = TokenTrace(BASE.tokens, BASE.token_ids, BASE.logprobs, BASE.top[:2] + (
        (TopEntry("(", -0.40), TopEntry(":", -0.40)),) + BASE.top[3:])
    assert classify(exact_tie, tied, margin=1e-2).kind == "near_tie"  # gap 0, drift 2e-3 < 1e-2
    assert classify(exact_tie, tied, margin=1e-3).kind == "real"  # the fp32 margin: 2e-3 of drift is no rounding


def test_identical_outputs_whose_log_probs_drift_are_listed_but_pass(tmp_path, caplog):
    baseline = tmp_path / "ar.json"
    baseline.write_text(json.dumps(_result([("T/0", "def f(x):", BASE), ("T/1", "def f(x):", BASE)])))
    same = _with_logprobs(BASE_TOKENS, [-0.01, -0.5, -0.40, -0.2, -0.05 - 1e-4])
    moved = _with_logprobs(BASE_TOKENS, [-0.01, -0.5, -1.1, -0.2, -0.05])  # token 2: 0.7 nats off
    with caplog.at_level(logging.WARNING, logger="ddtree.lab.humaneval"):
        lossless = compare_with_baseline(_result([("T/0", "def f(x):", same), ("T/1", "def f(x):", moved)]),
                                         baseline)
    assert (lossless["identical"], lossless["verdict"]) == (2, "identical")
    assert lossless["drifting"] == [{"task_id": "T/1", "drift": pytest.approx(0.7), "position": 2}]
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("LOG-PROB DRIFT in T/1: identical output, but the runs' log-probs of token 2 differ")
