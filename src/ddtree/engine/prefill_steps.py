"""Prompts into the KV cache: prefill steps between rounds, chunks riding in a round's verify (mixed rounds), and the
first completion tokens they sample on the device and the host reads later.

A mixin of :class:`ddtree.engine.scheduler.Scheduler` (its methods run on the engine thread and use the
scheduler's state: ``config``, ``runner``, ``graphs``, ``prefill_graphs``, ``_active``, ``_first``, ``_mixing``,
``_serving_since``, ``_counters``, ``_guarded``, ``_emit``, ``_upload``). A newcomer's prompt is written in chunks
of at most ``prefill_chunk`` tokens by prefill steps (a step takes as many prompts as ``prefill_step_tokens`` holds:
:mod:`ddtree.engine.prefill_budget`), or inside the decode round's verify forward while someone decodes
(``EngineConfig.mixed_chunk`` above 0: the same rule with ``mixed_chunk`` as the step's size; not for requests that
asked for log-probs); the step or round that ends a prompt samples its first token on the device
(:class:`~ddtree.engine.flights.FirstTokens`), and its row joins the next round with the token patched into its root
there, before the host has read it.
"""

from __future__ import annotations

import logging
import time

import torch

from ddtree.engine.api import MAX_STOP_IDS, TokenLogprob
from ddtree.engine.cuda_graphs import eager_chunk_dims
from ddtree.engine.flights import FirstTokens, any_filter, describe_current_exception, holds
from ddtree.engine.logprobs import device_logprobs, host_entries
from ddtree.engine.prefill_budget import step_takes
from ddtree.engine.request_state import Phase, RequestState
from ddtree.engine.round import ChunkRows, PrefillInputs, RoundShape
from ddtree.engine.runner import HostCopy, to_host

log = logging.getLogger("ddtree.engine")

# Mixed rounds' graph captures take at most this share of the time since the engine loop started (PrefillSteps
# ._may_ride); past it, riders whose layers graph is not captured take a prefill step instead.
MIXED_CAPTURE_SHARE = 0.05


