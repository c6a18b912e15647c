"""The slow loop's messages (§12.1): failure evidence in, proposed versions out.

When decide ends a challenger's time without a replacement (rejected by the test,
rolled back, or turned away at shadow's door), its `Proposer` drafts a new version
of the current one from **selection-set** failures only (§12.5: the held-out set
never reaches the generator). The draft is announced as `ProposalRequested` on
`assay.decisions`; it waits there for an operator's `ReviewProposal` on
`assay.workflows` (`assay proposals approve|reject ID`) unless the tenant is
ungated, in which case decide registers it at once. Either way the version enters
the DAG through an ordinary `WorkflowRegistered`, parented on the current version.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from assay.kernel.ids import RunId, TaskId, TenantId, WorkflowId, WorkflowVersion
from assay.kernel.schema import Versioned
from assay.kernel.scores import CoreViolation, StepCredit
from assay.messages.models import Usage, VerifierResult

EVIDENCE_CHARS = 400
"""Characters of one verifier's evidence kept as failure evidence (longer is cut)."""
FAILURES_KEPT = 8
"""Selection-set failures kept per version: the most recent ones."""


class FailureEvidence(BaseModel):
    """One graded selection-set run that failed: what the proposer may read of it.

    Only runs of the selection set become evidence (aggregate never keeps a held-out
    run's failure), so nothing here can leak the held-out set into the generator.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: RunId = Field(description="The run.")
    task_id: TaskId = Field(description="Its task.")
    workflow_version: WorkflowVersion = Field(description="The version that ran.")
    failed_checks: list[VerifierResult] = Field(
        default_factory=list, description="The verifiers it failed, with their evidence."
    )
    capped: list[CoreViolation] = Field(
        default_factory=list, description="The Core rubric items it violated (a Capped score)."
    )
    step_credit: list[StepCredit] = Field(
        default_factory=list, description="Steps whose attempt failed before a retry passed."
    )


def as_evidence(
    run_id: RunId,
    task_id: TaskId,
    version: WorkflowVersion,
    failed_checks: list[VerifierResult],
    capped: list[CoreViolation],
    step_credit: list[StepCredit],
) -> FailureEvidence:
    """Failure evidence with each verifier's evidence cut to `EVIDENCE_CHARS`."""
    checks = [
        c
        if len(c.evidence) <= EVIDENCE_CHARS
        else c.model_copy(update={"evidence": c.evidence[: EVIDENCE_CHARS - 1] + "…"})
        for c in failed_checks
    ]
    return FailureEvidence(
        run_id=run_id,
        task_id=task_id,
        workflow_version=version,
        failed_checks=checks,
        capped=capped,
        step_credit=step_credit,
    )


class ProposalRequested(Versioned):
    """A proposed version of a workflow, drafted by the slow loop's proposer.

    `gated` proposals wait for `ReviewProposal`; an ungated tenant's proposal was
    registered when it was made.
    """

    type: ClassVar[str] = "ProposalRequested"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    proposal_id: str = Field(
        pattern=r"^[0-9a-f]{16}$", description="The proposal's id (what `assay proposals` takes)."
    )
    workflow_version: WorkflowVersion = Field(description="The proposed version.")
    parent: WorkflowVersion = Field(description="The current version it derives from.")
    after: WorkflowVersion = Field(description="The challenger whose end triggered it.")
    definition: dict[str, Any] = Field(description="The proposed version's IR.")
    rationale: str = Field(description="Why the proposer expects it to do better.")
    proposer: str = Field(description="Which proposer drafted it.")
    evidence: list[RunId] = Field(description="The selection-set failures it read.")
    usage: Usage = Field(description="Model usage of drafting it (zero for the catalog).")
    gated: bool = Field(description="Waits for an operator's approval (false: registered).")


class ReviewProposal(Versioned):
    """An operator's verdict on a proposal: approve registers the version as the
    workflow's challenger (it starts in shadow); reject asks the proposer for the next
    one, the reason handed over as feedback."""

    type: ClassVar[str] = "ReviewProposal"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant.")
    workflow_id: WorkflowId = Field(description="Workflow of the proposal.")
    proposal_id: str = Field(pattern=r"^[0-9a-f]{16}$", description="The proposal.")
    approve: bool = Field(description="Approve (true) or reject.")
    reason: str = Field("", max_length=2000, description="Why, for the record.")
