"""Replay's predicted tok/s against hand computations: a small trace whose acceptance is known round by round, and
hand-made cost curves whose round times are known at every point."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree.engine.cost_curve import CostCurve, make_curve
from ddtree.errors import ConfigError
from ddtree.lab.replay import Trace, predict
from ddtree.lab.replay.throughput import (
    cell_sequences,
    curve_step_tokens,
    predict_cells,
    predicted_document,
    simulate_cell,
)

VOCAB, BLOCK, MAX_TOKENS = 4, 3, 5  # depth 2
CONT = [0, 1, 2, 3, 0, 1, 2]  # t_1 .. t_7 (max_tokens + depth)


def hand_trace() -> Trace:
    """Two sequences with prompt [1, 2]. Sequence 0's drafter is right at anchor t_1 (both depths: the chain commits
    3 tokens) and wrong at t_4 (1 token), so the chain commits [3, 1]; sequence 1's is always wrong: [1, 1, 1, 1]."""
    tokens, offsets, plens, ids, lps, seqs, js = [], [0], [], [], [], [], []
    for s in range(2):
        tokens += [1, 2] + CONT
        offsets.append(len(tokens))
        plens.append(2)
        for j in range(1, MAX_TOKENS):
            truth = CONT[j : j + 2]  # t_{j+1}, t_{j+2}
            right = s == 0 and j == 1
            rows = []
            for d in range(2):
                top = truth[d] if right else (truth[d] + 1) % VOCAB
                rest = [t for t in range(VOCAB) if t != top]
                rows.append([top, *rest])
            ids.append(torch.tensor(rows, dtype=torch.int32))
            lps.append(torch.log(torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 2)))
            seqs.append(s)
            js.append(j)
    return Trace(block_size=BLOCK, draft_window=None, max_tokens=MAX_TOKENS, top_m=VOCAB, vocab_size=VOCAB,
                 model="hand", tokens=torch.tensor(tokens), seq_offsets=torch.tensor(offsets),
                 prompt_lens=torch.tensor(plens), top_ids=torch.stack(ids), top_logprobs=torch.stack(lps),
                 anchor_seq=torch.tensor(seqs), anchor_j=torch.tensor(js))


def flat_curve(**kw) -> CostCurve:
    """seconds(rows, budget, kv_len) = 0.01 rows + 0.005 budget, the same at every kv_len."""
    return make_curve("cpu", "hand", (1, 2), (0, 2), (1, 100), lambda r, b, k: 0.01 * r + 0.005 * b, **kw)


def test_predicted_commits_are_the_hand_ones():
    preds = {p.setting.label: p for p in predict(hand_trace(), budgets=[], baselines=True)}
    assert [s["commits"] for s in preds["dflash"].per_sequence] == [[3, 1], [1, 1, 1, 1]]
    assert [s["commits"] for s in preds["ar"].per_sequence] == [[1, 1, 1, 1], [1, 1, 1, 1]]


def test_tok_s_equals_a_hand_computation():
    preds = predict(hand_trace(), budgets=[], baselines=True)
    cells = predict_cells(preds, flat_curve(), depth=2, contexts=(2,), concurrency=(1, 2), num_requests=2,
                          max_tokens=MAX_TOKENS, sequences={(2, 1): [0], (2, 2): [0, 1]})
    got = {(c.config, c.concurrency): c for c in cells}
    # chain, C=1, both requests replay sequence 0: 2 rounds each of 1 row at budget 2 = 0.01 + 0.01 s; 10 tokens
    assert got[("dflash", 1)].tok_s == pytest.approx(10 / (4 * 0.02))
    assert got[("dflash", 1)].rounds == 4
    # chain, C=2, sequences 0 and 1 together: 2 rounds of 2 rows (0.03 s), then sequence 1 alone for 2 (0.02 s)
    assert got[("dflash", 2)].tok_s == pytest.approx(10 / (2 * 0.03 + 2 * 0.02))
    assert got[("dflash", 2)].rounds == 4
    assert got[("dflash", 2)].accept_length == pytest.approx(10 / 6)
    # AR, C=2: 4 rounds of 2 rows at budget 0 (0.02 s)
    assert got[("ar", 2)].tok_s == pytest.approx(10 / (4 * 0.02))
    assert got[("ar", 1)].prefill_seconds == 0.0 and not got[("ar", 1)].extrapolated


