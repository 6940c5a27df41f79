"""Helpers shared by the lab tests: a threaded uvicorn on loopback and recorded-fixture readers."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

FIXTURES = Path(__file__).parent / "fixtures"


class ThreadedUvicorn:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) from a background thread."""

    def __init__(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedUvicorn:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def read_sse_fixture(name: str) -> list[str]:
    """The ``data:`` payloads of a recorded SSE body (``[DONE]`` included), in order."""
    text = (FIXTURES / name).read_text()
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


@dataclass
class ReplayConfig:
    owned_by: str  # "sglang" or "vllm"
    stream: list[str]  # SSE payloads replayed for every generation request
    metrics: list[str] = field(default_factory=list)  # /metrics texts, one per scrape (the last one repeats)
    response: dict | None = None  # the non-streamed body, when requests ask for stream=false
    pause_s: float = 0.02  # between streamed events


@dataclass
class Replay:
    url: str
    bodies: list[dict]  # every generation request body received, in order
    scrapes: list[int]  # how many /metrics requests were answered (a one-element list, mutated)


def load_json_fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())
