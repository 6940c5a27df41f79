"""Load a running OpenAI-compatible server with N concurrent clients for T seconds; check it stays healthy.

    ddtree serve --device cpu --max-batch 16 --port 8000 &
    python benchmarks/load.py --url http://127.0.0.1:8000 --clients 32 --duration 60 --out load.json

Each client loops: build a request, send it, check the answer, repeat until the time is up. Requests mix the two
endpoints, streamed and plain answers, and a few tree settings (``--mix``), so the run exercises every path the
server has; ``--abandon`` makes that fraction of streamed requests hang up after the first chunk, which must
cancel them in the engine and free their slots. Every answer is checked: status 200, ``[DONE]`` last, usage
present and ``completion_tokens == max_tokens`` (the requests set ``ignore_eos``), text non-empty.

Reported: requests/s, output tokens/s (from usage), latency percentiles, errors by kind (the run fails, exit code 1,
if there is any), and the server's resident memory (``/server_info`` ``server.rss_bytes``, sampled every
``--rss-every`` seconds) after the warm-up, at the end and at its peak; plus slots still busy after the run (leaks).
Memory that is flat across the run, after the warm-up, is the check for "does not grow without bound".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

TREES: tuple[dict[str, Any] | None, ...] = (None, {"budget": 4}, {"budget": 16, "topk": 4}, {"method": "dflash"},
                                            {"method": "ar"})


@dataclass
class Tally:
    """What the clients saw. ``latencies_s`` holds completed requests only."""

    ok: int = 0
    abandoned: int = 0
    output_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    error_examples: dict[str, str] = field(default_factory=dict)

    def fail(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.error_examples.setdefault(kind, detail[:300])


def build_body(rng: random.Random, seq: int, args: argparse.Namespace, model: str) -> tuple[str, dict[str, Any]]:
    """One request: a unique prefix (no cross-request caching) then filler text, maybe chat, maybe streamed."""
    chat = args.mix and rng.random() < 0.3
    stream = not args.mix or rng.random() < 0.7
    text = f"request {seq}: " + " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "tree", "token"))
                                          for _ in range(args.prompt_words))
    body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    tree = rng.choice(TREES) if args.mix else None
    if tree is not None:
        body["ddtree"] = tree
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    body["prompt"] = text
    return "/v1/completions", body


async def one_request(client: httpx.AsyncClient, path: str, body: dict[str, Any], abandon: bool,
                      tally: Tally, max_tokens: int) -> None:
    start = time.perf_counter()
    try:
        if not body["stream"]:
            r = await client.post(path, json=body)
            if r.status_code != 200:
                tally.fail(f"http_{r.status_code}", r.text)
                return
            data = r.json()
            text = data["choices"][0].get("text") or data["choices"][0].get("message", {}).get("content")
            usage = data.get("usage") or {}
        else:
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    tally.fail(f"http_{r.status_code}", (await r.aread()).decode(errors="replace"))
                    return
                events: list[Any] = []
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
                    if abandon:
                        break  # leaving the block closes the connection mid-stream
            if abandon:
                tally.abandoned += 1
                return
            if not events or events[-1] != "[DONE]":
                tally.fail("stream_without_done", str(events[-1:]))
                return
            if any(isinstance(e, dict) and "error" in e for e in events):
                tally.fail("stream_error_event", str(events[-2]))
                return
            usage = events[-2].get("usage") or {}
            text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                           for c in events[:-2])
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as exc:
        tally.fail(type(exc).__name__, str(exc))
        return
    if usage.get("completion_tokens") != max_tokens:
        tally.fail("wrong_usage", json.dumps(usage))
        return
    if not text:
        tally.fail("empty_text", json.dumps(body)[:200])
        return
    tally.ok += 1
    tally.output_tokens += usage["completion_tokens"]
    tally.latencies_s.append(time.perf_counter() - start)


async def client_loop(client: httpx.AsyncClient, worker: int, deadline: float, args: argparse.Namespace,
                      model: str, tally: Tally, counter: list[int]) -> None:
    rng = random.Random(args.seed * 10_007 + worker)
    while time.monotonic() < deadline:
        counter[0] += 1
        path, body = build_body(rng, counter[0], args, model)
        abandon = body["stream"] and rng.random() < args.abandon
        await one_request(client, path, body, abandon, tally, args.max_tokens)


async def rss(client: httpx.AsyncClient) -> int | None:
    try:
        r = await client.get("/server_info")
        return (r.json().get("server") or {}).get("rss_bytes") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def running_requests(client: httpx.AsyncClient) -> float | None:
    """``ddtree:num_running_reqs + ddtree:num_queue_reqs`` from /metrics (None for servers without them)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return None
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("ddtree:num_running_reqs", "ddtree:num_queue_reqs"):
            values[name] = float(value)
    return sum(values.values()) if values else None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout, limits=limits) as client:
        models = (await client.get("/v1/models")).json()["data"]
        model = args.model or models[0]["id"]
        counter = [0]

        warm = Tally()
        if args.warmup > 0:
            deadline = time.monotonic() + args.warmup
            await asyncio.gather(*(client_loop(client, w, deadline, args, model, warm, counter)
                                   for w in range(args.clients)))
        rss_samples: list[tuple[float, int | None]] = [(0.0, await rss(client))]

        tally = Tally()
        start = time.monotonic()
        deadline = start + args.duration

        async def sample_rss() -> None:
            while time.monotonic() < deadline:
                await asyncio.sleep(args.rss_every)
                rss_samples.append((time.monotonic() - start, await rss(client)))

        sampler = asyncio.ensure_future(sample_rss())
        await asyncio.gather(*(client_loop(client, w, deadline, args, model, tally, counter)
                               for w in range(args.clients)))
        elapsed = time.monotonic() - start
        sampler.cancel()

        # Abandoned streams must have freed their slots: wait briefly for the engine to go idle.
        busy = await running_requests(client)
        settle = time.monotonic() + 10
        while busy and time.monotonic() < settle:
            await asyncio.sleep(0.1)
            busy = await running_requests(client)
        rss_samples.append((time.monotonic() - start, await rss(client)))
        info = (await client.get("/server_info")).json()

    lat = sorted(tally.latencies_s)

    def pct(q: float) -> float | None:
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None

    known = [b for _, b in rss_samples if b is not None]
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "model": model,
        "duration_s": elapsed,
        "requests_ok": tally.ok,
        "requests_abandoned": tally.abandoned,
        "requests_per_s": tally.ok / elapsed,
        "output_tokens_per_s": tally.output_tokens / elapsed,
        "latency_s": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
                      "mean": statistics.fmean(lat) if lat else None},
        "errors": dict(tally.errors),
        "error_examples": tally.error_examples,
        "warmup": {"requests_ok": warm.ok, "errors": dict(warm.errors)},
        "busy_after_run": busy,
        "rss_bytes": {"after_warmup": known[0] if known else None, "end": known[-1] if known else None,
                      "peak": max(known) if known else None, "samples": rss_samples},
        "env": {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0],
                "platform": platform.platform(), "server_info": info},
    }


