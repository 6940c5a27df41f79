"""Running one response's engine requests (:class:`Job`): SSE events for a stream, one JSON body otherwise;
cancellation on every exit.

A response of several choices (a batch of prompts, ``n`` samples) runs one job per engine request, each with its
own admission ticket; a greedy job answers all ``n`` copies of its prompt. A client that leaves cancels every job
at once (queued ones never reach the engine), so their KV slots go to the next requests; the engine's own failure
of one job fails the response with a 500 (or an error event in a stream) and the server keeps serving. Every
ticket is released however the response ends. :class:`TextShaper` turns a job's chunks into the text the client
asked for (``echo``, ``skip_special_tokens``, ``include_stop_str_in_output``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ddtree.engine.api import GenerationRequest, StreamChunk
from ddtree.engine.detok import IncrementalDetokenizer
from ddtree.errors import InvalidRequestError, QueueFullError
from ddtree.server.logprobs import LogprobFormatter
from ddtree.server.metrics import ServerMetrics
from ddtree.server.protocol import ChoiceResult, ResponseBuilder, error_body, token_usage

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
    chunk (``continuous``). ``completion`` counts the tokens delivered so far over every choice."""

    prompt_tokens: int
    include: bool
    continuous: bool
    completion: int = 0

    def running(self) -> dict[str, int] | None:
        return token_usage(self.prompt_tokens, self.completion) if self.continuous else None

    def final(self) -> dict[str, int]:
        return token_usage(self.prompt_tokens, self.completion)


class _KeepSpecial:
    """A tokenizer whose ``decode`` keeps special tokens (for ``skip_special_tokens: false``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


class TextShaper:
    """The text one engine request's chunks show the client: the engine's text, or, for the fields that change
    it, text rebuilt from the token ids the chunks carry.

    ``prefix``: the prompt's text for ``echo``, sent before the first token's text. ``keep_special``
    (``skip_special_tokens: false``): the ids decoded again with special tokens kept, by the engine's own
    incremental detokenizer; the stop token that ended the request is left out unless ``include_stop``, as vLLM
    does (the protocol refuses stop *strings* with it). ``include_stop`` (``include_stop_str_in_output``): the
    stop string the engine trimmed (the start of the decoded rest after the text sent) or the stop token's
    text is put back on the last chunk."""

    def __init__(self, tokenizer: Any, *, stop: tuple[str, ...], stop_ids: frozenset[int], prefix: str = "",
                 keep_special: bool = False, include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.stop_ids = stop_ids
        self.prefix = prefix
        self.include_stop = include_stop
        self.detok = IncrementalDetokenizer(_KeepSpecial(tokenizer)) if keep_special else None
        self.ids: list[int] = []
        self.engine_text = ""

    def feed(self, chunk: StreamChunk) -> str:
        ended_by_token = (chunk.finished and chunk.finish_reason == "stop" and bool(chunk.token_ids)
                          and chunk.token_ids[-1] in self.stop_ids)
        self.ids.extend(chunk.token_ids)
        self.engine_text += chunk.text
        if self.detok is not None:
            ids = chunk.token_ids[:-1] if ended_by_token and not self.include_stop else chunk.token_ids
            text = self.detok.add(ids)
            if chunk.finished:
                text += self.detok.finish()
        else:
            text = chunk.text
            if self.include_stop and chunk.finished and chunk.finish_reason == "stop":
                text += self._stop_text(ended_by_token)
        if self.prefix:
            text, self.prefix = self.prefix + text, ""
        return text

    def _stop_text(self, ended_by_token: bool) -> str:
        rest = self.tokenizer.decode(self.ids, skip_special_tokens=True)[len(self.engine_text):]
        for s in self.stop:  # the engine tests stop strings in this order
            if rest.startswith(s):
                return s
        if ended_by_token:
            return self.tokenizer.decode(self.ids[-1:], skip_special_tokens=True)
        return ""


@dataclasses.dataclass
class Job:
    """One engine request behind a response and the choices it answers (several when greedy ``n`` copies it)."""

    request: GenerationRequest
    indices: list[int]
    ticket: Ticket
    shaper: TextShaper
    finished: bool = False
    last_token_at: float | None = None
    logprobs: LogprobFormatter | None = None  # when the request asked for log-probs

    def feed(self, chunk: StreamChunk) -> str:
        """The chunk's text for the client; its log-probs are kept until :meth:`take_logprobs`."""
        if self.logprobs is not None:
            self.logprobs.feed(chunk)
        return self.shaper.feed(chunk)

    def take_logprobs(self) -> dict[str, Any] | None:
        """The log-probs of every token since the last call (None when the request did not ask for them)."""
        return self.logprobs.take() if self.logprobs is not None else None

    def cancel(self, engine: Engine) -> None:
        """Free what the job holds, however the response ends (idempotent)."""
        if self.ticket.submitted and not self.finished:
            engine.cancel(self.request.request_id)
        self.ticket.release()

    def timed(self, chunk: StreamChunk, metrics: ServerMetrics) -> None:
        """Inter-token latency as the server sees it: the gap between two chunks that carry tokens."""
        if not chunk.token_ids:
            return
        now = time.perf_counter()
        if self.last_token_at is not None:
            metrics.token_gap(now - self.last_token_at)
        self.last_token_at = now


