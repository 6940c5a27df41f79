"""Client mistakes get a 400/404 with an OpenAI error body naming the problem; the server keeps serving."""

from __future__ import annotations

import json

import pytest

OK = {"prompt": "hello world", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (path, body: dict -> JSON, bytes -> sent raw), status, param, a fragment of the message
CASES = [
    ("/v1/completions", b'{"prompt": "hi", ', 400, None, "malformed JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("/v1/completions", b"", 400, None, "body is empty"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "missing required field 'prompt'"),
    ("/v1/completions", {**OK, "max_tokens": -1}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {**OK, "max_tokens": "8"}, 400, "max_tokens", "valid integer"),
    ("/v1/completions", {**OK, "max_tokens": 4.5}, 400, "max_tokens", "valid integer"),
    ("/v1/completions", {**OK, "max_tokens": 10**12}, 400, "max_tokens", "context limit"),
    ("/v1/completions", {**OK, "prompt": "word " * 300}, 400, "max_tokens", "context limit"),
    ("/v1/completions", {**OK, "prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {**OK, "prompt": []}, 400, "prompt", "empty"),
    ("/v1/completions", {**OK, "prompt": ["a", [1]]}, 400, "prompt", "a list of strings"),
    ("/v1/completions", {**OK, "prompt": [[1, 2], [3, 10**6]]}, 400, "prompt", "token ids"),
    ("/v1/completions", {**OK, "prompt": ["a", ""]}, 400, "prompt", "empty"),
    ("/v1/completions", {**OK, "prompt": [1, 2, 10**6]}, 400, "prompt", "token ids"),
    ("/v1/completions", {**OK, "prompt": [1, -2]}, 400, "prompt", "token ids"),
    ("/v1/completions", {**OK, "prompt": {"text": "hi"}}, 400, "prompt", "a list of token-id lists"),
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 4}', 400, "prompt", "not valid Unicode"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', 400, "messages",
     "chat template"),
    ("/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature", ">= 0"),
    ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", "valid number"),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {**OK, "top_k": -5}, 400, "top_k", ">= -1"),
    ("/v1/completions", {**OK, "seed": -1}, 400, "seed", ">= 0"),
    ("/v1/completions", {**OK, "stop": 5}, 400, "stop", "string or a list of strings"),
    ("/v1/completions", {**OK, "stop": [""]}, 400, "stop", "non-empty"),
    ("/v1/completions", {**OK, "n": 0}, 400, "n", "n must be >= 1"),
    ("/v1/completions", {**OK, "n": 65}, 400, "n", "at most 64"),
    ("/v1/completions", {**OK, "prompt": ["a"] * 9, "n": 8}, 400, "prompt", "72 choices"),
    ("/v1/completions", {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream: true"),
    ("/v1/completions", {**OK, "min_tokens": 5}, 400, "min_tokens", "<= max_tokens (4)"),
    ("/v1/completions", {**OK, "min_tokens": -1}, 400, "min_tokens", ">= 0"),
    ("/v1/completions", {**OK, "min_p": 0.1}, 400, "min_p", "not supported"),
    ("/v1/completions", {**OK, "best_of": 2}, 400, "best_of", "not supported"),
    ("/v1/completions", {**OK, "use_beam_search": True}, 400, "use_beam_search", "not supported"),
    ("/v1/completions", {**OK, "prompt_logprobs": 1}, 400, "prompt_logprobs", "not supported"),
    ("/v1/completions", {**OK, "guided_regex": "a+"}, 400, "guided_regex", "not supported"),
    ("/v1/completions", {**OK, "skip_special_tokens": False, "stop": ["x"]}, 400, "skip_special_tokens",
     "stop strings"),
    ("/v1/completions", {**OK, "echo": True, "logprobs": 21}, 400, "logprobs", "between 0 and 20"),
    ("/v1/completions", {**OK, "logprobs": -1}, 400, "logprobs", "between 0 and 20"),
    ("/v1/completions", {**OK, "stream": "yes"}, 400, "stream", "valid boolean"),
    ("/v1/completions", {**OK, "logprobs": True}, 400, "logprobs", "valid integer"),
    ("/v1/completions", {**OK, "suffix": "}"}, 400, "suffix", "not supported"),
    ("/v1/completions", {**OK, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("/v1/completions", {**OK, "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/completions", {**OK, "ddtree": {"budgett": 4}}, 400, "ddtree", "unknown tree setting"),
    ("/v1/completions", {**OK, "ddtree": {"budget": 0}}, 400, "ddtree.budget", ">= 1"),
    ("/v1/completions", {**OK, "ddtree": {"budget": 10**6}}, 400, "ddtree.budget", "<= 16"),
    ("/v1/completions", {**OK, "ddtree": {"budget": "8"}}, 400, "ddtree.budget", "integer"),
    ("/v1/completions", {**OK, "ddtree": {"method": "beam"}}, 400, "ddtree.method", "unknown method"),
    ("/v1/completions", {**OK, "ddtree": {"block_size": 64}}, 400, "ddtree.block_size", "<= 8"),
    ("/v1/completions", {**OK, "ddtree": {"block_size": 8, "draft_window": 4}}, 400, "ddtree.draft_window", ">= 8"),
    ("/v1/completions", {**OK, "ddtree": {"topk": 0}}, 400, "ddtree.topk", ">= 1"),
    ("/v1/completions", {**OK, "ddtree": [4]}, 400, "ddtree", "valid dictionary"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages", "missing required field 'messages'"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "at least 1 item"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "'user'"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}, 400, "messages[0].role", "missing"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0].content[0]", "only text parts"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", ">= 1"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format",
     "not supported"),
    ("/v1/chat/completions", {**CHAT, "model": "other"}, 404, "model", "does not exist"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, 400, "logprobs", "valid boolean"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "between 0 and 20"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice", "not supported"),
    ("/v1/chat/completions", {**CHAT, "n": 2, "stream": False, "stream_options": {}}, 400, "stream_options",
     "stream: true"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 5}, 400, "min_tokens", "<= max_tokens (4)"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, 400, "continue_final_message",
     "not supported"),
    ("/v1/chat/completions", {**CHAT, "ddtree": {"method": "chain"}}, 400, "ddtree.method", "unknown method"),
    ("/v1/no_such_route", OK, 404, None, "no route POST /v1/no_such_route"),
    ("/server_config", {"budget": 4}, 400, None, 'under "ddtree"'),
    ("/server_config", {"ddtree": {"budget": -3}}, 400, "ddtree.budget", ">= 1"),
    ("/server_config", {"ddtree": {"colour": "red"}}, 400, "ddtree", "unknown tree setting"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "fragment"), CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[-1]}" for i, c in enumerate(CASES)])
def test_bad_request_gets_an_openai_error(client, path, body, status, param, fragment):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert fragment in error["message"], error["message"]
    # The engine is untouched: the next valid request is served.
    ok = client.post("/v1/completions", json=OK)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_wrong_method_and_unknown_get_route(client):
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
    r = client.get("/v2/models")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_engine_failure_is_a_500_for_that_request_only(client, engine, monkeypatch):
    """A fault inside the engine ends the request with an error (never a hang), and the engine lives on."""
    real_round = engine.runner.round

    def broken_round(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "round", broken_round)
    r = client.post("/v1/completions", json={**OK, "max_tokens": 8})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["code"] == "engine_error" and "injected fault" in error["message"]
    r = client.post("/v1/completions", json={**OK, "max_tokens": 8, "stream": True})
    assert r.status_code == 200  # the stream had started; the failure arrives as an error event, then [DONE]
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_error"
    monkeypatch.setattr(engine.runner, "round", real_round)
    ok = client.post("/v1/completions", json={**OK, "max_tokens": 8, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
    assert engine.snapshot().requests_total.get("error", 0) == 2


def test_unexpected_server_fault_is_an_openai_500(app, engine, monkeypatch):
    import asyncio

    import httpx

    def broken_snapshot():
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(engine, "snapshot", broken_snapshot)

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://ddtree.test") as client:
            return await client.get("/server_info")

    r = asyncio.run(get())
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "internal server error: ZeroDivisionError: bug", "type": "server_error",
                                 "param": None, "code": "internal_error"}
