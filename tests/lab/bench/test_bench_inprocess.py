"""The in-process target of ``ddtree bench`` (``ddtree.lab.bench.inprocess``) on the CPU demo pair.

References: the engine's own results (every request's tokens, finish reason, rounds and its recorded submission,
first-token and finish times), the prompts as given, and hand arithmetic on those (tok/s is completion tokens over
the run's wall time; a closed loop of C never has more than C requests between submission and finish).
"""

from __future__ import annotations

import json

import pytest

from ddtree.engine import Engine, EngineConfig, TreeSettings
from ddtree.errors import ConfigError
from ddtree.lab.bench import (
    Workload,
    held_out_token_stream,
    prompts_for,
    run_cell,
    run_closed_loop,
    run_engine_bench,
)
from ddtree.lab.bench.inprocess import bench_requests, mean_in_flight, tree_from_extra_body

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def demo_engine():
    with Engine.from_config(EngineConfig(device="cpu", max_batch=2, max_len=256, max_budget=16,
                                         cuda_graphs=False)) as engine:
        yield engine


@pytest.fixture(scope="module")
def stream(demo_engine):
    return held_out_token_stream(demo_engine.tokenizer, 400)


def _in_flight_never_exceeds(timeline: list[list[float]], limit: int) -> None:
    events = sorted([(s, 1) for s, _, _ in timeline] + [(f, -1) for _, _, f in timeline], key=lambda e: (e[0], e[1]))
    in_flight = 0
    for _, step in events:
        in_flight += step
        assert in_flight <= limit


def test_held_out_prompts_are_exact_windows_of_the_stream(stream):
    prompts = prompts_for(stream, 24, 3, salt=7)
    assert [len(p) for p in prompts] == [24, 24, 24]
    step = (len(stream) - 24) // 3
    for i, p in enumerate(prompts):  # offsets by hand: (salt * 7919 + i * step) mod (len - context)
        off = (7 * 7919 + i * step) % (len(stream) - 24)
        assert p == stream[off : off + 24]
    assert len({tuple(p) for p in prompts}) == 3


def test_closed_loop_times_come_from_the_engine(demo_engine, stream):
    prompts = prompts_for(stream, 24, 4, salt=1)
    run = run_closed_loop(demo_engine, bench_requests(prompts, TreeSettings(method="ddtree", budget=4), NEW_TOKENS),
                          concurrency=2)
    assert [o.prompt_token_ids for o in run.outputs] == prompts  # request order kept
    for o in run.outputs:
        s = o.stats
        assert o.finish_reason == "length" and len(o.token_ids) == NEW_TOKENS == s.completion_tokens
        assert s.submitted_at is not None and run.t0 <= s.submitted_at
        assert s.submitted_at <= s.first_token_at <= s.finished_at <= run.t0 + run.wall_s
        assert "submitted_at" not in s.to_dict()  # a process-local clock stays out of responses
    submitted = [o.stats.submitted_at for o in run.outputs]
    assert submitted == sorted(submitted)  # submitted in order, one after another
    timeline = run.timeline()
    _in_flight_never_exceeds(timeline, 2)
    first_finish = min(o.stats.finished_at for o in run.outputs[:2])
    assert run.outputs[2].stats.submitted_at >= first_finish  # the third waits for a finish
    assert 0 < mean_in_flight(timeline, run.wall_s) <= 2.0


def test_run_cell_counts_tokens_and_time_as_stated(demo_engine, stream):
    prompts = prompts_for(stream, 32, 3, salt=2)
    tree = TreeSettings(method="ddtree", budget=4)
    cell = run_cell(demo_engine, prompts, tree, NEW_TOKENS, concurrency=1)
    assert [len(t) for t in cell["tokens"]] == [NEW_TOKENS] * 3 and cell["errors"] == []
    assert cell["tok_s"] == 3 * NEW_TOKENS / cell["wall_s"]
    assert len(cell["timeline"]) == 3
    for (_, _, f0), (s1, _, _) in zip(cell["timeline"], cell["timeline"][1:], strict=False):
        assert f0 <= s1 + 1e-3  # concurrency 1: one after another
    for s, first, f in cell["timeline"]:
        assert 0 <= s <= first <= f <= cell["wall_s"] + 1e-3
    # The tokens are the engine's: the same prompts through AR give the same greedy tokens (lossless).
    ar = run_cell(demo_engine, prompts, TreeSettings(method="ar"), NEW_TOKENS, concurrency=2)
    assert ar["tokens"] == cell["tokens"]
    # AR: the prefill gives the first token, then one verify round per token: 5 tokens in 4 rounds per request
    assert ar["accept_length"] == 3 * NEW_TOKENS / (3 * (NEW_TOKENS - 1))


