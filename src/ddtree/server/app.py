"""The FastAPI application: OpenAI routes over one :class:`~ddtree.engine.Engine`, plus health, info and metrics.

Life of a request::

    body (JSON) --pydantic--> CompletionRequest / ChatCompletionRequest    400 on bad JSON or types
            --protocol--> GenerationRequest (ddtree overrides merged)      400 on unsupported or bad values
            --engine.stream(...)-->                                        400 invalid, 503 queue full
            stream: SSE chunks, [DONE]            non-stream: one JSON body when the last chunk arrives

A request that ends early on the client side (closed connection) is cancelled in the engine at once, so its KV
slot goes to the next request; the engine's own failures end that request alone with a 500 (or an error event
in a stream) and the server keeps serving.

The engine may be handed over ready (tests) or built and started in a background thread after the server starts
listening, so ``/health`` answers 503 during the minutes a large model takes to load (what SGLang and vLLM do,
and what sweep scripts poll for). The app stops only an engine it started itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree import __version__
from ddtree.engine.api import GenerationRequest, StreamChunk
from ddtree.errors import ConfigError, InvalidRequestError, QueueFullError
from ddtree.server.metrics import ServerMetrics
from ddtree.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    ServerConfigUpdate,
    error_body,
    request_param,
    token_usage,
)

if TYPE_CHECKING:
    from ddtree.engine import Engine

logger = logging.getLogger("ddtree.server")

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
QUEUE_FULL_RETRY_AFTER_S = 1
NOT_READY_RETRY_AFTER_S = 5


class _Unavailable(Exception):
    """The engine is loading, failed to load, or is shutting down: 503."""


class _ModelNotFound(Exception):
    """The request names a model this server does not serve: 404."""

    def __init__(self, requested: str, served: str) -> None:
        super().__init__(f"model {requested!r} does not exist; this server serves {served!r} (see GET /v1/models)")


class EngineHost:
    """Owns the engine's life inside the server: build (from a factory) and start off the event loop, stop at exit.

    ``on_startup_failure`` is called (from the loading thread) when building or starting the engine raises, so the
    process running the server can exit instead of answering 503 forever."""

    def __init__(
        self,
        engine: Engine | None,
        factory: Callable[[], Engine] | None,
        drain_timeout: float,
        on_startup_failure: Callable[[BaseException], None] | None,
    ) -> None:
        if (engine is None) == (factory is None):
            raise ConfigError("create_app needs exactly one of engine= and engine_factory=")
        if drain_timeout < 0:
            raise ConfigError(f"drain_timeout must be >= 0 seconds, got {drain_timeout}")
        self.engine = engine
        self._factory = factory
        self.drain_timeout = drain_timeout
        self.on_startup_failure = on_startup_failure
        self.owns_engine = False
        self.startup_error: str | None = None
        self._loader: threading.Thread | None = None
        self._stop_lock = threading.Lock()
        self._stopped = False

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready

    def require_ready(self) -> Engine:
        if not self.ready:
            raise _Unavailable(self.status_message())
        assert self.engine is not None
        return self.engine

    def status_message(self) -> str:
        if self.startup_error is not None:
            return f"engine failed to start: {self.startup_error}"
        if self.engine is None or not self.engine.ready:
            return "engine is loading or warming up; retry shortly"
        return "ok"

    def start_in_background(self) -> None:
        """Build and start the engine unless it is already running (then the caller owns it)."""
        if self.ready:
            return
        self._loader = threading.Thread(target=self._bring_up, name="ddtree-engine-loader", daemon=True)
        self._loader.start()

    def _bring_up(self) -> None:
        try:
            if self.engine is None:
                assert self._factory is not None
                self.engine = self._factory()
            self.owns_engine = True
            if not self.engine.ready:
                self.engine.start()
            logger.info("engine ready: serving %s", self.engine.model_name)
        except BaseException as exc:  # reported through /health and the failure callback, never swallowed
            self.startup_error = f"{type(exc).__name__}: {exc}"
            logger.exception("engine failed to start")
            if self.on_startup_failure is not None:
                self.on_startup_failure(exc)

    def stop(self) -> None:
        """Drain and stop an engine this host started (idempotent: the server may call it at SIGTERM and again
        at the lifespan's end). Requests still running after ``drain_timeout`` end as cancelled, which their
        handlers turn into an error event (stream) or a 503 (non-stream)."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            if self._loader is not None and self._loader.is_alive():
                logger.warning("shutting down while the engine is still loading; not waiting for it")
                return
            if self.owns_engine and self.engine is not None:
                logger.info("draining the engine (up to %.1f s)", self.drain_timeout)
                self.engine.shutdown(drain_timeout=self.drain_timeout)


def create_app(
    engine: Engine | None = None,
    *,
    engine_factory: Callable[[], Engine] | None = None,
    drain_timeout: float = 30.0,
    on_startup_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (running or not) or over the engine ``engine_factory`` builds.

    An engine that is not running yet is started by the app's lifespan (so it needs a server that runs lifespans,
    like uvicorn); a running one is used as is and left running at exit (tests share one engine among apps)."""
    host = EngineHost(engine, engine_factory, drain_timeout, on_startup_failure)
    metrics = ServerMetrics(lambda: host.engine if host.ready else None)
    started_at = time.time()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        host.start_in_background()
        yield
        await asyncio.to_thread(host.stop)

    app = FastAPI(title="ddtree", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.host = host
    app.state.metrics = metrics

    # ------------------------------------------------------------------------------------------- errors

    def refuse(request: Request, outcome: str) -> None:
        if request.url.path in GENERATION_ROUTES:
            metrics.refused(outcome)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        refuse(request, "invalid")
        message, param, code = _describe_validation_errors(exc.errors())
        return JSONResponse(error_body(message, param=param, code=code), status_code=400)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        refuse(request, "invalid")
        return JSONResponse(error_body(str(exc), param=request_param(exc.param), code="invalid_value"), status_code=400)

    @app.exception_handler(Exception)
    async def _server_fault(request: Request, exc: Exception) -> JSONResponse:
        # A bug on our side (client mistakes never get here); Starlette logs the traceback after this answer.
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}: {exc}", type_="server_error",
                                       code="internal_error"), status_code=500)

    @app.exception_handler(_ModelNotFound)
    async def _no_model(request: Request, exc: _ModelNotFound) -> JSONResponse:
        refuse(request, "not_found")
        return JSONResponse(error_body(str(exc), param="model", code="model_not_found"), status_code=404)

    @app.exception_handler(QueueFullError)
    async def _queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        refuse(request, "queue_full")
        return JSONResponse(
            error_body(str(exc) or "the request queue is full; retry later", type_="server_error", code="queue_full"),
            status_code=503,
            headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
        )

    @app.exception_handler(_Unavailable)
    async def _unavailable(request: Request, exc: _Unavailable) -> JSONResponse:
        refuse(request, "unavailable")
        return JSONResponse(
            error_body(str(exc), type_="server_error", code="not_ready"),
            status_code=503,
            headers={"Retry-After": str(NOT_READY_RETRY_AFTER_S)},
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see the OpenAI routes under /v1"
            code = "not_found"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        return JSONResponse(error_body(message, code=code), status_code=exc.status_code, headers=exc.headers)

    # --------------------------------------------------------------------------------------- info routes

    @app.get("/health")
    async def health() -> JSONResponse:
        if host.ready:
            return JSONResponse({"status": "ok"})
        status = "failed" if host.startup_error is not None else "starting"
        return JSONResponse({"status": status, "message": host.status_message()}, status_code=503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        engine = host.require_ready()
        card = {"id": engine.model_name, "object": "model", "created": int(started_at), "owned_by": "ddtree",
                "root": engine.model_name, "max_model_len": engine.config.max_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        engine = host.require_ready()
        snap = engine.snapshot()
        rounds = snap.verify_rounds_total
        info = {
            "model": engine.model_name,
            "engine": _jsonable(engine.info()),
            "default_tree": engine.defaults.to_dict(),
            "snapshot": _jsonable(snap),
            "server": {
                "ddtree_version": __version__,
                "pid": os.getpid(),
                "rss_bytes": resident_memory_bytes(),
                "uptime_s": time.time() - started_at,
                "drain_timeout_s": host.drain_timeout,
            },
            # SGLang's place for the running acceptance length (read by tools written for SGLang).
            "internal_states": [{"avg_spec_accept_length": snap.generation_tokens_total / rounds if rounds else 0.0,
                                 "num_running_reqs": snap.running, "num_queue_reqs": snap.queued}],
        }
        return JSONResponse(info)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_config")
    async def get_server_config() -> JSONResponse:
        engine = host.require_ready()
        return JSONResponse({"ddtree": engine.defaults.to_dict()})

    @app.post("/server_config")
    async def set_server_config(body: ServerConfigUpdate) -> JSONResponse:
        """Change the default tree settings live; requests already submitted keep theirs."""
        engine = host.require_ready()
        updated = engine.set_defaults(engine.defaults.merged(body.ddtree))
        logger.info("default tree settings now %s", updated)
        return JSONResponse({"ddtree": updated.to_dict()})

    # ---------------------------------------------------------------------------------- generation routes

    def check_model(engine: Engine, model: str | None) -> None:
        if model is not None and model != engine.model_name:
            raise _ModelNotFound(model, engine.model_name)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        engine = host.require_ready()
        check_model(engine, body.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompt_ids = engine.encode_prompt(body.prompt) if isinstance(body.prompt, str) else body.prompt
        request = body.to_generation_request(prompt_ids, engine.defaults, request_id)
        builder = ResponseBuilder(request_id=request_id, model=engine.model_name, chat=False)
        return await run_generation(engine, request, builder, raw, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        engine = host.require_ready()
        check_model(engine, body.model)
        # The tokenizer's chat template; the engine reports a template failure as an invalid request (400).
        prompt_ids = engine.encode_chat(body.template_messages(), **(body.chat_template_kwargs or {}))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        request = body.to_generation_request(prompt_ids, engine.defaults, request_id, engine.config.max_len)
        builder = ResponseBuilder(request_id=request_id, model=engine.model_name, chat=True)
        return await run_generation(engine, request, builder, raw, body)

    async def run_generation(engine: Engine, request: GenerationRequest, builder: ResponseBuilder, raw: Request,
                             body: CompletionRequest | ChatCompletionRequest) -> Response:
        chunks = engine.stream(request)  # validates and admits now: raises InvalidRequestError / QueueFullError
        if body.stream:
            usage = _StreamUsage(len(request.prompt_token_ids or ()), body.include_usage, body.continuous_usage)
            return _CancellingStreamingResponse(
                _sse_events(engine, chunks, request.request_id, builder, usage, metrics),
                cancel=lambda: engine.cancel(request.request_id),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete(engine, chunks, request.request_id, builder, raw, metrics)

    return app


# ---------------------------------------------------------------------------------------------- generation


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


def _failure(chunk: StreamChunk) -> tuple[int, dict[str, Any]]:
    """HTTP status and error body for a request the engine ended with ``cancelled`` or ``error``."""
    if chunk.finish_reason == "cancelled":
        message = "the request was aborted before it finished (the server is shutting down); retry it"
        return 503, error_body(message, type_="server_error", code="aborted")
    return 500, error_body(f"the engine failed on this request: {chunk.error or 'unknown error'}",
                           type_="server_error", code="engine_error")


class _CancellingStreamingResponse(StreamingResponse):
    """A streaming response that cancels its request however the response ends before the last event.

    The event generator cancels in its ``finally``, but a client that leaves before the first event is sent can
    end the response before the generator ever starts, and a generator that never started has no ``finally``
    to run. Cancelling a request that already finished is a no-op for the engine."""

    def __init__(self, content: AsyncIterator[str], *, cancel: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._cancel = cancel
        self.completed = False

    async def stream_response(self, send: Any) -> None:
        await super().stream_response(send)
        self.completed = True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.completed:
                self._cancel()


@dataclasses.dataclass
class _StreamUsage:
    """What a stream reports about token counts: nothing, a final usage chunk, or also cumulative usage on every
    chunk (``continuous``). ``completion`` counts the tokens delivered so far."""

    prompt_tokens: int
    include: bool
    continuous: bool
    completion: int = 0

    def running(self) -> dict[str, int] | None:
        return token_usage(self.prompt_tokens, self.completion) if self.continuous else None


async def _sse_events(engine: Engine, chunks: AsyncIterator[StreamChunk], request_id: str, builder: ResponseBuilder,
                      usage: _StreamUsage, metrics: ServerMetrics) -> AsyncIterator[str]:
    """SSE for one request. Closing this generator early (client gone, server stopping) cancels the request.

    Chunks whose tokens produced no text yet (an incomplete UTF-8 sequence, a possible stop-string prefix) are
    not sent; their tokens count in the next chunk's cumulative usage."""
    finished = False
    try:
        async for chunk in chunks:
            usage.completion += len(chunk.token_ids)
            if not chunk.finished:
                if chunk.text:
                    yield _sse(builder.chunk(chunk.text, None, include_usage=usage.include,
                                             running_usage=usage.running()))
                continue
            finished = True
            if chunk.finish_reason in ("cancelled", "error"):
                if chunk.text:
                    yield _sse(builder.chunk(chunk.text, None, include_usage=usage.include,
                                             running_usage=usage.running()))
                yield _sse(_failure(chunk)[1])
                yield _SSE_DONE
                return
            assert chunk.stats is not None
            metrics.finished(chunk.stats)
            final = token_usage(chunk.stats.prompt_tokens, chunk.stats.completion_tokens)
            yield _sse(builder.chunk(chunk.text, chunk.stats, include_usage=usage.include,
                                     running_usage=final if usage.continuous else None))
            if usage.include:
                yield _sse(builder.usage_chunk(chunk.stats))
            yield _SSE_DONE
            return
    finally:
        if not finished:  # the consumer left before the end: free the slot now, not when the iterator is collected
            engine.cancel(request_id)


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _complete(engine: Engine, chunks: AsyncIterator[StreamChunk], request_id: str, builder: ResponseBuilder,
                    raw: Request, metrics: ServerMetrics) -> Response:
    """Collect a non-streamed answer while watching the connection: a client that leaves cancels its request."""

    async def collect() -> tuple[str, StreamChunk]:
        parts: list[str] = []
        async for chunk in chunks:
            parts.append(chunk.text)
            if chunk.finished:
                return "".join(parts), chunk
        raise RuntimeError(f"the engine's stream for {request_id} ended without a final chunk")

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():  # client gone, or this handler cancelled (server stopping)
            collecting.cancel()
            engine.cancel(request_id)
    if not collecting.done() or collecting.cancelled():
        return Response(status_code=499)  # nobody is listening; the status is for the access log
    text, final = collecting.result()
    if final.finish_reason in ("cancelled", "error"):
        status, body = _failure(final)
        return JSONResponse(body, status_code=status)
    assert final.stats is not None
    metrics.finished(final.stats)
    return JSONResponse(builder.response(text, final.stats))


# ------------------------------------------------------------------------------------------------- helpers


def _describe_validation_errors(errors: Any) -> tuple[str, str | None, str]:
    """One readable message for pydantic's error list: the first problem, its field, and how many more."""
    errors = list(errors)
    first = errors[0]
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return f"malformed JSON body: {detail}", None, "invalid_json"
    param = _param_from_loc(first["loc"])
    if param is None:
        if first["type"] == "value_error":
            return str(first["msg"]).removeprefix("Value error, "), None, "invalid_value"
        if first["type"] == "missing":
            return "the request body is empty; send a JSON object", None, "invalid_json"
        return f"the request body must be a JSON object, got {first.get('input')!r:.80}", None, "invalid_json"
    if first["type"] == "missing":
        return f"missing required field {param!r}{more}", param, "missing_field"
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return f"unknown field {param!r}{more}", param, "unknown_field"
    if first["type"] != "value_error":
        message += f", got {first.get('input')!r:.80}"
    return f"{param}: {message}{more}", param, "invalid_type"


def _param_from_loc(loc: Any) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``; union branch tags are dropped."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _jsonable(obj: Any) -> Any:
    """Plain JSON types from the engine's info (dataclasses, dtypes, devices and paths become dicts or strings)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def resident_memory_bytes() -> int | None:
    """This process's resident set size, from /proc (Linux); None where that is not available."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
