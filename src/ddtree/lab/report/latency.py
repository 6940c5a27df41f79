"""Latency limits (SLOs), goodput, and the Pareto front of per-user against total throughput.

SLO keys (milliseconds; a request *meets* the SLO when it is within every limit given)

``ttft_ms``
    time to first token;
``itl_ms``
    the request's mean inter-token latency after the first token, ``(latency - TTFT) / (tokens - 1)`` (vLLM's
    TPOT, which its ``--goodput tpot:`` limit checks; per-token gaps of a speculative stream are bursty by nature,
    so a per-gap limit would fail every request that ever waited for a verify round);
``e2e_ms``
    end-to-end latency.

Goodput of a run = requests that met the SLO (and did not fail) / run duration, in requests per second; a cell's
goodput is the mean over its repeats, with their min and max as the spread. A request with one token has no
inter-token latency and meets ``itl_ms`` trivially.

Pareto front (one per context length): each (config, concurrency) cell is a point with *tok/s per user* (the
mean per-request decode speed, 1 / TPOT) on one axis and *total tok/s* on the other; a point is on the front when
no other point is at least as good on both axes and better on one. Worked example: points (10, 100), (20, 80),
(15, 70), (5, 120) -> front (5, 120), (10, 100), (20, 80); (15, 70) is beaten by (20, 80) on both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SLO_KEYS: tuple[str, ...] = ("ttft_ms", "itl_ms", "e2e_ms")


def meets_slo(request: Mapping[str, Any], slo: Mapping[str, float]) -> bool:
    """Whether one request record (``ddtree.bench.cell/1`` ``runs[].requests[]``) met every limit in ``slo``."""
    if request.get("error") is not None:
        return False
    ttft, latency, tokens = request.get("ttft_s"), request.get("latency_s"), request.get("completion_tokens") or 0
    if "ttft_ms" in slo and (ttft is None or 1000.0 * ttft > slo["ttft_ms"]):
        return False
    if "e2e_ms" in slo and (latency is None or 1000.0 * latency > slo["e2e_ms"]):
        return False
    if "itl_ms" in slo and tokens > 1:
        if ttft is None or latency is None or 1000.0 * (latency - ttft) / (tokens - 1) > slo["itl_ms"]:
            return False
    return True


def run_goodput(run: Mapping[str, Any], slo: Mapping[str, float]) -> float | None:
    """Requests per second meeting ``slo`` in one run; ``None`` without a duration."""
    duration = (run.get("summary") or {}).get("duration_s")
    if not isinstance(duration, (int, float)) or duration <= 0:
        return None
    good = sum(1 for r in run.get("requests") or [] if meets_slo(r, slo))
    return good / duration


@dataclass(frozen=True)
class Goodput:
    mean: float
    min: float
    max: float
    met: int  # requests that met the SLO, over every run
    total: int  # requests, over every run

    @property
    def share(self) -> float:
        return self.met / self.total if self.total else 0.0


def cell_goodput(runs: Sequence[Mapping[str, Any]], slo: Mapping[str, float]) -> Goodput | None:
    """A cell's goodput over its repeats (``None`` when no run has a duration)."""
    values = [g for run in runs if (g := run_goodput(run, slo)) is not None]
    if not values:
        return None
    requests = [r for run in runs for r in run.get("requests") or []]
    met = sum(1 for r in requests if meets_slo(r, slo))
    return Goodput(sum(values) / len(values), min(values), max(values), met, len(requests))


def describe_slo(slo: Mapping[str, float]) -> str:
    names = {"ttft_ms": "TTFT", "itl_ms": "ITL (per-request mean)", "e2e_ms": "end-to-end"}
    return ", ".join(f"{names[k]} <= {v:g} ms" for k, v in slo.items())


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (higher is better on both axes), by the first axis."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (ox >= x and oy >= y) and (ox > x or oy > y) for j, (ox, oy) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: (points[i][0], -points[i][1]))


__all__ = ["SLO_KEYS", "Goodput", "cell_goodput", "describe_slo", "meets_slo", "pareto_front", "run_goodput"]
