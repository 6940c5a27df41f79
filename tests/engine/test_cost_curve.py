"""The cost curve: interpolation against hand-computed values, the JSON file (round trip, corrupt files, atomic
writes, the cache), and the measurement on the demo pair (the declared grid, positive finite times; no timing
assertions)."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch

from ddtree import tuning
from ddtree.engine.config import EngineConfig
from ddtree.engine.cost_curve import (
    CostCurve,
    CostCurveError,
    cache_key,
    cached_curve,
    load_curve,
    save_curve,
)
from ddtree.engine.cost_measure import CostGrid, curve_at_start, measure_cost_curve, sample_points
from ddtree.engine.runner import PrefillInputs
from ddtree.errors import ConfigError

# rows (1, 4) x budgets (0, 8) x kv_lens (64, 576), in storage order [r][b][k]
SECONDS = (0.010, 0.030, 0.020, 0.050,   # rows 1: b0 (k64, k576), b8 (k64, k576)
           0.016, 0.040, 0.040, 0.080)   # rows 4


def curve(**kw) -> CostCurve:
    args = dict(device="cpu", model="demo", rows=(1, 4), budgets=(0, 8), kv_lens=(64, 576), seconds=SECONDS)
    args.update(kw)
    return CostCurve(**args)


@pytest.mark.parametrize(("point", "expected"), [
    ((4, 8, 576), 0.080),                      # a grid point
    ((1, 0, 320), 0.020),                      # half way along kv: (0.010 + 0.030) / 2
    ((4, 8, 320), 0.060),                      # (0.040 + 0.080) / 2
    ((2, 0, 64), 2 / 3 * 0.010 + 1 / 3 * 0.016),  # rows 1/3 of the way from 1 to 4
    ((2, 8, 320), 2 / 3 * (0.020 + 0.050) / 2 + 1 / 3 * (0.040 + 0.080) / 2),  # and half way along kv
    ((2, 4, 64), 2 / 3 * 0.020 + 1 / 3 * 0.040),  # b4 below the smallest drafting budget: b8's time, not toward AR
    ((1, 1, 576), 0.050),
    ((1, 0, 10), 0.010),                       # below the first kv point: the first point's value
    ((7, 0, 64), 0.022),                       # one more rows span past 4: 0.010 + 2 x (0.016 - 0.010)
    ((100, 0, 64), 0.022),                     # capped at that span, held flat past it
    ((1, 12, 64), 0.025),                      # budget 12: 0.010 + 1.5 x (0.020 - 0.010)
])
def test_interpolation_matches_hand_computed_values(point, expected):
    assert curve().round_seconds(*point) == pytest.approx(expected, rel=1e-12)


def test_drafting_budgets_interpolate_among_themselves():
    """Between two drafting budgets the curve is linear; below the smallest one it is that one's time (a drafting
    round pays the draft forward whatever its budget), where interpolating toward AR's point would make it cheap."""
    c = CostCurve("cpu", "m", rows=(1,), budgets=(0, 1, 3, 15), kv_lens=(64,), seconds=(0.005, 0.010, 0.012, 0.024))
    assert c.round_seconds(1, 0, 64) == pytest.approx(0.005)
    assert c.round_seconds(1, 1, 64) == pytest.approx(0.010)
    assert c.round_seconds(1, 2, 64) == pytest.approx(0.011)
    assert c.round_seconds(1, 7, 64) == pytest.approx(0.012 + 4 / 12 * 0.012)
    coarse = c.restricted(budgets=(0, 3, 15))
    assert coarse.budgets == (0, 3, 15) and coarse.seconds == (0.005, 0.012, 0.024)
    assert coarse.round_seconds(1, 1, 64) == pytest.approx(0.012)  # not 0.005 + (0.012 - 0.005) / 3
    assert c.restricted() == c
    with pytest.raises(CostCurveError, match=r"budgets \[7\] are not on the curve's axis"):
        c.restricted(budgets=(0, 7))


