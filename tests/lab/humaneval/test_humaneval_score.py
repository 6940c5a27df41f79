"""Scoring HumanEval answers: canonical solutions pass 164/164, wrong ones fail, buckets, files, baselines."""

from __future__ import annotations

import json

import pytest

from ddtree.errors import ConfigError
from ddtree.lab.humaneval import (
    EVAL_SCHEMA,
    GATE_TASKS,
    Answer,
    compare_with_baseline,
    load_problems,
    score_answers,
)
from ddtree.lab.humaneval.run import read_answers_jsonl, score_responses_file, select_tasks


@pytest.fixture(scope="module")
def problems():
    return load_problems()


@pytest.mark.slow
def test_canonical_solutions_score_164_of_164(problems):
    answers = [Answer(task_id, p["canonical_solution"], finish_reason="stop") for task_id, p in problems.items()]
    result = score_answers(answers, problems, completion_mode=True)
    failed = [(t["task_id"], t["reason"]) for t in result["tasks"] if not t["passed"]]
    assert failed == []
    assert (result["passed"], result["total"], result["pass_at_1"]) == (164, 164, 1.0)
    assert result["isolation"] is not None


def test_gate_tasks_are_fixed_real_tasks(problems):
    assert len(GATE_TASKS) == 5 and len(set(GATE_TASKS)) == 5
    assert all(task in problems for task in GATE_TASKS)


def test_wrong_solutions_fail(problems):
    tasks = list(GATE_TASKS)
    canonical = [Answer(t, problems[t]["canonical_solution"], finish_reason="stop") for t in tasks]
    wrong = [Answer(t, "    return None\n", finish_reason="stop") for t in tasks]
    crashing = [Answer(t, "    raise RuntimeError('nope')\n", finish_reason="stop") for t in tasks]
    result = score_answers(canonical + wrong + crashing, problems, completion_mode=True)
    assert [t["passed"] for t in result["tasks"]] == [True] * 5 + [False] * 10
    assert (result["passed"], result["wrong"], result["truncated"], result["errors"]) == (5, 10, 0, 0)
    assert all("RuntimeError: nope" in t["reason"] for t in result["tasks"][10:])


def test_buckets_truncated_errors_and_reasoning(problems):
    task = GATE_TASKS[0]
    prompt = problems[task]["prompt"]
    answers = [
        Answer(task, "    for i in range(len(numbers)):\n        for j in", finish_reason="length"),
        Answer(task, "", error="HTTP 503: engine is loading"),
        Answer(task, "<think>hmm, the answer is\n```python\ndef x():", finish_reason="length"),
        Answer(task, "<think>long thoughts</think>", finish_reason="stop"),
        Answer(task, f"```python\n{prompt}{problems[task]['canonical_solution']}```", finish_reason="stop"),
    ]
    result = score_answers(answers, problems, completion_mode=False)
    reasons = [t["reason"] for t in result["tasks"]]
    assert (result["passed"], result["truncated"], result["wrong"], result["errors"]) == (1, 2, 1, 1)
    assert reasons[0].startswith("truncated at max_tokens: SyntaxError")
    assert reasons[1] == "error: HTTP 503: engine is loading"
    assert reasons[2] == "truncated at max_tokens: output ended inside <think> reasoning"
    assert reasons[3] == "no code in the answer"
    assert reasons[4] == "passed" and result["tasks"][4]["code"].startswith(prompt[:20])
    assert result["schema"] == EVAL_SCHEMA and result["total"] == 5 and result["pass_at_1"] == 0.2


def test_responses_file_and_baseline(problems, tmp_path):
    tasks = list(GATE_TASKS[:3])
    lines = [{"task_id": t, "text": "```python\n" + problems[t]["prompt"] + problems[t]["canonical_solution"] + "```",
              "finish_reason": "stop"} for t in tasks]
    path = tmp_path / "answers.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "first.json"
    first = score_responses_file(path, endpoint="chat", out=out)
    assert first["passed"] == 3 and json.loads(out.read_text()) == first

    lines[1]["text"] = lines[1]["text"].replace("```python", "```python\n# changed")
    changed = tmp_path / "changed.jsonl"
    changed.write_text("\n".join(json.dumps(line) for line in lines))
    second = score_responses_file(changed, endpoint="chat", baseline=out)
    assert second["passed"] == 3
    lossless = second["lossless"]
    assert {k: lossless[k] for k in ("baseline", "identical", "compared", "differing_tasks", "real", "verdict")} == {
        "baseline": str(out), "identical": 2, "compared": 3, "differing_tasks": [tasks[1]], "real": 1,
        "verdict": "failed"}
    assert "no token trace" in lossless["divergences"][0]["reason"]  # saved answers carry no tokens
    same = score_responses_file(path, endpoint="chat", baseline=out, limit=2, tasks=tasks)
    assert same["lossless"]["identical"] == same["lossless"]["compared"] == 2


def test_errored_tasks_never_count_as_identical(problems, tmp_path):
    task = GATE_TASKS[0]
    base = score_answers([Answer(task, "", error="HTTP 500: x")], problems, completion_mode=True)
    (tmp_path / "base.json").write_text(json.dumps(base))
    again = score_answers([Answer(task, "", error="HTTP 500: x")], problems, completion_mode=True)
    assert compare_with_baseline(again, tmp_path / "base.json")["identical"] == 0


def test_bad_inputs_are_config_errors(problems, tmp_path):
    with pytest.raises(ConfigError, match="unknown HumanEval task .999."):
        select_tasks(problems, ["999"], None)
    assert select_tasks(problems, ["3", "HumanEval/1", "3"], None) == ["HumanEval/3", "HumanEval/1"]
    assert select_tasks(problems, None, 2) == ["HumanEval/0", "HumanEval/1"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "HumanEval/0"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        read_answers_jsonl(bad)
    not_result = tmp_path / "other.json"
    not_result.write_text('{"schema": "ddtree.bench.cell/1"}')
    with pytest.raises(ConfigError, match="not a humaneval result"):
        compare_with_baseline({"tasks": []}, not_result)
