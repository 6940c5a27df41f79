"""Engine profiles: golden command lines per engine, refusals of what an engine cannot express, the seed campaign
as one dry-run, and the readable labels."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from ddtree.errors import ConfigError
from ddtree.lab.sweep.cli import register
from ddtree.lab.sweep.grid import SweepConfig, SweepPoint
from ddtree.lab.sweep.labels import config_labels
from ddtree.lab.sweep.profiles import EngineProfile, InexpressibleSetting, trained_block_size

SGL = EngineProfile("sglang", model="Qwen/Qwen3-8B", draft="z-lab/Qwen3-8B-DFlash-b16")
VLLM = EngineProfile("vllm", model="Qwen/Qwen3-8B", draft="z-lab/Qwen3-8B-DFlash-b16")
TREE = SweepPoint("ddtree", budget=8, topk=4, block_size=8, draft_window=2048)


def test_sglang_golden_commands():
    assert SGL.command(SweepPoint("ar"), 30000).display == (
        "python -m sglang.launch_server --model-path Qwen/Qwen3-8B --host 127.0.0.1 --port 30000")
    assert SGL.command(SweepPoint("dflash", block_size=16, draft_window=2048), 30000).display == (
        "python -m sglang.launch_server --model-path Qwen/Qwen3-8B --host 127.0.0.1 --port 30000 "
        "--speculative-algorithm DFLASH --speculative-draft-model-path z-lab/Qwen3-8B-DFlash-b16 "
        "--speculative-num-draft-tokens 16 --speculative-dflash-draft-window-size 2048")
    assert SGL.command(TREE, 30000).display == (
        "SGLANG_DDTREE_MAX_TOPK=4 SGLANG_DDTREE_DEPTH_BONUS=0 SGLANG_DDTREE_RANK_PROBE=0 "
        "python -m sglang.launch_server --model-path Qwen/Qwen3-8B --host 127.0.0.1 --port 30000 "
        "--speculative-algorithm DDTREE --speculative-draft-model-path z-lab/Qwen3-8B-DFlash-b16 "
        "--speculative-ddtree-budget 8 --speculative-dflash-block-size 8 --page-size 1 --disable-overlap-schedule "
        "--speculative-dflash-draft-window-size 2048")


def test_sglang_no_topk_cap_is_topk_equal_to_budget_and_options_and_dims():
    command = SGL.command(SweepPoint("ddtree", budget=12, dims=(("tp", "8"),)), 1)
    assert ("SGLANG_DDTREE_MAX_TOPK", "12") in command.env
    assert command.argv[-2:] == ("--tp-size", "8")
    verify = EngineProfile.build("sglang", "M", "D", options=["tree_verify=on", "block_flag=dflash-block-size"],
                                 extra_args="--mem-fraction-static 0.8")
    argv = verify.command(SweepPoint("dflash", block_size=8), 1).argv
    assert "--speculative-dflash-block-size" in argv and "--speculative-num-draft-tokens" not in argv
    assert argv[-2:] == ("--mem-fraction-static", "0.8")
    assert "--speculative-dflash-tree-verify" in verify.command(TREE, 1).argv
    with pytest.raises(ConfigError, match="sglang knows"):
        EngineProfile.build("sglang", "M", "D", options=["nope=1"])


def test_vllm_golden_commands():
    assert VLLM.command(SweepPoint("ar", dims=(("tp", "2"),)), 8000).display == (
        "vllm serve Qwen/Qwen3-8B --host 127.0.0.1 --port 8000 --tensor-parallel-size 2")
    spec = {"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 15}
    assert VLLM.command(SweepPoint("dflash", block_size=16), 8000).display == (
        f"vllm serve Qwen/Qwen3-8B --host 127.0.0.1 --port 8000 --speculative-config '{json.dumps(spec)}'")
    argv = VLLM.command(SweepPoint("ddtree", budget=8, block_size=8), 8000).argv
    assert json.loads(argv[-1]) == {"method": "ddtree", "model": "z-lab/Qwen3-8B-DFlash-b16",
                                    "num_speculative_tokens": 7, "tree_budget": 8}


@pytest.mark.parametrize(
    ("profile", "point", "message"),
    [
        (VLLM, SweepPoint("dflash", block_size=8, draft_window=2048), "vllm cannot express draft_window=2048"),
        (VLLM, SweepPoint("ddtree", budget=8, topk=4, block_size=8), "vllm cannot express topk=4"),
        (VLLM, SweepPoint("dflash"), "vllm cannot express block_size=trained"),
        (EngineProfile("ddtree", model="M"), SweepPoint("ar", dims=(("tp", "8"),)), "ddtree cannot express the "
                                                                                     "dimension tp"),
        (EngineProfile("sglang", model="M"), SweepPoint("dflash"), "sglang cannot serve dflash without a drafter"),
    ],
)
def test_inexpressible_settings_are_refused_naming_engine_and_setting(profile, point, message):
    with pytest.raises(InexpressibleSetting, match=message):
        profile.command(point, 1)


def test_a_grid_with_an_inexpressible_setting_is_refused_when_built():
    with pytest.raises(InexpressibleSetting, match="vllm cannot express draft_window=2048 .config dflash-bs8-w2048"):
        SweepConfig(budgets=(4,), block_sizes=(8,), draft_windows=(2048,), profile=VLLM)


def test_trained_block_size_from_a_local_drafter(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dflash_config": {"block_size": 16}}))
    assert trained_block_size(str(tmp_path)) == 16
    (tmp_path / "config.json").write_text(json.dumps({"block_size": 8}))
    assert trained_block_size(str(tmp_path)) == 8
    assert trained_block_size("z-lab/not-local") is None
    profile = EngineProfile.build("vllm", "M", str(tmp_path))
    assert json.loads(profile.command(SweepPoint("dflash"), 1).argv[-1])["num_speculative_tokens"] == 7


def test_the_seed_campaign_is_one_dry_run(tmp_path):
    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(app, ["sweep", "--preset", "seed", "--engine", "sglang", "--model", "Qwen/Qwen3-8B",
                                      "--draft", "z-lab/Qwen3-8B-DFlash-b16", "--dry-run", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    commands = [line.strip() for line in result.output.splitlines() if "sglang.launch_server" in line]
    assert len(commands) == 1 + 4 + 4 * 3 * 2 * 2  # AR, 4 chains, 48 trees
    trees = [c for c in commands if "DDTREE" in c]
    assert len(trees) == 48 and len(set(trees)) == 48
    assert sum("--speculative-ddtree-budget 12 " in c and "SGLANG_DDTREE_MAX_TOPK=6 " in c for c in trees) == 4
    assert "[1] ar  (ar)" in result.output
    assert "ddtree b4 k=4 bs=8 w=2048  (ddtree-b4-k4-bs8-w2048)" in result.output
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_dry_run_refuses_what_the_engine_cannot_express(tmp_path):
    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(app, ["sweep", "--preset", "seed", "--engine", "vllm", "--model", "M", "--draft", "D",
                                      "--dry-run", "--out", str(tmp_path)])
    assert isinstance(result.exception, InexpressibleSetting)
    assert "vllm cannot express draft_window=2048" in str(result.exception)


def test_labels_name_only_what_varies():
    points = SweepConfig(budgets=(4, 16), topks=(None,), draft_windows=(64, None)).points()
    labels = config_labels(points)
    assert list(labels.values()) == ["ar", "dflash w=64", "dflash", "ddtree b4 w=64", "ddtree b4", "ddtree b16 w=64",
                                     "ddtree b16"]
    assert list(labels) == [p.config_id for p in points]  # on-disk ids unchanged
    assert config_labels(SweepConfig(budgets=(8,)).points()) == {"ar": "ar", "dflash-bstrained-wnone": "dflash",
                                                                "ddtree-b8-knone-bstrained-wnone": "ddtree b8"}
