"""The scheduler: admit, prefill, launch, collect and overlap rounds, and emit their tokens.

It runs on the engine's thread (started by the facade, :class:`ddtree.engine.engine.Engine`, which derives from it)
and owns every request's state; other threads reach it only through the inbox (:meth:`Scheduler._enqueue`,
:meth:`Scheduler._enqueue_cancel`)::

    inbox  ->  loop: admit -> one prefill step -> read round n -> launch round n + 1
                     -> emit round n's chunks (on_chunk callbacks) while n + 1 runs

With ``overlap_rounds`` (CUDA) round n + 1 is queued on the device before round n is read, its rows advanced there
from round n's result, finished rows dropped and newcomers appended (:meth:`Scheduler._follow_size`), prompt chunks
riding in it (a mixed round); only a change of the round's kind or a cost curve to measure waits for a host launch.

Scheduling: requests wait in a bounded FIFO queue until a KV slot is free; a newcomer's prompt is written in chunks,
so running requests keep decoding while long prompts load: by prefill steps of ``prefill_chunk`` tokens between rounds
(while others decode, arrivals start at most once every ``prefill_every`` rounds and share a step:
:meth:`~ddtree.engine.prefill_steps.PrefillSteps._prefill_due`), or, with ``EngineConfig.mixed_chunk`` above 0 and
some request decoding, inside the decode round's own verify forward (a mixed round: the riders' chunks under a
prefill step's rule with ``mixed_chunk`` as its size, in admission order; requests that asked for log-probs still
take prefill steps). A mixed round reads the target's weights once for both, and a decoding request waits for at
most ``mixed_chunk`` extra tokens of forward per round (padding included); prompts are admitted at that rate. Off
by default (docs/benchmarks.md, "Mixed rounds"). A slot is freed the moment its request finishes or is cancelled.

Where the rest lives: prefill steps, mixed rounds' riders and first tokens in :mod:`ddtree.engine.prefill_steps`,
rounds queued before the flight is read in :mod:`ddtree.engine.follow_ups` (both mixins of :class:`Scheduler`),
the loop's in-between state (a round in flight, unread first tokens) in :mod:`ddtree.engine.flights`.

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
from ddtree.engine.api import MAX_LOGPROBS, StreamChunk, TokenLogprob
from ddtree.engine.build import EngineParts
from ddtree.engine.cost_curve import CostCurve
from ddtree.engine.cost_measure import fallback_curve
from ddtree.engine.cuda_graphs import bucket_nodes, bucket_rows
from ddtree.engine.flights import (
    UNREAD,
    FirstTokens,
    Flight,
    RowResult,
    describe_current_exception,
    holds,
    row_flags,
)
from ddtree.engine.follow_ups import FollowUps
from ddtree.engine.logprobs import bits_to_floats, unpack_logprobs
from ddtree.engine.prefill_steps import PrefillSteps
from ddtree.engine.request_state import Phase, RequestState
from ddtree.engine.round import (
    NO_WINDOW,
    ChunkRows,
    PackedRows,
    RoundInputs,
    RoundShape,
    RoundWork,
    RowInputs,
)
from ddtree.engine.runner import HostCopy, StageTimer

log = logging.getLogger("ddtree.engine")


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
    mixed_deferred_total: int = 0  # rounds whose riders took a prefill step instead (capture budget: _may_ride)


class Scheduler(PrefillSteps, FollowUps):
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
        self._first: FirstTokens | None = None  # first tokens a prefill step or a mixed round sampled, until read
        self._mixing = True  # mixed rounds allowed (off for good once one fails in its graphs)
        self._serving_since = time.perf_counter()  # the loop's start: mixed graph captures' budget (_may_ride)
        self._rounds_queued = 0  # Flight.seq
        self._last_read: tuple[int, float] | None = None  # (Flight.seq, perf_counter) of the last round read
        self._steps_after: set[int] = set()  # Flight.seq of rounds a prefill step was queued after (unread ones)
        self._prefill_round = 0  # _rounds_queued at the last prefill step (EngineConfig.prefill_every)

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
        flight: Flight | None = None
        self._serving_since = time.perf_counter()
        while not self._stopping:
            self._drain_inbox()
            self._admit()
            worked = self._read_first_tokens(in_flight=flight.seq if flight is not None else None)
            prefilling = [s for s in self._active.values() if s.phase is Phase.PREFILL]
            riders = self._riders(prefilling)  # their chunks ride in this iteration's round
            separate = [s for s in prefilling if not holds(riders, s)]
            if separate and self._prefill_due(separate):
                self._prefill_round = self._rounds_queued
                self._guarded(self._prefill_step, separate)
                worked = True
            results: list[RowResult] = []
            follow_up: Flight | None = None
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
                        if state.phase is Phase.DECODE and not holds(first, state):
                            self._guarded(self._decode_round, [state])
                    self._prefill_alone(riders)
                worked = True
            self._emit_results(results)
            # riders with no round to ride in (every decoding row finished on the tokens just read), or that the
            # round left out (its mixed graph not captured and the capture budget spent: _may_ride)
            left = [s for s in riders if flight is None or not holds(flight.riders, s)]
            if left:
                self._prefill_alone(left)
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

    def _guarded(self, step: Callable[[list[RequestState]], None], states: list[RequestState]) -> None:
        """Run a batched step; on failure rerun each request alone and fail only those that fail alone."""
        try:
            step(states)
        except Exception:
            if len(states) == 1:
                log.exception("request %s failed", states[0].request_id)
                self._finish(states[0], "error", error=describe_current_exception())
                return
            for state in states:
                if state.phase in (Phase.PREFILL, Phase.DECODE):
                    self._guarded(step, [state])

    # ---- decode ----------------------------------------------------------------------------------------------
    def _decode_round(self, states: list[RequestState]) -> None:
        """One round for ``states``, start to finish (the synchronous path: fault isolation reruns rows with it)."""
        self._emit_results(self._collect(self._launch(states, {})))

    def _launch(self, states: list[RequestState], pending: dict[str, list[int]],
                riders: list[RequestState] = ()) -> Flight:
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
            **row_flags(states),
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
               riders: list[RequestState] = ()) -> Flight:
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
        chunk = None
        if ride and graphed:
            ids = self._chunk_ids(ride)
            chunk = ChunkRows(ids=ids, slots=tuple(s.slot for s, _ in ride), start=tuple(s.prefilled for s, _ in ride),
                              valid_len=tuple(t for _, t in ride))
            if not self._may_ride(shape, chunk):  # the loop prefills them in a step of their own
                ride, riders, chunk = [], [], None
        if chunk is not None:
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
        return Flight(states=states, result=result, copy=HostCopy(result), rows=rows, shape=shape, timer=timer,
                       explores=explores, riders=list(riders), seq=seq)

    def _collect(self, flight: Flight) -> list[RowResult]:
        """Wait for a launched round and account for it; returns each still-decoding row's committed tokens and,
        for rows that asked, their log-probs (rows finished or cancelled while the round ran are dropped)."""
        rows = flight.copy.get()
        self._time_auto_round(flight)
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
            if flight.shape.auto_width:
                if flight.shape.drafts:
                    width = flight.shape.auto_width  # the last columns: this row's E(1 .. W), before them its path
                    path = row[-width - flight.shape.commit_width:-width]
                    # its tree's draft nodes (an auto row's budget may already be a follow-up's)
                    verified = (flight.shape.max_budget if state.tree.auto
                                else min(flight.shape.max_budget, state.budget))
                    self._auto.read_row(state, n, bits_to_floats(row[-width:]), path, verified)
                elif state.tree.auto:  # budget 0: no tree, nothing observed
                    self._auto.read_idle(state)
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
                width = flight.shape.commit_width  # L + 1 committed positions per row (1 for AR, or no tree)
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
        n = self._priced_rows(len(states))
        reach = max(s.root_position + len(pending.get(s.request_id, ())) for s in states)
        # keeps_context: an auto round at budget 0 keeps the drafter's context (its price, where the curve has it)
        chosen, best = self._auto.choose(
            states, lambda b: self._auto_cost().round_seconds(n, b, reach + b + 1, keeps_context=True),
            explore=explore)
        return chosen, best

    def _time_auto_round(self, flight: Flight) -> None:
        """Give budget auto the wall time since the round before ``flight`` was read (the loop's period, when the
        two were queued back to back) beside what the cost curve prices ``flight`` at: the part of a round's time
        the curve does not see (:meth:`auto_budget.AutoChooser.observe_period`), while ``auto_budget.OFFSET`` is on
        (off by default: no host work then beyond two stamps). Not timed: a period with a prefill
        step or a prompt chunk in it (a request's prompt costs the same whatever the tree sizes; spread over the
        rounds, it would make larger trees look cheaper than they are)."""
        now = time.perf_counter()
        last, self._last_read = self._last_read, (flight.seq, now)
        stepped = flight.seq - 1 in self._steps_after
        if self._steps_after:  # a round read: the steps queued before it are past
            self._steps_after = {q for q in self._steps_after if q >= flight.seq}
        if (not auto_budget.OFFSET or not flight.shape.auto_width or last is None or last[0] != flight.seq - 1
                or stepped or flight.riders or self.cost_curve is None):
            return
        priced = self.cost_curve.round_seconds(self._priced_rows(len(flight.states)), flight.shape.max_budget,
                                               flight.shape.kv_len, keeps_context=flight.shape.keeps_context)
        self._auto.observe_period(now - last[1], priced)

    def _priced_rows(self, count: int) -> int:
        """The rows the cost curve prices a round of ``count`` requests at: its graph bucket where rounds replay
        graphs (padding rows cost what real ones do), else the count."""
        return bucket_rows(count, self.config.max_batch) if self.graphs is not None else count

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

    def _collect_guarded(self, flight: Flight) -> list[RowResult]:
        """:meth:`_collect`; if reading the round fails (a device fault surfaces at the sync), its rows fail."""
        try:
            return self._collect(flight)
        except Exception:
            log.exception("a decode round failed on the device")
            error = describe_current_exception()
            for state in flight.states + flight.riders:
                self._finish(state, "error", error=error)
            return []

    def _emit_results(self, results: list[RowResult]) -> None:
        for state, tokens, logprobs in results:
            if state.phase is Phase.DECODE:
                self._emit(state, tokens, logprobs)

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
            self._finish(state, "error", error=describe_current_exception())
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

