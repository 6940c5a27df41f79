"""Run untrusted Python programs (model-written code) so that a hostile one fails only itself.

Each program runs in its own ``python -I`` process started through :mod:`ddtree.lab.sandbox_child`, which applies,
before any untrusted line runs:

- wall-clock limit (enforced here: the process group is killed), CPU-seconds limit (``RLIMIT_CPU``), address-space
  limit (``RLIMIT_AS``: allocations past it raise ``MemoryError``), file-size limit (``RLIMIT_FSIZE``, which also
  bounds what the program can print: stdout and stderr are files), no core dumps;
- a process-count limit (``RLIMIT_NPROC``). The kernel exempts root from it, so when we run as root every program
  gets its own unprivileged uid from a leased pool (``flock``-ed lock files, safe across processes): the limit then
  binds, a fork bomb stops at ``max_processes`` and the program cannot delete other users' files or signal their
  processes. Not running as root, the limit is counted on top of the user's current processes;
- no network: a new network namespace (only a loopback that is down). Where the kernel refuses namespaces, a
  socket guard refuses to create sockets from Python instead (weaker; reported);
- a new PID namespace: everything the program forks dies with it, even processes that called ``setsid``
  (as root, every process of the program's uid is killed after the run in any case; not root and without
  namespaces, only the program's process group is);
- a temporary working directory (removed afterwards), stdin from ``/dev/null``, a minimal environment.

What was achieved is reported per program in :class:`Isolation`, so a run can say how contained it was.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ddtree.errors import ConfigError

_CHILD = Path(__file__).with_name("sandbox_child.py")
# Unprivileged uids leased to programs when running as root: far above any login user's uid.
_UID_BASE = 1_900_000_000
_UID_POOL = 512
_LOCK_DIR = Path(tempfile.gettempdir()) / "ddtree-sandbox-uids"

Status = Literal["ok", "failed", "timeout", "cpu_limit", "memory", "killed", "sandbox_error"]


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits. The defaults suit HumanEval-style programs (stdlib only, fast tests)."""

    wall_s: float = 15.0
    cpu_s: int = 5
    # worst case of a fork-and-allocate bomb is max_processes x memory_bytes per program: keep the product small
    memory_bytes: int = 512 << 20
    max_processes: int = 8
    max_file_bytes: int = 16 << 20
    max_output_chars: int = 8000  # tail of stdout/stderr kept in the result
    namespaces: bool = True  # try network/PID namespaces (turn off to exercise the fallbacks)

    def validated(self) -> SandboxLimits:
        if not self.wall_s > 0:
            raise ConfigError(f"sandbox wall_s must be > 0, got {self.wall_s!r}")
        for name, lo in (("cpu_s", 1), ("memory_bytes", 64 << 20), ("max_processes", 1), ("max_file_bytes", 4096),
                         ("max_output_chars", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"sandbox {name} must be an integer >= {lo}, got {value!r}")
        return self


@dataclass(frozen=True)
class Isolation:
    """What the sandbox achieved for one program."""

    uid: int | None  # the uid the program ran as
    separate_uid: bool  # a uid of its own (process limit binding, other users' files and processes safe)
    network_namespace: bool  # else: the Python socket guard
    pid_namespace: bool
    nproc_limit: int | None


@dataclass(frozen=True)
class ProgramResult:
    """The outcome of one program. ``passed`` means it exited with status 0 within every limit."""

    passed: bool
    status: Status
    reason: str  # one line: "ok", "AssertionError: ...", "timeout after 15.0 s", "killed by SIGKILL", ...
    exit_code: int | None
    signal: int | None
    wall_s: float
    cpu_s: float | None
    stdout: str
    stderr: str
    isolation: Isolation | None


def run_program(code: str, limits: SandboxLimits = SandboxLimits()) -> ProgramResult:
    """Run one program (source text) in the sandbox and report how it ended."""
    limits = limits.validated()
    with _UidLease() as uid:
        return _run_in_sandbox(code, limits, uid)


def run_programs(codes: Sequence[str], limits: SandboxLimits = SandboxLimits(), *,
                 parallel: int | None = None) -> list[ProgramResult]:
    """Run many programs, ``parallel`` at a time (default: the CPU count), results in input order."""
    limits = limits.validated()
    workers = max(1, min(parallel or os.cpu_count() or 1, len(codes) or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda c: run_program(c, limits), codes))


class _UidLease:
    """An exclusive unprivileged uid for one program (root only), held by an ``flock`` on a lock file."""

    def __init__(self) -> None:
        self.uid: int | None = None
        self._fd: int | None = None

    def __enter__(self) -> int | None:
        if os.geteuid() != 0:
            return None
        _LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        for _attempt in range(200):
            for i in range(_UID_POOL):
                uid = _UID_BASE + i
                fd = os.open(_LOCK_DIR / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                if _uid_is_named(uid):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                    continue
                self.uid, self._fd = uid, fd
                _kill_uid(uid)  # leftovers of a crashed run that held this uid
                return uid
            time.sleep(0.05)
        raise RuntimeError(f"no free sandbox uid in [{_UID_BASE}, {_UID_BASE + _UID_POOL}) after waiting")

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)


def _uid_is_named(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _pids_of_uid(uid: int) -> list[int]:
    """Processes whose real uid is ``uid`` (scanned from /proc; the sandbox's uids run nothing else)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(entry.name))
                        break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left (bounded by its process limit)."""
    for _ in range(100):
        pids = _pids_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    raise RuntimeError(f"could not kill the processes of sandbox uid {uid}: {_pids_of_uid(uid)}")


def _count_tasks_of(uid: int) -> int:
    """Threads of ``uid`` (what ``RLIMIT_NPROC`` counts), for the non-root limit: current tasks + the budget."""
    tasks = 0
    for pid in _pids_of_uid(uid):
        try:
            with open(f"/proc/{pid}/status") as f:
                tasks += next((int(line.split()[1]) for line in f if line.startswith("Threads:")), 1)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return tasks



def _run_in_sandbox(code: str, limits: SandboxLimits, uid: int | None) -> ProgramResult:
    outer = Path(tempfile.mkdtemp(prefix="ddtree-sbx-"))
    try:
        os.chmod(outer, 0o711)  # the program's uid may traverse, not list
        work = outer / "work"
        work.mkdir(mode=0o700)
        program = work / "program.py"
        program.write_text(code)
        if uid is not None:
            os.chown(work, uid, uid)
            os.chown(program, uid, uid)
        stdout_path, stderr_path = outer / "stdout", outer / "stderr"
        read_fd, write_fd = os.pipe()
        spec = {
            "program": str(program),
            "workdir": str(work),
            "uid": uid,
            "gid": uid,
            "cpu_s": limits.cpu_s,
            "memory_bytes": limits.memory_bytes,
            "max_file_bytes": limits.max_file_bytes,
            "max_processes": limits.max_processes,
            "nproc_base": 0 if uid is not None else _count_tasks_of(os.getuid()),
            "status_fd": write_fd,
            "namespaces": limits.namespaces,
        }
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work), "TMPDIR": str(work)}
        start = time.monotonic()
        timed_out = False
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", str(_CHILD), json.dumps(spec)],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=str(work),
                    pass_fds=(write_fd,), start_new_session=True,
                )
            finally:
                os.close(write_fd)
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                proc.wait()
        wall = time.monotonic() - start
        if uid is not None:
            _kill_uid(uid)  # anything that escaped the process group (and the PID namespace, if there was none)
        else:
            _kill_group(proc.pid)
        status_lines = _read_all(read_fd)
        stdout = _tail(stdout_path, limits.max_output_chars)
        stderr = _tail(stderr_path, limits.max_output_chars)
        return _classify(status_lines, proc.returncode, timed_out, wall, stdout, stderr, limits, uid)
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_all(fd: int) -> list[dict]:
    os.set_blocking(fd, False)
    chunks = []
    try:
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(fd)
    lines = []
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return lines


