"""Prometheus metrics for one server, in a registry of its own.

The engine already keeps exact cumulative counters (:meth:`Engine.snapshot`), so most families are read from one
snapshot per scrape by a custom collector instead of being counted a second time here; the scrape is then
consistent (every number from the same instant) and cannot drift from the engine's own totals. The server adds
what only it sees: requests it refused before they reached the engine, and per-request latency histograms.

Names follow SGLang's (``sglang:spec_accept_length``, ``sglang:num_running_reqs``, ...) under our own prefix, so
dashboards built for SGLang need only the prefix changed. Every family has a ``model_name`` label (the served
model, as vLLM and SGLang label theirs; empty while the engine loads):

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
``ddtree:inter_token_latency_seconds``      histogram  gap between two chunks of one request that carry
                                                       tokens, as the server receives them (one round's
                                                       tokens arrive together: one gap per round)
``ddtree:time_per_output_token_seconds``    histogram  per request: (latency - TTFT) / (completion - 1)
``ddtree:spec_accept_rate``                 gauge      accepted / proposed draft tokens (SGLang's
                                                       definition) over the finished requests
``ddtree:auto_budget_chosen``               histogram  the budget each round of a ``budget: "auto"``
                                                       request chose, one sample per round (buckets: the
                                                       node buckets 1, 2, 3, 4, 7, 8, ... 512; 0: no tree)
==========================================  =========  ==================================================

vLLM's speculative counters, under vLLM's own names (exported with ``_total``) so vLLM dashboards and
``vllm bench serve`` read our acceptance; counted when a speculating (non-``ar``) request finishes, from its
statistics (:mod:`ddtree.server.spec_stats` says what a draft is for a tree):

===================================================  ===================================================
``vllm:spec_decode_num_drafts``                      verify rounds of speculating requests
``vllm:spec_decode_num_draft_tokens``                draft tokens verified (budget per ddtree round,
                                                     block_size - 1 per chain round)
``vllm:spec_decode_num_accepted_tokens``             draft tokens accepted (bonus excluded)
``vllm:spec_decode_num_accepted_tokens_per_pos``     rounds that accepted draft position ``position``
===================================================  ===================================================

So ``1 + accepted / drafts`` is vLLM's mean acceptance length, and ``accepted_per_pos / drafts`` its acceptance by
position.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ddtree.engine.api import RequestStats
from ddtree.server.spec_stats import accepted_per_position, spec_counts

PREFIX = "ddtree:"
REFUSALS: tuple[str, ...] = ("invalid", "not_found", "queue_full", "unavailable", "too_large", "unauthorized")
# Tokens committed by one verify round: one bucket per count up to 32 (a DFlash block of 16 commits at most 16;
# past 32 only +Inf counts). Fixed, so every scrape has the same buckets: Prometheus and AIPerf expect a schema
# that does not change between scrapes (AIPerf ignored the buckets that appeared later).
_ACCEPT_BUCKETS = tuple(range(1, 33))
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                  10.0)
# budget "auto": its candidates are 2^k - 1, a fixed row's floor any budget; the node buckets (ddtree.engine.cuda_graphs)
_AUTO_BUCKETS = tuple(sorted({0} | {(1 << k) - 1 for k in range(1, 10)} | {1 << k for k in range(0, 10)}))  # 0: no tree
MODEL = ["model_name"]


@dataclass
class SpecTotals:
    """vLLM's speculative counters, summed over finished speculating requests."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)

    def add(self, stats: RequestStats) -> None:
        c = spec_counts(stats)
        if not c.speculative:
            return
        self.drafts += c.rounds
        self.draft_tokens += c.proposed
        self.accepted += c.accepted
        for p, count in enumerate(accepted_per_position(c)):
            if p == len(self.per_position):
                self.per_position.append(0)
            self.per_position[p] += count


