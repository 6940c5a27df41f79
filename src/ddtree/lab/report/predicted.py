"""Predicted beside measured: ``ddtree replay predict --run`` writes ``predicted.json`` into a run directory, and
the report puts each predicted cell next to the one the sweep measured, with the error.

A predicted setting (``ddtree.replay.tok_s/1``: method, budget, top-k, at the trace's block size and draft window)
matches a run's config when the method, budget and top-k are equal and the config's block size (None = the
drafter's trained size) and draft window are the trace's. Error = (predicted - measured) / measured, in percent:
positive when replay promised more than the engine delivered.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree.lab.report.collect import ConfigResult, RunResults
from ddtree.lab.sweep.layout import read_json

log = logging.getLogger(__name__)

PREDICTED_FILE = "predicted.json"  # written by `ddtree replay predict --run` (ddtree.lab.replay.throughput)
TOK_S_SCHEMA = "ddtree.replay.tok_s/1"


@dataclass(frozen=True)
class PredictedCell:
    config_id: str
    context: int
    concurrency: int
    predicted: float  # tok/s
    measured: float | None  # tok/s, None when the sweep has no such cell
    extrapolated: bool  # the prediction read the cost curve outside its grid

    @property
    def error_pct(self) -> float | None:
        if self.measured is None or self.measured <= 0:
            return None
        return (self.predicted - self.measured) / self.measured * 100.0


@dataclass(frozen=True)
class Predicted:
    cells: list[PredictedCell]
    curve: dict[str, Any]  # the cost curve's device, model and grid
    model: str  # the prediction's model, as the file states it
    prefill_modelled: bool

    @property
    def compared(self) -> list[PredictedCell]:
        return [c for c in self.cells if c.error_pct is not None]

    def mean_abs_error_pct(self) -> float | None:
        errs = [abs(c.error_pct) for c in self.compared if c.error_pct is not None]
        return sum(errs) / len(errs) if errs else None


def _matches(cfg: ConfigResult, cell: Mapping[str, Any], trace: Mapping[str, Any], trained: int | None) -> bool:
    s = cfg.settings
    if s.get("dims") or s.get("method") != cell.get("method"):
        return False
    if cell.get("method") == "ddtree" and (s.get("budget") != cell.get("budget") or s.get("topk") != cell.get("topk")):
        return False
    if cell.get("method") == "ar":
        return True
    block = s.get("block_size") if s.get("block_size") is not None else trained
    if block is not None and trace.get("block_size") is not None and block != trace.get("block_size"):
        return False
    return s.get("draft_window") == trace.get("draft_window")


def load_predicted(results: RunResults, path: Path | None = None) -> Predicted | None:
    """The run's ``predicted.json`` (or ``path``) matched to its configs; None when there is none or it is not a
    ``ddtree.replay.tok_s/1`` file (logged)."""
    file = Path(path) if path is not None else results.root / PREDICTED_FILE
    data = read_json(file) if file.exists() else None
    if data is None:
        return None
    if not isinstance(data, dict) or data.get("schema") != TOK_S_SCHEMA:
        log.warning("%s is not a %s file; the report leaves predictions out", file, TOK_S_SCHEMA)
        return None
    trace = data.get("trace") or {}
    cells = []
    for cell in data.get("cells") or []:
        if not isinstance(cell, Mapping):
            continue
        tok_s = cell.get("tok_s")
        if isinstance(tok_s, bool) or not isinstance(tok_s, (int, float)) or not math.isfinite(tok_s):
            continue
        ctx, conc = int(cell.get("context", -1)), int(cell.get("concurrency", -1))
        for cfg in results.configs:
            if _matches(cfg, cell, trace, results.trained_block_size):
                cells.append(PredictedCell(cfg.config_id, ctx, conc, float(tok_s), cfg.tok_s(ctx, conc),
                                           bool(cell.get("extrapolated"))))
    order = {c.config_id: i for i, c in enumerate(results.configs)}
    cells.sort(key=lambda c: (order.get(c.config_id, 1 << 30), c.context, c.concurrency))
    return Predicted(cells, dict(data.get("cost_curve") or {}), str(data.get("model") or ""),
                     bool(data.get("prefill_modelled")))


__all__ = ["PREDICTED_FILE", "Predicted", "PredictedCell", "load_predicted"]
