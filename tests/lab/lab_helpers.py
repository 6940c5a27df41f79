"""Helpers shared by the lab tests: a threaded uvicorn on loopback and recorded-fixture readers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree.server.threaded import ThreadedServer

FIXTURES = Path(__file__).parent / "fixtures"


def ThreadedUvicorn(app):  # noqa: N802  (kept as the tests' name for the shared server)
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) from a background thread."""
    return ThreadedServer(app, wait_for_health=False)


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
