"""The lossless gate: a run's outputs against a baseline run's, task by task, each difference classified.

A task is *identical* when its text and reasoning equal the baseline's byte for byte. Every other task is
classified at its first differing token by :func:`ddtree.lab.humaneval.divergence.classify` against the baseline's
top log-probs: a *near-tie* (the two tokens' baseline log-probs within the margin, what bf16 rounding can flip) or
a *real* divergence (a wider gap, a token outside the baseline's top-N, missing data, a failed request). Verdict:
``identical`` (every task), ``near_ties`` (differences, all near-ties: the gate passes with a note) or ``failed``
(at least one real divergence). Real divergences are logged as warnings, one line each. An identical task whose
two runs' log-probs of the same tokens differ by more than the margin is listed in ``drifting`` and logged too
(the verify computes another distribution, although no token has flipped yet); it does not change the verdict,
which is about outputs.

``lossless`` object of a result (schema ``ddtree.eval.humaneval/2``)::

    {"baseline", "compared", "identical", "near_tie", "real", "verdict", "near_tie_margin",
     "differing_tasks": [task_id], "divergences": [{"task_id", "kind", "position", "baseline_token",
     "other_token", "baseline_logprob", "other_logprob", "gap", "margin", "reason", "baseline_next", "other_next", "drift", "drift_position"}],
     "drifting": [{"task_id", "drift", "position"}], "exact": bool (both runs from our engine in exact mode: every
     difference is real)}

Schema ``/1`` results (no token traces, no classification) are still read as baselines: their differing tasks are
then real divergences ("no token trace"), since nothing shows them to be ties.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError
from ddtree.lab.humaneval.divergence import (
    DEFAULT_NEAR_TIE_MARGIN,
    Divergence,
    TokenTrace,
    check_margin,
    classify,
    first_difference,
    log_prob_drift,
)

EVAL_SCHEMA = "ddtree.eval.humaneval/2"
READABLE_SCHEMAS = ("ddtree.eval.humaneval/1", EVAL_SCHEMA)  # /1: the same result without traces or classes

log = logging.getLogger("ddtree.lab.humaneval")


def _failed(task: Mapping[str, Any]) -> bool:
    return str(task.get("reason", "")).startswith("error: ")


def _trace(task: Mapping[str, Any]) -> TokenTrace | None:
    data = task.get("trace")
    return TokenTrace.from_json(data) if isinstance(data, Mapping) else None


def divergence_of(task: Mapping[str, Any], base: Mapping[str, Any], margin: float) -> Divergence | None:
    """None when ``task``'s output equals ``base``'s byte for byte, else the classified difference."""
    same_text = task.get("completion") == base.get("completion") and task.get("reasoning") == base.get("reasoning")
    if not _failed(task) and not _failed(base) and same_text:
        return None
    if _failed(task) or _failed(base):
        which = "this run" if _failed(task) else "the baseline"
        return Divergence("real", None, None, None, None, None, None, margin,
                          f"the request failed in {which}: identity cannot be shown")
    base_trace, trace = _trace(base), _trace(task)
    if base_trace is None or trace is None:
        which = "the baseline" if base_trace is None else "this run"
        return Divergence("real", None, None, None, None, None, None, margin,
                          f"{which} has no token trace (a schema /1 result, or the engine returned no log-probs): "
                          "nothing shows the difference to be a tie")
    return classify(base_trace, trace, margin=margin, texts_differ=True)


def compare_with_baseline(result: Mapping[str, Any], baseline: Path, *,
                          near_tie_margin: float = DEFAULT_NEAR_TIE_MARGIN, exact: bool = False) -> dict[str, Any]:
    """The ``lossless`` object of ``result`` against a baseline run's result JSON (see the module docstring).

    A task missing from the baseline is not compared; one that errored in either run is a real divergence.
    ``exact``: both runs came from our engine in exact mode (``EngineConfig.exact``), whose speculative outputs are
    bit-identical to AR's by construction, so every difference is real, a near-tie too (it is still classified,
    and its reason says what the classifier alone would have called it)."""
    margin = check_margin(near_tie_margin)
    try:
        data = json.loads(Path(baseline).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read baseline {baseline}: {exc}") from exc
    if not isinstance(data, dict) or data.get("schema") not in READABLE_SCHEMAS:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise ConfigError(f"{baseline} is not a humaneval result (schema {schema!r}, want one of "
                          f"{', '.join(READABLE_SCHEMAS)})")
    base = {t["task_id"]: t for t in data.get("tasks", [])}
    compared, identical, differing, divergences, drifting = 0, 0, [], [], []
    for task in result["tasks"]:
        other = base.get(task["task_id"])
        if other is None:
            continue
        compared += 1
        div = divergence_of(task, other, margin)
        if div is None:
            identical += 1
            drift = _identical_drift(task, other)
            if drift is not None and drift[0] > margin:
                drifting.append({"task_id": task["task_id"], "drift": drift[0], "position": drift[1]})
                log.warning("LOG-PROB DRIFT in %s: identical output, but the runs' log-probs of token %d differ by "
                            "%.4g nats (> margin %s): they do not compute the same distribution", task["task_id"],
                            drift[1], drift[0], margin)
            continue
        differing.append(task["task_id"])
        if exact and div.kind != "real":
            div = dataclasses.replace(div, kind="real", reason=f"exact mode: any difference from AR is a bug (the "
                                      f"classifier alone: a near-tie, {div.reason or 'within the margin'})")
        divergences.append({"task_id": task["task_id"], **div.to_json()})
        if div.kind == "real":
            log.warning("%s", div.warning(task["task_id"]))
    real = sum(d["kind"] == "real" for d in divergences)
    near = len(divergences) - real
    verdict = "failed" if real else ("near_ties" if near else "identical")
    return {"baseline": str(baseline), "identical": identical, "compared": compared, "near_tie": near, "real": real,
            "verdict": verdict, "near_tie_margin": margin, "differing_tasks": differing, "divergences": divergences,
            "drifting": drifting, "exact": exact}


def _identical_drift(task: Mapping[str, Any], base: Mapping[str, Any]) -> tuple[float, int] | None:
    """For a byte-identical task: the largest difference of the two runs' log-probs of the same token, and where
    (None without traces, or when the traces' tokens differ: a spelling difference, nothing to measure)."""
    base_trace, trace = _trace(base), _trace(task)
    if base_trace is None or trace is None or first_difference(base_trace, trace) is not None:
        return None
    drift, at = log_prob_drift(base_trace, trace)
    return None if drift is None or at is None else (drift, at)


def warning_lines(lossless: Mapping[str, Any] | None) -> list[str]:
    """One line per classified difference of a ``lossless`` object, real divergences first."""
    if not lossless:
        return []
    lines = []
    for d in sorted(lossless.get("divergences") or [], key=lambda d: d.get("kind") != "real"):
        fields = {k: d.get(k) for k in ("kind", "position", "baseline_token", "other_token", "baseline_logprob",
                                        "other_logprob", "gap", "margin", "reason", "drift", "drift_position")}
        div = Divergence(**fields, baseline_next=tuple(d.get("baseline_next") or ()),
                         other_next=tuple(d.get("other_next") or ()))
        lines.append(div.warning(str(d.get("task_id"))))
    return lines


__all__ = ["EVAL_SCHEMA", "READABLE_SCHEMAS", "compare_with_baseline", "divergence_of", "warning_lines"]
