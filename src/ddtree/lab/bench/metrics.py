"""Benchmark arithmetic: per-token timings from chunk arrivals, and the summaries of a run and of a cell.

Definitions (all times in seconds, measured by the client from the moment a request is sent)
------------------------------------------------------------------------------------------
event
    A streamed chunk that carried output: ``k >= 1`` tokens arriving at time ``t``. ``k`` comes from the
    cumulative ``usage.completion_tokens`` the chunk reported (exact); when the server reports usage only at the
    end, the final count is distributed over the chunks by re-tokenizing their text (``itl_source =
    "tokenizer"``) or, without a tokenizer, by their length in characters (``"chars"``).
TTFT
    Arrival time of the first event.
ITL (inter-token latency), per token
    An event of ``k`` tokens that arrives ``g`` after the previous event counts as ``k`` gaps of ``g / k``. So
    a speculative round committing 5 tokens in 50 ms gives five 10 ms entries, not one 50 ms entry and four
    zeros (the per-chunk error). The first event's tokens are covered by TTFT and add no entry, so a request
    has ``completion_tokens - k_first`` entries and their sum is ``last event time - TTFT``.
TPOT
    ``(latency - TTFT) / (completion_tokens - 1)``: vLLM's and SGLang's definition.
decode tok/s (per request)
    ``(completion_tokens - 1) / (latency - TTFT)`` = 1 / TPOT.
output tok/s (per run)
    Completion tokens of successful requests / run duration (first request sent to last one finished).

Worked example: events at 0.10 s (1 token), 0.15 s (3 tokens), 0.17 s (1 token) -> TTFT 0.10, ITL
``[0.05/3, 0.05/3, 0.05/3, 0.02]``, completion tokens 5.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from ddtree.lab.client import Completion
from ddtree.lab.engines import depth_curve

RUN_SUMMARY_KEYS: tuple[str, ...] = (
    "output_tok_s", "decode_tok_s_mean", "decode_tok_s_p50", "ttft_s_mean", "ttft_s_p50", "ttft_s_p90",
    "ttft_s_p99", "tpot_s_mean", "tpot_s_p50", "tpot_s_p90", "tpot_s_p99", "itl_s_p50", "itl_s_p90", "itl_s_p99",
    "e2e_s_p50", "e2e_s_p90", "e2e_s_p99", "accept_length", "accept_source", "spec_fields", "accept_by_depth",
    "depth_source", "errors", "completed", "duration_s",
)
# Keys that are not numbers averaged over runs: the first run's value is kept (sources), or the curves are
# averaged position by position (accept_by_depth).
_LABEL_KEYS = frozenset({"accept_source", "spec_fields", "depth_source"})


def per_token_itl(times: Sequence[float], tokens: Sequence[int]) -> list[float]:
    """Per-token inter-token latencies from event arrival ``times`` and their token counts (see module doc)."""
    if len(times) != len(tokens):
        raise ValueError(f"times and tokens differ in length: {len(times)} vs {len(tokens)}")
    itl: list[float] = []
    for i in range(1, len(times)):
        k = tokens[i]
        if k <= 0:
            raise ValueError(f"event {i} carries {k} tokens; events carry at least one")
        gap = times[i] - times[i - 1]
        itl.extend([gap / k] * k)
    return itl


def attribute_tokens(texts: Sequence[str], total: int, tokenizer: Any | None = None) -> list[int]:
    """Distribute ``total`` tokens over chunks by their share of the re-tokenized text (or of the characters).

    Shares come from the token count of each cumulative prefix of the text, so merges across chunk boundaries
    land where the tokenizer puts them; the result is scaled to ``total`` with largest-remainder rounding and
    every chunk keeps at least one token when ``total`` allows (a chunk arrives because output did)."""
    n = len(texts)
    if n == 0:
        return []
    if tokenizer is not None:
        counts, running, previous = [], "", 0
        for text in texts:
            running += text
            now = len(tokenizer.encode(running, add_special_tokens=False))
            counts.append(max(now - previous, 0))
            previous = now
    else:
        counts = [len(t) for t in texts]
    weights = [max(c, 1) for c in counts] if total >= n else counts
    scale = sum(weights)
    if scale == 0:
        weights, scale = [1] * n, n
    raw = [total * w / scale for w in weights]
    shares = [math.floor(r) for r in raw]
    order = sorted(range(n), key=lambda i: raw[i] - shares[i], reverse=True)
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    if total >= n:  # keep one token per chunk: move surplus from the largest shares to empty chunks
        for i in range(n):
            if shares[i] == 0:
                j = max(range(n), key=lambda m: shares[m])
                shares[j] -= 1
                shares[i] = 1
    return shares


def token_events(c: Completion, tokenizer: Any | None = None) -> tuple[list[float], list[int], str]:
    """``(times, tokens, source)`` of the output events of a streamed completion (see the module doc)."""
    if not c.chunk_times:
        return [], [], "none"
    continuous = all(u is not None for u, text in zip(c.chunk_usage, c.chunk_texts, strict=True) if text)
    if continuous and any(u is not None for u in c.chunk_usage):
        times, tokens, seen = [], [], 0
        for t, u in zip(c.chunk_times, c.chunk_usage, strict=True):
            if u is not None and u > seen:
                times.append(t)
                tokens.append(u - seen)
                seen = u
        return times, tokens, "usage"
    text_times = [t for t, text in zip(c.chunk_times, c.chunk_texts, strict=True) if text]
    texts = [text for text in c.chunk_texts if text]
    total = c.completion_tokens or 0
    shares = attribute_tokens(texts, total, tokenizer)
    kept = [(t, k) for t, k in zip(text_times, shares, strict=True) if k > 0]
    return [t for t, _ in kept], [k for _, k in kept], "tokenizer" if tokenizer is not None else "chars"


def request_record(c: Completion, prompt_tokens_sent: int, tokenizer: Any | None = None) -> dict[str, Any]:
    """The JSON record of one benchmark request (``ddtree.bench.cell/1`` ``runs[].requests[]``)."""
    times, tokens, source = token_events(c, tokenizer)
    ttft = times[0] if times else None
    return {
        "prompt_tokens": c.prompt_tokens if c.prompt_tokens is not None else prompt_tokens_sent,
        "prompt_tokens_sent": prompt_tokens_sent,
        "completion_tokens": c.completion_tokens,
        "ttft_s": ttft,
        "latency_s": c.latency_s,
        "itl_s": per_token_itl(times, tokens) if times else [],
        "itl_source": source,
        "chunks": len(times),
        "spec_verify_ct": c.spec_verify_ct,
        "accept_length": c.accept_length,
        "accept_hist": c.accept_hist,
        "correct_drafts": c.correct_drafts,
        "proposed_drafts": c.proposed_drafts,
        "spec_source": c.spec_source,
        "finish_reason": c.finish_reason,
        "error": c.error,
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile with linear interpolation (numpy's default); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize_run(records: Sequence[dict[str, Any]], duration_s: float, *,
                  counter_accept_length: float | None = None, counter_depth: Sequence[float] | None = None,
                  server_info_accept_length: float | None = None) -> dict[str, Any]:
    """The summary of one run of a cell (keys :data:`RUN_SUMMARY_KEYS`).

    Acceptance comes from the per-request stats when every successful request has them (completion tokens over
    verify rounds, summed over requests), else from ``counter_accept_length`` (a Prometheus difference), else
    from ``server_info_accept_length`` (SGLang's ``/server_info`` over the run); ``accept_source`` says which,
    ``spec_fields`` where the per-request stats sat (ddtree, meta_info, sglext). The depth curve likewise: the
    requests' histograms summed when every request has one, else ``counter_depth`` (vLLM's per-position
    counters)."""
    ok = [r for r in records if r["error"] is None]
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    decode = []
    tpots = []
    for r in ok:
        n, ttft, latency = r["completion_tokens"] or 0, r["ttft_s"], r["latency_s"]
        if ttft is not None and latency is not None and n > 1 and latency > ttft:
            tpots.append((latency - ttft) / (n - 1))
            decode.append((n - 1) / (latency - ttft))
    itl = [x for r in ok for x in r["itl_s"]]
    e2e = [r["latency_s"] for r in ok if r["latency_s"] is not None]
    rounds = [r["spec_verify_ct"] for r in ok]
    if ok and all(v is not None and v > 0 for v in rounds):
        accept, source = tokens / sum(rounds), "per_request"
    elif counter_accept_length is not None:
        accept, source = counter_accept_length, "prometheus"
    elif server_info_accept_length is not None:
        accept, source = server_info_accept_length, "server_info"
    else:
        accept, source = None, None
    hists = [r.get("accept_hist") for r in ok]
    depth: list[float] = []
    depth_source = None
    if ok and all(h for h in hists):
        total = [0] * max(len(h) for h in hists)
        for h in hists:
            for n, count in enumerate(h):
                total[n] += count
        depth, depth_source = depth_curve(total), "histogram"
    elif counter_depth:
        depth, depth_source = list(counter_depth), "per_position_counters"
    fields = sorted({r.get("spec_source") for r in ok if r.get("spec_source")})
    return {
        "output_tok_s": tokens / duration_s if duration_s > 0 else None,
        "decode_tok_s_mean": _mean(decode),
        "decode_tok_s_p50": percentile(decode, 50),
        "ttft_s_mean": _mean(ttfts),
        "ttft_s_p50": percentile(ttfts, 50),
        "ttft_s_p90": percentile(ttfts, 90),
        "ttft_s_p99": percentile(ttfts, 99),
        "tpot_s_mean": _mean(tpots),
        "tpot_s_p50": percentile(tpots, 50),
        "tpot_s_p90": percentile(tpots, 90),
        "tpot_s_p99": percentile(tpots, 99),
        "itl_s_p50": percentile(itl, 50),
        "itl_s_p90": percentile(itl, 90),
        "itl_s_p99": percentile(itl, 99),
        "e2e_s_p50": percentile(e2e, 50),
        "e2e_s_p90": percentile(e2e, 90),
        "e2e_s_p99": percentile(e2e, 99),
        "accept_length": accept,
        "accept_source": source,
        "spec_fields": ",".join(fields) if fields else None,
        "accept_by_depth": depth or None,
        "depth_source": depth_source,
        "errors": len(records) - len(ok),
        "completed": len(ok),
        "duration_s": duration_s,
    }


def summarize_cell(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Run summaries averaged key by key (``None`` values skipped), plus the spread of output tok/s over runs."""
    if not runs:
        raise ValueError("a cell needs at least one run")
    out: dict[str, Any] = {}
    for key in RUN_SUMMARY_KEYS:
        values = [run[key] for run in runs if run.get(key) is not None]
        if key in _LABEL_KEYS:
            out[key] = values[0] if values else None
        elif key == "accept_by_depth":
            width = max((len(v) for v in values), default=0)
            out[key] = [statistics.fmean([v[i] if i < len(v) else 0.0 for v in values]) for i in range(width)] or None
        else:
            out[key] = _mean(values)
    speeds = [run["output_tok_s"] for run in runs if run.get("output_tok_s") is not None]
    out["output_tok_s_spread"] = {
        "min": min(speeds) if speeds else None,
        "max": max(speeds) if speeds else None,
        "std": statistics.stdev(speeds) if len(speeds) > 1 else 0.0,
        "n": len(speeds),
    }
    return out
