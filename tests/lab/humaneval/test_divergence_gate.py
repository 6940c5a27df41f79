"""The lossless gate end to end on the demo pair (fp32, CPU), through a real server: the healthy engine's tree
outputs equal AR's, a deliberately broken verify (one tree node's RoPE position shifted by +1) is reported as real
divergences, classified against the AR baseline's top log-probs with the fp32 margin.

The Codex stop sequences end the demo model's HumanEval answers after 2-3 tokens (it opens with ``\n#`` or
``\ndef``), so these requests replace them with a stop string that never occurs and compare 40 tokens per task.
With the demo model's flat distributions the bug's first differing token is often a near-tie by its gap alone;
the drift of the two runs' log-probs of the same tokens is what shows the broken verify computes something else."""

from __future__ import annotations

import logging

import pytest
import torch
from lab_helpers import ThreadedUvicorn, shifted_tree_positions

from ddtree import speculative
from ddtree.lab.client import BenchTarget
from ddtree.lab.humaneval import FP32_NEAR_TIE_MARGIN, GATE_TASKS, TOP_LOGPROBS, TokenTrace, run_humaneval

MAX_TOKENS = 40
NO_STOP = {"stop": ["\x00"]}


@pytest.fixture(scope="module")
def demo_server():
    from ddtree.assets import demo_drafter_path, demo_target_path
    from ddtree.engine import Engine, EngineConfig
    from ddtree.models import load_drafter, load_target, load_tokenizer
    from ddtree.server.app import create_app

    tokenizer = load_tokenizer(demo_target_path())
    target = load_target(demo_target_path(), dtype=torch.float32, device="cpu")
    drafter = load_drafter(demo_drafter_path(), dtype=torch.float32, device="cpu")
    config = EngineConfig(max_batch=4, max_len=1024, max_budget=32, max_queue=64)
    with Engine.from_models(target, drafter, tokenizer, config, model_name="demo") as engine:
        with ThreadedUvicorn(create_app(engine)) as server:
            yield server.url


def test_broken_verify_is_a_real_divergence_and_the_healthy_engine_is_identical(demo_server, tmp_path,
                                                                                  monkeypatch, caplog):
    baseline = tmp_path / "ar.json"
    tasks = list(GATE_TASKS)
    ar = run_humaneval(BenchTarget(url=demo_server, extra_body={"ddtree": {"method": "ar"}, **NO_STOP}), tasks=tasks,
                       limit=None, max_tokens=MAX_TOKENS, out=baseline, logprobs=TOP_LOGPROBS)
    assert ar["errors"] == 0 and ar["logprobs"] == TOP_LOGPROBS and ar["lossless"] is None
    for task in ar["tasks"]:  # every emitted token recorded, with the baseline's top-5 and the chosen one first
        tr = TokenTrace.from_json(task["trace"])
        assert tr.top is not None and tr.logprobs is not None and len(tr.tokens) == MAX_TOKENS
        assert "".join(tr.tokens).startswith(task["completion"])  # the text ends at the stop string
        for chosen, lp, entries in zip(tr.tokens, tr.logprobs, tr.top, strict=True):
            assert entries is not None and len(entries) in (TOP_LOGPROBS, TOP_LOGPROBS + 1)
            assert entries[0].token == chosen and entries[0].logprob == lp  # greedy: the chosen one is the top

    tree = {"ddtree": {"method": "ddtree", "budget": 16}, **NO_STOP}
    healthy = run_humaneval(BenchTarget(url=demo_server, extra_body=tree), tasks=tasks, limit=None,
                            max_tokens=MAX_TOKENS, out=None, baseline=baseline, logprobs=TOP_LOGPROBS,
                            near_tie_margin=FP32_NEAR_TIE_MARGIN)
    lossless = healthy["lossless"]
    assert (lossless["identical"], lossless["near_tie"], lossless["real"]) == (len(tasks), 0, 0)
    assert lossless["verdict"] == "identical" and lossless["divergences"] == lossless["drifting"] == []

    monkeypatch.setattr(speculative, "tree_positions", shifted_tree_positions(1, 1))
    with caplog.at_level(logging.WARNING, logger="ddtree.lab.humaneval"):
        broken = run_humaneval(BenchTarget(url=demo_server, extra_body=tree), tasks=tasks, limit=None,
                               max_tokens=MAX_TOKENS, out=None, baseline=baseline, logprobs=TOP_LOGPROBS,
                            near_tie_margin=FP32_NEAR_TIE_MARGIN)
    lossless = broken["lossless"]
    assert lossless["real"] == len(tasks) and lossless["verdict"] == "failed"  # every task parted from AR
    assert lossless["identical"] + lossless["near_tie"] + lossless["real"] == lossless["compared"] == len(tasks)
    real = [d for d in lossless["divergences"] if d["kind"] == "real"]
    by_task = {t["task_id"]: t for t in ar["tasks"]}
    for d in real:  # the reported spot is where the two token sequences part, with the baseline's own log-prob
        base = TokenTrace.from_json(by_task[d["task_id"]]["trace"])
        assert d["baseline_token"] == base.tokens[d["position"]] and d["other_token"] != d["baseline_token"]
        assert d["baseline_logprob"] == base.logprobs[d["position"]]
        assert (d["gap"] is None or d["gap"] > d["margin"]) or d["drift"] > d["margin"]
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("REAL DIVERGENCE")]
    assert len(warnings) == len(real) and all(f"in {d['task_id']} at token {d['position']}" in w
                                              for d, w in zip(real, warnings, strict=True))
