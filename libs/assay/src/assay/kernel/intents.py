"""The write-ahead intent of a tool call with an effect (§8.4). The table is normative.

    Pending ──► Dispatched ──► Committed

Each state is committed durably before the next one begins, so the last
committed state tells a recovering worker which window a crash fell in:
`Pending` — the call was never issued; `Dispatched` — it may have landed;
`Committed` — its outcome is recorded.
"""

from __future__ import annotations

import enum

from assay.kernel.errors import IllegalTransition


class IntentState(enum.Enum):
    """Where a tool call's intent stands."""

    PENDING = "pending"
    DISPATCHED = "dispatched"
    COMMITTED = "committed"


_LEGAL: frozenset[tuple[IntentState | None, IntentState]] = frozenset(
    {
        (None, IntentState.PENDING),
        (IntentState.PENDING, IntentState.DISPATCHED),
        (IntentState.DISPATCHED, IntentState.COMMITTED),
    }
)


def intent_transition(frm: IntentState | None, to: IntentState) -> IntentState:
    """Return `to` if `frm -> to` is legal (None: no intent yet), else raise."""
    if (frm, to) not in _LEGAL:
        raise IllegalTransition("intent", frm, to)
    return to


def legal_intent_transitions() -> frozenset[tuple[IntentState | None, IntentState]]:
    """The (from, to) pairs of the intent machine."""
    return _LEGAL