def test_engine_bench_writes_the_cell_files_of_the_http_target(demo_engine, tmp_path):
    workload = Workload(contexts=(20,), concurrency=(1, 2), output_tokens=4, num_requests=3, warmup=False)
    cells = run_engine_bench(demo_engine, workload, out_dir=tmp_path, config={"budget": 4},
                             tree=TreeSettings(method="ddtree", budget=4), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ctx20-c1.json", "ctx20-c2.json"]
    for cell in cells:
        conc = cell["workload"]["concurrency"]
        assert json.loads((tmp_path / f"ctx20-c{conc}.json").read_text()) == cell
        assert cell["schema"] == "ddtree.bench.cell/1" and cell["workload"]["endpoint"] == "engine"
        assert cell["workload"]["prompt_lengths"] == [20, 20, 20]
        (run,) = cell["runs"]
        records = run["requests"]
        assert [r["completion_tokens"] for r in records] == [4, 4, 4]
        assert all(r["finish_reason"] == "length" and r["error"] is None for r in records)
        assert [r["submitted_s"] for r in records] == sorted(r["submitted_s"] for r in records)
        s = run["summary"]
        assert s["completed"] == 3 and s["errors"] == 0
        assert s["output_tok_s"] == 12 / s["duration_s"]
        rounds = sum(r["spec_verify_ct"] for r in records)
        assert s["accept_length"] == 12 / rounds and s["accept_source"] == "per_request"


def test_extra_body_tree_settings():
    assert tree_from_extra_body({}) is None
    assert tree_from_extra_body({"ddtree": {"budget": 8, "method": "ddtree"}}) == TreeSettings(budget=8)
    with pytest.raises(ConfigError, match="chat_template_kwargs"):
        tree_from_extra_body({"chat_template_kwargs": {}})


def test_an_auto_cell_reports_the_budgets_auto_chose(demo_engine, stream):
    """budget "auto" through run_cell: the same tokens as AR (lossless), and one chosen budget per verify round of
    every request (the engine's RequestStats.auto_budgets summed); a fixed budget reports none."""
    from ddtree.engine.auto_budget import candidates
    from ddtree.lab.bench.matrix import plan_cells

    prompts = prompts_for(stream, 32, 2, salt=3)
    cell = run_cell(demo_engine, prompts, TreeSettings(method="ddtree", budget="auto"), NEW_TOKENS, concurrency=2)
    ar = run_cell(demo_engine, prompts, TreeSettings(method="ar"), NEW_TOKENS, concurrency=2)
    assert cell["tokens"] == ar["tokens"] and cell["errors"] == []
    rounds = round(2 * NEW_TOKENS / cell["accept_length"])
    assert sum(cell["auto_budgets"].values()) == rounds
    assert set(cell["auto_budgets"]) <= {0, *candidates(16)}  # 0: no tree
    assert run_cell(demo_engine, prompts, TreeSettings(method="ddtree", budget=4), NEW_TOKENS)["auto_budgets"] == {}
    # the matrix plans auto last in every cell, and only when asked
    (_, _, methods), = plan_cells([64], [2], [4, 8], 4096, auto=True)
    assert methods == [("ar", 0), ("dflash", 0), ("ddtree", 4), ("ddtree", 8), ("ddtree", "auto")]
    (_, _, methods), = plan_cells([64], [2], [4, 8], 4096)
    assert ("ddtree", "auto") not in methods
    (_, _, methods), = plan_cells([64], [2], [4], 4096, auto=True, chain=False)
    assert methods == [("ar", 0), ("ddtree", 4), ("ddtree", "auto")]


def test_a_cell_can_mix_sampled_rows_with_greedy_ones(demo_engine, stream):
    """``temperatures``: one per prompt, 0 greedy; a sampled request is seeded by its index. The greedy rows of a
    mixed auto run still equal AR's greedy output (lossless beside sampled rows), the sampled ones run to length."""
    prompts = prompts_for(stream, 32, 4, salt=5)
    temps = [0.0, 1.0, 0.0, 0.7]
    reqs = bench_requests(prompts, TreeSettings(budget=4), NEW_TOKENS, temps)
    assert [(r.sampling.temperature, r.sampling.seed) for r in reqs] == [(0.0, None), (1.0, 1), (0.0, None), (0.7, 3)]
    assert all(r.sampling.temperature == 0.0 for r in bench_requests(prompts, TreeSettings(budget=4), NEW_TOKENS))
    mixed = run_cell(demo_engine, prompts, TreeSettings(method="ddtree", budget="auto"), NEW_TOKENS, concurrency=4,
                     temperatures=temps)
    ar = run_cell(demo_engine, prompts, TreeSettings(method="ar"), NEW_TOKENS, concurrency=4)
    assert mixed["errors"] == [] and [len(t) for t in mixed["tokens"]] == [NEW_TOKENS] * 4
    assert mixed["tokens"][0::2] == ar["tokens"][0::2]
