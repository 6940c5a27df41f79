"""Read a sweep's run directory into plain records the analysis can rank.

Only finished files count: a benchmark cell is read from ``bench/ctx{c}-c{n}.json`` (schema
``ddtree.bench.cell/1``), the gate from ``humaneval.json`` (``ddtree.eval.humaneval/2``, or ``/1`` from before the
divergence classes: its differing tasks are then unclassified); failure records are kept beside them so the report can
say what is missing and why. Configs are ordered as the manifest's grid lists them (baselines first); a directory
without a manifest (results copied by hand) is still readable, with configs in name order.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError
from ddtree.lab.report.latency import Goodput, cell_goodput
from ddtree.lab.sweep.labels import config_labels
from ddtree.lab.sweep.layout import BENCH_SCHEMA, EVAL_SCHEMAS, RunLayout, read_json

_CELL_FILE = re.compile(r"^ctx(\d+)-c(\d+)\.json$")
_TREE_KEYS = ("method", "budget", "topk", "block_size", "draft_window")
DEMO_MODEL_NAME = "ddtree-demo"  # the served name of the embedded demo pair (ddtree.engine's _model_paths)


@dataclass(frozen=True)
class CellResult:
    """One benchmark cell's summary numbers (averaged over repeats, with their spread)."""

    context: int
    concurrency: int
    tok_s: float | None  # aggregate output tokens/s
    tok_s_min: float | None
    tok_s_max: float | None
    tok_s_std: float | None
    runs: int  # repeats behind the spread (1 = no spread measured)
    accept_length: float | None
    decode_tok_s: float | None  # per-request decode speed (mean)
    ttft_s: float | None
    itl_p50_s: float | None
    errors: int
    # latency percentiles in seconds: {"ttft": {50: .., 90: .., 99: ..}, "itl": ..., "tpot": ..., "e2e": ...}
    latency: dict[str, dict[int, float | None]] = field(default_factory=dict)
    accept_source: str | None = None  # per_request, prometheus or server_info
    spec_fields: str | None = None  # where per-request stats sat: ddtree, meta_info, sglext
    accept_by_depth: tuple[float, ...] = ()  # P(accepted drafts >= d), d = 1, 2, ...
    depth_source: str | None = None
    goodput: Goodput | None = None  # with an SLO only

    @classmethod
    def from_json(cls, data: dict[str, Any], context: int, concurrency: int,
                  slo: Mapping[str, float] | None = None) -> CellResult:
        summary = data.get("summary") or {}
        spread = summary.get("output_tok_s_spread") or {}
        runs = int(spread.get("n") or len(data.get("runs") or []) or 1)
        latency = {name: {q: _num(summary.get(f"{name}_s_p{q}")) for q in (50, 90, 99)}
                   for name in ("ttft", "itl", "tpot", "e2e")}
        depth = summary.get("accept_by_depth")
        return cls(
            context=context,
            concurrency=concurrency,
            tok_s=_num(summary.get("output_tok_s")),
            tok_s_min=_num(spread.get("min")),
            tok_s_max=_num(spread.get("max")),
            tok_s_std=_num(spread.get("std")),
            runs=runs,
            accept_length=_num(summary.get("accept_length")),
            decode_tok_s=_num(summary.get("decode_tok_s_mean")),
            ttft_s=_num(summary.get("ttft_s_mean")),
            itl_p50_s=_num(summary.get("itl_s_p50")),
            errors=int(summary.get("errors") or 0),
            latency=latency,
            accept_source=summary.get("accept_source"),
            spec_fields=summary.get("spec_fields"),
            accept_by_depth=tuple(float(v) for v in depth) if isinstance(depth, list) else (),
            depth_source=summary.get("depth_source"),
            goodput=cell_goodput(data.get("runs") or [], slo) if slo else None,
        )


