"""HTTP helpers for the server tests: SSE parsing, an in-process uvicorn on loopback, a server subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from ddtree.server.threaded import ThreadedServer

DONE = "[DONE]"


def parse_sse(body: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``[DONE]`` kept as the string); checks the framing."""
    assert body.endswith("\n\n"), f"SSE body must end with a blank line: {body[-80:]!r}"
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), f"not an SSE data event: {block[:80]!r}"
        payload = block[len("data: "):]
        events.append(payload if payload == DONE else json.loads(payload))
    return events


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ddtree.test", timeout=60)


class SyncClient:
    """Blocking calls into an app through httpx's ASGITransport (one event loop per call)."""

    def __init__(self, app) -> None:
        self.app = app

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        async def one() -> httpx.Response:
            async with asgi_client(self.app) as client:
                return await client.request(method, path, **kwargs)

        return asyncio.run(one())

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, **kwargs)


def threaded_server(app, **uvicorn_config: Any) -> ThreadedServer:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) from a thread; returns once it listens."""
    return ThreadedServer(app, wait_for_health=False, **uvicorn_config)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m ddtree.server ARGS`` in its own process group; waits for /health 200."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddtree.server", *args, "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 120.0) -> list[int]:
        """Poll /health until 200; returns every status seen (a 503 while loading is expected)."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited early:\n{self.log_path.read_text()}"
            try:
                status = httpx.get(self.url + "/health", timeout=2).status_code
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            seen.append(status)
            if status == 200:
                return seen
            time.sleep(0.05)
        raise AssertionError(f"server not healthy after {timeout}s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.log.close()


@contextlib.contextmanager
def healthy_server(model_dirs: tuple[Path, Path], flags: list[str], log_dir: Path) -> Iterator[ServerProcess]:
    """``ddtree serve`` over the (target, drafter) directories with ``flags``, healthy, killed on exit (the module
    fixtures of the real-process tests)."""
    target, drafter = model_dirs
    proc = ServerProcess(["--target", str(target), "--draft", str(drafter), *flags], log_dir / "server.log")
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()
