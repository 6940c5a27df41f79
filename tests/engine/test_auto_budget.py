"""budget "auto": the size chosen is the argmax of the stated objective, and auto never changes outputs.

References: the best tree of n nodes and its expected length by brute force (every prefix of a small vocabulary
enumerated, its probability a product of the drafter's marginals, sorted by hand), the objective evaluated from
those numbers and a random cost function with a plain loop; outputs against the plain full-recompute decoder.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from engine_helpers import emulate_graphs, plain_greedy

from ddtree import speculative
from ddtree.engine import GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine import auto_budget as ab
from ddtree.engine.cost_curve import make_curve
from ddtree.errors import InvalidRequestError
from ddtree.speculative import tree_select


def brute_expected(log_probs: torch.Tensor, n: int) -> float:
    """1 + the n largest prefix probabilities over every prefix of depth 1 .. L (probabilities as products)."""
    probs = log_probs.double().exp()  # [L, V]
    depths, vocab = probs.shape
    every = []
    for d in range(1, depths + 1):
        for path in itertools.product(range(vocab), repeat=d):
            every.append(math.prod(float(probs[i, t]) for i, t in enumerate(path)))
    every.sort(reverse=True)
    return 1.0 + sum(every[:n])


def brute_choice(curves, caps, opts, cost) -> int:
    """The plain loop the objective states: sum of each row's expected length at its size, over the round's time."""
    best, best_value = None, -1.0
    for b in sorted(opts):
        total = 0.0
        for curve, cap in zip(curves, caps, strict=True):
            size = b if cap is None else min(b, cap)
            total += 1.0 if size == 0 or not curve else curve[min(size, len(curve)) - 1]
        value = total / cost(b)
        if value > best_value:
            best, best_value = b, value
    return best


def test_candidates_and_widths_by_hand():
    assert ab.candidates(64) == (1, 3, 7, 15, 31, 63)
    assert ab.candidates(1) == (1,)
    assert ab.candidates(2) == (1,)
    assert ab.initial_budget((1, 3, 7, 15, 31, 63)) == 15
    assert ab.initial_budget((1, 3)) == 3
    assert ab.curve_width(7, (1, 3, 7, 15)) == 15
    assert ab.curve_width(8, (1, 3, 7, 15)) == 15
    assert ab.curve_width(15, (1, 3, 7, 15)) == 15  # the top reports its own size only
    assert ab.options((1, 3, 7, 15), 0) == (1, 3, 7, 15)
    assert ab.options((1, 3, 7, 15), 4) == (4, 7, 15)  # a fixed b4 row: the round is at least 4
    assert ab.options((1, 3, 7, 15), 0, zero=True) == (0, 1, 3, 7, 15)  # no tree as well
    assert ab.options((1, 3, 7, 15), 4, zero=True) == (4, 7, 15)  # not beside a fixed row that drafts


def test_worked_example_of_the_module_doc():
    rows = [ab.RowCurve((1.8, 1.9, 2.4, 2.45, 2.5, 2.55, 2.6))]
    cost = {1: 0.010, 3: 0.012, 7: 0.020}
    assert ab.choose_budget(rows, (1, 3, 7), cost.__getitem__) == 3


def test_expected_lengths_match_brute_force_on_random_drafts():
    gen = torch.Generator().manual_seed(0)
    for trial in range(12):
        depths, vocab = 1 + trial % 3, 3 + trial % 2
        logits = 3 * torch.randn(2, depths, vocab, generator=gen)
        width = min(sum(vocab ** d for d in range(1, depths + 1)), 12)
        trees = speculative.build_trees(logits, width, max_budget=width)
        curve = tree_select.expected_lengths(trees.scores)  # [R, W]
        for r in range(2):
            lp = torch.log_softmax(logits[r].double(), -1)
            for n in range(1, width + 1):
                assert curve[r, n - 1].item() == pytest.approx(brute_expected(lp, n), rel=1e-5, abs=1e-6)


def test_prefix_of_a_wide_tree_is_the_narrow_tree():
    gen = torch.Generator().manual_seed(1)
    logits = 2 * torch.randn(3, 4, 50, generator=gen)
    budget = torch.tensor([7, 3, 0])
    depth = torch.tensor([4, 2, 3])
    narrow = speculative.build_trees(logits, budget, max_budget=7, depth_limit=depth)
    wide = speculative.build_trees(logits, 15, max_budget=15, depth_limit=depth)
    cut = tree_select.prefix_trees(wide, 8, budget)
    for a, b in zip(narrow, cut, strict=True):
        assert torch.equal(a, b)


def test_choice_is_the_argmax_of_the_objective_against_brute_force():
    """Random drafts (expected lengths by enumeration), random fixed rows beside the auto ones, random cost curves
    on a random grid: the engine's choice equals the plain loop's argmax."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(2)
    cands = ab.candidates(15)  # 1, 3, 7, 15
    for trial in range(40):
        n_auto, n_fixed = rng.randint(1, 3), rng.randint(0, 2)
        curves = []
        for _ in range(n_auto + n_fixed):
            lp = torch.log_softmax(rng.uniform(0.5, 4) * torch.randn(2, 4, generator=gen).double(), -1)
            curves.append(tuple(brute_expected(lp, n) for n in range(1, rng.choice([3, 7, 15]) + 1)))
        caps = [None] * n_auto + [rng.choice([0, 2, 4, 7]) for _ in range(n_fixed)]
        floor = max((c for c in caps if c is not None), default=0)
        budgets = sorted(rng.sample(range(0, 20), 4))
        curve = make_curve("cpu", "random", (1, 8), tuple(budgets), (64, 512),
                           lambda r, b, k: rng.uniform(0.001, 0.02) + r * b * rng.uniform(1e-5, 1e-3) + k * 1e-6)
        rows = len(curves)
        cost = lambda b, curve=curve, rows=rows: curve.round_seconds(rows, b, 100 + b)  # noqa: E731
        opts = ab.options(cands, floor, zero=trial % 2 == 0)
        got = ab.choose_budget([ab.RowCurve(c, cap) for c, cap in zip(curves, caps, strict=True)], opts, cost)
        assert got == brute_choice(curves, caps, opts, cost), f"trial {trial}"


def test_hysteresis_keeps_the_previous_size_within_the_margin():
    rows = [ab.RowCurve((2.0, 2.0, 2.1))]
    cost = {1: 1.0, 3: 1.0}.__getitem__  # b3 is 5 % better than b1
    assert ab.choose_budget(rows, (1, 3), cost) == 3
    assert ab.choose_budget(rows, (1, 3), cost, previous=1, margin=0.10) == 1
    assert ab.choose_budget(rows, (1, 3), cost, previous=1, margin=0.01) == 3


