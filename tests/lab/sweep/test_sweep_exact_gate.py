"""The lossless gate on our own engine runs in exact mode (``SweepConfig.gate_exact``), where any difference from
AR is a real bug: the in-process sweep starts an exact engine for the gate (or uses its own when exact already),
a deliberately broken verify still fails the gate, ``--no-gate-exact`` keeps the classifier, and a near-tie
between two exact runs is reported as real.

References: the sweep's own AR gate outputs (byte-identical expected), the broken verify double of
``benchmarks/divergence_gate.py`` (tree node 1's position shifted by +1), and hand-built traces for the classifier.
"""

from __future__ import annotations

import json

import pytest
import torch
from lab_helpers import shifted_tree_positions

from ddtree import speculative
from ddtree.engine import Engine
from ddtree.lab.humaneval.lossless import compare_with_baseline
from ddtree.lab.sweep.grid import SweepConfig
from ddtree.lab.sweep.layout import RunLayout, read_json
from ddtree.lab.sweep.runner import SweepTarget, run_sweep

GATE = SweepConfig(name="gate", budgets=(6,), topks=(None,), contexts=(12,), concurrency=(1,), output_tokens=4,
                   num_requests=1, repeats=1, gate_tasks=("HumanEval/0", "HumanEval/23"), gate_max_tokens=16)


def _started_configs(monkeypatch) -> list:
    started = []
    original = Engine.start

    def start(self, *args, **kwargs):
        started.append(self.config)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "start", start)
    return started


@pytest.mark.slow
def test_the_gate_starts_an_exact_engine_and_every_config_is_identical(tiny_engine_factory, tmp_path, monkeypatch):
    engine = tiny_engine_factory(max_len=1024)  # the sweep's engine: default mode
    started = _started_configs(monkeypatch)
    outcome = run_sweep(GATE, SweepTarget(), tmp_path / "run", engine=engine, report=False)
    assert outcome.status == "finished" and outcome.cells_failed == 0
    assert [c.exact for c in started] == [True]  # one engine started for the gate, in exact mode
    layout = RunLayout(tmp_path / "run")
    ids = [p.config_id for p in GATE.points()]
    ar = read_json(layout.eval_path("ar"))
    assert ar["exact"] is True and ar["lossless"] is None
    for cid in ids[1:]:
        gate = read_json(layout.eval_path(cid))
        assert gate["exact"] is True and gate["lossless"]["exact"] is True, cid
        assert gate["lossless"]["identical"] == gate["lossless"]["compared"] == 2, cid


@pytest.fixture
def demo_exact_engine():
    """The demo pair (trained, so a wrong position changes its tokens; the random tiny pair's rarely do), fp32,
    already in exact mode."""
    from ddtree.assets import demo_drafter_path, demo_target_path
    from ddtree.engine import EngineConfig
    from ddtree.models import load_drafter, load_target, load_tokenizer

    tokenizer = load_tokenizer(demo_target_path())
    target = load_target(demo_target_path(), dtype=torch.float32, device="cpu")
    drafter = load_drafter(demo_drafter_path(), dtype=torch.float32, device="cpu")
    config = EngineConfig(max_batch=4, max_len=1024, max_budget=16, max_queue=64, exact=True)
    with Engine.from_models(target, drafter, tokenizer, config, model_name="demo") as engine:
        yield engine


@pytest.mark.slow
def test_a_broken_verify_fails_the_exact_gate(demo_exact_engine, tmp_path, monkeypatch):
    started = _started_configs(monkeypatch)
    monkeypatch.setattr(speculative, "tree_positions", shifted_tree_positions(1, 1))
    config = GATE.replace(methods=("ar", "ddtree"), gate_max_tokens=24)
    no_stop = SweepTarget(extra_body={"stop": ["\x00"]})  # whole answers of gate_max_tokens, as the bf16 study ran
    outcome = run_sweep(config, no_stop, tmp_path / "run", engine=demo_exact_engine, report=False)
    assert outcome.status == "finished" and started == []  # the sweep's engine is exact: the gate uses it
    gate = read_json(RunLayout(tmp_path / "run").eval_path("ddtree-b6-knone-bstrained-wnone"))
    lossless = gate["lossless"]
    assert gate["exact"] is True and lossless["exact"] is True
    assert lossless["verdict"] == "failed" and lossless["real"] >= 1 and lossless["near_tie"] == 0


@pytest.mark.slow
def test_no_gate_exact_keeps_the_sweep_engine_and_the_classifier(tiny_engine_factory, tmp_path, monkeypatch):
    engine = tiny_engine_factory(max_len=1024)
    started = _started_configs(monkeypatch)
    outcome = run_sweep(GATE.replace(gate_exact=False, methods=("ar", "ddtree")), SweepTarget(), tmp_path / "run",
                        engine=engine, report=False)
    assert outcome.status == "finished" and started == []
    gate = read_json(RunLayout(tmp_path / "run").eval_path("ddtree-b6-knone-bstrained-wnone"))
    assert gate["exact"] is False and gate["lossless"]["exact"] is False


def _result(task_tokens: list[str], exact: bool) -> dict:
    """A humaneval result of one task whose baseline top-2 at token 1 is a near-tie (0.01 nats apart)."""
    top = [[[task_tokens[0], -0.1], ["z", -3.0]], [["a", -0.70], ["b", -0.71]]]
    trace = {"tokens": task_tokens, "token_ids": None, "logprobs": [-0.1, -0.70 if task_tokens[1] == "a" else -0.71],
             "top_logprobs": top}
    return {"schema": "ddtree.eval.humaneval/2", "exact": exact,
            "tasks": [{"task_id": "T/0", "completion": "".join(task_tokens), "reasoning": None, "trace": trace}]}


def test_an_exact_gate_reports_a_near_tie_flip_as_real(tmp_path):
    baseline = tmp_path / "ar.json"
    baseline.write_text(json.dumps(_result(["x", "a"], exact=True)))
    other = _result(["x", "b"], exact=True)
    classified = compare_with_baseline(other, baseline)
    assert (classified["near_tie"], classified["real"], classified["verdict"]) == (1, 0, "near_ties")
    strict = compare_with_baseline(other, baseline, exact=True)
    assert (strict["near_tie"], strict["real"], strict["verdict"], strict["exact"]) == (0, 1, "failed", True)
    assert strict["divergences"][0]["position"] == 1 and "exact mode" in strict["divergences"][0]["reason"]
