"""The OpenAI-compatible client against recorded-format SGLang/vLLM servers on loopback (and error shapes)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from lab_helpers import ReplayConfig, load_json_fixture, read_sse_fixture

from ddtree.errors import ConfigError
from ddtree.lab.client import BenchTarget, OpenAIClient


def _complete(target: BenchTarget, body_kwargs: dict, transport: httpx.AsyncBaseTransport | None = None):
    async def go():
        async with OpenAIClient(target, transport=transport) as client:
            body = await client.body(**body_kwargs)
            return body, await client.complete(body)

    return asyncio.run(go())


def test_vllm_stream_with_continuous_usage(replay_server):
    replay = replay_server(ReplayConfig(owned_by="vllm", stream=read_sse_fixture("vllm_completions_stream.txt")))
    body, c = _complete(BenchTarget(url=replay.url, extra_body={"top_k": 1}),
                        {"prompt": [5, 6, 7], "max_tokens": 12, "stream": True, "ignore_eos": True})
    assert c.error is None
    assert c.text == " The quick brown fox jumps over the lazy dog and"
    assert (c.prompt_tokens, c.completion_tokens, c.finish_reason) == (64, 12, "length")
    # cumulative completion_tokens per chunk as recorded (the usage-only chunk repeats the total)
    assert c.chunk_usage == [1, 4, 5, 9, 10, 12, 12]
    assert c.chunk_times == sorted(c.chunk_times) and c.latency_s >= c.chunk_times[-1]
    sent = replay.bodies[0]
    assert sent == body
    assert sent["prompt"] == [5, 6, 7] and sent["model"] == "recorded-model" and sent["ignore_eos"] is True
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert sent["temperature"] == 0.0 and sent["top_k"] == 1  # extra_body merged last


def test_vllm_chat_stream_separates_reasoning(replay_server):
    replay = replay_server(ReplayConfig(owned_by="vllm", stream=read_sse_fixture("vllm_chat_reasoning_stream.txt")))
    body, c = _complete(BenchTarget(url=replay.url, endpoint="chat"),
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True})
    assert c.error is None
    assert c.reasoning == "Think about it."
    assert c.text == "```python\ndef f():\n    return 1\n```"
    assert c.completion_tokens == 13 and c.finish_reason == "stop"
    assert body["max_completion_tokens"] == 64 and body["messages"][0]["content"] == "hi"


def test_sglang_chat_response_with_reasoning_and_spec(replay_server):
    fixture = load_json_fixture("sglang_chat_response.json")
    replay = replay_server(ReplayConfig(owned_by="sglang", stream=[], response=fixture))
    _, c = _complete(BenchTarget(url=replay.url, endpoint="chat", model="recorded-model"),
                     {"messages": [{"role": "user", "content": "add"}], "max_tokens": 64, "stream": False})
    assert c.error is None
    assert c.text == fixture["choices"][0]["message"]["content"]
    assert c.reasoning == fixture["choices"][0]["message"]["reasoning_content"]
    assert (c.spec_verify_ct, c.accept_length, c.completion_tokens) == (15, 4.0, 60)
    assert c.chunk_times == []  # nothing streamed


def test_sglang_stream_reads_spec_from_final_chunk(replay_server):
    replay = replay_server(ReplayConfig(owned_by="sglang", stream=read_sse_fixture("sglang_completions_stream.txt")))
    _, c = _complete(BenchTarget(url=replay.url), {"prompt": "x", "max_tokens": 16, "stream": True})
    assert (c.completion_tokens, c.spec_verify_ct, c.accept_length) == (16, 5, 3.2)
    assert c.chunk_usage == [None] * 6 + [16]  # usage only at the end


def _mock(handler) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


def test_http_error_body_is_reported():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "budget must be <= 16, got 99", "type":
                                                   "invalid_request_error", "param": "ddtree.budget"}})

    _, c = _complete(BenchTarget(url="http://server.test", model="m"),
                     {"prompt": "x", "max_tokens": 4, "stream": True}, _mock(handler))
    assert c.error == "HTTP 400: budget must be <= 16, got 99" and c.status_code == 400


def test_error_event_inside_a_stream_is_reported():
    events = ('data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
              'data: {"error":{"message":"the engine failed on this request: boom","type":"server_error"}}\n\n'
              "data: [DONE]\n\n")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})

    _, c = _complete(BenchTarget(url="http://server.test", model="m"),
                     {"prompt": "x", "max_tokens": 4, "stream": True}, _mock(handler))
    assert c.error == "server error: the engine failed on this request: boom"
    assert c.text == "a"


def test_missing_usage_is_an_error_not_a_chunk_count():
    events = ('data: {"choices":[{"index":0,"text":"a b","finish_reason":null}]}\n\n'
              'data: {"choices":[{"index":0,"text":" c","finish_reason":"length"}]}\n\n'
              "data: [DONE]\n\n")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})

    _, c = _complete(BenchTarget(url="http://server.test", model="m"),
                     {"prompt": "x", "max_tokens": 4, "stream": True}, _mock(handler))
    assert c.completion_tokens is None
    assert c.error is not None and "usage" in c.error


def test_connection_refused_is_an_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, c = _complete(BenchTarget(url=f"http://127.0.0.1:{port}", model="m", timeout_s=5),
                     {"prompt": "x", "max_tokens": 4, "stream": True})
    assert c.error is not None and "Connect" in c.error


def test_api_key_is_sent_as_bearer_token():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers.get("authorization")
        seen["body"] = json.loads(request.content)
        return httpx.Response(200, json={"choices": [{"text": "ok", "finish_reason": "stop"}],
                                         "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    _, c = _complete(BenchTarget(url="http://server.test/v1", model="m", api_key="sekrit"),
                     {"prompt": "x", "max_tokens": 4, "stream": False}, _mock(handler))
    assert c.error is None and c.text == "ok"
    assert seen["auth"] == "Bearer sekrit" and "stream_options" not in seen["body"]


@pytest.mark.parametrize("field,value", [("url", "localhost:8000"), ("engine", "tgi"), ("endpoint", "responses"),
                                         ("timeout_s", 0), ("extra_body", [1])])
def test_target_validation(field, value):
    kwargs = {"url": "http://x", field: value}
    with pytest.raises(ConfigError, match=field.split("_")[0]):
        BenchTarget(**kwargs).validated()


def test_base_url_strips_v1():
    assert BenchTarget(url="http://h:1/v1/").base_url == "http://h:1"
    assert BenchTarget(url="http://h:1").base_url == "http://h:1"


def test_model_resolution_errors_say_what_is_wrong():
    def not_ready(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"status": "starting"})

    def empty(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"object": "list", "data": []})

    async def resolve(handler):
        async with OpenAIClient(BenchTarget(url="http://server.test"), transport=_mock(handler)) as client:
            return await client.model()

    with pytest.raises(ConfigError, match="HTTP 503"):
        asyncio.run(resolve(not_ready))
    with pytest.raises(ConfigError, match="lists no model"):
        asyncio.run(resolve(empty))


def _logprob_server(bodies: list[dict], payload: dict) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [payload], "usage": {"completion_tokens": 2}})

    return httpx.MockTransport(handler)


def test_log_probs_are_requested_and_parsed_in_both_endpoint_shapes():
    # chat (OpenAI's shape): content items with their top_logprobs lists
    chat_choice = {"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "ab"},
                   "logprobs": {"content": [
                       {"token": "a", "logprob": -0.1, "bytes": [97],
                        "top_logprobs": [{"token": "a", "logprob": -0.1}, {"token": "c", "logprob": -2.5}]},
                       {"token": "b", "logprob": -0.3, "bytes": [98], "top_logprobs": [{"token": "b", "logprob": -0.3}]},
                   ], "refusal": None}}
    bodies: list[dict] = []
    _, c = _complete(BenchTarget(url="http://t", endpoint="chat"), {"prompt": "x", "max_tokens": 2, "stream": False,
                                                                 "logprobs": 2}, _logprob_server(bodies, chat_choice))
    assert bodies[0]["logprobs"] is True and bodies[0]["top_logprobs"] == 2
    assert c.tokens == ["a", "b"] and c.token_logprobs == [-0.1, -0.3] and c.token_ids is None
    assert c.top_logprobs == [[("a", -0.1, None), ("c", -2.5, None)], [("b", -0.3, None)]]
    # completions (vLLM with return_tokens_as_token_ids): dicts keyed by token, ids spelled token_id:N
    comp_choice = {"index": 0, "finish_reason": "length", "text": "ab", "logprobs": {
        "tokens": ["token_id:7", "token_id:9"], "token_logprobs": [-0.2, -0.05], "text_offset": [0, 1],
        "top_logprobs": [{"token_id:8": -1.9, "token_id:7": -0.2}, {"token_id:9": -0.05}]}}
    bodies.clear()
    _, c = _complete(BenchTarget(url="http://t"), {"prompt": "x", "max_tokens": 2, "stream": False, "logprobs": 1},
                  _logprob_server(bodies, comp_choice))
    assert bodies[0]["logprobs"] == 1 and "top_logprobs" not in bodies[0]
    assert c.token_ids == [7, 9] and c.tokens == ["token_id:7", "token_id:9"]
    assert c.top_logprobs[0] == [("token_id:7", -0.2, 7), ("token_id:8", -1.9, 8)]  # most probable first
    bodies.clear()
    _, c = _complete(BenchTarget(url="http://t"), {"prompt": "x", "max_tokens": 2, "stream": False},
                  _logprob_server(bodies, {**comp_choice, "logprobs": None}))
    assert "logprobs" not in bodies[0] and c.tokens is None


def test_bad_logprobs_argument_is_a_config_error():
    with pytest.raises(ConfigError, match="logprobs must be None or an integer >= 0"):
        _complete(BenchTarget(url="http://t"), {"prompt": "x", "max_tokens": 2, "stream": False, "logprobs": -1},
                  _logprob_server([], {}))