@dataclass(frozen=True)
class GateResult:
    passed: int
    total: int
    truncated: int
    wrong: int
    errors: int
    truncated_tasks: tuple[str, ...]
    wrong_tasks: tuple[str, ...]
    lossless_identical: int | None  # None: no baseline compared (the AR config itself, or AR's gate missing)
    lossless_compared: int | None
    differing_tasks: tuple[str, ...]
    # the differing tasks classified at their first differing token (ddtree.lab.humaneval.divergence); None when
    # the result predates the classes (schema /1) or nothing was compared
    near_tie: int | None = None
    real: int | None = None
    real_tasks: tuple[str, ...] = ()
    near_tie_tasks: tuple[str, ...] = ()
    near_tie_margin: float | None = None
    drifting_tasks: tuple[str, ...] = ()  # identical outputs whose runs' log-probs drifted past the margin

    @property
    def lossless(self) -> bool | None:
        """Byte-identical to the baseline on every compared task (None: nothing compared)."""
        if self.lossless_compared is None or self.lossless_compared == 0:
            return None
        return self.lossless_identical == self.lossless_compared

    @property
    def verdict(self) -> str | None:
        """``identical``; ``near_ties`` (differences, all numeric near-ties: passes with a note); ``failed`` (a
        real divergence); ``unclassified`` (differences without classes: a schema /1 result, counted as failing
        since nothing shows them to be ties); None when nothing was compared."""
        if self.lossless is None:
            return None
        if self.lossless:
            return "identical"
        if self.real is None:
            return "unclassified"
        return "failed" if self.real else "near_ties"

    @property
    def passes(self) -> bool | None:
        """Whether the lossless gate passes (identical or near-ties only); None when nothing was compared."""
        verdict = self.verdict
        return None if verdict is None else verdict in ("identical", "near_ties")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GateResult:
        tasks = data.get("tasks") or []
        truncated = tuple(t["task_id"] for t in tasks if not t.get("passed") and _is_truncation(t))
        wrong = tuple(t["task_id"] for t in tasks if not t.get("passed") and not _is_truncation(t))
        lossless = data.get("lossless") or None
        return cls(
            passed=int(data.get("passed", 0)),
            total=int(data.get("total", len(tasks))),
            truncated=int(data.get("truncated", len(truncated))),
            wrong=int(data.get("wrong", len(wrong))),
            errors=int(data.get("errors", 0) or 0),
            truncated_tasks=truncated,
            wrong_tasks=wrong,
            lossless_identical=None if lossless is None else int(lossless.get("identical", 0)),
            lossless_compared=None if lossless is None else int(lossless.get("compared", 0)),
            differing_tasks=tuple(lossless.get("differing_tasks") or ()) if lossless else (),
            **_classes(lossless),
        )


def _classes(lossless: Mapping[str, Any] | None) -> dict[str, Any]:
    """GateResult's divergence fields from a ``lossless`` object (empty for one without classes)."""
    if not lossless or "real" not in lossless:
        return {}
    divergences = [d for d in lossless.get("divergences") or [] if isinstance(d, Mapping)]
    margin = lossless.get("near_tie_margin")
    return {"near_tie": int(lossless.get("near_tie") or 0), "real": int(lossless.get("real") or 0),
            "real_tasks": tuple(str(d.get("task_id")) for d in divergences if d.get("kind") == "real"),
            "near_tie_tasks": tuple(str(d.get("task_id")) for d in divergences if d.get("kind") == "near_tie"),
            "near_tie_margin": float(margin) if isinstance(margin, (int, float)) else None,
            "drifting_tasks": tuple(str(d.get("task_id")) for d in lossless.get("drifting") or []
                                    if isinstance(d, Mapping))}


def _is_truncation(task: dict[str, Any]) -> bool:
    return task.get("finish_reason") == "length" or task.get("reason") == "truncated"


@dataclass
class ConfigResult:
    """Everything measured for one config."""

    config_id: str
    settings: dict[str, Any]  # method, budget, topk, block_size, draft_window, dims
    cells: dict[tuple[int, int], CellResult] = field(default_factory=dict)
    gate: GateResult | None = None
    failures: dict[str, Any] = field(default_factory=dict)
    launch: dict[str, Any] | None = None  # the launcher's record (load-to-ready time...)

    @property
    def method(self) -> str:
        return str(self.settings.get("method", "?"))

    @property
    def dims(self) -> dict[str, str]:
        return dict(self.settings.get("dims") or {})

    def cell(self, context: int, concurrency: int) -> CellResult | None:
        return self.cells.get((context, concurrency))

    def tok_s(self, context: int, concurrency: int) -> float | None:
        cell = self.cell(context, concurrency)
        return cell.tok_s if cell else None

    @property
    def accept_length(self) -> float | None:
        """Mean acceptance length over the config's cells (under greedy decoding it depends on the text, not on
        concurrency, so the mean is the config's acceptance)."""
        values = [c.accept_length for c in self.cells.values() if c.accept_length is not None]
        return sum(values) / len(values) if values else None

    @property
    def accept_by_depth(self) -> tuple[float, ...]:
        """The cells' depth curves averaged position by position (like :attr:`accept_length`)."""
        curves = [c.accept_by_depth for c in self.cells.values() if c.accept_by_depth]
        width = max((len(c) for c in curves), default=0)
        return tuple(sum(c[i] if i < len(c) else 0.0 for c in curves) / len(curves) for i in range(width))

    @property
    def accept_sources(self) -> str:
        """Which sources gave this config's acceptance (``per_request (meta_info)``, ``prometheus``, ...)."""
        seen = dict.fromkeys(
            f"{c.accept_source} ({c.spec_fields})" if c.spec_fields and c.accept_source == "per_request"
            else str(c.accept_source)
            for c in self.cells.values() if c.accept_source
        )
        return ", ".join(seen) or "-"


