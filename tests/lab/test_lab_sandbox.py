"""The sandbox: hostile programs fail only themselves, and the run says how each ended.

The hostile batch runs in parallel with harmless programs: those must still pass, nothing outside the sandbox
may change, and no process of the sandbox may survive. Guarantees that need root (a uid of the program's own,
which makes the process limit bind and protects other users' files) are asserted only when running as root.
"""

from __future__ import annotations

import os
import socket
import textwrap
import time

import pytest

from ddtree.errors import ConfigError
from ddtree.lab import sandbox
from ddtree.lab.sandbox import SandboxLimits, run_program, run_programs

ROOT = os.geteuid() == 0
LIMITS = SandboxLimits(wall_s=6.0, cpu_s=2, memory_bytes=256 << 20, max_processes=12)


def _survivors(*results) -> list[int]:
    """Processes still running under the uids the given programs ran as (root only: else they share ours), of the
    uids no sandboxed program holds now. Why the lock: a uid goes back to the machine's pool when its program ends,
    and another test worker's program (a coding gate beside this test under ``pytest -n``) may run under it by the
    time this looks; a uid taken again is cleared of leftovers by its next holder (``sandbox._kill_uid``)."""
    import fcntl

    uids = {r.isolation.uid for r in results if r.isolation is not None and r.isolation.separate_uid}
    out = []
    for uid in sorted(uids):
        fd = os.open(sandbox._LOCK_DIR / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # held by a program running now
            out += sandbox._pids_of_uid(uid)
        finally:
            os.close(fd)  # closing releases the lock
    return out


@pytest.mark.slow
def test_hostile_programs_are_contained(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.chmod(tmp_path, 0o755)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    programs = {
        "ok_before": "print(sum(range(10)))",
        "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
        "infinite_loop": "while True:\n    pass\n",
        "sleeper": "import time\ntime.sleep(1000)\n",
        "memory_hog": "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n",
        "deleter": f"import os, shutil\nos.remove({str(victim)!r})\n",
        "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n",
        "killer": f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\n",
        "escaper": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\n",
        "ok_after": "assert [1, 2][::-1] == [2, 1]",
    }
    start = time.monotonic()
    results = dict(zip(programs, run_programs(list(programs.values()), LIMITS, parallel=2), strict=True))
    elapsed = time.monotonic() - start

    assert results["ok_before"].passed and results["ok_before"].stdout == "45\n"
    assert results["ok_after"].passed
    assert results["escaper"].passed  # exits 0, leaving a setsid() child behind: killed below
    assert not any(r.passed for name, r in results.items() if not name.startswith("ok_") and name != "escaper")
    assert results["infinite_loop"].status == "cpu_limit"
    assert results["sleeper"].status == "timeout" and results["sleeper"].wall_s < LIMITS.wall_s + 3
    assert results["memory_hog"].status == "memory"
    assert "Error" in results["socket"].reason  # unreachable network (namespace) or refused socket (guard)
    assert results["killer"].status == "failed"  # the test process is not visible or not signalable from inside
    assert victim.read_text() == "keep me"
    try:
        conn, _ = listener.accept()
        conn.close()
        raise AssertionError("a sandboxed program reached a socket of the host")
    except TimeoutError:
        pass
    finally:
        listener.close()
    assert elapsed < 40
    assert _survivors(*results.values()) == []

    if ROOT:
        fork = results["fork_bomb"]
        # stopped by the process limit (the bomb's children interleave their tracebacks, so read all of stderr)
        assert fork.status == "failed" and "BlockingIOError" in fork.stderr
        assert "PermissionError" in results["deleter"].reason
        for r in results.values():
            assert r.isolation is not None and r.isolation.separate_uid
            assert r.isolation.nproc_limit == LIMITS.max_processes


def test_escaped_session_leader_is_killed():
    # A passing program that leaves a setsid() child behind: the child must not outlive the run.
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\nprint('parent done')\n"
    result = run_program(code, LIMITS)
    assert result.passed and result.stdout == "parent done\n"
    assert _survivors(result) == []


def test_working_directory_stdin_and_environment():
    code = textwrap.dedent("""
        import os, sys
        open("scratch.txt", "w").write("x" * 10)
        assert open("scratch.txt").read() == "x" * 10
        assert sys.stdin.read() == ""
        assert os.environ.get("HOME") == os.getcwd()
        assert "PYTHONPATH" not in os.environ
        assert sys.flags.isolated == 1
        print(os.getcwd())
    """)
    result = run_program(code, LIMITS)
    assert result.passed, result.stderr
    workdir = result.stdout.strip()
    assert not os.path.exists(workdir)  # removed after the run


def test_failures_are_reported_with_their_last_line():
    assert run_program("raise ValueError('bad value 7')", LIMITS).reason == "ValueError: bad value 7"
    syntax = run_program("def broken(:\n    pass", LIMITS)
    assert syntax.status == "failed" and "SyntaxError" in syntax.reason
    exit3 = run_program("import sys; sys.exit(3)", LIMITS)
    assert exit3.exit_code == 3 and not exit3.passed
    assert run_program("import sys; sys.exit(0)", LIMITS).passed


def test_output_limit_bounds_what_a_program_can_write():
    limits = SandboxLimits(wall_s=10, cpu_s=5, max_file_bytes=1 << 20, max_output_chars=100)
    result = run_program("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n", limits)
    assert not result.passed and "file size limit" in result.reason
    assert len(result.stdout) <= 100


def test_socket_guard_without_namespaces():
    limits = SandboxLimits(wall_s=6, cpu_s=2, namespaces=False)
    result = run_program("import socket\nsocket.socket()\n", limits)
    assert result.isolation is not None and not result.isolation.network_namespace
    assert "network access is disabled" in result.reason
    assert run_program("print('fine')", limits).passed


@pytest.mark.skipif(not ROOT, reason="a uid of the program's own needs root")
def test_process_limit_binds_per_program():
    code = textwrap.dedent("""
        import os, time
        children = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                children += 1
        except BlockingIOError:
            print(children)
    """)
    result = run_program(code, SandboxLimits(wall_s=10, cpu_s=5, max_processes=5))
    assert result.passed, result.stderr
    assert int(result.stdout) == 4  # five processes in all: the program and four children
    assert _survivors(result) == []


def test_limits_validation():
    for bad in (dict(wall_s=0), dict(cpu_s=0), dict(memory_bytes=1000), dict(max_processes=0)):
        with pytest.raises(ConfigError):
            SandboxLimits(**bad).validated()


@pytest.mark.skipif(not ROOT, reason="uids are leased only when running as root")
def test_concurrent_programs_get_different_uids():
    with sandbox._UidLease() as first, sandbox._UidLease() as second:
        assert first != second and first >= sandbox._UID_BASE and second >= sandbox._UID_BASE
