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
from assay.workflow import WorkflowDef, WorkflowInvalid, validate
from assay_decide.deciding import DecideUnitOfWork, Deciding
from assay_decide.entry import shadow_refusal
from assay_decide.events import ProposalMade, ProposalNotMade, ProposalReviewed
from assay_decide.proposer_spend import propose_within_ceiling
from assay_decide.state import Allocation, Known, OpenProposal, ProposalRecord
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


async def on_review_proposal(msg: ReviewProposal, uow: DecideUnitOfWork) -> None:
    """An operator approved a proposal (it is registered) or rejected it (the proposer
    is asked again, told why).

    Raises:
        Refused: no such proposal of the workflow for the tenant, it was already
            reviewed the other way, or (approving) the workflow has as many challengers
            as it allows.
    """
    w = await Workflow.open(uow, msg.workflow_id)
    doc = _under_review(await uow.get(ProposalRecord, msg.proposal_id), msg, uow.tenant)
    if doc is None:
        return  # a repeated review
    alloc = await w.allocation()
    assert alloc is not None  # a proposal is only ever made for a workflow decide holds
    _refuse_approval_beside_challenger(msg, alloc)
    reason = msg.reason or ("approved" if msg.approve else "rejected")
    w.record(
        ProposalReviewed(
            workflow_id=msg.workflow_id,
            proposal_id=msg.proposal_id,
            approved=msg.approve,
            reason=reason,
            by="operator",
        )
    )
    proposal = doc.announced()
    if msg.approve:
        _register(uow, proposal)
        return
    await propose(
        w,
        alloc.definition(alloc.current),
        WorkflowDef.model_validate(proposal.definition),
        "proposal_rejected",
        msg.reason or "an operator rejected the previous proposal",
        doc.failures,
        replacing=True,
    )


def _refuse_approval_beside_challenger(msg: ReviewProposal, alloc: Allocation) -> None:
    """No more live challengers than the workflow allows: a proposal is approved once a
    place is free.

    Raises:
        Refused: the review approves and the workflow has as many challengers as it allows.
    """
    if msg.approve and len(alloc.live) >= alloc.allowed:
        rungs = ", ".join(f"{c.version} on {c.rung.value}" for c in alloc.challengers)
        raise Refused(
            f"workflow {msg.workflow_id!r} has challenger {rungs} (at most "
            f"{alloc.allowed} at a time); approve proposal {msg.proposal_id} once a "
            "challenger's time ends"
        )


def _under_review(
    doc: ProposalRecord | None, msg: ReviewProposal, tenant: TenantId
) -> ProposalRecord | None:
    """The proposal the review changes (None: it was already reviewed so).

    Raises:
        Refused: no such proposal of the workflow for the tenant, or it was already
            reviewed the other way.
    """
    if doc is None or doc.workflow_id != msg.workflow_id:
        raise Refused(
            f"no proposal {msg.proposal_id} of workflow {msg.workflow_id!r} for tenant {tenant}"
        )
    if doc.status == ("approved" if msg.approve else "rejected"):
        return None
    if doc.status != "pending":
        raise Refused(f"proposal {msg.proposal_id} was already {doc.status}")
    return doc


async def propose(
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
    uow, deps = w.uow, w.uow.deps
    if not replacing and await uow.get(OpenProposal, w.id) is not None:
        return  # one proposal waits for an operator at a time
    after = ended.version if ended is not None else current.version
    tried, feedback = await _history(uow, w.id)
    request = ProposalInput(
        tenant=uow.tenant,
        workflow_id=w.id,
        current=current,
        ended=ended,
        outcome=outcome,
        reason=reason,
        failures=failures,
        tried=frozenset(tried),
        feedback=feedback,
    )
    try:
        proposal = await propose_within_ceiling(uow, request)
    except ProposerFailed as exc:
        _not_made(w, after, exc.reason, exc.usage)
        return
    if proposal is None:
        why = (
            "no selection-set failure to learn from"
            if not failures
            else f"nothing left to propose from {len(failures)} selection-set failure(s)"
        )
        _not_made(w, after, why, ProposerUsage())
        return
    refusal = _refusal(proposal.definition, request, deps)
    if refusal is not None:
        _not_made(w, after, f"draft refused: {refusal}", proposal.usage)
        return
    _made(w, request, proposal, after)


async def _history(
    uow: DecideUnitOfWork, workflow: WorkflowId
) -> tuple[set[WorkflowVersion], list[str]]:
    """Every version of the workflow decide held, turned away or saw proposed, and
    the reasons operators gave for rejecting proposals."""
    tried = {
        WorkflowVersion(v) for v, known in await uow.scan(Known) if known.workflow_id == workflow
    }
    feedback = []
    for _, proposal in await uow.scan(ProposalRecord):
        if proposal.workflow_id != workflow:
            continue
        tried.add(proposal.workflow_version)
        if proposal.status == "rejected" and proposal.review and proposal.review.reason:
            feedback.append(proposal.review.reason)
    return tried, feedback


def _refusal(wf: WorkflowDef, request: ProposalInput, deps: Deciding) -> str | None:
    """Why a draft could not be registered or enter shadow, or None."""
    if wf.id != request.workflow_id:
        return f"it names workflow {wf.id!r}"
    if wf.version in request.tried or wf.version == request.current.version:
        return f"version {wf.version} was already tried"
    try:
        validate(wf, frozenset(deps.tools), deps.verifier_kinds)
        check_executable(wf)
    except (WorkflowInvalid, StepNotExecutable) as exc:
        return f"invalid workflow: {exc}"
    return shadow_refusal(wf, deps)


def _made(w: Workflow, request: ProposalInput, proposal: Proposal, after: WorkflowVersion) -> None:
    uow, wf, deps = w.uow, proposal.definition, w.uow.deps
    gated = deps.proposals.gated(uow.tenant)
    announced = ProposalRequested(
        tenant=uow.tenant,
        workflow_id=request.workflow_id,
        proposal_id=proposal_id(uow.tenant, request.workflow_id, wf.version),
        workflow_version=wf.version,
        parent=request.current.version,
        after=after,
        definition=wf.model_dump(mode="json", by_alias=True),
        rationale=proposal.rationale,
        proposer=deps.proposer.name,
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


def _not_made(w: Workflow, after: WorkflowVersion, reason: str, usage: ProposerUsage) -> None:
    w.record(
        ProposalNotMade(
            workflow_id=w.id,
            after=after,
            proposer=w.uow.deps.proposer.name,
            reason=reason,
            usage=_usage(usage),
        ),
    )


def _register(uow: DecideUnitOfWork, proposal: ProposalRequested) -> None:
    """Put the approved version on `assay.workflows`, parented on its draft's base."""
    uow.emit(
        WORKFLOWS,
        WorkflowRegistered(
            tenant=proposal.tenant, definition=proposal.definition, parents=[proposal.parent]
        ),
    )
