"""The child side of the local sandbox: isolate, limit, drop privileges, exec.

`LocalSandbox` runs this file as `python -I -S _launcher.py FD`, as the leader
of a new process group with no controlling terminal, with the workspace as cwd
and a fixed clean environment. FD holds a JSON spec. Standard library only,
nothing of Assay: it must start fast and must not import code a command could
have touched.

In order:

1. `unshare` the namespaces asked for: a network namespace (only a loopback,
   brought up, so nothing of the host is reachable), a PID namespace, and —
   when not root — a user namespace that makes the other two possible.
2. With a PID namespace, fork: the child is PID 1 of the namespace and runs
   the command as PID 2; when the command ends, PID 1 reports how and exits,
   and the kernel kills every process left in the namespace, even ones that
   left the process group. The launcher exits as the command did.
3. For the command: default signal handling, resource limits, then drop to
   the sandbox's uid/gid (when started as root), a parent-death signal, and
   `execvpe`.

Exit codes of its own: 125 the sandbox could not be set up, 126 the command
could not be executed, 127 it was not found. A probe spec stops before exec.
"""

import ctypes
import fcntl
import json
import os
import resource
import signal
import socket
import struct
import sys
from typing import Any, NoReturn

CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
LIMITS = {
    "cpu": resource.RLIMIT_CPU,
    "as": resource.RLIMIT_AS,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
    "core": resource.RLIMIT_CORE,
}


def fail(code: int, what: str) -> NoReturn:
    """Report a setup failure on stderr and leave with `code`."""
    try:
        os.write(2, f"assay-sandbox: {what}\n".encode())
    finally:
        os._exit(code)


def libc_call(name: str, *args: int) -> None:
    """Call a libc function, raising OSError on -1."""
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def write_proc(path: str, text: str) -> None:
    """Write one of /proc/self's id-map files."""
    with open(path, "w") as f:
        f.write(text)


def loopback_up() -> None:
    """Bring up `lo` of the new network namespace (it starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def isolate(spec: dict[str, Any]) -> None:
    """Enter the namespaces the spec asks for."""
    flags = (CLONE_NEWNET if spec["net"] else 0) | (CLONE_NEWPID if spec["pid"] else 0)
    if not flags:
        return
    uid, gid = os.getuid(), os.getgid()
    if spec["userns"]:
        flags |= CLONE_NEWUSER
    libc_call("unshare", flags)
    if spec["userns"]:
        write_proc("/proc/self/setgroups", "deny")
        write_proc("/proc/self/uid_map", f"{uid} {uid} 1")
        write_proc("/proc/self/gid_map", f"{gid} {gid} 1")
    if spec["net"]:
        loopback_up()


def child(spec: dict[str, Any]) -> NoReturn:
    """Limit, drop privileges and exec the command (never returns)."""
    try:
        # Python ignores SIGPIPE and SIGXFSZ; the command gets the defaults back.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGXCPU):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        for name, value in spec["limits"].items():
            if name == "cpu":
                # The soft limit sends SIGXCPU, the hard one a second later SIGKILL.
                resource.setrlimit(LIMITS[name], (value, value + 1))
            else:
                resource.setrlimit(LIMITS[name], (value, value))
        if spec["uid"] is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        libc_call("prctl", PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if not spec["pid"] and os.getppid() != spec["parent"]:
            fail(125, "the Assay process is gone")
    except OSError as exc:
        fail(125, f"cannot apply limits or drop privileges: {exc}")
    if spec["probe"]:
        os._exit(0)
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except FileNotFoundError:
        fail(127, f"{argv[0]}: command not found")
    except OSError as exc:
        fail(126, f"{argv[0]}: cannot execute: {exc.strerror}")


def reap(pid: int) -> int:
    """Wait for `pid`, reaping any other child on the way; its wait status."""
    while True:
        try:
            reaped, status = os.waitpid(-1, 0)
        except ChildProcessError:
            fail(125, "the command vanished")
        except InterruptedError:
            continue
        if reaped == pid:
            return status


def init(spec: dict[str, Any], report: int) -> NoReturn:
    """PID 1 of the namespace: run the command as PID 2, report how it ended, exit.

    The command is not PID 1 itself because the kernel drops signals a PID 1
    has no handler for (SIGXCPU, SIGTERM...). When this exits, the kernel
    kills whatever is left in the namespace.
    """
    try:
        libc_call("prctl", PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except OSError as exc:
        fail(125, f"cannot set the parent-death signal: {exc}")
    pid = os.fork()
    if pid == 0:
        os.close(report)
        child(spec)
    os.write(report, str(reap(pid)).encode())
    os._exit(0)


def leave_as(status: int) -> NoReturn:
    """Exit as a process with wait status `status` did: same code, or same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 125)


def main() -> None:
    """Read the spec, isolate, and run the command."""
    with os.fdopen(int(sys.argv[1]), "rb") as f:
        spec = json.loads(f.read())
    try:
        # A core dump of this process would land in the workspace, written as root.
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        libc_call("prctl", PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != spec["parent"]:
            fail(125, "the Assay process is gone")
        isolate(spec)
    except OSError as exc:
        fail(125, f"cannot isolate the command: {exc}")
    if not spec["pid"]:
        child(spec)
    report, sink = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(report)
        init(spec, sink)
    os.close(sink)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda _s, _f: os.kill(pid, signal.SIGKILL))
    status = reap(pid)
    told = os.read(report, 32)
    if told:
        leave_as(int(told))
    leave_as(status if os.WIFSIGNALED(status) else 125 << 8)


if __name__ == "__main__":
    main()
