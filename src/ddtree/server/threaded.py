"""Serve an ASGI app (usually ``create_app(engine)``) with uvicorn in a background thread on a loopback port.

The sweep measures every engine the same way, over HTTP with ``run_bench`` / ``run_humaneval``; for the default
in-process engine that means the real ``ddtree.server`` app under uvicorn in a background thread (uvicorn only
installs signal handlers in the main thread, so the caller keeps its own). Tests use it for real-socket checks.
The socket is bound before the thread starts, so there is no window in which another process could take the port.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx

from ddtree.errors import EngineError


class ThreadedServer:
    """``with ThreadedServer(app) as server: server.url`` -- ``app`` served on 127.0.0.1 from a thread.

    ``wait_for_health``: start() returns once ``/health`` answers 200 (an app over a running engine); otherwise as
    soon as uvicorn listens (tests that watch ``/health`` change). An engine given to ``create_app`` running already
    is left running at exit: its owner (e.g. the sweep, for the whole campaign) stops it."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", ready_timeout_s: float = 60.0,
                 wait_for_health: bool = True, **uvicorn_config: Any) -> None:
        import uvicorn

        self.host = host
        self.ready_timeout_s = ready_timeout_s
        self.wait_for_health = wait_for_health
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port = int(self._sock.getsockname()[1])
        config = uvicorn.Config(app, **{"log_level": "warning", "access_log": False, "lifespan": "on",
                                        **uvicorn_config})
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="ddtree-http-server", daemon=True
        )
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ThreadedServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(base_url=self.url, timeout=5.0, trust_env=False) as client:
            while True:
                if not self._thread.is_alive():
                    raise EngineError("the in-process server thread exited during start-up; see the log above")
                if self._server.started and not self.wait_for_health:
                    return
                if self._server.started:
                    try:
                        if client.get("/health").status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise EngineError(f"the in-process server did not answer /health within {self.ready_timeout_s} s")
                time.sleep(0.05)

    def alive(self) -> bool:
        """Whether the server thread is still serving (it only exits on stop or on a fatal error)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=30.0)
        self._sock.close()


__all__ = ["ThreadedServer"]
