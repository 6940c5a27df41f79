"""``python -m ddtree.server`` as its own process on loopback, driven by real HTTP clients.

The tiny random pair is saved to disk (``tiny_model_dirs``) and loaded through the CLI flags, so this covers the
whole path a user takes: flags -> EngineConfig -> background load -> serving -> SIGTERM -> drain -> exit 0.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import DONE, ServerProcess, free_port, parse_sse

pytestmark = pytest.mark.slow  # each server process takes a few seconds to import torch and load

FLAGS = ["--device", "cpu", "--max-batch", "8", "--max-len", "256", "--max-budget", "16", "--max-queue", "64",
         "--budget", "4", "--topk", "2", "--log-level", "warning"]


def flags(model_dirs) -> list[str]:
    target, drafter = model_dirs
    return ["--target", str(target), "--draft", str(drafter), *FLAGS]


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    proc = ServerProcess(flags(tiny_model_dirs), tmp_path_factory.mktemp("server") / "server.log")
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def test_flags_reach_the_engine(server):
    info = httpx.get(server.url + "/server_info").json()
    assert info["model"] == "target"  # the target directory's name
    assert info["engine"]["limits"]["max_batch"] == 8 and info["engine"]["limits"]["max_len"] == 256
    assert info["engine"]["config"]["draft_fp8"] is False
    assert info["default_tree"] == {"method": "ddtree", "budget": 4, "topk": 2, "block_size": 8, "draft_window": None}
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["target"]


def test_draft_fp8_flag_serves_lossless_text(server, tiny_model_dirs, tmp_path):
    """--draft-fp8 reaches the engine (the drafter calibrated at load, here on the CPU) and a greedy completion is
    the same text as the default server's."""
    proc = ServerProcess([*flags(tiny_model_dirs), "--draft-fp8"], tmp_path / "fp8.log")
    try:
        proc.wait_healthy()
        assert httpx.get(proc.url + "/server_info").json()["engine"]["config"]["draft_fp8"] is True
        body = {"prompt": "hello world", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        texts = [httpx.post(p.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                 for p in (server, proc)]
        assert texts[0] == texts[1]
    finally:
        proc.stop()


def test_64_concurrent_streams(server):
    """64 streams at once (8 slots, the rest queued): every one completes with the right usage and the same text
    as the same prompt served alone."""
    prompts = [f"hello world {i}" for i in range(8)]

    async def main() -> tuple[list[str], list[list]]:
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            alone = []
            for p in prompts:
                r = await client.post("/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0,
                                                               "ignore_eos": True})
                alone.append(r.json()["choices"][0]["text"])

            async def one(i: int) -> list:
                body = {"prompt": prompts[i % 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return parse_sse(r.text)

            streams = await asyncio.gather(*(one(i) for i in range(64)))
            return alone, streams

    alone, streams = asyncio.run(main())
    for i, events in enumerate(streams):
        assert events[-1] == DONE
        usage = events[-2]["usage"]
        assert usage["completion_tokens"] == 12 and usage["total_tokens"] == usage["prompt_tokens"] + 12
        text = "".join(c["choices"][0]["text"] for c in events[:-2])
        assert text == alone[i % 8]
        assert events[-3]["choices"][0]["finish_reason"] == "length"
    samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
               for s in f.samples if set(s.labels) <= {"model_name"}}
    assert samples["ddtree:num_running_reqs"] == 0 and samples["ddtree:num_queue_reqs"] == 0


def test_server_config_changes_live(server):
    def tree() -> dict:
        body = {"prompt": "hello world", "max_tokens": 4, "temperature": 0}
        return httpx.post(server.url + "/v1/completions", json=body).json()["ddtree"]["tree"]

    assert tree()["budget"] == 4
    r = httpx.post(server.url + "/server_config", json={"ddtree": {"budget": 9, "draft_window": 64}})
    assert r.status_code == 200
    assert tree() == {"method": "ddtree", "budget": 9, "topk": 2, "block_size": 8, "draft_window": 64}
    httpx.post(server.url + "/server_config", json={"ddtree": {"budget": 4, "draft_window": None}})
    assert tree()["budget"] == 4 and tree()["draft_window"] is None


def test_bad_requests_do_not_hurt_the_process(server):
    for body in (b"{", b'{"prompt": ["a", 5]}', b'{"prompt": "x", "max_tokens": -5}'):
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True,
                                                        "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_sigterm_drains_then_exits_0(tiny_model_dirs, tmp_path):
    """SIGTERM mid-stream: a short request still finishes normally, one that outlives --drain-timeout is aborted
    with an error event and [DONE] (never a cut-off body), and the process exits 0."""
    target, drafter = tiny_model_dirs
    args = ["--target", str(target), "--draft", str(drafter), "--device", "cpu", "--max-len", "2048",
            "--drain-timeout", "3", "--log-level", "warning"]
    proc = ServerProcess(args, tmp_path / "server.log")
    try:
        proc.wait_healthy()

        async def read(client: httpx.AsyncClient, max_tokens: int, started: asyncio.Event) -> str:
            body = {"prompt": "hello world", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                texts = r.aiter_text()
                first = await anext(texts)
                started.set()
                return first + "".join([text async for text in texts])

        async def main() -> tuple[str, str, float]:
            async with httpx.AsyncClient(base_url=proc.url, timeout=120) as client:
                events = asyncio.Event(), asyncio.Event()
                short = asyncio.ensure_future(read(client, 20, events[0]))
                long = asyncio.ensure_future(read(client, 2000, events[1]))
                await events[0].wait()
                await events[1].wait()
                proc.proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                return await short, await long, sent

        short, long, sent = asyncio.run(main())
        code = proc.proc.wait(timeout=60)
        elapsed = time.monotonic() - sent
        assert code == 0, proc.log_path.read_text()
        short_events, long_events = parse_sse(short), parse_sse(long)
        assert short_events[-1] == DONE and short_events[-2]["usage"]["completion_tokens"] == 20
        assert long_events[-1] == DONE and long_events[-2]["error"]["code"] == "aborted"
        assert 3 <= elapsed < 3 + 10, elapsed
        with pytest.raises(httpx.TransportError):
            httpx.get(proc.url + "/health", timeout=2)
    finally:
        proc.stop()


def test_bad_checkpoint_ends_serve_app_with_1(tmp_path, caplog):
    """The same path as the CLI, in this process: the engine fails to load, so the server stops with exit code 1."""
    from ddtree.engine import Engine, EngineConfig
    from ddtree.server.app import create_app
    from ddtree.server.cli import serve_app

    config = EngineConfig(target=str(tmp_path / "missing"), draft="none", device="cpu")
    app = create_app(engine_factory=lambda: Engine.from_config(config))
    assert serve_app(app, port=free_port(), log_level="warning") == 1
    assert "engine failed to start" in caplog.text and "missing" in caplog.text


def test_invalid_flag_is_a_usage_error_naming_it():
    """A wrong engine value is the CLI's usage error (exit 2) naming the flag and the rule, never a traceback."""
    out = subprocess.run([sys.executable, "-m", "ddtree.server", "--max-batch", "0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    text = " ".join(out.stderr.replace("│", " ").split())  # typer's error box, wrapped at any width
    assert "Invalid value for '--max-batch': max_batch must be an integer >= 1, got 0" in text