def report(result: dict[str, Any]) -> str:
    mib = 2**20
    r = result["rss_bytes"]
    lat = result["latency_s"]
    lines = [
        f"clients {result['config']['clients']}, {result['duration_s']:.1f} s, model {result['model']}",
        f"requests ok        {result['requests_ok']} ({result['requests_per_s']:.2f}/s), "
        f"abandoned on purpose {result['requests_abandoned']}",
        f"output tokens/s    {result['output_tokens_per_s']:.1f}",
        "latency p50/p90/p99 " + "/".join("-" if lat[k] is None else f"{lat[k]:.3f}" for k in ("p50", "p90", "p99"))
        + " s",
        f"errors             {sum(result['errors'].values())} {result['errors'] or ''}",
        f"busy after run     {result['busy_after_run']}",
    ]
    if r["after_warmup"] is not None:
        lines.append(f"server RSS MiB     after warm-up {r['after_warmup'] / mib:.1f}, end {r['end'] / mib:.1f}, "
                     f"peak {r['peak'] / mib:.1f} (growth {(r['end'] - r['after_warmup']) / mib:+.1f})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the first /v1/models lists)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds measured")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of the same load before measuring")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--no-mix", dest="mix", action="store_false",
                        help="only streamed /v1/completions with the server's default tree")
    parser.add_argument("--abandon", type=float, default=0.05,
                        help="fraction of streamed requests the client hangs up on after the first chunk")
    parser.add_argument("--rss-every", type=float, default=2.0, help="seconds between memory samples")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the full result as JSON here")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(report(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    if result["errors"] or result["busy_after_run"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
