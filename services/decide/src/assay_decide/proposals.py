"""The slow loop (§12.1): when a challenger's time ends without a replacement, decide asks
its `Proposer` for the next version, and registers it once an operator approves — or at
once for an ungated tenant (§16).

A trigger, not a timer: a challenger rejected by the sequential test or rolled back, or
an operator rejecting the previous proposal. One proposal waits per workflow at a time.
The proposer reads the failures `VariantAggregate` carried — selection-set runs only,
since aggregate never keeps a held-out failure (§12.5) — and every version tried so far,
so it never proposes one twice. A draft is validated here as a registration would be
(and against shadow's entry criteria) before anyone sees it; a draft that fails, a
proposer that fails and a proposer with nothing left to try are each recorded as a
proposal not made, with the reason. Nothing here can fail the handler: the slow loop
degrades its own record, never the fast loop's decision (§1).

An approved proposal enters the DAG as an ordinary `WorkflowRegistered` on
`assay.workflows`, parented on the version it was drafted from; ingest stores it and
decide admits it to shadow like any registration.
"""

from __future__ import annotations

from typing import Any

from assay.bus.topics import DECISIONS, WORKFLOWS
from assay.engine import StepNotExecutable, check_executable
from assay.grading.proposers import Proposal, ProposalInput, ProposerFailed, ProposerUsage
from assay.kernel import Refused, TenantId, WorkflowId, WorkflowVersion
from assay.kernel.canonical import digest
from assay.messages import (
    FailureEvidence,
    ProposalRequested,
    ReviewProposal,
    Usage,
    WorkflowRegistered,
)
from assay.runtime import StageDeps, UnitOfWork
from assay.workflow import WorkflowDef, WorkflowInvalid, validate
from assay_decide.entry import shadow_refusal
from assay_decide.events import ProposalMade, ProposalNotMade, ProposalReviewed
from assay_decide.workflow import Workflow


def proposal_id(tenant: TenantId, workflow: WorkflowId, version: WorkflowVersion) -> str:
    """A proposal's id: the same draft of the same workflow has the same id."""
    return digest(f"proposal\x1f{tenant}\x1f{workflow}\x1f{version}".encode())[:16]


def _usage(u: ProposerUsage) -> Usage:
    return Usage(
        model_calls=u.model_calls,
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
    )


