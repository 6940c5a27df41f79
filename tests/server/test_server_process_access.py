"""``python -m ddtree.server`` with keys from the environment and the default body limit, over real sockets."""

from __future__ import annotations

import os
import threading

import httpx
import pytest
from server_helpers import healthy_server

pytestmark = pytest.mark.slow  # a server process takes a few seconds to import torch and load

USER, ADMIN = "process-user-key", "process-admin-key"
FLAGS = ["--device", "cpu", "--max-batch", "4", "--max-len", "256", "--max-budget", "16", "--budget", "4",
         "--log-level", "warning"]
OK = {"prompt": "hello world", "max_tokens": 2, "temperature": 0}
TEN_MB = 10 * 2**20


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("DDTREE_API_KEY", USER)  # keys from the environment, as a deployment passes them
    monkeypatch_module.setenv("DDTREE_ADMIN_API_KEY", ADMIN)
    with healthy_server(tiny_model_dirs, FLAGS, tmp_path_factory.mktemp("server")) as proc:
        yield proc


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_keys_from_the_environment(server):
    assert os.environ.get("DDTREE_API_KEY") == USER
    for headers in ({}, auth("wrong")):
        r = httpx.post(server.url + "/v1/completions", json=OK, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/completions", json=OK, headers=auth(USER), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = httpx.post(server.url + "/server_config", json={"ddtree": {"budget": 2}}, headers=auth(USER), timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    r = httpx.post(server.url + "/server_config", json={"ddtree": {"budget": 4}}, headers=auth(ADMIN), timeout=30)
    assert r.status_code == 200
    info = httpx.get(server.url + "/server_info", headers=auth(USER), timeout=30).json()
    assert info["server"]["auth"] == {"api_key": True, "admin_api_key": True, "loopback_only": True}
    assert USER not in str(info) and ADMIN not in str(info)


def test_oversize_body_is_413_with_and_without_content_length(server):
    limit = httpx.get(server.url + "/server_info", headers=auth(USER)).json()["server"]["limits"]["max_body_bytes"]
    body = b'{"prompt": "' + b"x" * (limit + 10) + b'"}'
    headers = {**auth(USER), "content-type": "application/json"}
    r = httpx.post(server.url + "/v1/completions", content=body, headers=headers, timeout=30)
    assert r.status_code == 413 and f"the limit is {limit} bytes" in r.json()["error"]["message"]

    def chunked():
        for i in range(0, len(body), 65536):
            yield body[i:i + 65536]

    r = httpx.post(server.url + "/v1/completions", content=chunked(), headers=headers, timeout=30)
    assert r.status_code == 413 and f"more than {limit} bytes" in r.json()["error"]["message"]
    # the connection pool's next request is served normally
    assert httpx.post(server.url + "/v1/completions", json=OK, headers=auth(USER), timeout=30).status_code == 200


def test_health_answers_while_a_10mb_prompt_is_refused(server):
    """A 10 MB prompt, sent chunked, is refused while /health keeps answering (each within a 1 s timeout)."""
    body = b'{"prompt": "' + b"word " * (TEN_MB // 5) + b'", "max_tokens": 4}'
    headers = {**auth(USER), "content-type": "application/json"}
    result: dict[str, object] = {}
    started = threading.Event()

    def send() -> None:
        def chunked():
            started.set()
            for i in range(0, len(body), 16384):
                yield body[i:i + 16384]

        try:
            result["status"] = httpx.post(server.url + "/v1/completions", content=chunked(), headers=headers,
                                          timeout=60).status_code
        except httpx.HTTPError as exc:  # recorded, so the assertion below names it
            result["status"] = repr(exc)

    sender = threading.Thread(target=send)
    sender.start()
    started.wait(30)
    health = [httpx.get(server.url + "/health", timeout=1.0).status_code for _ in range(5)]
    sender.join(60)
    assert health == [200] * 5
    assert result["status"] == 413