@dataclass
class RunResults:
    root: Path
    manifest: dict[str, Any] | None
    configs: list[ConfigResult]
    contexts: list[int]
    concurrency: list[int]
    slo: dict[str, float] | None = None
    labels: dict[str, str] = field(default_factory=dict)  # config_id -> readable label (sweep.labels)
    trained_block_size: int | None = None  # the drafter's, when the run recorded it
    demo_pair: bool = False  # measured on the embedded demo pair

    def label(self, config_id: str) -> str:
        return self.labels.get(config_id, config_id)

    def by_id(self, config_id: str) -> ConfigResult | None:
        return next((c for c in self.configs if c.config_id == config_id), None)

    def baseline(self, method: str, dims: dict[str, str]) -> list[ConfigResult]:
        """Configs of ``method`` measured with the same extra dimensions (AR for ``tp=8`` is AR-tp8)."""
        return [c for c in self.configs if c.method == method and c.dims == dims]

    @property
    def output_tokens(self) -> int | None:
        grid = (self.manifest or {}).get("grid") or {}
        return grid.get("output_tokens")


def load_run(root: str | Path, *, slo: Mapping[str, float] | None = None) -> RunResults:
    """Read every finished cell, gate result and failure record under ``root``; ``slo`` (else the one the sweep
    stored in its manifest) adds goodput to every cell."""
    layout = RunLayout(Path(root))
    if not layout.root.is_dir():
        raise ConfigError(f"{layout.root} is not a directory; give the run directory a sweep wrote (results/<run>)")
    manifest = read_json(layout.manifest_path)
    manifest = manifest if isinstance(manifest, dict) else None
    slo = dict(slo) if slo else ((manifest or {}).get("slo") or None)
    points: dict[str, dict[str, Any]] = {}
    for point in (manifest or {}).get("points") or []:
        points[point["config_id"]] = point
    order = list(points) + [cid for cid in layout.config_ids() if cid not in points]
    if not order:
        raise ConfigError(f"{layout.root} holds no configs/ results; run `ddtree sweep` first")
    configs = []
    trained: int | None = None
    models: set[str] = set()
    for config_id in order:
        config_json = read_json(layout.config_path(config_id)) or {}
        settings = points.get(config_id) or config_json.get("point") or {"method": config_id.split("-")[0]}
        result = ConfigResult(
            config_id=config_id,
            settings={k: settings.get(k) for k in (*_TREE_KEYS, "dims")},
            failures=layout.failures(config_id),
            launch=config_json.get("launch"),
        )
        bench_dir = layout.config_dir(config_id) / "bench"
        if bench_dir.is_dir():
            for path in sorted(bench_dir.iterdir()):
                match = _CELL_FILE.match(path.name)
                data = read_json(path) if match else None
                if match and isinstance(data, dict) and data.get("schema") == BENCH_SCHEMA:
                    ctx, conc = int(match.group(1)), int(match.group(2))
                    result.cells[(ctx, conc)] = CellResult.from_json(data, ctx, conc, slo)
                    env = data.get("env") or {}
                    models.add(str(env.get("model")))
                    limits = ((env.get("server_info") or {}).get("engine") or {}).get("limits") or {}
                    if isinstance(limits.get("trained_block_size"), int):
                        trained = limits["trained_block_size"]
        gate = read_json(layout.eval_path(config_id))
        if isinstance(gate, dict) and gate.get("schema") in EVAL_SCHEMAS:
            result.gate = GateResult.from_json(gate)
        configs.append(result)
    grid = (manifest or {}).get("grid") or {}
    contexts = sorted(set(grid.get("contexts") or []) | {k[0] for c in configs for k in c.cells})
    concurrency = sorted(set(grid.get("concurrency") or []) | {k[1] for c in configs for k in c.cells})
    profile = grid.get("profile") or {}
    if trained is None and isinstance(profile.get("trained_block_size"), int):
        trained = profile["trained_block_size"]
    engine_config = ((manifest or {}).get("target") or {}).get("engine_config") or {}
    demo = (models == {DEMO_MODEL_NAME}) or (
        bool(engine_config) and engine_config.get("target") is None and not models - {DEMO_MODEL_NAME})
    labels = config_labels([{"config_id": c.config_id, **c.settings} for c in configs])
    return RunResults(layout.root, manifest, configs, contexts, concurrency, slo=slo, labels=labels,
                      trained_block_size=trained, demo_pair=demo)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


__all__ = ["CellResult", "ConfigResult", "GateResult", "RunResults", "load_run"]
