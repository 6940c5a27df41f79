"""Rounds queued on the device before the round in flight is read (follow-ups, with ``overlap_rounds``).

A mixin of :class:`ddtree.engine.scheduler.Scheduler` (its methods run on the engine thread and use the
scheduler's state: ``config``, ``_active``, ``_first``, ``_auto``, ``_queue``, ``_row_inputs``, ``_root_patch``,
``_upload``). Round n + 1 is queued before round n is read, its rows advanced on the device from round n's result:
rows of requests that finished are dropped, newcomers appended (their first token possibly still unread), prompt
chunks of a mixed round carried; a newcomer that needs another kind of round, or a cost curve still to measure,
leaves the next round to a host launch (docs/architecture.md, the overlap of rounds).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ddtree.engine import auto_budget
from ddtree.engine.cuda_graphs import bucket_nodes
from ddtree.engine.flights import ROW_FLAGS, UNREAD, Flight, holds, live_rows, row_flags
from ddtree.engine.request_state import Phase, RequestState
from ddtree.engine.round import PackedRows

log = logging.getLogger("ddtree.engine")


class FollowUps:
    """Follow-up rounds (module docstring)."""

    def _follow_size(self, flight: Flight) -> tuple[int, int, list[RequestState]] | None:
        """(The budget, budget auto's best size (the two differ when it explores), the requests that join) of the
        round that can be queued before ``flight`` is read, or None when the next round must be launched from the
        host once it is.

        A follow-up takes ``flight``'s rows still decoding (those whose request finished on the round read before,
        or was cancelled, are dropped on the device: a newcomer may hold their slot already) and the joiners
        (:meth:`_joiners`: newcomers whose first token is sampled, read or not) while prompts are still being
        prefilled beside them, and writes
        that stay inside the cache whatever ``flight`` accepts; rows that finish on ``flight``'s tokens only waste
        their place in it. Its budget is ``flight``'s, or for an auto round budget auto's next choice, made on the
        evidence of the rounds read so far (one round behind a host launch's): a change of size costs another
        graph, not a break in the overlap of rounds. Why joiners: at 64 requests in flight one finishes and one
        arrives almost every round, and a host launch after each read left the device idle while the flight was
        read and the next round packed and uploaded (docs/benchmarks.md, "Rounds that take in newcomers")."""
        if not self._overlap or self._waiting and self._free_slots or self._cost_waiters:
            return None
        live = live_rows(flight)
        if not live:
            return None
        joiners = self._joiners(flight)
        if joiners is None:
            return None
        states = live + joiners
        size = best = flight.shape.max_budget
        if flight.shape.auto_width:
            if self._known_curve() is None:  # measuring it replays the round graphs whose buffers hold the result
                return None
            # an exploring flight's evidence is not read yet: its follow-up must not explore the same size again
            size, best = self._auto_choice(states, self._unread(joiners), explore=not flight.explores)
        elif joiners and flight.shape.block_size > 1:
            size = best = max(size, *(s.budget for s in joiners))
        # The next round's roots lie at most a block past the states' positions (a joiner's: its first token's);
        # from there it writes its tree (nodes) into the target cache and its block into the drafter's.
        block = flight.shape.block_size
        fits = self._follow_reach(live, block, joiners) + max(size + 1, block) + 1 <= self.cache_len
        return (size, best, joiners) if fits else None

    def _joiners(self, flight: Flight) -> list[RequestState] | None:
        """The decoding requests outside ``flight`` that its follow-up takes in, or None when the follow-up's rows
        (``flight``'s still decoding and these) need a round of another kind than ``flight``'s (block size, sampling
        flags, budget auto or not): a host launch makes that one. A newcomer that finishes on its unread first
        token (``max_tokens`` 1) is left out, as a host launch leaves it out."""
        held = {id(s) for s in flight.states}
        unread = self._unread([s for s in self._active.values() if id(s) not in held])
        joiners = [s for s in self._active.values() if s.phase is Phase.DECODE and id(s) not in held
                   and not s.ends_by_token(unread.get(s.request_id, ()))]
        states = live_rows(flight) + joiners
        shape = flight.shape
        auto = shape.block_size > 1 and any(s.tree.auto for s in states)
        same = (self._block_size(states) == shape.block_size and auto == (shape.auto_width > 0)
                and row_flags(states) == {name: getattr(shape, name) for name in ROW_FLAGS})
        return joiners if same else None

    def _unread(self, states: list[RequestState]) -> dict[str, list[int]]:
        """The first token still on the device (one token, not yet read) of each of ``states`` that has one."""
        late = self._first.states if self._first is not None else []
        return {s.request_id: [UNREAD] for s in states if holds(late, s)}

    @staticmethod
    def _follow_reach(live: list[RequestState], block: int, joiners: list[RequestState]) -> int:
        """The furthest root a follow-up of the flight's ``live`` rows (draft block ``block``) taking ``joiners``
        can start from."""
        reach = max(s.root_position for s in live) + block
        return max([reach] + [s.root_position + 1 for s in joiners])

    def _follow_up(self, flight: Flight, size: int, best: int | None = None, joiners: list[RequestState] = (),
                   riders: list[RequestState] = ()) -> Flight | None:
        """Queue the round after ``flight`` with inputs advanced on the device from its result: each row's root is
        the last token it commits, its position and step counter move by the tokens it commits, and with budget
        auto its auto rows take ``size`` (:meth:`_follow_size`; ``best`` its best size, None: ``size``), which becomes
        the hysteresis' previous once the round is queued. The rows of requests that finished since ``flight`` was
        queued are dropped; ``joiners`` (:meth:`_joiners`) take rows after the others, packed on the host as a
        launch packs them (a first token still unread: its root patched on the device); ``riders``: prefilling
        requests whose next chunk rides in its verify (a mixed round: the prompt tokens are on the host, so a
        follow-up carries them as a launch does). The states hold every round before ``flight``, so their positions
        plus one block bound this round's cache reads."""
        try:
            joiners, live = list(joiners), live_rows(flight)
            states = live + joiners
            reach = self._follow_reach(live, flight.shape.block_size, joiners)
            shape, auto = flight.shape, flight.shape.auto_width > 0
            if auto:
                for s in states:
                    if s.tree.auto:
                        s.auto_budget = size
                nodes = max(s.budget for s in states)  # = size: the options are never below a fixed row's
                shape = replace(shape, max_budget=nodes,
                                auto_width=auto_budget.curve_width(bucket_nodes(nodes), self._auto.candidates))
            elif shape.block_size > 1:
                shape = replace(shape, max_budget=size)
            rows = flight.rows.advanced(flight.result, auto_budget=size if auto else None)
            if len(live) < len(flight.states):  # drop finished rows: a device gather, its index through pinned memory
                keep = self._upload(torch.tensor([i for i, s in enumerate(flight.states) if s.phase is Phase.DECODE]))
                rows = PackedRows(rows.longs.index_select(1, keep), rows.floats.index_select(1, keep))
            patch = None
            if joiners:
                joined, late = self._row_inputs(joiners, {}, first_row=rows.rows)
                host = PackedRows.pack(joined)
                rows = PackedRows(torch.cat([rows.longs, self._upload(host.longs.contiguous())], 1),
                                  torch.cat([rows.floats, self._upload(host.floats.contiguous())], 1))
                patch = self._root_patch(late)
            shape = replace(shape, rows=len(states), kv_len=reach + shape.max_budget + 1, draft_kv_len=max(1, reach))
            best = size if best is None else best
            follow_up = self._queue(states, rows, shape, patch, explores=size != best, riders=riders)
            if auto:
                self._auto.previous = best
            return follow_up
        except Exception:  # the host path below will launch it (and isolate a faulty row if it fails again)
            log.warning("queuing a follow-up round failed; launching from the host instead", exc_info=True)
            return None