def test_prefill_steps_are_added():
    preds = [p for p in predict(hand_trace(), budgets=[], baselines=True) if p.setting.method == "dflash"]
    curve = flat_curve(prefill_tokens=(1, 4), prefill_seconds=(0.001, 0.004))
    cells = predict_cells(preds, curve, depth=2, contexts=(2,), concurrency=(1, 2), num_requests=2,
                          max_tokens=MAX_TOKENS, sequences={(2, 1): [0], (2, 2): [0]})
    c1, c2 = cells
    # C=1: each request's 2-token prompt is one step of 0.002 s; C=2: one step of both prompts, 4 tokens, 0.004 s
    assert c1.prefill_seconds == pytest.approx(0.004) and c1.tok_s == pytest.approx(10 / (0.08 + 0.004))
    assert c2.prefill_seconds == pytest.approx(0.004) and c2.tok_s == pytest.approx(10 / (2 * 0.03 + 0.004))
    # a prefill chunk of 3 tokens and steps of 3 (the CPU default: the chunk): a second row would pad the step to
    # 2 x 16 tokens, so step 1 takes request 0's prompt alone (2 tokens, 0.002 s) and its first round runs alone
    # (1 row, 0.02 s); step 2 takes request 1's and both decode (0.03 s); then request 1 alone (0.02 s)
    round_s, prefill_s, rounds, _ = simulate_cell(curve, [[3, 1], [3, 1]], context=2, concurrency=2, max_tokens=5,
                                                  budget=2, prefill_chunk=3)
    assert prefill_s == pytest.approx(0.002 + 0.002)
    assert (round_s, rounds) == (pytest.approx(0.02 + 0.03 + 0.02), 3)
    # steps of 32 hold both (2 rows x 16 padded): one step of 2 rows x 2 tokens (0.004 s), then two rounds of both
    round_s, prefill_s, rounds, _ = simulate_cell(curve, [[3, 1], [3, 1]], context=2, concurrency=2, max_tokens=5,
                                                  budget=2, prefill_chunk=3, step_tokens=32)
    assert prefill_s == pytest.approx(0.004)
    assert (round_s, rounds) == (pytest.approx(0.03 + 0.03), 2)
    # unset, the step is the engine's default on the curve's device: the chunk on a CPU, 2048 on a GPU
    gpu = make_curve("NVIDIA H200", "hand", (1, 2), (0, 2), (1, 100), lambda r, b, k: 0.01 * r + 0.005 * b,
                     prefill_tokens=(1, 4), prefill_seconds=(0.001, 0.004))
    assert (curve_step_tokens(curve, 3, None), curve_step_tokens(gpu, 3, None), curve_step_tokens(gpu, 3, 8)) == (3, 2048, 8)
    assert simulate_cell(gpu, [[3, 1], [3, 1]], context=2, concurrency=2, max_tokens=5, budget=2,
                         prefill_chunk=3)[1] == pytest.approx(0.004)


