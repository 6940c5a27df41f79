"""Learning-rate schedule and step-count calibration."""

from __future__ import annotations

import json

import pytest

from ddtree.train.runtime import RunLog, StepPlan, calibrate_steps, lr_at


def test_warmup_is_linear_then_cosine_to_the_floor() -> None:
    lrs = [lr_at(s, peak=1.0, warmup=10, total=110, final_fraction=0.1) for s in range(110)]
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55)  # half-way through the decay: floor + half the range
    assert lr_at(110, peak=1.0, warmup=10, total=110, final_fraction=0.1) == pytest.approx(0.1)
    decay = lrs[10:]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))


def test_calibrate_steps_fits_the_remaining_budget() -> None:
    assert calibrate_steps(max_steps=1000, seconds_per_step=0.5, time_budget_s=60, elapsed_s=10) == 100
    assert calibrate_steps(max_steps=50, seconds_per_step=0.5, time_budget_s=60, elapsed_s=10) == 50
    assert calibrate_steps(max_steps=50, seconds_per_step=0.5, time_budget_s=None, elapsed_s=10) == 50
    assert calibrate_steps(max_steps=50, seconds_per_step=0.5, time_budget_s=5, elapsed_s=10) == 1


def test_step_plan_uses_the_median_after_the_first_step() -> None:
    plan = StepPlan(max_steps=10_000, time_budget_s=100.0, calibration_steps=4, overhead=1.0)
    for step, seconds in enumerate([5.0, 0.1, 0.3, 0.2], start=1):
        plan.observe(step, seconds, elapsed_s=6.0)
    assert plan.seconds_per_step == pytest.approx(0.2)
    assert plan.total == 4 + int(94.0 / 0.2)
    fixed = StepPlan(max_steps=7, time_budget_s=None, calibration_steps=2)
    fixed.observe(2, 1.0, elapsed_s=2.0)
    assert fixed.total == 7


def test_run_log_writes_settings_records_and_results(tmp_path) -> None:
    log = RunLog(tmp_path / "sub" / "log.json", "unit", {"a": 1})
    log.record(step=1, loss=2.0)
    log.results["done"] = True
    log.write()
    data = json.loads((tmp_path / "sub" / "log.json").read_text())
    assert data["kind"] == "unit" and data["settings"] == {"a": 1}
    assert data["records"][0]["step"] == 1 and "wall_s" in data["records"][0]
    assert data["results"] == {"done": True}
    assert "torch" in data["environment"]
