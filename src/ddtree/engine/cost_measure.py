"""Measuring cost curves (:mod:`ddtree.engine.cost_curve`) on the engine's own runner: the declared grid, the one
measurer, budget auto's fallback curve, and what engine start does with ``EngineConfig.cost_curve``.

Why a module of its own: the curve is data (a grid, interpolation, a file) that the replay and the report read
without an engine; measuring it needs the runner, its graphs and torch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree import tuning
from ddtree.engine.auto_budget import candidates, curve_width
from ddtree.engine.cost_curve import (
    CostCurve,
    CostCurveError,
    cache_key,
    cached_curve,
    check_axis,
    load_curve,
)

log = logging.getLogger("ddtree.engine.cost_curve")

# a point's budget in measure_cost_curve standing for a round at budget 0 that keeps the drafter's context
# (CostGrid.context): budget auto's no tree
CONTEXT = -1
# the fewest keys before a chunk worth a prefill point of their own (default_grid): below, what the chunk's attention
# over them adds is within the noise of a step's time
PREFILL_CONTEXT_MIN = 256


@dataclass(frozen=True)
class CostGrid:
    """The declared grid a measurement times: every (rows, budget, kv_len) point, plus prefill step sizes."""

    rows: tuple[int, ...]
    budgets: tuple[int, ...]
    kv_lens: tuple[int, ...]
    block_size: int  # the draft block of every drafting round (L + 1); AR rounds draft nothing
    prefill_tokens: tuple[int, ...] = ()
    repeats: int = 3  # timed rounds per point (passes over the whole grid), after one untimed round
    # a point whose untimed round took longer is timed once: it is long against the few milliseconds of noise, and
    # it is what bounds the measurement's cost (on a CPU its untimed round is that one timing: nothing is captured)
    long_round_s: float = 0.05
    # what is kept of a point's timings: "median" (engine start, a quiet engine: the typical round) or "min" (budget
    # auto's fallback, measured while serving on a machine that may be busy: load only ever adds time)
    statistic: str = "median"
    # where the synthetic rows live: "free" (slots 0 .. rows - 1, as a real batch reads as many caches; only while no
    # request holds a slot) or "scratch" (every row in the scratch slot: safe while requests are served)
    slots: str = "free"
    # budget auto's candidates: when set, every drafting point is an auto round, whose tree stage selects the next
    # candidate's nodes to report the expected lengths (auto_budget.curve_width), as served
    auto_candidates: tuple[int, ...] = ()
    # also time, at every rows x kv_lens point, a round at budget 0 that keeps the drafter's context (budget auto's
    # no tree: CostCurve.context_seconds); needs a drafter and block_size >= 2
    context: bool = False
    # also time every prefill point after this many keys of its prompt (CostCurve.prefill_context_seconds: a later
    # chunk of a long prompt attends over the earlier ones); 0: not
    prefill_context: int = 0

    def __post_init__(self) -> None:
        check_axis("rows", self.rows, 1)
        check_axis("budgets", self.budgets, 0)
        check_axis("kv_lens", self.kv_lens, 1)
        if self.prefill_tokens:
            check_axis("prefill_tokens", self.prefill_tokens, 1)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise CostCurveError(f"cost grid block_size must be an integer >= 1, got {self.block_size!r}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise CostCurveError(f"cost grid repeats must be an integer >= 1, got {self.repeats!r}")
        if isinstance(self.long_round_s, bool) or not isinstance(self.long_round_s, (int, float)) or not (
                self.long_round_s > 0):
            raise CostCurveError(f"cost grid long_round_s must be > 0 seconds, got {self.long_round_s!r}")
        if self.context and self.block_size < 2:
            raise CostCurveError("cost grid context points need a drafting block_size >= 2")
        if self.statistic not in ("median", "min"):
            raise CostCurveError(f"cost grid statistic must be 'median' or 'min', got {self.statistic!r}")
        if self.slots not in ("free", "scratch"):
            raise CostCurveError(f"cost grid slots must be 'free' or 'scratch', got {self.slots!r}")
        k = self.prefill_context
        if isinstance(k, bool) or not isinstance(k, int) or k < 0 or (k and not self.prefill_tokens):
            raise CostCurveError(f"cost grid prefill_context must be an integer >= 0, and 0 without prefill_tokens, "
                                 f"got {k!r}")

    @property
    def points(self) -> int:
        return len(self.rows) * (len(self.budgets) + self.context) * len(self.kv_lens)


def reach_limit(cache_len: int, budget: int, block_size: int) -> int:
    """The largest kv_len a round of ``budget`` can be timed at: from its root at ``kv_len - budget - 1`` it writes
    ``budget + 1`` tree nodes into the target cache and a block into the drafter's, inside ``cache_len``."""
    return cache_len - max(budget + 1, block_size) + budget - 1


