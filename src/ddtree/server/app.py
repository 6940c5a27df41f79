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
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree import __version__
from ddtree.errors import ConfigError, InvalidRequestError, QueueFullError
from ddtree.server.admission import Admission
from ddtree.server.auth import AccessPolicy, AuthMiddleware
from ddtree.server.generation import (
    CancellingStreamingResponse,
    Job,
    StreamUsage,
    TextShaper,
    complete,
    sse_events,
)
from ddtree.server.info_routes import ModelNotFound, check_model, register_info_routes
from ddtree.server.limits import PROVISIONAL_BODY_BYTES, BodyLimitMiddleware, ResolvedLimits, ServerLimits
from ddtree.server.logprobs import LogprobFormatter
from ddtree.server.metrics import ServerMetrics
from ddtree.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    ServerConfigUpdate,
    describe_validation_errors,
    error_body,
    request_param,
)

if TYPE_CHECKING:
    from ddtree.engine import Engine

_CancellingStreamingResponse = CancellingStreamingResponse  # its old name, which tests import

logger = logging.getLogger("ddtree.server")

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
QUEUE_FULL_RETRY_AFTER_S = 1
NOT_READY_RETRY_AFTER_S = 5


class _Unavailable(Exception):
    """The engine is loading, failed to load, or is shutting down: 503."""


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
        limits: ServerLimits,
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
        self._limits_spec = limits.validated()
        self.limits: ResolvedLimits | None = None
        if engine is not None and engine.ready:
            self._resolve_limits()

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready and self.limits is not None

    def _resolve_limits(self) -> None:
        """Concrete request limits from the engine's config and tokenizer (decodes the vocabulary once)."""
        assert self.engine is not None
        cfg = self.engine.config
        self.limits = self._limits_spec.resolve(
            max_len=cfg.max_len, max_batch=cfg.max_batch, max_queue=cfg.max_queue, tokenizer=self.engine.tokenizer,
            vocab_size=int(self.engine.target.config.vocab_size))
        logger.info("request limits: body %d bytes, prompt %s characters, queue %d requests / %d tokens",
                    self.limits.max_body_bytes, self.limits.prompt_chars, self.limits.max_queued,
                    self.limits.max_queued_tokens)

    def require_limits(self) -> ResolvedLimits:
        assert self.limits is not None  # require_ready() came first
        return self.limits

    def require_ready(self) -> Engine:
        if not self.ready:
            raise _Unavailable(self.status_message())
        assert self.engine is not None
        return self.engine

    def status_message(self) -> str:
        if self.startup_error is not None:
            return f"engine failed to start: {self.startup_error}"
        if self.engine is None:
            return "engine is loading; retry shortly"
        if not self.engine.ready:  # the warm-up's progress ("warming up: 37/120 graphs"; ddtree.engine.warmup)
            warmup = getattr(self.engine, "warmup", None)
            return warmup.message() if warmup is not None else "engine is warming up; retry shortly"
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
            self._resolve_limits()
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
    access: AccessPolicy | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (running or not) or over the engine ``engine_factory`` builds.

    An engine that is not running yet is started by the app's lifespan (so it needs a server that runs lifespans,
    like uvicorn); a running one is used as is and left running at exit (tests share one engine among apps).
    ``access``: API keys (default none, for a server on loopback); ``limits``: request and queue bounds (default
    derived from the engine's config)."""
    access = (access or AccessPolicy()).validated()
    limits = limits or ServerLimits()
    host = EngineHost(engine, engine_factory, drain_timeout, on_startup_failure, limits)
    workers = limits.validated().tokenizer_workers or max(1, min(8, os.cpu_count() or 1))
    # Tokenization and chat templates run here, not on the event loop: /health, /metrics and every stream keep
    # answering while a large prompt is encoded (HF fast tokenizers release the GIL while they encode).
    tokenize_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ddtree-tokenize")
    gate: list[Admission] = []  # built once the engine's limits are known

    def admission() -> Admission:
        if not gate:
            lim = host.require_limits()
            gate.append(Admission(max_queued=lim.max_queued, max_queued_tokens=lim.max_queued_tokens,
                                  max_running=lim.max_running))
        return gate[0]

    metrics = ServerMetrics(lambda: host.engine if host.ready else None,
                            lambda: (gate[0].queued, gate[0].queued_tokens) if gate else (0, 0),
                            model_fn=lambda: host.engine.model_name if host.ready and host.engine else "")
    started_at = time.time()

    async def off_loop(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(tokenize_pool, lambda: fn(*args, **kwargs))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        host.start_in_background()
        yield
        await asyncio.to_thread(host.stop)
        tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="ddtree", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.host = host
    app.state.metrics = metrics
    app.state.access = access
    app.state.queue = lambda: {"requests": admission().queued, "tokens": admission().queued_tokens,
                               "running": admission().running}

    def refused_at_edge(outcome: str) -> Callable[[str], None]:
        return lambda path: metrics.refused(outcome) if path in GENERATION_ROUTES else None

    # Outermost first: keys are checked before a byte of the body is read.
    app.add_middleware(BodyLimitMiddleware, on_refused=refused_at_edge("too_large"),
                       limit_fn=lambda: host.limits.max_body_bytes if host.limits else PROVISIONAL_BODY_BYTES)
    app.add_middleware(AuthMiddleware, policy=access, on_refused=refused_at_edge("unauthorized"))

    # ------------------------------------------------------------------------------------------- errors

    def refuse(request: Request, outcome: str) -> None:
        if request.url.path in GENERATION_ROUTES:
            metrics.refused(outcome)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        refuse(request, "invalid")
        message, param, code = describe_validation_errors(exc.errors())
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

    @app.exception_handler(ModelNotFound)
    async def _no_model(request: Request, exc: ModelNotFound) -> JSONResponse:
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

    def server_block() -> dict[str, Any]:
        return {
            "ddtree_version": __version__,
            "pid": os.getpid(),
            "rss_bytes": resident_memory_bytes(),
            "uptime_s": time.time() - started_at,
            "drain_timeout_s": host.drain_timeout,
            "limits": host.require_limits().to_dict(),
            "queue": app.state.queue(),
            "auth": {"api_key": access.api_key is not None, "admin_api_key": access.admin_api_key is not None,
                     "loopback_only": access.loopback_only},
        }

    app.state.stats_baseline = register_info_routes(
        app, engine_fn=host.require_ready, started_at=started_at, server_fn=server_block,
        queued_fn=lambda: admission().queued, off_loop=off_loop, jsonable=_jsonable)

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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        engine = host.require_ready()
        check_model(engine, body.model)
        limits = host.require_limits()
        max_tokens = body.check()
        limits.check_fields(body.stop, body.stop_token_ids)
        prompts = body.prompt_list()
        limits.check_choices(len(prompts), body.num_samples)
        ids_list: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                limits.check_prompt_chars(prompt, where)
                ids_list.append(await off_loop(engine.encode_prompt, prompt))
            else:
                limits.check_prompt_ids(prompt)
                ids_list.append(list(prompt))
        echoes = ([p if isinstance(p, str) else await off_loop(engine.tokenizer.decode, p) for p in prompts]
                  if body.echo else None)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return await run_generation(engine, body, ids_list, max_tokens, request_id, raw, chat=False, echoes=echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        engine = host.require_ready()
        check_model(engine, body.model)
        limits = host.require_limits()
        body.check()
        limits.check_fields(body.stop, body.stop_token_ids)
        limits.check_choices(1, body.num_samples)
        # The tokenizer's chat template; the engine reports a template failure as an invalid request (400).
        prompt_ids = await off_loop(_encode_chat, engine, limits, body.template_messages(),
                                    body.chat_template_kwargs or {})
        max_tokens = body.max_tokens_for(len(prompt_ids), engine.config.max_len)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        return await run_generation(engine, body, [prompt_ids], max_tokens, request_id, raw, chat=True)

    async def run_generation(engine: Engine, body: CompletionRequest | ChatCompletionRequest,
                             prompts: list[list[int]], max_tokens: int, request_id: str, raw: Request, *,
                             chat: bool, echoes: list[str] | None = None) -> Response:
        """Validate every engine request behind the body, give each a place in the admission queue (all or
        none), answer: a stream of events, or one body once every choice is done. A client that leaves while
        its requests wait never reaches the engine."""
        runs = body.generation_requests(prompts, engine.defaults, request_id, max_tokens)
        for request, _ in runs:
            engine.validate(request)  # 400 now, not after waiting in the queue
        gate = admission()
        stop_ids = frozenset(engine.eos_ids) | frozenset(body.stop_token_ids or ())
        jobs: list[Job] = []
        try:
            for request, indices in runs:
                ticket = gate.enter(len(request.prompt_token_ids or ()) + request.sampling.max_tokens)
                prompt_index = indices[0] // body.num_samples
                shaper = TextShaper(engine.tokenizer, stop=request.sampling.stop, stop_ids=stop_ids,
                                    prefix=echoes[prompt_index] if echoes else "",
                                    keep_special=body.keep_special_tokens, include_stop=body.include_stop)
                formatter = (LogprobFormatter(engine.tokenizer, chat=chat, prompt_ids=list(request.prompt_token_ids))
                             if request.sampling.logprobs is not None else None)
                jobs.append(Job(request=request, indices=indices, ticket=ticket, shaper=shaper, logprobs=formatter))
        except QueueFullError:
            for job in jobs:
                job.cancel(engine)
            raise
        builder = ResponseBuilder(request_id=request_id, model=engine.model_name, chat=chat,
                                  num_choices=len(prompts) * body.num_samples)
        prompt_tokens = sum(len(p) for p in prompts)
        if body.streaming:
            # Headers go out now (what streaming clients expect); the events wait for the turn. A client that
            # leaves meanwhile ends the response, which closes the generator before anything was submitted.
            usage = StreamUsage(prompt_tokens, body.include_usage, body.continuous_usage)

            def cancel() -> None:
                for job in jobs:
                    job.cancel(engine)

            return CancellingStreamingResponse(
                sse_events(engine, jobs, builder, usage, metrics),
                cancel=cancel,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await complete(engine, jobs, builder, prompt_tokens, raw, metrics)

    return app


# ------------------------------------------------------------------------------------------------- helpers


def _encode_chat(engine: Engine, limits: ResolvedLimits, messages: list[dict[str, Any]],
                 template_kwargs: dict[str, Any]) -> list[int]:
    """The chat's prompt ids, refusing a rendered chat too long to fit before tokenizing it (worker thread).

    The template is rendered to text first for the length check (what the template does with each message,
    dropping or adding text, is its own business), then the engine encodes it the way it always does."""
    if limits.prompt_chars is not None:
        try:
            text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                        **template_kwargs)
        except Exception as exc:  # template errors are the caller's input problem
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
        if isinstance(text, str):
            limits.check_prompt_chars(text, "messages")
    return engine.encode_chat(messages, **template_kwargs)


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
