"""Named crash points: SIGKILL this process at a chosen commit boundary (DESIGN §9).

Reliability tests kill real processes where durability is decided — between
two commits, after an effect landed and before its outcome is recorded — and
check that nothing acknowledged was lost or done twice. A crash point is a
name placed at such a boundary:

    crash_point("execute.tool.before_effect")

With `ASSAY_CRASH_AT=<name>:<n>` (a comma-separated list of them) the n-th
time this process reaches `<name>` it kills itself with SIGKILL: no cleanup,
no flush, no `finally` — what a power cut or the OOM killer does. Without
`:<n>` the first hit kills. With `ASSAY_CRASH_TRACE=<file>` every hit of every
point is appended to the file as one line, `<name> <pid> <unix ms>`, and made
durable before the process goes on (or dies), so a test can prove a point was
reached and in what order.

Both variables are read once, at the first crash point reached. When neither
is set a crash point costs one global read and a comparison.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

CRASH_AT_ENV = "ASSAY_CRASH_AT"
CRASH_TRACE_ENV = "ASSAY_CRASH_TRACE"


class CrashPlanInvalid(ValueError):
    """`ASSAY_CRASH_AT` does not parse as `<name>[:<n>]`, comma-separated, n >= 1."""


@dataclass
class CrashPlan:
    """Where this process dies and where it reports the points it reaches.

    Attributes:
        at: point name -> the hit (1-based) on which to die.
        trace: the trace file, or None.
        hits: how often each point was reached so far.
    """

    at: dict[str, int]
    trace: str | None = None
    hits: Counter[str] = field(default_factory=Counter)

    @classmethod
    def parse(cls, crash_at: str | None, trace: str | None = None) -> CrashPlan | None:
        """The plan the two variables describe; None when there is nothing to do.

        Raises:
            CrashPlanInvalid: `crash_at` names a point badly or gives a bad count.
        """
        at: dict[str, int] = {}
        for item in (crash_at or "").split(","):
            item = item.strip()
            if not item:
                continue
            name, _, count = item.rpartition(":") if ":" in item else (item, "", "1")
            try:
                n = int(count)
            except ValueError:
                n = 0
            if not name or n < 1:
                raise CrashPlanInvalid(f"{CRASH_AT_ENV}: {item!r} is not <name>:<n> with n >= 1")
            at[name] = n
        if not at and not trace:
            return None
        return cls(at=at, trace=trace or None)

    def reached(self, name: str) -> None:
        """Count a hit of `name`; trace it; die if this is the hit the plan names."""
        self.hits[name] += 1
        if self.trace is not None:
            line = f"{name} {os.getpid()} {time.time_ns() // 1_000_000}\n".encode()
            fd = os.open(self.trace, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        if self.at.get(name) == self.hits[name]:
            os.kill(os.getpid(), signal.SIGKILL)


class _Unread:
    """The variables have not been read yet."""


_UNREAD = _Unread()
_plan: CrashPlan | _Unread | None = _UNREAD


def _load() -> CrashPlan | None:
    global _plan
    plan = CrashPlan.parse(os.environ.get(CRASH_AT_ENV), os.environ.get(CRASH_TRACE_ENV))
    _plan = plan
    return plan


def crash_point(name: str) -> None:
    """Reach the crash point `name`: trace it, and die here if the plan says so.

    Raises:
        CrashPlanInvalid: on the first call, when `ASSAY_CRASH_AT` does not parse.
    """
    plan = _plan
    if plan is None:
        return
    if isinstance(plan, _Unread):
        plan = _load()
        if plan is None:
            return
    plan.reached(name)


def crash_points_armed() -> bool:
    """Whether crash points do anything in this process (a plan or a trace is set).

    Call sites that build a point's name check this first, so an unarmed
    process never pays for the name.
    """
    plan = _plan
    if isinstance(plan, _Unread):
        plan = _load()
    return plan is not None


def reset_crash_points() -> None:
    """Forget the plan and the hit counts; the variables are read again at the next point.

    For tests that change the variables within one process.
    """
    global _plan
    _plan = _UNREAD
