"""The run lifecycle (§5.2). Each stage drives the part it owns."""

from __future__ import annotations

import enum

from assay.kernel.errors import IllegalTransition


class RunState(enum.Enum):
    """Where a run is in its life. `Verifying` and `Grading` are resting states."""

    SCHEDULED = "scheduled"
    RUNNING = "running"
    SUSPENDED = "suspended"
    VERIFYING = "verifying"
    VERIFIED_PASS = "verified_pass"
    VERIFIED_FAIL = "verified_fail"
    GRADING = "grading"
    GRADED = "graded"
    UNGRADED = "ungraded"
    ARCHIVED = "archived"
    CANCELLED = "cancelled"

    @property
    def grading_ended(self) -> bool:
        """Retention may reduce a run only once this holds (§10.3)."""
        return self in (RunState.GRADED, RunState.UNGRADED, RunState.ARCHIVED)

    @property
    def cancellable(self) -> bool:
        """Cancel is reachable from every non-terminal state."""
        return self not in _TERMINAL


_S = RunState
_TERMINAL = frozenset({_S.GRADED, _S.UNGRADED, _S.ARCHIVED, _S.CANCELLED})
_LEGAL: frozenset[tuple[RunState, RunState]] = frozenset(
    {
        (_S.SCHEDULED, _S.RUNNING),
        (_S.RUNNING, _S.SUSPENDED),
        (_S.SUSPENDED, _S.RUNNING),
        (_S.RUNNING, _S.VERIFYING),
        (_S.VERIFYING, _S.VERIFIED_PASS),
        (_S.VERIFYING, _S.VERIFIED_FAIL),
        (_S.VERIFIED_PASS, _S.GRADING),
        (_S.VERIFIED_FAIL, _S.GRADING),
        (_S.GRADING, _S.GRADED),
        (_S.GRADING, _S.UNGRADED),
        (_S.GRADED, _S.ARCHIVED),
        (_S.UNGRADED, _S.ARCHIVED),
    }
    | {(s, _S.CANCELLED) for s in _S if s not in _TERMINAL}
)


def run_transition(frm: RunState, to: RunState) -> RunState:
    """Return `to` if §5.2 allows `frm -> to`, else raise `IllegalTransition`."""
    if (frm, to) not in _LEGAL:
        raise IllegalTransition("run", frm, to)
    return to


def legal_run_transitions() -> frozenset[tuple[RunState, RunState]]:
    """The (from, to) pairs of §5.2's lifecycle."""
    return _LEGAL
