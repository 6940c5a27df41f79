"""Does one oversized request hurt anybody else? ``ddtree serve`` under 16 streams, idle vs. next to a huge body.

Starts ``python -m ddtree.server`` (the demo pair on the CPU unless ``--server-args`` says otherwise), then runs
the same phase twice: 16 clients streaming completions while ``/health`` is polled every 50 ms; in the second run
one more client keeps sending bodies of 10x the server's body limit (chunked, so the server must count them as
they arrive). (one body, then the next a second after its answer). Reports p50/p99 of ``/health`` latency and of the streams' inter-chunk gaps, the 413 latencies,
the server's resident memory (from /proc, sampled every 50 ms) before and at its peak, and whether a prompt at
exactly the context limit (``max_len - 1`` tokens + 1 generated) is served. One JSON object on stdout.

    python benchmarks/server_load.py                      # demo pair, CPU
    python benchmarks/server_load.py --server-args "--max-len 2048" --streams 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": 1e3 * percentile(values, 0.5), "p99_ms": 1e3 * percentile(values, 0.99),
            "max_ms": 1e3 * max(values, default=float("nan"))}


async def stream_one(client: httpx.AsyncClient, prompt: str, max_tokens: int, gaps: list[float]) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.status_code
        last = time.perf_counter()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now


async def poll_health(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            t = time.perf_counter()
            r = await client.get("/health")
            latencies.append(time.perf_counter() - t)
            assert r.status_code == 200
            await asyncio.sleep(0.05)


def big_sender(url: str, size: int, stop: threading.Event, results: list[tuple[int, float]]) -> None:
    """One client sending a ``size``-byte body in 64 KiB chunks (no Content-Length), then the next one a second
    later, until ``stop``; records status and seconds of each."""
    piece = b"x" * 65536

    def chunks():
        yield b'{"prompt": "'
        for _ in range(size // len(piece)):
            yield piece
        yield b'", "max_tokens": 4}'

    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            t = time.perf_counter()
            r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            results.append((r.status_code, time.perf_counter() - t))
            stop.wait(1.0)


def run_phase(url: str, pid: int, streams: int, max_tokens: int, big_size: int | None) -> dict[str, Any]:
    gaps: list[float] = []
    health: list[float] = []
    rss: list[int] = []
    big: list[tuple[int, float]] = []
    stop_big = threading.Event()
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            rss.append(rss_bytes(pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    sender = threading.Thread(target=big_sender, args=(url, big_size, stop_big, big)) if big_size else None
    before = rss_bytes(pid)

    async def main() -> None:
        stop = asyncio.Event()
        poller = asyncio.ensure_future(poll_health(url, stop, health))
        if sender is not None:
            sender.start()
            await asyncio.sleep(0.5)
        limits = httpx.Limits(max_connections=streams + 4)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            await asyncio.gather(*(stream_one(client, f"def f{i}(x):", max_tokens, gaps) for i in range(streams)))
        stop.set()
        await poller

    t0 = time.perf_counter()
    asyncio.run(main())
    stop_big.set()
    if sender is not None:
        sender.join(120)
    sampling.set()
    sampler.join()
    out: dict[str, Any] = {"seconds": time.perf_counter() - t0, "health": summary(health),
                           "stream_gaps": summary(gaps), "rss_before_mib": before / 2**20,
                           "rss_peak_mib": max(rss) / 2**20}
    if big_size:
        out["big_requests"] = {"count": len(big), "statuses": sorted({s for s, _ in big}),
                               **summary([t for _, t in big])}
    return out


def at_context_limit(url: str, tokenizer_dir: str | None, max_len: int) -> dict[str, Any]:
    """A prompt of ``max_len - 1`` tokens (a space-led word repeated: one token per copy) and max_tokens 1."""
    from transformers import AutoTokenizer

    from ddtree.assets import demo_target_path

    tok = AutoTokenizer.from_pretrained(tokenizer_dir or str(demo_target_path()))
    words = [t for t in (tok.decode([i]) for i in range(len(tok))) if t.startswith(" ") and t[1:].isalpha()]
    word = max(words, key=len)
    prompt = word * (max_len - 1)
    n = len(tok.encode(prompt, add_special_tokens=False))
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                  "ignore_eos": True}, timeout=600)
    return {"prompt_tokens_local": n, "prompt_chars": len(prompt), "status": r.status_code,
            "usage": r.json().get("usage") if r.status_code == 200 else r.json()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-args", default="", help="extra flags for python -m ddtree.server")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--big-factor", type=float, default=10.0, help="big body size / body limit")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory for the context-limit prompt "
                        "(default: the demo target's)")
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ddtree.server", "--device", "cpu", "--port", str(port), "--log-level", "warning",
           *shlex.split(args.server_args)]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, "server exited"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server not healthy in 600 s"
            time.sleep(0.2)
        info = httpx.get(url + "/server_info").json()
        limits = info["server"]["limits"]
        big = int(args.big_factor * limits["max_body_bytes"])
        idle = run_phase(url, proc.pid, args.streams, args.max_tokens, None)
        loaded = run_phase(url, proc.pid, args.streams, args.max_tokens, big)
        report = {
            "command": " ".join(cmd), "cpu_count": os.cpu_count(), "limits": limits, "big_body_bytes": big,
            "idle": idle, "with_big_bodies": loaded,
            "health_p99_ratio": loaded["health"]["p99_ms"] / idle["health"]["p99_ms"],
            "stream_gap_p99_ratio": loaded["stream_gaps"]["p99_ms"] / idle["stream_gaps"]["p99_ms"],
            # the same 16 streams ran in both phases: the difference of the peaks is what the big bodies cost
            "rss_peak_growth_over_idle_mib": loaded["rss_peak_mib"] - idle["rss_peak_mib"],
            "limit_mib": limits["max_body_bytes"] / 2**20,
            "at_context_limit": at_context_limit(url, args.tokenizer, limits["max_len"]),
        }
        print(json.dumps(report, indent=2))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
