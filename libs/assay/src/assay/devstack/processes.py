"""Which process a pid is, and stopping it only while it is still that process.

A pid alone names a process only until it ends: the kernel then gives the number to
the next process it starts. `assay up` records each process it started as a
`ProcessIdentity` — pid, start time (field 22 of `/proc/<pid>/stat`, in clock ticks
after boot), command line and boot id — and `assay down` signals a pid only while all
of them still match. Linux only (`/proc`); elsewhere nothing can be identified, so
nothing is signalled.
"""

from __future__ import annotations

import enum
import math
import os
import select
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from assay.kernel.errors import AssayError

_PROC = Path("/proc")
_BOOT_ID = _PROC / "sys/kernel/random/boot_id"
_PF_KTHREAD = 0x00200000
"""`/proc/<pid>/stat` field 9 (flags): the process is a kernel thread."""


class IdentityInvalid(AssayError):
    """A recorded process identity is not one `ProcessIdentity.to_json` wrote."""


@dataclass(frozen=True)
class ProcessIdentity:
    """One process for as long as it lives: no later process matches all four fields."""

    pid: int
    start_ticks: int
    """When it started, in clock ticks after boot (`/proc/<pid>/stat`, field 22)."""
    cmdline: tuple[str, ...]
    """Its arguments as `/proc/<pid>/cmdline` lists them."""
    boot_id: str
    """The kernel's boot id: start ticks restart from zero at every boot."""

    def to_json(self) -> dict[str, object]:
        """The form kept in `stack.json`."""
        return {
            "pid": self.pid,
            "start_ticks": self.start_ticks,
            "cmdline": list(self.cmdline),
            "boot_id": self.boot_id,
        }

    @classmethod
    def from_json(cls, data: object) -> ProcessIdentity:
        """Read what `to_json` wrote.

        Raises:
            IdentityInvalid: `data` is not such a record.
        """
        if not isinstance(data, dict):
            raise IdentityInvalid(f"not a process identity: {data!r}")
        pid, ticks, cmdline, boot = (
            data.get(k) for k in ("pid", "start_ticks", "cmdline", "boot_id")
        )
        if (
            not isinstance(pid, int)
            or not isinstance(ticks, int)
            or not isinstance(boot, str)
            or not isinstance(cmdline, list)
            or not all(isinstance(a, str) for a in cmdline)
        ):
            raise IdentityInvalid(f"not a process identity: {data!r}")
        return cls(pid, ticks, tuple(cmdline), boot)

    def describe(self) -> str:
        """`pid N (command line)`, for messages."""
        return f"pid {self.pid} ({' '.join(self.cmdline) or '?'})"


def identify(pid: int, exec_wait_s: float = 1.0) -> ProcessIdentity | None:
    """The identity of the live process `pid` now is; None when there is none (no such
    process, one that has exited and awaits its parent, or no `/proc` to read).

    A process in the middle of `execve` reads with no command line for a moment (the
    new image's arguments are not mapped yet) although `Popen` has already returned: up
    to `exec_wait_s` is given for them to appear, so that what `assay up` records is the
    command line `assay down` will later read. Kernel threads never have one.
    """
    deadline = time.monotonic() + exec_wait_s
    while True:
        try:
            stat = (_PROC / str(pid) / "stat").read_text()
            cmdline = (_PROC / str(pid) / "cmdline").read_bytes()
            boot_id = _BOOT_ID.read_text().strip()
        except OSError:
            return None
        # The command name (field 2) is in parentheses and may hold spaces or parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] in ("Z", "X"):  # exited: a zombie or dead
            return None
        kernel_thread = int(fields[6]) & _PF_KTHREAD
        if cmdline or kernel_thread or time.monotonic() >= deadline:
            break
        time.sleep(0.001)
    args = tuple(a.decode(errors="replace") for a in cmdline.split(b"\0")[:-1])
    return ProcessIdentity(pid, int(fields[19]), args, boot_id)


class Stop(enum.Enum):
    """What `terminate_all` found and did with one process."""

    STOPPED = "stopped"
    """It was the recorded process; it has ended."""
    GONE = "already gone"
    """The recorded process had ended; its pid is free."""
    NOT_OURS = "now another process"
    """The pid belongs to another process now: it was left alone."""
    SURVIVED = "still running"
    """It was the recorded process and outlived SIGTERM and SIGKILL."""


def terminate(recorded: ProcessIdentity, timeout_s: float = 10.0) -> tuple[Stop, str]:
    """`terminate_all` of one process."""
    return terminate_all([recorded], timeout_s)[0]


def terminate_all(
    recorded: Sequence[ProcessIdentity], timeout_s: float = 10.0
) -> list[tuple[Stop, str]]:
    """SIGTERM, all at once, every recorded process its pid still names; wait up to
    `timeout_s` for them to end, then SIGKILL those left and wait 5 s more. Returns, in
    order, what happened to each and a line saying so.

    Each pid is pinned with a pidfd before its identity is checked, so a process that
    ends between the check and the signal cannot pass the signal on to the pid's next
    owner (where pidfds are missing, that window is merely short).
    """
    pidfds = [_pidfd(r.pid) for r in recorded]
    try:
        outcomes: list[tuple[Stop, str] | None] = []
        for r in recorded:
            now = identify(r.pid)
            if now is None:
                outcomes.append((Stop.GONE, f"{r.describe()}: already gone"))
            elif now != r:
                outcomes.append(
                    (
                        Stop.NOT_OURS,
                        f"pid {r.pid} is now another process ({' '.join(now.cmdline) or '?'}),"
                        f" not {r.describe()}: left alone",
                    )
                )
            else:
                outcomes.append(None)
        running = [i for i, o in enumerate(outcomes) if o is None]
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            running = [i for i in running if _send(recorded[i].pid, pidfds[i], sig)]
            running = _still_running({i: (recorded[i], pidfds[i]) for i in running}, wait_s)
            if not running:
                break
        return [
            o
            if o is not None
            else (
                (Stop.SURVIVED, f"{r.describe()}: still running after SIGKILL")
                if i in running
                else (Stop.STOPPED, f"{r.describe()}: stopped")
            )
            for i, (r, o) in enumerate(zip(recorded, outcomes, strict=True))
        ]
    finally:
        for fd in pidfds:
            if fd is not None:
                os.close(fd)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):  # no such process, or no pidfds here
        return None


def _send(pid: int, pidfd: int | None, sig: signal.Signals) -> bool:
    """Signal the process; False when it has already ended."""
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _still_running(
    processes: Mapping[int, tuple[ProcessIdentity, int | None]], timeout_s: float
) -> list[int]:
    """Wait up to `timeout_s` for the processes (by key: identity and pidfd) to end;
    the keys of those that did not. A pidfd turns readable when its process ends; a
    process without one is polled by identity."""
    deadline = time.monotonic() + timeout_s
    waiting = dict(processes)
    poller = select.poll()
    key_of: dict[int, int] = {}
    for key, (_, pidfd) in waiting.items():
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
            key_of[pidfd] = key
    while True:
        for key, (r, pidfd) in list(waiting.items()):
            if pidfd is None and identify(r.pid) != r:
                del waiting[key]
        left = deadline - time.monotonic()
        if not waiting or left <= 0:
            return sorted(waiting)
        unpinned = any(pidfd is None for _, pidfd in waiting.values())
        for ready, _ in poller.poll(math.ceil(1000 * (min(left, 0.05) if unpinned else left))):
            poller.unregister(ready)
            del waiting[key_of[ready]]
