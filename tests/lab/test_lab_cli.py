"""``ddtree bench`` and ``ddtree eval humaneval`` through the real command line (typer), against a live server."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ddtree.cli import app
from ddtree.errors import ConfigError
from ddtree.lab.cli import parse_ints, parse_json_object
from ddtree.lab.humaneval import GATE_TASKS, load_problems


def test_bench_command_writes_cells_and_prints_the_table(live_ddtree, tmp_path):
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, [
        "bench", "--url", live_ddtree.url, "--tokenizer", live_ddtree.tokenizer.name_or_path,
        "--contexts", "16,40", "--concurrency", "2", "--output-tokens", "6", "--num-requests", "2",
        "--repeats", "2", "--extra-body", '{"ddtree": {"budget": 3}}', "--config", '{"budget": 3}',
        "--out", str(out), "--no-progress",
    ], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["ctx16-c2.json", "ctx40-c2.json"]
    cell = json.loads((out / "ctx40-c2.json").read_text())
    assert cell["config"] == {"budget": 3} and len(cell["runs"]) == 2
    assert cell["workload"]["prompt_lengths"] == [40] * 4
    assert all(r["prompt_tokens"] == 40 for run in cell["runs"] for r in run["requests"])
    assert "ddtree bench" in result.output and "out tok/s" in result.output


def test_eval_command_against_live_server(live_ddtree, tmp_path):
    out = tmp_path / "gate.json"
    result = CliRunner().invoke(app, ["eval", "humaneval", "--url", live_ddtree.url, "--gate", "--limit", "2",
                                      "--max-tokens", "16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [t["task_id"] for t in data["tasks"]] == list(GATE_TASKS[:2])
    assert "pass@1" in result.output


def test_eval_command_records_log_probs_and_classifies_against_the_baseline(live_ddtree, tmp_path):
    base, other = tmp_path / "ar.json", tmp_path / "tree.json"
    common = ["eval", "humaneval", "--url", live_ddtree.url, "--gate", "--limit", "2", "--max-tokens", "12",
              "--logprobs", "3"]
    first = CliRunner().invoke(app, [*common, "--extra-body", '{"ddtree": {"method": "ar"}}', "--out", str(base)])
    assert first.exit_code == 0, first.output
    data = json.loads(base.read_text())
    assert data["logprobs"] == 3 and all(len(t["trace"]["top_logprobs"][0]) in (3, 4) for t in data["tasks"])
    second = CliRunner().invoke(app, [*common, "--baseline", str(base), "--near-tie-margin", "0.001",
                                      "--out", str(other)], env={"COLUMNS": "200"})
    assert second.exit_code == 0, second.output
    assert json.loads(other.read_text())["lossless"]["near_tie_margin"] == 0.001
    assert "lossless: 2/2 byte-identical" in second.output and "0 real divergence(s): identical" in second.output
    bad = CliRunner().invoke(app, [*common, "--baseline", str(base), "--near-tie-margin", "-1", "--out", str(other)])
    assert bad.exit_code != 0 and "near_tie_margin must be a finite number" in str(bad.exception or bad.output)


def test_the_margin_flag_defaults_to_the_gates_margin():
    import inspect

    from ddtree.lab.cli import humaneval
    from ddtree.lab.humaneval import DEFAULT_NEAR_TIE_MARGIN

    assert inspect.signature(humaneval).parameters["near_tie_margin"].default.default == DEFAULT_NEAR_TIE_MARGIN


def test_eval_command_scores_a_responses_file(tmp_path):
    problems = load_problems()
    path = tmp_path / "answers.jsonl"
    rows = [{"task_id": t, "completion": problems[t]["canonical_solution"]} for t in GATE_TASKS[:2]]
    rows.append({"task_id": GATE_TASKS[2], "completion": "    return None\n"})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "scored.json"
    result = CliRunner().invoke(app, ["eval", "humaneval", "--responses", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["passed"], data["wrong"], data["total"]) == (2, 1, 3)
    assert "pass@1 0.667" in result.output and GATE_TASKS[2] in result.output


def test_flag_parsing_errors_name_the_flag():
    assert parse_ints("60, 1024,", what="--contexts") == (60, 1024)
    with pytest.raises(ConfigError, match="--contexts"):
        parse_ints("60,abc", what="--contexts")
    with pytest.raises(ConfigError, match="--extra-body"):
        parse_json_object("[1, 2]", what="--extra-body")
    with pytest.raises(ConfigError, match="--extra-body"):
        parse_json_object("{bad", what="--extra-body")
    assert parse_json_object(None, what="--config") == {}


def test_eval_without_url_or_responses_is_a_clear_error():
    result = CliRunner().invoke(app, ["eval", "humaneval", "--gate"])
    assert result.exit_code != 0
    assert isinstance(result.exception, ConfigError) and "--url" in str(result.exception)
