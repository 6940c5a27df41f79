"""``ddtree sweep`` flag handling: resuming finished runs loads nothing, changed grids are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ddtree.errors import ConfigError
from ddtree.lab.sweep.cli import latest_run, register
from ddtree.lab.sweep.layout import RunLayout, read_json

sys.path.insert(0, str(Path(__file__).parents[1] / "report"))
from report_synthetic import make_run  # noqa: E402


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_bare_resume_finds_the_latest_run_and_skips_every_finished_cell(app, tmp_path):
    make_run(tmp_path / "synthetic-old", failures=False)
    newest = make_run(tmp_path / "synthetic-new", failures=False)
    assert latest_run(tmp_path, "synthetic") == newest
    result = CliRunner().invoke(app, ["sweep", "--resume", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "finished: 0 cells run, 30 skipped, 0 failed" in result.output  # 6 configs x (4 cells + gate)
    sessions = read_json(RunLayout(newest).manifest_path)["sessions"]
    assert [s["resumed"] for s in sessions] == [False, True] and sessions[-1]["status"] == "finished"
    assert (newest / "report.html").is_file()


def test_resume_with_a_different_grid_is_refused(app, tmp_path):
    make_run(tmp_path / "run", failures=False)
    result = CliRunner().invoke(app, ["sweep", "--resume", "--out", str(tmp_path), "--run", "run",
                                      "--budget", "4,8,16"])
    assert isinstance(result.exception, ConfigError)
    assert "differs in: budgets" in str(result.exception)


def test_a_new_run_never_overwrites_an_old_one(app, tmp_path):
    make_run(tmp_path / "run", failures=False)
    result = CliRunner().invoke(app, ["sweep", "--out", str(tmp_path), "--run", "run", "--preset", "demo"])
    assert isinstance(result.exception, ConfigError) and "pass --resume" in str(result.exception)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "demo", "--config", "x.toml"], "either --preset or --config"),
        (["--preset", "nope"], "unknown sweep preset"),
        (["--budget", "4,x"], "'x' is not an integer"),
        (["--extra-body", "[1]"], "must be a JSON object"),
        (["--url", "http://127.0.0.1:1", "--launch", "serve --port {port}"], "either --url"),
    ],
)
def test_bad_flags_name_the_fix(app, tmp_path, args, message):
    result = CliRunner().invoke(app, ["sweep", "--out", str(tmp_path), *args])
    assert isinstance(result.exception, ConfigError), result.output
    assert message in str(result.exception)
