"""Prometheus metrics for one server, in a registry of its own.

The engine already keeps exact cumulative counters (:meth:`Engine.snapshot`), so most families are read from one
snapshot per scrape by a custom collector instead of being counted a second time here; the scrape is then
consistent (every number from the same instant) and cannot drift from the engine's own totals. The server adds
what only it sees: requests it refused before they reached the engine, and per-request latency histograms.

Names follow SGLang's (``sglang:spec_accept_length``, ``sglang:num_running_reqs``, ...) under our own prefix, so
dashboards built for SGLang need only the prefix changed:

==========================================  =========  ==================================================
``ddtree:requests_total{outcome}``          counter    engine finish reasons (stop, length, cancelled,
                                                       error) and refusals (invalid, not_found,
                                                       queue_full, unavailable, too_large: 413,
                                                       unauthorized: 401/403)
``ddtree:prompt_tokens_total``              counter    prompt tokens of admitted requests
``ddtree:generation_tokens_total``          counter    completion tokens
``ddtree:spec_verify_calls_total``          counter    verify rounds (target forwards over a tree)
``ddtree:spec_accept_length``               gauge      completion tokens per verify round since start
``ddtree:spec_accept_length_per_round``     histogram  tokens committed by each round (bonus included)
``ddtree:num_running_reqs``                 gauge      requests holding a KV slot
``ddtree:num_queue_reqs``                   gauge      requests waiting for a slot (the server's queue
                                                       and the engine's)
``ddtree:num_queue_tokens``                 gauge      prompt + max_tokens of the server's queue
``ddtree:max_running_reqs``                 gauge      KV slots
``ddtree:kv_tokens_used`` / ``_capacity``   gauge      KV cache positions in use / allocated
``ddtree:token_usage``                      gauge      kv_tokens_used / kv_tokens_capacity
``ddtree:stage_seconds_total{stage}``       counter    engine time per stage (draft, tree, verify, ...)
``ddtree:time_to_first_token_seconds``      histogram  per request, from the engine's statistics
``ddtree:e2e_request_latency_seconds``      histogram  per request, from the engine's statistics
==========================================  =========  ==================================================
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ddtree.engine.api import RequestStats

PREFIX = "ddtree:"
REFUSALS: tuple[str, ...] = ("invalid", "not_found", "queue_full", "unavailable", "too_large", "unauthorized")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    """Reads one engine snapshot per scrape. ``engine_fn`` returns None while the engine is still loading."""

    def __init__(self, engine_fn: Callable[[], Any], queue_fn: Callable[[], tuple[int, int]],
                 refusals: dict[str, int], lock: threading.Lock) -> None:
        self._engine_fn = engine_fn
        self._queue_fn = queue_fn
        self._refusals = refusals
        self._lock = lock

    def describe(self) -> Iterator[Metric]:
        # Names only, so registering does not need a live engine.
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        engine = self._engine_fn()
        yield from self._families(None if engine is None else engine.snapshot())

    def _families(self, snap: Any) -> Iterator[Metric]:
        requests = CounterMetricFamily(PREFIX + "requests", "Requests by outcome.", labels=["outcome"])
        with self._lock:
            refusals = dict(self._refusals)
        finished = {} if snap is None else dict(snap.requests_total)
        for outcome in ("stop", "length", "cancelled", "error"):
            finished.setdefault(outcome, 0)
        for outcome, count in sorted({**finished, **refusals}.items()):
            requests.add_metric([outcome], count)
        yield requests

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        get = (lambda name: 0) if snap is None else (lambda name: getattr(snap, name))
        yield counter("prompt_tokens", "Prompt tokens of admitted requests.", get("prompt_tokens_total"))
        yield counter("generation_tokens", "Completion tokens generated.", get("generation_tokens_total"))
        yield counter("spec_verify_calls", "Verify rounds (one target pass each).", get("verify_rounds_total"))

        hist = [] if snap is None else list(snap.accept_hist)
        rounds = sum(hist)
        committed = sum(k * c for k, c in enumerate(hist))
        generated, verified = get("generation_tokens_total"), get("verify_rounds_total")
        yield gauge("spec_accept_length", "Completion tokens per verify round since start (SGLang's definition).",
                    generated / verified if verified else 0.0)
        buckets: list[tuple[str, float]] = []
        cumulative = hist[0] if hist else 0
        for k in range(1, max(len(hist), 2)):
            cumulative += hist[k] if k < len(hist) else 0
            buckets.append((str(float(k)), cumulative))
        buckets.append(("+Inf", rounds))
        yield HistogramMetricFamily(PREFIX + "spec_accept_length_per_round",
                                    "Tokens committed by each verify round (bonus included).",
                                    buckets=buckets, sum_value=committed)

        yield gauge("num_running_reqs", "Requests holding a KV slot.", get("running"))
        server_queued, server_tokens = self._queue_fn()
        yield gauge("num_queue_reqs", "Requests waiting for a KV slot.", get("queued") + server_queued)
        yield gauge("num_queue_tokens", "Prompt + max_tokens of the requests in the server's queue.", server_tokens)
        yield gauge("max_running_reqs", "KV slots (the engine's max batch).", get("max_batch"))
        used, capacity = get("kv_tokens_used"), get("kv_tokens_capacity")
        yield gauge("kv_tokens_used", "KV cache positions in use.", used)
        yield gauge("kv_tokens_capacity", "KV cache positions allocated.", capacity)
        yield gauge("token_usage", "Fraction of the KV cache in use.", used / capacity if capacity else 0.0)

        stages = CounterMetricFamily(PREFIX + "stage_seconds", "Engine time per stage.", labels=["stage"])
        for stage, seconds in sorted(({} if snap is None else snap.stage_seconds_total).items()):
            stages.add_metric([stage], seconds)
        yield stages


class ServerMetrics:
    """The registry behind ``GET /metrics`` plus the two things the server counts itself."""

    def __init__(self, engine_fn: Callable[[], Any], queue_fn: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        """``queue_fn``: (requests, tokens) waiting in the server's admission queue."""
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._refusals: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        self.registry.register(_EngineCollector(engine_fn, queue_fn, self._refusals, self._lock))
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token per request.",
                               buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end latency per request.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)

    def refused(self, outcome: str) -> None:
        """Count a request answered with an error before (or instead of) running in the engine."""
        with self._lock:
            self._refusals[outcome] = self._refusals.get(outcome, 0) + 1

    def finished(self, stats: RequestStats) -> None:
        if stats.ttft_s is not None:
            self._ttft.observe(stats.ttft_s)
        if stats.latency_s is not None:
            self._e2e.observe(stats.latency_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