def test_restricted_picks_each_point_from_its_place_in_the_grid():
    c = curve()
    sub = c.restricted(rows=(4,), kv_lens=(576,))
    assert (sub.rows, sub.budgets, sub.kv_lens, sub.seconds) == ((4,), (0, 8), (576,), (0.040, 0.080))


def test_falling_slope_is_not_extrapolated_below_the_edge():
    falling = CostCurve("cpu", "m", rows=(1, 2), budgets=(0,), kv_lens=(64,), seconds=(0.020, 0.010))
    assert falling.round_seconds(2, 0, 64) == pytest.approx(0.010)
    assert falling.round_seconds(3, 0, 64) == pytest.approx(0.010)  # the last segment falls: held at the edge
    assert falling.round_seconds(1.5, 0, 64) == pytest.approx(0.015)


def test_covers_and_prefill_interpolation():
    c = curve(prefill_tokens=(64, 256), prefill_seconds=(0.01, 0.03))
    assert c.covers(2, 4, 100) and not c.covers(5, 4, 100) and not c.covers(1, 0, 10)
    assert c.prefill_step_seconds(160) == pytest.approx(0.02)
    assert c.prefill_step_seconds(10) == pytest.approx(0.01)
    assert curve().prefill_step_seconds(100) is None


def test_prefill_after_a_context_is_linear_in_its_keys():
    """prefill_context_seconds: a step after ``c`` keys costs the point at 0 plus ``c / prefill_context`` of the
    difference (hand values), followed one span past the points and held there, never below the points at 0; a
    curve without them prices every offset as position 0; bad arguments and counts are named."""
    c = curve(prefill_tokens=(64, 256), prefill_seconds=(0.01, 0.03), prefill_context=1000,
              prefill_context_seconds=(0.02, 0.05))
    assert c.prefill_step_seconds(64) == pytest.approx(0.01)
    assert c.prefill_step_seconds(64, 1000) == pytest.approx(0.02)
    assert c.prefill_step_seconds(64, 250) == pytest.approx(0.0125)
    assert c.prefill_step_seconds(160, 500) == pytest.approx(0.02 + 0.5 * (0.035 - 0.02))
    assert c.prefill_step_seconds(256, 2000) == pytest.approx(0.07)  # one more span
    assert c.prefill_step_seconds(256, 9000) == pytest.approx(0.07)  # and held
    plain = curve(prefill_tokens=(64, 256), prefill_seconds=(0.01, 0.03))
    assert plain.prefill_step_seconds(160, 5000) == plain.prefill_step_seconds(160) == pytest.approx(0.02)
    cheaper = curve(prefill_tokens=(64,), prefill_seconds=(0.02,), prefill_context=100, prefill_context_seconds=(0.01,))
    assert cheaper.prefill_step_seconds(64, 100) == pytest.approx(0.02)  # noise never makes context cheaper
    with pytest.raises(CostCurveError, match="context must be a number >= 0"):
        c.prefill_step_seconds(64, -1)
    with pytest.raises(CostCurveError, match="prefill_context must be an integer >= 1"):
        curve(prefill_tokens=(64,), prefill_seconds=(0.01,), prefill_context_seconds=(0.02,))
    with pytest.raises(CostCurveError, match=r"prefill_context_seconds must hold one value per prefill_tokens entry \(2\)"):
        curve(prefill_tokens=(64, 256), prefill_seconds=(0.01, 0.03), prefill_context=8, prefill_context_seconds=(0.02,))


def test_bad_arguments_are_named():
    with pytest.raises(CostCurveError, match="rows must be a number >= 1"):
        curve().round_seconds(0, 0, 64)
    with pytest.raises(CostCurveError, match="budget"):
        curve().round_seconds(1, -1, 64)


