"""Start-up warm-up: which CUDA graphs (and so which Triton kernel variants) an engine captures before it is ready.

Why: graphs are captured on first use of a shape bucket and a capture may compile Triton variants (0.4-1.2 s each
on a fresh machine), so without this the first users of a fresh server wait seconds per new shape while ``/health``
already says ready (issue 22). vLLM and SGLang capture a declared set of batch sizes at start-up; here the set is
the :class:`WarmupPlan`, a pure function of the engine's configuration (:func:`plan_warmup`), and
:class:`Warmup` executes it at :meth:`ddtree.engine.engine.Engine.start`, before the engine reports ready.

Terms:

- *round key*: a round's :class:`~ddtree.engine.round.RoundShape` bucketed by
  :func:`~ddtree.engine.cuda_graphs.graph_key`: rows bucket x tree shape (block size, node bucket, contiguous) x
  the cache-length bucket x the sampling flags (greedy, filtered; log-prob and min_tokens rounds are never planned).
- *tree shape*: ``(block_size, node bucket, contiguous)``. AR is ``(1, 0, True)``, the DFlash chain at block B is
  ``(B, bucket_nodes(B - 1), True)``, DDTree at budget b is ``(B, bucket_nodes(b), False)``.
- *prefill key*: ``(rows bucket, width bucket)`` of a graphed first prefill chunk (:class:`PrefillKey`).
- *eager chunk*: ``(rows, width, kv_len)`` of a prefill chunk that runs without a graph (a long prompt's later
  chunks, chunks too wide to graph): the scheduler pads its width to a multiple of 16 and buckets its key length
  (:func:`~ddtree.engine.cuda_graphs.eager_chunk_dims`), so its kernels' variants lie in a finite set.
- *shared key*: with the tree-attention kernel, length buckets that launch a round's attentions alike (same tiles
  and splits) capture identical graphs; the plan keeps one key per such group
  (:func:`~ddtree.engine.cuda_graphs.shared_key`), and the round graphs replay it for all of them.

Levels (``EngineConfig.warmup``; docs/architecture.md "Start-up warm-up" counts them for the stand-in):

- ``none``: nothing planned; every shape captures lazily (the behaviour before the plan).
- ``fast`` (the default): AR and the default tree, greedy, at every rows bucket and every length bucket; every
  prefill key; one eager chunk per tree-attention variant an eager prefill chunk can launch (:func:`eager_chunks`).
- ``full``: ``fast`` plus the DFlash chain and DDTree at every node bucket up to ``max_budget`` (default block
  size), and every one of these tree shapes (AR included) greedy, sampled and sampled with a top-p / top-k filter.
- ``"4,15,31"`` (a comma-separated list of DDTree budgets): ``fast`` plus DDTree at those budgets' buckets, greedy.

Worked example: ``max_batch=4, max_len=100, max_budget=8, prefill_chunk=16, prefill_step_tokens=64``, drafter of
block 16, default tree DDTree b8. cache_len = 100 + 17 = 117: rows buckets {1, 2, 4}; length buckets of AR (nodes
0): {64, 117}; of b8 (nodes 8): {64, 117} (9 + 0 .. 117 -> 64 or the cap). ``fast`` = 3 rows x (2 + 2) = 12 round
keys; prefill keys (1, 16), (2, 16), (4, 16): up to four rows of 16 fit a step of 64.

Shapes outside the plan still capture lazily; :class:`Warmup` counts them (and any Triton compilation after the
warm-up) as misses, reported by :meth:`Warmup.info` (``Engine.info()["warmup"]``, ``/server_info``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ddtree.engine import auto_budget
from ddtree.engine.api import TreeSettings
from ddtree.engine.config import EngineConfig, parse_warmup
from ddtree.engine.cuda_graphs import (
    AttentionDims,
    PrefillKey,
    bucket_length,
    bucket_nodes,
    bucket_rows,
    length_buckets_of,
    prefill_key,
    shared_key,
    stage_key,
)
from ddtree.engine.prefill_budget import eager_steps, resolve_step_tokens, step_shapes
from ddtree.engine.round import RoundShape

log = logging.getLogger("ddtree.engine")

PREFILL_MAX_TOKENS = 8192  # cuda_graphs.PrefillGraphs' default max_tokens: rows x width of a graphed chunk

TreeShape = tuple[int, int, bool]  # (block_size, node bucket, contiguous)
SAMPLING_GREEDY: tuple[tuple[bool, bool], ...] = ((True, False),)  # (greedy, filtered)
SAMPLING_ALL: tuple[tuple[bool, bool], ...] = ((True, False), (False, False), (False, True))


@dataclass(frozen=True)
class EagerChunk:
    """An eager prefill chunk as the scheduler launches it: rows, padded width, key-length bucket."""

    rows: int
    width: int
    kv_len: int


@dataclass(frozen=True)
class WarmupPlan:
    """What a warm-up captures: round keys (shared ones), prefill keys, and the eager chunks to run once (each
    compiles the tree-attention variants no earlier chunk did; ``eager_variants`` is every variant an eager chunk
    within the limits can launch, all of them compiled by these)."""

    level: str
    rounds: tuple[RoundShape, ...] = ()
    prefills: tuple[PrefillKey, ...] = ()
    eager_chunks: tuple[EagerChunk, ...] = ()
    eager_variants: frozenset = frozenset()

    @property
    def graphs(self) -> int:
        """Graph sets the plan captures (a round key is up to four stage graphs; a prefill key one)."""
        return len(self.rounds) + len(self.prefills)


def row_buckets(max_batch: int) -> list[int]:
    """Every rows bucket a round of 1 .. max_batch requests falls in."""
    return sorted({bucket_rows(n, max_batch) for n in range(1, max_batch + 1)})


def length_buckets(nodes: int, cache_len: int) -> list[int]:
    """Every cache-length bucket of a round with ``nodes`` tree nodes past the root: the verify reads
    ``reach + nodes + 1`` positions for a furthest root at ``reach`` in 0 .. cache_len (graph_key caps at the cache)."""
    return sorted({bucket_length(reach + nodes + 1, cache_len) for reach in range(cache_len + 1)})


def tree_shapes(level: str, budgets: tuple[int, ...], *, drafts: bool, block_size: int, default: TreeSettings,
                max_budget: int) -> list[TreeShape]:
    """The (block size, node bucket, contiguous) triples a level covers; AR always, nothing else without a drafter.

    ``block_size`` is the default tree's resolved block size: every drafting shape is planned at it only (requests
    that ask for another block size capture lazily)."""
    shapes: set[TreeShape] = {(1, 0, True)}
    if not drafts or level == "none":
        return sorted(shapes) if level != "none" else []
    chain: TreeShape = (block_size, bucket_nodes(block_size - 1), True)
    if default.method == "dflash":
        shapes.add(chain)
    elif default.auto:  # budget "auto" chooses among declared candidates: plan every one's bucket
        shapes.update((block_size, bucket_nodes(b), False) for b in auto_budget.candidates(max_budget))
        if auto_budget.ZERO:  # and no tree: the roots alone, the drafter's block kept for its context
            shapes.add((block_size, 0, False))
    elif default.method == "ddtree":
        shapes.add((block_size, bucket_nodes(default.budget), False))
    if level == "full":
        shapes.add(chain)
        shapes.update((block_size, bucket_nodes(b), False) for b in range(1, max_budget + 1))
    shapes.update((block_size, bucket_nodes(b), False) for b in budgets)
    return sorted(shapes)


def prefill_keys(*, max_batch: int, prefill_chunk: int, step_tokens: int, max_width: int, max_len: int,
                 max_tokens: int = PREFILL_MAX_TOKENS) -> list[PrefillKey]:
    """Every key of a first prefill chunk the scheduler can graph: r rows (1 .. max_batch), the widest taking w
    tokens, for every step the scheduler makes (:func:`ddtree.engine.prefill_budget.step_shapes`), a prompt
    shorter than max_len, and the key within ``max_width`` and ``max_tokens``
    (:meth:`~ddtree.engine.cuda_graphs.PrefillGraphs.fits`)."""
    keys: set[PrefillKey] = set()
    for r, widest in step_shapes(max_batch=max_batch, chunk=prefill_chunk, step_tokens=step_tokens):
        for w in range(1, min(widest, max_len - 1) + 1):
            key = prefill_key(r, w, max_batch)
            if key.width <= max_width and key.rows * key.width <= max_tokens:
                keys.add(key)
    return sorted(keys, key=lambda k: (k.rows, k.width))


def eager_chunk_variants(chunk: EagerChunk, attention: AttentionDims) -> tuple[tuple, ...]:
    """The tree-attention variants an eager chunk launches (the target's prefill attention; no draft window)."""
    from ddtree.models.tree_attention import plan_launch, variants

    heads, kv, d = attention.target
    launch = plan_launch(chunk.rows, heads, kv, chunk.width, d, chunk.kv_len, attention.elem, attention.sms)
    return variants(launch, chunk.width, d, has_first=False)


def eager_chunks(*, max_batch: int, prefill_chunk: int, step_tokens: int, max_len: int, cache_len: int,
                 attention: AttentionDims | None) -> tuple[tuple[EagerChunk, ...], frozenset]:
    """The eager chunks to run at start-up and every variant they cover: for every chunk the scheduler can
    launch eagerly (r rows, the widest taking as many tokens as a step allows, per
    :func:`ddtree.engine.prefill_budget.step_shapes`, padded to w, a multiple of 16, over a length bucket in
    [w, bucket(max_len + w)]), its tree-attention variants; then the cheapest chunk (rows x width, then length) of
    each variant. Without the kernel (``attention`` None) one chunk: the padding
    already gives every other kernel the width class (a multiple of 16) the graphed prefill chunks compile."""
    top = -(-prefill_chunk // 16) * 16
    if attention is None:
        return (EagerChunk(1, top, bucket_length(top, cache_len)),), frozenset()
    lengths = length_buckets_of(cache_len)
    cheapest: dict[tuple, EagerChunk] = {}
    for rows, width in eager_steps(max_batch=max_batch, chunk=prefill_chunk, step_tokens=step_tokens):
        most = bucket_length(max_len + width, cache_len)
        for length in lengths:
            if width <= length <= most:
                chunk = EagerChunk(rows, width, length)
                for variant in eager_chunk_variants(chunk, attention):
                    have = cheapest.get(variant)
                    if have is None or (rows * width, length) < (have.rows * have.width, have.kv_len):
                        cheapest[variant] = chunk
    chunks = sorted(set(cheapest.values()), key=lambda c: (c.rows * c.width, c.kv_len, c.rows))
    return tuple(chunks), frozenset(cheapest)


def plan_warmup(config: EngineConfig, *, cache_len: int, drafts: bool, block_size: int,
                prefill_max_width: int | None, attention: AttentionDims | None = None) -> WarmupPlan:
    """The warm-up plan of a built engine's ``config`` (``max_batch`` resolved). Pure: no device, no models.

    cache_len: KV positions per slot (build: max_len + headroom). drafts: the engine has a drafter. block_size: the
    default tree's resolved block size. prefill_max_width: widest graphed prefill chunk (None: prefill graphs off).
    attention: the tree-attention launches' dimensions (:meth:`AttentionDims.of`; None without the kernel): with
    them round keys that launch alike collapse to their shared key and eager chunks are planned per variant."""
    level, budgets = parse_warmup(config.warmup)
    if level == "none":
        return WarmupPlan(level=config.warmup)
    step_tokens = resolve_step_tokens(config.prefill_step_tokens, config.prefill_chunk, config.device.split(":")[0])
    sampling = SAMPLING_ALL if level == "full" else SAMPLING_GREEDY

    def auto_width(nodes: int, contiguous: bool) -> int:  # a default tree of budget "auto": its trees are auto rounds
        if not config.default_tree.auto or contiguous or not drafts:
            return 0
        return auto_budget.curve_width(nodes, auto_budget.candidates(config.max_budget))

    rounds: list[RoundShape] = []
    for block, nodes, contiguous in tree_shapes(level, budgets, drafts=drafts, block_size=block_size,
                                                default=config.default_tree, max_budget=config.max_budget):
        for rows in row_buckets(config.max_batch):
            for length in length_buckets(nodes, cache_len):
                for greedy, filtered in sampling:
                    rounds.append(shared_key(RoundShape(rows=rows, max_budget=nodes, block_size=block, kv_len=length,
                                             draft_kv_len=length, greedy=greedy, filtered=filtered,
                                             contiguous=contiguous, auto_width=auto_width(nodes, contiguous)), attention, cache_len))
    prefills = [] if prefill_max_width is None else prefill_keys(
        max_batch=config.max_batch, prefill_chunk=config.prefill_chunk, step_tokens=step_tokens,
        max_width=prefill_max_width, max_len=config.max_len)
    chunks, variants = eager_chunks(max_batch=config.max_batch, prefill_chunk=config.prefill_chunk,
                                    step_tokens=step_tokens, max_len=config.max_len, cache_len=cache_len,
                                    attention=attention)
    return WarmupPlan(level=config.warmup, rounds=tuple(dict.fromkeys(rounds)), prefills=tuple(prefills),
                      eager_chunks=chunks, eager_variants=variants)


# ---- memory ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GraphDims:
    """The sizes a graph's memory follows: vocabulary, target hidden / MLP width, the drafter's feature width."""

    vocab: int
    hidden: int
    intermediate: int
    features: int  # target features the drafter reads per node (0 without a drafter)
    elem: int  # bytes per element of the model dtype

    @classmethod
    def of(cls, target, drafter) -> GraphDims:
        c = target.config
        elem = next(target.parameters()).element_size()
        features = int(drafter.config.feature_size) if drafter is not None else 0
        return cls(vocab=int(c.vocab_size), hidden=int(c.hidden_size), intermediate=int(c.intermediate_size),
                   features=features, elem=elem)


def round_bytes(key: RoundShape, dims: GraphDims) -> tuple[int, int]:
    """Estimated (persistent, transient) bytes of one captured round key, the drafter's states left out (keys of
    one draft key share them: :func:`draft_bytes`).

    Persistent: the stage outputs a key keeps between replays (target features ``[R, N, F]`` and the normed
    states ``[R, N, H]``, trees and visibility ``[R, N, N / 8]``; counted per key although keys of one tree key
    share them: an upper bound). Transient: the verify's peak (fp32 logits ``[R, N, V]`` and the MLP's
    ``[R, N, 2I]``), or the tree stage's (the drafter's logits ``[R, D, V]``, their fp32 copy and the
    log-sum-exp's temporary on the torch path: an upper bound for the Triton top-k's), freed into the pool every
    key shares, so only the largest counts."""
    r, n, depths = key.rows, key.max_budget + 1, key.draft_depths
    persistent = r * n * ((dims.features + dims.hidden) * dims.elem + n // 8 + 64) + (1 << 16)
    transient = r * n * (4 * dims.vocab + dims.elem * (3 * dims.intermediate + 6 * dims.hidden))
    if depths > 0:
        transient = max(transient, r * depths * (8 + dims.elem) * dims.vocab)
    return persistent, transient


def draft_bytes(key: RoundShape, dims: GraphDims) -> int:
    """The drafter's states a draft key keeps (``cuda_graphs.RoundGraphs`` shares them among its keys): the
    ``[R, L, H]`` the tree stage reads, a view of the block's ``[R, L + 1, H]``; the head's logits are the tree
    stage's."""
    return key.rows * key.block_size * dims.hidden * dims.elem


def prefill_bytes(key: PrefillKey, dims: GraphDims) -> tuple[int, int]:
    """Estimated (persistent, transient) bytes of one prefill key: its ``[rows, V]`` logits; a chunk's activations."""
    tokens = key.rows * key.width
    return key.rows * dims.vocab * 4, tokens * dims.elem * (3 * dims.intermediate + 6 * dims.hidden + dims.features)


def plan_bytes(plan: WarmupPlan, dims: GraphDims) -> int:
    """Estimated graph memory of a whole plan: every key's persistent outputs, each draft key's states once, plus
    the largest transient per pool."""
    total = sum(draft_bytes(k, dims) for k in {stage_key(k, "draft"): k for k in plan.rounds}.values())
    for sizes in ([round_bytes(k, dims) for k in plan.rounds], [prefill_bytes(k, dims) for k in plan.prefills]):
        if sizes:
            total += sum(p for p, _ in sizes) + max(t for _, t in sizes)
    return total


def fit_plan(plan: WarmupPlan, dims: GraphDims, available: int) -> tuple[WarmupPlan, int]:
    """``plan`` without its largest round keys until its estimate fits ``available`` bytes -> (plan, keys dropped).

    Why the largest: they hold the most memory per key and are met least (full batches at long contexts)."""
    if plan_bytes(plan, dims) <= available:
        return plan, 0
    rounds = sorted(plan.rounds, key=lambda k: sum(round_bytes(k, dims)))
    prefills = sorted(plan.prefills, key=lambda k: sum(prefill_bytes(k, dims)))
    dropped = 0
    while rounds or prefills:
        fitted = replace(plan, rounds=tuple(rounds), prefills=tuple(prefills))
        if plan_bytes(fitted, dims) <= available:
            return fitted, dropped
        last_round = sum(round_bytes(rounds[-1], dims)) if rounds else -1
        last_prefill = sum(prefill_bytes(prefills[-1], dims)) if prefills else -1
        (rounds if last_round >= last_prefill else prefills).pop()
        dropped += 1
    return replace(plan, rounds=(), prefills=()), dropped


# ---- Triton compilations -----------------------------------------------------------------------------------------
class CompileCounter:
    """Counts Triton compilations through ``triton.knobs.compilation.listener`` (as ``benchmarks/gpu.py``'s
    ``CompileLog`` does), forwarding each event to the listener installed before it, so both keep working.

    The hook is process-wide: with two engines in one process each counts every compilation."""

    def __init__(self) -> None:
        self.compiled = 0  # compilations the disk cache did not serve
        self.disk_hits = 0
        self.seconds = 0.0
        self._previous: Callable[..., Any] | None = None
        self._installed = False

    def install(self) -> bool:
        """Listen from now on; False where Triton (3.4+, with ``knobs``) is missing: then nothing is counted."""
        try:
            from triton import knobs
        except ImportError:
            return False
        if not self._installed:
            self._previous = knobs.compilation.listener
            knobs.compilation.listener = self
            self._installed = True
        return True

    def uninstall(self) -> None:
        """Give the hook back to the previous listener (only if nobody replaced this one meanwhile)."""
        if not self._installed:
            return
        from triton import knobs

        if knobs.compilation.listener is self:
            knobs.compilation.listener = self._previous
        self._installed = False

    @property
    def total(self) -> int:
        return self.compiled + self.disk_hits

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if cache_hit:
            self.disk_hits += 1
        else:
            self.compiled += 1
        self.seconds += (times.ir_initialization + sum(d for _, d in times.lowering_stages) + times.store_results) / 1e6
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)


# ---- execution ---------------------------------------------------------------------------------------------------
@dataclass
class WarmupStep:
    """One unit of warm-up work: a graph capture (``graph=True``, counted in the progress) or an eager run."""

    label: str
    run: Callable[[], None]
    graph: bool = True
    bytes: int = 0  # estimated graph memory it adds


@dataclass
class Warmup:
    """Runs a plan once and reports it. States: ``pending`` -> ``running`` -> ``done`` (also on a CPU, where the
    plan is empty). A step that fails (out of memory, a capture refused) is dropped with a warning, never fatal:
    the shape then captures lazily, as without a plan."""

    plan: WarmupPlan
    steps: list[WarmupStep] = field(default_factory=list)
    graphs: Any = None  # cuda_graphs.RoundGraphs
    prefill_graphs: Any = None  # cuda_graphs.PrefillGraphs
    dims: GraphDims | None = None
    device: Any = None  # torch.device
    state: str = "pending"
    done: int = 0
    dropped: int = 0  # keys left out for memory (before the run) or whose capture failed
    seconds: float = 0.0
    estimated_bytes: int = 0
    graph_bytes: int | None = None  # measured: device memory the run took from the driver (CUDA only)
    # measured: torch's allocated and reserved bytes the run added (CUDA only). Why both and the driver's figure:
    # on the H200 run of 2026-12-01 the driver's free memory did not move (graph_bytes 0) although peak memory
    # left ~4 GB beyond weights and KV; torch's own counters say where the pools' blocks came from.
    torch_deltas: tuple[int, int] | None = None
    compiles: CompileCounter = field(default_factory=CompileCounter)
    compiles_during: tuple[int, int] = (0, 0)  # (compiled, disk hits) during the run
    listening: bool = False
    # compiles the plan's tree-attention variants in worker processes first (ddtree.engine.precompile)
    precompile: Callable[[], Any] | None = None
    precompiled: Any = None  # its precompile.Precompiled
    _captures_after: tuple[int, int] = (0, 0)  # graph captures when the run ended (later ones are misses)
    _compiles_after: int = 0  # compilations counted when the run ended
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def total(self) -> int:
        return sum(1 for s in self.steps if s.graph)

    def message(self) -> str:
        """What ``/health`` says while the engine is not ready."""
        if self.state == "done":
            return f"warm-up done ({self.done - self.dropped} graphs); running a first request"
        if self.state == "pending":
            return f"loading; warm-up of {self.total} graphs next"
        return f"warming up: {self.done}/{self.total} graphs"

    def run(self, *, free_bytes: Callable[[], int] | None = None, reserve_bytes: int = 1 << 30) -> None:
        """Execute every step in order (smallest graphs first), with progress; idempotent.

        free_bytes: the device's free memory now (CUDA); with it the plan is cut to what fits first (largest
        keys dropped, with a warning) and the memory the run took is measured."""
        if self.state != "pending":
            return
        self.state = "running"
        self.listening = self.compiles.install()
        before = (self.compiles.compiled, self.compiles.disk_hits)
        if free_bytes is not None:
            # Each capture empties torch's cache (torch.cuda.graph does), so blocks cached before the run would
            # leave it and make the reserved delta negative (-4.1 GiB on the H200 run of 2026-12-01b): start empty.
            import torch

            torch.cuda.empty_cache()
        free0 = free_bytes() if free_bytes is not None else None
        torch0 = _torch_memory(self.device) if free0 is not None else None
        if free0 is not None and self.dims is not None:
            plan, dropped = fit_plan(self.plan, self.dims, max(0, free0 - reserve_bytes))
            if dropped:
                log.warning("warm-up: %d of %d planned graphs do not fit in the %.1f GiB free (estimate); the "
                            "largest are left to capture lazily", dropped, self.plan.graphs, free0 / 2**30)
                keep = set(plan.rounds) | set(plan.prefills)
                self.steps = [s for s in self.steps if not isinstance(s, KeyStep) or s.key in keep]
                self.dropped += dropped
        t0 = time.perf_counter()
        if self.precompile is not None:
            self.precompiled = self.precompile()
        with _progress(self.total) as advance:
            for step in self.steps:
                try:
                    step.run()
                except Exception as exc:  # one shape failing must not take the server down
                    log.warning("warm-up step %s failed (%s: %s); it will capture lazily", step.label,
                                type(exc).__name__, exc)
                    self.dropped += step.graph
                if step.graph:
                    with self._lock:
                        self.done += 1
                    advance(step.label)
        self.seconds = time.perf_counter() - t0
        if free0 is not None and free_bytes is not None:
            self.graph_bytes = max(0, free0 - free_bytes())
            torch1 = _torch_memory(self.device)
            self.torch_deltas = (torch1[0] - torch0[0], torch1[1] - torch0[1])
        self.compiles_during = (self.compiles.compiled - before[0], self.compiles.disk_hits - before[1])
        self._captures_after = self._captures()
        self._compiles_after = self.compiles.total
        self.state = "done"
        log.info("warm-up (%s): %d graphs in %.1f s, %d Triton compilations (%d from the disk cache), %d dropped",
                 self.plan.level, self.done - self.dropped, self.seconds, sum(self.compiles_during),
                 self.compiles_during[1], self.dropped)

    def _captures(self) -> tuple[int, int]:
        return (self.graphs.captures if self.graphs is not None else 0,
                self.prefill_graphs.captures if self.prefill_graphs is not None else 0)

    def info(self) -> dict[str, Any]:
        """``Engine.info()["warmup"]``: the plan, the run, and the misses since (lazy captures, compilations)."""
        out: dict[str, Any] = {
            "level": self.plan.level, "state": self.state, "graphs_planned": self.total, "graphs_done": self.done,
            "round_keys": len(self.plan.rounds), "prefill_keys": len(self.plan.prefills),
            "eager_prefill_chunks": len(self.plan.eager_chunks), "dropped": self.dropped,
            "seconds": round(self.seconds, 3), "estimated_graph_bytes": self.estimated_bytes,
            "graph_bytes": self.graph_bytes,
            "allocated_delta_bytes": None if self.torch_deltas is None else self.torch_deltas[0],
            "reserved_delta_bytes": None if self.torch_deltas is None else self.torch_deltas[1],
            "compile_listener": self.listening,
            "triton_compiled": self.compiles_during[0], "triton_disk_hits": self.compiles_during[1],
            "triton_cache_dir": _triton_cache_dir(),
            "precompiled": None if self.precompiled is None else self.precompiled.info(),
            # where the capture time went (eager passes, recording per stage) and the stage graphs held
            "capture": None if self.graphs is None else self.graphs.recorder.clock.info(),
            "stage_graphs": None if self.graphs is None else self.graphs.stage_graphs(),
        }
        if self.state == "done":
            rounds, prefills = self._captures()
            out["misses"] = {"round_graphs": rounds - self._captures_after[0],
                             "prefill_graphs": prefills - self._captures_after[1],
                             # mixed rounds' layer graphs: never planned (a chunk's key exists only when it rides)
                             "mixed_graphs": 0 if self.graphs is None else self.graphs.mixed_captures,
                             "triton_compiles": self.compiles.total - self._compiles_after}
        return out

    def close(self) -> None:
        self.compiles.uninstall()


def _torch_memory(device) -> tuple[int, int]:
    """(allocated, reserved) bytes of torch's caching allocator on ``device``."""
    import torch

    return int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device))


