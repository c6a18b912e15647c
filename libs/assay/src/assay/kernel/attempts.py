"""The closed attempt state machine (§5.1). The table is normative."""

from __future__ import annotations

import enum

from assay.kernel.errors import IllegalTransition


class AttemptState(enum.Enum):
    """Kernel state of one attempt. Closed: users never extend it."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INDETERMINATE = "indeterminate"
    """Crashed or stopped mid-side-effect; what happened outside is unknown (§8.4)."""
    CANCELLED = "cancelled"
    """Stopped by decision with no dispatched intent outstanding."""
    TIMED_OUT = "timed_out"

    @property
    def terminal(self) -> bool:
        """Nothing leaves a terminal state."""
        return self not in (AttemptState.PENDING, AttemptState.RUNNING)


_P, _R = AttemptState.PENDING, AttemptState.RUNNING
_LEGAL: frozenset[tuple[AttemptState, AttemptState]] = frozenset(
    {
        (_P, _R),  # admitted
        (_P, AttemptState.CANCELLED),  # run cancelled before the attempt started
        (_P, AttemptState.TIMED_OUT),  # queue deadline passed before admission
        (_R, AttemptState.SUCCEEDED),
        (_R, AttemptState.FAILED),
        (_R, AttemptState.TIMED_OUT),
        (_R, AttemptState.CANCELLED),  # only with no intent dispatched
        (_R, AttemptState.INDETERMINATE),  # only with an intent dispatched
    }
)


def attempt_transition(
    frm: AttemptState, to: AttemptState, *, intent_dispatched: bool = False
) -> AttemptState:
    """Return `to` if §5.1's table allows `frm -> to`, else raise `IllegalTransition`.

    Args:
        intent_dispatched: whether an intent of this attempt reached `Dispatched`
            without resolving. It decides between `Cancelled` and `Indeterminate`.
    """
    if (frm, to) not in _LEGAL:
        raise IllegalTransition("attempt", frm, to)
    if frm is _R and to is AttemptState.CANCELLED and intent_dispatched:
        raise IllegalTransition("attempt", frm, to, "an intent was dispatched: Indeterminate")
    if to is AttemptState.INDETERMINATE and not intent_dispatched:
        raise IllegalTransition("attempt", frm, to, "no intent was dispatched: Cancelled")
    return to


def legal_attempt_transitions() -> frozenset[tuple[AttemptState, AttemptState]]:
    """The (from, to) pairs of §5.1's table."""
    return _LEGAL
