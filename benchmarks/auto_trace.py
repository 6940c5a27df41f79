"""Budget auto's predictions against what its rounds committed, traced on a running engine (auto_ab.py ``--trace``).

Why: at 32 in flight on the H100 auto ran b15 in 35-45 % of its row-rounds for 7-9 % more tokens a round at 12-13 %
more round time (docs/benchmarks.md, "The cost curve's grid"), so what it expected of b15 against b7 was not what
b15 gave. A greedy round that verified ``N`` draft nodes tells exactly what every candidate up to ``N`` would have
committed (best-first order is prefix-closed: :func:`ddtree.engine.auto_budget.observed_update`), so each traced
round compares, over the same rows, the chooser's expected lengths ``E(c)`` at the choice with those committed
counterfactuals, for every candidate ``c`` up to the round's size.

:class:`AutoTrace` wraps, on one engine, the chooser's ``choose`` (the rows' curves and the cost of each option at
the choice), ``_queue`` (a round queued just after a choice carries it) and ``read_row`` (each read row's realized
lengths). Records, one per read auto round: ``size``, ``best``, ``rows`` (auto rows read), ``cost_ms`` (per option,
the non-decreasing cost the chooser divided by), ``pred`` and ``real`` (per candidate up to ``size``: the summed
``E(c)`` and committed counterfactuals of the rows read), ``pred_all`` (per option: the summed ``E`` of every row
at the choice), ``stages_ms`` (the round's device stages). :func:`summary` aggregates them per size.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from ddtree.engine import auto_budget


class AutoTrace:
    """Installed on ``engine`` while in a ``with`` block; ``records`` holds one dict per read auto round."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.records: list[dict] = []
        self._choice: dict | None = None  # the last choice made, until a round is queued with it
        self._by_seq: dict[int, dict] = {}  # queued rounds' choices, until they are read
        self._reading: dict | None = None

    def __enter__(self) -> AutoTrace:
        eng, chooser = self.engine, self.engine._auto
        real_choose, real_queue, real_collect, real_read = eng._auto.choose, eng._queue, eng._collect, chooser.read_row

        def choose(states, cost, *, explore=True):
            size, best = real_choose(states, cost, explore=explore)
            auto = [s for s in states if s.tree.auto]
            fixed = [s for s in states if not s.tree.auto]
            opts = auto_budget.options(chooser.candidates, max((s.budget for s in fixed), default=0))
            up = auto_budget.rising(cost, opts)
            curves = {s.request_id: chooser.row_curve(s) for s in auto}
            have = [c for c in curves.values() if c]
            prior = auto_budget.mean_curve(have)
            rows = {rid: auto_budget.RowCurve(c or prior) for rid, c in curves.items()}
            self._choice = {"size": size, "best": best, "explore": explore, "rows": rows,
                            "cost_ms": {b: round(up(b) * 1e3, 3) for b in opts},
                            "offset_ms": round(chooser.offset() * 1e3, 3),
                            "pred_all": {b: round(sum(r.expected(b) for r in rows.values()), 3) for b in opts}}
            return size, best

        def queue(states, rows, shape, *args, **kwargs):
            flight = real_queue(states, rows, shape, *args, **kwargs)
            if shape.auto_width and self._choice is not None and self._choice["size"] == shape.max_budget:
                self._by_seq[flight.seq] = self._choice
            self._choice = None
            return flight

        def collect(flight):
            choice = self._by_seq.pop(flight.seq, None)
            if choice is None:
                return real_collect(flight)
            cands = [c for c in chooser.candidates if c <= choice["size"]]
            self._reading = {"choice": choice, "cands": cands, "pred": defaultdict(float),
                             "real": defaultdict(float), "n": 0}
            before = sum(eng._counters.stage_seconds_total.values())
            try:
                return real_collect(flight)
            finally:
                r, self._reading = self._reading, None
                self.records.append({
                    "t": time.perf_counter(), "size": choice["size"], "best": choice["best"], "rows": r["n"],
                    "batch": len(flight.states), "cost_ms": choice["cost_ms"], "offset_ms": choice["offset_ms"],
                    "pred_all": choice["pred_all"],
                    "pred": {c: round(r["pred"][c], 3) for c in cands},
                    "real": {c: round(r["real"][c], 3) for c in cands},
                    "stages_ms": round((sum(eng._counters.stage_seconds_total.values()) - before) * 1e3, 3)})

        def read_row(state, committed, reported, path, verified):
            r = self._reading
            if r is not None and state.tree.auto and state.request_id in r["choice"]["rows"]:
                row = r["choice"]["rows"][state.request_id]
                ranks = list(path[1:committed])
                r["n"] += 1
                for c in r["cands"]:
                    if c <= verified:
                        r["pred"][c] += row.expected(c)
                        r["real"][c] += 1 + sum(1 for k in ranks if k <= c)
            return real_read(state, committed, reported, path, verified)

        self._undo = [(chooser, "choose"), (eng, "_queue"), (eng, "_collect"), (chooser, "read_row")]
        chooser.choose, eng._queue, eng._collect, chooser.read_row = choose, queue, collect, read_row
        return self

    def __exit__(self, *exc) -> None:
        for obj, name in self._undo:
            obj.__dict__.pop(name, None)  # the instance attributes set above; the class's methods show again


def summary(records: list[dict]) -> dict:
    """Per round size: rounds, row-rounds, and over those rounds' rows the summed predicted and committed ``E`` of
    each candidate up to it (their ratio: how far the chooser's expectation was from what the tree gave), the mean
    stage time and the mean predicted cost of the size; ``E_choice`` and ``T_choice``: per option, the mean ``E`` of
    a row of the batch and the curve's cost at those rounds' choices (the chooser added ``offset_ms`` to it)."""
    out: dict[int, dict] = {}
    for rec in records:
        s = out.setdefault(rec["size"], {"rounds": 0, "row_rounds": 0, "pred": defaultdict(float),
                                         "real": defaultdict(float), "stages_ms": 0.0, "cost_ms": 0.0,
                                         "all": defaultdict(float), "batch": 0, "cost": defaultdict(float),
                                         "offset_ms": 0.0})
        s["rounds"] += 1
        s["offset_ms"] += rec["offset_ms"]
        s["batch"] += rec["batch"]
        for b, v in rec["pred_all"].items():
            s["all"][b] += v
            s["cost"][b] += rec["cost_ms"][b]
        s["row_rounds"] += rec["rows"]
        s["stages_ms"] += rec["stages_ms"]
        s["cost_ms"] += rec["cost_ms"].get(rec["size"], 0.0)
        for c, v in rec["pred"].items():
            s["pred"][c] += v
            s["real"][c] += rec["real"][c]
    return {size: {"rounds": s["rounds"], "row_rounds": s["row_rounds"],
                   "stages_ms": round(s["stages_ms"] / s["rounds"], 3), "cost_ms": round(s["cost_ms"] / s["rounds"], 3),
                   "E_pred": {c: round(v / max(s["row_rounds"], 1), 3) for c, v in s["pred"].items()},
                   "E_real": {c: round(v / max(s["row_rounds"], 1), 3) for c, v in s["real"].items()},
                   "E_choice": {b: round(v / max(s["batch"], 1), 3) for b, v in s["all"].items()},
                   "T_choice": {b: round(v / s["rounds"], 3) for b, v in s["cost"].items()},
                   "offset_ms": round(s["offset_ms"] / s["rounds"], 3)}
            for size, s in sorted(out.items())}
