"""Decide's log: every record of a workflow goes on its stream `workflow:<id>`.

Derived state, per tenant (read models and fold in `state.py`):

- `allocation/<workflow>`: the latest `AllocationChanged` payload;
- `ladder/<workflow>/<version>`: where each live challenger stands (`Standing`);
- `head/<workflow>`: the next LSN of the workflow's stream — what a handler
  expects it still to be when it commits (the compare-and-swap);
- `known/<version>`: every version decide has held or turned away;
- `decision/<version>`: how a challenger's time ended;
- `accepted/<version>`: when its sequential test crossed the accept boundary;
- `proposal/<id>`: every proposal the slow loop made, its evidence and its status
  (`pending`, `approved`, `rejected`);
- `open_proposal/<workflow>`: the proposal waiting for an operator, absent without one;
- `unproposed/<workflow>`: why the last request for a proposal yielded none;
- `task_mix_hold/<workflow>`: the task-mix drift ingest found, while it holds the
  workflow's promotion (`task_mix.py`);
- `held_evidence/<workflow>/<version>`: the evidence a held challenger's promotion
  waits on, while it is held (so the hold's release can promote it at once);
- `judge_health/latest`: the tenant's last judge calibration that judged anything
  (on the tenant's stream `judge-health`): what holds promotion when agreement is low.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from assay.grading.ladder import Standing
from assay.kernel import TenantId, WorkflowId, WorkflowVersion
from assay.kernel.scores import WinRecord
from assay.messages import (
    AllocationChanged,
    JudgeCalibrated,
    Ladder,
    Rung,
    TaskMixDrifted,
    TaskMixRebased,
    Usage,
    VariantAggregate,
)
from assay.messages.loop import allocation_changed_v1_to_v2, allocation_changed_v2_to_v3
from assay.messages.proposals import FailureEvidence, ProposalRequested
from assay.record import BranchKey, Event, EventRegistry
from assay.record.erasure import TenantErased

STREAM_PREFIX = "workflow:"


def stream_of(tenant: TenantId, workflow: WorkflowId) -> BranchKey:
    """The stream every decide record of a workflow goes on."""
    return BranchKey.main(tenant, f"{STREAM_PREFIX}{workflow}")


class AllocationSet(Event):
    """The allocation of a workflow moved to a new generation.

    Version 2 carries the allocation at version 2 (rung and ladder) and where the
    challenger stands after the change. Version 3 allows several live challengers:
    `standing` is where `moved` (the challenger the change admitted or moved) stands
    now. A challenger whose time the change ends has its `ChallengerDecided` recorded
    just before.
    """

    type: ClassVar[str] = "AllocationSet"
    version: ClassVar[int] = 3
    allocation: AllocationChanged = Field(description="The new allocation.")
    expected_generation: int = Field(ge=0, description="Generation it replaced (CAS).")
    cause: str = Field(description="Why it changed.")
    standing: Standing | None = Field(
        None, description="v2: where the (v3: moved) challenger stands now; None without one."
    )
    moved: WorkflowVersion | None = Field(
        None, description="v3: the challenger `standing` belongs to; None without one."
    )


class ChallengerDecided(Event):
    """A challenger's time ended: promoted, rejected (by the test, or at registration for
    failing shadow's entry criteria) or rolled back.

    Version 2 adds `outcome`, the `ladder` and `rung` it ended on and a rollback's
    `trigger`.
    """

    type: ClassVar[str] = "ChallengerDecided"
    version: ClassVar[int] = 2
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="The challenger.")
    accepted: bool = Field(description="Promoted (true) or not.")
    record: WinRecord = Field(description="Record at the decision.")
    llr: float = Field(description="Log-likelihood ratio at the decision.")
    reason: str = Field(description="Why.")
    outcome: Literal["promoted", "rejected", "rolled_back"] = Field(description="v2: how it ended.")
    ladder: Ladder = Field(description="v2: the ladder it climbed (or would have).")
    rung: Rung | None = Field(description="v2: the rung it ended on (None: never admitted).")
    trigger: Literal["capped", "pass_rate"] | None = Field(
        description="v2: what rolled it back, for a rollback."
    )


class EvidenceAccepted(Event):
    """The challenger's sequential test crossed its accept boundary. The decision is
    latched: promotion then waits only for the rung's other criteria."""

    type: ClassVar[str] = "EvidenceAccepted"
    version: ClassVar[int] = 1
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="The challenger.")
    record: WinRecord = Field(description="Selection record at the crossing.")
    llr: float = Field(description="Log-likelihood ratio at the crossing.")
    reason: str = Field(description="The boundary crossed.")


