"""``ddtree generate`` end to end on checkpoints saved to disk (loader + engine + CLI)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from ddtree.cli import app


def test_generate_json_matches_between_methods(tiny_model_dirs):
    target, drafter = tiny_model_dirs
    runner = CliRunner()
    outs = {}
    for method in ("ar", "dflash", "ddtree"):
        res = runner.invoke(app, [
            "generate", "--target", str(target), "--draft", str(drafter), "--method", method, "--budget", "8",
            "--topk", "4", "--block-size", "6", "--draft-window", "64", "--max-tokens", "12", "--ignore-eos",
            "--prompt", "def add(a, b):", "--json", "--device", "cpu",
        ])
        assert res.exit_code == 0, res.output
        outs[method] = json.loads(res.stdout)
    assert outs["ar"]["token_ids"] == outs["dflash"]["token_ids"] == outs["ddtree"]["token_ids"]
    stats = outs["ddtree"]["stats"]
    assert stats["completion_tokens"] == 12 and stats["verify_rounds"] >= 1
    assert stats["tree"]["budget"] == 8 and stats["tree"]["draft_window"] == 64


def test_generate_rejects_bad_settings_with_a_clear_message(tiny_model_dirs):
    target, drafter = tiny_model_dirs
    res = CliRunner().invoke(app, [
        "generate", "--target", str(target), "--draft", str(drafter), "--method", "ddtree", "--block-size", "8",
        "--draft-window", "4", "--prompt", "x", "--device", "cpu",
    ])
    assert res.exit_code != 0
    assert "draft_window" in str(res.exception) or "draft_window" in res.output


def test_generate_with_the_fp8_drafter_on_the_demo_pair_matches_ar(monkeypatch):
    """--draft-fp8 on the embedded demo pair (block 16: one request's draft takes the fp8 path): same tokens."""
    import torch

    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    runner = CliRunner()
    outs = {}
    for method, extra in (("ar", []), ("ddtree", ["--draft-fp8"])):
        res = runner.invoke(app, ["generate", "--method", method, "--budget", "8", "--max-tokens", "16",
                                  "--ignore-eos", "--prompt", "def fibonacci(n):", "--json", "--device", "cpu",
                                  "--max-len", "256", *extra])
        assert res.exit_code == 0, res.output
        outs[method] = json.loads(res.stdout)["token_ids"]
    assert outs["ddtree"] == outs["ar"] and calls


def test_cpu_threads_are_validated():
    import pytest

    from ddtree.engine.config import EngineConfig
    from ddtree.errors import ConfigError

    assert EngineConfig().cpu_threads is None and EngineConfig(cpu_threads=3).validated().cpu_threads == 3
    for bad in (0, True, 1.5):
        with pytest.raises(ConfigError, match="cpu_threads"):
            EngineConfig(cpu_threads=bad).validated()


def test_a_cpu_engine_sets_torch_threads_from_its_config(tiny_pair, tiny_tokenizer):
    import torch

    from ddtree.engine import Engine, EngineConfig

    before = torch.get_num_threads()
    try:
        target, drafter = tiny_pair
        for threads in (2, 1):
            torch.set_num_threads(3 - threads)
            Engine(target, drafter, tiny_tokenizer,
                   EngineConfig(device="cpu", max_batch=1, max_len=64, cpu_threads=threads))
            assert torch.get_num_threads() == threads
        Engine(target, drafter, tiny_tokenizer, EngineConfig(device="cpu", max_batch=1, max_len=64))
        assert torch.get_num_threads() == 1  # None leaves torch's setting alone
    finally:
        torch.set_num_threads(before)
