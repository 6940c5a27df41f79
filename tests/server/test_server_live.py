"""The server on real sockets: uvicorn on loopback in this process (slot and queue behaviour, disconnects)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from server_helpers import threaded_server

from ddtree.server.app import create_app

LONG = {"prompt": "hello world", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}


async def next_event(lines) -> str:
    """The next SSE data line from ``lines = response.aiter_lines()``. The caller keeps ``lines`` alive: a
    finalized line iterator closes the response, which is a disconnect the server would (rightly) act on."""
    async for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("stream ended before its next event")


async def wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture
def one_slot(tiny_engine_factory):
    """An engine with one KV slot and room for one waiting request, served by uvicorn on loopback."""
    engine = tiny_engine_factory(max_batch=1, max_queue=1, max_len=2048, max_budget=16)
    app = create_app(engine)
    with threaded_server(app) as server:
        yield engine, server.url, app.state.queue


def test_disconnect_cancels_and_frees_the_slot(one_slot):
    engine, url, queue = one_slot

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as hog, httpx.AsyncClient(base_url=url, timeout=60) as c:
            async with hog.stream("POST", "/v1/completions", json=LONG) as running:
                assert running.status_code == 200
                hog_lines = running.aiter_lines()
                await next_event(hog_lines)
                async with c.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 3}) as waiting:
                    assert waiting.status_code == 200
                    await wait_until(lambda: queue()["requests"] == 1)  # waiting in the server's queue
                    await next_event(hog_lines)  # still streaming, still holding the only slot
                    snap = engine.snapshot()
                    assert snap.running == 1 and snap.queued == 0 and not snap.requests_total
                    assert queue()["requests"] == 1
                    await hog.aclose()  # the client goes away mid-stream
                    body = await waiting.aread()  # ... so the waiting request gets the slot and finishes
                    assert body.decode().endswith("data: [DONE]\n\n")
        await wait_until(lambda: engine.snapshot().running == 0)

    asyncio.run(main())
    snap = engine.snapshot()
    assert snap.requests_total.get("cancelled") == 1 and snap.requests_total.get("length") == 1
    assert snap.generation_tokens_total < 2000


def test_non_streaming_disconnect_cancels(one_slot):
    engine, url, _ = one_slot
    body = {**LONG, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    deadline = time.monotonic() + 20
    while engine.snapshot().requests_total.get("cancelled") != 1:
        assert time.monotonic() < deadline, engine.snapshot()
        time.sleep(0.01)
    assert engine.snapshot().running == 0
    r = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_full_queue_answers_503_with_retry_after(one_slot):
    engine, url, queue = one_slot

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as a, httpx.AsyncClient(base_url=url, timeout=60) as b:
            async with a.stream("POST", "/v1/completions", json=LONG) as running:
                running_lines = running.aiter_lines()
                await next_event(running_lines)
                async with b.stream("POST", "/v1/completions", json=LONG) as queued:
                    assert queued.status_code == 200
                    await wait_until(lambda: queue()["requests"] == 1)
                    r = await b.post("/v1/completions", json={**LONG, "stream": False})
                    assert r.status_code == 503
                    assert int(r.headers["retry-after"]) >= 1
                    error = r.json()["error"]
                    assert error["code"] == "queue_full" and "queue" in error["message"]
                    metrics = (await b.get("/metrics")).text
                    assert 'ddtree:requests_total{model_name="tiny",outcome="queue_full"} 1.0' in metrics
                    await next_event(running_lines)
                    assert engine.snapshot().running == 1 and not engine.snapshot().requests_total

    asyncio.run(main())


def test_health_is_503_until_the_engine_is_ready(tiny_engine_factory):
    """An engine built by a factory loads after the server starts; /health and generation answer 503 meanwhile."""
    import threading

    release = threading.Event()

    def slow_factory():
        release.wait(30)
        return tiny_engine_factory(max_batch=2, max_len=64, max_budget=16)

    app = create_app(engine_factory=slow_factory)
    with threaded_server(app) as server:
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "not_ready"
        release.set()
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = httpx.post(server.url + "/v1/completions",
                       json={"prompt": "hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_failed_engine_start_is_reported(tiny_engine_factory):
    failures: list[BaseException] = []

    def broken_factory():
        raise RuntimeError("no such checkpoint")

    app = create_app(engine_factory=broken_factory, on_startup_failure=failures.append)
    with threaded_server(app) as server:
        deadline = time.monotonic() + 10
        while not failures:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        assert "no such checkpoint" in r.json()["message"]


@pytest.mark.parametrize("client_leaves", [True, False])
def test_stream_cancelled_even_if_the_client_leaves_before_the_first_event(client_leaves):
    """The response itself cancels when it ends early, even if its event generator never started."""
    from ddtree.server.app import _CancellingStreamingResponse

    started, cancelled, sent = [], [], []

    async def events():
        started.append(True)
        yield "data: [DONE]\n\n"

    async def receive():
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    async def send(message):
        if client_leaves:
            raise OSError("connection reset by peer")
        sent.append(message)

    async def main() -> None:
        response = _CancellingStreamingResponse(events(), cancel=lambda: cancelled.append(True),
                                                media_type="text/event-stream")
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        if client_leaves:
            with pytest.raises(OSError):
                await response(scope, receive, send)
        else:
            await response(scope, receive, send)

    asyncio.run(main())
    assert started == ([] if client_leaves else [True])
    assert cancelled == ([True] if client_leaves else [])
    assert client_leaves or sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
