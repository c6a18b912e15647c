"""The console's record of each workflow's ladder, folded from the loop's topics.

It consumes `assay.workflows` (registrations: the version DAG; proposal reviews),
`assay.aggregates` (each challenger's evidence), and `assay.decisions` (allocations,
promotions, rejections, rollbacks, proposals). Each fact lands as an event on the
workflow's stream `workflow:<id>` in the console's own log, stamped with when its
producer committed it, and patches one `WorkflowRow` per workflow.

A challenger's evidence is recorded with the sequential test's log-likelihood ratio
and boundaries under the console's SPRT policy (`ASSAY_SPRT_*`, the same settings
decide reads), so the path a page draws is the one the test walked.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar, Literal

from pydantic import Field

from assay.grading.sprt import SprtPolicy, llr
from assay.kernel.ids import WorkflowVersion
from assay.kernel.scores import WinRecord
from assay.messages import (
    AllocationChanged,
    ChallengerRejected,
    HeldOutTally,
    Ladder,
    LiveChallenger,
    Promoted,
    ProposalRequested,
    ReviewProposal,
    RolledBack,
    Rung,
    StrengthSummary,
    VariantAggregate,
    WorkflowRegistered,
)
from assay.record import BranchKey, Event, LogRecord, Patch, ReadModel, StateDelta
from assay.runtime import UnitOfWork
from assay.workflow import WorkflowInvalid, from_document
from assay_console.workflow_views import LiveShare

LadderUnitOfWork = UnitOfWork[SprtPolicy]


class VersionSeen(Event):
    """A version of the workflow was registered: a node of its DAG."""

    type: ClassVar[str] = "console.VersionSeen"
    version: ClassVar[int] = 1
    at: datetime = Field(description="When it was registered.")
    workflow_version: WorkflowVersion = Field(description="The version.")
    parents: list[WorkflowVersion] = Field(description="The versions it derives from.")
    description: str = Field(description="The definition's description.")
    grading: str = Field(description="Its grading strategy.")


class AllocationSeen(Event):
    """Decide moved the workflow's allocation to a new generation.

    Version 2 adds every live challenger (`challengers`) and each live version's share
    (`shares`); `challenger`, `rung`, `ladder` and `share` are the first challenger's.
    """

    type: ClassVar[str] = "console.AllocationSeen"
    version: ClassVar[int] = 2
    at: datetime = Field(description="When decide published it.")
    generation: int = Field(description="Compare-and-swap generation.")
    current: WorkflowVersion = Field(description="The current version.")
    challenger: WorkflowVersion | None = Field(description="The (first) challenger, if any.")
    rung: Rung | None = Field(description="The (first) challenger's rung.")
    ladder: Ladder = Field(description="The ladder it climbs.")
    share: float = Field(description="Share of live tasks the (first) challenger serves.")
    shadow_rate: float = Field(description="Share of tasks also re-run under the other version.")
    challengers: list[LiveChallenger] = Field(
        description="v2: every live challenger, in the order admitted."
    )
    shares: dict[str, float] = Field(description="v2: each live version's share of live tasks.")


class EvidenceSeen(Event):
    """A challenger's cumulative evidence, and the sequential test on it."""

    type: ClassVar[str] = "console.EvidenceSeen"
    version: ClassVar[int] = 1
    at: datetime = Field(description="When aggregate published it.")
    workflow_version: WorkflowVersion = Field(description="The challenger.")
    baseline_version: WorkflowVersion = Field(description="The current version compared with.")
    record: WinRecord = Field(description="Cumulative record on selection tasks.")
    runs: int = Field(description="Graded challenger runs on selection tasks.")
    passes: int = Field(description="Of which passed verification.")
    baseline_runs: int = Field(description="Graded baseline runs on selection tasks.")
    baseline_passes: int = Field(description="Of which passed verification.")
    strength: StrengthSummary | None = Field(description="Anchored Ranked deltas from control.")
    held_out: HeldOutTally | None = Field(description="The same measures on held-out tasks.")
    order_checked: int = Field(description="Comparisons asked again with positions swapped.")
    order_inconsistent: int = Field(description="Of which the judge did not mirror itself.")
    llr: float = Field(description="Log-likelihood ratio of the record (draws excluded).")
    policy: SprtPolicy = Field(description="The sequential test's policy it was computed under.")
    upper: float = Field(description="The accept boundary.")
    lower: float = Field(description="The reject boundary.")


class DecisionSeen(Event):
    """A challenger's time ended: promoted, rejected or rolled back."""

    type: ClassVar[str] = "console.DecisionSeen"
    version: ClassVar[int] = 1
    at: datetime = Field(description="When decide published it.")
    workflow_version: WorkflowVersion = Field(description="The challenger.")
    outcome: Literal["promoted", "rejected", "rolled_back"] = Field(description="How it ended.")
    reason: str = Field(description="Why, for people.")
    record: WinRecord = Field(description="Its record at the decision.")
    llr: float | None = Field(description="Log-likelihood ratio at the decision (not rollbacks).")
    trigger: str | None = Field(description="What rolled it back.")
    rung: Rung | None = Field(description="The rung it was rolled back from.")


