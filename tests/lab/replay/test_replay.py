"""Replay: predictions against a brute-force oracle on hand-made traces, and against the engine's own rounds."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from typer.testing import CliRunner

from ddtree.errors import ConfigError
from ddtree.lab.replay import Trace, predict, record_trace
from ddtree.lab.replay.predict import Setting


def synthetic_trace(*, vocab=6, block_size=4, top_m=6, max_tokens=20, sequences=2, seed=0) -> Trace:
    """Random drafter marginals that often favour the true next token, over a random continuation."""
    gen = torch.Generator().manual_seed(seed)
    depth = block_size - 1
    tokens, offsets, plens, ids, lps, seqs, js = [], [0], [], [], [], [], []
    for s in range(sequences):
        prompt = [1, 2]
        cont = torch.randint(0, vocab, (max_tokens + depth,), generator=gen).tolist()
        tokens += prompt + cont
        offsets.append(len(tokens))
        plens.append(len(prompt))
        for j in range(1, max_tokens):
            logits = 1.5 * torch.randn(depth, vocab, generator=gen)
            for d in range(depth):
                if torch.rand(1, generator=gen).item() < 0.6:
                    logits[d, cont[j + d]] += 3.0  # the true t_{j+d+1} (cont is 0-based: t_1 = cont[0])
            logp = torch.log_softmax(logits, -1)
            vals, idx = torch.topk(logp, top_m, -1)
            ids.append(idx.to(torch.int32))
            lps.append(vals)
            seqs.append(s)
            js.append(j)
    return Trace(
        block_size=block_size, draft_window=None, max_tokens=max_tokens, top_m=top_m, vocab_size=vocab, model="synthetic",
        tokens=torch.tensor(tokens), seq_offsets=torch.tensor(offsets), prompt_lens=torch.tensor(plens),
        top_ids=torch.stack(ids), top_logprobs=torch.stack(lps), anchor_seq=torch.tensor(seqs),
        anchor_j=torch.tensor(js),
    )


def oracle_accepted(logp: list[list[float]], truth: list[int], budget: int, topk: int | None) -> int:
    """Plain-Python DDTree: every prefix scored, the best ``budget`` kept, the longest one matching ``truth``."""
    depth, vocab = len(logp), len(logp[0])
    allowed = []
    for row in logp:
        ranked = sorted(range(vocab), key=lambda t: -row[t])
        allowed.append(ranked[: topk or vocab])
    prefixes = []
    for d in range(1, depth + 1):
        for path in itertools.product(*allowed[:d]):
            prefixes.append((sum(logp[i][t] for i, t in enumerate(path)), path))
    prefixes.sort(key=lambda p: -p[0])
    chosen = {path for score, path in prefixes[:budget] if math.isfinite(score)}
    matched = 0
    while matched < depth and tuple(truth[: matched + 1]) in chosen:
        matched += 1
    return matched + 1  # the bonus token


def oracle_replay(trace: Trace, setting: Setting) -> list[list[int]]:
    """Per-sequence accept_hist by stepping through the continuation round by round."""
    hists = []
    for s in range(trace.num_sequences):
        _, cont = trace.sequence(s)
        committed, hist = 1, [0]
        while committed < trace.max_tokens:
            a = ((trace.anchor_seq == s) & (trace.anchor_j == committed)).nonzero().item()
            dense = torch.full((trace.depth, trace.vocab_size), -math.inf)
            dense.scatter_(1, trace.top_ids[a].long(), trace.top_logprobs[a])
            truth = cont[committed : committed + trace.depth]
            if setting.method == "ar":
                n = 1
            elif setting.method == "dflash":
                n = 1
                while n <= trace.depth and int(dense[n - 1].argmax()) == truth[n - 1]:
                    n += 1
            else:
                n = oracle_accepted(dense.tolist(), truth, setting.budget, setting.topk)
            hist += [0] * (n + 1 - len(hist))
            hist[n] += 1
            committed += n
        hists.append(hist)
    return hists


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_predictions_match_a_brute_force_oracle(seed):
    trace = synthetic_trace(seed=seed)
    predictions = predict(trace, budgets=[1, 3, 7, 20], topks=[None, 1, 2])
    assert [p.setting.label for p in predictions][:3] == ["ar", "dflash", "ddtree-b1-knone"]
    for p in predictions:
        expected = oracle_replay(trace, p.setting)
        assert [q["accept_hist"] for q in p.per_sequence] == expected, p.setting.label
        rounds = sum(sum(h) for h in expected)
        assert p.rounds == rounds and p.accept_length == pytest.approx(trace.num_sequences * 20 / rounds)
    by_label = {p.setting.label: p.accept_length for p in predictions}
    assert by_label["ar"] == pytest.approx(20 / 19)
    assert by_label["ddtree-b20-knone"] >= by_label["ddtree-b7-knone"] >= by_label["ddtree-b1-knone"]
    assert by_label["ddtree-b20-knone"] > by_label["dflash"]  # the tree beats the chain on these marginals


def test_truncated_top_m_predicts_exactly_up_to_its_budget():
    # M = 3 of V = 8: the unrecorded tokens share the leftover mass; budgets <= 3 stay exact
    full = synthetic_trace(vocab=8, top_m=8, seed=5)
    cut = Trace(**{**full.__dict__, "top_m": 3, "top_ids": full.top_ids[..., :3].contiguous(),
                   "top_logprobs": full.top_logprobs[..., :3].contiguous()})
    for budget in (1, 2, 3):
        a = predict(full, [budget], [None, 2])
        b = predict(cut, [budget], [None, 2])
        assert [p.per_sequence for p in a] == [p.per_sequence for p in b]
    with pytest.raises(ConfigError, match="record it with top_m >= 4"):
        predict(cut, [4])


def test_save_load_round_trip(tmp_path):
    trace = synthetic_trace()
    path = trace.save(tmp_path / "t.safetensors")
    loaded = Trace.load(path)
    for name in ("tokens", "seq_offsets", "prompt_lens", "top_ids", "top_logprobs", "anchor_seq", "anchor_j"):
        assert torch.equal(getattr(loaded, name), getattr(trace, name)), name
    assert loaded.metadata() == trace.metadata()
    (tmp_path / "bad.safetensors").write_bytes(b"not a trace")
    with pytest.raises(ConfigError, match="not a readable trace"):
        Trace.load(tmp_path / "bad.safetensors")
    with pytest.raises(ConfigError, match="does not exist"):
        Trace.load(tmp_path / "missing.safetensors")


@pytest.mark.slow
def test_predictions_equal_the_engines_measured_rounds(tiny_engine_factory, tmp_path):
    """The tiny random pair: repetitive prompts give the drafter something to accept. Every setting's predicted
    per-round histogram must equal what the engine reports for the same requests, round for round."""
    from ddtree.engine.api import GenerationRequest, SamplingParams, TreeSettings

    engine = tiny_engine_factory(max_len=512, max_budget=64)
    prompts = ["def foo(x):\n    return", "x = [1, 2, 3]\n" * 4, "import os\nclass A:"]
    tokens = 40
    for block_size, window in ((None, None), (4, 16)):
        trace = record_trace(engine, prompts, tokens, block_size, window, top_m=64)
        trace = Trace.load(trace.save(tmp_path / "trace.safetensors"))
        predictions = predict(trace, budgets=[3, 12, 48], topks=[None, 1])
        assert any(p.accept_length > 1.1 for p in predictions)  # something was accepted: a real check
        for p in predictions:
            s = p.setting
            tree = TreeSettings(method=s.method, budget=s.budget or 16, topk=s.topk, block_size=block_size,
                                draft_window=window)
            outs = engine.generate([
                GenerationRequest(prompt=text, tree=tree, sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))
                for text in prompts
            ])
            assert [o.stats.accept_hist for o in outs] == [q["accept_hist"] for q in p.per_sequence], s.label
            measured = sum(o.stats.completion_tokens for o in outs) / sum(o.stats.verify_rounds for o in outs)
            assert p.accept_length == pytest.approx(measured)


def test_replay_cli_predict(tmp_path):
    import typer

    from ddtree.lab.replay.cli import register
    from ddtree.lab.sweep.layout import read_json

    app = typer.Typer()
    register(app)
    path = synthetic_trace().save(tmp_path / "t.safetensors")
    result = CliRunner().invoke(app, ["replay", "predict", str(path), "--budget", "1,3", "--topk", "none,2",
                                      "--json", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    assert "ddtree-b3-k2" in result.output and "dflash" in result.output
    data = read_json(tmp_path / "p.json")
    assert [p["config"] for p in data["predictions"]] == ["ar", "dflash", "ddtree-b1-knone", "ddtree-b1-k2",
                                                          "ddtree-b3-knone", "ddtree-b3-k2"]