def _tail(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 4 * limit))
        text = f.read().decode(errors="replace")
    return text[-limit:] if limit else ""


def _last_error_line(stderr: str) -> str:
    for line in reversed(stderr.strip().splitlines()):
        line = line.strip()
        if line:
            return line[:300]
    return ""


def _classify(status_lines: list[dict], returncode: int, timed_out: bool, wall: float, stdout: str, stderr: str,
              limits: SandboxLimits, uid: int | None) -> ProgramResult:
    iso = next((s for s in status_lines if s.get("kind") == "isolation"), None)
    exit_ = next((s for s in status_lines if s.get("kind") == "exit"), None)
    isolation = None
    if iso is not None:
        isolation = Isolation(uid=iso.get("uid"), separate_uid=uid is not None and iso.get("uid") == uid,
                              network_namespace=bool(iso.get("network_namespace")),
                              pid_namespace=bool(iso.get("pid_namespace")), nproc_limit=iso.get("nproc_limit"))
    exit_code = exit_["exit_code"] if exit_ else (returncode if returncode is not None and returncode >= 0 else None)
    sig = exit_["signal"] if exit_ else None
    cpu = exit_["cpu_s"] if exit_ else None
    last = _last_error_line(stderr)

    def result(passed: bool, status: Status, reason: str) -> ProgramResult:
        return ProgramResult(passed=passed, status=status, reason=reason, exit_code=exit_code, signal=sig,
                             wall_s=round(wall, 4), cpu_s=cpu, stdout=stdout, stderr=stderr, isolation=isolation)

    if iso is None and not timed_out:
        return result(False, "sandbox_error", last or f"sandbox did not start (exit status {returncode})")
    if timed_out:
        return result(False, "timeout", f"timeout after {limits.wall_s:g} s wall time")
    if sig is not None:
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu is not None and cpu >= limits.cpu_s):
            return result(False, "cpu_limit", f"CPU time limit of {limits.cpu_s} s exceeded")
        if sig == signal.SIGXFSZ:
            return result(False, "killed", f"file size limit of {limits.max_file_bytes} bytes exceeded (SIGXFSZ)")
        return result(False, "killed", f"killed by {signal.Signals(sig).name}")
    if exit_code == 0:
        return result(True, "ok", "ok")
    if "[Errno 27]" in last:  # EFBIG: Python ignores SIGXFSZ, so the write past RLIMIT_FSIZE raises instead
        return result(False, "failed", f"file size limit of {limits.max_file_bytes} bytes exceeded ({last})")
    if "MemoryError" in last:
        return result(False, "memory", f"memory limit of {limits.memory_bytes >> 20} MiB exceeded (MemoryError)")
    return result(False, "failed", last or f"exit status {exit_code}")