class SlowLoop:
    """Decide's side of the slow loop, over one handler's unit of work."""

    def __init__(self, deps: StageDeps) -> None:
        self.deps = deps
        self.known_tools = frozenset(deps.tools)

    async def propose(
        self,
        w: Workflow,
        current: WorkflowDef,
        ended: WorkflowDef | None,
        outcome: str,
        reason: str,
        failures: list[FailureEvidence],
        *,
        replacing: bool = False,
    ) -> None:
        """Ask the proposer for the next version of `current` and record what came of it.

        `replacing`: the open proposal was just rejected in this handler (its state still
        reads open until the commit)."""
        uow, workflow = w.uow, w.id
        if not replacing and await uow.get_document("open_proposal", workflow) is not None:
            return  # one proposal waits for an operator at a time
        after = ended.version if ended is not None else current.version
        tried, feedback = await self._history(uow, workflow)
        request = ProposalInput(
            tenant=uow.tenant,
            workflow_id=workflow,
            current=current,
            ended=ended,
            outcome=outcome,
            reason=reason,
            failures=failures,
            tried=frozenset(tried),
            feedback=feedback,
        )
        proposer = self.deps.proposer
        try:
            proposal = await proposer.propose(request)
        except ProposerFailed as exc:
            self._not_made(w, after, exc.reason, exc.usage)
            return
        if proposal is None:
            why = (
                "no selection-set failure to learn from"
                if not failures
                else f"nothing left to propose from {len(failures)} selection-set failure(s)"
            )
            self._not_made(w, after, why, ProposerUsage())
            return
        refusal = self._refusal(proposal.definition, request)
        if refusal is not None:
            self._not_made(w, after, f"draft refused: {refusal}", proposal.usage)
            return
        self._made(w, request, proposal, after)

    async def review(self, msg: ReviewProposal, uow: UnitOfWork[Any]) -> None:
        """An operator approved or rejected a proposal.

        Raises:
            Refused: no such proposal of the workflow for the tenant, it was already
                reviewed the other way, or (approving) the workflow has a challenger.
        """
        w = await Workflow.open(uow, msg.workflow_id)
        doc = await uow.get_document("proposal", msg.proposal_id)
        if doc is None or doc["workflow_id"] != msg.workflow_id:
            raise Refused(
                f"no proposal {msg.proposal_id} of workflow {msg.workflow_id!r} "
                f"for tenant {uow.tenant}"
            )
        wanted = "approved" if msg.approve else "rejected"
        if doc["status"] == wanted:
            return  # a repeated review
        if doc["status"] != "pending":
            raise Refused(f"proposal {msg.proposal_id} was already {doc['status']}")
        alloc = await w.allocation()
        assert alloc is not None  # a proposal is only ever made for a workflow decide holds
        if msg.approve and alloc.get("challenger"):
            raise Refused(
                f"workflow {msg.workflow_id!r} has challenger {alloc['challenger']} on "
                f"{alloc.get('rung') or 'the ladder'}; approve proposal {msg.proposal_id} once "
                "its time ends"
            )
        w.record(
            ProposalReviewed(
                workflow_id=msg.workflow_id,
                proposal_id=msg.proposal_id,
                approved=msg.approve,
                reason=msg.reason or ("approved" if msg.approve else "rejected"),
                by="operator",
            ),
        )
        proposal = ProposalRequested.model_validate(
            {k: v for k, v in doc.items() if k not in ("failures", "status", "review")}
        )
        if msg.approve:
            _register(uow, proposal)
            return
        failures = [FailureEvidence.model_validate(f) for f in doc["failures"]]
        current = WorkflowDef.model_validate(alloc["definitions"][alloc["current"]])
        await self.propose(
            w,
            current,
            WorkflowDef.model_validate(proposal.definition),
            "proposal_rejected",
            msg.reason or "an operator rejected the previous proposal",
            failures,
            replacing=True,
        )

    async def _history(
        self, uow: UnitOfWork[Any], workflow: WorkflowId
    ) -> tuple[set[WorkflowVersion], list[str]]:
        """Every version of the workflow decide held, turned away or saw proposed, and
        the reasons operators gave for rejecting proposals."""
        tried = {
            WorkflowVersion(v)
            for v, d in await uow.scan_documents("known")
            if d["workflow_id"] == workflow
        }
        feedback = []
        for _, doc in await uow.scan_documents("proposal"):
            if doc["workflow_id"] != workflow:
                continue
            tried.add(WorkflowVersion(doc["workflow_version"]))
            review = doc.get("review") or {}
            if doc["status"] == "rejected" and review.get("reason"):
                feedback.append(str(review["reason"]))
        return tried, feedback

    def _refusal(self, wf: WorkflowDef, request: ProposalInput) -> str | None:
        """Why a draft could not be registered or enter shadow, or None."""
        if wf.id != request.workflow_id:
            return f"it names workflow {wf.id!r}"
        if wf.version in request.tried or wf.version == request.current.version:
            return f"version {wf.version} was already tried"
        try:
            validate(wf, self.known_tools, self.deps.verifier_kinds)
            check_executable(wf)
        except (WorkflowInvalid, StepNotExecutable) as exc:
            return f"invalid workflow: {exc}"
        return shadow_refusal(wf, self.deps)

    def _made(
        self, w: Workflow, request: ProposalInput, proposal: Proposal, after: WorkflowVersion
    ) -> None:
        uow, wf = w.uow, proposal.definition
        gated = self.deps.proposals.gated(uow.tenant)
        announced = ProposalRequested(
            tenant=uow.tenant,
            workflow_id=request.workflow_id,
            proposal_id=proposal_id(uow.tenant, request.workflow_id, wf.version),
            workflow_version=wf.version,
            parent=request.current.version,
            after=after,
            definition=wf.model_dump(mode="json", by_alias=True),
            rationale=proposal.rationale,
            proposer=self.deps.proposer.name,
            evidence=[f.run_id for f in request.failures],
            usage=_usage(proposal.usage),
            gated=gated,
        )
        w.record(ProposalMade(proposal=announced, failures=request.failures))
        uow.emit(DECISIONS, announced)
        if gated:
            return
        w.record(
            ProposalReviewed(
                workflow_id=request.workflow_id,
                proposal_id=announced.proposal_id,
                approved=True,
                reason="the tenant's proposals are ungated",
                by="ungated",
            ),
        )
        _register(uow, announced)

    def _not_made(
        self, w: Workflow, after: WorkflowVersion, reason: str, usage: ProposerUsage
    ) -> None:
        w.record(
            ProposalNotMade(
                workflow_id=w.id,
                after=after,
                proposer=self.deps.proposer.name,
                reason=reason,
                usage=_usage(usage),
            ),
        )


def _register(uow: UnitOfWork[Any], proposal: ProposalRequested) -> None:
    """Put the approved version on `assay.workflows`, parented on its draft's base."""
    uow.emit(
        WORKFLOWS,
        WorkflowRegistered(
            tenant=proposal.tenant, definition=proposal.definition, parents=[proposal.parent]
        ),
    )
