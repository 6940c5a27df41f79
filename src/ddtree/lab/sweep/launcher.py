"""Start an external inference server per configuration, wait until it really answers, and stop it for good.

Used by ``ddtree sweep --launch`` for engines that need a restart per setting (SGLang, vLLM, or ``ddtree serve``
itself). The life of one launch:

1. the port must be free before the command starts (so nothing already listening can be mistaken for it);
2. the command runs in its own session / process group (``start_new_session``), stdin closed, stdout and stderr
   appended to the config's ``server.log``;
3. readiness: ``GET /health`` answers 200, then a one-token generation succeeds (SGLang and vLLM answer
   ``/health`` before the model can generate); a launch that exits or is not ready by the timeout fails;
4. identity: the process listening on the port is looked up through ``/proc/net/tcp{,6}`` and the socket inodes in
   ``/proc/<pid>/fd``: it must be in the launched session or have started after the launch (a container proxy
   spawned by the command); where ``/proc`` does not show it (another network namespace), the weaker evidence
   is recorded instead: the port was free at launch and the launched process is alive when it answers;
5. stop: SIGTERM to the whole group, SIGKILL to whatever is left after ``stop_timeout_s``, then wait until the
   port is free again so the next configuration can bind it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ddtree.errors import DDTreeError


class LaunchError(DDTreeError, RuntimeError):
    """A launched server did not come up (exited, timed out, or another process answered on its port).

    Not an EngineError: no engine ran (EngineError is a request failing inside a running engine)."""


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on ``host:port`` (connections in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel considers free right now (the launched server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_port_free(port: int, timeout_s: float, host: str = "127.0.0.1") -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if port_is_free(port, host):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------ /proc look-ups
def listening_inodes(port: int) -> set[int]:
    """Socket inodes listening on ``port`` (any address, IPv4 or IPv6) in this network namespace."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "0A":  # 0A = TCP_LISTEN
                continue
            if int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(cols[9]))
    return inodes


