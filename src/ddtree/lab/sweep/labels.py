"""Config names a person can read: only the settings that vary in the sweep, in the user's words.

A config id (``ddtree-b16-knone-bstrained-wnone``) names every knob so that a directory is unambiguous and resume
finds it; it stays the on-disk name. Tables and plots use a *label* instead::

    method     always (ar, dflash, ddtree)
    b16        the budget of a DDTree config, always
    k=4        the top-k cap, when the sweep varies it (no cap: left out)
    bs=16      the block size, when varied (the drafter's trained size: left out)
    w=2048     the draft window, when varied (the whole context: left out)
    tp=8       an extra launch dimension, when varied

so a sweep over budgets and windows reads ``ar``, ``dflash``, ``dflash w=64``, ``ddtree b16``, ``ddtree b16 w=64``.
A label that would name two configs (impossible for grids built by :class:`SweepConfig`, possible for directories
assembled by hand) falls back to the config id for those configs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

_KNOBS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("topk", "k", ("ddtree",)),
    ("block_size", "bs", ("ddtree", "dflash")),
    ("draft_window", "w", ("ddtree", "dflash")),
)


def _get(point: Any, key: str) -> Any:
    return point.get(key) if isinstance(point, Mapping) else getattr(point, key, None)


def _dims(point: Any) -> dict[str, str]:
    dims = _get(point, "dims") or {}
    return dict(dims) if isinstance(dims, Mapping) else {str(k): str(v) for k, v in dims}


def config_labels(points: Iterable[Any]) -> dict[str, str]:
    """``{config_id: label}`` for points given as :class:`SweepPoint` objects or their ``to_dict()`` mappings."""
    points = list(points)
    varied: dict[str, bool] = {}
    for knob, _, methods in _KNOBS:
        values = {_get(p, knob) for p in points if _get(p, "method") in methods}
        varied[knob] = len(values) > 1
    dim_values: dict[str, set[str]] = {}
    for p in points:
        for name, value in _dims(p).items():
            dim_values.setdefault(name, set()).add(value)
    labels: dict[str, str] = {}
    for p in points:
        method = str(_get(p, "method"))
        parts = [method]
        if method == "ddtree" and _get(p, "budget") is not None:
            parts.append(f"b{_get(p, 'budget')}")
        for knob, short, methods in _KNOBS:
            value = _get(p, knob)
            if method in methods and varied[knob] and value is not None:
                parts.append(f"{short}={value}")
        for name, value in _dims(p).items():
            if len(dim_values.get(name, ())) > 1:
                parts.append(f"{name}={value}")
        labels[str(_get(p, "config_id"))] = " ".join(parts)
    seen: dict[str, int] = {}
    for label in labels.values():
        seen[label] = seen.get(label, 0) + 1
    return {cid: (label if seen[label] == 1 else cid) for cid, label in labels.items()}


__all__ = ["config_labels"]
