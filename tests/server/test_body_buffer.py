"""The body limit's buffer: a body that spills to its temporary file comes back byte for byte, a refused one
leaves no file open, and the middleware hands the app exactly what was sent (ASGI driven directly)."""

from __future__ import annotations

import asyncio
import os

import pytest

from ddtree.server import limits
from ddtree.server.limits import BodyBuffer, BodyLimitMiddleware


def test_spilled_body_reads_back_identical() -> None:
    data = os.urandom(10_000)
    buffer = BodyBuffer(spool_bytes=1000)
    for i in range(0, len(data), 333):
        buffer.add(data[i:i + 333])
    assert buffer.size == len(data)
    assert buffer._file is not None  # it spilled: the bytes past 1000 went to the file
    assert buffer.read() == data
    buffer.close()
    assert buffer._file is None


def test_small_body_stays_in_memory() -> None:
    buffer = BodyBuffer(spool_bytes=1000)
    buffer.add(b"x" * 600)
    buffer.add(b"y" * 400)
    assert buffer._file is None
    assert buffer.read() == b"x" * 600 + b"y" * 400


def _drive(chunks: list[bytes], limit: int) -> tuple[int | None, bytes | None]:
    """Send ``chunks`` as one chunked request through the middleware: (status sent, body the app saw)."""
    seen: dict[str, bytes] = {}
    sent: dict[str, int] = {}

    async def app(scope, receive, send) -> None:
        seen["body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0)

    async def send(message) -> None:
        if message["type"] == "http.response.start":
            sent["status"] = message["status"]

    mw = BodyLimitMiddleware(app, lambda: limit, lambda path: None)
    asyncio.run(mw({"type": "http", "path": "/v1/completions", "headers": []}, receive, send))
    return sent.get("status"), seen.get("body")


@pytest.mark.parametrize("total", [999, 1000, 1001, 4000, 5000])
def test_middleware_passes_bodies_within_the_limit_through_the_spool(monkeypatch, total: int) -> None:
    monkeypatch.setattr(limits, "SPOOL_BYTES", 1000)
    data = os.urandom(total)
    status, body = _drive([data[i:i + 700] for i in range(0, total, 700)], limit=5000)
    assert status == 200 and body == data


def test_middleware_refuses_past_the_limit_after_spilling(monkeypatch) -> None:
    monkeypatch.setattr(limits, "SPOOL_BYTES", 1000)
    status, body = _drive([b"a" * 700] * 10, limit=5000)
    assert status == 413 and body is None
