"""Where each engine reports speculative acceptance, and how its answers are read.

Pure parsing, no requests: the probes that ask a server (which engine it is, ``/metrics``, ``/flush_cache``,
``/server_info``) are methods of :class:`ddtree.lab.client.OpenAIClient`, which imports this module.

Acceptance length is counted the SGLang way everywhere: committed tokens per verify round, the bonus token
included (so plain decoding scores 1.0). Sources, best first:

per request
    ddtree: the ``ddtree`` stats object (``verify_rounds``, ``accept_length``) and SGLang-style ``meta_info``
    (``spec_verify_ct``, ``spec_accept_length``) on the response and its choice (streams: on the last content
    chunk). SGLang: ``meta_info`` or ``sglext.spec_tokens_details`` (asked for with
    ``"return_spec_tokens_details": true``). The cell's value is sum(completion tokens) / sum(verify rounds).
Prometheus counters, as a difference over the measured run only (taken after the warm-up, so earlier traffic
never pollutes it)
    ddtree: ``ddtree:generation_tokens_total / ddtree:spec_verify_calls_total``; SGLang:
    ``sglang:generation_tokens_total / sglang:spec_verify_calls_total``; vLLM:
    ``1 + vllm:spec_decode_num_accepted_tokens_total / vllm:spec_decode_num_drafts_total``.
    Counters are summed over label sets (several engines / data-parallel ranks).

/server_info (SGLang, last resort)
    ``internal_states[i].avg_spec_accept_length`` is cumulative since start-up or the last ``/flush_cache``, so
    the bench flushes before each measured run (when the server is idle, as SGLang's ``bench_serving
    --flush-cache`` does) and reads it after: the value then covers that run alone. Without a successful flush it
    is not used.

Field names change between SGLang versions: per request the current names are ``spec_num_correct_drafts``,
``spec_num_proposed_drafts`` and ``spec_correct_drafts_histogram``; ``spec_accepted_drafts``,
``spec_proposed_drafts`` and ``spec_accept_histogram`` are the older spellings (kept by SGLang as aliases due for
removal). Both are read, the new ones first, so a server with either set gives the same numbers.

Acceptance by depth
    ``hist[n]`` = verify rounds that accepted exactly ``n`` draft tokens (the bonus token not counted): SGLang's
    histogram as it is, ddtree's ``accept_hist`` (indexed by committed tokens, bonus included) shifted by one.
    The depth curve is ``P(accepted >= d)`` for ``d = 1 .. max``: the fraction of rounds whose first ``d`` draft
    tokens were all accepted. vLLM gives it directly: ``num_accepted_tokens_per_pos_total{position=d-1}`` over
    ``num_drafts_total`` (differences over the run). The curve sums to the mean accepted drafts per round.

Prometheus text is parsed with ``prometheus_client``'s parser (a main dependency).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ENGINES: tuple[str, ...] = ("ddtree", "sglang", "vllm", "openai")

# Extra request fields each engine needs to report per-request speculative stats.
REQUEST_EXTRAS: dict[str, dict[str, Any]] = {
    "ddtree": {},
    "sglang": {"return_spec_tokens_details": True},
    "vllm": {},
    "openai": {},
}


_CORRECT = ("spec_num_correct_drafts", "spec_accepted_drafts")  # new name first, then the old alias
_PROPOSED = ("spec_num_proposed_drafts", "spec_proposed_drafts")
_HISTOGRAM = ("spec_correct_drafts_histogram", "spec_accept_histogram")
VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class SpecDetails:
    """Per-request speculative detail beyond the acceptance length, normalised across engines and versions."""

    accept_hist: tuple[int, ...] | None = None  # [n] = rounds that accepted exactly n draft tokens (no bonus)
    correct_drafts: int | None = None
    proposed_drafts: int | None = None
    source: str | None = None  # "ddtree", "meta_info" or "sglext" (where the histogram came from)


def _count(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _hist(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (list, tuple)) and value and all(_count(v) is not None and v >= 0 for v in value):
        return tuple(int(v) for v in value)
    return None


def spec_details(obj: Mapping[str, Any]) -> SpecDetails:
    """Histogram and draft counts from a response object or stream chunk (empty :class:`SpecDetails` if none).

    ddtree's own ``ddtree.accept_hist`` is preferred over the ``meta_info`` our server also sends, because that
    object's ``spec_accept_histogram`` keeps ddtree's indexing (committed tokens), not SGLang's (drafts)."""
    places: list[Mapping[str, Any]] = [obj]
    places += [c for c in obj.get("choices") or [] if isinstance(c, Mapping)]
    for place in places:
        own = place.get("ddtree")
        if isinstance(own, Mapping) and (hist := _hist(own.get("accept_hist"))) is not None:
            drafts = hist[1:] or (0,)
            return SpecDetails(drafts, sum(n * c for n, c in enumerate(drafts)), None, "ddtree")
    for place in places:
        for name, source in _sglang_sources(place):
            hist = next((h for key in _HISTOGRAM if (h := _hist(source.get(key))) is not None), None)
            correct = next((c for key in _CORRECT if (c := _count(source.get(key))) is not None), None)
            proposed = next((c for key in _PROPOSED if (c := _count(source.get(key))) is not None), None)
            if hist is not None or correct is not None:
                return SpecDetails(hist, correct, proposed, name)
    return SpecDetails()


