"""budget "auto" as a sweep configuration: the flag and the config file parse it, the grid and the engine sizing
keep it, and the in-process backend measures the engine's cost curve before an auto config is timed."""

from __future__ import annotations

import pytest

from ddtree.engine import TreeSettings
from ddtree.errors import ConfigError
from ddtree.lab.sweep.cli import build_config
from ddtree.lab.sweep.grid import SweepConfig, SweepPoint, parse_budgets
from ddtree.lab.sweep.runner import sized_engine_config


def test_budget_flag_and_file_take_auto():
    assert parse_budgets("4,auto,16") == (4, "auto", 16)
    assert parse_budgets("auto") == ("auto",)
    with pytest.raises(ConfigError, match="budget"):
        parse_budgets("4,best")
    config = build_config(preset="demo", budgets="16,auto")
    assert config.budgets == (16, "auto")
    points = [p for p in config.points() if p.method == "ddtree"]
    assert [p.budget for p in points] == [16, "auto"]
    assert points[1].config_id == "ddtree-bauto-knone-bstrained-wnone"
    assert points[1].tree_settings()["budget"] == "auto"
    assert SweepPoint.from_dict(points[1].to_dict()) == points[1]
    from_file = SweepConfig.from_mapping({"grid": {"budget": [4, "auto"]}})
    assert from_file.budgets == (4, "auto")
    with pytest.raises(ConfigError, match="budget"):
        SweepConfig.from_mapping({"grid": {"budget": [4, "most"]}})


def test_engine_sizing_ignores_auto():
    assert sized_engine_config(build_config(preset="demo", budgets="auto")).max_budget == 64  # the default
    assert sized_engine_config(build_config(preset="demo", budgets="auto,100")).max_budget == 100


def test_prepare_auto_measures_on_the_running_engine_once(tiny_engine_factory):
    engine = tiny_engine_factory(max_batch=2, max_budget=3, default_tree=TreeSettings(budget=2))
    curve = engine.prepare_auto(timeout=120)
    assert curve.budgets == (0, 1, 3) and curve.rows == (1, 2)  # 0: no tree (AR rounds)
    assert all(s > 0 for s in curve.seconds)
    assert engine.prepare_auto() is curve  # measured once