def test_the_rounds_time_past_their_price_is_added_to_every_option(monkeypatch):
    """observe_period keeps a decayed mean of each round's period past its price; with OFFSET choose adds it to
    every option's price (at most halving a price), which can turn the choice to a larger tree: the brute-force
    argmax of the objective under the shifted prices."""
    monkeypatch.setattr(ab, "OFFSET", True)
    monkeypatch.setattr(ab, "ZERO", False)  # trees only here (no tree: test_no_tree_is_chosen_...)
    chooser = ab.AutoChooser(15)
    assert chooser.offset() == 0.0
    chooser.observe_period(0.030, 0.010, decay=0.5)
    chooser.observe_period(0.025, 0.015, decay=0.5)
    assert chooser.offset() == pytest.approx((0.5 * 0.020 + 0.010) / 1.5)
    rows = [_Row("a", ab.observed_update((), [1, 2, 3, 5, 9], 15), (1.0,) * 15)]  # commits 2, 4, 5, 6 at 1, 3, 7, 15
    cost = {1: 0.010, 3: 0.016, 7: 0.025, 15: 0.040}.__getitem__
    curve = ab.observed_curve(rows[0].auto_seen, (1.0,) * 15)

    def brute(off):
        prices = {b: max(cost(b) + off, 0.5 * cost(b)) for b in (1, 3, 7, 15)}
        return max(prices, key=lambda b: (curve[b - 1] / prices[b], -b))

    for off in (0.0, 0.005, 0.02, 0.1, -0.004, -1.0):
        chooser = ab.AutoChooser(15)
        if off:
            chooser.observe_period(0.05 + off, 0.05)
        assert chooser.choose(rows, cost) == (brute(off), brute(off)), off
    assert brute(0.0) == 3 and brute(0.1) == 15  # the offset moves the choice here
    monkeypatch.setattr(ab, "OFFSET", False)
    assert chooser.offset() == 0.0 and chooser.choose(rows, cost) == (3, 3)  # off: the curve's prices alone


def test_the_scheduler_prices_every_timed_auto_round(tiny_engine_factory, monkeypatch):
    """With OFFSET, each auto round read right after the round queued before it gives the chooser its period
    (positive) and the curve's price of its own rows, size and keys."""
    monkeypatch.setattr(ab, "OFFSET", True)
    calls = []
    real = ab.AutoChooser.observe_period
    monkeypatch.setattr(ab.AutoChooser, "observe_period",
                        lambda self, wall, priced, decay=None: calls.append((wall, priced))
                        or real(self, wall, priced, decay))
    engine = tiny_engine_factory(oracle=True)
    engine.cost_curve = hand_curve(8, 1e-5)
    prices = {engine.cost_curve.round_seconds(r, b, k) for r in range(1, 9) for b in (1, 3, 7, 15, 31)
              for k in range(1, 200)}
    engine.generate([GenerationRequest(prompt=p, tree=TreeSettings(budget="auto"),
                                       sampling=SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS])
    assert calls and all(wall > 0 and priced in prices for wall, priced in calls)
    assert engine._auto.overhead[1] > 0


def test_periods_with_prompt_work_or_a_gap_are_not_timed(monkeypatch):
    """Scheduler._time_auto_round times a round only when the round before it was the last one read and no prefill
    step or prompt chunk ran between them; fixed-budget rounds are not timed."""
    from types import SimpleNamespace

    from ddtree.engine.scheduler import Scheduler

    calls = []
    chooser = SimpleNamespace(observe_period=lambda wall, priced: calls.append(priced))
    sched = SimpleNamespace(_last_read=None, _steps_after={2}, cost_curve=hand_curve(8, 1e-3), graphs=None,
                            config=SimpleNamespace(max_batch=8), _auto=chooser)
    sched._priced_rows = lambda count: Scheduler._priced_rows(sched, count)
    monkeypatch.setattr(ab, "OFFSET", True)

    def read(seq, *, auto=True, riders=()):
        shape = SimpleNamespace(auto_width=15 if auto else 0, max_budget=7, kv_len=100, keeps_context=True)
        Scheduler._time_auto_round(sched, SimpleNamespace(seq=seq, shape=shape, states=[0, 0], riders=list(riders)))
        return len(calls)

    assert read(1) == 0  # nothing read before it
    assert read(2) == 1 and calls[0] == sched.cost_curve.round_seconds(2, 7, 100)
    assert read(3) == 1  # a prefill step was queued after round 2
    assert read(4, riders=["r"]) == 1  # a prompt chunk rode in it
    assert read(5, auto=False) == 1  # a fixed-budget round
    assert read(7) == 1  # round 6 was not read before it
    assert read(8) == 2 and sched._steps_after == set()
    monkeypatch.setattr(ab, "OFFSET", False)
    assert read(9) == 2  # off: nothing timed


def test_tuning_constants_are_read_when_used(monkeypatch):
    """benchmarks/auto_ab.py's variants set auto_budget's constants on the module between runs: each function must
    read them when called (a default argument bound at import kept the old value and ignored the variant)."""
    seen = ab.observed_update((), [1], 3)
    sur = (1.5, 1.8, 2.0)
    for name, value, call in [
        ("PRIOR_WEIGHT", 5.0, lambda: ab.observed_curve(seen, sur)),
        ("GAIN_DECAY", 0.5, lambda: ab.gain_update((2.0, 2.0), 3, 2.0)),
        ("GAIN_DECAY", 0.5, lambda: ab.observed_update(seen, [1], 3)),
        ("SMOOTHING", 0.9, lambda: ab.smoothed((2.0,), (3.0,))),
    ]:
        before = call()
        monkeypatch.setattr(ab, name, value)
        assert call() != before, name
        monkeypatch.undo()
    chooser = ab.AutoChooser(7)
    chooser.observe_period(0.02, 0.01)
    monkeypatch.setattr(ab, "GAIN_DECAY", 0.5)
    chooser.observe_period(0.02, 0.01)
    assert chooser.overhead == (0.5 * 0.01 + 0.01, 0.5 + 1.0)


def test_smoothing_and_the_prior_by_hand():
    assert ab.smoothed((), (2.0, 3.0)) == (2.0, 3.0)
    assert ab.smoothed((2.0, 4.0), (3.0, 5.0, 6.0), 0.5) == (2.5, 4.5, 6.0)
    assert ab.smoothed((2.0, 4.0, 5.0), (3.0,), 0.5) == (2.5,)  # older sizes are dropped
    assert ab.mean_curve([(2.0, 4.0), (3.0,), ()]) == (2.5,)


def test_budget_auto_is_validated():
    assert TreeSettings(budget="auto").validated(trained_block_size=8, max_block_size=8, max_budget=16).auto
    assert not TreeSettings(method="dflash", budget="auto").auto
    with pytest.raises(InvalidRequestError, match='budget must be an integer or "auto"') as err:
        TreeSettings(budget="best").validated(trained_block_size=8, max_block_size=8, max_budget=16)
    assert err.value.param == "budget"


# ---- the engine: outputs never change, sizes are recorded -----------------------------------------------------------

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self", "x",
           "    return '\\n'.join(lines)\n\n\ndef wrap(text, width=70, **kwargs):\n"]


def hand_curve(max_batch: int, per_node: float):
    """A made-up cost curve: 10 ms a round plus ``per_node`` seconds per verified token row."""
    return make_curve("cpu", "hand", (1, max_batch), (0, 1, 3, 7, 15, 31), (64, 1024),
                      lambda r, b, k: 0.010 + per_node * r * (b + 1) + 1e-7 * k)


