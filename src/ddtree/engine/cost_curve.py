"""The cost curve: one decode round's wall seconds as a function of rows, tree budget and context length.

Terms:
    rows     requests in the round (the batch; padding rows included: on CUDA a round pays its rows bucket).
    budget   tree nodes past the root per request; 0 is AR (the root alone), a chain of depth d is budget d.
    kv_len   the keys the round's verify reads: the furthest root's position + budget + 1 (``RoundShape.kv_len``),
             in tokens; a row whose root is at ``p`` (``p`` committed tokens before it) reads ``p + budget + 1``.
    round seconds  wall time of one decode round for that many rows: draft + tree + verify + commit, as the engine's
             ``StageTimer`` and round timing measure it (the one host sync included).

A curve is a grid of measured points, ``seconds[r, b, k]`` for ``rows[r]``, ``budgets[b]``, ``kv_lens[k]``, stored
flattened in that (C) order. Worked example: rows (1, 4), budgets (0, 4, 8), kv_lens (64,) and seconds
(0.010, 0.016, 0.020, 0.016, 0.028, 0.040) mean a 4-row b8 round at 64 tokens takes 40 ms; 2 rows b6 interpolates
to ``2/3 * (0.016 + 0.020) / 2 + 1/3 * (0.028 + 0.040) / 2`` = 23.3 ms (2 rows is 1/3 of the way from 1 to 4, b6
half the way from 4 to 8), and any kv_len reads the one kv_len point.

Budget 0 (AR) is a round of another kind: it runs no draft forward and no tree stage, which every drafting round
pays whatever its budget. So a drafting budget is never interpolated toward the AR point: below the grid's smallest
drafting budget it costs that budget's time (b2 above costs what b4 does). Interpolating from AR made small trees
look nearly free: with budgets (0, 3, 15) a b1 round was timed at a third of the way from AR to b3, and auto chose
b1 and b3 where b7 was best (docs/benchmarks.md, "The cost curve's grid"). The grids the engine measures hold
budget 1 (:func:`ddtree.engine.cost_measure.default_grid`), so this matters only for a curve without it.

Budget auto's no tree (``ddtree.engine.auto_budget``) is a round at budget 0 that still copies the verify's features
into the drafter's context, which an AR round skips: a curve may hold its own points for it, ``context_seconds``
over rows x kv_lens (the grids the engine measures with a drafter do, ``CostGrid.context``), read by
``round_seconds(..., keeps_context=True)``; a curve without them prices such a round at AR's point, a few per cent
cheap (0.36 ms of a 7 ms round at 64 rows on the H200 stand-in; 0.4-0.5 ms of 4-6 ms on the 2-core CPU VM).

Prefill steps (optional, read by ``ddtree replay``'s model of the engine loop): ``prefill_seconds`` for one step of
``prefill_tokens[i]`` prompt tokens from position 0, and ``prefill_context_seconds`` for the same steps after
``prefill_context`` keys of their prompt; a step whose chunks sit after ``c`` keys on average costs the first plus
``c / prefill_context`` of the difference (:meth:`CostCurve.prefill_step_seconds`).

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
import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
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


def check_axis(name: str, values: Any, lo: int) -> tuple[int, ...]:
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
    # optional: the same steps with prefill_context keys before the chunk (a prompt's later chunks attend over its
    # earlier ones), one value per prefill_tokens entry; 0 / empty: a step costs the same at any offset
    prefill_context: int = 0
    prefill_context_seconds: tuple[float, ...] = ()
    # optional: flattened [len(rows), len(kv_lens)] wall seconds of a round at budget 0 that keeps the drafter's
    # context (budget auto's no tree: the verify's features copied and appended, which an AR round skips); empty:
    # such a round is priced at AR's point (budget 0)
    context_seconds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("device", "model"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise CostCurveError(f"cost curve {name} must be a non-empty string, got {getattr(self, name)!r}")
        object.__setattr__(self, "rows", check_axis("rows", self.rows, 1))
        object.__setattr__(self, "budgets", check_axis("budgets", self.budgets, 0))
        object.__setattr__(self, "kv_lens", check_axis("kv_lens", self.kv_lens, 1))
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
            object.__setattr__(self, "prefill_tokens", check_axis("prefill_tokens", self.prefill_tokens, 1))
            object.__setattr__(self, "prefill_seconds", self._per_step("prefill_seconds", self.prefill_seconds))
        else:
            object.__setattr__(self, "prefill_tokens", ())
            object.__setattr__(self, "prefill_seconds", ())
        self._check_prefill_context()
        context = None
        if self.context_seconds:
            # the points as a curve of one budget, read by the same interpolation (round_seconds)
            try:
                context = CostCurve(self.device, self.model, self.rows, (0,), self.kv_lens, self.context_seconds)
            except CostCurveError as exc:
                raise CostCurveError(f"cost curve context_seconds (one value per rows x kv_lens point): "
                                     f"{exc}") from None
            object.__setattr__(self, "context_seconds", context.seconds)
        else:
            object.__setattr__(self, "context_seconds", ())
        object.__setattr__(self, "_context", context)

    def _check_prefill_context(self) -> None:
        k, values = self.prefill_context, self.prefill_context_seconds
        if not k and not values:
            object.__setattr__(self, "prefill_context", 0)
            object.__setattr__(self, "prefill_context_seconds", ())
            return
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise CostCurveError(f"cost curve prefill_context must be an integer >= 1 (the keys before the timed "
                                 f"chunks), got {k!r}")
        object.__setattr__(self, "prefill_context_seconds", self._per_step("prefill_context_seconds", values))

    def _per_step(self, name: str, values: Any) -> tuple[float, ...]:
        """``values`` checked as one finite, positive seconds value per ``prefill_tokens`` entry."""
        if not isinstance(values, (list, tuple)) or len(values) != len(self.prefill_tokens) or not values:
            raise CostCurveError(f"cost curve {name} must hold one value per prefill_tokens entry "
                                 f"({len(self.prefill_tokens)}), got {values!r}")
        for t, v in zip(self.prefill_tokens, values, strict=True):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise CostCurveError(f"cost curve {name} must be finite and > 0, got {v!r} at {t} tokens")
        return tuple(float(v) for v in values)

    def point(self, r: int, b: int, k: int) -> float:
        """The measured seconds at grid indices (r, b, k)."""
        return self.seconds[(r * len(self.budgets) + b) * len(self.kv_lens) + k]

    def round_seconds(self, rows: int, budget: int, kv_len: int, *, keeps_context: bool = False) -> float:
        """One round's wall seconds for ``rows`` requests at ``budget`` reading ``kv_len`` keys (trilinear; a drafting
        budget below the grid's smallest drafting budget is read there, never toward AR's point). ``keeps_context``:
        a round at budget 0 that keeps the drafter's context (budget auto's no tree), read from
        :attr:`context_seconds` where the curve has them, else at AR's point."""
        for name, v, lo in (("rows", rows, 1), ("budget", budget, 0), ("kv_len", kv_len, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
                raise CostCurveError(f"round_seconds: {name} must be a number >= {lo}, got {v!r}")
        if budget == 0 and keeps_context and self._context is not None:
            return self._context.interpolated(rows, 0, kv_len)
        if budget > 0 and len(self.budgets) > 1 and self.budgets[0] == 0:
            budget = max(budget, self.budgets[1])  # a drafting round never blends with AR's point (module doc)
        return self.interpolated(rows, budget, kv_len)

    def interpolated(self, rows: float, budget: float, kv_len: float) -> float:
        """The grid read at a point, trilinear along every axis with the capped extrapolation of the module doc
        (no rule for AR's point: :meth:`round_seconds` applies that, and checks the arguments)."""
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

    def prefill_step_seconds(self, tokens: int, context: float = 0) -> float | None:
        """One prefill step's wall seconds for ``tokens`` prompt tokens in all (piecewise-linear in tokens, capped
        extrapolation as for rounds; a step of several rows is taken to cost what one row of their total does)
        whose chunks sit after ``context`` keys of their prompts on average; None when the curve has no prefill
        points.

        Context: where the curve has :attr:`prefill_context_seconds`, linear from the points at 0 keys to those at
        :attr:`prefill_context` keys (a chunk's attention over its prompt's earlier keys is linear in them), followed
        past them for at most one more span, never below the points at 0; without them a step costs the same at
        any offset. Why: a prompt of 8k tokens prefilled in chunks of 2048 attends over 0, 2k, 4k and 6k earlier
        keys, and pricing every chunk as the first left replay's tok/s 10-14 % high at 32 prompts of 8k on the H100
        stand-in (docs/benchmarks.md, "Budget auto across the matrix on one H100")."""
        if not self.prefill_tokens:
            return None
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not math.isfinite(tokens) or tokens < 0:
            raise CostCurveError(f"prefill_step_seconds: tokens must be a number >= 0, got {tokens!r}")
        if (isinstance(context, bool) or not isinstance(context, (int, float)) or not math.isfinite(context)
                or context < 0):
            raise CostCurveError(f"prefill_step_seconds: context must be a number >= 0, got {context!r}")
        at_zero = self._prefill_read(self.prefill_seconds, tokens)
        if not context or not self.prefill_context_seconds:
            return at_zero
        at_k = self._prefill_read(self.prefill_context_seconds, tokens)
        share = min(float(context), 2.0 * self.prefill_context) / self.prefill_context
        return at_zero + max(at_k - at_zero, 0.0) * share

    def _prefill_read(self, seconds: tuple[float, ...], tokens: float) -> float:
        i, j, w = _segment(self.prefill_tokens, tokens)
        edge = (1 - min(w, 1.0)) * seconds[i] + min(w, 1.0) * seconds[j]
        return max(edge, (1 - w) * seconds[i] + w * seconds[j])

    def covers(self, rows: int, budget: int, kv_len: int) -> bool:
        """Whether the point lies inside the measured grid (no extrapolation)."""
        return (self.rows[0] <= rows <= self.rows[-1] and self.budgets[0] <= budget <= self.budgets[-1]
                and self.kv_lens[0] <= kv_len <= self.kv_lens[-1])

    def table(self) -> list[list[list[float]]]:
        """The seconds as a nested ``[rows][budgets][kv_lens]`` list (e.g. ``torch.tensor(curve.table())``)."""
        nb, nk = len(self.budgets), len(self.kv_lens)
        return [[[self.point(r, b, k) for k in range(nk)] for b in range(nb)] for r in range(len(self.rows))]

    def restricted(self, *, rows: Sequence[int] | None = None, budgets: Sequence[int] | None = None,
                   kv_lens: Sequence[int] | None = None) -> CostCurve:
        """The curve over a sub-grid of its own points (None: the whole axis), e.g. to see what a coarser grid
        would have chosen from the same measurements; a value not on the axis is a :class:`CostCurveError`."""
        picked = []
        for name, axis, want in (("rows", self.rows, rows), ("budgets", self.budgets, budgets),
                                 ("kv_lens", self.kv_lens, kv_lens)):
            want = axis if want is None else tuple(sorted(set(want)))
            missing = [v for v in want if v not in axis]
            if missing:
                raise CostCurveError(f"restricted: {name} {missing} are not on the curve's axis {list(axis)}")
            picked.append([axis.index(v) for v in want])
        ri, bi, ki = picked
        context = self.context_seconds
        if context:
            context = tuple(context[r * len(self.kv_lens) + k] for r in ri for k in ki)
        return replace(
            self, rows=tuple(self.rows[r] for r in ri), budgets=tuple(self.budgets[b] for b in bi),
            kv_lens=tuple(self.kv_lens[k] for k in ki),
            seconds=tuple(self.point(r, b, k) for r in ri for b in bi for k in ki), context_seconds=context)

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
            **({"context_seconds": list(self.context_seconds)} if self.context_seconds else {}),
            **({"prefill_context": self.prefill_context,
                "prefill_context_seconds": list(self.prefill_context_seconds)} if self.prefill_context else {}),
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
                                   "measure_seconds", "prefill_tokens", "prefill_seconds", "context_seconds",
                                   "prefill_context", "prefill_context_seconds"})
        if unknown:
            raise CostCurveError(f"cost curve has unknown fields {unknown}")
        return cls(device=d["device"], model=d["model"], rows=d["rows"], budgets=d["budgets"], kv_lens=d["kv_lens"],
                   seconds=d["seconds"], repeats=d.get("repeats", 1), measure_seconds=d.get("measure_seconds", 0.0),
                   prefill_tokens=d.get("prefill_tokens", ()), prefill_seconds=d.get("prefill_seconds", ()),
                   context_seconds=d.get("context_seconds", ()), prefill_context=d.get("prefill_context", 0),
                   prefill_context_seconds=d.get("prefill_context_seconds", ()))


# Bumped when the engine's rounds change what they cost (so curves cached by an older engine are measured again):
# 2 = the drafter's head in the tree stage over the depths a round's trees reach (git 8f9665a)
# 3 = prefill points through the prefill graphs where the scheduler replays one (cost_measure.measure_cost_curve)
# 4 = prefill points after a context too (CostCurve.prefill_context_seconds)
ROUND_COST_VERSION = 4


def cache_key(device: str, model: str, **extra: Any) -> str:
    """A file-name-safe key for one device and model: a readable slug plus a hash of everything that sets the costs
    (``extra``: dtype, kernels, graphs, the grid...) and of :data:`ROUND_COST_VERSION`, so two configs, or two
    engines whose rounds cost differently, never share a file."""
    canonical = json.dumps({"device": device, "model": model, "rounds": ROUND_COST_VERSION, **extra}, sort_keys=True,
                           default=str)
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


__all__ = ["COST_CURVE_SCHEMA", "CostCurve", "CostCurveError", "cache_key", "cached_curve", "check_axis",
           "default_cache_dir", "load_curve", "make_curve", "save_curve"]
