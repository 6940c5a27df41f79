"""The engine facade: one loaded target and drafter serving many requests, each with its own tree settings.

Three modules make an engine, each changed for its own reasons:

- :mod:`ddtree.engine.build`: loading, fusing, fp8, KV sizing and CUDA-graph set-up (once, before serving);
- :mod:`ddtree.engine.scheduler`: the loop on the engine thread (admit, prefill, launch, collect, overlap, emit;
  its prefill steps in :mod:`ddtree.engine.prefill_steps`, its queued rounds in :mod:`ddtree.engine.follow_ups`);
- this module: the thread and the public, thread-safe API (``submit`` / ``stream`` / ``cancel`` / ``generate`` /
  ``snapshot`` / ``info``) the server and the lab speak.

Usage::

    with Engine.from_config(EngineConfig(...)) as engine:   # starts the thread and warms up; shuts down on exit
        outputs = engine.generate([GenerationRequest(prompt="def f(x):")])

``Engine(target, drafter, tokenizer, config)`` builds over models already loaded (tests, benchmarks, training).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ddtree.engine.api import (
    MAX_STOP_IDS,
    GenerationOutput,
    GenerationRequest,
    RequestStats,
    SamplingParams,
    StreamChunk,
    TreeSettings,
)
from ddtree.engine.build import build, default_tree, load_models
from ddtree.engine.config import EngineConfig
from ddtree.engine.cost_measure import CurveSource, attach_curve
from ddtree.engine.detok import IncrementalDetokenizer
from ddtree.engine.info import engine_info
from ddtree.engine.request_state import RequestState
from ddtree.engine.scheduler import Scheduler
from ddtree.engine.warmup import Warmup, free_device_bytes
from ddtree.errors import ConfigError, EngineError, InvalidRequestError, QueueFullError


@dataclass
class EngineSnapshot:
    running: int
    queued: int
    max_batch: int
    kv_tokens_used: int
    kv_tokens_capacity: int
    requests_total: dict[str, int]
    prompt_tokens_total: int
    generation_tokens_total: int
    verify_rounds_total: int
    accept_hist: list[int]
    stage_seconds_total: dict[str, float]
    mixed_rounds_total: int = 0  # decode rounds that carried prompt chunks (EngineConfig.mixed_chunk)
    mixed_prompt_tokens_total: int = 0  # prompt tokens those rounds carried
    mixed_deferred_total: int = 0  # rounds whose riders took a prefill step: mixed graph captures over their share


class Engine(Scheduler):
    """Continuous batching of AR, DFlash-chain and DDTree requests over one target and one drafter.

    Why a subclass of the scheduler rather than a holder of one: the loop's steps stay methods of the engine
    object, so a test can wrap one (``Engine._follow_up``) and see every round the engine runs."""

    def __init__(self, target, drafter, tokenizer, config: EngineConfig, *, model_name: str = "ddtree-model") -> None:
        """An engine over already-loaded models (``drafter=None``: AR only); nothing runs until :meth:`start`."""
        super().__init__(build(target, drafter, tokenizer, config, model_name=model_name))
        self._defaults = self._validate_tree(default_tree(self.parts))
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._ready = False
        self._request_seq = itertools.count()
        self.cost_curve_source = CurveSource()  # EngineConfig.cost_curve, resolved by start() (ddtree.engine.cost_curve)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Load the configured models (the demo pair by default) and build an engine over them."""
        target, drafter, tokenizer, config, name = load_models(config)
        return cls(target, drafter, tokenizer, config, model_name=name)

    @classmethod
    def from_models(cls, target, drafter, tokenizer, config: EngineConfig, *, model_name: str = "ddtree-model") -> Engine:
        """The constructor under the name older callers use."""
        return cls(target, drafter, tokenizer, config, model_name=model_name)

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ---- public API --------------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def defaults(self) -> TreeSettings:
        return self._defaults

    def set_defaults(self, tree: TreeSettings) -> TreeSettings:
        self._defaults = self._validate_tree(tree)
        return self._defaults

    @property
    def warmup(self) -> Warmup:
        return self.parts.warmup

    def start(self) -> None:
        """Capture the warm-up plan (``EngineConfig.warmup``), start the engine thread and run a warm-up request;
        returns once the engine is ready."""
        if self._thread is not None:
            return
        self.parts.warmup.run(free_bytes=free_device_bytes(self.device))
        attach_curve(self)  # EngineConfig.cost_curve, after the warm-up (on CUDA it times graphed rounds)
        self._thread = threading.Thread(target=self._loop, name="ddtree-engine", daemon=True)
        self._thread.start()
        # The warm-up request is kept out of the metrics counters (RequestState.counted).
        warm = GenerationRequest(prompt_token_ids=[self._any_token()],
                                 sampling=SamplingParams(max_tokens=2, ignore_eos=True), request_id="warmup")
        self._run_to_completion([warm], max_in_flight=None, counted=False)
        # What start-up made (weights' wrappers, captured graphs, Triton's compiled kernels) lives as long as the
        # engine: frozen, a full collection in the serving loop walks only what requests allocate (vLLM and SGLang
        # freeze after start-up too). Process-wide; shutdown() unfreezes.
        gc.collect()
        gc.freeze()
        self._ready = True

    def shutdown(self, *, drain_timeout: float = 30.0) -> None:
        """Refuse new work, let in-flight requests finish (cancel what is left after ``drain_timeout``), stop."""
        self._accepting = False
        self._ready = False
        gc.unfreeze()  # start()'s freeze: what this engine leaves behind is collectable again
        self.parts.warmup.close()
        deadline = time.monotonic() + drain_timeout
        while self._thread is not None and (self._active or self._waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
        for rid in list(self._by_id):
            self.cancel(rid)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, drain_timeout))
            self._thread = None

    def validate(self, request: GenerationRequest) -> tuple[list[int], TreeSettings]:
        """Check one request before it takes a slot; returns its prompt ids and resolved tree settings."""
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            vocab = int(self.target.config.vocab_size)
            if any(isinstance(t, bool) or not isinstance(t, int) or not (0 <= t < vocab) for t in ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        elif request.prompt is not None:
            ids = self.encode_prompt(request.prompt)
        else:
            raise InvalidRequestError("a request needs a prompt (text or token ids)", param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        sampling = request.sampling.validated()
        if len(ids) + sampling.max_tokens > self.config.max_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the context limit "
                f"of {self.config.max_len} tokens; shorten the prompt or lower max_tokens",
                param="max_tokens",
            )
        tree = self._validate_tree(request.tree if request.tree is not None else self._defaults)
        return ids, tree

    def submit(self, request: GenerationRequest, on_chunk: Callable[[StreamChunk], None]) -> str:
        """Queue a request; ``on_chunk`` is called from the engine thread. Raises on invalid input or a full queue."""
        return self._submit(request, on_chunk, counted=True)

    def _submit(self, request: GenerationRequest, on_chunk: Callable[[StreamChunk], None], *, counted: bool) -> str:
        """:meth:`submit`; ``counted=False`` keeps the request out of the metrics counters (the warm-up)."""
        if not self._accepting:
            raise QueueFullError("the engine is shutting down and accepts no new requests")
        ids, tree = self.validate(request)
        with self._lock:
            if len(self._waiting) + self._inbox.qsize() - len(self._free_slots) >= self.config.max_queue:
                raise QueueFullError(
                    f"the request queue is full ({self.config.max_queue} waiting); retry later"
                )
        rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        sampling = request.sampling
        seed = sampling.seed if sampling.seed is not None else (self.config.seed * 1_000_003 + next(self._request_seq)) % 2**62
        state = RequestState(
            request_id=rid,
            prompt_ids=ids,
            tree=tree,
            sampling=sampling,
            seed=seed,
            on_chunk=on_chunk,
            detok=IncrementalDetokenizer(self.tokenizer, stop=sampling.stop),
            eos_ids=self.eos_ids,
            max_len=self.config.max_len,
            counted=counted,
        )
        if len(state.banned_ids) > MAX_STOP_IDS:
            raise InvalidRequestError(
                f"min_tokens masks EOS and the stop token ids, at most {MAX_STOP_IDS} in all; this request has "
                f"{len(state.banned_ids)}", param="min_tokens")
        state.stats.prompt_tokens = len(ids)
        state.stats.tree = tree.to_dict()
        state.stats.submitted_at = state.arrival  # the clock ttft_s and latency_s count from
        self._enqueue(state)
        return rid

    def stream(self, request: GenerationRequest, *,
               on_finished: Callable[[], None] | None = None) -> AsyncIterator[StreamChunk]:
        """Submit now (raising on bad input) and return an async iterator of chunks on the running event loop.

        Closing the iterator early (client disconnect, ``aclose()``) cancels the request and frees its slot.
        ``on_finished`` runs on the loop when the engine's final chunk (finished, cancelled or failed) arrives, in
        the same hand-over as that chunk, so nothing on the loop runs between the two (the server's admission
        releases its slot there)."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[StreamChunk] = asyncio.Queue()

        def on_loop(chunk: StreamChunk) -> None:
            chunks.put_nowait(chunk)
            if chunk.finished and on_finished is not None:
                on_finished()

        def deliver(chunk: StreamChunk) -> None:  # engine thread: one hand-over per chunk
            loop.call_soon_threadsafe(on_loop, chunk)

        rid = self.submit(request, deliver)

        async def iterate() -> AsyncIterator[StreamChunk]:
            finished = False
            try:
                while not finished:
                    chunk = await chunks.get()
                    finished = chunk.finished
                    yield chunk
            finally:
                if not finished:
                    self.cancel(rid)

        return iterate()

    def cancel(self, request_id: str) -> None:
        self._enqueue_cancel(request_id)

    def generate(self, requests: Sequence[GenerationRequest], *,
                 max_in_flight: int | None = None) -> list[GenerationOutput]:
        """Run requests to completion (blocking). All are validated before any is submitted.

        ``max_in_flight`` keeps at most that many submitted and unfinished, submitting the next as one finishes:
        a closed loop of that many clients (what vLLM's and SGLang's benchmarks call max concurrency), instead of
        one batch that drains to its slowest request."""
        if self._thread is None:
            raise EngineError("the engine is not started; call start() first")
        if max_in_flight is not None and max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}")
        return self._run_to_completion(requests, max_in_flight=max_in_flight, counted=True)

    def _run_to_completion(self, requests: Sequence[GenerationRequest], *, max_in_flight: int | None,
                           counted: bool) -> list[GenerationOutput]:
        """:meth:`generate`'s body; ``counted`` as for :meth:`_submit`."""
        # Counted requests go through the public submit (what a caller wrapping it sees); the warm-up does not.
        submit = self.submit if counted else functools.partial(self._submit, counted=False)
        resolved = [self.validate(r) for r in requests]
        slots = threading.Semaphore(max_in_flight or max(len(requests), 1))
        done = threading.Event()
        results: dict[int, list[StreamChunk]] = {i: [] for i in range(len(requests))}
        remaining = [len(requests)]
        guard = threading.Lock()

        def collector(i: int) -> Callable[[StreamChunk], None]:
            def on_chunk(chunk: StreamChunk) -> None:
                results[i].append(chunk)
                if chunk.finished:
                    slots.release()
                    with guard:
                        remaining[0] -= 1
                        if remaining[0] == 0:
                            done.set()
            return on_chunk

        if not requests:
            return []
        for i, req in enumerate(requests):
            slots.acquire()
            while True:  # a blocking caller waits for queue room instead of failing
                try:
                    submit(req, collector(i))
                    break
                except QueueFullError:
                    if not self._accepting:
                        raise
                    time.sleep(0.005)
        done.wait()
        outputs = []
        for i, (ids, _) in enumerate(resolved):
            chunks = results[i]
            last = chunks[-1]
            outputs.append(
                GenerationOutput(
                    request_id=last.request_id,
                    prompt_token_ids=ids,
                    token_ids=[t for c in chunks for t in c.token_ids],
                    text="".join(c.text for c in chunks),
                    finish_reason=last.finish_reason or "error",
                    stats=last.stats or RequestStats(),
                    error=last.error,
                    logprobs=(None if requests[i].sampling.logprobs is None
                              else [lp for c in chunks for lp in (c.logprobs or ())]),
                    prompt_logprobs=next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None),
                )
            )
        return outputs

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def encode_chat(self, messages: list[dict], **template_kwargs: Any) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **template_kwargs
            )
        except Exception as exc:  # template errors are the caller's input problem
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            c = self._counters
            used = sum(s.num_committed for s in self._active.values())
            return EngineSnapshot(
                running=len(self._active),
                queued=len(self._waiting) + self._inbox.qsize(),
                max_batch=self.config.max_batch,
                kv_tokens_used=used,
                kv_tokens_capacity=self.config.max_batch * self.config.max_len,
                requests_total=dict(c.requests_total),
                prompt_tokens_total=c.prompt_tokens_total,
                generation_tokens_total=c.generation_tokens_total,
                verify_rounds_total=c.verify_rounds_total,
                accept_hist=list(c.accept_hist),
                stage_seconds_total=dict(c.stage_seconds_total),
                mixed_rounds_total=c.mixed_rounds_total,
                mixed_prompt_tokens_total=c.mixed_prompt_tokens_total,
                mixed_deferred_total=c.mixed_deferred_total,
            )

    def info(self) -> dict[str, Any]:
        """What ``/server_info`` reports (:func:`ddtree.engine.info.engine_info`)."""
        return engine_info(self)

    # ---- validation helpers ------------------------------------------------------------------------------------
    def _validate_tree(self, tree: TreeSettings) -> TreeSettings:
        resolved = tree.validated(
            trained_block_size=self.trained_block_size,
            max_block_size=self.max_block_size,
            max_budget=self.config.max_budget,
        )
        if resolved.method != "ar" and self.drafter is None:
            raise InvalidRequestError(
                f"method {resolved.method!r} needs a drafter, but this engine was started without one; use 'ar'",
                param="method",
            )
        return resolved

    def _any_token(self) -> int:
        tok = self.tokenizer.bos_token_id
        if tok is None:
            ids = self.encode_prompt("a")
            tok = ids[0] if ids else 0
        return int(tok)