def test_context_points_price_no_tree_and_nothing_else():
    """context_seconds ([rows][kv_lens]): a round at budget 0 that keeps the drafter's context reads them with
    keeps_context, interpolated as the grid is; AR's point and the drafting budgets are unchanged; a curve without
    them prices that round at AR's point; restricted keeps the matching points; a wrong count is named."""
    plain = curve()
    c = curve(context_seconds=(0.012, 0.034, 0.019, 0.046))  # rows 1: k64, k576; rows 4
    assert c.round_seconds(1, 0, 64, keeps_context=True) == pytest.approx(0.012)
    assert c.round_seconds(4, 0, 320, keeps_context=True) == pytest.approx((0.019 + 0.046) / 2)
    assert c.round_seconds(2, 0, 64, keeps_context=True) == pytest.approx(2 / 3 * 0.012 + 1 / 3 * 0.019)
    for point in ((1, 0, 64), (2, 0, 320), (4, 8, 576), (2, 4, 64)):
        assert c.round_seconds(*point) == plain.round_seconds(*point)
        assert c.round_seconds(*point, keeps_context=point[1] > 0) == plain.round_seconds(*point)
    assert plain.round_seconds(1, 0, 64, keeps_context=True) == plain.round_seconds(1, 0, 64)
    sub = c.restricted(rows=(4,), kv_lens=(576,))
    assert sub.context_seconds == (0.046,) and sub.round_seconds(4, 0, 576, keeps_context=True) == 0.046
    with pytest.raises(CostCurveError, match="context_seconds"):
        curve(context_seconds=(0.01, 0.02, 0.03))


def test_json_round_trip(tmp_path):
    c = curve(repeats=3, measure_seconds=1.5, prefill_tokens=(16, 64), prefill_seconds=(0.001, 0.002),
              context_seconds=(0.012, 0.034, 0.019, 0.046), prefill_context=512, prefill_context_seconds=(0.002, 0.003))
    assert CostCurve.from_json(json.loads(json.dumps(c.to_json()))) == c
    path = save_curve(c, tmp_path / "sub" / "c.json")
    assert load_curve(path) == c
    assert curve().table()[1][1] == [0.040, 0.080]


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.update(seconds=d["seconds"][:-1]), r"2 x 2 x 2 = 8 values, got 7"),
    (lambda d: d["seconds"].__setitem__(5, -0.01), r"finite and > 0, got -0.01 at rows 4, budget 0, kv_len 576"),
    (lambda d: d["seconds"].__setitem__(0, float("nan")), r"finite and > 0, got nan at rows 1, budget 0, kv_len 64"),
    (lambda d: d.update(rows=[4, 1]), r"rows must be strictly increasing"),
    (lambda d: d.update(budgets=[0, 2.5]), r"budgets must hold integers >= 0"),
    (lambda d: d.pop("kv_lens"), r"lacks kv_lens"),
    (lambda d: d.update(schema="other/1"), r"schema must be 'ddtree.cost_curve/1'"),
    (lambda d: d.update(extra=1), r"unknown fields \['extra'\]"),
    (lambda d: d.update(device=""), r"device must be a non-empty string"),
    (lambda d: d.update(prefill_tokens=[16], prefill_seconds=[]), r"one value per prefill_tokens entry"),
    (lambda d: d.update(context_seconds=[0.01, -1.0, 0.01, 0.01]), r"context_seconds .*finite and > 0"),
    (lambda d: d.update(prefill_tokens=[16], prefill_seconds=[0.01], prefill_context=64,
                        prefill_context_seconds=[0.0]), r"prefill_context_seconds must be finite and > 0, got 0.0"),
])
def test_malformed_curves_get_clear_errors(tmp_path, mutate, message):
    data = curve().to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CostCurveError, match=message) as info:
        load_curve(path)
    assert str(path) in str(info.value)


def test_truncated_and_missing_files(tmp_path):
    path = save_curve(curve(), tmp_path / "c.json")
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(CostCurveError, match="not JSON"):
        load_curve(path)
    with pytest.raises(CostCurveError, match="cannot be read"):
        load_curve(tmp_path / "absent.json")
    assert isinstance(CostCurveError("x"), ConfigError)