class PromotionHeld(Event):
    """Everything but the drift check, the judge's calibration or a stronger held
    challenger says promote (or nothing holds it any more).

    Version 2 adds the challenger's `strength` when held. Version 3 adds the `evidence`
    it was held on, so that the hold's release — a calibration that finds the judge
    recovered, a new reference task mix — can promote it at once, without waiting for
    the next evidence."""

    type: ClassVar[str] = "PromotionHeld"
    version: ClassVar[int] = 3
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="The challenger.")
    reason: str | None = Field(description="Why the swap waits; None: it no longer does.")
    strength: float | None = Field(
        None, description="v2: its strength when held (None: no strength, or no longer held)."
    )
    evidence: VariantAggregate | None = Field(
        None,
        description=(
            "v3: the evidence that said promote but for the hold (None: no longer held, or "
            "recorded before v3 — then only the next evidence can promote it)."
        ),
    )


class JudgeHealthNoted(Event):
    """The tournament stage calibrated the tenant's judge (§11): what it found."""

    type: ClassVar[str] = "JudgeHealthNoted"
    version: ClassVar[int] = 1
    calibration: JudgeCalibrated = Field(description="The round's findings, as published.")


JUDGE_HEALTH_STREAM = "judge-health"
"""A tenant's judge calibrations, as decide heard them (one writer: their one partition)."""


class ProposalMade(Event):
    """The proposer drafted a version (§12.1), from the failures it carries."""

    type: ClassVar[str] = "ProposalMade"
    version: ClassVar[int] = 1
    proposal: ProposalRequested = Field(description="The proposal, as announced.")
    failures: list[FailureEvidence] = Field(description="The selection-set failures it read.")


class ProposalNotMade(Event):
    """Decide asked for a proposal and got none: nothing left to try, no evidence to
    learn from, the proposer failed, or its draft was invalid. The loop waits for the
    next challenger's end (or an operator's registration)."""

    type: ClassVar[str] = "ProposalNotMade"
    version: ClassVar[int] = 1
    workflow_id: WorkflowId = Field(description="Workflow.")
    after: WorkflowVersion = Field(description="The challenger (or proposal) whose end asked.")
    proposer: str = Field(description="The proposer asked.")
    reason: str = Field(description="Why no proposal was made.")
    usage: Usage = Field(description="What asking cost.")


class ProposalReviewed(Event):
    """A proposal was approved (and registered) or rejected: by an operator, or approved
    at once for an ungated tenant."""

    type: ClassVar[str] = "ProposalReviewed"
    version: ClassVar[int] = 1
    workflow_id: WorkflowId = Field(description="Workflow.")
    proposal_id: str = Field(description="The proposal.")
    approved: bool = Field(description="Approved (true) or rejected.")
    reason: str = Field(description="Why, as the reviewer said.")
    by: Literal["operator", "ungated"] = Field(description="Who reviewed it.")


class TaskMixHeld(Event):
    """Ingest found the workflow's task mix drifted: promotion waits for a new reference."""

    type: ClassVar[str] = "TaskMixHeld"
    version: ClassVar[int] = 1
    workflow_id: WorkflowId = Field(description="Workflow.")
    drift: TaskMixDrifted = Field(description="What ingest found, as announced.")


class TaskMixReleased(Event):
    """Ingest took a new reference mix: a drift noted before no longer holds promotion."""

    type: ClassVar[str] = "TaskMixReleased"
    version: ClassVar[int] = 1
    workflow_id: WorkflowId = Field(description="Workflow.")
    rebased: TaskMixRebased = Field(description="The new reference, as announced.")


DECIDE_EVENTS = EventRegistry(
    [
        TenantErased,  # every stage log can hold a tenant's tombstone
        AllocationSet,
        ChallengerDecided,
        EvidenceAccepted,
        PromotionHeld,
        ProposalMade,
        ProposalNotMade,
        ProposalReviewed,
        JudgeHealthNoted,
        TaskMixHeld,
        TaskMixReleased,
    ]
)


@DECIDE_EVENTS.upcaster("AllocationSet", 1)
def _allocation_set_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 held a version 1 allocation and no standing (one is rebuilt from the rung)."""
    return {
        **payload,
        "allocation": allocation_changed_v1_to_v2(payload["allocation"]),
        "standing": None,
    }


@DECIDE_EVENTS.upcaster("ChallengerDecided", 1)
def _challenger_decided_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 decided by the sequential test alone: promoted or rejected."""
    outcome = "promoted" if payload["accepted"] else "rejected"
    return {**payload, "outcome": outcome, "ladder": "default", "rung": None, "trigger": None}


@DECIDE_EVENTS.upcaster("AllocationSet", 2)
def _allocation_set_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """v2 held one challenger at most: the standing was its."""
    alloc = allocation_changed_v2_to_v3(payload["allocation"])
    moved = alloc.get("challenger") if payload.get("standing") is not None else None
    return {**payload, "allocation": alloc, "moved": moved}


@DECIDE_EVENTS.upcaster("PromotionHeld", 1)
def _promotion_held_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 kept no strength."""
    return {**payload, "strength": None}


@DECIDE_EVENTS.upcaster("PromotionHeld", 2)
def _promotion_held_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """v2 kept no evidence: the hold's release waits for the next."""
    return {**payload, "evidence": None}