def test_a_prompts_later_chunks_pay_for_its_earlier_keys():
    """A 10-token prompt in chunks of 4 at C = 1: chunks start after 0, 4 and 8 keys; with points after 8 keys
    (0.001 more a token-step at 4 tokens) they cost 0.004, 0.0045 and 0.005 (the last, 2 tokens: 0.002 + 0.001); two
    prompts in one step of 8 (2 rows x 4) pay for the mean of their chunks' offsets."""
    curve = flat_curve(prefill_tokens=(1, 4), prefill_seconds=(0.001, 0.004), prefill_context=8,
                       prefill_context_seconds=(0.002, 0.005))
    _, prefill_s, _, _ = simulate_cell(curve, [[1, 1]], context=10, concurrency=1, max_tokens=3, budget=2,
                                       prefill_chunk=4, step_tokens=4)
    assert prefill_s == pytest.approx(0.004 + (0.004 + 0.5 * 0.001) + (0.002 + 0.001))
    flat = flat_curve(prefill_tokens=(1, 4), prefill_seconds=(0.001, 0.004))
    assert simulate_cell(flat, [[1, 1]], context=10, concurrency=1, max_tokens=3, budget=2, prefill_chunk=4,
                         step_tokens=4)[1] == pytest.approx(0.004 + 0.004 + 0.002)
    # two 6-token prompts, chunk 3, steps of 32 (2 rows x 16 padded): steps take 3 + 3 (after 0) then 3 + 3 (after 3
    # keys each); a step of 6 tokens extrapolates along the last segment (0.006, after 8 keys 0.007)
    _, prefill_s, _, _ = simulate_cell(curve, [[1, 1], [1, 1]], context=6, concurrency=2, max_tokens=3, budget=2,
                                       prefill_chunk=3, step_tokens=32)
    assert prefill_s == pytest.approx(0.006 + (0.006 + 3 / 8 * 0.001))


def test_rounds_read_the_furthest_root():
    # seconds = 0.01 + 0.0001 kv_len; one request with a 10-token prompt: roots at positions 10 and 11, so an AR
    # verify reads 11 and 12 keys, a budget-4 one 15 and 16
    curve = make_curve("cpu", "hand", (1,), (0, 4), (1, 1001), lambda r, b, k: 0.01 + 0.0001 * k)
    round_s, prefill_s, rounds, extrapolated = simulate_cell(curve, [[1, 1]], context=10, concurrency=1,
                                                             max_tokens=3, budget=0)
    assert round_s == pytest.approx(0.0111 + 0.0112) and rounds == 2 and prefill_s == 0 and not extrapolated
    round_s, _, _, _ = simulate_cell(curve, [[1, 1]], context=10, concurrency=1, max_tokens=3, budget=4)
    assert round_s == pytest.approx(0.0115 + 0.0116)
    _, _, _, extrapolated = simulate_cell(curve, [[1, 1]], context=10, concurrency=2, max_tokens=3, budget=8)
    assert extrapolated


def test_errors_are_named():
    with pytest.raises(ConfigError, match="ends after"):
        simulate_cell(flat_curve(), [[1]], context=2, concurrency=1, max_tokens=5, budget=0)
    with pytest.raises(ConfigError, match="concurrency >= 1"):
        simulate_cell(flat_curve(), [[1]], context=2, concurrency=0, max_tokens=5, budget=0)


def test_cells_replay_their_own_prompts():
    trace_prompts = [[1, 2], [3, 4], [5, 6, 7]]
    got = cell_sequences(trace_prompts, {(2, 1): [[3, 4], [1, 2]], (3, 1): [[9, 9, 9]], (2, 4): [[8, 8]]})
    assert got == {(2, 1): [1, 0], (3, 1): [2], (2, 4): [0, 1]}


def test_the_document_round_trips_through_json():
    preds = predict(hand_trace(), budgets=[], baselines=True)
    cells = predict_cells(preds, flat_curve(), depth=2, contexts=(2,), concurrency=(1,), num_requests=1,
                          max_tokens=MAX_TOKENS)
    doc = json.loads(json.dumps(predicted_document(cells, curve=flat_curve(), curve_path="c.json",
                                                   trace=hand_trace().metadata(), prefill_chunk=512)))
    assert doc["schema"] == "ddtree.replay.tok_s/1" and not doc["prefill_modelled"]
    assert [c["config"] for c in doc["cells"]] == ["ar", "dflash"]