class _EngineCollector(Collector):
    """Reads one engine snapshot per scrape. ``engine_fn`` returns None while the engine is still loading."""

    def __init__(self, engine_fn: Callable[[], Any], queue_fn: Callable[[], tuple[int, int]],
                 refusals: dict[str, int], spec: SpecTotals, lock: threading.Lock,
                 model_fn: Callable[[], str]) -> None:
        self._engine_fn = engine_fn
        self._queue_fn = queue_fn
        self._refusals = refusals
        self._spec = spec
        self._lock = lock
        self._model_fn = model_fn

    def describe(self) -> Iterator[Metric]:
        # Names only, so registering does not need a live engine.
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        engine = self._engine_fn()
        yield from self._families(None if engine is None else engine.snapshot())

    def _families(self, snap: Any) -> Iterator[Metric]:
        model = self._model_fn() if snap is not None else ""
        requests = CounterMetricFamily(PREFIX + "requests", "Requests by outcome.", labels=["outcome", *MODEL])
        with self._lock:
            refusals = dict(self._refusals)
            spec = SpecTotals(self._spec.drafts, self._spec.draft_tokens, self._spec.accepted,
                              list(self._spec.per_position))
        finished = {} if snap is None else dict(snap.requests_total)
        for outcome in ("stop", "length", "cancelled", "error"):
            finished.setdefault(outcome, 0)
        for outcome, count in sorted({**finished, **refusals}.items()):
            requests.add_metric([outcome, model], count)
        yield requests

        def counter(name: str, doc: str, value: float, prefix: str = PREFIX) -> CounterMetricFamily:
            family = CounterMetricFamily(prefix + name, doc, labels=MODEL)
            family.add_metric([model], value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=MODEL)
            family.add_metric([model], value)
            return family

        get = (lambda name: 0) if snap is None else (lambda name: getattr(snap, name))
        yield counter("prompt_tokens", "Prompt tokens of admitted requests.", get("prompt_tokens_total"))
        yield counter("generation_tokens", "Completion tokens generated.", get("generation_tokens_total"))
        yield counter("spec_verify_calls", "Verify rounds (one target pass each).", get("verify_rounds_total"))
        yield counter("mixed_rounds", "Decode rounds whose verify forward carried prompt chunks (mixed_chunk).",
                      get("mixed_rounds_total"))
        yield counter("mixed_prompt_tokens", "Prompt tokens prefilled inside decode rounds.",
                      get("mixed_prompt_tokens_total"))
        yield counter("mixed_deferred", "Decode rounds whose riders took a prefill step instead: their mixed-round "
                      "graph was not captured and captures had spent their share of the time.",
                      get("mixed_deferred_total"))

        hist = [] if snap is None else list(snap.accept_hist)
        rounds = sum(hist)
        committed = sum(k * c for k, c in enumerate(hist))
        generated, verified = get("generation_tokens_total"), get("verify_rounds_total")
        yield gauge("spec_accept_length", "Completion tokens per verify round since start (SGLang's definition).",
                    generated / verified if verified else 0.0)
        buckets: list[tuple[str, float]] = []
        cumulative = hist[0] if hist else 0
        for k in _ACCEPT_BUCKETS:
            cumulative += hist[k] if k < len(hist) else 0
            buckets.append((str(float(k)), cumulative))
        buckets.append(("+Inf", rounds))
        per_round = HistogramMetricFamily(PREFIX + "spec_accept_length_per_round",
                                          "Tokens committed by each verify round (bonus included).", labels=MODEL)
        per_round.add_metric([model], buckets, sum_value=committed)
        yield per_round
        yield gauge("spec_accept_rate", "Accepted / proposed draft tokens of finished speculating requests.",
                    spec.accepted / spec.draft_tokens if spec.draft_tokens else 0.0)
        yield counter("spec_decode_num_drafts", "Verify rounds of speculating requests (vLLM's name).",
                      spec.drafts, prefix="vllm:")
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified (vLLM's name).", spec.draft_tokens,
                      prefix="vllm:")
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted, bonus excluded (vLLM's name).",
                      spec.accepted, prefix="vllm:")
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Rounds that accepted each draft position (vLLM's name).",
                                      labels=[*MODEL, "position"])
        for position, count in enumerate(spec.per_position):
            per_pos.add_metric([model, str(position)], count)
        yield per_pos

        yield gauge("num_running_reqs", "Requests holding a KV slot.", get("running"))
        server_queued, server_tokens = self._queue_fn()
        yield gauge("num_queue_reqs", "Requests waiting for a KV slot.", get("queued") + server_queued)
        yield gauge("num_queue_tokens", "Prompt + max_tokens of the requests in the server's queue.", server_tokens)
        yield gauge("max_running_reqs", "KV slots (the engine's max batch).", get("max_batch"))
        used, capacity = get("kv_tokens_used"), get("kv_tokens_capacity")
        yield gauge("kv_tokens_used", "KV cache positions in use.", used)
        yield gauge("kv_tokens_capacity", "KV cache positions allocated.", capacity)
        yield gauge("token_usage", "Fraction of the KV cache in use.", used / capacity if capacity else 0.0)

        stages = CounterMetricFamily(PREFIX + "stage_seconds", "Engine time per stage.", labels=["stage", *MODEL])
        for stage, seconds in sorted(({} if snap is None else snap.stage_seconds_total).items()):
            stages.add_metric([stage, model], seconds)
        yield stages