@pytest.mark.parametrize("per_node", [1e-5, 2e-3], ids=["cheap-nodes", "dear-nodes"])
def test_auto_beside_fixed_rows_matches_the_plain_decoder(tiny_engine_factory, tiny_tokenizer, tiny_pair, per_node):
    """Auto rows share rounds with fixed rows of other budgets, a chain and AR (fp32, greedy): every output equals
    the plain decoder's; each auto row records its chosen sizes, every one at least the floor of the fixed rows."""
    engine = tiny_engine_factory(oracle=True)
    engine.cost_curve = hand_curve(8, per_node)
    target, _ = tiny_pair
    trees = [TreeSettings(budget="auto"), TreeSettings(budget="auto", topk=3), TreeSettings(budget=4),
             TreeSettings(method="dflash"), TreeSettings(method="ar"), TreeSettings(budget="auto", block_size=5),
             TreeSettings(budget=12), TreeSettings(budget="auto")]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(trees))]
    refs = {p: plain_greedy(target, tiny_tokenizer.encode(p), 32) for p in set(prompts)}
    outs = engine.generate([GenerationRequest(prompt=p, tree=t, sampling=SamplingParams(max_tokens=32, ignore_eos=True))
                            for p, t in zip(prompts, trees, strict=True)])
    for out, p, t in zip(outs, prompts, trees, strict=True):
        assert out.token_ids == refs[p], f"{t} differs from the plain decoder on {p!r}"
        if t.auto:
            sizes = out.stats.auto_budgets
            assert sum(sizes.values()) == out.stats.verify_rounds > 0
            assert all(b >= 1 for b in sizes)
            assert out.stats.to_dict()["mean_auto_budget"] == pytest.approx(out.stats.mean_auto_budget)
        else:
            assert out.stats.auto_budgets == {}


def test_auto_alone_follows_the_cost_of_nodes(tiny_engine_factory, tiny_tokenizer):
    """The same requests under a curve where nodes are nearly free and one where each costs more than a round:
    auto picks larger trees under the first (the objective's direction, not a number)."""
    means = {}
    for per_node in (1e-6, 5e-2):
        engine = tiny_engine_factory(oracle=True, noise=0.5)
        engine.cost_curve = hand_curve(8, per_node)
        outs = engine.generate([GenerationRequest(prompt=p, tree=TreeSettings(budget="auto"),
                                                  sampling=SamplingParams(max_tokens=24, ignore_eos=True))
                                for p in PROMPTS])
        means[per_node] = sum(o.stats.mean_auto_budget for o in outs) / len(outs)
    assert means[1e-6] > means[5e-2]


def test_auto_without_a_cost_curve_measures_one(tiny_engine_factory, tiny_tokenizer, tiny_pair, caplog):
    engine = tiny_engine_factory(max_batch=2, max_budget=7, default_tree=TreeSettings(budget="auto"))
    assert engine.cost_curve is None
    target, _ = tiny_pair
    with caplog.at_level("WARNING", logger="ddtree.engine"):
        out = engine.generate([GenerationRequest(prompt=PROMPTS[0],  # the engine's default tree: auto
                                                 sampling=SamplingParams(max_tokens=12, ignore_eos=True))])[0]
    assert out.token_ids == plain_greedy(target, tiny_tokenizer.encode(PROMPTS[0]), 12)
    assert "no cost curve" in caplog.text
    assert engine.cost_curve is not None and engine.cost_curve.budgets == (0, 1, 3, 7)  # 0: no tree (AR rounds)
    assert len(engine.cost_curve.context_seconds) == len(engine.cost_curve.rows) * len(engine.cost_curve.kv_lens)
    assert engine.cost_curve.rows == (1, 2)


def test_warmup_plans_every_auto_candidate_when_the_default_tree_is_auto():
    """With the default tree auto, the fast level holds the key of an auto round at every candidate and at no tree
    (budget 0, the block kept), every rows bucket and every length (the scheduler's shape, bucketed by graph_key)."""
    from ddtree.engine import EngineConfig
    from ddtree.engine.cuda_graphs import bucket_nodes, graph_key
    from ddtree.engine.round import RoundShape
    from ddtree.engine.warmup import plan_warmup

    config = EngineConfig(max_batch=4, max_len=200, max_budget=16, default_tree=TreeSettings(budget="auto"))
    cache_len = 240
    plan = set(plan_warmup(config, cache_len=cache_len, drafts=True, block_size=8, prefill_max_width=None).rounds)
    for b in (0, *ab.candidates(16)):  # no tree (ZERO), 1, 3, 7, 15
        width = ab.curve_width(bucket_nodes(b), ab.candidates(16))
        for rows in range(1, 5):
            for reach in (0, 50, cache_len - b - 9):
                shape = RoundShape(rows=rows, max_budget=b, block_size=8, kv_len=reach + b + 1,
                                   draft_kv_len=max(1, reach), greedy=True, filtered=False, contiguous=False,
                                   auto_width=width)
                assert graph_key(shape, max_rows=4, cache_len=cache_len) in plan, (b, rows, reach)
    fixed = EngineConfig(max_batch=4, max_len=200, max_budget=16)
    assert not any(s.auto_width for s in plan_warmup(fixed, cache_len=cache_len, drafts=True, block_size=8,
                                                     prefill_max_width=None).rounds)


def test_auto_uses_the_cost_curve_the_engine_config_names(tiny_engine_factory, tmp_path, caplog):
    """EngineConfig.cost_curve = a file: Engine.start loads it and auto divides by it (nothing measured)."""
    from ddtree.engine.cost_curve import save_curve

    path = save_curve(hand_curve(8, 1e-4), tmp_path / "curve.json")
    engine = tiny_engine_factory(cost_curve=str(path))
    with caplog.at_level("WARNING", logger="ddtree.engine"):
        out = engine.generate([GenerationRequest(prompt=PROMPTS[1], tree=TreeSettings(budget="auto"),
                                                 sampling=SamplingParams(max_tokens=8, ignore_eos=True))])[0]
    assert out.stats.auto_budgets and "no cost curve" not in caplog.text
    assert engine.prepare_auto().seconds == hand_curve(8, 1e-4).seconds


def test_rising_costs_by_hand():
    cost = {1: 0.02, 3: 0.01, 7: 0.03, 15: 0.025}.__getitem__  # a noisy curve: b1 dearer than b3, b7 than b15
    up = ab.rising(cost, (1, 3, 7, 15))
    assert [up(b) for b in (1, 3, 7, 15)] == [0.01, 0.01, 0.025, 0.025]  # each bounded by the larger trees


