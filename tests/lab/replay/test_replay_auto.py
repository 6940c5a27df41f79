"""Budget auto replayed (ddtree.lab.replay.auto): each anchor's expected lengths and accepted ranks against a
brute-force enumeration of prefixes, the closed loop at prices where the answer is known, and the engine's own auto
rounds, request for request and size for size."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
from test_replay import oracle_accepted, synthetic_trace

from ddtree.engine import auto_budget
from ddtree.engine.cost_curve import make_curve
from ddtree.errors import ConfigError
from ddtree.lab.replay import Trace, predict, record_trace
from ddtree.lab.replay.auto import AutoRounds, auto_anchors
from ddtree.lab.replay.throughput import closed_loop, predict_cells


def brute_prefixes(logp: list[list[float]], topk: int | None) -> list[tuple[float, tuple[int, ...]]]:
    """Every prefix of depth 1 .. L whose tokens are among each depth's top-k, best first (score = summed log-prob)."""
    allowed = [sorted(range(len(row)), key=lambda t: -row[t])[: topk or len(row)] for row in logp]
    out = []
    for d in range(1, len(logp) + 1):
        for path in itertools.product(*allowed[:d]):
            out.append((sum(logp[i][t] for i, t in enumerate(path)), path))
    return sorted(out, key=lambda p: -p[0])


def dense_rows(trace: Trace, a: int) -> list[list[float]]:
    dense = torch.full((trace.depth, trace.vocab_size), -math.inf)
    dense.scatter_(1, trace.top_ids[a].long(), trace.top_logprobs[a])
    return dense.tolist()


@pytest.mark.parametrize("seed, topk", [(0, None), (1, 2), (2, None)])
def test_anchors_match_a_brute_force_enumeration(seed, topk):
    """At every anchor and candidate size b: E(b) = 1 + the b best prefix probabilities, and a round at b commits
    what a brute-force DDTree of b nodes accepts against the continuation."""
    trace = synthetic_trace(seed=seed)
    anchors = auto_anchors(trace, max_budget=8, topk=topk)
    assert anchors.candidates == (1, 3, 7)
    for a in range(trace.anchor_seq.shape[0]):
        s, j = int(trace.anchor_seq[a]), int(trace.anchor_j[a])
        assert anchors.index[(s, j)] == a
        logp = dense_rows(trace, a)
        truth = trace.sequence(s)[1][j : j + trace.depth]
        prefixes = [p for p in brute_prefixes(logp, topk) if math.isfinite(p[0])]
        ranks = anchors.ranks[a]
        assert list(ranks) == sorted(ranks)
        for b in range(1, 8):
            want = 1.0 + sum(math.exp(score) for score, _ in prefixes[:b])
            assert anchors.expected[a][b - 1] == pytest.approx(want, rel=1e-5), (a, b)
            assert 1 + sum(1 for r in ranks if r <= b) == oracle_accepted(logp, truth, b, topk), (a, b)


def test_anchors_need_the_largest_candidates_tokens():
    full = synthetic_trace(vocab=8, top_m=8)
    cut = Trace(**{**full.__dict__, "top_m": 3, "top_ids": full.top_ids[..., :3].contiguous(),
                   "top_logprobs": full.top_logprobs[..., :3].contiguous()})
    auto_anchors(cut, max_budget=3)  # candidates 1, 3: within the top 3
    with pytest.raises(ConfigError, match="top_m >= 7"):
        auto_anchors(cut, max_budget=7)


def linear_curve(per_node: float, *, budgets=(0, 1, 3, 7), context: float = 0.0):
    """10 ms a round plus ``per_node`` seconds per verified row (root included), flat in the keys; its context
    points (no tree that keeps the drafter's context) ``context`` seconds above AR's."""
    rows, kvs = (1, 8), (1, 4096)
    return make_curve("cpu", "hand", rows, budgets, kvs, lambda r, b, k: 0.010 + per_node * r * (b + 1),
                      context_seconds=tuple(0.010 + per_node * r + context for r in rows for k in kvs))