def socket_owners(inodes: set[int]) -> list[int]:
    """PIDs holding any of the socket ``inodes`` open (those whose fds we may read)."""
    wanted = {f"socket:[{i}]" for i in inodes}
    owners: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    owners.append(int(entry.name))
                    break
        except OSError:
            continue
    return owners


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` fields after the command name (index 0 = state, 2 = pgrp, 19 = starttime)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def process_start_ticks(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``; zombies are dead even if not yet reaped."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields and int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def stop_stale(record: dict[str, Any], timeout_s: float = 30.0) -> bool:
    """Stop the process group of an earlier launch that outlived its sweep (a SIGKILLed sweep cannot stop it).

    Only a process whose PID *and* start time match the record is touched, so a recycled PID is never signalled.
    Returns True when a live group was found and stopped."""
    pid, ticks = record.get("pid"), record.get("start_ticks")
    if not pid or ticks is None or process_start_ticks(pid) != ticks or not group_members(pid):
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + (timeout_s if sig == signal.SIGTERM else 5.0)
        while group_members(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not group_members(pid):
            break
    return True


# ------------------------------------------------------------------------------------------ the launcher
@dataclass
class LaunchRecord:
    """What one launch did; stored in the config's ``config.json``."""

    command: str
    port: int
    pid: int | None = None
    started_at: float | None = None
    load_to_ready_s: float | None = None
    start_ticks: int | None = None  # /proc start time of the launched process: tells it apart from a reused PID
    verified: str | None = None  # "process-group", "started-after-launch" or "port-free-and-alive"
    listener_pids: list[int] = field(default_factory=list)
    served_model: str | None = None
    returncode: int | None = None
    stop_signal: str | None = None  # "SIGTERM" when it stopped in time, "SIGKILL" when it had to be killed
    port_freed: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class LaunchedServer:
    """Context manager around one launched server: ``with LaunchedServer(cmd, ...) as server: server.url``.

    On entry it starts the command and returns once the server is ready and verified (or raises
    :class:`LaunchError` after stopping what it started); on exit it stops the whole process group."""

    def __init__(
        self,
        command: str,
        *,
        port: int,
        log_path: Path,
        ready_timeout_s: float = 900.0,
        stop_timeout_s: float = 30.0,
        host: str = "127.0.0.1",
        model: str | None = None,
        poll_interval_s: float = 0.25,
        env: dict[str, str] | None = None,
        on_start: Callable[[LaunchRecord], None] | None = None,
    ) -> None:
        self.command = command
        self.argv = shlex.split(command)
        if not self.argv:
            raise LaunchError("the launch command is empty")
        self.port = port
        self.host = host
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.poll_interval_s = poll_interval_s
        self.model = model
        self.env = env
        self.on_start = on_start  # e.g. persist the PID at once, so a killed sweep's orphan can be found later
        self.record = LaunchRecord(command=command, port=port)
        self._proc: subprocess.Popen[bytes] | None = None
        self._start_ticks: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> LaunchedServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ start
    def start(self) -> None:
        if not port_is_free(self.port, self.host):
            raise LaunchError(
                f"port {self.port} is already in use before launching; stop whatever listens there or pick "
                "another port (a server already answering could be mistaken for the launched one)"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n# ddtree sweep {time.strftime('%Y-%m-%d %H:%M:%S')}: {self.command}\n".encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=self.env,
                )
            except OSError as exc:
                raise LaunchError(f"could not start {self.argv[0]!r}: {exc}") from None
        self.record.pid = self._proc.pid
        self.record.started_at = time.time()
        self._started_mono = time.monotonic()
        self._start_ticks = process_start_ticks(self._proc.pid)
        self.record.start_ticks = self._start_ticks
        if self.on_start is not None:
            self.on_start(self.record)

    def wait_ready(self) -> None:
        """Poll until ``/health`` and a one-token generation succeed; raise on exit or timeout."""
        assert self._proc is not None, "start() first"
        deadline = self._started_mono + self.ready_timeout_s
        last = "no answer yet"
        with httpx.Client(base_url=self.url, timeout=httpx.Timeout(10.0, connect=2.0), trust_env=False) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise LaunchError(
                        f"the launched server exited with code {code} before becoming ready; "
                        f"see {self.log_path}:\n{self.log_tail()}"
                    )
                if time.monotonic() >= deadline:
                    raise LaunchError(
                        f"the launched server was not ready after {self.ready_timeout_s:g} s ({last}); "
                        f"raise the launch timeout or see {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    last = self._probe(client)
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if last == "ready":
                    break
                time.sleep(self.poll_interval_s)
        self._verify_identity()
        self.record.load_to_ready_s = time.monotonic() - self._started_mono

    def _probe(self, client: httpx.Client) -> str:
        health = client.get("/health")
        if health.status_code != 200:
            return f"/health answered {health.status_code}"
        model = self.model or self._served_model(client)
        body: dict[str, Any] = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
        if model:
            body["model"] = model
        gen = client.post("/v1/completions", json=body)
        if gen.status_code == 404:  # chat-only servers
            chat = {k: v for k, v in body.items() if k != "prompt"}
            chat["messages"] = [{"role": "user", "content": "Hello"}]
            gen = client.post("/v1/chat/completions", json=chat)
        if gen.status_code != 200:
            return f"one-token generation answered {gen.status_code}: {gen.text[:200]}"
        choices = gen.json().get("choices")
        if not choices:
            return "one-token generation returned no choices"
        self.record.served_model = model
        return "ready"

    def _served_model(self, client: httpx.Client) -> str | None:
        resp = client.get("/v1/models")
        if resp.status_code != 200:
            return None
        data = resp.json().get("data") or []
        return data[0].get("id") if data else None

    def _verify_identity(self) -> None:
        """Check that the process answering on the port is the one we launched (see the module docstring)."""
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise LaunchError(
                f"something answered on port {self.port} but the launched process exited "
                f"(code {self._proc.returncode}); see {self.log_path}"
            )
        owners = socket_owners(listening_inodes(self.port)) if Path("/proc/net/tcp").exists() else []
        self.record.listener_pids = owners
        if not owners:
            self.record.verified = "port-free-and-alive"
            return
        sid = self._proc.pid  # start_new_session: the child leads its session and group
        for pid in owners:
            with contextlib.suppress(OSError):
                if os.getsid(pid) == sid:
                    self.record.verified = "process-group"
                    return
        launched = self._start_ticks
        for pid in owners:
            ticks = process_start_ticks(pid)
            if launched is not None and ticks is not None and ticks >= launched:
                self.record.verified = "started-after-launch"
                return
        described = ", ".join(f"{pid} ({_command_line(pid)[:80]})" for pid in owners)
        raise LaunchError(
            f"port {self.port} is answered by PID {described}, which was running before this launch; "
            "it is not the launched server: stop it or use another port"
        )

    # ------------------------------------------------------------------------------------------ stop
    def stop(self) -> None:
        """SIGTERM the group, SIGKILL what is left after ``stop_timeout_s``, reap, wait for the port."""
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid
        self.record.stop_signal = "SIGTERM"
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=self.stop_timeout_s)
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None or group_members(pgid):
            self.record.stop_signal = "SIGKILL"
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            proc.wait()
            gone_by = time.monotonic() + 5.0  # SIGKILL is delivered asynchronously to the other members
            while group_members(pgid) and time.monotonic() < gone_by:
                time.sleep(0.02)
        self.record.returncode = proc.returncode
        self.record.port_freed = wait_port_free(self.port, self.stop_timeout_s, self.host)
        self._proc = None

    def alive(self) -> bool:
        """Whether the launched process is still running (a crash mid-sweep fails the remaining cells fast)."""
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


__all__ = [
    "LaunchError",
    "LaunchRecord",
    "LaunchedServer",
    "free_port",
    "port_is_free",
    "stop_stale",
    "wait_port_free",
]
