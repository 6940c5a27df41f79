"""Fixtures for the lab tests: real HTTP servers on loopback.

- ``live_ddtree`` : the real ddtree server app (``ddtree.server.app.create_app``) over a real engine on the tiny
  random pair, served by uvicorn on a free loopback port (module-scoped: one model load per test module).
- ``replay_server`` : a small FastAPI app that answers like SGLang or vLLM by replaying recorded-format fixtures
  (``tests/lab/fixtures``): ``/v1/models``, ``/metrics`` (one text per scrape, in order), and
  ``/v1/completions`` / ``/v1/chat/completions`` streaming a recorded SSE body chunk by chunk with a pause, so
  client-side timings are real.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from lab_helpers import ReplayConfig, ThreadedUvicorn


@dataclass
class LiveDDTree:
    url: str
    engine: Any
    tokenizer: Any


@pytest.fixture(scope="module")
def live_ddtree(tiny_pair, tiny_tokenizer) -> Iterator[LiveDDTree]:
    from ddtree.engine import Engine, EngineConfig
    from ddtree.server.app import create_app

    target, drafter = tiny_pair
    config = EngineConfig(max_batch=8, max_len=512, max_budget=16, max_queue=256)
    engine = Engine.from_models(target, drafter, tiny_tokenizer, config, model_name="tiny")
    engine.start()
    try:
        with ThreadedUvicorn(create_app(engine)) as server:
            yield LiveDDTree(server.url, engine, tiny_tokenizer)
    finally:
        engine.shutdown(drain_timeout=0)


@dataclass
class Replay:
    url: str
    bodies: list[dict]  # every generation request body received, in order
    scrapes: list[int]  # how many /metrics requests were answered (a one-element list, mutated)


@pytest.fixture
def replay_server():
    """``start(ReplayConfig) -> Replay``: a recorded-format SGLang/vLLM server on loopback.

    (FastAPI resolves the handlers' annotations by name, so ``Request`` is imported at module level.)"""
    servers: list[ThreadedUvicorn] = []

    def start(config: ReplayConfig) -> Replay:
        app = FastAPI()
        bodies: list[dict] = []
        scrapes = [0]

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": "recorded-model", "object": "model",
                                                             "owned_by": config.owned_by}]})

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            if not config.metrics:
                return PlainTextResponse("not found", status_code=404)
            text = config.metrics[min(scrapes[0], len(config.metrics) - 1)]
            scrapes[0] += 1
            return PlainTextResponse(text)

        async def generate(request: Request):
            body = await request.json()
            bodies.append(body)
            if not body.get("stream"):
                return JSONResponse(config.response)

            async def events():
                for payload in config.stream:
                    await asyncio.sleep(config.pause_s)
                    yield f"data: {payload}\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        app.post("/v1/completions")(generate)
        app.post("/v1/chat/completions")(generate)
        server = ThreadedUvicorn(app).__enter__()
        servers.append(server)
        return Replay(server.url, bodies, scrapes)

    yield start
    for server in servers:
        server.__exit__(None, None, None)