def test_free_trees_replay_as_the_largest_fixed_budget(monkeypatch):
    """Trees that cost nothing more than a root: auto runs the largest candidate every round (its initial size
    is the largest up to 15, here 7), so it commits and costs exactly what the fixed budget 7 does."""
    trace = synthetic_trace(seed=3, max_tokens=20, sequences=4)
    anchors = auto_anchors(trace, max_budget=7)
    fixed = {p.setting.label: p for p in predict(trace, [7], baselines=False)}["ddtree-b7-knone"]
    curve = linear_curve(0.0)
    cells = predict_cells([], curve, depth=trace.depth, contexts=(2,), concurrency=(1, 4), num_requests=4,
                          max_tokens=20, auto=anchors)
    by_fixed = predict_cells([fixed], curve, depth=trace.depth, contexts=(2,), concurrency=(1, 4), num_requests=4,
                             max_tokens=20)
    for auto_cell, fixed_cell in zip(cells, by_fixed, strict=True):
        assert auto_cell.config == "ddtree-bauto-knone" and auto_cell.budget == "auto"
        assert auto_cell.auto_budgets == {7: fixed_cell.rounds if auto_cell.concurrency == 1 else
                                          sum(len(s["commits"]) for s in fixed.per_sequence)}
        assert auto_cell.tok_s == pytest.approx(fixed_cell.tok_s)
        assert auto_cell.accept_length == pytest.approx(fixed.accept_length)


def test_dear_trees_replay_as_ar_with_probes():
    """Every tree dearer than it can earn: after the first round (at the initial size) auto runs no tree, with one
    probe of a tree (at the initial size again) after every PROBE_ROUNDS rounds at 0."""
    trace = synthetic_trace(seed=4, max_tokens=40, sequences=1)
    anchors = auto_anchors(trace, max_budget=7)
    model = AutoRounds(anchors, [0])
    res = closed_loop(linear_curve(1.0), 1, model, context=2, concurrency=1, max_tokens=40)
    row = model.rows[0]
    sizes = [b for b in row.sizes for _ in range(row.sizes[b])]
    assert set(row.sizes) == {0, 7}  # the first round and the probes at the initial size (here the largest, 7)
    assert 2 <= row.sizes[7] <= 1 + (len(sizes) - 1) // (auto_budget.PROBE_ROUNDS + 1)
    assert res.rounds == res.row_rounds == len(row.commits) == sum(row.sizes.values())
    assert sum(row.commits) >= 39


@pytest.mark.slow
@pytest.mark.parametrize("per_node", [1e-5, 3e-5, 1e-4, 5e-2], ids=["cheap", "small", "mixed", "dear"])
def test_replay_equals_the_engines_auto_rounds(tiny_engine_factory, tmp_path, monkeypatch, per_node):
    """The engine serving budget auto over a cost curve, and replay's closed loop over the same curve and a trace of
    the same prompts: every request's sizes (round counts per budget) and per-round commits are the engine's.
    The curve is flat in the keys (the prompts differ in length; the loop gives every request one context), and
    rounds are launched from the host after each read (overlap_rounds off: follow-ups would choose a round early)."""
    from ddtree.engine.api import GenerationRequest, SamplingParams, TreeSettings

    prompts = ["def foo(x):\n    return", "x = [1, 2, 3]\n" * 4, "import os\nclass A:"]
    tokens = 48
    engine = tiny_engine_factory(max_len=512, max_budget=64, overlap_rounds=False)
    curve = linear_curve(per_node, budgets=(0, 1, 3, 7, 15, 31, 63), context=2e-4)
    trace = record_trace(engine, prompts, tokens, None, None, top_m=64)
    trace = Trace.load(trace.save(tmp_path / "trace.safetensors"))
    engine.cost_curve = curve
    held = engine._drain_inbox

    def drain_all_at_once() -> None:  # the closed loop admits every request of the first wave in one step
        while engine._inbox.qsize() < len(prompts) and not drained:
            time.sleep(0.001)
        drained.append(True)
        held()

    drained: list[bool] = []
    monkeypatch.setattr(engine, "_drain_inbox", drain_all_at_once)
    outs = engine.generate([GenerationRequest(prompt=text, tree=TreeSettings(budget="auto"),
                                              sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))
                            for text in prompts])
    model = AutoRounds(auto_anchors(trace, max_budget=64), range(len(prompts)))
    closed_loop(curve, len(prompts), model, context=8, concurrency=len(prompts), max_tokens=tokens)
    # a real check: the chooser moved between sizes (no tree among them where trees are dear) and rounds accepted
    assert len({b for o in outs for b in o.stats.auto_budgets}) >= (2 if per_node > 1e-3 else 3)
    assert sum(o.stats.completion_tokens for o in outs) > sum(o.stats.verify_rounds for o in outs)
    for out, row in zip(outs, model.rows, strict=True):
        assert out.stats.auto_budgets == row.sizes
        hist = [0] * (max(row.commits) + 1)
        for n in row.commits:
            hist[n] += 1
        assert out.stats.accept_hist == hist


