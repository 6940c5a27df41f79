"""The engine: one loaded target and drafter serving many requests, each with its own tree settings.

A background thread runs the loop; everything else talks to it through a thread-safe inbox::

    submit()/cancel()  ->  inbox  ->  loop: admit -> one prefill step -> read round n -> launch round n + 1
                                                -> emit round n's chunks (on_chunk callbacks) while n + 1 runs

Scheduling: requests wait in a bounded FIFO queue until a KV slot is free; a newcomer's prompt is written in
chunks of ``prefill_chunk`` tokens, one prefill step between decode rounds, so running requests keep decoding
while long prompts load. A slot is freed the moment its request finishes or is cancelled.

Fault isolation: if a round raises, the engine reruns each of its rows alone (the round only writes cache
positions past each row's committed length, so a rerun is safe); rows that fail alone are finished with
``finish_reason="error"`` and the others continue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
import warnings
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ddtree.devices import resolve_device, resolve_dtype
from ddtree.engine.api import (
    GenerationOutput,
    GenerationRequest,
    RequestStats,
    StreamChunk,
    TreeSettings,
)
from ddtree.engine.config import EngineConfig
from ddtree.engine.detok import IncrementalDetokenizer
from ddtree.engine.request_state import Phase, RequestState
from ddtree.engine.runner import (
    ROUND_LONGS,
    HostCopy,
    ModelRunner,
    PrefillInputs,
    RoundInputs,
    StageTimer,
    to_host,
)
from ddtree.errors import ConfigError, EngineError, InvalidRequestError, QueueFullError
from ddtree.models import fuse_projections

log = logging.getLogger("ddtree.engine")

_NO_WINDOW = 1 << 30
# Whole prompts up to this many tokens prefill through a CUDA graph (cuda_graphs.PrefillGraphs); longer ones eager.
PREFILL_GRAPH_MAX_WIDTH = 1024
_ROOT, _START, _STEP = (ROUND_LONGS.index(name) for name in ("root_tokens", "start", "step"))


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


@dataclass
class _Counters:
    requests_total: dict[str, int] = field(default_factory=dict)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    verify_rounds_total: int = 0
    accept_hist: list[int] = field(default_factory=list)
    stage_seconds_total: dict[str, float] = field(default_factory=dict)


@dataclass
class _Flight:
    """A round queued on the device whose result the host has not read yet."""

    states: list[RequestState]  # the rows, in order
    result: torch.Tensor  # [R, 2 + L] device: tokens committed, then the tokens (ModelRunner.round)
    copy: HostCopy  # the result's copy to the host, started when the round was queued
    longs: torch.Tensor  # [len(ROUND_LONGS), R] device inputs of the round (a follow-up round advances them)
    floats: torch.Tensor  # [len(ROUND_FLOATS), R]
    sizes: dict  # the host-known RoundInputs fields
    timer: StageTimer


class Engine:
    """Continuous batching of AR, DFlash-chain and DDTree requests over one target and one drafter."""

    def __init__(self, config: EngineConfig) -> None:
        from ddtree.models import load_drafter, load_target, load_tokenizer

        config = config.validated()
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        target_dir, draft_dir, name = _model_paths(config)
        target = load_target(target_dir, dtype=dtype, device=device)
        drafter = None
        if draft_dir is not None:
            drafter = load_drafter(draft_dir, dtype=dtype, device=device)
        tokenizer = load_tokenizer(target_dir)
        self._init(target, drafter, tokenizer, replace(config, device=str(device), dtype=str(dtype).split(".")[-1]),
                   model_name=name)

    @classmethod
    def from_models(cls, target, drafter, tokenizer, config: EngineConfig, *, model_name: str = "ddtree-model") -> Engine:
        """An engine over already-loaded models (tests, the stand-in benchmark, training evaluation)."""
        self = cls.__new__(cls)
        param = next(target.parameters())
        config = replace(config.validated(), device=str(param.device), dtype=str(param.dtype).split(".")[-1])
        self._init(target, drafter, tokenizer, config, model_name=model_name)
        return self

    # ---- construction ------------------------------------------------------------------------------------------
    def _init(self, target, drafter, tokenizer, config: EngineConfig, *, model_name: str) -> None:
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.model_name = model_name
        self.trained_block_size = int(drafter.trained_block_size) if drafter is not None else 2
        max_block = config.max_block_size or self.trained_block_size
        if drafter is not None and max_block > self.trained_block_size:
            warnings.warn(
                f"max_block_size {max_block} exceeds the drafter's trained block size {self.trained_block_size}: "
                "draft positions past the trained depth are untrained and rarely accepted",
                stacklevel=3,
            )
        self.max_block_size = max_block
        param = next(target.parameters())
        self.device = param.device
        if self.device.type == "cuda":
            # One matmul for q/k/v and one for gate/up per layer (the weights become views of a fused matrix) and,
            # with gpu_kernels, Triton kernels for the element-wise steps: the graphs captured below launch ~10
            # kernels per decoder layer instead of ~50.
            fuse_projections(target, kernels=config.gpu_kernels)
            if drafter is not None:
                fuse_projections(drafter, kernels=config.gpu_kernels)
        _check_fp8_sharing(drafter, config.draft_fp8)
        if config.draft_fp8:
            _quantize_drafter(target, drafter, tokenizer, kernels=config.gpu_kernels)
        headroom = max(config.prefill_chunk, config.max_budget + 1, max_block) + 1
        max_batch = config.max_batch
        if config.kv_memory_fraction is not None:
            max_batch = _slots_from_memory(target, drafter, config, headroom, self.device)
        self.config = replace(config, max_batch=max_batch, max_block_size=max_block)
        self.cache_len = config.max_len + headroom
        self.runner = ModelRunner(target, drafter, slots=max_batch, cache_len=self.cache_len,
                                  kernels=config.gpu_kernels)
        self._overlap = config.overlap_rounds if config.overlap_rounds is not None else self.device.type == "cuda"
        self.graphs = None
        self.prefill_graphs = None
        if config.cuda_graphs and self.device.type == "cuda":
            from ddtree.engine.cuda_graphs import PrefillGraphs, RoundGraphs

            self.graphs = RoundGraphs(self.runner, max_rows=max_batch, cache_len=self.cache_len)
            if config.prefill_graphs:
                self.prefill_graphs = PrefillGraphs(self.runner, max_rows=max_batch,
                                                    max_width=min(PREFILL_GRAPH_MAX_WIDTH, config.prefill_chunk))
        default_tree = config.default_tree if drafter is not None else TreeSettings(method="ar")
        self._defaults = self._validate_tree(default_tree)
        self.eos_ids = _eos_ids(target, tokenizer)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiting: deque[RequestState] = deque()
        self._active: dict[int, RequestState] = {}  # slot -> state
        self._by_id: dict[str, RequestState] = {}
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._counters = _Counters()
        self._lock = threading.Lock()  # guards counters and queue sizes read by snapshot()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self._ready = False
        self._request_seq = itertools.count()
        log.info(
            "engine: %s on %s/%s, %d slots x %d tokens, KV %.1f MiB", model_name, self.device,
            self.config.dtype, max_batch, self.cache_len, self.runner.kv_bytes / 2**20,
        )

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

    def start(self) -> None:
        """Start the engine thread and run a warm-up request; returns once the engine is ready."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="ddtree-engine", daemon=True)
        self._thread.start()
        warm = GenerationRequest(prompt_token_ids=[self._any_token()], sampling=_warmup_sampling(), request_id="warmup")
        self.generate([warm], _count=False)
        self._ready = True

    def shutdown(self, *, drain_timeout: float = 30.0) -> None:
        """Refuse new work, let in-flight requests finish (cancel what is left after ``drain_timeout``), stop."""
        self._accepting = False
        self._ready = False
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

    def submit(self, request: GenerationRequest, on_chunk: Callable[[StreamChunk], None], *, _count: bool = True) -> str:
        """Queue a request; ``on_chunk`` is called from the engine thread. Raises on invalid input or a full queue."""
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
            counted=_count,
        )
        state.stats.prompt_tokens = len(ids)
        state.stats.tree = tree.to_dict()
        self._inbox.put(("submit", state))
        self._wake.set()
        return rid

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Submit now (raising on bad input) and return an async iterator of chunks on the running event loop.

        Closing the iterator early (client disconnect, ``aclose()``) cancels the request and frees its slot."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[StreamChunk] = asyncio.Queue()

        def deliver(chunk: StreamChunk) -> None:
            loop.call_soon_threadsafe(chunks.put_nowait, chunk)

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
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    def generate(self, requests: Sequence[GenerationRequest], *, max_in_flight: int | None = None,
                 _count: bool = True) -> list[GenerationOutput]:
        """Run requests to completion (blocking). All are validated before any is submitted.

        ``max_in_flight`` keeps at most that many submitted and unfinished, submitting the next as one finishes:
        a closed loop of that many clients (what vLLM's and SGLang's benchmarks call max concurrency), instead of
        one batch that drains to its slowest request."""
        if self._thread is None:
            raise EngineError("the engine is not started; call start() first")
        if max_in_flight is not None and max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}")
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
                    self.submit(req, collector(i), _count=_count)
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
            )

    def info(self) -> dict[str, Any]:
        import transformers

        from ddtree import __version__

        cfg = self.config
        return {
            "model": self.model_name,
            "versions": {"ddtree": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
            "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "dtype": cfg.dtype,
            "config": {k: (v.to_dict() if isinstance(v, TreeSettings) else v) for k, v in cfg.__dict__.items()},
            "defaults": self._defaults.to_dict(),
            "limits": {
                "max_batch": cfg.max_batch,
                "max_len": cfg.max_len,
                "max_budget": cfg.max_budget,
                "max_block_size": self.max_block_size,
                "trained_block_size": self.trained_block_size if self.drafter is not None else None,
            },
            "kv_cache": {
                "slots": cfg.max_batch,
                "tokens_per_slot": self.cache_len,
                "capacity_tokens": cfg.max_batch * cfg.max_len,
                "bytes": self.runner.kv_bytes,
            },
            "drafter": self.drafter is not None,
        }

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

    # ---- the loop ----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        """One iteration: admit, one prefill step, then read the round in flight, launch the next and only then
        emit what was read, so detokenizing, stop checks and callbacks overlap the device's next round."""
        flight: _Flight | None = None
        while not self._stopping:
            self._drain_inbox()
            self._admit()
            worked = False
            prefilling = [s for s in self._active.values() if s.phase is Phase.PREFILL]
            if prefilling:
                self._guarded(self._prefill_step, prefilling)
                worked = True
            results: list[tuple[RequestState, list[int]]] = []
            follow_up: _Flight | None = None
            if flight is not None:
                if self._can_follow(flight):
                    follow_up = self._follow_up(flight)
                results = self._collect_guarded(flight)
                flight = follow_up
                worked = True
            pending = {state.request_id: tokens for state, tokens in results}
            decoding = [s for s in self._active.values()
                        if s.phase is Phase.DECODE and not s.ends_by_token(pending.get(s.request_id, ()))]
            if follow_up is None and decoding:
                try:
                    flight = self._launch(decoding, pending)
                except Exception:
                    # Emit first so every state is exact, then isolate the fault row by row, synchronously.
                    self._emit_results(results)
                    results = []
                    for state in decoding:
                        if state.phase is Phase.DECODE:
                            self._guarded(self._decode_round, [state])
                worked = True
            self._emit_results(results)
            if not worked:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
        if flight is not None:
            self._collect_guarded(flight)  # let the device finish; the requests are being cancelled
        self._drain_inbox()  # deliver the final chunks of cancellations queued by shutdown()
        # A submit that passed the accepting check just before shutdown() arrives after its cancellations: finish
        # it too, or its caller (a generate() waiting on it) would wait forever.
        for state in list(self._by_id.values()):
            self._finish(state, "cancelled")

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
                self._finish(states[0], "error", error=_describe_current_exception())
                return
            for state in states:
                if state.phase in (Phase.PREFILL, Phase.DECODE):
                    self._guarded(step, [state])

    # ---- prefill ---------------------------------------------------------------------------------------------
    def _prefill_step(self, states: list[RequestState]) -> None:
        budget = self.config.prefill_chunk
        rows: list[tuple[RequestState, int]] = []
        for state in states:
            if budget <= 0:
                break
            take = min(len(state.prompt_ids) - state.prefilled, budget)
            rows.append((state, take))
            budget -= take
        t0 = time.perf_counter()
        width = max(take for _, take in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (state, take) in enumerate(rows):
            ids[i, :take] = torch.tensor(state.prompt_ids[state.prefilled : state.prefilled + take])
        dev = self.device
        start = [s.prefilled for s, _ in rows]
        takes = [t for _, t in rows]
        logits = None
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(len(rows), width, start):
            try:
                logits = self.prefill_graphs.run(ids, [s.slot for s, _ in rows], takes)
            except Exception:  # a capture that fails (memory, an op graphs refuse) must not fail the requests
                log.exception("prefill CUDA graph failed; prefilling eagerly from now on")
                self.prefill_graphs = None
        if logits is None:
            inp = PrefillInputs(
                ids=ids.to(dev),
                slots=torch.tensor([s.slot for s, _ in rows], device=dev),
                start=torch.tensor(start, device=dev),
                valid_len=torch.tensor(takes, device=dev),
                last_index=torch.tensor([t - 1 for t in takes], device=dev),
                kv_len=max(s + width for s in start),
            )
            logits = self.runner.prefill(inp)
        done = [i for i, (s, take) in enumerate(rows) if s.prefilled + take == len(s.prompt_ids)]
        first: list[int] = []
        if done:
            sel = torch.tensor(done, device=dev)
            finished = [rows[i][0] for i in done]
            temp, top_p, top_k, seed = self._sampling_tensors(finished)
            greedy = all(s.sampling.greedy for s in finished)
            (first,) = to_host(self.runner.sample_first(logits[sel], temp, top_p, top_k, seed, greedy,
                                                        _any_filter(finished)))
        elapsed = time.perf_counter() - t0
        for state, take in rows:
            state.prefilled += take
            state.stats.stage_s["prefill"] = state.stats.stage_s.get("prefill", 0.0) + elapsed
        for i, tok in zip(done, first, strict=False):
            state = rows[i][0]
            state.phase = Phase.DECODE
            state.stats.ttft_s = time.perf_counter() - state.arrival
            with self._lock:
                if state.counted:
                    self._counters.prompt_tokens_total += len(state.prompt_ids)
            self._emit(state, [tok])

    # ---- decode ----------------------------------------------------------------------------------------------
    def _decode_round(self, states: list[RequestState]) -> None:
        """One round for ``states``, start to finish (the synchronous path: fault isolation reruns rows with it)."""
        self._emit_results(self._collect(self._launch(states, {})))

    def _launch(self, states: list[RequestState], pending: dict[str, list[int]]) -> _Flight:
        """Queue one round for ``states`` on the device and return without waiting for it.

        ``pending``: tokens read from the previous round but not yet committed to their states (the loop emits
        them while this round runs); a row's root, position and step are taken as if they were committed, which
        is exact for every row that does not finish on them (rows that do are dropped when this round is read)."""
        drafting = [s for s in states if s.tree.method != "ar"]
        block = max((int(s.tree.block_size) for s in drafting), default=1) if self.drafter is not None else 1
        max_budget = max(s.budget for s in states)
        if block == 1:
            max_budget = 0
        longs, roots = [], []
        for s in states:
            extra = pending.get(s.request_id, ())
            root = s.root_position + len(extra)
            roots.append(root)
            longs.append([s.slot, extra[-1] if extra else s.root_token, root, s.budget, s.topk, s.depth_limit,
                          s.tree.draft_window or _NO_WINDOW, int(s.sampling.top_k), s.seed,
                          len(s.output_ids) + len(extra)])  # ROUND_LONGS order
        # [F, R] host tensors: one copy each to the device instead of one per field.
        packed_longs = torch.tensor(longs, dtype=torch.long).T
        packed_floats = torch.tensor([[float(s.sampling.temperature), float(s.sampling.top_p)] for s in states],
                                     dtype=torch.float32).T  # ROUND_FLOATS order
        sizes = dict(
            max_budget=max_budget,
            block_size=block,
            kv_len=max(roots) + max_budget + 1,
            draft_kv_len=max(1, max(roots)),
            greedy=all(s.sampling.greedy for s in states),
            filtered=_any_filter(states),
            contiguous=all(s.tree.method != "ddtree" for s in states),
        )
        return self._queue(states, packed_longs, packed_floats, sizes)

    def _queue(self, states: list[RequestState], longs: torch.Tensor, floats: torch.Tensor, sizes: dict) -> _Flight:
        """Queue a round from packed inputs (host tensors, or device tensors for a follow-up round)."""
        timer = StageTimer(self.device)
        if self.graphs is not None and self.graphs.can_run(len(states)):
            result, longs, floats = self.graphs.run(longs, floats, sizes, timer)
        else:
            dev = self.device
            longs = longs.contiguous().to(dev, non_blocking=True)
            floats = floats.contiguous().to(dev, non_blocking=True)
            result = self.runner.round(RoundInputs.from_packed(longs, floats, **sizes), timer)
        return _Flight(states=states, result=result, copy=HostCopy(result), longs=longs, floats=floats, sizes=sizes,
                       timer=timer)

    def _can_follow(self, flight: _Flight) -> bool:
        """Whether the next round can be queued before ``flight`` is read: the same rows will run it (every one still
        decoding, nobody else decoding, prefilling or able to take a free slot) and its writes stay inside the cache
        whatever ``flight`` accepts. Rows that finish on ``flight``'s tokens only waste their place in it."""
        if not self._overlap or self._waiting and self._free_slots:
            return False
        if any(s.phase is not Phase.DECODE for s in flight.states):
            return False
        decoding = sum(1 for s in self._active.values() if s.phase is not Phase.DONE)
        if decoding != len(flight.states):
            return False
        # The next round's roots lie at most a block past the states' positions; from there it writes its tree
        # (nodes) into the target cache and its block into the drafter's.
        block, nodes = flight.sizes["block_size"], flight.sizes["max_budget"] + 1
        return max(s.root_position for s in flight.states) + block + max(nodes, block) + 1 <= self.cache_len

    def _follow_up(self, flight: _Flight) -> _Flight | None:
        """Queue the round after ``flight`` with inputs advanced on the device from its result: each row's root is
        the last token it commits, its position and step counter move by the tokens it commits. The states hold
        every round before ``flight``, so their positions plus one block bound this round's cache reads."""
        try:
            result = flight.result
            n = result[:, 0]
            longs = flight.longs.clone()
            longs[_ROOT] = torch.gather(result, 1, n[:, None])[:, 0]  # result[:, 1 + n - 1]
            longs[_START] += n
            longs[_STEP] += n
            reach = max(s.root_position for s in flight.states) + flight.sizes["block_size"]
            sizes = {**flight.sizes, "kv_len": reach + flight.sizes["max_budget"] + 1, "draft_kv_len": max(1, reach)}
            return self._queue(flight.states, longs, flight.floats, sizes)
        except Exception:  # the host path below will launch it (and isolate a faulty row if it fails again)
            log.warning("queuing a follow-up round failed; launching from the host instead", exc_info=True)
            return None

    def _collect(self, flight: _Flight) -> list[tuple[RequestState, list[int]]]:
        """Wait for a launched round and account for it; returns each still-decoding row's committed tokens
        (rows finished or cancelled while the round ran are dropped)."""
        rows = flight.copy.get()
        stages = flight.timer.collect()
        with self._lock:
            for name, secs in stages.items():
                self._counters.stage_seconds_total[name] = self._counters.stage_seconds_total.get(name, 0.0) + secs
        out = []
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
            with self._lock:
                c = self._counters
                if state.counted:
                    c.verify_rounds_total += 1
                    while len(c.accept_hist) <= n:
                        c.accept_hist.append(0)
                    c.accept_hist[n] += 1
            out.append((state, row[1 : 1 + n]))
        return out

    def _collect_guarded(self, flight: _Flight) -> list[tuple[RequestState, list[int]]]:
        """:meth:`_collect`; if reading the round fails (a device fault surfaces at the sync), its rows fail."""
        try:
            return self._collect(flight)
        except Exception:
            log.exception("a decode round failed on the device")
            error = _describe_current_exception()
            for state in flight.states:
                self._finish(state, "error", error=error)
            return []

    def _emit_results(self, results: list[tuple[RequestState, list[int]]]) -> None:
        for state, tokens in results:
            if state.phase is Phase.DECODE:
                self._emit(state, tokens)

    def _sampling_tensors(self, states: list[RequestState]):
        """temperature, top_p [R] float and top_k, seed [R] long on the device, in two copies."""
        dev = self.device
        floats = torch.tensor([[float(s.sampling.temperature), float(s.sampling.top_p)] for s in states],
                              dtype=torch.float32).T.contiguous().to(dev, non_blocking=True)
        longs = torch.tensor([[int(s.sampling.top_k), s.seed] for s in states],
                             dtype=torch.long).T.contiguous().to(dev, non_blocking=True)
        return floats[0], floats[1], longs[0], longs[1]

    # ---- emitting and finishing --------------------------------------------------------------------------------
    def _emit(self, state: RequestState, tokens: list[int]) -> None:
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
        if reason is not None:
            self._finish(state, reason, last_ids=kept, last_text=text)
            return
        self._deliver(state, StreamChunk(request_id=state.request_id, token_ids=kept, text=text))

    def _finish(self, state: RequestState, reason: str, *, last_ids: list[int] | None = None,
                last_text: str = "", error: str | None = None) -> None:
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
        )
        self._deliver(state, chunk, final=True)

    def _deliver(self, state: RequestState, chunk: StreamChunk, *, final: bool = False) -> None:
        try:
            state.on_chunk(chunk)
        except Exception:
            log.warning("request %s: the consumer raised; cancelling it", state.request_id, exc_info=True)
            if not final:
                self._finish(state, "cancelled")


def _any_filter(states: list[RequestState]) -> bool:
    return any(s.sampling.top_p < 1.0 or s.sampling.top_k > 0 for s in states if not s.sampling.greedy)


def _describe_current_exception() -> str:
    import sys

    exc = sys.exc_info()[1]
    return f"{type(exc).__name__}: {exc}"


def _warmup_sampling():
    from ddtree.engine.api import SamplingParams

    return SamplingParams(max_tokens=2, ignore_eos=True)


def _eos_ids(target, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(target.config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _model_paths(config: EngineConfig) -> tuple[str, str | None, str]:
    """Target dir, drafter dir (None = no drafter) and the served model name; demo pair by default."""
    if config.target is None:
        from ddtree.assets import demo_drafter_path, demo_target_path

        target, name = str(demo_target_path()), "ddtree-demo"
        draft = str(demo_drafter_path()) if config.draft is None else config.draft
    else:
        target, name = config.target, str(config.target).rstrip("/").split("/")[-1]
        draft = config.draft
        if draft is None:
            raise ConfigError("--target was given without --draft; pass --draft DIR, or --draft none for AR only")
    if draft is not None and draft.lower() == "none":
        draft = None
    return target, draft, name


def _slots_from_memory(target, drafter, config: EngineConfig, headroom: int, device: torch.device) -> int:
    """KV slots that fit in ``kv_memory_fraction`` of the device's free memory (at least 1)."""
    per_token = _kv_bytes_per_token(target) + (_kv_bytes_per_token(drafter) if drafter is not None else 0)
    per_slot = per_token * (config.max_len + headroom)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = _host_available_bytes()
    slots = int(free * float(config.kv_memory_fraction) // per_slot)
    if slots < 1:
        raise ConfigError(
            f"kv_memory_fraction {config.kv_memory_fraction} of {free / 2**30:.1f} GiB free holds no KV slot of "
            f"{per_slot / 2**20:.1f} MiB; raise the fraction or lower max_len"
        )
    return slots


def _kv_bytes_per_token(model) -> int:
    cfg = model.config
    elem = next(model.parameters()).element_size()
    return 2 * int(cfg.num_layers) * int(cfg.num_kv_heads) * int(cfg.head_dim) * elem


def _host_available_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 * 2**30


# Drafters an engine without draft_fp8 serves: their layers must not get fp8 copies (weakly held, so a drafter that
# outlives its engines can be freed; a deep copy is a new drafter).
_DRAFTERS_WITHOUT_FP8: weakref.WeakSet = weakref.WeakSet()


def _check_fp8_sharing(drafter, draft_fp8: bool) -> None:
    """fp8 copies live on the drafter's modules, so two engines over one drafter object must agree on
    ``draft_fp8``: otherwise one engine's eager calls would silently take (or lose) the other's fp8 path."""
    if drafter is None:
        return
    from ddtree.models import fp8

    if draft_fp8 and drafter in _DRAFTERS_WITHOUT_FP8:
        raise ConfigError("draft_fp8=True on a drafter that also serves an engine with draft_fp8=False (fp8 copies "
                          "attach to the drafter's modules); give this engine its own copy.deepcopy(drafter)")
    if not draft_fp8:
        if any(fp8.projections(drafter)):
            raise ConfigError("this drafter carries fp8 copies from an engine with draft_fp8=True; pass "
                              "draft_fp8=True too, or a copy.deepcopy(drafter) made before that engine was built")
        _DRAFTERS_WITHOUT_FP8.add(drafter)


def _quantize_drafter(target, drafter, tokenizer, *, kernels: bool) -> None:
    """``EngineConfig.draft_fp8``: fp8 copies of the drafter's layer projections, their input scales calibrated on
    :data:`ddtree.models.fp8.CALIBRATION_TEXT` (see :mod:`ddtree.models.fp8`). Runs before any graph is captured."""
    from ddtree.models import fp8

    if drafter is None:
        raise ConfigError("draft_fp8 needs a drafter; this engine has none (draft='none')")
    device = next(drafter.parameters()).device
    if not fp8.fp8_supported(device):
        found = (f"compute capability {torch.cuda.get_device_capability(device)}" if device.type == "cuda"
                 else "no CUDA")
        raise ConfigError(f"draft_fp8 needs fp8 matmuls (a CUDA device of compute capability 8.9 or newer, or the "
                          f"CPU); {device} has {found}")
    fuse_projections(drafter, kernels=kernels)  # idempotent; on the CPU the layers are fused only for fp8
    fp8.quantize_drafter(drafter, kernels=kernels)
    if not all(p.calibrated for p in fp8.projections(drafter)):
        ids = tokenizer.encode(fp8.CALIBRATION_TEXT, add_special_tokens=False)[:512]
        fp8.calibrate(drafter, target, torch.tensor([ids], device=device))
