"""The body limit over real sockets: ``python -m ddtree.server --max-body-bytes`` (real uvicorn, h11).

Oversize bodies get a 413 naming the limit whether they declare a Content-Length or arrive chunked, at any
size past the limit; the 413 closes the connection, so the server never reads (and the client need not send)
the rest of the upload; a body of exactly the limit is not refused for its size. Raw sockets check what the
server does on the wire (an HTTP client would hide a kept-alive connection behind its pool)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from server_helpers import healthy_server

pytestmark = pytest.mark.slow  # a server process takes a few seconds to import torch and load

LIMIT = 65536
FLAGS = ["--device", "cpu", "--max-batch", "4", "--max-len", "256", "--max-budget", "16", "--budget", "4",
         "--max-body-bytes", str(LIMIT), "--log-level", "warning"]
OK = {"prompt": "hello world", "max_tokens": 2, "temperature": 0}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    with healthy_server(tiny_model_dirs, FLAGS, tmp_path_factory.mktemp("server")) as proc:
        yield proc


def oversize(size: int) -> bytes:
    return b'{"prompt": "' + b"x" * size + b'", "max_tokens": 2}'


def read_until_eof(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; a server that keeps the connection open times out here."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def raw_request(port: int, head: bytes, body: bytes) -> tuple[bytes, bytes]:
    """Send ``head`` and ``body`` (and nothing after it: no chunk terminator, no rest of a declared body), then
    read until the server closes. Returns (status line, rest)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(head + body)
        data = read_until_eof(sock)
    status, _, rest = data.partition(b"\r\n")
    return status, rest


def test_sizes_past_the_limit_are_413_declared_and_chunked(server):
    """10x and 40x the limit, with a Content-Length and chunked: 413, the limit in the message, connection
    closed; a request on a new connection is served afterwards."""
    for factor in (10, 40):
        body = oversize(factor * LIMIT)
        r = httpx.post(server.url + "/v1/completions", content=body, headers=JSON, timeout=30)
        assert r.status_code == 413, (factor, r.text)
        assert f"Content-Length {len(body)}" in r.json()["error"]["message"]
        assert f"the limit is {LIMIT} bytes" in r.json()["error"]["message"]
        assert r.headers["connection"] == "close"

        def chunked(data: bytes = body):
            for i in range(0, len(data), 16384):
                yield data[i:i + 16384]

        r = httpx.post(server.url + "/v1/completions", content=chunked(), headers=JSON, timeout=30)
        assert r.status_code == 413, (factor, r.text)
        assert f"more than {LIMIT} bytes" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "request_too_large"
        assert r.headers["connection"] == "close"
    r = httpx.post(server.url + "/v1/completions", json=OK, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_declared_oversize_body_is_refused_before_it_is_sent(server):
    """Headers alone, declaring one byte over the limit: the 413 comes and the connection closes although no body
    byte was sent (a kept-alive connection would wait for the declared bytes and this read would time out)."""
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(LIMIT + 1).encode() + b"\r\n\r\n")
    status, rest = raw_request(server.port, head, b"")
    assert status == b"HTTP/1.1 413 Request Entity Too Large", status
    assert b"connection: close" in rest.lower()
    assert f"Content-Length {LIMIT + 1}".encode() in rest


def test_chunked_upload_is_refused_at_the_chunk_that_crosses_the_limit(server):
    """Chunks summing to one byte over the limit and no terminating chunk: the 413 comes and the connection
    closes without the server waiting for the rest of the upload."""
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    piece = b"x" * 4096
    count = LIMIT // len(piece)
    body = (b"%x\r\n" % len(piece) + piece + b"\r\n") * count + b"1\r\nx\r\n"  # LIMIT + 1 bytes, no 0-chunk
    status, rest = raw_request(server.port, head, body)
    assert status == b"HTTP/1.1 413 Request Entity Too Large", status
    assert b"connection: close" in rest.lower()
    assert f"more than {LIMIT} bytes".encode() in rest


def test_body_of_exactly_the_limit_is_served(server):
    """A valid request padded with JSON whitespace to exactly LIMIT bytes (declared and chunked) is answered,
    not refused for its size."""
    compact = json.dumps(OK).encode()
    body = compact[:-1] + b" " * (LIMIT - len(compact)) + b"}"
    assert len(body) == LIMIT
    r = httpx.post(server.url + "/v1/completions", content=body, headers=JSON, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/completions", content=iter([body[:1000], body[1000:]]), headers=JSON,
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers.get("connection") != "close"  # only a refusal closes the connection