def test_calibration_by_hand():
    """Decayed sums of accepted and predicted draft tokens; the curve's draft part scaled by their ratio."""
    sums = ab.gain_update((0.0, 0.0), 3, 1.5, decay=0.5)  # 2 drafts accepted where 0.5 were predicted
    assert sums == (2.0, 0.5)
    assert ab.gain_update(sums, 1, 1.0) == sums  # AR-like rounds leave the sums alone
    sums = ab.gain_update(sums, 2, 1.5, decay=0.5)  # (1 + 1, 0.25 + 0.5)
    assert sums == (2.0, 0.75)
    assert ab.calibrated((1.5, 2.0), (3.0, 1.5)) == (2.0, 3.0)  # gain 2
    assert ab.calibrated((1.5,), (0.5, 0.5), prior=(4.0, 2.0)) == (2.0,)  # too little evidence: the prior's gain
    assert ab.calibrated((1.5,), (0.0, 0.0)) == (1.5,)  # nothing known: the surrogate itself
    assert ab.calibrated((2.0,), (100.0, 1.0)) == (21.0,)  # clamped at 20



@pytest.mark.parametrize("steps", [False, True], ids=["totals", "steps"])
def test_observed_lengths_equal_walking_every_smaller_tree(steps, monkeypatch):
    """The counterfactual a verified tree gives: for every m, what walking the tree of its first m nodes (the tree
    a build at budget m makes, ``prefix_trees``) against the same target choices commits, by ``walk_trees`` (kept
    per size, or as steps whose running sum it is)."""
    monkeypatch.setattr(ab, "STEPS", steps)
    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        rows, depths, vocab, width = 3, 2 + trial % 4, 4 + trial % 3, 15
        logits = 2 * torch.randn(rows, depths, vocab, generator=gen)
        trees = speculative.build_trees(logits, width, max_budget=width)
        # target choices that often follow the tree: a random node's token as its parent's choice, else random
        choices = torch.randint(0, vocab, (rows, width + 1), generator=gen)
        for r in range(rows):
            for i in range(1, width + 1):
                if trees.valid[r, i] and torch.rand((), generator=gen) < 0.6:
                    choices[r, trees.parents[r, i]] = trees.tokens[r, i]
        walk = speculative.walk_trees(trees, choices, depths)
        for r in range(rows):
            n = int(walk.num_accepted[r])
            seen = ab.observed_update((), walk.path[r, 1:n].tolist(), width)
            committed = 1.0  # the steps' running sum: what the tree of the first m nodes commits
            for m in range(1, width + 1):
                cut = tree_select.prefix_trees(trees, m + 1, torch.full((rows,), m))
                small = speculative.walk_trees(cut, choices[:, :m + 1], depths)
                committed = committed + seen[m - 1][0] if steps else seen[m - 1][0]
                assert seen[m - 1][1] == 1.0 and committed == float(small.num_accepted[r]), (trial, r, m)


def test_observed_curve_by_hand():
    seen = ab.observed_update((), [1, 4], 5, decay=0.5)  # sizes 1..5 commit 2, 2, 2, 3, 3
    assert seen == ((2.0, 1.0), (2.0, 1.0), (2.0, 1.0), (3.0, 1.0), (3.0, 1.0))
    seen = ab.observed_update(seen, [2], 3, decay=0.5)  # 1, 2, 2 at sizes 1..3; sizes 4, 5 only decay
    assert seen == ((2.0, 1.5), (3.0, 1.5), (3.0, 1.5), (1.5, 0.5), (1.5, 0.5))
    assert ab.evidence(seen, 3) == 1.5 and ab.evidence(seen, 6) == 0.0 and ab.evidence(seen, 0) == 0.0
    # each size blends its observations with the surrogate counted as one round, non-decreasing; past the sizes
    # observed the surrogate's increments
    sur = (1.2, 1.3, 1.4, 1.5, 1.6, 2.1, 2.6)
    assert ab.observed_curve(seen, sur, prior_weight=1.0) == pytest.approx(
        ((2.0 + 1.2) / 2.5, (3.0 + 1.3) / 2.5, (3.0 + 1.4) / 2.5, (1.5 + 1.5) / 1.5, (1.5 + 1.6) / 1.5,
         (1.5 + 1.6) / 1.5 + 0.5, (1.5 + 1.6) / 1.5 + 1.0))
    assert ab.observed_curve((), (1.5, 2.0)) == (1.5, 2.0)


def test_observed_steps_by_hand(monkeypatch):
    monkeypatch.setattr(ab, "STEPS", True)
    seen = ab.observed_update((), [1, 4], 5, decay=0.5)  # sizes 1..5 commit 2, 2, 2, 3, 3: steps 1, 0, 0, 1, 0
    assert seen == ((1.0, 1.0), (0.0, 1.0), (0.0, 1.0), (1.0, 1.0), (0.0, 1.0))
    seen = ab.observed_update(seen, [2], 3, decay=0.5)  # 1, 2, 2 at sizes 1..3: steps 0, 1, 0; sizes 4, 5 only decay
    assert seen == ((0.5, 1.5), (1.0, 1.5), (0.0, 1.5), (0.5, 0.5), (0.0, 0.5))
    # each size's step blends its observed steps with the surrogate's step counted as one round, summed from
    # E(0) = 1 (a negative step counts 0); past the sizes observed the surrogate's increments
    sur = (1.2, 1.3, 1.4, 1.5, 1.6, 2.1, 2.6)
    steps = [(0.5 + 0.2) / 2.5, (1.0 + 0.1) / 2.5, (0.0 + 0.1) / 2.5, (0.5 + 0.1) / 1.5, (0.0 + 0.1) / 1.5]
    curve = [1.0 + sum(steps[:m]) for m in range(1, 6)]
    assert ab.observed_curve(seen, sur, prior_weight=1.0) == pytest.approx((*curve, curve[-1] + 0.5, curve[-1] + 1.0))


@pytest.mark.parametrize("steps", [False, True], ids=["totals", "steps"])
def test_a_size_no_longer_verified_keeps_its_steps_on_the_fresh_lengths(steps, monkeypatch):
    """What STEPS changes: a row verified b15 while it accepted little (sizes 8..15 added one token a round), then
    b7 while it accepted more. As steps its E(15) is its fresh E(7) plus the old step from 7 to 15; as totals the
    old total at 15, which the fresh E(7) has overtaken: a curve flat past 7 that makes b15 look worthless."""
    monkeypatch.setattr(ab, "STEPS", steps)
    seen = ()
    for _ in range(10):
        seen = ab.observed_update(seen, [1, 9], 15)  # 2 at sizes 1..8, 3 from 9: the step from 7 to 15 is 1
    for _ in range(10):
        seen = ab.observed_update(seen, [1, 2, 3, 4], 7)  # 5 at sizes 4..7
    curve = ab.observed_curve(seen, (), prior_weight=0.0)
    old, new = sum(0.9 ** k for k in range(10, 20)), sum(0.9 ** k for k in range(10))  # the rounds' decayed weights
    assert curve[6] == pytest.approx((2 * old + 5 * new) / (old + new))  # above the old total at 15 (3)
    assert curve[14] - curve[6] == pytest.approx(1.0 if steps else 0.0)