async def _run_job(engine: Engine, job: Job, out: asyncio.Queue[tuple[Job, StreamChunk | Exception]]) -> None:
    """Wait for the job's turn, submit it and relay its chunks (or the error that stopped it) to ``out``."""
    await job.ticket.wait()
    try:
        chunks = await job.ticket.submit_when_room(engine, job.request)
    except (InvalidRequestError, QueueFullError) as exc:  # the engine started shutting down meanwhile
        await out.put((job, exc))
        return
    async for chunk in chunks:
        await out.put((job, chunk))
        if chunk.finished:
            return


async def sse_events(engine: Engine, jobs: list[Job], builder: ResponseBuilder, usage: StreamUsage,
                     metrics: ServerMetrics) -> AsyncIterator[str]:
    """SSE for one response: every job waits for its turn, is submitted, and its chunks are relayed as they come
    (one choice per event, several choices interleaved). Closing this generator early (client gone, server
    stopping) cancels the jobs still running, or takes those still waiting out of the queue unsubmitted.

    Chunks whose tokens produced no text yet (an incomplete UTF-8 sequence, a possible stop-string prefix) are
    not sent; their tokens count in the next chunk's cumulative usage."""
    out: asyncio.Queue[tuple[Job, StreamChunk | Exception]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_run_job(engine, job, out)) for job in jobs]
    remaining = len(jobs)
    last_stats = None
    try:
        while remaining:
            job, item = await out.get()
            if isinstance(item, Exception):
                yield _sse(error_body(str(item), type_="server_error", code="aborted"))
                yield _SSE_DONE
                return
            chunk = item
            job.timed(chunk, metrics)
            usage.completion += len(chunk.token_ids) * len(job.indices)
            text = job.feed(chunk)
            if not chunk.finished:
                if text:
                    logprobs = job.take_logprobs()
                    for index in job.indices:
                        yield _sse(builder.chunk(index, text, include_usage=usage.include,
                                                 running_usage=usage.running(), logprobs=logprobs))
                continue
            job.finished = True
            remaining -= 1
            if chunk.finish_reason in ("cancelled", "error"):
                if text:
                    for index in job.indices:
                        yield _sse(builder.chunk(index, text, include_usage=usage.include,
                                                 running_usage=usage.running()))
                yield _sse(_failure(chunk)[1])
                yield _SSE_DONE
                return
            assert chunk.stats is not None
            metrics.finished(chunk.stats)
            last_stats = chunk.stats
            logprobs = job.take_logprobs()
            for index in job.indices:
                yield _sse(builder.chunk(index, text, chunk.stats, result_id=job.request.request_id,
                                         include_usage=usage.include, running_usage=usage.running(),
                                         logprobs=logprobs))
        if usage.include:
            yield _sse(builder.usage_chunk(usage.final(), last_stats))
        yield _SSE_DONE
    finally:
        for task in tasks:
            task.cancel()
        for job in jobs:  # a consumer that left before the end frees the slots now, not at collection
            job.cancel(engine)


async def wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def complete(engine: Engine, jobs: list[Job], builder: ResponseBuilder, prompt_tokens: int, raw: Request,
                   metrics: ServerMetrics) -> Response:
    """Run every job to its end while watching the connection; one JSON body with every choice. A client that
    leaves cancels its jobs (queued ones never reach the engine); a job the engine fails fails the response."""
    out: asyncio.Queue[tuple[Job, StreamChunk | Exception]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_run_job(engine, job, out)) for job in jobs]
    texts: dict[int, list[str]] = {id(job): [] for job in jobs}
    finals: list[tuple[Job, StreamChunk]] = []

    async def collect() -> None:
        while len(finals) < len(jobs):
            job, item = await out.get()
            if isinstance(item, Exception):
                raise item
            job.timed(item, metrics)
            texts[id(job)].append(job.feed(item))
            if item.finished:
                job.finished = True
                finals.append((job, item))
                if item.finish_reason in ("cancelled", "error"):
                    return

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():  # client gone, or this handler cancelled (server stopping)
            collecting.cancel()
        for task in tasks:
            task.cancel()
        for job in jobs:
            job.cancel(engine)
    if not collecting.done() or collecting.cancelled():
        return Response(status_code=499)  # nobody is listening; the status is for the access log
    collecting.result()  # re-raises a submission error (QueueFullError: 503)
    for _, final in finals:
        if final.finish_reason in ("cancelled", "error"):
            status, body = _failure(final)
            return JSONResponse(body, status_code=status)
    choices = []
    for job, final in finals:
        assert final.stats is not None
        metrics.finished(final.stats)
        text = "".join(texts[id(job)])
        logprobs = job.take_logprobs()
        choices += [ChoiceResult(index, text, final.stats, job.request.request_id, logprobs) for index in job.indices]
    return JSONResponse(builder.response(choices, prompt_tokens))
