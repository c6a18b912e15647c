"""Observe-only decisions: what a controller would do on a trace under a policy.

The log is deterministic and calls nothing. For each wait the policy suspends
(`assay.fleet.simulate.suspension`) it holds a `would_suspend` when the sandbox has
been idle `idle_after` and a `would_resume` when the wait ends. Times are on the
suspended run's own clock (`t_ms`: each resume's added latency delays everything
after it) and on the trace's (`trace_t_ms`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from assay.fleet.simulate import Policy, suspension
from assay.fleet.trace import Trace, WaitKind


@dataclass(frozen=True)
class Decision:
    """One decision a controller would take."""

    decision: Literal["would_suspend", "would_resume"]
    t_ms: int
    trace_t_ms: int
    kind: WaitKind
    reason: str
    released_ms: int
    added_ms: int
    ready_t_ms: int

    def to_json(self) -> dict[str, Any]:
        """The decision as one log line."""
        return {
            "decision": self.decision,
            "t_ms": self.t_ms,
            "trace_t_ms": self.trace_t_ms,
            "wait_kind": self.kind.value,
            "reason": self.reason,
            "released_ms": self.released_ms,
            "added_latency_ms": self.added_ms,
            "ready_t_ms": self.ready_t_ms,
        }


def plan(trace: Trace, policy: Policy) -> list[Decision]:
    """The decisions `policy` would take on `trace`, in time order.

    `ready_t_ms` is when the sandbox is released (after the checkpoint) for a
    `would_suspend`, and when the run can go on (after the resume) for a `would_resume`.
    """
    out: list[Decision] = []
    shift = 0
    for wait in trace.waits():
        s = suspension(wait, policy)
        if s is None:
            continue
        at = wait.start_ms + policy.idle_after_ms
        idle = policy.idle_after_ms / 1000
        out.append(
            Decision(
                decision="would_suspend",
                t_ms=at + shift,
                trace_t_ms=at,
                kind=wait.kind,
                reason=f"sandbox idle {idle:g} s in a {wait.kind.value} wait (idle_after)",
                released_ms=s.released_ms,
                added_ms=s.added_ms,
                ready_t_ms=at + shift + policy.checkpoint_ms,
            )
        )
        out.append(
            Decision(
                decision="would_resume",
                t_ms=wait.end_ms + shift,
                trace_t_ms=wait.end_ms,
                kind=wait.kind,
                reason=f"the {wait.kind.value} wait finished",
                released_ms=s.released_ms,
                added_ms=s.added_ms,
                ready_t_ms=wait.end_ms + shift + s.added_ms,
            )
        )
        shift += s.added_ms
    return out