def test_a_failing_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = save_curve(curve(), tmp_path / "c.json")
    before = path.read_bytes()

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        save_curve(curve(seconds=tuple(2 * s for s in SECONDS)), path)
    assert path.read_bytes() == before
    assert load_curve(path) == curve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]  # no temporary file left behind


def test_cache_measures_once_and_remeasures_a_corrupt_file(tmp_path, caplog):
    calls = []

    def measure():
        calls.append(1)
        return curve()

    key = cache_key("cpu", "demo", dtype="float32")
    assert key == cache_key("cpu", "demo", dtype="float32") != cache_key("cpu", "demo", dtype="bfloat16")
    c, path, source = cached_curve(key, measure, cache_dir=tmp_path)
    assert (source, len(calls), path) == ("measured", 1, tmp_path / f"{key}.json")
    c2, _, source = cached_curve(key, measure, cache_dir=tmp_path)
    assert (source, len(calls), c2) == ("cache", 1, c)
    path.write_text(path.read_text()[:40])
    with caplog.at_level(logging.WARNING, logger="ddtree.engine.cost_curve"):
        _, _, source = cached_curve(key, measure, cache_dir=tmp_path)
    assert (source, len(calls)) == ("measured", 2)
    assert "not JSON" in caplog.text and "measuring it again" in caplog.text
    assert load_curve(path) == curve()


def test_config_names_a_missing_curve_file(tmp_path):
    with pytest.raises(ConfigError, match="cost_curve"):
        EngineConfig(cost_curve=str(tmp_path / "absent.json")).validated()
    assert EngineConfig(cost_curve="auto").validated().cost_curve == "auto"


@pytest.fixture(scope="module")
def demo_engine():
    from ddtree.engine import Engine

    engine = Engine.from_config(EngineConfig(device="cpu", max_batch=2, max_len=256, max_budget=16, warmup="none"))
    yield engine
    engine.shutdown(drain_timeout=0)


@pytest.mark.slow
def test_measurement_on_the_demo_pair_covers_the_declared_grid(demo_engine):
    grid = CostGrid(rows=(1, 2), budgets=(0, 4), kv_lens=(16, 64), block_size=demo_engine.trained_block_size,
                    prefill_tokens=(16, 32), repeats=1, context=True, prefill_context=200)
    c = measure_cost_curve(demo_engine.runner, grid, graphs=demo_engine.parts.graphs, device_name="cpu",
                           model="demo")
    assert (c.rows, c.budgets, c.kv_lens, c.prefill_tokens) == ((1, 2), (0, 4), (16, 64), (16, 32))
    assert len(c.seconds) == 8 and len(c.prefill_seconds) == 2 and len(c.context_seconds) == 4
    assert c.prefill_context == 200 and len(c.prefill_context_seconds) == 2
    assert all(math.isfinite(s) and s > 0
               for s in c.seconds + c.prefill_seconds + c.context_seconds + c.prefill_context_seconds)
    assert c.measure_seconds > 0
    over = demo_engine.runner.target_cache.max_len - 31  # a 32-token step from there ends one past the cache
    with pytest.raises(CostCurveError, match=f"prefill_context {over} leaves no room for a 32-token prefill point"):
        measure_cost_curve(demo_engine.runner, CostGrid((1,), (0,), (16,), 16, prefill_tokens=(16, 32),
                                                        prefill_context=over), device_name="cpu", model="m")
    with pytest.raises(CostCurveError, match="prefill_context must be an integer >= 0, and 0 without"):
        CostGrid((1,), (0,), (16,), 16, prefill_context=64)
    # a grid the cache cannot hold is refused before anything runs
    with pytest.raises(CostCurveError, match="leaves no room"):
        measure_cost_curve(demo_engine.runner, CostGrid((1,), (0,), (10_000,), 16), device_name="cpu", model="m")
    with pytest.raises(CostCurveError, match="KV slots"):
        measure_cost_curve(demo_engine.runner, CostGrid((1, 5), (0,), (16,), 16), device_name="cpu", model="m")


