"""``ddtree serve``: build an :class:`EngineConfig` from flags and run the OpenAI server under uvicorn.

The flags mirror :class:`~ddtree.engine.config.EngineConfig` (engine limits) and
:class:`~ddtree.engine.api.TreeSettings` (the default tree, which requests override per request and
``POST /server_config`` changes live). The server listens at once and loads the models in the background, so
``GET /health`` answers 503 until the engine is warm.

Keys: ``--api-key`` (or ``DDTREE_API_KEY``, read here once, so keys stay off the command line) is required as
``Authorization: Bearer <key>`` on every route but ``/health`` and ``/metrics``; ``--admin-api-key`` (or
``DDTREE_ADMIN_API_KEY``) on routes that change server state, which without it are served only when the server
listens on loopback (see :mod:`ddtree.server.auth`). Bounds on bodies, prompts and the queue:
:mod:`ddtree.server.limits`, :mod:`ddtree.server.admission`.

SIGTERM stops the server gracefully: uvicorn stops accepting connections while the engine refuses new work and
lets in-flight requests finish for up to ``--drain-timeout`` seconds; what is still running then is aborted
(a stream gets an error event and ``[DONE]``, a plain request a 503), and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

import typer
import uvicorn

from ddtree.engine.config import EngineConfig
from ddtree.engine.options import engine_options, tree_settings
from ddtree.errors import ConfigError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ddtree.server.app import EngineHost

logger = logging.getLogger("ddtree.server")

EXIT_OK = 0
EXIT_ENGINE_FAILED = 1


def serve_app(
    app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0, log_level: str = "info"
) -> int:
    """Run ``app`` (from :func:`~ddtree.server.app.create_app`) under uvicorn until SIGTERM/SIGINT; the exit code.

    Returns 0 after a graceful stop (SIGTERM included) and 1 when the engine failed to load or start.
    An app whose access policy was built for loopback only (the default) refuses to listen anywhere else."""
    from ddtree.server.auth import is_loopback

    policy = getattr(app.state, "access", None)
    if policy is not None and policy.loopback_only and not is_loopback(host):
        raise ConfigError(f"the app was built for a loopback-only server but would listen on {host!r}; build it "
                          "with create_app(access=AccessPolicy(loopback_only=False, ...))")
    if policy is not None and policy.api_key is None and not is_loopback(host):
        logger.warning("listening on %s without --api-key: anyone who can reach the port can generate", host)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level == "debug",
        # A backstop only: the engine's own drain ends every request by drain_timeout (see _DrainingServer).
        timeout_graceful_shutdown=drain_timeout + _GRACE_AFTER_DRAIN_S,
    )
    server = _DrainingServer(config, app.state.host)
    failures: list[BaseException] = []

    def engine_failed(exc: BaseException) -> None:
        failures.append(exc)
        server.should_exit = True  # read by uvicorn's main loop every 0.1 s

    app.state.host.on_startup_failure = engine_failed
    in_main_thread = threading.current_thread() is threading.main_thread()
    # uvicorn re-raises the signal that stopped it once it has restored the previous handler; with the default
    # handler that would kill the process by SIGTERM after a clean drain. A no-op handler turns it into exit 0.
    previous = signal.signal(signal.SIGTERM, _stopped_by_sigterm) if in_main_thread else None
    try:
        server.run()
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    return EXIT_ENGINE_FAILED if failures else EXIT_OK


_GRACE_AFTER_DRAIN_S = 5.0


class _DrainingServer(uvicorn.Server):
    """uvicorn whose shutdown drains the engine at the same time as it waits for open connections.

    Plain uvicorn stops only after every connection has finished and then runs the app's lifespan shutdown;
    a stream still running at its graceful timeout would be cut off mid-body. Draining the engine at once
    instead ends each leftover request through the normal path (an error event and ``[DONE]`` for a stream, a
    503 for a plain request), so every client gets a well-formed answer before its connection closes."""

    def __init__(self, config: uvicorn.Config, host: EngineHost) -> None:
        super().__init__(config)
        self.host = host

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        draining = asyncio.ensure_future(asyncio.to_thread(self.host.stop))
        try:
            await super().shutdown(sockets)
        finally:
            await draining


def _stopped_by_sigterm(signum: int, frame: object) -> None:
    logger.info("stopped by SIGTERM")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


@engine_options()  # every EngineConfig field is a flag (--max-batch, --cuda-graphs/--no-cuda-graphs, ...)
def serve(
    method: str = typer.Option("ddtree", help="Default method: ar, dflash or ddtree."),
    budget: str = typer.Option("16", help="Default tree budget (draft nodes verified per round), or 'auto': chosen per round for the most tokens per second."),
    topk: int | None = typer.Option(None, help="Default cap on candidates per depth (default: none)."),
    block_size: int | None = typer.Option(None, help="Default block size (default: the drafter's trained size)."),
    draft_window: int | None = typer.Option(None, help="Default drafter context window in tokens (default: all)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 exposes the server to the network)."),
    port: int = typer.Option(8000, help="Port to listen on."),
    drain_timeout: float = typer.Option(30.0, help="Seconds to let in-flight requests finish after SIGTERM."),
    log_level: str = typer.Option("info", help="critical, error, warning, info or debug (debug adds an access log)."),
    api_key: str | None = typer.Option(None, envvar="DDTREE_API_KEY", show_default=False, help="Require 'Authorization: Bearer <key>' on every route but /health and /metrics."),
    admin_api_key: str | None = typer.Option(None, envvar="DDTREE_ADMIN_API_KEY", show_default=False, help="Key for routes that change server state (POST /server_config, stats resets); without it they are refused unless --host is loopback."),
    max_body_bytes: int | None = typer.Option(None, help="Largest request body (default: derived from --max-len and the tokenizer, so any prompt that fits is accepted)."),
    max_queued_tokens: int | None = typer.Option(None, help="Prompt + max_tokens of the requests waiting for a slot before new ones get 503 (default: 4 x max_batch x max_len)."),
    tokenizer_workers: int | None = typer.Option(None, help="Threads that tokenize and render chat templates off the event loop (default: the CPU count, at most 8)."),
    *,
    engine_config: EngineConfig,
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions) with per-request tree settings."""
    from ddtree.server.app import create_app
    from ddtree.server.auth import AccessPolicy, is_loopback
    from ddtree.server.limits import ServerLimits

    tree = tree_settings(method, budget, topk, block_size, draft_window)
    config = replace(engine_config, default_tree=tree).validated()
    access = AccessPolicy(api_key=api_key, admin_api_key=admin_api_key, loopback_only=is_loopback(host)).validated()
    limits = ServerLimits(max_body_bytes=max_body_bytes, max_queued_tokens=max_queued_tokens,
                          tokenizer_workers=tokenizer_workers).validated()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def build_engine():  # runs in the server's loading thread, after the port is open
        from ddtree.engine import Engine

        return Engine.from_config(config)

    app = create_app(engine_factory=build_engine, drain_timeout=drain_timeout, access=access, limits=limits)
    code = serve_app(app, host=host, port=port, drain_timeout=drain_timeout, log_level=log_level)
    if code != EXIT_OK:
        raise typer.Exit(code)