def plain_observed_curve(seen, surrogate, prior_weight=1.0, steps=False):
    """The observed curve as its docstring states it, one size at a time: the oracle of the engine's loop. Totals:
    each size's blend, the running maximum; steps: each size's blended step (negative ones read 0) summed from
    E(0) = 1."""
    if not seen:
        return tuple(surrogate)

    def prior(m):  # the surrogate at size m + 1, held at its last value; E(0) = 1
        return 1.0 if m < 0 or not surrogate else float(surrogate[min(m, len(surrogate) - 1)])

    out, level = [], 1.0
    for m, (total, weight) in enumerate(seen):
        if steps:
            level += max(0.0, (total + prior_weight * (prior(m) - prior(m - 1))) / (weight + prior_weight))
        else:
            level = max(level, (total + prior_weight * prior(m)) / (weight + prior_weight))
        out.append(level)
    for m in range(len(seen), len(surrogate)):
        out.append(level + max(0.0, float(surrogate[m]) - float(surrogate[len(seen) - 1])))
    return tuple(out)


@pytest.mark.parametrize("steps", [False, True], ids=["totals", "steps"])
def test_observed_curve_equals_the_plain_loop_bit_for_bit(steps, monkeypatch):
    """Random observed lengths or steps (decayed sums and counts, some sizes poor) and surrogates shorter than, as
    long as and longer than them, empty, or falling: the engine's loop returns the plain loop's floats exactly."""
    monkeypatch.setattr(ab, "STEPS", steps)
    rng = random.Random(3)
    for _ in range(500):
        weights = [rng.uniform(0.05, 3) for _ in range(rng.randint(1, 31))]
        seen = tuple((rng.uniform(0, 1 if steps else 6) * w, w) for w in weights)
        n = rng.choice([0, 1, len(seen) // 2, len(seen), len(seen) + rng.randint(1, 16)])
        surrogate = tuple(sorted(rng.uniform(1, 6) for _ in range(n)))
        if surrogate and rng.random() < 0.2:
            surrogate = tuple(reversed(surrogate))
        w0 = rng.choice([0.5, 1.0, 2.0])
        assert ab.observed_curve(seen, surrogate, prior_weight=w0) == plain_observed_curve(seen, surrogate, w0, steps)


class _Row:
    """The parts of a RequestState AutoChooser reads."""

    def __init__(self, rid, seen, curve, auto=True, budget=0):
        self.request_id, self.auto_seen, self.auto_curve, self.auto_gain = rid, seen, curve, (0.0, 0.0)
        self.tree, self.budget = TreeSettings(budget="auto" if auto else budget), budget
        self.auto_cached = None
        self.auto_idle = 0


def test_a_rows_kept_curve_is_the_fresh_one_after_every_change():
    """AutoChooser.row_curve keeps a row's curve until one of its inputs changes: after each read round (seen,
    curve and gain replaced), and for a row whose own sums are too small, after the engine's prior gain changes,
    it must equal the curve computed from scratch; with nothing changed it is the kept object itself."""
    chooser = ab.AutoChooser(32)
    rows = [_Row(str(i), (), ()) for i in range(3)]
    rng = random.Random(0)

    def fresh(row):
        return ab.observed_curve(row.auto_seen, ab.calibrated(row.auto_curve, row.auto_gain, chooser.gain))

    rows[2].auto_curve = (1.5, 2.0, 2.2)  # row 2 is never read: its inputs stay, the engine's prior gain moves
    for _ in range(12):
        for row in rows[:2]:
            reported = sorted(1.0 + rng.random() * 3 for _ in range(15))
            chooser.read_row(row, rng.randint(1, 4), reported, list(range(8)), 7)
        for row in rows:
            first = chooser.row_curve(row)
            assert first == fresh(row)
            assert chooser.row_curve(row) is first  # unchanged inputs: the kept curve, not a new one
    assert rows[0].auto_gain[1] >= 1.0 and rows[2].auto_gain[1] < 1.0  # both kinds of row were exercised
    # the kept curve is really reused: a chooser that never kept one would return a new tuple each call
    calls = []
    real = ab.observed_curve
    ab.observed_curve = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        chooser.row_curve(rows[0])
        chooser.row_curve(rows[0])
    finally:
        ab.observed_curve = real
    assert calls == []


def test_a_size_one_round_made_look_poor_is_explored_again(monkeypatch):
    """A first round that accepted nothing at b15: the best is then b1, but b3's evidence is that one round; once
    it has decayed (about 11 rounds) b3 runs once, while its objective is within the slack of the best's."""
    monkeypatch.setattr(ab, "ZERO", False)  # trees only here (no tree: test_no_tree_is_chosen_...)
    chooser = ab.AutoChooser(64)
    cost = {1: 0.040, 3: 0.041, 7: 0.042, 15: 0.045, 31: 0.05, 63: 0.06}.__getitem__
    flat = (1.0,) * 31  # the surrogate: nothing beyond the root
    seen = ab.observed_update((), [], 15)  # the unlucky first round
    rows = [_Row("a", seen, flat)]
    assert chooser.choose(rows, cost) == (1, 1)  # b3's evidence is one round: no exploration yet
    for _ in range(11):  # rounds at b1 that accepted nothing
        seen = ab.observed_update(seen, [], 1)
    rows = [_Row("a", seen, flat)]
    assert ab.evidence(seen, 3) < ab.EXPLORE_EVIDENCE
    assert chooser.choose(rows, cost) == (3, 1)  # explored; the best stays b1 (the hysteresis keeps that)
    assert chooser.choose(rows, cost, explore=False) == (1, 1)  # a follow-up check never explores
    dear = {**{b: 0.04 for b in (1,)}, 3: 0.08, 7: 0.09, 15: 0.1, 31: 0.11, 63: 0.12}.__getitem__
    assert chooser.choose(rows, dear) == (1, 1)  # b3 would cost half the objective: not explored
    # a fifth dearer (as a 1024-row verify against a 512-row one at 64 in flight): beyond EXPLORE_SLACK, not explored
    fifth = {**{b: 0.04 for b in (1,)}, 3: 0.05, 7: 0.06, 15: 0.07, 31: 0.08, 63: 0.09}.__getitem__
    assert chooser.choose(rows, fifth) == (1, 1)


def test_auto_rounds_report_their_accepted_paths(tiny_engine_factory, monkeypatch):
    """What the scheduler reads from an auto round's result for the observed lengths: per row and round the
    accepted nodes' indices, increasing (ancestors first) and inside the verified tree, one per accepted draft
    token: over all rounds, 1 + their count sums to the tokens the rounds committed (the requests' acceptance
    histograms)."""
    seen = []
    real = ab.observed_update

    def spy(old, ranks, verified, decay=None):
        seen.append((list(ranks), verified))
        return real(old, ranks, verified, decay)

    monkeypatch.setattr(ab, "observed_update", spy)
    engine = tiny_engine_factory(oracle=True)
    engine.cost_curve = hand_curve(8, 1e-5)
    trees = [TreeSettings(budget="auto"), TreeSettings(budget="auto", topk=3), TreeSettings(budget="auto", block_size=5)]
    outs = engine.generate([GenerationRequest(prompt=PROMPTS[i], tree=t,
                                              sampling=SamplingParams(max_tokens=24, ignore_eos=True))
                            for i, t in enumerate(trees)])
    assert any(ranks for ranks, _ in seen)  # the oracle drafter's trees get accepted
    for ranks, verified in seen:
        assert ranks == sorted(set(ranks)) and all(1 <= r <= verified for r in ranks)
    committed = sum(k * c for o in outs for k, c in enumerate(o.stats.accept_hist))
    assert sum(1 + len(ranks) for ranks, _ in seen) == committed


def test_auto_measures_its_curve_only_while_no_round_is_in_flight(tiny_engine_factory, tiny_tokenizer, tiny_pair,
                                                                  monkeypatch):
    """With rounds queued ahead (overlap_rounds), the first auto choice that weighs a cost curve measures one on
    the round graphs, whose buffers a queued round's result lives in: it must wait until every queued round was
    read (a measurement from the follow-up check would overwrite them on CUDA). Counts rounds queued and read."""
    from ddtree.engine import scheduler as sch
    from ddtree.engine.engine import Engine

    outstanding = {"n": 0, "at_measure": [], "follow_ups": 0}
    real_queue, real_collect, real_follow, real_fallback = (Engine._queue, Engine._collect, Engine._follow_up,
                                                            sch.fallback_curve)

    def queue(self, *args, **kwargs):
        outstanding["n"] += 1
        return real_queue(self, *args, **kwargs)

    def collect(self, flight):
        outstanding["n"] -= 1
        return real_collect(self, flight)

    def follow(self, flight, *args):
        outstanding["follow_ups"] += 1
        return real_follow(self, flight, *args)

    def fallback(sched, cands):
        outstanding["at_measure"].append(outstanding["n"])
        return real_fallback(sched, cands)

    monkeypatch.setattr(Engine, "_queue", queue)
    monkeypatch.setattr(Engine, "_collect", collect)
    monkeypatch.setattr(Engine, "_follow_up", follow)
    monkeypatch.setattr(sch, "fallback_curve", fallback)
    engine = tiny_engine_factory(oracle=True, overlap_rounds=True, max_batch=2, max_budget=7,
                                 default_tree=TreeSettings(budget="auto"))
    assert engine.cost_curve is None
    target, _ = tiny_pair
    outs = engine.generate([GenerationRequest(prompt=p, sampling=SamplingParams(max_tokens=24, ignore_eos=True))
                            for p in PROMPTS[:1]])
    for p, out in zip(PROMPTS[:1], outs, strict=True):
        assert out.token_ids == plain_greedy(target, tiny_tokenizer.encode(p), 24)
    assert outstanding["at_measure"] == [0]
    assert outstanding["follow_ups"] > 0  # rounds were queued ahead once the curve was there


def test_follow_up_rounds_change_the_auto_size_on_the_device(tiny_engine_factory, tiny_tokenizer, tiny_pair,
                                                             monkeypatch):
    """With rounds queued ahead (overlap_rounds), a new auto size no longer waits for a host launch: the follow-up
    round sets it on the device (PackedRows.advanced). A chooser forced to cycle through b7, b15 and an exploration
    of b15 (best b7), beside a fixed b4 row and an AR row (fp32, greedy): outputs equal the plain decoder's,
    follow-ups were queued at a changed size, every queued round's auto rows carry its size, the fixed rows their
    own, and its curve width is its size's; the follow-up of an exploring round never explores; each read round is
    accounted at the size it ran (the sizes' counts are the rounds, the nodes its rows verified that size)."""
    from ddtree.engine.cuda_graphs import bucket_nodes
    from ddtree.engine.engine import Engine
    from ddtree.engine.round import LONG_FIELDS

    calls, asked = itertools.count(), []
    cycle = [(7, 7), (15, 15), (15, 7)]  # all above the fixed row's floor, as the options are; the last explores

    def choose(self, states, cost, explore=True):
        asked.append(explore)
        pick = cycle[next(calls) % 3]
        return pick if explore or pick[0] == pick[1] else (pick[1], pick[1])

    monkeypatch.setattr(ab.AutoChooser, "choose", choose)
    queued, follow_ups, verified_seen, reading, follow_explore = [], [], [], [], []
    real_queue, real_follow, real_collect, real_read, real_size = (
        Engine._queue, Engine._follow_up, Engine._collect, ab.AutoChooser.read_row, Engine._follow_size)

    def queue(self, states, rows, shape, *args, **kw):
        budgets = rows.longs[LONG_FIELDS.index("budget")].tolist()
        queued.append((shape, [(s.tree.auto, s.tree.method, b) for s, b in zip(states, budgets, strict=True)]))
        return real_queue(self, states, rows, shape, *args, **kw)

    def follow(self, flight, size, *args):
        out = real_follow(self, flight, size, *args)
        follow_ups.append((flight.shape.max_budget, size, out))
        return out

    def follow_size(self, flight):
        before = len(asked)
        out = real_size(self, flight)
        follow_explore.extend((flight.explores, e) for e in asked[before:])
        return out

    def collect(self, flight):
        reading[:] = [flight.shape.max_budget]
        return real_collect(self, flight)

    def read_row(self, state, committed, reported, path, verified):
        verified_seen.append((state.tree.auto, state.tree.method, verified, reading[0]))
        return real_read(self, state, committed, reported, path, verified)

    monkeypatch.setattr(Engine, "_queue", queue)
    monkeypatch.setattr(Engine, "_follow_up", follow)
    monkeypatch.setattr(Engine, "_follow_size", follow_size)
    monkeypatch.setattr(Engine, "_collect", collect)
    monkeypatch.setattr(ab.AutoChooser, "read_row", read_row)
    engine = tiny_engine_factory(oracle=True, overlap_rounds=True)
    engine.cost_curve = hand_curve(8, 1e-5)
    queued.clear()  # the engine's start-up round
    target, _ = tiny_pair
    trees = [TreeSettings(budget="auto"), TreeSettings(budget=4), TreeSettings(method="ar"),
             TreeSettings(budget="auto", topk=3)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(trees))]
    outs = engine.generate([GenerationRequest(prompt=p, tree=t, sampling=SamplingParams(max_tokens=40, ignore_eos=True))
                            for p, t in zip(prompts, trees, strict=True)])
    for out, p, t in zip(outs, prompts, trees, strict=True):
        assert out.token_ids == plain_greedy(target, tiny_tokenizer.encode(p), 40), f"{t} differs"
    assert any(old != size and out is not None and out.shape.max_budget == size for old, size, out in follow_ups), \
        "no follow-up round was queued at a changed auto size"
    assert any(flight_explores for flight_explores, _ in follow_explore), "no follow-up of an exploring round"
    for flight_explores, explore in follow_explore:
        assert explore == (not flight_explores)
    for shape, rows in queued:
        for auto, method, budget in rows:
            assert budget == (shape.max_budget if auto else 4 if method == "ddtree" else 0)
        if any(auto for auto, _, _ in rows):
            assert shape.auto_width == ab.curve_width(bucket_nodes(shape.max_budget), engine._auto.candidates)
    for out, t in zip(outs, trees, strict=True):
        if t.auto:
            assert set(out.stats.auto_budgets) == {7, 15}
            assert sum(out.stats.auto_budgets.values()) == out.stats.verify_rounds
    assert {size for *_, size in verified_seen} == {7, 15}
    for auto, method, verified, size in verified_seen:  # a read round's nodes are its own, not its follow-up's
        assert verified == (size if auto else 4 if method == "ddtree" else 0)


# ---- no tree (budget 0) ---------------------------------------------------------------------------------------------

def test_no_tree_is_chosen_where_no_tree_earns_its_cost_and_a_tree_comes_back(monkeypatch):
    """Rows whose trees commit nothing past the root: no tree (budget 0) is the argmax, as the brute force says.
    Rounds at 0 observe nothing: the rows' observed lengths stay as they were (read_idle counts the round), and once
    the rows have run PROBE_ROUNDS at 0 on average one round probes a tree: the initial size (b15), since the best
    tree by the objective (b1, a fifth below no tree's: far past the exploration's slack) would observe b1 alone.
    The probe's read ages the evidence from before the idle rounds by as many rounds, and a probe that commits more
    makes a tree the best again. Newcomers count from their first round. Beside a fixed row that drafts, or with
    ZERO off, 0 is no option."""
    chooser = ab.AutoChooser(15)
    cost = {0: 0.0100, 1: 0.0125, 3: 0.014, 4: 0.015, 7: 0.017, 15: 0.025}.__getitem__
    flat = (1.0,) * 15
    seen = ab.observed_update((), [], 3)  # a b3 round that accepted nothing
    rows = [_Row("a", seen, flat), _Row("b", seen, flat)]
    curves = [chooser.row_curve(r) for r in rows]
    assert brute_choice(curves, [None, None], (0, 1, 3, 7, 15), cost) == 0
    for _ in range(ab.PROBE_ROUNDS):
        assert chooser.choose(rows, cost) == (0, 0)
        for r in rows:
            chooser.read_idle(r)
    assert rows[0].auto_seen == seen  # nothing observed, nothing decayed
    assert chooser.choose(rows, cost) == (15, 0)  # the probe, at the initial size; the best stays no tree
    assert ab.probe_budget((1, 3, 7, 15), {1: 2.0, 3: 1.0, 7: 1.0, 15: 1.0}, chooser.candidates) == 15
    assert ab.probe_budget((1, 3, 7, 15, 31), {1: 1.0, 3: 1.0, 7: 1.0, 15: 1.0, 31: 2.0}, (1, 3, 7, 15, 31)) == 31
    assert ab.probe_budget((7, 15), {7: 2.0, 15: 1.0}, (1, 3, 7, 15)) == 15
    assert ab.probe_budget((31,), {31: 1.0}, (1, 3, 7, 15, 31)) == 31  # a floor above the initial size
    assert chooser.choose(rows, cost, explore=False) == (0, 0)  # a follow-up check never probes
    newcomer = _Row("c", (), ())  # joined at 0: no rounds counted yet, so the mean falls below PROBE_ROUNDS
    assert chooser.choose([*rows, newcomer], cost) == (0, 0)
    probe = (1.9, 2.5, 2.8, 2.9, 3.0, 3.0, 3.1, 3.1, 3.1, 3.1, 3.1, 3.1, 3.1, 3.1, 3.2)
    for r in rows:  # the b15 probe accepts three nodes (ranks 1, 2, 5)
        chooser.read_row(r, 4, probe, [0, 1, 2, 5], 15)
    age = ab.GAIN_DECAY ** ab.PROBE_ROUNDS
    want = ab.observed_update(tuple((t * age, w * age) for t, w in seen), [1, 2, 5], 15)
    assert [v for pair in rows[0].auto_seen for v in pair] == pytest.approx([v for pair in want for v in pair])  # the evidence from before the idle rounds aged by them
    assert rows[0].auto_idle == 0
    assert chooser.choose(rows, cost)[1] > 0  # a tree earns its cost again
    fixed = [_Row("a", seen, flat), _Row("d", (), (1.2, 1.3, 1.3, 1.3), auto=False, budget=4)]
    assert chooser.choose(fixed, cost)[1] >= 4
    monkeypatch.setattr(ab, "ZERO", False)
    assert ab.AutoChooser(15).choose([_Row("a", seen, flat)], cost) == (1, 1)


@pytest.mark.parametrize("overlap, graphs", [(True, False), (False, False), (True, True)],
                         ids=["follow-ups", "host-launches", "graphs"])
def test_rounds_at_budget_0_keep_outputs_and_the_drafters_context(tiny_engine_factory, tiny_tokenizer, tiny_pair,
                                                                   monkeypatch, overlap, graphs):
    """A chooser forced through no tree and trees (0, 0, 3, 0, 7, 1, ...) for auto rows beside an AR row (fp32,
    greedy, the real drafter; eager rounds, or CUDA graphs emulated on the CPU, whose budget-0 keys must not share
    a drafting key's draft stage): every output equals the plain decoder's; rounds at 0 draft nothing but keep the
    drafter's context (RoundShape.drafts off, keeps_context on), and when a request finishes its drafter context
    equals the one a prefill of its whole text writes (the reference: ModelRunner.prefill over prompt + output but
    the last token, in a fresh runner); its stats count the rounds at 0."""
    from ddtree.engine.engine import Engine
    from ddtree.engine.kernels import KernelSet
    from ddtree.engine.runner import ModelRunner, PrefillInputs

    cycle = itertools.cycle([0, 0, 3, 0, 7, 1, 0, 15])
    monkeypatch.setattr(ab.AutoChooser, "choose", lambda self, states, cost, explore=True: (next(cycle),) * 2)
    shapes, finished = [], {}
    real_queue, real_finish = Engine._queue, Engine._finish

    def queue(self, states, rows, shape, *args, **kw):
        shapes.append(shape)
        return real_queue(self, states, rows, shape, *args, **kw)

    def finish(self, state, reason, **kw):
        finished[state.request_id] = state.slot
        return real_finish(self, state, reason, **kw)

    monkeypatch.setattr(Engine, "_queue", queue)
    monkeypatch.setattr(Engine, "_finish", finish)
    engine = tiny_engine_factory(overlap_rounds=overlap, max_batch=4)
    if graphs:
        emulate_graphs(engine, monkeypatch, max_rows=4)
    engine.cost_curve = hand_curve(4, 1e-5)
    target, drafter = tiny_pair
    trees = [TreeSettings(budget="auto"), TreeSettings(method="ar"), TreeSettings(budget="auto", topk=2)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(trees))]
    outs = engine.generate([GenerationRequest(prompt=p, tree=t, request_id=f"r{i}",
                                              sampling=SamplingParams(max_tokens=36, ignore_eos=True))
                            for i, (p, t) in enumerate(zip(prompts, trees, strict=True))])
    auto_shapes = [s for s in shapes if s.auto_width]
    assert {s.max_budget for s in auto_shapes} >= {0, 3, 7}
    for s in auto_shapes:
        assert s.drafts == (s.max_budget > 0) and s.keeps_context
    if graphs:  # both kinds of key were captured, each with its own front (a draft graph only where it drafts)
        keys = list(engine.graphs.graphs)
        assert {k.max_budget == 0 for k in keys if k.auto_width} == {True, False}
        assert any(f.draft is None for f in engine.graphs.fronts.values())
        assert any(f.draft is not None for f in engine.graphs.fronts.values())
    reference = ModelRunner(target, drafter, slots=1, cache_len=128, kernels=KernelSet.torch())
    one = lambda v: torch.tensor([v])  # noqa: E731
    for i, (out, p, t) in enumerate(zip(outs, prompts, trees, strict=True)):
        prompt = tiny_tokenizer.encode(p)
        assert out.token_ids == plain_greedy(target, prompt, 36), f"{t} differs from the plain decoder"
        if not t.auto:
            continue
        assert out.stats.auto_budgets.get(0, 0) > 0 and sum(out.stats.auto_budgets.values()) == out.stats.verify_rounds
        text = prompt + out.token_ids[:-1]  # every token whose features the drafter has read
        reference.prefill(PrefillInputs(ids=torch.tensor([text]), slots=one(0), start=one(0), valid_len=one(len(text)),
                                        last_index=one(len(text) - 1), kv_len=len(text)))
        slot = finished[f"r{i}"]
        for got, want in ((engine.runner.drafter_cache.k, reference.drafter_cache.k),
                          (engine.runner.drafter_cache.v, reference.drafter_cache.v)):
            torch.testing.assert_close(got[:, slot, :, : len(text)], want[:, 0, :, : len(text)], rtol=1e-4, atol=1e-4)


