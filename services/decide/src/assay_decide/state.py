"""Decide's derived state, typed (the kinds `events.py` lists).

Several documents are a message or an event as it was recorded: their read model
is that model, given a `kind`, so the document and the payload cannot drift apart.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from assay.grading.ladder import Standing
from assay.kernel import WorkflowId, WorkflowVersion
from assay.messages import (
    AllocationChanged,
    JudgeCalibrated,
    Ladder,
    LiveChallenger,
    Rung,
    TaskMixDrifted,
    VariantAggregate,
)
from assay.messages.proposals import FailureEvidence, ProposalRequested
from assay.record import Delete, LogRecord, Patch, ReadModel, StateDelta
from assay.workflow import WorkflowDef
from assay_decide.events import (
    STREAM_PREFIX,
    AllocationSet,
    ChallengerDecided,
    EvidenceAccepted,
    JudgeHealthNoted,
    PromotionHeld,
    ProposalMade,
    ProposalNotMade,
    ProposalReviewed,
    TaskMixHeld,
    TaskMixReleased,
)


class Head(ReadModel):
    """The next LSN of a workflow's stream: what a handler expects it still to be."""

    kind: ClassVar[str] = "head"
    next: int


class Allocation(ReadModel, AllocationChanged):
    """A workflow's allocation: the latest `AllocationChanged` decide published.

    With one challenger at most, `challengers` and `shares` say nothing the
    single-challenger fields do not: the document leaves them out (they are read back
    from those fields), so it is stored as it was before several challengers.
    """

    kind: ClassVar[str] = "allocation"

    @model_serializer(mode="wrap")
    def _single_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if len(self.challengers) <= 1:
            data.pop("challengers", None)
            data.pop("shares", None)
        return data

    def definition(self, version: WorkflowVersion) -> WorkflowDef:
        """The IR of a version the allocation names."""
        return WorkflowDef.model_validate(self.definitions[version])

    @property
    def live(self) -> list[WorkflowVersion]:
        """The live challengers, in the order they were admitted."""
        return [c.version for c in self.challengers]

    @property
    def allowed(self) -> int:
        """How many challengers may be live at once: the current version's
        `grading.challengers` (one by default)."""
        return self.definition(self.current).grading.live_challengers


def climb_key(workflow: WorkflowId, version: WorkflowVersion) -> str:
    """Where a live challenger's standing is kept: `ladder/<workflow>/<version>`."""
    return f"{workflow}/{version}"


class Climb(ReadModel):
    """Where one live challenger stands (a `Standing`), keyed `<workflow>/<version>`.

    An allocation of version 1 kept no standing: its latches alone may be here, and
    the rest comes from the allocation (`standing`).
    """

    kind: ClassVar[str] = "ladder"
    ladder: Ladder | None = None
    rung: Rung | None = None
    share: float | None = None
    entered_served: int = 0
    entered_episodes: int = 0
    accepted: bool = False
    held: str | None = None
    held_strength: float | None = None

    @model_serializer(mode="wrap")
    def _unheld_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("held_strength") is None:  # stored as before several challengers
            data.pop("held_strength", None)
        return data

    @classmethod
    def of(cls, standing: Standing) -> Climb:
        """The document of a standing."""
        return cls.model_validate(standing.model_dump())

    def standing(self, alloc: Allocation, live: LiveChallenger) -> Standing:
        """The standing, what this document lacks read from the allocation."""
        share = alloc.shares[live.version] if self.share is None else self.share
        return Standing.model_validate(
            {
                **self.model_dump(),
                "ladder": self.ladder or live.ladder,
                "rung": self.rung or live.rung,
                "share": share,
            }
        )


class HeldEvidence(ReadModel, VariantAggregate):
    """The evidence a held challenger's promotion waits on (`PromotionHeld` v3), keyed
    like its standing, while it is held: what the hold's release steps it on again."""

    kind: ClassVar[str] = "held_evidence"


class Known(ReadModel):
    """A version decide has held or turned away."""

    kind: ClassVar[str] = "known"
    workflow_id: WorkflowId


class Decision(ReadModel, ChallengerDecided):
    """How a challenger's time ended."""

    kind: ClassVar[str] = "decision"


class Accepted(ReadModel, EvidenceAccepted):
    """When a challenger's sequential test crossed its accept boundary."""

    kind: ClassVar[str] = "accepted"


class Review(BaseModel):
    """Who reviewed a proposal, and why."""

    model_config = ConfigDict(frozen=True)
    reason: str
    by: Literal["operator", "ungated"]


