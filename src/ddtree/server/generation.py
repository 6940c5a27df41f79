"""Running one admitted request: SSE events for a stream, one JSON body otherwise; cancellation on every exit.

A request that ends early on the client side (closed connection) is cancelled in the engine at once, so its KV
slot goes to the next request; the engine's own failures end that request alone with a 500 (or an error event
in a stream). ``release`` (the request's admission ticket) is called however the request ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ddtree.engine.api import GenerationRequest, StreamChunk
from ddtree.errors import InvalidRequestError, QueueFullError
from ddtree.server.metrics import ServerMetrics
from ddtree.server.protocol import ResponseBuilder, error_body, token_usage

if TYPE_CHECKING:
    from ddtree.engine import Engine
    from ddtree.server.admission import Ticket


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


class CancellingStreamingResponse(StreamingResponse):
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
class StreamUsage:
    """What a stream reports about token counts: nothing, a final usage chunk, or also cumulative usage on every
    chunk (``continuous``). ``completion`` counts the tokens delivered so far."""

    prompt_tokens: int
    include: bool
    continuous: bool
    completion: int = 0

    def running(self) -> dict[str, int] | None:
        return token_usage(self.prompt_tokens, self.completion) if self.continuous else None


async def sse_events(engine: Engine, request: GenerationRequest, ticket: Ticket, builder: ResponseBuilder,
                     usage: StreamUsage, metrics: ServerMetrics) -> AsyncIterator[str]:
    """SSE for one request: wait for its turn, submit, relay. Closing this generator early (client gone, server
    stopping) cancels the request, or, while it still waits, takes it out of the queue unsubmitted.

    Chunks whose tokens produced no text yet (an incomplete UTF-8 sequence, a possible stop-string prefix) are
    not sent; their tokens count in the next chunk's cumulative usage."""
    request_id = request.request_id
    submitted = False
    finished = False
    try:
        await ticket.wait()
        try:
            chunks = await ticket.submit_when_room(engine, request)
        except (InvalidRequestError, QueueFullError) as exc:  # the engine started shutting down meanwhile
            yield _sse(error_body(str(exc), type_="server_error", code="aborted"))
            yield _SSE_DONE
            return
        submitted = True
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
        if submitted and not finished:  # the consumer left before the end: free the slot now, not at collection
            engine.cancel(request_id)
        ticket.release()


async def wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def wait_turn(wait: Callable[[], Any], raw: Request) -> bool:
    """Wait for ``wait()`` (the request's turn in the admission queue) while watching the connection; False when
    the client left first (its request then never reaches the engine)."""
    turn = asyncio.ensure_future(wait())
    watching = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        await asyncio.wait({turn, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not turn.done():
            turn.cancel()
    return turn.done() and not turn.cancelled() and turn.exception() is None


async def complete(engine: Engine, chunks: AsyncIterator[StreamChunk], request_id: str, builder: ResponseBuilder,
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
    watching = asyncio.ensure_future(wait_for_disconnect(raw))
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