def default_grid(*, max_batch: int, max_budget: int, cache_len: int, block_size: int | None, step_tokens: int,
                 budgets: Sequence[int] | None = None, repeats: int = 3, buckets: bool = True) -> CostGrid:
    """The grid engine start measures.

    With ``buckets`` (CUDA graphs) the grid holds the points the engine's rounds are padded to, so a choice reads
    measured points, never an interpolation: rows are the rows buckets (powers of two up to ``max_batch``, and
    ``max_batch``), budgets 0 (AR), budget auto's candidates ``2^k - 1`` up to ``max_budget`` (each fills a node
    bucket exactly) and ``max_budget`` itself. Why every bucket: a round's cost is flat below a knee in the tokens
    it verifies and steep past it, and a line between far points misplaces the knee: rows 1/4/16/64 and budgets
    0/3/15 (the grid before 2026-12-07) read a 32-row b15 round a quarter of the way from 16 rows to 64 and a b1
    round a third of the way from AR to b3 (docs/benchmarks.md, "The cost curve's grid"). It costs start-up time
    once per device, model and config: 7 x 7 x 3 points at 64 rows and budget 32, 94 s on the H100 stand-in (each
    point's graph captured once), cached on disk (:func:`curve_at_start`).

    Without ``buckets`` (a CPU engine pays seconds, not minutes: at most 4 x 5 x 3 points): rows 1, ``max_batch``
    and up to two powers of four between; budgets 0, 1 (the smallest drafting round: a draft forward and a tree
    stage that AR lacks, module doc of :mod:`ddtree.engine.cost_curve`), 4, 16 below ``max_budget`` and
    ``max_budget`` (a CPU round's cost is smooth in the budget past the draft).

    With a drafter, also the context points (``CostGrid.context``: budget auto's no tree, a round at budget 0 that
    keeps the drafter's context, which AR's point leaves out). ``budgets`` given: 0 plus those. kv_lens: 64, 512
    and 4096, capped at what the cache leaves room for (:func:`reach_limit`); prefill steps of 16, 64, 256 .. tokens up to ``step_tokens``
    (``EngineConfig.prefill_step_tokens``: a step's size, padding included; timed as one row, which costs about what
    a step of as many tokens in several rows does once the step is compute-bound), from position 0 and again after
    the largest kv_len's keys (``prefill_context``, where the cache leaves room for the widest step and that is at
    least :data:`PREFILL_CONTEXT_MIN`): a long prompt's later chunks attend over its earlier ones. ``block_size`` None (no
    drafter) measures AR only."""
    if buckets:
        rows = list(rows_buckets(max_batch))
    else:
        rows = sorted({1, max_batch} | {1 << i for i in range(2, 8, 2) if (1 << i) < max_batch})
        if len(rows) > 4:
            rows = [rows[0], rows[len(rows) // 3], rows[2 * len(rows) // 3], rows[-1]]
    if block_size is None or block_size < 2:
        chosen: list[int] = [0]
        block = 1
    else:
        block = block_size
        if budgets is not None:
            chosen = sorted({int(b) for b in budgets} | {0})
        elif buckets:
            chosen = sorted({0, max_budget, *candidates(max_budget)})
        else:
            chosen = sorted({0, max_budget} | {b for b in (1, 4, 16) if b < max_budget})
    top = min(reach_limit(cache_len, b, block if b else 1) for b in chosen)
    if top < 1:
        raise CostCurveError(f"cache length {cache_len} leaves no room to time a round of budget {max(chosen)}")
    kv = sorted({min(v, top) for v in (64, 512, 4096)})
    prefill = sorted({min(16 * 4 ** i, step_tokens, cache_len) for i in range(5)})
    return CostGrid(tuple(rows), tuple(chosen), tuple(kv), block, tuple(prefill), repeats, context=block > 1,
                    prefill_context=prefill_context_for(kv, prefill, cache_len))


def prefill_context_for(kv_lens: Sequence[int], prefill_tokens: Sequence[int], cache_len: int) -> int:
    """Where a grid's prefill points are timed again (``CostGrid.prefill_context``): after its longest keys, or as
    many as the cache leaves room for before the widest step; 0 (not at all) below :data:`PREFILL_CONTEXT_MIN` or
    without prefill points."""
    if not prefill_tokens or not kv_lens:
        return 0
    after = min(max(kv_lens), cache_len - max(prefill_tokens))
    return after if after >= PREFILL_CONTEXT_MIN else 0


def sample_points(points: Sequence[tuple[int, int, int]], one_round: Callable[[int, int, int], float], *,
                  repeats: int, long_round_s: float, statistic: str, warm_counts: bool) -> list[float]:
    """Seconds per point: one untimed round each, then ``repeats`` passes over the whole grid, ``statistic``
    ("median" or "min") of each point's timings kept. Passes rather than repeats in a row, so a burst of load from
    another process lands in one pass of a few neighbouring points, not in every timing of one point. A point whose
    untimed round took over ``long_round_s`` is timed once; with ``warm_counts`` (nothing captured: the untimed
    round was a real one) that untimed round is its timing."""
    import statistics

    warm = [one_round(*point) for point in points]  # untimed: a CUDA capture, first-use allocations
    long = [w > long_round_s for w in warm]
    samples: list[list[float]] = [[w] if is_long and warm_counts else [] for w, is_long in zip(warm, long, strict=True)]
    for _ in range(repeats):
        for i, point in enumerate(points):
            if not (long[i] and samples[i]):
                samples[i].append(one_round(*point))
    keep = statistics.median if statistic == "median" else min
    return [keep(s) for s in samples]


def measure_cost_curve(runner: Any, grid: CostGrid, *, graphs: Any = None, prefill_graphs: Any = None,
                       device_name: str, model: str, progress: Callable[[str], None] | None = None) -> CostCurve:
    """Time the engine's real runner on every point of ``grid`` and return the curve (:func:`sample_points`: one
    untimed round per point, on CUDA capturing the point's graphs, then ``grid.repeats`` timed passes, the
    grid's statistic per point). The one measurer of the engine: at engine start and ``ddtree replay curve``
    (slots "free", the median) and budget auto's fallback while serving (slots "scratch", the fastest pass).

    runner: the engine's :class:`~ddtree.engine.runner.ModelRunner`; graphs: its
    :class:`~ddtree.engine.cuda_graphs.RoundGraphs` (CUDA) or None (eager rounds, the CPU path); prefill_graphs:
    its :class:`~ddtree.engine.cuda_graphs.PrefillGraphs` or None. The synthetic rows
    are :meth:`~ddtree.engine.round.RowInputs.padding` rows, moved to slots ``0 .. rows - 1`` with slots "free"
    (a real batch reads as many different caches; all on the scratch slot, a GPU would serve them from its L2 and
    undercount long contexts: only while no request holds a slot) or all on the scratch slot; each with the
    point's budget and its root at ``kv_len - budget - 1`` (at 1 where that is smaller: a kv_len below the budget's
    own nodes is not a real round, and times the smallest one); a graph bucket's padding rows take the scratch slot
    as in serving. Their cache contents are garbage and stay unread: a request's prefill writes every position of
    its slot it will read. A round's time is wall time from packing its rows to reading its result on the host
    (the engine's one sync), so it includes the launch and the copy. Prefill points are one row of that many tokens
    from position 0 on the scratch slot, through ``prefill_graphs`` where the scheduler would replay one for that
    chunk (:meth:`~ddtree.engine.cuda_graphs.PrefillGraphs.can_run`), else eager, as the scheduler runs it: on the
    H200 stand-in an eager chunk of 16-1024 tokens took 26-34 ms, launch-bound, against 5-7 ms for a graphed one
    up to 256 tokens, and a curve of eager points charged every short prompt's arrival that much
    (docs/benchmarks.md, "Replay predicts tok/s on the H200"). With ``grid.prefill_context`` the same points again
    from that position (the keys before it garbage, as the rounds' are), eager, as the scheduler runs a prompt's
    later chunks (the prefill graphs take chunks from position 0 only)."""
    import statistics
    import time

    import torch

    from ddtree.engine.round import NO_WINDOW, PackedRows, RoundInputs, RoundShape, RowInputs
    from ddtree.engine.runner import PrefillInputs, StageTimer, to_host

    scratch = runner.target_cache.scratch_slot  # live slots are 0 .. scratch - 1
    if grid.slots == "free" and grid.rows[-1] > scratch:
        raise CostCurveError(f"cost grid rows {list(grid.rows)} exceed the engine's {scratch} KV slots")
    if max(grid.budgets) > 0 and (runner.drafter is None or grid.block_size < 2):
        raise CostCurveError(f"cost grid budgets {list(grid.budgets)} need a drafter and a block size >= 2")
    if grid.context and runner.drafter is None:
        raise CostCurveError("cost grid context points (no tree with the drafter's context kept) need a drafter")
    cache_len = runner.target_cache.max_len
    for b in grid.budgets:
        top = reach_limit(cache_len, b, grid.block_size if b else 1)
        if grid.kv_lens[-1] > top:
            raise CostCurveError(f"cost grid kv_len {grid.kv_lens[-1]} leaves no room for a budget-{b} round in "
                                 f"{cache_len} cache positions; keep kv_lens <= {top}")
    if grid.prefill_context and grid.prefill_context + grid.prefill_tokens[-1] > cache_len:
        raise CostCurveError(f"cost grid prefill_context {grid.prefill_context} leaves no room for a "
                             f"{grid.prefill_tokens[-1]}-token prefill point in {cache_len} cache positions")
    began = time.perf_counter()
    pad = RowInputs.padding(scratch)

    def point_shape(rows: int, budget: int, kv_len: int) -> RoundShape:
        if budget == CONTEXT:  # no tree as budget auto runs it: the block kept, the curve width above 0 (always 1,
            start = max(kv_len - 1, 1)  # the smallest candidate: auto_budget.curve_width)
            return RoundShape(rows=rows, max_budget=0, block_size=grid.block_size, kv_len=start + 1,
                              draft_kv_len=start, greedy=True, filtered=False, contiguous=False, auto_width=1)
        start = max(kv_len - budget - 1, 1)  # the root: the verify reads start + budget + 1 keys
        width = curve_width(budget, grid.auto_candidates) if grid.auto_candidates and budget else 0
        return RoundShape(rows=rows, max_budget=budget, block_size=grid.block_size if budget else 1,
                          kv_len=start + budget + 1, draft_kv_len=start, greedy=True, filtered=False,
                          contiguous=budget == 0, auto_width=width)

    def one_round(rows: int, budget: int, kv_len: int) -> float:
        shape = point_shape(rows, budget, kv_len)
        row_list = [dataclasses.replace(pad, slot=i if grid.slots == "free" else scratch, root_token=0,
                                        start=shape.draft_kv_len, budget=shape.max_budget,
                                        depth_limit=shape.block_size - 1, window=NO_WINDOW, auto=int(budget == CONTEXT))
                    for i in range(rows)]
        t0 = time.perf_counter()
        packed = PackedRows.pack(row_list)
        timer = StageTimer(runner.device)
        if graphs is not None and graphs.can_run(rows):
            result, _ = graphs.run(packed, shape, timer)
        else:
            result = runner.round(RoundInputs.from_packed(packed.to(runner.device), shape), timer)
        to_host(result)
        return time.perf_counter() - t0

    points = [(r, b, k) for r in grid.rows for b in grid.budgets for k in grid.kv_lens]  # storage order
    grid_points = len(points)
    if grid.context:  # then the context points, in their own storage order
        points += [(r, CONTEXT, k) for r in grid.rows for k in grid.kv_lens]
    kept = None if graphs is None else graphs.max_graphs
    if graphs is not None:
        # Every point's graph stays captured through the passes: past the graphs' LRU cap a pass in grid order
        # would evict each key before its next use, and every timed round would include a capture.
        keys = {graphs.key_for(point_shape(*point)) for point in points if graphs.can_run(point[0])}
        graphs.max_graphs = max(kept, len(graphs.graphs) + len(keys))
    try:
        seconds = sample_points(points, one_round, repeats=grid.repeats, long_round_s=grid.long_round_s,
                                statistic=grid.statistic, warm_counts=graphs is None)
    finally:
        if graphs is not None:
            graphs.max_graphs = kept  # the next capture trims the cache back to it
    if progress is not None:
        for (r, b, k), sec in zip(points, seconds, strict=True):
            what = "no tree, context kept" if b == CONTEXT else f"budget {b}"
            progress(f"rows {r} {what} kv_len {k}: {sec * 1e3:.2f} ms")

    dev = runner.device
    one = lambda v: torch.tensor([v], dtype=torch.long, device=dev)  # noqa: E731

    def one_prefill(tokens: int, start: int = 0) -> float:
        nonlocal prefill_graphs  # dropped at a failed replay or capture, as the scheduler drops its prefill graphs
        t0 = time.perf_counter()
        if not start and prefill_graphs is not None and prefill_graphs.can_run(1, tokens, [0]):
            try:
                logits = prefill_graphs.run(torch.zeros((1, tokens), dtype=torch.long), [scratch], [tokens])
                to_host(logits.argmax(-1))
                return time.perf_counter() - t0
            except Exception:  # a capture that fails (memory, an op graphs refuse) must not fail the measurement
                log.exception("cost curve: a prefill graph failed; timing the prefill points eagerly")
                prefill_graphs = None
                t0 = time.perf_counter()
        logits = runner.prefill(PrefillInputs(
            ids=torch.zeros((1, tokens), dtype=torch.long, device=dev), slots=one(scratch),
            start=one(start), valid_len=one(tokens), last_index=one(tokens - 1), kv_len=start + tokens))
        to_host(logits.argmax(-1))
        return time.perf_counter() - t0

    after = grid.prefill_context
    steps = [(t, 0) for t in grid.prefill_tokens] + [(t, after) for t in grid.prefill_tokens if after]
    with torch.inference_mode():
        for t, start in steps:
            one_prefill(t, start)
        timed_prefill = [[one_prefill(t, start) for t, start in steps] for _ in range(grid.repeats)]
    prefill = [statistics.median(rep[i] for rep in timed_prefill) for i in range(len(steps))]
    n = len(grid.prefill_tokens)
    return CostCurve(device=device_name, model=model, rows=grid.rows, budgets=grid.budgets, kv_lens=grid.kv_lens,
                     seconds=tuple(seconds[:grid_points]), repeats=grid.repeats,
                     measure_seconds=time.perf_counter() - began, prefill_tokens=grid.prefill_tokens,
                     prefill_seconds=tuple(prefill[:n]), context_seconds=tuple(seconds[grid_points:]),
                     prefill_context=after, prefill_context_seconds=tuple(prefill[n:]))


# ------------------------------------------------------------------------------------------------ budget auto's fallback
def fallback_curve(sched: Any, cands: Sequence[int]) -> CostCurve:
    """The fallback curve of a scheduler (:class:`ddtree.engine.scheduler.Scheduler`) that was given none, measured
    by the engine's one measurer (:func:`measure_cost_curve`) while it may be serving: auto
    rounds over budget auto's ``cands`` and AR rounds (budget 0, no tree: auto's option too, ``auto_budget.ZERO``; a
    curve without it would price no tree as b1) at :func:`rows_buckets` x :func:`fallback_kv_lens`, every row in the scratch slot (live slots are
    never touched), one untimed round a point then the fastest of three passes over the grid (load only ever adds
    time), on its graphs (CUDA) or eagerly; logged with the values, since a busy machine makes them noisy.

    Auto rounds, as served: each selects the next candidate's nodes to report the expected lengths; on a CPU that
    selection is milliseconds a round, and a curve of plain rounds left it out (docs/benchmarks.md, run 7)."""
    rows, kv = rows_buckets(sched.config.max_batch), fallback_kv_lens(sched.cache_len)
    log.warning("budget auto: no cost curve set on the engine; measuring one now (%d rows x %d budgets x %d lengths, "
                "greedy rounds in the scratch slot)", len(rows), len(cands), len(kv))
    grid = CostGrid(rows=rows, budgets=(0, *cands), kv_lens=kv, block_size=max(2, int(sched.trained_block_size)),
                    repeats=3, long_round_s=math.inf, statistic="min", slots="scratch", auto_candidates=tuple(cands),
                    context=True)
    curve = measure_cost_curve(sched.runner, grid, graphs=sched.graphs, device_name=str(sched.device),
                               model=sched.model_name)
    log.warning("budget auto: cost curve measured in %.1f s: %s", curve.measure_seconds, curve.to_json())
    return curve


def rows_buckets(max_batch: int) -> tuple[int, ...]:
    """The rows buckets of CUDA graphs (``cuda_graphs.bucket_rows``' values): powers of two up to ``max_batch``,
    and ``max_batch``; the rows the engine-start grid on CUDA and the fallback curve are measured at."""
    out = {1 << k for k in range(0, 16) if 1 << k <= max_batch} | {max_batch}
    return tuple(sorted(out))


def fallback_kv_lens(cache_len: int) -> tuple[int, ...]:
    """Key lengths a fallback curve is measured at: 128 and half the cache (the cost is close to linear in the keys;
    past the last point the curve extrapolates; the whole cache would let the scratch rows write past its end)."""
    return tuple(sorted({min(128, cache_len // 2), cache_len // 2}))


# ------------------------------------------------------------------------------------------------ engine start
@dataclass(frozen=True)
class CurveSource:
    """Where an engine's cost curve came from (``Engine.info()["cost_curve"]``, ``/server_info``)."""

    setting: str = "off"  # EngineConfig.cost_curve: "off", "auto" or a path
    source: str = "off"  # "off", "measured", "cache" (a cached file of an earlier measurement) or "file"
    curve: CostCurve | None = None
    path: str | None = None  # the file read or written
    seconds: float = 0.0  # wall seconds engine start spent on it (measuring, or reading the file)

    def info(self) -> dict[str, Any]:
        c = self.curve
        return {"setting": self.setting, "source": self.source, "path": self.path, "seconds": round(self.seconds, 3),
                "measure_seconds": None if c is None else round(c.measure_seconds, 3),
                "device": None if c is None else c.device, "model": None if c is None else c.model,
                "grid": None if c is None else {"rows": list(c.rows), "budgets": list(c.budgets),
                                                "kv_lens": list(c.kv_lens), "prefill_tokens": list(c.prefill_tokens),
                                                "context_points": bool(c.context_seconds),
                                                "prefill_context": c.prefill_context, "repeats": c.repeats}}


def engine_device_name(device: Any) -> str:
    """The device a curve belongs to: the CUDA device's name (``NVIDIA H200``) or ``cpu``."""
    import torch

    return torch.cuda.get_device_name(device) if getattr(device, "type", None) == "cuda" else "cpu"


def engine_grid(parts: Any) -> CostGrid:
    """The declared grid of an engine (:func:`default_grid` over its resolved config, cache and drafter)."""
    config = parts.config
    block = int(config.default_tree.block_size or parts.trained_block_size) if parts.drafter is not None else None
    return default_grid(max_batch=config.max_batch, max_budget=config.max_budget, cache_len=parts.cache_len,
                        block_size=block, step_tokens=config.prefill_step_tokens, buckets=parts.graphs is not None)


def curve_at_start(parts: Any, *, cache_dir: Path | None = None,
                   progress: Callable[[str], None] | None = None) -> CurveSource:
    """The cost curve ``EngineConfig.cost_curve`` asks for, for a built engine (:class:`~ddtree.engine.build.
    EngineParts`) whose slots are all free: ``off`` -> none; a path -> that file (a malformed one is a
    :class:`CostCurveError`: the user named it); ``auto`` -> the curve cached for this device, model and engine
    config under ``cache_dir`` (default :func:`default_cache_dir`), measured now on :func:`engine_grid` (graphed
    rounds on CUDA, so call it after the warm-up captured its graphs) and cached when missing or unreadable."""
    import time

    import torch

    setting = str(parts.config.cost_curve)
    if setting == "off":
        return CurveSource()
    began = time.perf_counter()
    device = engine_device_name(parts.device)
    model = f"{parts.model_name} ({parts.config.dtype})"
    if setting != "auto":
        curve = load_curve(Path(setting))
        if curve.device != device or curve.model != model:
            log.warning("cost curve %s was measured on %s for %s; this engine is %s with %s", setting, curve.device,
                        curve.model, device, model)
        return CurveSource(setting, "file", curve, setting, time.perf_counter() - began)
    grid = engine_grid(parts)
    cfg = parts.config
    key = cache_key(device, model, target=cfg.target, draft=cfg.draft, kernels=cfg.gpu_kernels,
                    graphs=parts.graphs is not None, exact=cfg.exact, draft_fp8=cfg.draft_fp8,
                    blas_rule=cfg.blas_rule, cpu_threads=cfg.cpu_threads, torch=torch.__version__,
                    grid=dataclasses.asdict(grid), combine_block_m=tuning.COMBINE_BLOCK_M,
                    combine_block_d=tuning.COMBINE_BLOCK_D)

    def measure() -> CostCurve:
        log.info("measuring the cost curve: %d points x %d rounds", grid.points, grid.repeats + 1)
        return measure_cost_curve(parts.runner, grid, graphs=parts.graphs, prefill_graphs=parts.prefill_graphs,
                                  device_name=device, model=model, progress=progress)

    curve, path, source = cached_curve(key, measure, cache_dir=cache_dir)
    return CurveSource(setting, source, curve, str(path), time.perf_counter() - began)


def attach_curve(engine: Any, *, cache_dir: Path | None = None) -> CurveSource:
    """Resolve ``EngineConfig.cost_curve`` for a built, not yet serving engine (:func:`curve_at_start`) and give it
    the result: ``engine.cost_curve_source`` (its info) and, when there is a curve, ``engine.cost_curve`` (what
    budget "auto" reads; left as it was when the setting is ``off``)."""
    source = curve_at_start(engine.parts, cache_dir=cache_dir)
    engine.cost_curve_source = source
    if source.curve is not None:
        engine.cost_curve = source.curve
    return source


__all__ = ["CostGrid", "CurveSource", "attach_curve", "curve_at_start", "default_grid", "engine_device_name",
           "engine_grid", "fallback_curve", "fallback_kv_lens", "measure_cost_curve", "reach_limit", "rows_buckets",
           "sample_points"]
