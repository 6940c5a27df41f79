"""The server's admission queue on real sockets: bounded in tokens, and a client that leaves while queued never
reaches the engine."""

from __future__ import annotations

import asyncio

import httpx
from server_helpers import threaded_server
from test_server_live import LONG, next_event, wait_until

from ddtree.server.app import create_app
from ddtree.server.limits import ServerLimits


def test_queued_client_that_leaves_never_reaches_the_engine(tiny_engine_factory):
    engine = tiny_engine_factory(max_batch=1, max_queue=4, max_len=2048, max_budget=16)
    app = create_app(engine)
    queue = app.state.queue
    with threaded_server(app) as server:

        async def main() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as hog, \
                    httpx.AsyncClient(base_url=server.url, timeout=60) as other:
                async with hog.stream("POST", "/v1/completions", json=LONG) as running:
                    lines = running.aiter_lines()
                    await next_event(lines)
                    plain = asyncio.ensure_future(other.post("/v1/completions", json={**LONG, "stream": False,
                                                                                      "prompt": "x y z"}))
                    async with httpx.AsyncClient(base_url=server.url, timeout=60) as streaming:
                        async with streaming.stream("POST", "/v1/completions", json={**LONG, "prompt": "a b"}) as s:
                            assert s.status_code == 200  # streaming headers go out while it waits
                            await wait_until(lambda: queue()["requests"] == 2)
                    plain.cancel()  # both clients leave while queued
                    await wait_until(lambda: queue()["requests"] == 0)
                    assert queue()["tokens"] == 0 and queue()["running"] == 1
                    await next_event(lines)
            await wait_until(lambda: engine.snapshot().running == 0 and queue()["running"] == 0)

        asyncio.run(main())
        snap = engine.snapshot()
        # Only the hog ever ran: its prompt alone was admitted, and it alone was cancelled.
        assert snap.requests_total == {"cancelled": 1}
        assert snap.prompt_tokens_total == len(engine.encode_prompt(LONG["prompt"]))
        r = httpx.post(server.url + "/v1/completions", json={**LONG, "stream": False, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_queue_bound_in_tokens_answers_503(tiny_engine_factory):
    engine = tiny_engine_factory(max_batch=1, max_queue=8, max_len=2048, max_budget=16)
    app = create_app(engine, limits=ServerLimits(max_queued_tokens=2048))
    with threaded_server(app) as server:

        async def main() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as a, \
                    httpx.AsyncClient(base_url=server.url, timeout=60) as b:
                async with a.stream("POST", "/v1/completions", json=LONG) as running:
                    lines = running.aiter_lines()
                    await next_event(lines)
                    async with b.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 1500}) as queued:
                        assert queued.status_code == 200
                        await wait_until(lambda: app.state.queue()["requests"] == 1)
                        small = await b.post("/v1/completions", json={**LONG, "stream": False, "max_tokens": 600})
                        assert small.status_code == 503 and small.headers["retry-after"]
                        error = small.json()["error"]
                        assert error["code"] == "queue_full" and "limit of 2048" in error["message"]
                        assert "tokens" in error["message"]
                        await next_event(lines)

        asyncio.run(main())
