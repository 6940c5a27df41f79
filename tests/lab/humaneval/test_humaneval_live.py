"""The coding gate against a real ``ddtree`` server: answers are the engine's greedy outputs, and the lossless
check holds between plain decoding and tree speculation."""

from __future__ import annotations

import json

from ddtree.engine.api import GenerationRequest, SamplingParams, TreeSettings
from ddtree.lab.client import BenchTarget
from ddtree.lab.humaneval import COMPLETION_STOP, GATE_TASKS, load_problems, run_humaneval

TASKS = list(GATE_TASKS[:3])
MAX_TOKENS = 24


def test_gate_answers_are_the_engines_greedy_outputs_and_lossless(live_ddtree, tmp_path):
    baseline = tmp_path / "ar.json"
    ar = run_humaneval(BenchTarget(url=live_ddtree.url, extra_body={"ddtree": {"method": "ar"}}), tasks=TASKS,
                       limit=None, max_tokens=MAX_TOKENS, out=baseline)
    assert json.loads(baseline.read_text()) == ar
    assert ar["engine"] == "ddtree" and ar["model"] == "tiny" and ar["total"] == 3 and ar["errors"] == 0
    assert ar["passed"] + ar["truncated"] + ar["wrong"] == 3  # a random tiny model writes no working code
    assert ar["lossless"] is None

    problems = load_problems()
    requests = [GenerationRequest(prompt=problems[t]["prompt"], tree=TreeSettings(method="ar"),
                                  sampling=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                          stop=COMPLETION_STOP)) for t in TASKS]
    direct = live_ddtree.engine.generate(requests)
    assert [t["completion"] for t in ar["tasks"]] == [o.text for o in direct]
    assert [t["finish_reason"] for t in ar["tasks"]] == [o.finish_reason for o in direct]

    tree = run_humaneval(BenchTarget(url=live_ddtree.url), tasks=TASKS, limit=None, max_tokens=MAX_TOKENS, out=None,
                         extra_body={"ddtree": {"method": "ddtree", "budget": 8}}, baseline=baseline)
    assert tree["extra_body"] == {"ddtree": {"method": "ddtree", "budget": 8}}
    assert tree["lossless"] == {"baseline": str(baseline), "identical": 3, "compared": 3, "near_tie": 0, "real": 0,
                                "verdict": "identical", "near_tie_margin": 0.5, "differing_tasks": [],
                                "divergences": [], "drifting": [], "exact": False}
    assert all(t["trace"] is None for t in tree["tasks"])  # no log-probs asked, no trace


def test_gate_over_the_chat_endpoint(live_ddtree):
    result = run_humaneval(BenchTarget(url=live_ddtree.url, endpoint="chat"), tasks=TASKS[:1], limit=None,
                           max_tokens=MAX_TOKENS, out=None)
    [task] = result["tasks"]
    assert result["errors"] == 0 and result["endpoint"] == "chat"
    assert task["finish_reason"] in ("length", "stop") and not task["reason"].startswith("error")


def test_request_errors_are_their_own_bucket(live_ddtree):
    result = run_humaneval(BenchTarget(url=live_ddtree.url), tasks=TASKS[:2], limit=None, max_tokens=MAX_TOKENS,
                           out=None, extra_body={"ddtree": {"budget": 0}})
    assert result["errors"] == 2 and result["passed"] == result["wrong"] == result["truncated"] == 0
    assert all(t["reason"].startswith("error: HTTP 400") for t in result["tasks"])


def test_completion_requests_stop_at_the_end_of_the_function_and_chat_requests_do_not():
    import asyncio

    import httpx

    from ddtree.lab.humaneval.run import fetch_answers

    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        bodies.append(json.loads(request.content))
        text = "    return 1\n"
        choice = {"index": 0, "finish_reason": "stop", "text": text, "message": {"role": "assistant", "content": text}}
        return httpx.Response(200, json={"choices": [choice], "usage": {"completion_tokens": 3}})

    problems = load_problems()
    for endpoint in ("completions", "chat"):
        answers, _, _ = asyncio.run(fetch_answers(BenchTarget(url="http://test", endpoint=endpoint, engine="ddtree"),
                                                  problems, TASKS[:1], max_tokens=16, concurrency=1,
                                                  transport=httpx.MockTransport(handler)))
        assert answers[0].text == "    return 1\n"
    completion, chat = bodies
    assert completion["stop"] == list(COMPLETION_STOP) and "prompt" in completion
    assert "stop" not in chat and "messages" in chat
