"""Every command that builds an engine takes its engine flags from EngineConfig (ddtree.engine.options): the same
names, defaults and validation, declared once. Through the real ``ddtree`` app (typer's CliRunner)."""

from __future__ import annotations

import inspect
import json
import re

import pytest
from typer.testing import CliRunner

from ddtree.cli import app
from ddtree.engine.config import EngineConfig
from ddtree.engine.options import HELP, engine_fields, int_list
from ddtree.errors import ConfigError

# command -> (argv prefix that reaches it, EngineConfig fields it sets itself, flags spelled otherwise)
ENGINE_COMMANDS = {
    "serve": (["serve"], set(), {}),
    "generate": (["generate"], {"max_batch", "max_budget", "max_block_size", "seed"}, {}),
    "bench": (["bench"], {"seed"}, {"warmup": "--engine-warmup"}),
    "sweep": (["sweep"], {"seed"}, {}),
    "replay record": (["replay", "record"], {"max_batch", "max_budget", "max_block_size"}, {}),
    "train quality": (["train", "quality"], {"max_len", "max_budget"}, {}),
}


def _flag(name: str, spelled: dict[str, str]) -> str:
    return spelled.get(name, "--" + name.replace("_", "-"))


def _command(argv: list[str]):
    """The click command object behind ``ddtree <argv>``."""
    import typer.main

    group = typer.main.get_command(app)
    ctx = group.make_context("ddtree", list(argv) + ["--help"], resilient_parsing=True)
    cmd = group
    for name in argv:
        cmd = cmd.get_command(ctx, name)
    return cmd


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_help_lists_every_shared_engine_option(command):
    argv, own, spelled = ENGINE_COMMANDS[command]
    res = CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": "240", "TERM": "dumb"})
    assert res.exit_code == 0, res.output
    listed = set(re.findall(r"--[a-z0-9][a-z0-9-]*", res.output))
    expected = {_flag(f.name, spelled) for f in engine_fields() if f.name not in own}
    assert expected <= listed, sorted(expected - listed)


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_model_and_device_flags_are_the_shared_definitions(command):
    """--target/--draft/--device/--dtype: one declaration each (the generated option, with its shared help and
    EngineConfig's default), never a copy in the command."""
    argv, own, spelled = ENGINE_COMMANDS[command]
    params = {p.name: p for p in _command(argv).params}
    for name in ("target", "draft", "device", "dtype"):
        option = params[name]
        assert option.opts == [_flag(name, spelled)] and option.help == HELP[name]
        assert option.default == getattr(EngineConfig(), name)
    for field in engine_fields():
        if field.name not in own:
            option = params[_flag(field.name, spelled)[2:].replace("-", "_")]
            assert option.help == HELP[field.name] and option.opts[0] == _flag(field.name, spelled)


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_a_wrong_engine_value_is_an_error_naming_the_flag(command):
    argv, own, spelled = ENGINE_COMMANDS[command]
    required = {"generate": ["--prompt", "x"], "train quality": ["--out", "/nonexistent/q.json"]}.get(command, [])
    runner = CliRunner()
    res = runner.invoke(app, [*argv, *required, "--dtype", "float8"], env={"COLUMNS": "240"})
    assert res.exit_code == 2, res.output
    assert "'--dtype'" in res.output and "float8" in res.output
    flag = "--max-len" if "max_len" not in own else "--max-queue"
    res = runner.invoke(app, [*argv, *required, flag, "many"], env={"COLUMNS": "240"})
    assert res.exit_code == 2 and f"'{flag}'" in res.output


def test_a_derived_limit_left_out_is_checked_at_its_default_and_given_is_checked_as_given():
    res = CliRunner().invoke(app, ["bench", "--in-process", "--max-batch", "0"], env={"COLUMNS": "240"})
    assert res.exit_code == 2 and "'--max-batch'" in res.output and "max_batch must be an integer >= 1" in res.output


def test_bench_needs_exactly_one_target():
    res = CliRunner().invoke(app, ["bench"])
    assert res.exit_code != 0 and "--in-process" in str(res.exception)
    res = CliRunner().invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--in-process"])
    assert res.exit_code != 0 and "either --url" in str(res.exception)