class ProposalRecord(ReadModel, ProposalRequested):
    """A proposal the slow loop made: as announced, its evidence and its status."""

    kind: ClassVar[str] = "proposal"
    failures: list[FailureEvidence]
    status: Literal["pending", "approved", "rejected"]
    review: Review | None

    def announced(self) -> ProposalRequested:
        """The proposal as it was announced."""
        return ProposalRequested.model_validate(
            self.model_dump(exclude={"failures", "status", "review"})
        )


class OpenProposal(ReadModel):
    """The proposal of a workflow waiting for an operator."""

    kind: ClassVar[str] = "open_proposal"
    proposal_id: str


class Unproposed(ReadModel, ProposalNotMade):
    """Why the last request for a proposal of a workflow yielded none."""

    kind: ClassVar[str] = "unproposed"


class JudgeHealth(ReadModel, JudgeCalibrated):
    """The tenant's last judge calibration that judged anything (key `latest`)."""

    kind: ClassVar[str] = "judge_health"


class MixHold(ReadModel, TaskMixDrifted):
    """The drift that holds a workflow's promotion, absent while none does."""

    kind: ClassVar[str] = "task_mix_hold"


LATEST = "latest"


DECIDE_STATE: tuple[type[ReadModel], ...] = (
    Head,
    Allocation,
    Climb,
    HeldEvidence,
    Known,
    Decision,
    Accepted,
    ProposalRecord,
    OpenProposal,
    Unproposed,
    JudgeHealth,
    MixHold,
)
"""Every kind of document decide keeps, by its read model."""


def fold_decide(record: LogRecord) -> list[StateDelta]:
    """The allocation, standing and stream head per workflow; decisions per version."""
    t = record.key.tenant
    out: list[StateDelta] = []
    if record.key.stream.startswith(STREAM_PREFIX):
        workflow = record.key.stream[len(STREAM_PREFIX) :]
        out.append(Head(next=record.lsn + 1).put(t, workflow))
    match record.event:
        case AllocationSet(allocation=a, standing=standing, moved=moved):
            out += [
                Allocation.model_validate(a.model_dump()).put(t, a.workflow_id),
                *(Known(workflow_id=a.workflow_id).put(t, v) for v in sorted(a.definitions)),
            ]
            if standing is not None and moved is not None:
                out.append(Climb.of(standing).put(t, climb_key(a.workflow_id, moved)))
        case ChallengerDecided() as e:
            out += [
                Decision.model_validate(e.model_dump()).put(t, e.workflow_version),
                Known(workflow_id=e.workflow_id).put(t, e.workflow_version),
                Delete(Climb.at(t, climb_key(e.workflow_id, e.workflow_version))),
                Delete(HeldEvidence.at(t, climb_key(e.workflow_id, e.workflow_version))),
            ]
        case EvidenceAccepted() as e:
            out += [
                Accepted.model_validate(e.model_dump()).put(t, e.workflow_version),
                Patch(
                    Climb.at(t, climb_key(e.workflow_id, e.workflow_version)), {"accepted": True}
                ),
            ]
        case PromotionHeld() as e:
            held = {"held": e.reason, "held_strength": e.strength}
            where = climb_key(e.workflow_id, e.workflow_version)
            out.append(Patch(Climb.at(t, where), held))
            if e.evidence is None:
                out.append(Delete(HeldEvidence.at(t, where)))
            else:
                out.append(HeldEvidence.model_validate(e.evidence.model_dump()).put(t, where))
        case ProposalMade(proposal=p, failures=failures):
            made = ProposalRecord.model_validate(
                {**p.model_dump(), "failures": failures, "status": "pending", "review": None}
            )
            out += [
                made.put(t, p.proposal_id),
                OpenProposal(proposal_id=p.proposal_id).put(t, p.workflow_id),
                Delete(Unproposed.at(t, p.workflow_id)),
            ]
        case ProposalNotMade() as e:
            out.append(Unproposed.model_validate(e.model_dump()).put(t, e.workflow_id))
        case TaskMixHeld(drift=d):
            out.append(MixHold.model_validate(d.model_dump()).put(t, d.workflow_id))
        case TaskMixReleased(workflow_id=workflow):
            out.append(Delete(MixHold.at(t, workflow)))
        case JudgeHealthNoted(calibration=c):
            out.append(JudgeHealth.model_validate(c.model_dump()).put(t, LATEST))
        case ProposalReviewed() as e:
            review = Review(reason=e.reason, by=e.by).model_dump(mode="json")
            status = "approved" if e.approved else "rejected"
            out += [
                Patch(ProposalRecord.at(t, e.proposal_id), {"status": status, "review": review}),
                Delete(OpenProposal.at(t, e.workflow_id)),
            ]
    return out