def test_auto_leaves_no_tree_to_probe_a_tree_and_keeps_outputs(tiny_engine_factory, tiny_tokenizer, tiny_pair):
    """The real chooser under a curve where every node costs more than a round (a tree never pays on this
    drafter): auto runs most rounds at no tree, and still probes a tree now and then (rounds above 0 after the
    first), every output equal to the plain decoder's (fp32, greedy)."""
    engine = tiny_engine_factory(max_batch=4)
    engine.cost_curve = hand_curve(4, 5e-2)
    target, _ = tiny_pair
    outs = engine.generate([GenerationRequest(prompt=p, tree=TreeSettings(budget="auto"),
                                              sampling=SamplingParams(max_tokens=64, ignore_eos=True))
                            for p in PROMPTS[:2]])
    for out, p in zip(outs, PROMPTS, strict=False):
        assert out.token_ids == plain_greedy(target, tiny_tokenizer.encode(p), 64)
        sizes = out.stats.auto_budgets
        assert sizes.get(0, 0) > sum(n for b, n in sizes.items() if b > 0)  # mostly no tree
        trees = sum(n for b, n in sizes.items() if b > 0)
        assert trees >= 1 + (sizes[0] - 1) // (ab.PROBE_ROUNDS + 1)  # the first round, then a probe every 12