@pytest.mark.slow
def test_round_graphs_keep_every_point_captured_through_the_passes(demo_engine):
    """Past the round graphs' LRU cap, passes over the grid in order would evict each key before its next use, and
    every timed round would include a capture: the measurement lifts the cap to hold the grid's keys, and puts it
    back after. A recording double stands in for the CUDA-only graphs (an LRU cache of keys, rounds run eagerly)."""
    from collections import OrderedDict

    from ddtree.engine.round import RoundInputs

    runner = demo_engine.runner

    class Graphs:
        def __init__(self):
            self.graphs, self.max_graphs, self.captures = OrderedDict(), 3, 0

        def can_run(self, rows):
            return True

        def key_for(self, shape):
            return (shape.rows, shape.max_budget, shape.kv_len)

        def run(self, packed, shape, timer):
            key = self.key_for(shape)
            if key in self.graphs:
                self.graphs.move_to_end(key)
            else:
                self.captures += 1
                self.graphs[key] = True
                while len(self.graphs) > self.max_graphs:
                    self.graphs.popitem(last=False)
            return runner.round(RoundInputs.from_packed(packed.to(runner.device), shape), timer), packed

    graphs = Graphs()
    grid = CostGrid(rows=(1, 2), budgets=(0, 4), kv_lens=(16, 64), block_size=demo_engine.trained_block_size,
                    repeats=2)
    measure_cost_curve(runner, grid, graphs=graphs, device_name="cpu", model="demo")
    assert graphs.captures == 8  # one per point (8 keys), none in the timed passes
    assert graphs.max_graphs == 3  # the cap as it was


@pytest.mark.slow
def test_prefill_points_replay_the_prefill_graphs_where_the_scheduler_would(demo_engine):
    """A prefill point goes through the engine's prefill graphs when they take that chunk (as the scheduler's
    prefill step does), else eagerly. A recording double stands in for the CUDA-only graphs: it takes chunks of at
    most 32 tokens and returns the eager prefill's logits."""
    runner = demo_engine.runner

    class Graphs:
        def __init__(self):
            self.asked, self.ran = [], []

        def can_run(self, rows, width, starts):
            self.asked.append((rows, width, tuple(starts)))
            return width <= 32

        def run(self, ids, slots, valid_len):
            self.ran.append((tuple(ids.shape), list(slots), list(valid_len)))
            one = lambda v: torch.tensor([v], dtype=torch.long)  # noqa: E731
            return runner.prefill(PrefillInputs(ids=ids, slots=one(slots[0]), start=one(0),
                                                valid_len=one(valid_len[0]), last_index=one(valid_len[0] - 1),
                                                kv_len=ids.shape[1]))

    graphs = Graphs()
    grid = CostGrid(rows=(1,), budgets=(0,), kv_lens=(16,), block_size=demo_engine.trained_block_size,
                    prefill_tokens=(16, 64), repeats=1)
    c = measure_cost_curve(runner, grid, prefill_graphs=graphs, device_name="cpu", model="demo")
    scratch = runner.target_cache.scratch_slot
    assert set(graphs.asked) == {(1, 16, (0,)), (1, 64, (0,))}
    assert graphs.ran == [((1, 16), [scratch], [16])] * 2  # the untimed pass and one timed; 64 tokens ran eagerly
    assert len(c.prefill_seconds) == 2 and all(s > 0 for s in c.prefill_seconds)


