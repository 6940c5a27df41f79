"""API keys and request bounds through httpx's ASGITransport: who may call what, and what a body may cost."""

from __future__ import annotations

import json

import pytest
from server_helpers import SyncClient

from ddtree.errors import ConfigError
from ddtree.server.app import create_app
from ddtree.server.auth import AccessPolicy, is_loopback
from ddtree.server.limits import ServerLimits, _shrink_factor, prompt_char_bound

USER, ADMIN = "user-key-123", "admin-key-456"
OK = {"prompt": "hello world", "max_tokens": 2, "temperature": 0}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def keyed(engine) -> SyncClient:
    return SyncClient(create_app(engine, access=AccessPolicy(api_key=USER, admin_api_key=ADMIN)))


@pytest.mark.parametrize("headers", [{}, bearer("wrong"), {"authorization": USER}, {"authorization": "Basic x"}],
                         ids=["none", "wrong", "no-scheme", "basic"])
def test_missing_or_wrong_key_is_401(keyed, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/server_info"),
                         ("GET", "/v1/no_such_route")):
        r = keyed.request(method, path, headers=headers, json=OK)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert ("missing" if "authorization" not in headers or "Bearer " not in headers["authorization"]
                else "invalid") in error["message"]


def test_right_key_is_served_and_health_metrics_stay_open(keyed):
    assert keyed.get("/v1/models", headers=bearer(USER)).status_code == 200
    r = keyed.post("/v1/completions", headers=bearer(USER), json=OK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert keyed.get("/v1/models", headers=bearer(ADMIN)).status_code == 200  # the admin key is a user key too
    assert keyed.get("/health").status_code == 200
    metrics = keyed.get("/metrics")
    assert metrics.status_code == 200
    assert 'ddtree:requests_total{model_name="tiny",outcome="unauthorized"} 0.0' in metrics.text


def test_refusals_are_counted(keyed):
    keyed.post("/v1/completions", json=OK)
    assert 'ddtree:requests_total{model_name="tiny",outcome="unauthorized"} 1.0' in keyed.get("/metrics").text


def test_admin_route_needs_the_admin_key(keyed, engine):
    before = engine.defaults.to_dict()
    r = keyed.post("/server_config", headers=bearer(USER), json={"ddtree": {"budget": 3}})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert r.json()["error"]["type"] == "permission_error"
    assert keyed.post("/server_config", json={"ddtree": {"budget": 3}}).status_code == 401
    assert engine.defaults.to_dict() == before
    assert keyed.get("/server_config", headers=bearer(USER)).status_code == 200  # reading is a user route
    r = keyed.post("/server_config", headers=bearer(ADMIN), json={"ddtree": {"budget": 3}})
    assert r.status_code == 200 and r.json()["ddtree"]["budget"] == 3


def test_exposed_server_without_admin_key_refuses_admin_routes(engine):
    client = SyncClient(create_app(engine, access=AccessPolicy(api_key=USER, loopback_only=False)))
    r = client.post("/server_config", headers=bearer(USER), json={"ddtree": {"budget": 3}})
    assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
    assert client.get("/server_config", headers=bearer(USER)).status_code == 200
    open_loopback = SyncClient(create_app(engine))  # no keys, loopback: what tests and the sweep use
    assert open_loopback.post("/server_config", json={"ddtree": {"budget": 3}}).status_code == 200


def test_policy_validation_and_loopback():
    with pytest.raises(ConfigError, match="non-empty"):
        AccessPolicy(api_key="  ").validated()
    with pytest.raises(ConfigError, match="must differ"):
        AccessPolicy(api_key="k", admin_api_key="k").validated()
    assert [is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost")] == [True] * 5
    assert [is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.2", "example.com")] == [False] * 4


def test_serve_app_refuses_a_loopback_app_on_an_open_address(engine):
    from ddtree.server.cli import serve_app

    with pytest.raises(ConfigError, match="loopback-only"):
        serve_app(create_app(engine), host="0.0.0.0", port=1)


# ------------------------------------------------------------------------------------------------- bounds


def test_body_over_the_limit_is_413_declared_or_chunked(engine):
    client = SyncClient(create_app(engine, limits=ServerLimits(max_body_bytes=4096)))
    body = json.dumps({**OK, "prompt": "x" * 5000}).encode()
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "request_too_large"

    async def chunked():  # a generator body: sent without a Content-Length
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    r = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "more than 4096 bytes" in r.json()["error"]["message"]
    # exactly at the limit is read and parsed (then refused by the prompt check, not for its size)
    exact = json.dumps({**OK, "prompt": "x"}).encode()
    exact = exact[:-1] + b" " * (4096 - len(exact)) + b"}"
    assert len(exact) == 4096
    r = client.post("/v1/completions", content=exact, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert 'ddtree:requests_total{model_name="tiny",outcome="too_large"} 2.0' in client.get("/metrics").text


def test_default_body_limit_carries_the_longest_prompt_that_fits(app, engine):
    limits = app.state.host.limits
    assert limits.prompt_chars == engine.config.max_len * limits.max_token_bytes  # byte-level BPE: no normalizer
    assert limits.max_body_bytes >= 6 * limits.prompt_chars


def test_prompt_exactly_at_the_character_bound_reaches_the_tokenizer(client, app, engine):
    """``prompt_chars`` characters pass the pre-check (the engine then counts tokens); one more is refused
    before tokenization with a message naming the bound."""
    bound = app.state.host.limits.prompt_chars
    r = client.post("/v1/completions", json={**OK, "prompt": "a" * bound})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]
    assert "characters" not in r.json()["error"]["message"]  # the engine's token count, not the pre-check
    r = client.post("/v1/completions", json={**OK, "prompt": "a" * (bound + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert f"at most {bound} can fit" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * (bound + 1)}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_prompt_of_the_longest_tokens_at_the_context_limit_is_served(client, app, engine, tiny_tokenizer):
    """A prompt of ``max_len - 1`` of the longest repeatable token (a space-led word: the pre-tokenizer splits
    before each space, so each copy is one token) plus ``max_tokens = 1`` fills the context exactly."""
    vocab = range(len(tiny_tokenizer))
    words = [t for t in (tiny_tokenizer.decode([i]) for i in vocab) if t.startswith(" ") and t[1:].isalpha()]
    word = max(words, key=len)
    n = engine.config.max_len - 1
    prompt = word * n
    assert len(tiny_tokenizer.encode(prompt, add_special_tokens=False)) == n
    assert len(prompt) <= app.state.host.limits.prompt_chars
    r = client.post("/v1/completions", json={**OK, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}


def test_token_id_prompt_longer_than_the_context_is_refused_unread(client, engine):
    r = client.post("/v1/completions", json={**OK, "prompt": [1] * (engine.config.max_len + 1)})
    assert r.status_code == 400 and "token ids, more than the context limit" in r.json()["error"]["message"]


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("stop", [f"s{i}" for i in range(17)], "at most 16"),
    ("stop", "x" * 1025, "at most 1024 are allowed"),
    ("stop_token_ids", list(range(1025)), "at most 1024 are allowed"),
])
def test_field_limits(client, field, value, fragment):
    r = client.post("/v1/completions", json={**OK, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field and fragment in r.json()["error"]["message"]


def test_normalizer_shrink_factors():
    assert _shrink_factor(None) == 1
    assert _shrink_factor({"type": "NFC"}) == 4
    assert _shrink_factor({"type": "Strip", "strip_left": True, "strip_right": True}) is None
    sentencepiece = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    assert _shrink_factor(sentencepiece) == 1
    assert _shrink_factor({"type": "Replace", "pattern": {"String": "ab"}, "content": ""}) is None


def test_char_bound_counts_special_tokens(tiny_tokenizer):
    """``<|im_start|>`` in a text is one token of 12 characters: the bound must allow 12 per token at least."""
    bound = prompt_char_bound(tiny_tokenizer, 10)
    assert bound.max_token_bytes >= len("<|im_start|>")
    assert bound.chars == 10 * bound.max_token_bytes