class ServerMetrics:
    """The registry behind ``GET /metrics`` plus what the server counts itself: refusals, per-request latency
    histograms, and vLLM's speculative counters."""

    def __init__(self, engine_fn: Callable[[], Any], queue_fn: Callable[[], tuple[int, int]] = lambda: (0, 0), *,
                 model_fn: Callable[[], str] = lambda: "") -> None:
        """``queue_fn``: (requests, tokens) waiting in the server's admission queue; ``model_fn``: the served
        model's name (the ``model_name`` label)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._refusals: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        self._spec = SpecTotals()
        self._model_fn = model_fn
        self.registry.register(_EngineCollector(engine_fn, queue_fn, self._refusals, self._spec, self._lock,
                                                model_fn))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labelnames=MODEL, buckets=buckets, registry=self.registry)

        self._ttft = histogram("time_to_first_token_seconds", "Time to first token per request.", _LATENCY_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "End-to-end latency per request.", _LATENCY_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds", "Gap between two token-carrying chunks of a request.",
                              _TOKEN_BUCKETS)
        self._tpot = histogram("time_per_output_token_seconds",
                               "Per request: (latency - time to first token) / (completion tokens - 1).",
                               _TOKEN_BUCKETS)
        self._auto = histogram("auto_budget_chosen", 'The budget each round of a budget "auto" request chose.',
                               _AUTO_BUCKETS)

    def refused(self, outcome: str) -> None:
        """Count a request answered with an error before (or instead of) running in the engine."""
        with self._lock:
            self._refusals[outcome] = self._refusals.get(outcome, 0) + 1

    def token_gap(self, seconds: float) -> None:
        self._itl.labels(self._model_fn()).observe(seconds)

    def finished(self, stats: RequestStats) -> None:
        model = self._model_fn()
        if stats.ttft_s is not None:
            self._ttft.labels(model).observe(stats.ttft_s)
        if stats.latency_s is not None:
            self._e2e.labels(model).observe(stats.latency_s)
        if stats.ttft_s is not None and stats.latency_s is not None and stats.completion_tokens > 1:
            self._tpot.labels(model).observe((stats.latency_s - stats.ttft_s) / (stats.completion_tokens - 1))
        for budget, rounds in stats.auto_budgets.items():
            for _ in range(rounds):
                self._auto.labels(model).observe(budget)
        with self._lock:
            self._spec.add(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