@pytest.mark.slow
def test_a_failing_prefill_graph_falls_back_to_eager_points(demo_engine, caplog):
    """A prefill graph that fails (a capture out of memory) is logged and the points are timed eagerly, as the
    scheduler then prefills: the measurement, and the engine start that runs it, do not fail."""
    class Failing:
        calls = 0

        def can_run(self, rows, width, starts):
            return True

        def run(self, ids, slots, valid_len):
            Failing.calls += 1
            raise RuntimeError("CUDA out of memory (test double)")

    grid = CostGrid(rows=(1,), budgets=(0,), kv_lens=(16,), block_size=demo_engine.trained_block_size,
                    prefill_tokens=(16, 32), repeats=2)
    with caplog.at_level(logging.ERROR, logger="ddtree.engine.cost_curve"):
        c = measure_cost_curve(demo_engine.runner, grid, prefill_graphs=Failing(), device_name="cpu", model="demo")
    assert Failing.calls == 1  # tried once, then every point eager
    assert len(c.prefill_seconds) == 2 and all(s > 0 for s in c.prefill_seconds)
    assert "prefill graph failed" in caplog.text


def test_sample_points_takes_whole_passes_and_the_grid_statistic():
    """One untimed round a point, then whole passes over the grid (not repeats in a row); "min" keeps the fastest,
    "median" the middle; a long point (its untimed round over long_round_s) is timed once, or not again at all
    where the untimed round counts (nothing captured)."""
    def runner(times):
        seen = []
        it = iter(times)

        def one_round(r, b, k):
            seen.append((r, b, k))
            return next(it)
        return one_round, seen

    points = [(1, 1, 64), (1, 3, 64)]
    run, seen = runner([0.9, 0.9, 0.5, 0.2, 0.3, 0.1, 0.4, 0.4])  # untimed, then 3 passes
    assert sample_points(points, run, repeats=3, long_round_s=math.inf, statistic="min", warm_counts=True) == [0.3, 0.1]
    assert seen == points * 4
    run, _ = runner([0.9, 0.9, 0.5, 0.2, 0.3, 0.1, 0.4, 0.4])
    assert sample_points(points, run, repeats=3, long_round_s=math.inf, statistic="median", warm_counts=True) == [
        0.4, 0.2]
    # the second point is long: timed once more (a capture happened in its untimed round), or kept as it was
    run, seen = runner([0.01, 0.9, 0.02, 0.5, 0.03])
    assert sample_points(points, run, repeats=2, long_round_s=0.05, statistic="median", warm_counts=False) == [
        0.025, 0.5]
    run, seen = runner([0.01, 0.9, 0.02, 0.03])
    assert sample_points(points, run, repeats=2, long_round_s=0.05, statistic="median", warm_counts=True) == [
        0.025, 0.9]
    with pytest.raises(CostCurveError, match="statistic"):
        CostGrid((1,), (0,), (16,), 16, statistic="mean")
    with pytest.raises(CostCurveError, match="slots"):
        CostGrid((1,), (0,), (16,), 16, slots="live")


@pytest.mark.slow
def test_scratch_measurement_leaves_live_slots_alone(demo_engine):
    """Budget auto's fallback measures while requests hold slots: with slots "scratch" every synthetic row, auto
    rounds included, writes only the scratch slot, and more rows than free slots are allowed."""
    import torch

    runner = demo_engine.runner
    caches = [runner.target_cache, runner.drafter_cache]
    for cache in caches:  # what live requests would hold there
        cache.k.normal_()
        cache.v.normal_()
    before = [(c.k[:, :runner.target_cache.scratch_slot].clone(), c.v[:, :runner.target_cache.scratch_slot].clone())
              for c in caches]
    grid = CostGrid(rows=(1, 3), budgets=(3, 7), kv_lens=(32,), block_size=demo_engine.trained_block_size, repeats=1,
                    long_round_s=math.inf, statistic="min", slots="scratch", auto_candidates=(1, 3, 7, 15))
    c = measure_cost_curve(runner, grid, device_name="cpu", model="demo")
    assert len(c.seconds) == 4 and all(s > 0 for s in c.seconds)
    for cache, (k, v) in zip(caches, before, strict=True):
        assert torch.equal(cache.k[:, :runner.target_cache.scratch_slot], k)
        assert torch.equal(cache.v[:, :runner.target_cache.scratch_slot], v)