class ProposalSeen(Event):
    """The slow loop proposed a version."""

    type: ClassVar[str] = "console.ProposalSeen"
    version: ClassVar[int] = 1
    at: datetime = Field(description="When it was proposed.")
    proposal_id: str = Field(description="The proposal.")
    workflow_version: WorkflowVersion = Field(description="The proposed version.")
    parent: WorkflowVersion = Field(description="The version it derives from.")
    after: WorkflowVersion = Field(description="The challenger whose end triggered it.")
    rationale: str = Field(description="Why the proposer expects it to do better.")
    proposer: str = Field(description="Which proposer drafted it.")
    evidence: int = Field(description="Selection-set failures it read.")
    gated: bool = Field(description="Waits for an operator's approval.")


class ReviewSeen(Event):
    """An operator approved or rejected a proposal."""

    type: ClassVar[str] = "console.ReviewSeen"
    version: ClassVar[int] = 1
    at: datetime = Field(description="When it was reviewed.")
    proposal_id: str = Field(description="The proposal.")
    approve: bool = Field(description="Approved (true) or rejected.")
    reason: str = Field(description="Why, as the reviewer said.")


LADDER_EVENTS = (
    VersionSeen,
    AllocationSeen,
    EvidenceSeen,
    DecisionSeen,
    ProposalSeen,
    ReviewSeen,
)


class WorkflowRow(ReadModel):
    """What the workflows list shows of one workflow. Built by patches."""

    kind: ClassVar[str] = "console_workflow"
    workflow_id: str = ""
    latest: str | None = None
    current: str | None = None
    challenger: str | None = None
    rung: str | None = None
    share: float = 0.0
    generation: int = 0
    updated: str | None = None
    live: list[LiveShare] = Field(default_factory=list)
    """Every live challenger, its rung and share (the first one is also `challenger`)."""


class ProposalRow(ReadModel):
    """One proposal of the slow loop and its review, for the list of open proposals.
    Built by patches: a review may be folded before its proposal (`gated` is None until
    the proposal is)."""

    kind: ClassVar[str] = "console_proposal"
    proposal_id: str = ""
    workflow_id: str = ""
    workflow_version: str | None = None
    parent: str | None = None
    after: str | None = None
    rationale: str = ""
    proposer: str = ""
    evidence: int = 0
    gated: bool | None = None
    proposed_at: str | None = None
    approve: bool | None = None
    review: str | None = None
    reviewed_at: str | None = None

    @property
    def open(self) -> bool:
        """Proposed, waiting for an operator, and not reviewed yet."""
        return self.gated is True and self.approve is None


def workflow_stream(tenant: Any, workflow_id: str) -> BranchKey:
    """The console's stream of one workflow."""
    return BranchKey.main(tenant, f"workflow:{workflow_id}")


def fold_ladder(record: LogRecord) -> list[StateDelta]:
    """Patch the workflow's row with what the event changes."""
    event = record.event
    if not isinstance(event, LADDER_EVENTS):
        return []
    workflow = record.key.stream.removeprefix("workflow:")
    fields: dict[str, Any] = {"workflow_id": workflow, "updated": event.at.isoformat()}
    deltas: list[StateDelta] = []
    match event:
        case VersionSeen(workflow_version=v):
            fields["latest"] = v
        case ProposalSeen() | ReviewSeen():
            deltas.append(_proposal_patch(record.key.tenant, workflow, event))
        case AllocationSeen() as a:
            fields |= {
                "current": a.current,
                "challenger": a.challenger,
                "rung": a.rung.value if a.rung else None,
                "share": a.share,
                "generation": a.generation,
                "live": [
                    {"version": c.version, "rung": c.rung.value, "share": a.shares[c.version]}
                    for c in a.challengers
                ],
            }
    return [Patch(WorkflowRow.at(record.key.tenant, workflow), fields), *deltas]


def _proposal_patch(tenant: Any, workflow: str, event: ProposalSeen | ReviewSeen) -> Patch:
    fields: dict[str, Any] = {"proposal_id": event.proposal_id, "workflow_id": workflow}
    match event:
        case ProposalSeen() as p:
            fields |= {
                "workflow_version": p.workflow_version,
                "parent": p.parent,
                "after": p.after,
                "rationale": p.rationale,
                "proposer": p.proposer,
                "evidence": p.evidence,
                "gated": p.gated,
                "proposed_at": p.at.isoformat(),
            }
        case ReviewSeen() as r:
            fields |= {"approve": r.approve, "review": r.reason, "reviewed_at": r.at.isoformat()}
    return Patch(ProposalRow.at(tenant, event.proposal_id), fields)


def _record(uow: LadderUnitOfWork, workflow: str, event: Event) -> None:
    uow.record(workflow_stream(uow.tenant, workflow), event)