def test_replay_cli_predicts_auto(tmp_path):
    import typer
    from typer.testing import CliRunner

    from ddtree.engine.cost_curve import save_curve
    from ddtree.lab.replay.cli import register
    from ddtree.lab.sweep.layout import read_json

    app = typer.Typer()
    register(app)
    trace = synthetic_trace().save(tmp_path / "t.safetensors")
    curve = save_curve(linear_curve(1e-4), tmp_path / "curve.json")
    args = ["replay", "predict", str(trace), "--budget", "3,auto", "--json", str(tmp_path / "p.json")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and "--budget auto needs --cost-curve" in str(result.exception)
    result = CliRunner().invoke(app, [*args, "--cost-curve", str(curve), "--contexts", "2", "--max-budget", "0"])
    assert result.exit_code != 0 and "max_budget must be >= 1, got 0" in str(result.exception)
    result = CliRunner().invoke(app, [*args, "--cost-curve", str(curve), "--concurrency", "1,2", "--contexts", "2",
                                      "--max-budget", "7"])
    assert result.exit_code == 0, result.output
    assert "ddtree-bauto-knone" in result.output
    cells = read_json(tmp_path / "p.tok_s.json")["cells"]
    auto = [c for c in cells if c["budget"] == "auto"]
    assert [c["concurrency"] for c in auto] == [1, 2]
    assert all(sum(c["auto_budgets"].values()) * c["accept_length"] == pytest.approx(2 * 20) for c in auto)


@pytest.mark.slow
def test_replay_curve_cli_times_no_trees_own_points(tmp_path):
    """`ddtree replay curve` on the demo pair: the file holds the context points budget auto prices no tree by, and
    the prefill points after a context replay prices later chunks by."""
    import typer
    from typer.testing import CliRunner

    from ddtree.engine.cost_curve import load_curve
    from ddtree.lab.replay.cli import register

    app = typer.Typer()
    register(app)

    def measured(name: str, *grid: str):
        out = tmp_path / name
        result = CliRunner().invoke(app, ["replay", "curve", "--device", "cpu", "--max-batch", "2", "--max-len",
                                          "256", "--max-budget", "16", "--warmup", "none", "--budgets", "0,3",
                                          "--repeats", "1", *grid, "--out", str(out)])
        assert result.exit_code == 0, result.output
        return load_curve(out)

    curve = measured("curve.json", "--rows", "1,2", "--kv-lens", "64", "--prefill-tokens", "none")
    assert curve.rows == (1, 2) and curve.budgets == (0, 3) and curve.kv_lens == (64,)
    assert len(curve.context_seconds) == 2 and all(s > 0 for s in curve.context_seconds)
    assert curve.round_seconds(1, 0, 64, keeps_context=True) == curve.context_seconds[0]
    # with prefill points, they are timed again after the longest keys, as the engine-start grid does
    curve = measured("curve2.json", "--rows", "1", "--kv-lens", "64,300", "--prefill-tokens", "16,32")
    assert curve.prefill_tokens == (16, 32) and curve.prefill_context == 300
    assert len(curve.prefill_context_seconds) == 2 and all(s > 0 for s in curve.prefill_context_seconds)
