"""The cost curve: one decode round's wall seconds as a function of rows, tree budget and context length.

Terms:
    rows     requests in the round (the batch; padding rows included: on CUDA a round pays its rows bucket).
    budget   tree nodes past the root per request; 0 is AR (the root alone), a chain of depth d is budget d.
    kv_len   the keys the round's verify reads: the furthest root's position + budget + 1 (``RoundShape.kv_len``),
             in tokens; a row whose root is at ``p`` (``p`` committed tokens before it) reads ``p + budget + 1``.
    round seconds  wall time of one decode round for that many rows: draft + tree + verify + commit, as the engine's
             ``StageTimer`` and round timing measure it (the one host sync included).

A curve is a grid of measured points, ``seconds[r, b, k]`` for ``rows[r]``, ``budgets[b]``, ``kv_lens[k]``, stored
flattened in that (C) order. Worked example: rows (1, 4), budgets (0, 8), kv_lens (64,) and seconds
(0.010, 0.020, 0.016, 0.040) mean a 4-row b8 round at 64 tokens takes 40 ms; 2 rows b4 interpolates to
``2/3 * (0.010 + 0.020) / 2 + 1/3 * (0.016 + 0.040) / 2`` = 19.3 ms (2 rows is 1/3 of the way from 1 to 4, b4 half
the way from 0 to 8), and any kv_len reads the one kv_len point.

Interpolation is piecewise-linear along each axis (trilinear on the grid cell): a round's cost is close to linear
in the rows it verifies once the forward is past its bandwidth-bound knee (below it, extra rows ride almost free,
and the measured points are that knee: a denser rows grid near it is the remedy, not a fancier curve), linear in
the keys attention reads, and between two measured budgets linear in the tree's token rows. On CUDA the rows and
budgets are bucketed (powers of two, ``2^k - 1`` node buckets), so a curve measured at bucket edges is exact there;
a budget between two grid budgets gets the blend of their buckets, which is why the grid should hold exactly the
budgets a chooser picks from.

Extrapolation is capped: below an axis' first point the first point's value is used (a round never costs less than
the smallest measured one); above its last point the last segment's slope (never negative) is followed for at most
one more grid span, twice the last point at most, and held flat past that (:meth:`CostCurve.covers` says whether a
point is inside the grid, so callers can tell an extrapolated answer).

Curves are cached per device and model on disk as JSON (``<cache_dir>/<key>.json``, default
``~/.cache/ddtree/cost_curves``), written atomically (a temporary file in the same directory, then ``os.replace``),
so a crash leaves the old file or the new one, never half of one; a file that does not load is reported with a
warning naming the problem and measured again (:func:`cached_curve`).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError
from ddtree.files import atomic_write_text

log = logging.getLogger(__name__)

COST_CURVE_SCHEMA = "ddtree.cost_curve/1"


class CostCurveError(ConfigError):
    """A cost curve (a file, a JSON object or the values built into one) is malformed; the message names the field."""


def default_cache_dir() -> Path:
    """``~/.cache/ddtree/cost_curves``: the user cache directory (a parameter everywhere it is used, never an env var)."""
    return Path.home() / ".cache" / "ddtree" / "cost_curves"


def _axis(name: str, values: Any, lo: int) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)) or not values:
        raise CostCurveError(f"cost curve {name} must be a non-empty list of integers, got {values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise CostCurveError(f"cost curve {name} must hold integers >= {lo}, got {v!r} in {list(values)}")
    if any(b <= a for a, b in zip(values[:-1], values[1:], strict=True)):
        raise CostCurveError(f"cost curve {name} must be strictly increasing, got {list(values)}")
    return tuple(values)


def _segment(axis: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """(i, j, w): ``x`` is ``(1 - w) * axis[i] + w * axis[j]`` with the capped extrapolation of the module doc."""
    if len(axis) == 1 or x <= axis[0]:
        return 0, 0, 0.0
    if x >= axis[-1]:
        i, j = len(axis) - 2, len(axis) - 1
        span = axis[j] - axis[i]
        x = min(x, axis[j] + span, 2 * axis[j])  # one more grid span at most, twice the last point at most
        return i, j, (x - axis[i]) / span
    j = bisect.bisect_right(axis, x)
    i = j - 1
    return i, j, (x - axis[i]) / (axis[j] - axis[i])


@dataclass(frozen=True)
class CostCurve:
    """Measured round wall seconds on a rows x budgets x kv_lens grid, for one device and model (see module doc)."""

    device: str  # e.g. "cpu" or "NVIDIA H200"
    model: str  # the pair measured (target + drafter + dtype), free text
    rows: tuple[int, ...]  # strictly increasing, >= 1
    budgets: tuple[int, ...]  # strictly increasing, >= 0 (0 = AR)
    kv_lens: tuple[int, ...]  # strictly increasing, >= 1
    seconds: tuple[float, ...]  # flattened [len(rows), len(budgets), len(kv_lens)] round wall seconds, each > 0
    repeats: int = 1  # rounds timed per point (the median is stored)
    measure_seconds: float = 0.0  # wall seconds the whole measurement took (0 when unknown)
    # optional: one prefill step's wall seconds for prefill_tokens[i] prompt tokens (one row, from position 0)
    prefill_tokens: tuple[int, ...] = ()
    prefill_seconds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("device", "model"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise CostCurveError(f"cost curve {name} must be a non-empty string, got {getattr(self, name)!r}")
        object.__setattr__(self, "rows", _axis("rows", self.rows, 1))
        object.__setattr__(self, "budgets", _axis("budgets", self.budgets, 0))
        object.__setattr__(self, "kv_lens", _axis("kv_lens", self.kv_lens, 1))
        expected = len(self.rows) * len(self.budgets) * len(self.kv_lens)
        if not isinstance(self.seconds, (list, tuple)) or len(self.seconds) != expected:
            got = len(self.seconds) if isinstance(self.seconds, (list, tuple)) else type(self.seconds).__name__
            raise CostCurveError(
                f"cost curve seconds must hold len(rows) x len(budgets) x len(kv_lens) = {len(self.rows)} x "
                f"{len(self.budgets)} x {len(self.kv_lens)} = {expected} values, got {got}"
            )
        for n, s in enumerate(self.seconds):
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
                r, rest = divmod(n, len(self.budgets) * len(self.kv_lens))
                b, k = divmod(rest, len(self.kv_lens))
                raise CostCurveError(
                    f"cost curve seconds must be finite and > 0, got {s!r} at rows {self.rows[r]}, budget "
                    f"{self.budgets[b]}, kv_len {self.kv_lens[k]}; measure the curve again"
                )
        object.__setattr__(self, "seconds", tuple(float(s) for s in self.seconds))
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise CostCurveError(f"cost curve repeats must be an integer >= 1, got {self.repeats!r}")
        if (isinstance(self.measure_seconds, bool) or not isinstance(self.measure_seconds, (int, float))
                or not math.isfinite(self.measure_seconds) or self.measure_seconds < 0):
            raise CostCurveError(f"cost curve measure_seconds must be finite and >= 0, got {self.measure_seconds!r}")
        if self.prefill_tokens or self.prefill_seconds:
            object.__setattr__(self, "prefill_tokens", _axis("prefill_tokens", self.prefill_tokens, 1))
            if (not isinstance(self.prefill_seconds, (list, tuple))
                    or len(self.prefill_seconds) != len(self.prefill_tokens)):
                raise CostCurveError(f"cost curve prefill_seconds must hold one value per prefill_tokens entry "
                                     f"({len(self.prefill_tokens)}), got {self.prefill_seconds!r}")
            for t, v in zip(self.prefill_tokens, self.prefill_seconds, strict=True):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                    raise CostCurveError(f"cost curve prefill_seconds must be finite and > 0, got {v!r} at {t} tokens")
            object.__setattr__(self, "prefill_seconds", tuple(float(v) for v in self.prefill_seconds))
        else:
            object.__setattr__(self, "prefill_tokens", ())
            object.__setattr__(self, "prefill_seconds", ())

    def point(self, r: int, b: int, k: int) -> float:
        """The measured seconds at grid indices (r, b, k)."""
        return self.seconds[(r * len(self.budgets) + b) * len(self.kv_lens) + k]

    def round_seconds(self, rows: int, budget: int, kv_len: int) -> float:
        """One round's wall seconds for ``rows`` requests at ``budget`` reading ``kv_len`` keys (trilinear)."""
        for name, v, lo in (("rows", rows, 1), ("budget", budget, 0), ("kv_len", kv_len, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
                raise CostCurveError(f"round_seconds: {name} must be a number >= {lo}, got {v!r}")
        segments = (_segment(self.rows, rows), _segment(self.budgets, budget), _segment(self.kv_lens, kv_len))
        inside = self._blend(tuple((i, j, min(w, 1.0)) for i, j, w in segments))
        # past the grid's last point, follow the last segment only upwards: a slope that falls is held flat
        return max(inside, self._blend(segments)) if any(w > 1.0 for _, _, w in segments) else inside

    def _blend(self, segments: tuple[tuple[int, int, float], ...]) -> float:
        (ri, rj, rw), (bi, bj, bw), (ki, kj, kw) = segments
        total = 0.0
        for r, wr in ((ri, 1.0 - rw), (rj, rw)):
            for b, wb in ((bi, 1.0 - bw), (bj, bw)):
                for k, wk in ((ki, 1.0 - kw), (kj, kw)):
                    if wr * wb * wk:
                        total += wr * wb * wk * self.point(r, b, k)
        return total

    def prefill_step_seconds(self, tokens: int) -> float | None:
        """One prefill step's wall seconds for ``tokens`` prompt tokens in all (piecewise-linear in tokens, capped
        extrapolation as for rounds; a step of several rows is taken to cost what one row of their total does);
        None when the curve has no prefill points."""
        if not self.prefill_tokens:
            return None
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not math.isfinite(tokens) or tokens < 0:
            raise CostCurveError(f"prefill_step_seconds: tokens must be a number >= 0, got {tokens!r}")
        i, j, w = _segment(self.prefill_tokens, tokens)
        edge = (1 - min(w, 1.0)) * self.prefill_seconds[i] + min(w, 1.0) * self.prefill_seconds[j]
        return max(edge, (1 - w) * self.prefill_seconds[i] + w * self.prefill_seconds[j])

    def covers(self, rows: int, budget: int, kv_len: int) -> bool:
        """Whether the point lies inside the measured grid (no extrapolation)."""
        return (self.rows[0] <= rows <= self.rows[-1] and self.budgets[0] <= budget <= self.budgets[-1]
                and self.kv_lens[0] <= kv_len <= self.kv_lens[-1])

    def table(self) -> list[list[list[float]]]:
        """The seconds as a nested ``[rows][budgets][kv_lens]`` list (e.g. ``torch.tensor(curve.table())``)."""
        nb, nk = len(self.budgets), len(self.kv_lens)
        return [[[self.point(r, b, k) for k in range(nk)] for b in range(nb)] for r in range(len(self.rows))]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": COST_CURVE_SCHEMA,
            "device": self.device,
            "model": self.model,
            "rows": list(self.rows),
            "budgets": list(self.budgets),
            "kv_lens": list(self.kv_lens),
            "seconds": list(self.seconds),
            "repeats": self.repeats,
            "measure_seconds": self.measure_seconds,
            "prefill_tokens": list(self.prefill_tokens),
            "prefill_seconds": list(self.prefill_seconds),
        }

    @classmethod
    def from_json(cls, d: Any) -> CostCurve:
        """A curve from :meth:`to_json`'s object; anything malformed raises :class:`CostCurveError` naming it."""
        if not isinstance(d, Mapping):
            raise CostCurveError(f"a cost curve must be a JSON object, got {type(d).__name__}")
        if d.get("schema") != COST_CURVE_SCHEMA:
            raise CostCurveError(f"cost curve schema must be {COST_CURVE_SCHEMA!r}, got {d.get('schema')!r}")
        missing = [k for k in ("device", "model", "rows", "budgets", "kv_lens", "seconds") if k not in d]
        if missing:
            raise CostCurveError(f"cost curve lacks {', '.join(missing)}")
        unknown = sorted(set(d) - {"schema", "device", "model", "rows", "budgets", "kv_lens", "seconds", "repeats",
                                   "measure_seconds", "prefill_tokens", "prefill_seconds"})
        if unknown:
            raise CostCurveError(f"cost curve has unknown fields {unknown}")
        return cls(device=d["device"], model=d["model"], rows=d["rows"], budgets=d["budgets"], kv_lens=d["kv_lens"],
                   seconds=d["seconds"], repeats=d.get("repeats", 1), measure_seconds=d.get("measure_seconds", 0.0),
                   prefill_tokens=d.get("prefill_tokens", ()), prefill_seconds=d.get("prefill_seconds", ()))


def cache_key(device: str, model: str, **extra: Any) -> str:
    """A file-name-safe key for one device and model: a readable slug plus a hash of everything that sets the costs
    (``extra``: dtype, kernels, graphs, the grid...), so two configs never share a file."""
    canonical = json.dumps({"device": device, "model": model, **extra}, sort_keys=True, default=str)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{device}_{model}").strip("-")[:80] or "curve"
    return f"{slug}-{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"


def save_curve(curve: CostCurve, path: Path) -> Path:
    """Write ``curve`` to ``path`` atomically: a temporary file beside it, flushed and synced, then ``os.replace``."""
    path = Path(path)
    atomic_write_text(path, json.dumps(curve.to_json(), indent=1))
    return path


def load_curve(path: Path) -> CostCurve:
    """Read a curve written by :func:`save_curve`; a missing, truncated or malformed file raises
    :class:`CostCurveError` naming the file and the problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise CostCurveError(f"cost curve {path} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CostCurveError(f"cost curve {path} is not JSON (truncated or corrupt?): {exc}") from None
    try:
        return CostCurve.from_json(data)
    except CostCurveError as exc:
        raise CostCurveError(f"cost curve {path}: {exc}") from None


def cached_curve(
    key: str, measure: Callable[[], CostCurve], *, cache_dir: Path | None = None
) -> tuple[CostCurve, Path, str]:
    """The curve cached under ``key``, or ``measure()``'s result saved there. Returns (curve, path, source) with
    source ``"cache"`` or ``"measured"``; a cached file that does not load is warned about and measured again."""
    path = (default_cache_dir() if cache_dir is None else Path(cache_dir)) / f"{key}.json"
    if path.exists():
        try:
            return load_curve(path), path, "cache"
        except CostCurveError as exc:
            log.warning("%s; measuring it again", exc)
    curve = measure()
    save_curve(curve, path)
    return curve, path, "measured"


def make_curve(device: str, model: str, rows: Sequence[int], budgets: Sequence[int], kv_lens: Sequence[int],
               seconds: Callable[[int, int, int], float], **kwargs: Any) -> CostCurve:
    """A curve from a function of (rows, budget, kv_len): fills the grid in storage order (tests, hand-made curves)."""
    values = [seconds(r, b, k) for r in rows for b in budgets for k in kv_lens]
    return CostCurve(device, model, tuple(rows), tuple(budgets), tuple(kv_lens), tuple(values), **kwargs)



# ------------------------------------------------------------------------------------------------ measurement
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

    def __post_init__(self) -> None:
        _axis("rows", self.rows, 1)
        _axis("budgets", self.budgets, 0)
        _axis("kv_lens", self.kv_lens, 1)
        if self.prefill_tokens:
            _axis("prefill_tokens", self.prefill_tokens, 1)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise CostCurveError(f"cost grid block_size must be an integer >= 1, got {self.block_size!r}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise CostCurveError(f"cost grid repeats must be an integer >= 1, got {self.repeats!r}")
        if isinstance(self.long_round_s, bool) or not isinstance(self.long_round_s, (int, float)) or not (
                self.long_round_s > 0):
            raise CostCurveError(f"cost grid long_round_s must be > 0 seconds, got {self.long_round_s!r}")
        if self.statistic not in ("median", "min"):
            raise CostCurveError(f"cost grid statistic must be 'median' or 'min', got {self.statistic!r}")
        if self.slots not in ("free", "scratch"):
            raise CostCurveError(f"cost grid slots must be 'free' or 'scratch', got {self.slots!r}")

    @property
    def points(self) -> int:
        return len(self.rows) * len(self.budgets) * len(self.kv_lens)


def reach_limit(cache_len: int, budget: int, block_size: int) -> int:
    """The largest kv_len a round of ``budget`` can be timed at: from its root at ``kv_len - budget - 1`` it writes
    ``budget + 1`` tree nodes into the target cache and a block into the drafter's, inside ``cache_len``."""
    return cache_len - max(budget + 1, block_size) + budget - 1


def default_grid(*, max_batch: int, max_budget: int, cache_len: int, block_size: int | None, prefill_chunk: int,
                 budgets: Sequence[int] | None = None, repeats: int = 3, buckets: bool = True) -> CostGrid:
    """The grid engine start measures, at most 4 x 5 x 3 points (so a CPU engine pays seconds, not minutes):

    rows: 1, ``max_batch`` and up to two powers of two between, spread by factors of 4 (CUDA rows buckets);
    budgets: 0 (AR), 3, 15, 63 below ``max_budget`` and ``max_budget`` itself (with ``buckets``, CUDA graphs:
    2^k - 1 fills a node bucket exactly, the cheapest budget of its bucket; without, 4 and 16: a CPU round's cost
    is smooth in the budget), or 0 plus the ``budgets`` given; kv_lens: 64, 512 and 4096, capped at what
    the cache leaves room for (:func:`reach_limit`); prefill steps of 16, 64, 256 .. tokens up to ``prefill_chunk``.
    ``block_size`` None (no drafter) measures AR only."""
    rows = sorted({1, max_batch} | {1 << i for i in range(2, 8, 2) if (1 << i) < max_batch})
    if len(rows) > 4:
        rows = [rows[0], rows[len(rows) // 3], rows[2 * len(rows) // 3], rows[-1]]
    if block_size is None or block_size < 2:
        chosen: list[int] = [0]
        block = 1
    else:
        block = block_size
        if budgets is None:
            chosen = sorted({0, max_budget} | {b for b in ((3, 15, 63) if buckets else (4, 16)) if b < max_budget})
        else:
            chosen = sorted({int(b) for b in budgets} | {0})
    top = min(reach_limit(cache_len, b, block if b else 1) for b in chosen)
    if top < 1:
        raise CostCurveError(f"cache length {cache_len} leaves no room to time a round of budget {max(chosen)}")
    kv = sorted({min(v, top) for v in (64, 512, 4096)})
    prefill = sorted({min(16 * 4 ** i, prefill_chunk, cache_len) for i in range(5)})
    return CostGrid(tuple(rows), tuple(chosen), tuple(kv), block, tuple(prefill), repeats)


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


def measure_cost_curve(runner: Any, grid: CostGrid, *, graphs: Any = None, device_name: str, model: str,
                       progress: Callable[[str], None] | None = None) -> CostCurve:
    """Time the engine's real runner on every point of ``grid`` and return the curve (:func:`sample_points`: one
    untimed round per point, on CUDA capturing the point's graphs, then ``grid.repeats`` timed passes, the
    grid's statistic per point). The one measurer of the engine: at engine start and ``ddtree replay curve``
    (slots "free", the median) and budget auto's fallback while serving (slots "scratch", the fastest pass).

    runner: the engine's :class:`~ddtree.engine.runner.ModelRunner`; graphs: its
    :class:`~ddtree.engine.cuda_graphs.RoundGraphs` (CUDA) or None (eager rounds, the CPU path). The synthetic rows
    are :meth:`~ddtree.engine.round.RowInputs.padding` rows, moved to slots ``0 .. rows - 1`` with slots "free"
    (a real batch reads as many different caches; all on the scratch slot, a GPU would serve them from its L2 and
    undercount long contexts: only while no request holds a slot) or all on the scratch slot; each with the
    point's budget and its root at ``kv_len - budget - 1`` (at 1 where that is smaller: a kv_len below the budget's
    own nodes is not a real round, and times the smallest one); a graph bucket's padding rows take the scratch slot
    as in serving. Their cache contents are garbage and stay unread: a request's prefill writes every position of
    its slot it will read. A round's time is wall time from packing its rows to reading its result on the host
    (the engine's one sync), so it includes the launch and the copy. Prefill points are one row of that many tokens
    from position 0 on the scratch slot, eager."""
    import statistics
    import time

    import torch

    from ddtree.engine.auto_budget import curve_width
    from ddtree.engine.round import NO_WINDOW, PackedRows, RoundInputs, RoundShape, RowInputs
    from ddtree.engine.runner import PrefillInputs, StageTimer, to_host

    scratch = runner.target_cache.scratch_slot  # live slots are 0 .. scratch - 1
    if grid.slots == "free" and grid.rows[-1] > scratch:
        raise CostCurveError(f"cost grid rows {list(grid.rows)} exceed the engine's {scratch} KV slots")
    if max(grid.budgets) > 0 and (runner.drafter is None or grid.block_size < 2):
        raise CostCurveError(f"cost grid budgets {list(grid.budgets)} need a drafter and a block size >= 2")
    cache_len = runner.target_cache.max_len
    for b in grid.budgets:
        top = reach_limit(cache_len, b, grid.block_size if b else 1)
        if grid.kv_lens[-1] > top:
            raise CostCurveError(f"cost grid kv_len {grid.kv_lens[-1]} leaves no room for a budget-{b} round in "
                                 f"{cache_len} cache positions; keep kv_lens <= {top}")
    began = time.perf_counter()
    pad = RowInputs.padding(scratch)

    def one_round(rows: int, budget: int, kv_len: int) -> float:
        block = grid.block_size if budget else 1
        start = max(kv_len - budget - 1, 1)  # the root: the verify reads start + budget + 1 keys
        row_list = [dataclasses.replace(pad, slot=i if grid.slots == "free" else scratch, root_token=0, start=start,
                                        budget=budget, depth_limit=block - 1, window=NO_WINDOW) for i in range(rows)]
        width = curve_width(budget, grid.auto_candidates) if grid.auto_candidates and budget else 0
        shape = RoundShape(rows=rows, max_budget=budget, block_size=block, kv_len=start + budget + 1,
                           draft_kv_len=start, greedy=True, filtered=False, contiguous=budget == 0, auto_width=width)
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
    seconds = sample_points(points, one_round, repeats=grid.repeats, long_round_s=grid.long_round_s,
                            statistic=grid.statistic, warm_counts=graphs is None)
    if progress is not None:
        for (r, b, k), sec in zip(points, seconds, strict=True):
            progress(f"rows {r} budget {b} kv_len {k}: {sec * 1e3:.2f} ms")

    dev = runner.device
    one = lambda v: torch.tensor([v], dtype=torch.long, device=dev)  # noqa: E731

    def one_prefill(tokens: int) -> float:
        t0 = time.perf_counter()
        logits = runner.prefill(PrefillInputs(
            ids=torch.zeros((1, tokens), dtype=torch.long, device=dev), slots=one(runner.target_cache.scratch_slot),
            start=one(0), valid_len=one(tokens), last_index=one(tokens - 1), kv_len=tokens))
        to_host(logits.argmax(-1))
        return time.perf_counter() - t0

    with torch.inference_mode():
        for t in grid.prefill_tokens:
            one_prefill(t)
        timed_prefill = [[one_prefill(t) for t in grid.prefill_tokens] for _ in range(grid.repeats)]
    prefill = [statistics.median(rep[i] for rep in timed_prefill) for i in range(len(grid.prefill_tokens))]
    return CostCurve(device=device_name, model=model, rows=grid.rows, budgets=grid.budgets, kv_lens=grid.kv_lens,
                     seconds=tuple(seconds), repeats=grid.repeats, measure_seconds=time.perf_counter() - began,
                     prefill_tokens=grid.prefill_tokens, prefill_seconds=tuple(prefill))


# ------------------------------------------------------------------------------------------------ budget auto's fallback
def fallback_curve(sched: Any, cands: Sequence[int]) -> CostCurve:
    """The fallback curve of a scheduler (:class:`ddtree.engine.scheduler.Scheduler`) that was given none, measured
    by the engine's one measurer (:func:`measure_cost_curve`) while it may be serving: auto
    rounds over budget auto's ``cands`` at :func:`fallback_rows` x :func:`fallback_kv_lens`, every row in the scratch slot (live slots are
    never touched), one untimed round a point then the fastest of three passes over the grid (load only ever adds
    time), on its graphs (CUDA) or eagerly; logged with the values, since a busy machine makes them noisy.

    Auto rounds, as served: each selects the next candidate's nodes to report the expected lengths; on a CPU that
    selection is milliseconds a round, and a curve of plain rounds left it out (docs/benchmarks.md, run 7)."""
    rows, kv = fallback_rows(sched.config.max_batch), fallback_kv_lens(sched.cache_len)
    log.warning("budget auto: no cost curve set on the engine; measuring one now (%d rows x %d budgets x %d lengths, "
                "greedy rounds in the scratch slot)", len(rows), len(cands), len(kv))
    grid = CostGrid(rows=rows, budgets=tuple(cands), kv_lens=kv, block_size=max(2, int(sched.trained_block_size)),
                    repeats=3, long_round_s=math.inf, statistic="min", slots="scratch", auto_candidates=tuple(cands))
    curve = measure_cost_curve(sched.runner, grid, graphs=sched.graphs, device_name=str(sched.device),
                               model=sched.model_name)
    log.warning("budget auto: cost curve measured in %.1f s: %s", curve.measure_seconds, curve.to_json())
    return curve


def fallback_rows(max_batch: int) -> tuple[int, ...]:
    """Rows a fallback curve is measured at: powers of two up to ``max_batch``, and ``max_batch``."""
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
                                                "repeats": c.repeats}}


def engine_device_name(device: Any) -> str:
    """The device a curve belongs to: the CUDA device's name (``NVIDIA H200``) or ``cpu``."""
    import torch

    return torch.cuda.get_device_name(device) if getattr(device, "type", None) == "cuda" else "cpu"


def engine_grid(parts: Any) -> CostGrid:
    """The declared grid of an engine (:func:`default_grid` over its resolved config, cache and drafter)."""
    config = parts.config
    block = int(config.default_tree.block_size or parts.trained_block_size) if parts.drafter is not None else None
    return default_grid(max_batch=config.max_batch, max_budget=config.max_budget, cache_len=parts.cache_len,
                        block_size=block, prefill_chunk=config.prefill_chunk, buckets=parts.graphs is not None)


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
                    grid=dataclasses.asdict(grid))

    def measure() -> CostCurve:
        log.info("measuring the cost curve: %d points x %d rounds", grid.points, grid.repeats + 1)
        return measure_cost_curve(parts.runner, grid, graphs=parts.graphs, device_name=device, model=model,
                                  progress=progress)

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


__all__ = ["COST_CURVE_SCHEMA", "CostCurve", "CostCurveError", "CostGrid", "CurveSource", "attach_curve", "cache_key",
           "cached_curve",
           "curve_at_start", "default_cache_dir", "engine_device_name", "engine_grid", "default_grid", "load_curve", "make_curve", "measure_cost_curve", "reach_limit", "sample_points", "fallback_curve", "fallback_rows", "fallback_kv_lens",
           "save_curve"]
