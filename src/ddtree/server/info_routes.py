"""The routes other engines' clients read besides generation: model cards, versions, tokenization, server info and
the statistics reset that benchmark tools call between runs.

=================================  ==================================================================================
``GET /v1/models``                 the one served model (OpenAI's list shape, vLLM's ``max_model_len``)
``GET /v1/models/{id}``            its card, or an OpenAI 404 (``model_not_found``) for any other id
``GET /version``                   vLLM's ``{"version": ...}`` (ddtree's version)
``POST /tokenize``                 vLLM's shape: ``prompt`` (with ``add_special_tokens``, default true like vLLM) or
                                   chat ``messages`` (the template with ``add_generation_prompt``, default true);
                                   answers ``count``, ``max_model_len``, ``tokens`` and ``token_strs`` when asked
``POST /detokenize``               vLLM's shape: ``tokens`` -> ``prompt``
``GET /server_info``,              engine, limits, queue, the cumulative engine snapshot, and SGLang's
``GET /get_server_info``           ``internal_states[0].avg_spec_accept_length`` counted since the last reset
``/flush_cache`` (SGLang),         admin routes (:mod:`ddtree.server.auth`): reset the acceptance statistics
``/reset_prefix_cache`` (vLLM)     ``/server_info`` reports; there is no prefix cache, and the answer says so
=================================  ==================================================================================

Prometheus counters are never reset (counters must only grow; scrapers take differences).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ddtree import __version__
from ddtree.errors import InvalidRequestError
from ddtree.server.protocol import ChatMessage

if TYPE_CHECKING:
    from ddtree.engine import Engine


class ModelNotFound(Exception):
    """The request names a model this server does not serve: 404."""

    def __init__(self, requested: str, served: str) -> None:
        super().__init__(f"model {requested!r} does not exist; this server serves {served!r} (see GET /v1/models)")


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` body: ``prompt`` or ``messages``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    return_token_strs: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize`` body."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt] = Field(...)


@dataclasses.dataclass
class StatsBaseline:
    """The engine's cumulative counters at the last reset; ``/server_info`` reports the difference."""

    generation_tokens: int = 0
    verify_rounds: int = 0
    accept_hist: list[int] = dataclasses.field(default_factory=list)
    reset_at: float | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def reset(self, snap: Any) -> None:
        with self.lock:
            self.generation_tokens = snap.generation_tokens_total
            self.verify_rounds = snap.verify_rounds_total
            self.accept_hist = list(snap.accept_hist)
            self.reset_at = time.time()

    def since(self, snap: Any) -> dict[str, Any]:
        """Acceptance since the last reset (since start-up before any): rounds, tokens, histogram, length."""
        with self.lock:
            rounds = snap.verify_rounds_total - self.verify_rounds
            tokens = snap.generation_tokens_total - self.generation_tokens
            hist = [c - (self.accept_hist[k] if k < len(self.accept_hist) else 0)
                    for k, c in enumerate(snap.accept_hist)]
            reset_at = self.reset_at
        return {"verify_rounds": rounds, "generation_tokens": tokens, "accept_hist": hist,
                "accept_length": tokens / rounds if rounds else 0.0, "reset_at": reset_at}


def check_model(engine: Engine, model: str | None) -> None:
    if model is not None and model != engine.model_name:
        raise ModelNotFound(model, engine.model_name)


def register_info_routes(app: FastAPI, *, engine_fn: Callable[[], Engine], started_at: float,
                         server_fn: Callable[[], dict[str, Any]], queued_fn: Callable[[], int],
                         off_loop: Callable[..., Any], jsonable: Callable[[Any], Any]) -> StatsBaseline:
    """Add the routes above to ``app``. ``engine_fn`` returns the ready engine (or raises the app's 503);
    ``server_fn`` the ``server`` block of ``/server_info``; ``queued_fn`` the requests in the server's queue."""
    baseline = StatsBaseline()

    def card(engine: Engine) -> dict[str, Any]:
        return {"id": engine.model_name, "object": "model", "created": int(started_at), "owned_by": "ddtree",
                "root": engine.model_name, "parent": None, "max_model_len": engine.config.max_len}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card(engine_fn())]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        engine = engine_fn()
        check_model(engine, model_id)
        return JSONResponse(card(engine))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    async def server_info() -> JSONResponse:
        engine = engine_fn()
        snap = engine.snapshot()
        since = baseline.since(snap)
        return JSONResponse({
            "model": engine.model_name,
            "engine": jsonable(engine.info()),
            "default_tree": engine.defaults.to_dict(),
            "snapshot": jsonable(snap),  # cumulative since start-up (the engine's own counters)
            "since_reset": since,
            "server": server_fn(),
            # SGLang's place for the running acceptance length (read by tools written for SGLang); like SGLang's,
            # counted since start-up or the last /flush_cache.
            "internal_states": [{"avg_spec_accept_length": since["accept_length"], "num_running_reqs": snap.running,
                                 "num_queue_reqs": snap.queued + queued_fn()}],
        })

    app.add_api_route("/server_info", server_info, methods=["GET"])
    app.add_api_route("/get_server_info", server_info, methods=["GET"])  # SGLang's older name

    async def reset_stats() -> JSONResponse:
        engine = engine_fn()
        baseline.reset(engine.snapshot())
        return JSONResponse({
            "success": True,
            "reset": "acceptance statistics reported by /server_info (since_reset, internal_states)",
            "prefix_cache": "none: ddtree serve keeps no prefix cache, so there is nothing to flush",
            "reset_at": baseline.reset_at,
        })

    app.add_api_route("/flush_cache", reset_stats, methods=["GET", "POST"])  # SGLang: POST now, GET on older ones
    app.add_api_route("/reset_prefix_cache", reset_stats, methods=["POST"])  # vLLM

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        engine = engine_fn()
        check_model(engine, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("send exactly one of prompt and messages", param="prompt")
        tok = engine.tokenizer
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await off_loop(lambda: list(tok.encode(body.prompt, add_special_tokens=special)))
        else:
            messages = [m.for_template(i) for i, m in enumerate(body.messages or [])]
            generation = True if body.add_generation_prompt is None else body.add_generation_prompt
            ids = await off_loop(_render_chat, tok, messages, generation, body.chat_template_kwargs or {})
        strs = await off_loop(tok.convert_ids_to_tokens, ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": engine.config.max_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        engine = engine_fn()
        check_model(engine, body.model)
        vocab = int(engine.target.config.vocab_size)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"tokens must be ids in [0, {vocab}); got {bad[0]}", param="tokens")
        text = await off_loop(engine.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    return baseline


def _render_chat(tokenizer: Any, messages: list[dict[str, Any]], generation: bool,
                 template_kwargs: dict[str, Any]) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True,
                                            **template_kwargs)
    except Exception as exc:  # template errors are the caller's input problem
        raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