def test_logprobs_of_rounds_at_budget_0_equal_the_full_forward(tiny_engine_factory, tiny_tokenizer, tiny_pair,
                                                                monkeypatch):
    """A round at no tree commits one token a row and carries its log-probs in one column (RoundShape.commit_width,
    not the block's): a chooser forced through 0 and trees, requests asking for log-probs; every token's log-prob and
    top ones equal a full forward's (test_logprobs' reference), and the rounds at 0 really ran."""
    from test_logprobs import N_TOP, _check_against_reference

    cycle = itertools.cycle([0, 3, 0, 0, 7])
    monkeypatch.setattr(ab.AutoChooser, "choose", lambda self, states, cost, explore=True: (next(cycle),) * 2)
    engine = tiny_engine_factory(max_batch=4)
    engine.cost_curve = hand_curve(4, 1e-5)
    target, _ = tiny_pair
    outs = engine.generate([GenerationRequest(prompt=p, tree=TreeSettings(budget="auto"), sampling=SamplingParams(
        max_tokens=24, ignore_eos=True, logprobs=N_TOP)) for p in PROMPTS[:3]])
    for out in outs:
        assert out.stats.auto_budgets.get(0, 0) > 0
        _check_against_reference(target, out)


def test_min_tokens_holds_in_rounds_at_budget_0(tiny_engine_factory, monkeypatch):
    """min_tokens masks the banned ids at the root of a round at no tree as at every tree node: a chooser forced
    through 0 and trees, stop ids that end AR early without the mask (test_min_tokens' construction); auto's
    outputs and finish reasons equal AR's with min_tokens, and rounds at 0 ran."""
    from test_min_tokens import METHODS, MIN_TOKENS, _early_stop_ids, _requests

    engine = tiny_engine_factory(oracle=True, max_batch=4)
    engine.cost_curve = hand_curve(4, 1e-5)
    stops = _early_stop_ids(engine)
    ar = engine.generate(_requests(stops, METHODS[0], min_tokens=MIN_TOKENS))
    cycle = itertools.cycle([0, 0, 3, 0, 7])
    monkeypatch.setattr(ab.AutoChooser, "choose", lambda self, states, cost, explore=True: (next(cycle),) * 2)
    outs = engine.generate(_requests(stops, TreeSettings(budget="auto"), min_tokens=MIN_TOKENS))
    for out, base in zip(outs, ar, strict=True):
        assert len(out.token_ids) >= MIN_TOKENS
        assert out.token_ids == base.token_ids and out.finish_reason == base.finish_reason
    assert any(out.stats.auto_budgets.get(0, 0) for out in outs)


