"""``/health`` during the start-up warm-up, on a real uvicorn process: 503 with the warm-up's progress as the reason
("warming up: 1/3 graphs") until the plan has run, then 200, and ``/server_info`` reports the warm-up.

On the CPU the plan is empty, so the server under test replaces its engine's warm-up steps with three steps that
each wait for a file the test creates (a hook, not a timer): the test watches every state of the same machine a
CUDA warm-up goes through, one step at a time, and no assertion depends on how long anything takes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port

SERVER = textwrap.dedent('''
    import sys, time
    from pathlib import Path

    import uvicorn

    from ddtree.engine import Engine, EngineConfig, TreeSettings
    from ddtree.engine.warmup import WarmupStep
    from ddtree.server import create_app

    target, draft, gates, port = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])

    def gate(i):
        def wait():
            for _ in range(6000):  # bounded: 10 minutes at most
                if (gates / f"gate{i}").exists():
                    return
                time.sleep(0.1)
            raise TimeoutError(f"gate{i} never opened")
        return wait

    def factory():
        engine = Engine.from_config(EngineConfig(target=target, draft=draft, device="cpu", max_batch=2, max_len=64,
                                                 max_budget=8, default_tree=TreeSettings(budget=4)))
        engine.warmup.steps = [WarmupStep(f"test step {i}", gate(i)) for i in range(3)]
        return engine

    uvicorn.run(create_app(engine_factory=factory), host="127.0.0.1", port=port, log_level="warning")
''')


def _health(url: str) -> tuple[int, dict] | None:
    try:
        r = httpx.get(url + "/health", timeout=2)
    except httpx.TransportError:
        return None
    return r.status_code, r.json()


def _wait_for(url: str, want, proc: subprocess.Popen, log: Path) -> tuple[int, dict]:
    """Poll /health until ``want(status, body)``; bounded so a broken server fails the test instead of hanging it."""
    for _ in range(3000):
        assert proc.poll() is None, f"server exited:\n{log.read_text()}"
        seen = _health(url)
        if seen is not None and want(*seen):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"/health never satisfied the condition; last {seen}:\n{log.read_text()}")


@pytest.mark.slow
def test_health_reports_warm_up_progress_then_ready(tiny_model_dirs, tmp_path):
    target, draft = tiny_model_dirs
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd() / "src"), os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(script), str(target), str(draft), str(tmp_path), str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        seen = [_wait_for(url, lambda s, b: "warming up" in b.get("message", ""), proc, log)]
        assert seen[0] == (503, {"status": "starting", "message": "warming up: 0/3 graphs"})
        for i in range(3):
            (tmp_path / f"gate{i}").touch()
            if i < 2:
                seen.append(_wait_for(url, lambda s, b, i=i: f"{i + 1}/3" in b.get("message", ""), proc, log))
                assert seen[-1] == (503, {"status": "starting", "message": f"warming up: {i + 1}/3 graphs"})
        assert _wait_for(url, lambda s, b: s == 200, proc, log) == (200, {"status": "ok"})
        info = httpx.get(url + "/server_info", timeout=5).json()["engine"]["warmup"]
        assert info["state"] == "done" and info["graphs_planned"] == 3 and info["graphs_done"] == 3
        assert info["dropped"] == 0 and info["misses"]["round_graphs"] == 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