def _sglang_sources(place: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    out: list[tuple[str, Mapping[str, Any]]] = []
    if isinstance(place.get("meta_info"), Mapping):
        out.append(("meta_info", place["meta_info"]))
    sglext = place.get("sglext")
    if isinstance(sglext, Mapping) and isinstance(sglext.get("spec_tokens_details"), Mapping):
        out.append(("sglext", sglext["spec_tokens_details"]))
    return out


def depth_curve(hist: Sequence[int]) -> list[float]:
    """``[P(accepted >= 1), P(accepted >= 2), ...]`` from ``hist[n]`` = rounds accepting exactly n drafts.

    Worked example: ``hist = [2, 1, 1]`` (4 rounds: two accepted nothing, one accepted 1, one accepted 2) ->
    ``[0.5, 0.25]``; their sum 0.75 is the mean accepted drafts per round (acceptance length 1.75)."""
    rounds = sum(hist)
    if rounds <= 0:
        return []
    curve, remaining = [], rounds
    for count in hist[:-1]:
        remaining -= count
        curve.append(remaining / rounds)
    while curve and curve[-1] == 0.0:
        curve.pop()
    return curve


def depth_curve_from_positions(per_position: Mapping[int, float], drafts: float) -> list[float]:
    """vLLM's per-position accepted counts (position 0 = the first draft token) over the drafts in the interval."""
    if not drafts or drafts <= 0 or not per_position:
        return []
    last = max(per_position)
    curve = [per_position.get(i, 0.0) / drafts for i in range(last + 1)]
    while curve and curve[-1] == 0.0:
        curve.pop()
    return curve


def spec_stats(obj: Mapping[str, Any]) -> tuple[int | None, float | None]:
    """``(verify rounds, acceptance length)`` from a response object or stream chunk, ``None`` where absent."""
    places: list[Mapping[str, Any]] = [obj]
    for choice in obj.get("choices") or []:
        if isinstance(choice, Mapping):
            places.append(choice)
    verify_ct: int | None = None
    accept: float | None = None
    for place in places:
        for source in _spec_sources(place):
            ct = source.get("spec_verify_ct", source.get("verify_rounds"))
            length = source.get("spec_accept_length", source.get("accept_length"))
            if isinstance(ct, (int, float)) and not isinstance(ct, bool) and verify_ct is None:
                verify_ct = int(ct)
            if isinstance(length, (int, float)) and not isinstance(length, bool) and accept is None:
                accept = float(length)
    return verify_ct, accept


def _spec_sources(place: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    sources = []
    for key in ("ddtree", "meta_info"):
        value = place.get(key)
        if isinstance(value, Mapping):
            sources.append(value)
    sglext = place.get("sglext")
    if isinstance(sglext, Mapping) and isinstance(sglext.get("spec_tokens_details"), Mapping):
        sources.append(sglext["spec_tokens_details"])
    return sources


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{sample name: value summed over label sets}`` (``*_created`` samples dropped); a
    sample with a ``position`` label is also kept per position as ``name@position``."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
            position = sample.labels.get("position")
            if position is not None and position.isdigit():  # vLLM's per-position counters, kept apart
                key = f"{sample.name}@{int(position)}"
                totals[key] = totals.get(key, 0.0) + float(sample.value)
    return totals


@dataclass(frozen=True)
class CounterAcceptance:
    """How to turn two Prometheus scrapes into an acceptance length for one engine."""

    engine: str

    def from_counters(self, before: Mapping[str, float], after: Mapping[str, float]) -> float | None:
        """Acceptance length over the interval between two scrapes; ``None`` when no round ran in it."""
        def delta(name: str) -> float | None:
            if name not in after:
                return None
            return after[name] - before.get(name, 0.0)

        if self.engine == "vllm":
            drafts = delta("vllm:spec_decode_num_drafts_total")
            accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
            if not drafts or accepted is None:
                return None
            return 1.0 + accepted / drafts
        if self.engine in ("sglang", "ddtree"):
            rounds = delta(f"{self.engine}:spec_verify_calls_total")
            tokens = delta(f"{self.engine}:generation_tokens_total")
            if not rounds or tokens is None:
                return None
            return tokens / rounds
        return None

    def depth_from_counters(self, before: Mapping[str, float], after: Mapping[str, float]) -> list[float]:
        """vLLM's acceptance by depth over the interval (``[]`` for other engines or no drafts)."""
        if self.engine != "vllm":
            return []
        drafts = after.get("vllm:spec_decode_num_drafts_total", 0.0) - before.get(
            "vllm:spec_decode_num_drafts_total", 0.0)
        prefix = VLLM_PER_POSITION + "@"
        per_position = {int(k[len(prefix):]): v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix)}
        return depth_curve_from_positions(per_position, drafts)