def test_predict_cli_writes_tok_s(tmp_path):
    import typer
    from typer.testing import CliRunner

    from ddtree.engine.cost_curve import save_curve
    from ddtree.lab.replay.cli import register

    app = typer.Typer()
    register(app)
    trace = hand_trace().save(tmp_path / "t.safetensors")
    curve = save_curve(flat_curve(), tmp_path / "c.json")
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, ["replay", "predict", str(trace), "--budget", "2", "--cost-curve", str(curve),
                                      "--contexts", "2", "--concurrency", "1,2", "--num-requests", "2",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "predicted tok/s" in result.output
    doc = json.loads((tmp_path / "p.tok_s.json").read_text())
    got = {(c["config"], c["concurrency"]): c["tok_s"] for c in doc["cells"]}
    # no --run: every request replays the trace's sequences in turn (0, 1): the chain at C=1 is 2 + 4 rounds of
    # 0.02 s for 10 tokens
    assert got[("dflash", 1)] == pytest.approx(10 / (6 * 0.02))
    result = CliRunner().invoke(app, ["replay", "predict", str(trace), "--run", str(tmp_path)])
    assert result.exit_code != 0 and "--run needs --cost-curve" in str(result.exception or result.output)


def test_each_repeat_is_its_own_run():
    preds = [p for p in predict(hand_trace(), budgets=[], baselines=True) if p.setting.method == "dflash"]
    (cell,) = predict_cells(preds, flat_curve(), depth=2, contexts=(2,), concurrency=(1,), num_requests=1,
                            max_tokens=MAX_TOKENS, sequences={(2, 1): [0, 1]})
    # two runs of one request: sequence 0 (2 rounds of 0.02 s) and sequence 1 (4 rounds); tok/s is their mean
    assert cell.tok_s == pytest.approx((5 / 0.04 + 5 / 0.08) / 2)
    assert cell.accept_length == pytest.approx(10 / 6) and cell.rounds == 6


def test_sweep_cells_are_the_manifest_ones_and_their_prompts_the_benchs(tmp_path, tiny_tokenizer):
    from ddtree.lab.bench.workload import build_prompts
    from ddtree.lab.replay.throughput import SweepCells
    from ddtree.lab.sweep.grid import SweepConfig
    from ddtree.lab.sweep.layout import RunLayout
    from ddtree.lab.sweep.manifest import Manifest

    config = SweepConfig(name="t", budgets=(4,), contexts=(24, 40), concurrency=(1, 2), output_tokens=8,
                         num_requests=3, repeats=2, seed=5)
    Manifest.open(RunLayout(tmp_path / "run"), config, {"mode": "inprocess", "engine_config": {"prefill_chunk": 128}},
                  resume=False)
    cells = SweepCells.from_run(tmp_path / "run")
    assert (cells.contexts, cells.concurrency, cells.output_tokens, cells.num_requests, cells.repeats,
            cells.prefill_chunk, cells.prefill_step_tokens, cells.max_budget) == (
        (24, 40), (1, 2), 8, {1: 3, 2: 3}, 2, 128, None, 64)  # max_budget: the engine's default
    Manifest.open(RunLayout(tmp_path / "run2"), config, {"mode": "inprocess", "engine_config": {
        "prefill_chunk": 128, "prefill_step_tokens": 1024, "max_budget": 16}}, resume=False)
    run2 = SweepCells.from_run(tmp_path / "run2")
    assert (run2.prefill_step_tokens, run2.max_budget) == (1024, 16)  # budget auto's sizes stop at 15 there
    prompts = cells.prompts(tiny_tokenizer)
    assert sorted(prompts) == [(24, 1), (24, 2), (40, 1), (40, 2)]
    assert all(len(v) == 6 and all(len(p) == ctx for p in v) for (ctx, _), v in prompts.items())
    # the bench's own prompts of the second repeat at (40, 2), in order
    bench = build_prompts(tiny_tokenizer, 40, 3, phase="r1-", seed=5, context=40, concurrency=2, text=cells.text)
    assert prompts[(40, 2)][3:] == [list(p.ids) for p in bench]
    with pytest.raises(ConfigError, match="no sweep manifest"):
        SweepCells.from_run(tmp_path / "absent")
