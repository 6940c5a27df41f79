"""The launcher against real processes: a small stdlib HTTP server script written by the test.

The script answers ``/health`` with 503 for its first ``delay`` seconds (like SGLang and vLLM while loading), can
fork a child that ignores SIGTERM (so only SIGKILL of the whole group stops it), and serves a one-token
completion. Everything here is real: process groups, signals, ports and /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddtree.lab.sweep import launcher
from ddtree.lab.sweep.launcher import LaunchedServer, LaunchError, free_port, port_is_free

SERVER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    port, delay, stubborn_child = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
    started = time.time()
    if stubborn_child and os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(sys.argv[4], "w") as fh:
            fh.write(str(os.getpid()))
        time.sleep(600)
        os._exit(0)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            print(self.requestline, flush=True)

        def reply(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self.reply(200 if time.time() - started >= delay else 503, {})
            elif self.path == "/v1/models":
                self.reply(200, {"data": [{"id": "tiny-served"}]})
            else:
                self.reply(404, {})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.reply(200, {"choices": [{"text": "x", "finish_reason": "length"}]})

    print("listening", port, flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def server_script(tmp_path) -> Path:
    path = tmp_path / "mini_server.py"
    path.write_text(SERVER)
    return path


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ready_verified_then_whole_group_killed(server_script, tmp_path):
    port = free_port()
    child_pid_file = tmp_path / "child.pid"
    cmd = f"{sys.executable} {server_script} {port} 0.6 1 {child_pid_file}"
    log = tmp_path / "server.log"
    server = LaunchedServer(cmd, port=port, log_path=log, ready_timeout_s=30, stop_timeout_s=1.0)
    with server:
        rec = server.record
        assert rec.load_to_ready_s is not None and rec.load_to_ready_s >= 0.6  # waited for /health to turn 200
        assert rec.verified == "process-group" and rec.listener_pids == [rec.pid]
        assert rec.served_model == "tiny-served"
        assert server.alive()
        child = int(child_pid_file.read_text())
        assert _alive(child)
    assert not _alive(child)  # ignored SIGTERM, so the group got SIGKILL
    assert server.record.stop_signal == "SIGKILL"
    assert server.record.port_freed and port_is_free(port)
    text = log.read_text()
    assert "GET /health" in text and "POST /v1/completions" in text and cmd in text  # stdout kept per config


def test_graceful_stop_uses_sigterm_only(server_script, tmp_path):
    port = free_port()
    server = LaunchedServer(f"{sys.executable} {server_script} {port} 0 0", port=port,
                            log_path=tmp_path / "s.log", stop_timeout_s=5.0)
    with server:
        pid = server.record.pid
    assert server.record.stop_signal == "SIGTERM" and server.record.returncode == -signal.SIGTERM
    assert not _alive(pid)


def test_never_ready_times_out_and_is_stopped(server_script, tmp_path):
    port = free_port()
    server = LaunchedServer(f"{sys.executable} {server_script} {port} 3600 0", port=port,
                            log_path=tmp_path / "s.log", ready_timeout_s=1.0, stop_timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="not ready after 1 s.*/health answered 503"):
        with server:
            pass
    assert time.monotonic() - t0 < 10
    assert not _alive(server.record.pid) and port_is_free(port)


def test_exit_before_ready_reports_code_and_log(tmp_path):
    port = free_port()
    cmd = f"{sys.executable} -c \"import sys; print('cannot load weights'); sys.exit(3)\""
    with pytest.raises(LaunchError, match="exited with code 3(.|\\n)*cannot load weights"):
        with LaunchedServer(cmd, port=port, log_path=tmp_path / "s.log", ready_timeout_s=30):
            pass


def test_busy_port_is_refused_before_launch(server_script, tmp_path):
    port = free_port()
    squatter = subprocess.Popen([sys.executable, str(server_script), str(port), "0", "0"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while port_is_free(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(LaunchError, match="already in use"):
            with LaunchedServer("sleep 30", port=port, log_path=tmp_path / "s.log"):
                pass
    finally:
        squatter.kill()
        squatter.wait()


def test_a_server_running_before_the_launch_is_not_mistaken_for_it(server_script, tmp_path, monkeypatch):
    # The port check and the launch race: simulate losing the race (the squatter holds the port, the check says
    # free). The launched command never listens; the squatter answers /health; the identity check must refuse it.
    port = free_port()
    squatter = subprocess.Popen([sys.executable, str(server_script), str(port), "0", "0"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while port_is_free(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.05)
        monkeypatch.setattr(launcher, "port_is_free", lambda port, host="127.0.0.1": True)
        with pytest.raises(LaunchError, match=f"answered by PID {squatter.pid}.*running before this launch"):
            with LaunchedServer("sleep 30", port=port, log_path=tmp_path / "s.log", ready_timeout_s=20,
                                stop_timeout_s=2.0):
                pass
        assert squatter.poll() is None  # not ours: never signalled
    finally:
        squatter.kill()
        squatter.wait()


def test_sigkilled_group_leaves_no_process_behind(server_script, tmp_path):
    port = free_port()
    server = LaunchedServer(f"{sys.executable} {server_script} {port} 0 1 {tmp_path / 'c.pid'}", port=port,
                            log_path=tmp_path / "s.log", stop_timeout_s=0.5)
    with server:
        pgid = server.record.pid
    assert launcher.group_members(pgid) == []  # the leader and the SIGTERM-proof child are both gone
    with pytest.raises(ProcessLookupError):
        os.kill(pgid, 0)  # and the leader was reaped, not left a zombie


def test_an_orphan_of_a_killed_sweep_is_stopped_but_a_recycled_pid_is_not(server_script, tmp_path):
    port = free_port()
    persisted = []
    server = LaunchedServer(f"{sys.executable} {server_script} {port} 0 0", port=port, log_path=tmp_path / "s.log",
                            on_start=lambda record: persisted.append(record.to_dict()))
    server.start()  # as if the sweep were SIGKILLed now: nobody will call stop()
    server.wait_ready()
    try:
        record = persisted[0]  # what the sweep wrote to config.json the moment the process started
        assert record["pid"] == server.record.pid and record["start_ticks"] is not None
        assert not launcher.stop_stale({**record, "start_ticks": record["start_ticks"] - 1})  # another process
        assert server.alive()
        assert launcher.stop_stale(record, timeout_s=5.0)
        assert launcher.group_members(record["pid"]) == []
        assert launcher.wait_port_free(port, 10.0)
        assert not launcher.stop_stale(record)  # nothing left to stop
    finally:
        server.stop()