class PrefillSteps:
    """Prefill steps, mixed rounds' riders and first tokens (module docstring)."""

    def _riders(self, prefilling: list[RequestState]) -> list[RequestState]:
        """The prefilling requests whose next chunk rides in this iteration's decode round (a mixed round): all of
        them while some request decodes and ``EngineConfig.mixed_chunk`` is on, except those that asked for
        log-probs (their prompt's, or their first token's, which a prefill step reads with its logits)."""
        if self.config.mixed_chunk <= 0 or not prefilling or not self._mixing:
            return []
        if not self._someone_decodes():
            return []
        return [s for s in prefilling if s.sampling.prompt_logprobs is None and s.sampling.logprobs is None]

    def _may_ride(self, shape: RoundShape, chunk: ChunkRows) -> bool:
        """Whether a graphed round of ``shape`` may carry ``chunk`` (its riders' rows): its layers graph with that
        chunk is captured, or capturing it now keeps the mixed captures' time within :data:`MIXED_CAPTURE_SHARE` of
        the time since the loop started. Why: a mixed graph's key (the round's and the chunk's buckets) is known only
        when a chunk rides, so the warm-up cannot plan it, and each capture stalls the whole batch (an eager pass and
        a recording of the target's layers: 0.27 s on the H100 stand-in); without a budget a fresh server's first
        arrivals would meet one capture after another. Refused riders take a prefill step in the same iteration, as
        with mixing off; later rounds of the same buckets capture once the budget allows (the graphs of a steady
        load are few: 14-25 in a whole C = 64 cell of docs/benchmarks.md)."""
        graphs = self.graphs
        if graphs.mixed_captured(shape, chunk):
            return True
        if graphs.mixed_capture_s <= MIXED_CAPTURE_SHARE * (time.perf_counter() - self._serving_since):
            return True
        with self._lock:
            self._counters.mixed_deferred_total += 1
        return False

    def _someone_decodes(self) -> bool:
        """Whether some admitted request decodes (prompts then ride in its rounds or wait for a shared step)."""
        return any(s.phase is Phase.DECODE for s in self._active.values())

    def _prefill_due(self, states: list[RequestState]) -> bool:
        """Whether the prefilling ``states`` (not riding in a round) take a prefill step in this iteration: always,
        unless some request decodes and ``EngineConfig.prefill_every`` is above 1; then once that many rounds were
        queued since the last step, or when one of them is past its first chunk (a long prompt goes on as before),
        or when their prompts hold a whole chunk (``prefill_chunk``: a step that large costs its compute, so
        sharing it saves little). Why: at 64 in flight one request arrives about every round, and each arrival's
        own step of a 60-token prompt cost the whole batch about a read of the target's weights (the H200
        stand-in: DDTree's round 2.7 ms past its device stages, docs/benchmarks.md "Rounds that take in
        newcomers"); arrivals that share a step pay that once."""
        every = self.config.prefill_every
        if every <= 1 or not self._someone_decodes():
            return True
        if any(s.prefilled > 0 for s in states):
            return True
        if sum(len(s.prompt_ids) for s in states) >= self.config.prefill_chunk:
            return True
        return self._rounds_queued - self._prefill_round >= every

    def _prefill_alone(self, states: list[RequestState]) -> None:
        """A prefill step for those of ``states`` still prefilling (riders whose round did not run)."""
        left = [s for s in states if s.phase is Phase.PREFILL]
        if left:
            self._guarded(self._prefill_step, left)

    def _step_rows(self, states: list[RequestState]) -> list[tuple[RequestState, int]]:
        """(state, prompt tokens it takes) for a prefill step, in the states' order: ``prefill_chunk`` tokens of
        each prompt at most, as many prompts as ``prefill_step_tokens`` holds with the step's padding
        (:func:`ddtree.engine.prefill_budget.step_takes`)."""
        takes = step_takes([len(s.prompt_ids) - s.prefilled for s in states], chunk=self.config.prefill_chunk,
                           step_tokens=self.config.prefill_step_tokens)
        return list(zip(states, takes, strict=False))

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
        rows = self._step_rows(states)
        t0 = time.perf_counter()
        self._steps_after.add(self._rounds_queued)  # it runs between this round and the next (_time_auto_round)
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
        late: FirstTokens | None = None
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
            else:  # read at the top of the next iteration (FirstTokens); the rows decode meanwhile
                self._read_first_tokens()  # one step's tokens unread at a time (fault isolation reruns this step)
                late = FirstTokens(states=finished, tokens=chosen, copy=HostCopy(chosen), started=t0)
        elapsed = time.perf_counter() - t0
        for state, take in rows:
            state.prefilled += take
            if late is None or not holds(late.states, state):
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
        return self.runner.sample_first(last, temp, top_p, top_k, seed, greedy, any_filter(finished), min_tokens=ban)

    def _ride(self, rows: list[tuple[RequestState, int]], logits: torch.Tensor, t0: float, seq: int) -> None:
        """Account for the chunk rows a mixed round (number ``seq``) carries (queued, not read): the riders' prompts
        move on, and those whose prompt it ends get their first token sampled on the device from ``logits`` [P, V]
        (each row's last token), read once the round is (:class:`FirstTokens`); they decode from the round after,
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
        self._first = FirstTokens(states=finished, tokens=chosen, copy=HostCopy(chosen), started=t0, round_seq=seq)

    def _ride_rows(self, riders: list[RequestState]) -> list[tuple[RequestState, int]]:
        """The chunk rows of a mixed round, in the riders' order: a prefill step's rule
        (:func:`~ddtree.engine.prefill_budget.step_takes`) with ``mixed_chunk`` as the step's padded size and each
        prompt's share at most ``prefill_chunk`` (and ``mixed_chunk``), so a rider's row never passes the cache
        headroom a prefill step keeps."""
        mixed = self.config.mixed_chunk
        takes = step_takes([len(s.prompt_ids) - s.prefilled for s in riders],
                           chunk=min(self.config.prefill_chunk, mixed), step_tokens=mixed)
        return list(zip(riders, takes, strict=False))

    def _first_token(self, state: RequestState, token: int, logprobs: list[TokenLogprob] | None = None) -> None:
        """A request's first completion token, read: it decodes from now on (and may finish on it)."""
        state.phase = Phase.DECODE
        state.stats.ttft_s = time.perf_counter() - state.arrival
        with self._lock:
            if state.counted:
                self._counters.prompt_tokens_total += len(state.prompt_ids)
        self._emit(state, [token], logprobs)

    def _read_first_tokens(self, in_flight: int | None = None) -> bool:
        """Read and emit the unread first tokens (:class:`FirstTokens`), if any: a prefill step's waits only for
        that prefill (the round launched after it is still running); those a mixed round sampled are left unread
        while that round is the one in flight (``in_flight``: its ``Flight.seq``), so the host does not wait for
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
            error = describe_current_exception()
            for state in first.states:
                self._finish(state, "error", error=error)
            return True
        elapsed = time.perf_counter() - first.started
        for state, token in zip(first.states, tokens, strict=True):
            if state.phase is Phase.DECODE:
                if first.round_seq is None:  # a mixed round's riders have its stage time already (_collect)
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

    def _sampling_tensors(self, states: list[RequestState]):
        """temperature, top_p [R] float and top_k, seed [R] long on the device, in two copies."""
        floats = self._upload(torch.tensor([[float(s.sampling.temperature), float(s.sampling.top_p)] for s in states],
                                           dtype=torch.float32).T.contiguous())
        longs = self._upload(torch.tensor([[int(s.sampling.top_k), s.seed] for s in states], dtype=torch.long).T.contiguous())
        return floats[0], floats[1], longs[0], longs[1]
