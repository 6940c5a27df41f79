"""Which engine answers at a URL, and where each engine reports speculative acceptance.

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

Prometheus text is parsed with ``prometheus_client``'s parser (a main dependency).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from ddtree.lab.client import OpenAIClient

ENGINES: tuple[str, ...] = ("ddtree", "sglang", "vllm", "openai")

# Extra request fields each engine needs to report per-request speculative stats.
REQUEST_EXTRAS: dict[str, dict[str, Any]] = {
    "ddtree": {},
    "sglang": {"return_spec_tokens_details": True},
    "vllm": {},
    "openai": {},
}


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
    """Prometheus text -> ``{sample name: value summed over label sets}`` (``*_created`` samples dropped)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
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


async def scrape(client: OpenAIClient) -> dict[str, float] | None:
    """The server's ``/metrics`` summed by sample name; ``None`` when it has none (or it does not parse)."""
    text = await client.get_text("/metrics")
    if not text:
        return None
    try:
        return parse_metrics(text)
    except ValueError:
        return None


async def detect_engine(client: OpenAIClient) -> str:
    """``ddtree``, ``sglang`` or ``vllm`` from what the server says about itself; ``openai`` when unknown.

    Order: ``/v1/models`` ``owned_by`` (each of the three names itself there), then metric-name prefixes on
    ``/metrics``, then ``/server_info`` keys."""
    listing = await client.get_json("/v1/models")
    for card in (listing or {}).get("data") or []:
        owner = str(card.get("owned_by", "")).lower() if isinstance(card, Mapping) else ""
        for engine in ("ddtree", "sglang", "vllm"):
            if engine in owner:
                return engine
    text = await client.get_text("/metrics") or ""
    for engine in ("ddtree", "sglang", "vllm"):
        if f"\n{engine}:" in "\n" + text:
            return engine
    info = await client.get_json("/server_info")
    if isinstance(info, Mapping):
        if "ddtree_version" in (info.get("server") or {}):
            return "ddtree"
        if "internal_states" in info:
            return "sglang"
    return "openai"


async def server_info(client: OpenAIClient, engine: str) -> dict[str, Any]:
    """What the server says about its configuration and versions, for the record (``{}`` when nothing)."""
    paths = {"ddtree": ("/server_info",), "sglang": ("/server_info", "/get_server_info"),
             "vllm": ("/version",), "openai": ()}[engine]
    for path in paths:
        info = await client.get_json(path)
        if isinstance(info, dict):
            return info
    return {}
