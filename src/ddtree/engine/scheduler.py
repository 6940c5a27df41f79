"""The scheduler: admit, prefill, launch, collect and overlap rounds, and emit their tokens.

It runs on the engine's thread (started by the facade, :class:`ddtree.engine.engine.Engine`, which derives from it)
and owns every request's state; other threads reach it only through the inbox (:meth:`Scheduler._enqueue`,
:meth:`Scheduler._enqueue_cancel`)::

    inbox  ->  loop: admit -> one prefill step -> read round n -> launch round n + 1
                     -> emit round n's chunks (on_chunk callbacks) while n + 1 runs

With ``overlap_rounds`` (CUDA) round n + 1 is queued on the device before round n is read, its rows advanced there
from round n's result, finished rows dropped and newcomers appended (:meth:`Scheduler._follow_size`), prompt chunks
riding in it (a mixed round); only a change of the round's kind or a cost curve to measure waits for a host launch.

Scheduling: requests wait in a bounded FIFO queue until a KV slot is free; a newcomer's prompt is written in
chunks, so running requests keep decoding while long prompts load: by prefill steps of ``prefill_chunk`` tokens
between rounds, or, with ``EngineConfig.mixed_chunk`` above 0 and some request decoding, inside the decode round's
own verify forward (a mixed round: ``mixed_chunk`` prompt tokens a round, in admission order; requests that asked
for log-probs still take prefill steps). A mixed round reads the target's weights once for both, and a decoding
request waits for at most ``mixed_chunk`` extra tokens of forward per round; prompts are admitted at that rate,
which is why it is off by default (docs/benchmarks.md, "Mixed rounds"). A slot is freed the moment its request
finishes or is cancelled.

Fault isolation: if a round raises, the scheduler reruns each of its rows alone (the round only writes cache
positions past each row's committed length, so a rerun is safe); rows that fail alone are finished with
``finish_reason="error"`` and the others continue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ddtree.engine import auto_budget
from ddtree.engine.api import MAX_LOGPROBS, MAX_STOP_IDS, StreamChunk, TokenLogprob
from ddtree.engine.build import EngineParts
from ddtree.engine.cost_curve import CostCurve
from ddtree.engine.cost_measure import fallback_curve
from ddtree.engine.cuda_graphs import bucket_nodes, bucket_rows, eager_chunk_dims
from ddtree.engine.logprobs import bits_to_floats, device_logprobs, host_entries, unpack_logprobs
from ddtree.engine.request_state import Phase, RequestState
from ddtree.engine.round import (
    NO_WINDOW,
    ChunkRows,
    PackedRows,
    PrefillInputs,
    RoundInputs,
    RoundShape,
    RoundWork,
    RowInputs,
)
from ddtree.engine.runner import HostCopy, StageTimer, to_host

log = logging.getLogger("ddtree.engine")

# The host's stand-in for a first token still on the device (_FirstTokens), in the tokens a launch takes as read but
# not committed: never a token id, so no stop rule matches it (its row's root is patched on the device).
UNREAD = -1

# One row's share of a round read on the host: its state, the tokens it commits, their log-probs (None unless asked).
RowResult = tuple["RequestState", list[int], "list[TokenLogprob] | None"]

@dataclass
class _Counters:
    requests_total: dict[str, int] = field(default_factory=dict)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    verify_rounds_total: int = 0
    accept_hist: list[int] = field(default_factory=list)
    stage_seconds_total: dict[str, float] = field(default_factory=dict)
    mixed_rounds_total: int = 0  # rounds that carried prompt chunks in their verify forward
    mixed_prompt_tokens_total: int = 0  # prompt tokens those rounds carried


@dataclass
class _FirstTokens:
    """First completion tokens sampled on the device by a prefill step and not read on the host yet: the rows join
    the next round at once, their roots patched on the device (:meth:`Scheduler._launch`), and the tokens are read
    and emitted at the top of the next loop iteration, before that round is read.

    Why: reading them in the prefill step made the host wait for the round in flight and the prefill, then build
    the next round while the device idled; at 64 in flight requests arrive about every round (the H200 stand-in:
    3.6 ms a round past the device stages for DDTree b4, 0.3 ms for AR, whose requests arrive once a wave)."""

    states: list[RequestState]  # in the order of ``tokens``
    tokens: torch.Tensor  # [D] long, device
    copy: HostCopy  # ``tokens``' copy to the host, started when they were sampled
    started: float  # perf_counter at the start of the prefill step (the rows' prefill stage time ends at the read)
    # the queued round (_Flight.seq) whose prompt chunk sampled them (a mixed round), None: a prefill step's. Those
    # of the round in flight are read once it is read, not at the top of the next iteration (which would make the
    # host wait for that round before queuing the next one)
    round_seq: int | None = None


@dataclass
class _Flight:
    """A round queued on the device whose result the host has not read yet."""

    states: list[RequestState]  # the rows, in order
    result: torch.Tensor  # [R, 2 + L] device: tokens committed, then the tokens (ModelRunner.round)
    copy: HostCopy  # the result's copy to the host, started when the round was queued
    rows: PackedRows  # the round's device inputs (a follow-up round advances them)
    shape: RoundShape
    timer: StageTimer
    explores: bool = False  # budget auto ran a size above its best to observe it (AutoChooser.choose)
    riders: list[RequestState] = field(default_factory=list)  # a mixed round's prefilling requests (_launch)
    seq: int = 0  # the round's number (Scheduler._rounds_queued when it was queued)


class Scheduler:
    """The engine loop over one built engine (:class:`~ddtree.engine.build.EngineParts`)."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.target, self.drafter, self.tokenizer = parts.target, parts.drafter, parts.tokenizer
        self.model_name = parts.model_name
        self.config = parts.config
        self.trained_block_size = parts.trained_block_size
        self.max_block_size = int(parts.config.max_block_size)
        self.device = parts.device
        self.cache_len = parts.cache_len
        self.runner = parts.runner
        self.graphs = parts.graphs
        self.prefill_graphs = parts.prefill_graphs
        self._overlap = parts.overlap
        self.eos_ids = parts.eos_ids
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiting: deque[RequestState] = deque()
        self._active: dict[int, RequestState] = {}  # slot -> state
        self._by_id: dict[str, RequestState] = {}
        self._free_slots = list(range(parts.config.max_batch - 1, -1, -1))
        self._counters = _Counters()
        self._lock = threading.Lock()  # guards counters and queue sizes read by snapshot()
        self._stopping = False
        # budget "auto" (ddtree.engine.auto_budget): round seconds by (rows, budget, kv_len); None = measured on this
        # engine at the first auto round (logged), unless a caller sets one first
        self.cost_curve: CostCurve | None = None
        self._auto = auto_budget.AutoChooser(parts.config.max_budget)
        self._cost_waiters: list[threading.Event] = []  # prepare_auto calls waiting for the loop to measure
        self._first: _FirstTokens | None = None  # the last prefill step's first tokens, until read
        self._mixing = True  # mixed rounds allowed (off for good once one fails in its graphs)
        self._rounds_queued = 0  # _Flight.seq

    # ---- the inbox (any thread) --------------------------------------------------------------------------------
    def _enqueue(self, state: RequestState) -> None:
        self._inbox.put(("submit", state))
        self._wake.set()

    def _enqueue_cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    # ---- the loop ----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        """One iteration: admit, one prefill step, then read the round in flight, launch the next and only then
        emit what was read, so detokenizing, stop checks and callbacks overlap the device's next round."""
        flight: _Flight | None = None
        while not self._stopping:
            self._drain_inbox()
            self._admit()
            worked = self._read_first_tokens(in_flight=flight.seq if flight is not None else None)
            prefilling = [s for s in self._active.values() if s.phase is Phase.PREFILL]
            riders = self._riders(prefilling)  # their chunks ride in this iteration's round
            separate = [s for s in prefilling if not _holds(riders, s)]
            if separate:
                self._guarded(self._prefill_step, separate)
                worked = True
            results: list[RowResult] = []
            follow_up: _Flight | None = None
            if flight is not None:
                follow = self._follow_size(flight)  # (size, best, joiners)
                if follow is not None:
                    follow_up = self._follow_up(flight, *follow, riders)
                results = self._collect_guarded(flight)
                flight = follow_up
                worked = True
            if self._cost_waiters and flight is None:  # prepare_auto: the measurement replays the round graphs
                self._measure_for_waiters()
            pending = {state.request_id: tokens for state, tokens, _ in results}
            first = self._first.states if self._first is not None else []
            for state in first:  # one token each, still on the device: counted, its value patched there
                pending[state.request_id] = [UNREAD]
            decoding = [s for s in self._active.values()
                        if s.phase is Phase.DECODE and not s.ends_by_token(pending.get(s.request_id, ()))]
            if follow_up is None and decoding:
                try:
                    flight = self._launch(decoding, pending, riders)
                except Exception:
                    # Emit first so every state is exact, then isolate the fault row by row, synchronously (rows
                    # whose first token is unread join once it is read; riders prefill in steps of their own).
                    self._emit_results(results)
                    results = []
                    for state in decoding:
                        if state.phase is Phase.DECODE and not _holds(first, state):
                            self._guarded(self._decode_round, [state])
                    self._prefill_alone(riders)
                worked = True
            self._emit_results(results)
            if riders and flight is None:  # every decoding row finished on the tokens just read: no round to ride
                self._prefill_alone(riders)
                worked = True
            if not worked:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
        if flight is not None:
            self._collect_guarded(flight)  # let the device finish; the requests are being cancelled
        self._first = None
        self._drain_inbox()  # deliver the final chunks of cancellations queued by shutdown()
        # A submit that passed the accepting check just before shutdown() arrives after its cancellations: finish
        # it too, or its caller (a generate() waiting on it) would wait forever.
        for state in list(self._by_id.values()):
            self._finish(state, "cancelled")

    def _measure_for_waiters(self) -> None:
        try:
            self._auto_cost()
        except Exception:  # the loop goes on; prepare_auto's caller gets the error
            log.exception("budget auto: measuring the cost curve failed")
        for done in self._cost_waiters:
            done.set()
        self._cost_waiters.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._by_id[payload.request_id] = payload
                self._waiting.append(payload)
            elif kind == "cancel":
                state = self._by_id.get(payload)
                if state is not None:
                    self._finish(state, "cancelled")
            elif kind == "cost":  # prepare_auto: measured by the loop once no round is in flight
                self._cost_waiters.append(payload)

    def _admit(self) -> None:
        while self._waiting and self._free_slots:
            state = self._waiting.popleft()
            state.slot = self._free_slots.pop()
            state.phase = Phase.PREFILL
            state.admitted_at = time.perf_counter()
            state.stats.queue_s = state.admitted_at - state.arrival
            with self._lock:
                self._active[state.slot] = state

    def _riders(self, prefilling: list[RequestState]) -> list[RequestState]:
        """The prefilling requests whose next chunk rides in this iteration's decode round (a mixed round): all of
        them while some request decodes and ``EngineConfig.mixed_chunk`` is on, except those that asked for
        log-probs (their prompt's, or their first token's, which a prefill step reads with its logits)."""
        if self.config.mixed_chunk <= 0 or not prefilling or not self._mixing:
            return []
        if not any(s.phase is Phase.DECODE for s in self._active.values()):
            return []
        return [s for s in prefilling if s.sampling.prompt_logprobs is None and s.sampling.logprobs is None]

    def _prefill_alone(self, states: list[RequestState]) -> None:
        """A prefill step for those of ``states`` still prefilling (riders whose round did not run)."""
        left = [s for s in states if s.phase is Phase.PREFILL]
        if left:
            self._guarded(self._prefill_step, left)

    def _guarded(self, step: Callable[[list[RequestState]], None], states: list[RequestState]) -> None:
        """Run a batched step; on failure rerun each request alone and fail only those that fail alone."""
        try:
            step(states)
        except Exception:
            if len(states) == 1:
                log.exception("request %s failed", states[0].request_id)
                self._finish(states[0], "error", error=_describe_current_exception())
                return
            for state in states:
                if state.phase in (Phase.PREFILL, Phase.DECODE):
                    self._guarded(step, [state])

    # ---- prefill ---------------------------------------------------------------------------------------------
    @staticmethod
    def _chunk_rows(states: list[RequestState], budget: int) -> list[tuple[RequestState, int]]:
        """(state, prompt tokens it takes) for a chunk of at most ``budget`` tokens, in the states' order."""
        rows: list[tuple[RequestState, int]] = []
        for state in states:
            if budget <= 0:
                break
            take = min(len(state.prompt_ids) - state.prefilled, budget)
            rows.append((state, take))
            budget -= take
        return rows

    @staticmethod
    def _chunk_ids(rows: list[tuple[RequestState, int]]) -> torch.Tensor:
        """The chunk's prompt tokens ``[R, widest take]`` (host, zero-padded)."""
        ids = torch.zeros((len(rows), max(take for _, take in rows)), dtype=torch.long)
        for i, (state, take) in enumerate(rows):
            ids[i, :take] = torch.tensor(state.prompt_ids[state.prefilled : state.prefilled + take])
        return ids

    def _eager_chunk(self, rows: list[tuple[RequestState, int]], ids: torch.Tensor) -> PrefillInputs:
        """The device inputs of an eager chunk: width padded to a multiple of 16, key length bucketed (kernel
        variants the warm-up planned: cuda_graphs.eager_chunk_dims)."""
        start = [s.prefilled for s, _ in rows]
        takes = [t for _, t in rows]
        padded, kv_len = eager_chunk_dims(ids.shape[1], start, self.runner.target_cache.max_len)
        up = self._upload
        return PrefillInputs(
            ids=up(torch.nn.functional.pad(ids, (0, padded - ids.shape[1]))),
            slots=up(torch.tensor([s.slot for s, _ in rows])),
            start=up(torch.tensor(start)),
            valid_len=up(torch.tensor(takes)),
            last_index=up(torch.tensor([t - 1 for t in takes])),
            kv_len=kv_len,
        )

    def _prefill_step(self, states: list[RequestState]) -> None:
        rows = self._chunk_rows(states, self.config.prefill_chunk)
        t0 = time.perf_counter()
        ids = self._chunk_ids(rows)
        width = ids.shape[1]
        start = [s.prefilled for s, _ in rows]
        takes = [t for _, t in rows]
        logits = None
        # Prompt log-probs need the logits at every position, which the prefill graphs do not keep: a chunk with a
        # row that asked runs eagerly (and computes every row's; only the asking rows' are read).
        prompt_lp = any(s.sampling.prompt_logprobs is not None for s, _ in rows)
        every = None
        if not prompt_lp and self.prefill_graphs is not None and self.prefill_graphs.can_run(len(rows), width, start):
            try:
                logits = self.prefill_graphs.run(ids, [s.slot for s, _ in rows], takes)
            except Exception:  # a capture that fails (memory, an op graphs refuse) must not fail the requests
                log.exception("prefill CUDA graph failed; prefilling eagerly from now on")
                self.prefill_graphs = None
        if logits is None:
            inp = self._eager_chunk(rows, ids)
            if prompt_lp:
                every = self.runner.prefill(inp, every_position=True)[:, :width]  # [R, T, V]
                logits = torch.gather(every, 1, inp.last_index[:, None, None].expand(-1, 1, every.shape[-1]))[:, 0]
            else:
                logits = self.runner.prefill(inp)
        if every is not None:
            self._prompt_logprobs(rows, ids, every)
        done = [i for i, (s, take) in enumerate(rows) if s.prefilled + take == len(s.prompt_ids)]
        first: list[int] = []
        first_lp: list[TokenLogprob | None] = []
        late: _FirstTokens | None = None
        if done:
            finished = [rows[i][0] for i in done]
            last = logits if len(done) == len(rows) else logits[self._upload(torch.tensor(done))]  # [D, V]
            chosen = self._sample_first(finished, last)
            if any(s.sampling.logprobs is not None for s in finished):
                # the first token's log-probs: the prefill's last logits, in the same host read as the token
                first, chosen_lp, top_lp, top_ids = to_host(chosen, *device_logprobs(last, chosen))
                first_lp = [None if s.sampling.logprobs is None else
                            host_entries([chosen_lp[j]], [top_lp[j]], [top_ids[j]], [first[j]], s.sampling.logprobs)[0]
                            for j, s in enumerate(finished)]
            else:  # read at the top of the next iteration (_FirstTokens); the rows decode meanwhile
                self._read_first_tokens()  # one step's tokens unread at a time (fault isolation reruns this step)
                late = _FirstTokens(states=finished, tokens=chosen, copy=HostCopy(chosen), started=t0)
        elapsed = time.perf_counter() - t0
        for state, take in rows:
            state.prefilled += take
            if late is None or not _holds(late.states, state):
                state.stats.stage_s["prefill"] = state.stats.stage_s.get("prefill", 0.0) + elapsed
        if late is not None:
            for state in late.states:
                state.phase = Phase.DECODE
            self._first = late
            return
        for j, (i, tok) in enumerate(zip(done, first, strict=False)):
            self._first_token(rows[i][0], tok, [first_lp[j]] if first_lp and first_lp[j] is not None else None)

    def _sample_first(self, finished: list[RequestState], last: torch.Tensor) -> torch.Tensor:
        """The first completion token ``[D]`` (device) of each request whose prompt ``last`` [D, V] ends."""
        temp, top_p, top_k, seed = self._sampling_tensors(finished)
        greedy = all(s.sampling.greedy for s in finished)
        ban = None
        if any(s.banned_ids for s in finished):  # min_tokens: the first token (output index 0) is masked too
            ids = [list(s.banned_ids) + [-1] * (MAX_STOP_IDS - len(s.banned_ids)) for s in finished]
            ban = (self._upload(torch.tensor(ids, dtype=torch.long).T.contiguous()),
                   self._upload(torch.tensor([s.sampling.min_tokens for s in finished], dtype=torch.long)))
        return self.runner.sample_first(last, temp, top_p, top_k, seed, greedy, _any_filter(finished), min_tokens=ban)

    def _ride(self, rows: list[tuple[RequestState, int]], logits: torch.Tensor, t0: float, seq: int) -> None:
        """Account for the chunk rows a mixed round (number ``seq``) carries (queued, not read): the riders' prompts
        move on, and those whose prompt it ends get their first token sampled on the device from ``logits`` [P, V]
        (each row's last token), read once the round is (:class:`_FirstTokens`); they decode from the round after,
        which may be queued before this one is read (their roots patched on the device)."""
        for state, take in rows:
            state.prefilled += take
        done = [i for i, (s, _) in enumerate(rows) if s.prefilled == len(s.prompt_ids)]
        if not done:
            return
        finished = [rows[i][0] for i in done]
        last = logits if len(done) == len(rows) else logits[self._upload(torch.tensor(done))]  # [D, V]
        chosen = self._sample_first(finished, last)
        for state in finished:
            state.phase = Phase.DECODE
        # One batch of unread first tokens at a time: those unread so far (a prefill step's, or the round before's
        # riders') are read now. This round is queued already, so the device keeps working while the host waits.
        self._read_first_tokens()
        self._first = _FirstTokens(states=finished, tokens=chosen, copy=HostCopy(chosen), started=t0, round_seq=seq)

    def _ride_rows(self, riders: list[RequestState]) -> list[tuple[RequestState, int]]:
        """The chunk rows of a mixed round: ``EngineConfig.mixed_chunk`` prompt tokens among the riders, in order."""
        return self._chunk_rows(riders, self.config.mixed_chunk)

    def _first_token(self, state: RequestState, token: int, logprobs: list[TokenLogprob] | None = None) -> None:
        """A request's first completion token, read: it decodes from now on (and may finish on it)."""
        state.phase = Phase.DECODE
        state.stats.ttft_s = time.perf_counter() - state.arrival
        with self._lock:
            if state.counted:
                self._counters.prompt_tokens_total += len(state.prompt_ids)
        self._emit(state, [token], logprobs)

    def _read_first_tokens(self, in_flight: int | None = None) -> bool:
        """Read and emit the unread first tokens (:class:`_FirstTokens`), if any: a prefill step's waits only for
        that prefill (the round launched after it is still running); those a mixed round sampled are left unread
        while that round is the one in flight (``in_flight``: its ``_Flight.seq``), so the host does not wait for
        it before queuing the next. Rows cancelled meanwhile are skipped; a read that fails (a device fault
        surfaces at the sync) fails its rows."""
        first = self._first
        if first is None or in_flight is not None and first.round_seq == in_flight:
            return False
        self._first = None
        try:
            tokens = first.copy.get()
        except Exception:
            log.exception("reading the first tokens of a prefill step failed")
            error = _describe_current_exception()
            for state in first.states:
                self._finish(state, "error", error=error)
            return True
        elapsed = time.perf_counter() - first.started
        for state, token in zip(first.states, tokens, strict=True):
            if state.phase is Phase.DECODE:
                state.stats.stage_s["prefill"] = state.stats.stage_s.get("prefill", 0.0) + elapsed
                self._first_token(state, token)
            elif state.counted:  # cancelled after its prompt was prefilled: its prompt counts, as a read one's does
                with self._lock:
                    self._counters.prompt_tokens_total += len(state.prompt_ids)
        return True

    def _prompt_logprobs(self, rows: list[tuple[RequestState, int]], ids: torch.Tensor, every: torch.Tensor) -> None:
        """Append this chunk's prompt log-probs to each asking row: column ``c`` (position ``s + c``) predicts the
        prompt token at ``s + c + 1``; the chunk's last column predicts the next chunk's first token (or the first
        completion token: not a prompt token, dropped). The first prompt token has none (None, as vLLM)."""
        nxt = torch.zeros_like(ids)  # [R, T] host: the token each column predicts (0 past the prompt)
        for i, (state, take) in enumerate(rows):
            follow = state.prompt_ids[state.prefilled + 1 : state.prefilled + take + 1]
            nxt[i, : len(follow)] = torch.tensor(follow, dtype=torch.long)
        chosen_lp, top_lp, top_ids = to_host(*device_logprobs(every, nxt.to(self.device)))
        for i, (state, take) in enumerate(rows):
            n_top = state.sampling.prompt_logprobs
            if n_top is None:
                continue
            # entries for positions 0 .. prefilled exist already; cutting there makes a rerun of the step (fault
            # isolation) replace this chunk's entries instead of appending them twice
            kept = (state.prompt_logprobs or [None])[: state.prefilled + 1]
            follow = state.prompt_ids[state.prefilled + 1 : state.prefilled + take + 1]
            state.prompt_logprobs = kept + host_entries(chosen_lp[i], top_lp[i], top_ids[i], follow, n_top)

    # ---- decode ----------------------------------------------------------------------------------------------
    def _decode_round(self, states: list[RequestState]) -> None:
        """One round for ``states``, start to finish (the synchronous path: fault isolation reruns rows with it)."""
        self._emit_results(self._collect(self._launch(states, {})))

    def _launch(self, states: list[RequestState], pending: dict[str, list[int]],
                riders: list[RequestState] = ()) -> _Flight:
        """Queue one round for ``states`` on the device and return without waiting for it.

        ``pending``: tokens read from the previous round but not yet committed to their states (the loop emits
        them while this round runs); a row's root, position and step are taken as if they were committed, which
        is exact for every row that does not finish on them (rows that do are dropped when this round is read).
        ``riders``: prefilling requests whose next chunk rides in the round's verify forward (a mixed round,
        :meth:`_riders`)."""
        block = self._block_size(states)
        auto = block > 1 and any(s.tree.auto for s in states)
        explores = False
        if auto:  # every auto row takes the round's whole budget: the verify is padded to it anyway
            chosen, best = self._auto_choice(states, pending, explore=True)
            explores = chosen != best
            self._auto.previous = best  # the hysteresis keeps the best, not an explored size
            for s in (s for s in states if s.tree.auto):
                s.auto_budget = chosen
        max_budget = max(s.budget for s in states) if block > 1 else 0
        auto_width = auto_budget.curve_width(bucket_nodes(max_budget), self._auto.candidates) if auto else 0
        rows, patch = self._row_inputs(states, pending)
        reach = max(r.start for r in rows)
        shape = RoundShape(
            rows=len(rows),
            max_budget=max_budget,
            block_size=block,
            kv_len=reach + max_budget + 1,
            draft_kv_len=max(1, reach),
            **_row_flags(states),
            auto_width=auto_width,
        )
        # One host tensor per dtype: one copy each to the device instead of one per field.
        return self._queue(states, PackedRows.pack(rows), shape, self._root_patch(patch), explores=explores,
                           riders=list(riders))

    def _block_size(self, states: list[RequestState]) -> int:
        """The draft block of a round of ``states``: the largest of its drafting rows' (1: no row drafts)."""
        drafting = [s for s in states if s.tree.method != "ar"]
        return max((int(s.tree.block_size) for s in drafting), default=1) if self.drafter is not None else 1

    def _row_inputs(self, states: list[RequestState], pending: dict[str, list[int]],
                    first_row: int = 0) -> tuple[list[RowInputs], list[tuple[int, int]]]:
        """The host inputs of ``states``' rows (the round's rows ``first_row`` on) and the roots to patch on the
        device: (row, index into the unread first tokens) for each state whose first token is unread."""
        rows = []
        late = self._first.states if self._first is not None else []
        patch: list[tuple[int, int]] = []  # (row, index into self._first.tokens): roots taken on the device
        for s in states:
            extra = pending.get(s.request_id, ())
            j = next((j for j, t in enumerate(late) if t is s), None)
            root = extra[-1] if extra else s.root_token
            if j is not None:  # its first token is unread: one token past the prompt, the root patched on the device
                extra, root = [UNREAD], 0
                patch.append((first_row + len(rows), j))
            rows.append(RowInputs(
                slot=s.slot, root_token=root, start=s.root_position + len(extra),
                budget=s.budget, topk=s.topk, depth_limit=s.depth_limit, window=s.tree.draft_window or NO_WINDOW,
                top_k=int(s.sampling.top_k), seed=s.seed, step=len(s.output_ids) + len(extra),
                min_tokens=s.sampling.min_tokens, temperature=float(s.sampling.temperature),
                top_p=float(s.sampling.top_p), auto=int(s.tree.auto), banned=s.banned_ids))
        return rows, patch

    def _root_patch(self, patch: list[tuple[int, int]]) -> Callable[[PackedRows], None] | None:
        """What writes the unread first tokens into their rows' roots on the device, after the inputs' copy and
        before the round's kernels: one device-to-device copy per row (slices: no index tensor to upload, which
        from pageable memory would synchronise)."""
        if not patch:
            return None
        tokens = self._first.tokens

        def apply(rows: PackedRows) -> None:
            root = rows.field("root_token")
            for r, j in patch:
                root[r : r + 1].copy_(tokens[j : j + 1])

        return apply

    def _queue(self, states: list[RequestState], rows: PackedRows, shape: RoundShape,
               patch: Callable[[PackedRows], None] | None = None, *, explores: bool = False,
               riders: list[RequestState] = ()) -> _Flight:
        """Queue a round from packed inputs (host tensors, or device tensors for a follow-up round); ``patch``
        edits the device inputs before the round runs (:meth:`_root_patch`); ``riders``: a mixed round's
        prefilling requests (their chunk's layers graph per round key and chunk bucket: RoundGraphs.run_mixed)."""
        timer = StageTimer(self.device)
        t0 = time.perf_counter()
        if not self._mixing:  # a mixed round failed in its graphs since the riders were chosen: they prefill later
            riders = []
        self._rounds_queued += 1
        seq = self._rounds_queued
        ride = self._ride_rows(riders) if riders else []
        first_logits = None
        graphed = self.graphs is not None and self.graphs.can_run(len(states))
        if ride and graphed:
            ids = self._chunk_ids(ride)
            chunk = ChunkRows(ids=ids, slots=tuple(s.slot for s, _ in ride), start=tuple(s.prefilled for s, _ in ride),
                              valid_len=tuple(t for _, t in ride))
            try:
                result, rows, prompt = self.graphs.run_mixed(rows, shape, timer, chunk, patch=patch)
                first_logits = self.runner.chunk_logits(prompt)
            except Exception:  # the loop reruns the rows alone and prefills the riders in a step of their own
                log.exception("a mixed round failed in its CUDA graphs; prompts are prefilled in steps of their "
                              "own from now on")
                self._mixing = False
                raise
        elif graphed:
            result, rows = self.graphs.run(rows, shape, timer, patch=patch)
        else:
            rows = rows.to(self.device)
            if patch is not None:
                rows = PackedRows(rows.longs.clone(), rows.floats)  # .to() may return the caller's host tensor
                patch(rows)
            work = RoundWork()
            inp = RoundInputs.from_packed(rows, shape)
            if ride:
                inp = replace(inp, prefill=self._eager_chunk(ride, self._chunk_ids(ride)))
            result = self.runner.round(inp, timer, work)
            first_logits = work.first_logits
        if ride:
            self._ride(ride, first_logits, t0, seq)
            with self._lock:
                self._counters.mixed_rounds_total += 1
                self._counters.mixed_prompt_tokens_total += int(sum(t for _, t in ride))
        return _Flight(states=states, result=result, copy=HostCopy(result), rows=rows, shape=shape, timer=timer,
                       explores=explores, riders=list(riders), seq=seq)

    def _follow_size(self, flight: _Flight) -> tuple[int, int, list[RequestState]] | None:
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
        live = _live(flight)
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

    def _joiners(self, flight: _Flight) -> list[RequestState] | None:
        """The decoding requests outside ``flight`` that its follow-up takes in, or None when the follow-up's rows
        (``flight``'s still decoding and these) need a round of another kind than ``flight``'s (block size, sampling
        flags, budget auto or not): a host launch makes that one. A newcomer that finishes on its unread first
        token (``max_tokens`` 1) is left out, as a host launch leaves it out."""
        held = {id(s) for s in flight.states}
        unread = self._unread([s for s in self._active.values() if id(s) not in held])
        joiners = [s for s in self._active.values() if s.phase is Phase.DECODE and id(s) not in held
                   and not s.ends_by_token(unread.get(s.request_id, ()))]
        states = _live(flight) + joiners
        shape = flight.shape
        auto = shape.block_size > 1 and any(s.tree.auto for s in states)
        same = (self._block_size(states) == shape.block_size and auto == (shape.auto_width > 0)
                and _row_flags(states) == {name: getattr(shape, name) for name in _ROW_FLAGS})
        return joiners if same else None

    def _unread(self, states: list[RequestState]) -> dict[str, list[int]]:
        """The first token still on the device (one token, not yet read) of each of ``states`` that has one."""
        late = self._first.states if self._first is not None else []
        return {s.request_id: [UNREAD] for s in states if _holds(late, s)}

    @staticmethod
    def _follow_reach(live: list[RequestState], block: int, joiners: list[RequestState]) -> int:
        """The furthest root a follow-up of the flight's ``live`` rows (draft block ``block``) taking ``joiners``
        can start from."""
        reach = max(s.root_position for s in live) + block
        return max([reach] + [s.root_position + 1 for s in joiners])

    def _follow_up(self, flight: _Flight, size: int, best: int | None = None, joiners: list[RequestState] = (),
                   riders: list[RequestState] = ()) -> _Flight | None:
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
            joiners, live = list(joiners), _live(flight)
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

    def _collect(self, flight: _Flight) -> list[RowResult]:
        """Wait for a launched round and account for it; returns each still-decoding row's committed tokens and,
        for rows that asked, their log-probs (rows finished or cancelled while the round ran are dropped)."""
        rows = flight.copy.get()
        stages = flight.timer.collect()
        with self._lock:
            for name, secs in stages.items():
                self._counters.stage_seconds_total[name] = self._counters.stage_seconds_total.get(name, 0.0) + secs
        out = []
        for state in flight.riders:  # a mixed round's chunk took the whole round
            state.stats.stage_s["prefill"] = state.stats.stage_s.get("prefill", 0.0) + sum(stages.values())
        for state, row in zip(flight.states, rows, strict=True):
            if state.phase is not Phase.DECODE:
                continue
            n = row[0]
            st = state.stats
            st.verify_rounds += 1
            while len(st.accept_hist) <= n:
                st.accept_hist.append(0)
            st.accept_hist[n] += 1
            for name, secs in stages.items():
                st.stage_s[name] = st.stage_s.get(name, 0.0) + secs
            if flight.shape.auto_width and flight.shape.drafts:
                width = flight.shape.auto_width  # the last columns: this row's E(1 .. W), before them its path
                path = row[-width - flight.shape.block_size:-width]
                # its tree's draft nodes (an auto row's budget may already be a follow-up's)
                verified = flight.shape.max_budget if state.tree.auto else min(flight.shape.max_budget, state.budget)
                self._auto.read_row(state, n, bits_to_floats(row[-width:]), path, verified)
                if state.tree.auto:
                    b = flight.shape.max_budget
                    st.auto_budgets[b] = st.auto_budgets.get(b, 0) + 1
            with self._lock:
                c = self._counters
                if state.counted:
                    c.verify_rounds_total += 1
                    while len(c.accept_hist) <= n:
                        c.accept_hist.append(0)
                    c.accept_hist[n] += 1
            tokens = row[1 : 1 + n]
            logprobs = None
            if flight.shape.logprobs and state.sampling.logprobs is not None:
                width = flight.shape.block_size  # L + 1 committed positions per row (1 for AR)
                logprobs = unpack_logprobs(row[1 + width :], tokens, width, MAX_LOGPROBS, state.sampling.logprobs)
            out.append((state, tokens, logprobs))
        return out

    # ---- budget "auto" ---------------------------------------------------------------------------------------------
    def _auto_choice(self, states: list[RequestState], pending: dict[str, list[int]], *,
                     explore: bool) -> tuple[int, int]:
        """(The budget of the next round of ``states``, some "auto"; the best size) by
        :meth:`auto_budget.AutoChooser.choose` over the cost curve at this round's rows bucket and furthest root
        (measured, when the engine has none, only once a row has a curve to weigh: the first round starts at the
        initial budget). ``explore``: it may run a larger size to observe it (the two differ then); the caller makes
        the best size the hysteresis' previous once the round is queued."""
        n = bucket_rows(len(states), self.config.max_batch) if self.graphs is not None else len(states)
        reach = max(s.root_position + len(pending.get(s.request_id, ())) for s in states)
        chosen, best = self._auto.choose(states, lambda b: self._auto_cost().round_seconds(n, b, reach + b + 1),
                                         explore=explore)
        return chosen, best

    def _known_curve(self) -> CostCurve | None:
        """The curve set on the engine, else EngineConfig.cost_curve's (Engine.start resolves it; adopted here).
        None: the next auto choice that weighs one measures it, on the round graphs, so only with no round in flight."""
        source = getattr(self, "cost_curve_source", None)  # ddtree.engine.cost_measure.CurveSource, set by Engine.start
        if self.cost_curve is None and source is not None and source.curve is not None:
            self.cost_curve = source.curve
        return self.cost_curve

    def prepare_auto(self, timeout: float | None = None) -> CostCurve:
        """The cost curve budget "auto" uses, measured now if the engine has none (on the engine thread when it
        runs, so a caller can pay the measurement before timing anything instead of inside the first auto round)."""
        thread = getattr(self, "_thread", None)
        if self.cost_curve is None and thread is not None and thread.is_alive():
            done = threading.Event()
            self._inbox.put(("cost", done))
            self._wake.set()
            done.wait(timeout)
        elif self.cost_curve is None:
            self._auto_cost()
        if self.cost_curve is None:
            raise RuntimeError("budget auto: the cost curve was not measured (see the engine's log)")
        return self.cost_curve

    def _auto_cost(self) -> CostCurve:
        """The cost curve auto divides by: the one set on the engine, else EngineConfig.cost_curve's (Engine.start
        resolves it), else one measured now over the candidates (logged: it stalls the loop once, seconds on a CPU)."""
        if self._known_curve() is None:
            self.cost_curve = fallback_curve(self, self._auto.candidates)
        return self.cost_curve

    def _collect_guarded(self, flight: _Flight) -> list[RowResult]:
        """:meth:`_collect`; if reading the round fails (a device fault surfaces at the sync), its rows fail."""
        try:
            return self._collect(flight)
        except Exception:
            log.exception("a decode round failed on the device")
            error = _describe_current_exception()
            for state in flight.states + flight.riders:
                self._finish(state, "error", error=error)
            return []

    def _emit_results(self, results: list[RowResult]) -> None:
        for state, tokens, logprobs in results:
            if state.phase is Phase.DECODE:
                self._emit(state, tokens, logprobs)

    def _sampling_tensors(self, states: list[RequestState]):
        """temperature, top_p [R] float and top_k, seed [R] long on the device, in two copies."""
        floats = self._upload(torch.tensor([[float(s.sampling.temperature), float(s.sampling.top_p)] for s in states],
                                           dtype=torch.float32).T.contiguous())
        longs = self._upload(torch.tensor([[int(s.sampling.top_k), s.seed] for s in states], dtype=torch.long).T.contiguous())
        return floats[0], floats[1], longs[0], longs[1]

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the engine's device without waiting: through pinned memory, non-blocking (torch's
        blocking host-to-device copy synchronises the stream, i.e. waits for the round in flight; torch keeps the
        pinned block until the copy has run)."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    # ---- emitting and finishing --------------------------------------------------------------------------------
    def _emit(self, state: RequestState, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Commit ``tokens`` (with their log-probs, aligned, when the request asked) and deliver the chunk; the
        first chunk also carries the prompt log-probs of a request that asked for them."""
        try:
            kept, text, reason = state.commit(tokens)
        except Exception:
            log.exception("request %s failed while committing tokens", state.request_id)
            self._finish(state, "error", error=_describe_current_exception())
            return
        state.stats.completion_tokens = len(state.output_ids)
        with self._lock:
            if state.counted:
                self._counters.generation_tokens_total += len(kept)
        extra = {"logprobs": logprobs[: len(kept)] if logprobs is not None else None,
                 "prompt_logprobs": state.take_prompt_logprobs()}
        if reason is not None:
            self._finish(state, reason, last_ids=kept, last_text=text, **extra)
            return
        self._deliver(state, StreamChunk(request_id=state.request_id, token_ids=kept, text=text, **extra))

    def _finish(self, state: RequestState, reason: str, *, last_ids: list[int] | None = None,
                last_text: str = "", error: str | None = None, logprobs: list[TokenLogprob] | None = None,
                prompt_logprobs: list[TokenLogprob | None] | None = None) -> None:
        if state.phase is Phase.DONE:
            return
        if state.phase is Phase.WAITING:
            try:
                self._waiting.remove(state)
            except ValueError:
                pass
        if state.slot >= 0:
            with self._lock:
                self._active.pop(state.slot, None)
            self._free_slots.append(state.slot)
            state.slot = -1
        state.phase = Phase.DONE
        self._by_id.pop(state.request_id, None)
        st = state.stats
        st.finish_reason = reason  # type: ignore[assignment]
        st.latency_s = time.perf_counter() - state.arrival
        with self._lock:
            if state.counted:
                self._counters.requests_total[reason] = self._counters.requests_total.get(reason, 0) + 1
        chunk = StreamChunk(
            request_id=state.request_id,
            token_ids=last_ids or [],
            text=last_text,
            finished=True,
            finish_reason=reason,  # type: ignore[arg-type]
            stats=st,
            error=error,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        self._deliver(state, chunk, final=True)

    def _deliver(self, state: RequestState, chunk: StreamChunk, *, final: bool = False) -> None:
        try:
            state.on_chunk(chunk)
        except Exception:
            log.warning("request %s: the consumer raised; cancelling it", state.request_id, exc_info=True)
            if not final:
                self._finish(state, "cancelled")


def _live(flight: _Flight) -> list[RequestState]:
    """The rows of ``flight`` whose requests still decode, in order (the others finished or were cancelled since it
    was queued)."""
    return [s for s in flight.states if s.phase is Phase.DECODE]


def _holds(states: list[RequestState], state: RequestState) -> bool:
    """Whether ``state`` itself is in ``states`` (identity: states are dataclasses, and equality compares fields)."""
    return any(s is state for s in states)


# The fields of a RoundShape that its rows' settings decide (_row_flags): a follow-up's joiners must keep them.
_ROW_FLAGS = ("greedy", "filtered", "contiguous", "logprobs", "min_tokens")


def _row_flags(states: list[RequestState]) -> dict[str, bool]:
    """The :data:`_ROW_FLAGS` of a round of ``states``."""
    return {"greedy": all(s.sampling.greedy for s in states), "filtered": _any_filter(states),
            "contiguous": all(s.tree.method != "ddtree" for s in states),
            "logprobs": any(s.sampling.logprobs is not None for s in states),
            "min_tokens": any(bool(s.banned_ids) for s in states)}


def _any_filter(states: list[RequestState]) -> bool:
    return any(s.sampling.top_p < 1.0 or s.sampling.top_k > 0 for s in states if not s.sampling.greedy)


def _describe_current_exception() -> str:
    import sys

    exc = sys.exc_info()[1]
    return f"{type(exc).__name__}: {exc}"