@pytest.mark.slow
def test_engine_start_measures_caches_and_reports_the_curve(tiny_pair, tiny_tokenizer, tmp_path, monkeypatch):
    from dataclasses import replace

    from ddtree.engine import Engine

    target, drafter = tiny_pair
    config = EngineConfig(max_batch=2, max_len=128, max_budget=16, cost_curve="auto", warmup="none")
    engine = Engine.from_models(target, drafter, tiny_tokenizer, config, model_name="tiny")
    first = curve_at_start(engine.parts, cache_dir=tmp_path)
    assert first.source == "measured" and Path(first.path).parent == tmp_path
    assert first.curve.rows == (1, 2) and first.curve.budgets == (0, 1, 4, 16)  # no graphs: no node buckets
    assert len(first.curve.context_seconds) == len(first.curve.rows) * len(first.curve.kv_lens)
    assert all(s > 0 for s in first.curve.seconds)
    again = curve_at_start(engine.parts, cache_dir=tmp_path)
    assert again.source == "cache" and again.curve == first.curve
    # launches planned otherwise (tree attention's combine tile) cost otherwise: their curve is a file of its own
    monkeypatch.setattr(tuning, "COMBINE_BLOCK_D", 16)
    other = curve_at_start(engine.parts, cache_dir=tmp_path)
    assert other.source == "measured" and other.path != first.path
    monkeypatch.undo()
    # a named file is what Engine.start() reads, and info() says where the curve came from
    started = Engine.from_models(target, drafter, tiny_tokenizer, replace(config, cost_curve=first.path),
                                 model_name="tiny")
    assert started.info()["cost_curve"]["source"] == "off"
    started.start()
    try:
        info = started.info()["cost_curve"]
        assert (info["source"], info["path"], info["grid"]["rows"]) == ("file", first.path, [1, 2])
        assert info["grid"]["context_points"] is True
        assert info["grid"]["prefill_context"] == first.curve.prefill_context
        assert started.cost_curve_source.curve == first.curve
        assert started.cost_curve == first.curve  # what budget "auto" reads
    finally:
        started.shutdown(drain_timeout=0)


def test_default_grid_is_the_declared_one():
    from ddtree.engine.cost_measure import default_grid

    # graphs: every rows bucket and every node bucket auto chooses from, AR and max_budget
    g = default_grid(max_batch=16, max_budget=64, cache_len=4200, block_size=16, step_tokens=512)
    assert (g.rows, g.budgets, g.kv_lens, g.prefill_tokens) == ((1, 2, 4, 8, 16), (0, 1, 3, 7, 15, 31, 63, 64),
                                                                (64, 512, 4096), (16, 64, 256, 512))
    # the prefill points again after the longest keys, where the cache leaves room for the widest step
    assert g.prefill_context == 4096 - 512 + 104 == 4200 - 512
    assert default_grid(max_batch=4, max_budget=8, cache_len=9000, block_size=16, step_tokens=2048).prefill_context == 4096
    assert default_grid(max_batch=4, max_budget=8, cache_len=700, block_size=16, step_tokens=512).prefill_context == 0
    assert default_grid(max_batch=48, max_budget=32, cache_len=4200, block_size=16, step_tokens=512).rows == (
        1, 2, 4, 8, 16, 32, 48)
    g = default_grid(max_batch=64, max_budget=64, cache_len=700, block_size=16, step_tokens=512, buckets=False)
    # the tightest budget is 1: its 16-token draft block from a root at kv_len - 2 ends inside the cache
    assert (g.rows, g.budgets, g.kv_lens) == ((1, 4, 16, 64), (0, 1, 4, 16, 64), (64, 512, 700 - 16 + 1 - 1))
    assert default_grid(max_batch=3, max_budget=8, cache_len=300, block_size=None, step_tokens=128).budgets == (0,)
    # with a drafter, no tree's own points (budget auto's no tree: the drafter's context kept); without, none
    assert g.context and not default_grid(max_batch=3, max_budget=8, cache_len=300, block_size=None,
                                          step_tokens=128).context