def test_no_tree_is_priced_by_the_curves_context_points(tiny_engine_factory, tiny_tokenizer, tiny_pair):
    """The same requests (the real drafter: its trees commit nothing past the root) under a curve whose AR point is
    cheap: auto runs most rounds at no tree; with context points (a round at 0 keeping the drafter's context) dearer
    than any tree, it runs none at 0. Outputs equal the plain decoder's either way."""
    base = hand_curve(4, 5e-2)
    dear = make_curve("cpu", "hand", base.rows, base.budgets, base.kv_lens, base.round_seconds,
                      context_seconds=tuple(10.0 for _ in base.rows for _ in base.kv_lens))
    target, _ = tiny_pair
    at_zero = {}
    for name, c in (("ar-point", base), ("dear-context", dear)):
        engine = tiny_engine_factory(max_batch=4)
        engine.cost_curve = c
        outs = engine.generate([GenerationRequest(prompt=p, tree=TreeSettings(budget="auto"),
                                                  sampling=SamplingParams(max_tokens=32, ignore_eos=True))
                                for p in PROMPTS[:2]])
        for out, p in zip(outs, PROMPTS, strict=False):
            assert out.token_ids == plain_greedy(target, tiny_tokenizer.encode(p), 32)
        at_zero[name] = sum(out.stats.auto_budgets.get(0, 0) for out in outs)
    assert at_zero["ar-point"] > 0 and at_zero["dear-context"] == 0