def _triton_cache_dir() -> str | None:
    """Where Triton keeps compiled kernels (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), as Triton reads it."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return str(knobs.cache.dir)


def _progress(total: int):
    """A context giving ``advance(label)``: a rich progress bar on a terminal, log lines (about every 10%) otherwise."""
    import contextlib

    @contextlib.contextmanager
    def bar():
        if total and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn("warm-up"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          TextColumn("{task.description}"), transient=True) as progress:
                task = progress.add_task("", total=total)
                yield lambda label: progress.update(task, advance=1, description=label)
            return
        every = max(1, total // 10)
        count = [0]

        def advance(label: str) -> None:
            count[0] += 1
            if count[0] % every == 0 or count[0] == total:
                log.info("warm-up: %d/%d graphs (%s)", count[0], total, label)

        yield advance

    return bar()


@dataclass
class KeyStep(WarmupStep):
    """A step that captures one planned key (what :func:`fit_plan` may drop)."""

    key: Any = None


def build_steps(plan: WarmupPlan, *, graphs, prefill_graphs, runner, dims: GraphDims | None) -> list[WarmupStep]:
    """The plan as executable steps over a built engine's graph sets and runner, smallest first (so that when
    memory runs out, what is left uncaptured is the largest), then the eager continuation chunks."""
    steps: list[KeyStep] = []
    if graphs is not None:
        for key in plan.rounds:
            steps.append(KeyStep(label=_round_label(key), run=lambda k=key: graphs.capture(k), key=key,
                                  bytes=sum(round_bytes(key, dims)) if dims else 0))
    if prefill_graphs is not None:
        for key in plan.prefills:
            steps.append(KeyStep(label=f"prefill {key.rows}x{key.width}", run=lambda k=key: prefill_graphs.capture(k),
                                  key=key, bytes=sum(prefill_bytes(key, dims)) if dims else 0))
    steps.sort(key=lambda s: s.bytes)
    out: list[WarmupStep] = list(steps)
    for chunk in plan.eager_chunks if graphs is not None else ():
        out.append(WarmupStep(label=f"eager prefill {chunk.rows}x{chunk.width} over {chunk.kv_len}",
                              run=lambda c=chunk: _eager_chunk(runner, c), graph=False))
    return out


def _round_label(key: RoundShape) -> str:
    kind = "AR" if key.block_size == 1 else ("chain" if key.contiguous else "tree")
    return (f"{kind} rows {key.rows} nodes {key.max_budget} len {key.kv_len}"
            f"{'' if key.greedy else ' sampled' + (' filtered' if key.filtered else '')}")


def _eager_chunk(runner, chunk: EagerChunk) -> None:
    """One eager prefill chunk of ``chunk``'s shape, every row into the scratch slot at ``kv_len - width`` (so the
    chunk reads up to its key length): compiles its kernels' variants. The scratch slot holds garbage by design."""
    import torch

    from ddtree.engine.runner import PrefillInputs

    dev = runner.device
    rows = lambda v: torch.full((chunk.rows,), v, dtype=torch.long, device=dev)  # noqa: E731
    runner.prefill(PrefillInputs(ids=torch.zeros((chunk.rows, chunk.width), dtype=torch.long, device=dev),
                                 slots=rows(runner.target_cache.scratch_slot), start=rows(chunk.kv_len - chunk.width),
                                 valid_len=rows(chunk.width), last_index=rows(chunk.width - 1), kv_len=chunk.kv_len))


def free_device_bytes(device) -> Callable[[], int] | None:
    """The device's free memory as a callable (CUDA), None elsewhere: what :meth:`Warmup.run` fits the plan to."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return lambda: int(torch.cuda.mem_get_info(device)[0])
