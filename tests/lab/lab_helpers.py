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


def shifted_tree_positions(node: int, shift: int):
    """``benchmarks/divergence_gate.py``'s broken verify (a tree node's RoPE position shifted), loaded from the
    script by path: the gate tests use the very double the GPU benchmark runs."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "divergence_gate.py"
    spec = importlib.util.spec_from_file_location("divergence_gate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.shifted_tree_positions(node, shift)


def md_section(md: str, title: str) -> str:
    """The body of the markdown section ``## title`` (up to the next ``## `` heading)."""
    import re

    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", md, flags=re.S | re.M)
    assert match, f"section {title!r} missing"
    return match.group(1)


def md_table(text: str) -> list[list[str]]:
    """The header and body rows of the first markdown table in ``text``, cells stripped (escaped pipes kept)."""
    import re

    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[:1] + rows[2:]]
