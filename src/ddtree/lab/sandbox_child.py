"""The sandbox's child side: a stdlib-only bootstrap run as ``python -I sandbox_child.py SPEC_JSON``.

It is a script, not an import: :mod:`ddtree.lab.sandbox` starts it in a fresh interpreter so that every limit is
applied to a process that has run no untrusted code yet, and in an order that matters:

1. (parent, still privileged) ``unshare`` a new network, PID and IPC namespace. The network namespace has only a
   loopback interface that is down, so no socket can reach anything; the PID namespace means every process the
   program starts dies with the namespace's init.
2. Fork the namespace's init (PID 1). It stays privileged, sets ``PR_SET_PDEATHSIG`` so that killing the bootstrap
   kills it (and with it the whole namespace), forks the worker, and reports the worker's exit status and CPU time
   on the status pipe. Without a PID namespace the bootstrap itself plays this role.
3. The worker sets the resource limits (CPU seconds, address space, file size, core dumps, process count), drops to
   the sandbox's own uid/gid when started as root (so ``RLIMIT_NPROC`` applies -- root is exempt from it -- and
   the program can neither delete other users' files nor signal their processes), keeps only
   ``CAP_DAC_READ_SEARCH`` (the interpreter may live under a private home such as ``/root/.pyenv``; reads are
   therefore not confined, writes, deletions, signals, processes and network are), sets ``no_new_privs``, installs
   a socket guard if no network namespace could be made, reports what it achieved, closes the status pipe and
   runs the program with :func:`runpy.run_path` in its temporary working directory.

The status pipe carries one JSON object per line; the untrusted program never holds it, so it cannot forge them.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import runpy
import signal
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWIPC = 0x08000000

PR_SET_PDEATHSIG = 1
PR_SET_KEEPCAPS = 8
PR_SET_NO_NEW_PRIVS = 38

CAP_DAC_READ_SEARCH = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)),
           f"prctl({option})")


def _unshare(flags: int) -> bool:
    """True when the namespaces were created; False when the kernel or our privileges refuse."""
    return _libc.unshare(ctypes.c_int(flags)) == 0


def _keep_only_read_search() -> None:
    """After setuid with KEEPCAPS: effective = permitted = {CAP_DAC_READ_SEARCH}, inheritable = {}."""
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = 1 << CAP_DAC_READ_SEARCH
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def _socket_guard() -> None:
    """Fallback when no network namespace is possible: refuse to create sockets from Python.

    Weaker than a namespace (ctypes can still reach the syscall), which is why the isolation report says which one
    was used."""
    import _socket
    import socket

    class _BlockedSocket(_socket.socket):
        def __init__(self, *args, **kwargs):
            raise PermissionError("network access is disabled in the ddtree sandbox")

    socket.socket = _BlockedSocket  # type: ignore[misc]
    _socket.socket = _BlockedSocket  # type: ignore[misc]
    socket.socketpair = None  # type: ignore[assignment]
    socket.create_connection = None  # type: ignore[assignment]


def _report(fd: int, **fields) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def _supervise(spec: dict, status_fd: int, isolation: dict) -> int:
    """Fork the worker, wait for it, report its status; returns the exit code to pass on."""
    pid = os.fork()
    if pid == 0:
        _worker(spec, status_fd, isolation)  # never returns
    _, status, usage = os.wait4(pid, 0)
    cpu_s = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        _report(status_fd, kind="exit", exit_code=None, signal=sig, cpu_s=cpu_s, maxrss_kb=usage.ru_maxrss)
        return 128 + sig
    code = os.WEXITSTATUS(status)
    _report(status_fd, kind="exit", exit_code=code, signal=None, cpu_s=cpu_s, maxrss_kb=usage.ru_maxrss)
    return code


def _worker(spec: dict, status_fd: int, isolation: dict) -> None:
    try:
        cpu = int(spec["cpu_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the limit, SIGKILL a second later
        resource.setrlimit(resource.RLIMIT_AS, (spec["memory_bytes"], spec["memory_bytes"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["max_file_bytes"], spec["max_file_bytes"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        nproc = int(spec["nproc_base"]) + int(spec["max_processes"])
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        uid = spec["uid"]
        if uid is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            _prctl(PR_SET_KEEPCAPS, 1)
            os.setuid(uid)
            _keep_only_read_search()
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if not isolation["network_namespace"]:
            _socket_guard()
        isolation = dict(isolation, uid=os.getuid(), nproc_limit=nproc)
        _report(status_fd, kind="isolation", **isolation)
        os.close(status_fd)
        os.chdir(spec["workdir"])
    except BaseException as exc:  # the sandbox could not be set up: say so on stderr, never run the program
        sys.stderr.write(f"ddtree sandbox setup failed: {exc!r}\n")
        sys.stderr.flush()
        os._exit(125)
    sys.argv = [spec["program"]]
    sys.path.insert(0, spec["workdir"])
    code = 0
    try:
        runpy.run_path(spec["program"], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            sys.stderr.write(f"{exc.code}\n")
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        code = code or 1
    os._exit(code)


def main() -> None:
    spec = json.loads(sys.argv[1])
    status_fd = int(spec["status_fd"])
    os.set_inheritable(status_fd, True)
    namespaces = False
    if spec["namespaces"]:
        flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC
        if spec["uid"] is None and os.geteuid() != 0:
            real_uid, real_gid = os.getuid(), os.getgid()
            namespaces = _unshare(flags | CLONE_NEWUSER)
            if namespaces:  # identity maps, so files keep their owners and rlimits their user
                with open("/proc/self/setgroups", "w") as f:
                    f.write("deny")
                with open("/proc/self/uid_map", "w") as f:
                    f.write(f"{real_uid} {real_uid} 1")
                with open("/proc/self/gid_map", "w") as f:
                    f.write(f"{real_gid} {real_gid} 1")
        else:
            namespaces = _unshare(flags)
    isolation = {"network_namespace": namespaces, "pid_namespace": namespaces}
    if not namespaces:
        os._exit(_supervise(spec, status_fd, isolation))
    init = os.fork()
    if init == 0:
        # PID 1 of the new namespace: when it exits, the kernel kills every process left in the namespace.
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os._exit(_supervise(spec, status_fd, isolation))
    _, status = os.waitpid(init, 0)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