async def on_workflow_registered(msg: WorkflowRegistered, uow: LadderUnitOfWork) -> None:
    """Add the version to its workflow's DAG, under the parents it names (else the
    version registered last, as ingest reads it). A definition that does not parse is
    left out: ingest dead-letters it with the reason."""
    try:
        wf = from_document(msg.definition)
    except WorkflowInvalid:
        return
    row = await uow.get(WorkflowRow, wf.id)
    latest = row.latest if row is not None else None
    if msg.parents is not None:
        parents = list(dict.fromkeys(msg.parents))
    else:
        parents = [WorkflowVersion(latest)] if latest and latest != wf.version else []
    event = VersionSeen(
        at=uow.envelope.occurred_at,
        workflow_version=wf.version,
        parents=parents,
        description=wf.description,
        grading=wf.grading.strategy,
    )
    _record(uow, wf.id, event)


async def on_review_proposal(msg: ReviewProposal, uow: LadderUnitOfWork) -> None:
    """Record an operator's verdict on a proposal."""
    event = ReviewSeen(
        at=uow.envelope.occurred_at,
        proposal_id=msg.proposal_id,
        approve=msg.approve,
        reason=msg.reason,
    )
    _record(uow, msg.workflow_id, event)


async def on_variant_aggregate(msg: VariantAggregate, uow: LadderUnitOfWork) -> None:
    """Record a challenger's evidence with the sequential test's ratio and boundaries."""
    policy = uow.deps
    event = EvidenceSeen(
        at=uow.envelope.occurred_at,
        workflow_version=msg.workflow_version,
        baseline_version=msg.baseline_version,
        record=msg.record,
        runs=msg.runs,
        passes=msg.passes,
        baseline_runs=msg.baseline_runs,
        baseline_passes=msg.baseline_passes,
        strength=msg.strength,
        held_out=msg.held_out,
        order_checked=msg.order_checked,
        order_inconsistent=msg.order_inconsistent,
        llr=llr(msg.record.wins, msg.record.losses, policy),
        policy=policy,
        upper=policy.upper,
        lower=policy.lower,
    )
    _record(uow, msg.workflow_id, event)


async def on_allocation_changed(msg: AllocationChanged, uow: LadderUnitOfWork) -> None:
    """Record the allocation: the current version, every challenger, rungs and shares."""
    event = AllocationSeen(
        at=uow.envelope.occurred_at,
        generation=msg.generation,
        current=msg.current,
        challenger=msg.challenger,
        rung=msg.rung,
        ladder=msg.ladder,
        share=msg.challenger_share,
        shadow_rate=msg.shadow_rate,
        challengers=msg.challengers,
        shares=msg.shares,
    )
    _record(uow, msg.workflow_id, event)


async def on_promoted(msg: Promoted, uow: LadderUnitOfWork) -> None:
    """Record a promotion."""
    _record(uow, msg.workflow_id, _decision(uow, msg.workflow_version, "promoted", msg))


async def on_challenger_rejected(msg: ChallengerRejected, uow: LadderUnitOfWork) -> None:
    """Record a rejection and its reason."""
    _record(uow, msg.workflow_id, _decision(uow, msg.workflow_version, "rejected", msg))


async def on_rolled_back(msg: RolledBack, uow: LadderUnitOfWork) -> None:
    """Record a rollback, what triggered it and from which rung."""
    _record(uow, msg.workflow_id, _decision(uow, msg.workflow_version, "rolled_back", msg))


def _decision(
    uow: LadderUnitOfWork,
    version: WorkflowVersion,
    outcome: Literal["promoted", "rejected", "rolled_back"],
    msg: Promoted | ChallengerRejected | RolledBack,
) -> DecisionSeen:
    ratio: float | None = None
    trigger: str | None = None
    rung: Rung | None = None
    match msg:
        case Promoted():
            reason, ratio = f"promoted over {msg.previous}", msg.llr
        case ChallengerRejected():
            reason, ratio = msg.reason, msg.llr
        case RolledBack():
            reason, trigger, rung = msg.reason, msg.trigger, msg.rung
    return DecisionSeen(
        at=uow.envelope.occurred_at,
        workflow_version=version,
        outcome=outcome,
        reason=reason,
        record=msg.record,
        llr=ratio,
        trigger=trigger,
        rung=rung,
    )


async def on_proposal_requested(msg: ProposalRequested, uow: LadderUnitOfWork) -> None:
    """Record a proposal of the slow loop."""
    event = ProposalSeen(
        at=uow.envelope.occurred_at,
        proposal_id=msg.proposal_id,
        workflow_version=msg.workflow_version,
        parent=msg.parent,
        after=msg.after,
        rationale=msg.rationale,
        proposer=msg.proposer,
        evidence=len(msg.evidence),
        gated=msg.gated,
    )
    _record(uow, msg.workflow_id, event)


LADDER_HANDLERS = (
    on_workflow_registered,
    on_review_proposal,
    on_variant_aggregate,
    on_allocation_changed,
    on_promoted,
    on_challenger_rejected,
    on_rolled_back,
    on_proposal_requested,
)
"""Every handler of the ladder's topics."""
