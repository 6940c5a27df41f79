"""Does one oversized request hurt anybody else? ``ddtree serve`` under 16 streams, idle vs. next to huge bodies.

Starts ``python -m ddtree.server`` (the demo pair on the CPU unless ``--server-args`` says otherwise), then runs
the same phase twice (``--repeat`` pairs): 16 clients streaming completions while ``/health`` is polled every
50 ms; in the second one more client sends bodies of ``--body-factor`` x the server's body limit (chunked, so the
server must count them as they arrive; ``--declared`` sends a Content-Length instead), ``--gap`` seconds apart,
until the streams end or, with ``--bodies N``, exactly N of them (the phase then lasts until both are done).
Reports p50/p99 of ``/health`` latency and of the streams' inter-chunk gaps, the 413 latencies, and the server's
resident memory (from /proc): before the phase, its exact peak (``VmHWM``, reset at the phase's start through
``/proc/PID/clear_refs``; 50 ms samples where that file is not writable), after each refused body, and 1 s
after the phase (what persists). Last, whether a prompt at exactly the context limit (``max_len - 1`` tokens + 1
generated) is served. One JSON object on stdout.

    python benchmarks/server_load.py                      # demo pair, CPU
    python benchmarks/server_load.py --streams 0 --bodies 50 --gap 0 --repeat 3   # the body path alone
    python benchmarks/server_load.py --server-args "--max-len 2048" --streams 16 --max-tokens 32

``--bare MODE`` isolates the body path: instead of ``ddtree serve`` it starts uvicorn serving only the server's
``BodyLimitMiddleware`` (or a variant) around an app that answers with the body's length, no engine, so one cause
at a time can be measured (with ``--trace``, tracemalloc's peak of Python allocations too). MODE: ``ours`` (the
middleware as it is), ``keepalive`` (its 413 without ``Connection: close``: uvicorn reads and drops the rest of the
upload), ``bytearray`` (one growing bytearray instead of a list of chunks), ``count`` (counts and drops every
chunk, holds nothing: what uvicorn and asyncio alone cost for a refused upload).

    python benchmarks/server_load.py --bare count --bodies 50 --gap 0 --repeat 3
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


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (the peak since start or the last reset) of ``pid``, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def reset_peak(pid: int) -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False where the file is not writable."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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


def big_sender(url: str, pid: int, size: int, declared: bool, bodies: int, gap: float, stop: threading.Event,
               results: list[dict[str, float]]) -> None:
    """One client sending ``size``-byte bodies (64 KiB chunks without a Content-Length, or one declared body),
    ``gap`` seconds apart, until ``stop`` or ``bodies`` of them (0: no count); records each one's status, seconds
    and the server's RSS right after its answer."""
    piece = b"x" * 65536
    whole = b'{"prompt": "' + piece * (size // len(piece)) + b'", "max_tokens": 4}' if declared else None

    def chunks():
        yield b'{"prompt": "'
        for _ in range(size // len(piece)):
            yield piece
        yield b'", "max_tokens": 4}'

    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set() and (bodies == 0 or len(results) < bodies):
            t = time.perf_counter()
            r = client.post("/v1/completions", content=whole if declared else chunks(),
                            headers={"content-type": "application/json"})
            results.append({"status": r.status_code, "seconds": time.perf_counter() - t,
                            "rss_mib": rss_bytes(pid) / 2**20})
            if gap:
                stop.wait(gap)


def run_phase(url: str, pid: int, streams: int, max_tokens: int, big_size: int | None, declared: bool = False,
              bodies: int = 0, gap: float = 1.0) -> dict[str, Any]:
    gaps: list[float] = []
    health: list[float] = []
    rss: list[int] = []
    big: list[dict[str, float]] = []
    stop_big = threading.Event()
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            rss.append(rss_bytes(pid))
            time.sleep(0.05)

    before = rss_bytes(pid)
    exact_peak = reset_peak(pid)
    sampler = threading.Thread(target=sample)
    sampler.start()
    sender = (threading.Thread(target=big_sender, args=(url, pid, big_size, declared, bodies, gap, stop_big, big))
              if big_size else None)

    async def main() -> None:
        stop = asyncio.Event()
        poller = asyncio.ensure_future(poll_health(url, stop, health))
        if sender is not None:
            sender.start()
            await asyncio.sleep(0.5)
        limits = httpx.Limits(max_connections=streams + 4)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            await asyncio.gather(*(stream_one(client, f"def f{i}(x):", max_tokens, gaps) for i in range(streams)))
        while bodies and sender is not None and sender.is_alive():  # --bodies N: the phase lasts until all N
            await asyncio.sleep(0.1)
        stop.set()
        await poller

    t0 = time.perf_counter()
    asyncio.run(main())
    stop_big.set()
    if sender is not None:
        sender.join(600)
    sampling.set()
    sampler.join()
    peak = rss_bytes(pid, "VmHWM") if exact_peak else max(rss)
    time.sleep(1.0)
    mib = 2**20
    out: dict[str, Any] = {"seconds": time.perf_counter() - t0, "health": summary(health),
                           "stream_gaps": summary(gaps), "rss_before_mib": before / mib,
                           "rss_peak_mib": peak / mib, "peak_from": "VmHWM" if exact_peak else "50 ms samples",
                           "rss_after_mib": rss_bytes(pid) / mib}
    out["peak_growth_mib"] = out["rss_peak_mib"] - out["rss_before_mib"]
    out["persistent_growth_mib"] = out["rss_after_mib"] - out["rss_before_mib"]
    if big_size:
        after = [b["rss_mib"] - before / mib for b in big]
        out["big_requests"] = {"count": len(big), "statuses": sorted({int(b["status"]) for b in big}),
                               **summary([b["seconds"] for b in big]),
                               "rss_growth_after_body_mib": {str(i + 1): after[i] for i in sorted({0, 9, len(big) - 1})
                                                             if i < len(big)}}
    return out


BARE_MODES = ("ours", "keepalive", "bytearray", "count")


def serve_bare(mode: str, port: int, limit: int) -> None:
    """uvicorn on 127.0.0.1:``port`` serving ``BodyLimitMiddleware`` (``mode``: a variant) around an app that
    answers every request with its body's length; ``/server_info`` gives the limit, ``/trace`` tracemalloc's
    current and peak bytes (and resets the peak) when the process runs under ``-X tracemalloc``."""
    import tracemalloc

    import uvicorn

    from ddtree.server.limits import BodyLimitMiddleware, send_json

    async def inner(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/trace":
            current, peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            await send_json(send, 200, {"current": current, "peak": peak, "tracing": tracemalloc.is_tracing()})
            return
        if path == "/server_info":
            await send_json(send, 200, {"server": {"limits": {"max_body_bytes": limit, "max_len": 0}}})
            return
        message = await receive()
        await send_json(send, 200, {"bytes": len(message.get("body", b""))})

    class KeepAlive(BodyLimitMiddleware):
        async def _refuse(self, scope: Any, send: Any, limit: int, got: str) -> None:
            await send_json(send, 413, {"error": {"message": f"too large: {got}"}})

    class ByteArray(BodyLimitMiddleware):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            buf: bytearray | None = bytearray()
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return
                buf += message.get("body", b"")
                if len(buf) > limit:
                    buf = None
                    return await self._refuse(scope, send, limit, "too much")
                if not message.get("more_body", False):
                    break
            body = [bytes(buf)]
            buf = None

            async def replay() -> Any:
                return {"type": "http.request", "body": body.pop(), "more_body": False} if body else await receive()

            await self.app(scope, replay, send)

    class CountOnly(BodyLimitMiddleware):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["method"] == "GET":
                return await self.app(scope, receive, send)
            size = 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return
                size += len(message.get("body", b""))
                if size > limit:
                    return await self._refuse(scope, send, limit, "too much")
                if not message.get("more_body", False):
                    break
            await send_json(send, 200, {"bytes": size})

    cls = {"ours": BodyLimitMiddleware, "keepalive": KeepAlive, "bytearray": ByteArray, "count": CountOnly}[mode]
    app = cls(inner, lambda: limit, lambda path: None)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def traced(url: str) -> dict[str, float] | None:
    """tracemalloc's current and peak MiB in a ``--bare --trace`` server since the last call (None: not tracing)."""
    r = httpx.get(url + "/trace", timeout=10).json()
    return {"current_mib": r["current"] / 2**20, "peak_mib": r["peak"] / 2**20} if r["tracing"] else None


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
    parser.add_argument("--body-factor", "--big-factor", type=float, default=10.0, help="big body size / body limit")
    parser.add_argument("--bodies", type=int, default=0,
                        help="send exactly this many big bodies per loaded phase (default 0: until the streams end)")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between one big body's answer and the next")
    parser.add_argument("--declared", action="store_true", help="send the big bodies with a Content-Length")
    parser.add_argument("--repeat", type=int, default=1, help="idle/loaded phase pairs (the idle peaks' spread is "
                        "the noise of the peak comparison)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory for the context-limit prompt "
                        "(default: the demo target's)")
    parser.add_argument("--bare", choices=BARE_MODES, default=None,
                        help="serve only the body-limit middleware (or a variant), no engine; implies --streams 0")
    parser.add_argument("--bare-limit", type=int, default=5 * 2**19, help="--bare: the body limit in bytes "
                        "(default 2.5 MiB, the demo server's derived limit)")
    parser.add_argument("--trace", action="store_true", help="--bare: run the server under tracemalloc")
    parser.add_argument("--serve-bare", choices=BARE_MODES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_bare:  # the --bare server process itself
        serve_bare(args.serve_bare, args.port, args.bare_limit)
        return 0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if args.bare:
        args.streams = 0
        cmd = [sys.executable, *(["-X", "tracemalloc"] if args.trace else []), os.path.abspath(__file__),
               "--serve-bare", args.bare, "--port", str(port), "--bare-limit", str(args.bare_limit)]
    else:
        cmd = [sys.executable, "-m", "ddtree.server", "--device", "cpu", "--port", str(port), "--log-level",
               "warning", *shlex.split(args.server_args)]
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
        big = int(args.body_factor * limits["max_body_bytes"])
        pairs = []
        if args.bare:  # one small request first, so first-request allocations are not counted as the bodies'
            httpx.post(url + "/v1/completions", content=b'{"prompt": "x"}', timeout=10)
        for _ in range(args.repeat):
            idle = run_phase(url, proc.pid, args.streams, args.max_tokens, None)
            start = traced(url) if args.bare else None  # also resets tracemalloc's peak
            loaded = run_phase(url, proc.pid, args.streams, args.max_tokens, big, args.declared, args.bodies, args.gap)
            end = traced(url) if args.bare else None
            if start is not None and end is not None:  # Python's own allocations, over the phase's start
                loaded["tracemalloc_mib"] = {"peak_growth": end["peak_mib"] - start["current_mib"],
                                             "persistent_growth": end["current_mib"] - start["current_mib"]}
            pairs.append({"idle": idle, "with_big_bodies": loaded,
                          # the same streams ran in both phases: the difference of the peaks is what the bodies cost
                          "rss_peak_growth_over_idle_mib": loaded["rss_peak_mib"] - idle["rss_peak_mib"]})
        idle, loaded = pairs[0]["idle"], pairs[0]["with_big_bodies"]
        report = {
            "command": " ".join(cmd), "argv": sys.argv[1:], "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(), "limits": limits, "big_body_bytes": big,
            "idle": idle, "with_big_bodies": loaded, "repeats": pairs[1:],
            "health_p99_ratio": loaded["health"]["p99_ms"] / idle["health"]["p99_ms"],
            "stream_gap_p99_ratio": (loaded["stream_gaps"]["p99_ms"] / idle["stream_gaps"]["p99_ms"]
                                     if args.streams else None),
            "rss_peak_growth_over_idle_mib": [p["rss_peak_growth_over_idle_mib"] for p in pairs],
            "idle_peak_growth_mib": [p["idle"]["peak_growth_mib"] for p in pairs],
            "loaded_peak_growth_mib": [p["with_big_bodies"]["peak_growth_mib"] for p in pairs],
            "loaded_persistent_growth_mib": [p["with_big_bodies"]["persistent_growth_mib"] for p in pairs],
            "limit_mib": limits["max_body_bytes"] / 2**20,
            "at_context_limit": None if args.bare else at_context_limit(url, args.tokenizer, limits["max_len"]),
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