def test_bench_in_process_on_the_demo_pair(tmp_path):
    out = tmp_path / "cells"
    res = CliRunner().invoke(app, [
        "bench", "--in-process", "--device", "cpu", "--no-cuda-graphs", "--contexts", "20", "--concurrency", "2",
        "--output-tokens", "3", "--num-requests", "2", "--no-warmup", "--no-progress", "--out", str(out),
        "--extra-body", '{"ddtree": {"budget": 4}}', "--engine-warmup", "none"], env={"COLUMNS": "240"})
    assert res.exit_code == 0, res.output
    cell = json.loads((out / "ctx20-c2.json").read_text())
    assert [r["completion_tokens"] for r in cell["runs"][0]["requests"]] == [3, 3]
    assert cell["env"]["server_info"]["config"]["max_batch"] == 2  # sized from --concurrency
    assert cell["env"]["server_info"]["config"]["max_len"] == 20 + 3 + 16


def test_sweep_sizes_its_in_process_engine_from_the_grid_unless_told(monkeypatch):
    import ddtree.lab.sweep.runner as runner

    seen = []

    def fake_run_sweep(cfg, target, run_dir, **kwargs):  # what the sweep would run, without running it
        seen.append(target.engine_config)
        raise SystemExit(0)

    monkeypatch.setattr(runner, "run_sweep", fake_run_sweep)
    for extra in ([], ["--max-batch", "5", "--max-len", "999", "--dtype", "float32"]):
        res = CliRunner().invoke(app, ["sweep", "--preset", "demo", "--concurrency", "1,3", "--contexts", "40",
                                       "--output-tokens", "8", "--gate-tasks", "none", "--out", "/nonexistent",
                                       *extra])
        assert res.exit_code == 0, res.output
    grid, told = seen
    assert (grid.max_batch, grid.max_len, grid.dtype) == (3, max(EngineConfig().max_len, 40 + 8 + 16), "auto")
    assert (told.max_batch, told.max_len, told.dtype) == (5, 999, "float32")


def test_int_list_with_none():
    assert int_list("4,none, 8", name="--topk", optional=True) == (4, None, 8)
    with pytest.raises(ConfigError, match="--budget does not accept 'none'"):
        int_list("4,none", name="--budget")
    with pytest.raises(ConfigError, match="--topk must be comma-separated integers or none: 'x' is not an integer"):
        int_list("4,x", name="--topk", optional=True)


def test_the_engine_commands_declare_no_engine_field_by_hand():
    """The source of each command: no ``typer.Option`` for a parameter named like an EngineConfig field."""
    from ddtree.engine import cli as generate_cli
    from ddtree.lab import cli as lab_cli
    from ddtree.lab.replay import cli as replay_cli
    from ddtree.lab.sweep import cli as sweep_cli
    from ddtree.server import cli as serve_cli
    from ddtree.train import cli as train_cli

    fields = {f.name for f in engine_fields()}
    for fn, own in ((serve_cli.serve, set()), (generate_cli.generate, {"seed"}), (lab_cli.bench, {"seed", "warmup"}),
                    (sweep_cli.sweep, {"seed"}), (replay_cli.record, set()), (train_cli.quality_command, set())):
        source = inspect.getsource(inspect.unwrap(fn))
        declared = set(re.findall(r"^\s+(\w+): [^=]+= typer\.Option\(", source, flags=re.M))
        assert declared & fields <= own, (fn.__name__, sorted(declared & fields))


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x"], ["serve"]], ids=["generate", "serve"])
def test_a_wrong_budget_is_a_usage_error_naming_the_flag(argv):
    """--budget takes a count or ``auto`` (options.tree_settings, shared by both commands): anything else exits 2
    with the flag and the value named, before a model loads."""
    res = CliRunner().invoke(app, [*argv, "--budget", "lots", "--device", "cpu"], env={"COLUMNS": "240"})
    assert res.exit_code == 2, res.output
    assert "Invalid value for --budget" in res.output and "'lots'" in res.output
