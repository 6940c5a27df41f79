"""Admission: the server's own FIFO queue in front of the engine, bounded in requests and in tokens.

The server hands the engine at most ``max_running`` requests at a time (its KV slots), so requests that wait
for a slot wait here, where a client that disconnects is simply dropped: it never reaches the engine, never
costs a prefill, and never holds a place another client could use. A request enters the queue only if both
bounds hold with it counted (``max_queued`` requests and ``max_queued_tokens`` tokens, a request costing its
prompt plus ``max_tokens``); otherwise it is refused at once with 503 and ``Retry-After``, as vLLM and SGLang
clients expect of a full server. Inside the queue the order is strict arrival order (a long request at the head
is never overtaken), so no request waits behind a stream of later ones: admission cannot be starved.

Everything here runs on the event loop thread (the engine's callbacks reach it through
``call_soon_threadsafe``), so no lock is needed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from ddtree.engine.api import GenerationRequest, StreamChunk
from ddtree.errors import QueueFullError

if TYPE_CHECKING:
    from ddtree.engine import Engine


ENGINE_ROOM_WAIT_S = 1.0


class Ticket:
    """One request's place: waiting, then running (holding an engine slot), then released (idempotent)."""

    def __init__(self, gate: Admission, tokens: int) -> None:
        self.tokens = tokens
        self._gate = gate
        self._loop = asyncio.get_running_loop()
        self._turn: asyncio.Future[None] = self._loop.create_future()
        self.released = False
        self.submitted = False
        self._slot_freed = False

    @property
    def admitted(self) -> bool:
        """Its turn came (so the request may have been submitted to the engine)."""
        return self._turn.done() and not self._turn.cancelled()

    async def wait(self) -> None:
        """Return once this request may be submitted to the engine."""
        await asyncio.shield(self._turn)

    def submit(self, engine: Engine, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Submit to the engine (raising on bad input) and iterate its chunks, as ``Engine.stream`` does, except
        that the engine slot counts as taken until the engine's final chunk (finished, cancelled or failed) comes
        back: a request cancelled by its client holds its slot until the engine has let go of it, so the server
        never hands the engine more than ``max_running`` requests."""
        assert self.admitted and not self.submitted
        chunks = engine.stream(request, on_finished=self._free_slot)
        self.submitted = True
        return chunks

    async def submit_when_room(self, engine: Engine, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """:meth:`submit`, retried for up to a second while the engine's inbox still holds messages about
        requests this server already let go of (their cancellations count against the engine's own queue
        bound until its loop drains them); a QueueFullError from an engine that is shutting down is raised."""
        deadline = self._loop.time() + ENGINE_ROOM_WAIT_S
        while True:
            try:
                return self.submit(engine, request)
            except QueueFullError:
                if not engine.ready or self._loop.time() > deadline:
                    raise
                await asyncio.sleep(0.005)

    def release(self) -> None:
        """The handler is done with the request: a waiting one leaves the queue, an admitted one that was never
        submitted frees its slot, a submitted one frees it when the engine's final chunk arrives."""
        if self.released:
            return
        self.released = True
        if not self._turn.done():
            self._gate._leave_queue(self)
        elif not self.submitted:
            self._free_slot()

    def _free_slot(self) -> None:
        if not self._slot_freed:
            self._slot_freed = True
            self._gate._slot_freed()


class Admission:
    """The queue. ``enter`` refuses or queues at once; ``Ticket.wait`` returns in arrival order."""

    def __init__(self, *, max_queued: int, max_queued_tokens: int, max_running: int) -> None:
        self.max_queued = max_queued
        self.max_queued_tokens = max_queued_tokens
        self.max_running = max_running
        self._waiting: deque[Ticket] = deque()
        self.queued_tokens = 0
        self.running = 0

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def enter(self, tokens: int) -> Ticket:
        """A ticket for a request of ``tokens`` (prompt + max_tokens); raises QueueFullError when a bound would break."""
        ticket = Ticket(self, tokens)
        if not self._waiting and self.running < self.max_running:
            self.running += 1
            ticket._turn.set_result(None)
            return ticket
        if len(self._waiting) >= self.max_queued:
            raise QueueFullError(f"the request queue is full ({len(self._waiting)} requests waiting, the limit is "
                                 f"{self.max_queued}); retry later")
        if self.queued_tokens + tokens > self.max_queued_tokens:
            raise QueueFullError(
                f"the request queue is full ({self.queued_tokens} tokens waiting + {tokens} for this request "
                f"exceeds the limit of {self.max_queued_tokens} prompt + max_tokens tokens); retry later")
        self._waiting.append(ticket)
        self.queued_tokens += tokens
        return ticket

    def _leave_queue(self, ticket: Ticket) -> None:
        self._waiting.remove(ticket)
        self.queued_tokens -= ticket.tokens
        ticket._turn.cancel()

    def _slot_freed(self) -> None:
        self.running -= 1
        self._pump()

    def _pump(self) -> None:
        while self._waiting and self.running < self.max_running:
            head = self._waiting.popleft()
            self.queued_tokens -= head.tokens
            self.running += 1
            head._turn.set_result(None)
