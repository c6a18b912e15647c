"""The console's queries over each workflow's ladder: the workflows of a tenant, and one
workflow's version DAG, allocation history, challengers' evidence (the sequential
test's path, the win record, pass rates, strengths) and decisions.

Everything is read from the workflow's stream in the console's own log (`ladder.py`)
and the tenant's `WorkflowRow` documents; every query is scoped to one tenant.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from assay.kernel.ids import Lsn, TenantId
from assay.kernel.scores import WinRecord
from assay.messages import StrengthSummary
from assay.record import LogRecord
from assay.store.ports import EventLog
from assay_console.ladder import (
    AllocationSeen,
    DecisionSeen,
    EvidenceSeen,
    ProposalRow,
    ProposalSeen,
    ReviewSeen,
    VersionSeen,
    WorkflowRow,
    workflow_stream,
)
from assay_console.workflow_views import (
    Challenger,
    DecisionEntry,
    HeldOut,
    ProposalEntry,
    ProposalsList,
    ProposalView,
    RungEntry,
    SprtPath,
    SprtPoint,
    Strength,
    VersionNode,
    WorkflowDetail,
    WorkflowsList,
    WorkflowSummary,
)

READ_CHUNK = 10_000


def summary_of(row: WorkflowRow) -> WorkflowSummary:
    """A row of the list from a workflow's document."""
    return WorkflowSummary(
        workflow_id=row.workflow_id,
        current=row.current,
        challenger=row.challenger,
        rung=row.rung,
        share=row.share,
        generation=row.generation,
        latest=row.latest,
        updated=datetime.fromisoformat(row.updated) if row.updated else None,
        challengers=row.live,
    )


async def list_workflows(log: EventLog, tenant: TenantId) -> WorkflowsList:
    """The tenant's workflows, by id."""
    found = await log.scan(tenant, WorkflowRow.kind)
    rows = [summary_of(WorkflowRow.model_validate(doc)) for _, doc in sorted(found)]
    return WorkflowsList(workflows=rows)


async def _records(log: EventLog, tenant: TenantId, workflow_id: str) -> list[LogRecord]:
    key = workflow_stream(tenant, workflow_id)
    out: list[LogRecord] = []
    while True:
        chunk = await log.read(key, Lsn(out[-1].lsn + 1 if out else 0), READ_CHUNK)
        out += chunk
        if len(chunk) < READ_CHUNK:
            return out


def _rate(passes: int, runs: int) -> float | None:
    return passes / runs if runs else None


def _point(e: EvidenceSeen, latest: EvidenceSeen) -> SprtPoint:
    r = e.record
    return SprtPoint(
        comparisons=r.comparisons,
        wins=r.wins,
        losses=r.losses,
        draws=r.draws,
        llr=e.llr,
        at=e.at,
        policy_changed=e.policy != latest.policy,
    )


def sprt_path(evidence: list[EvidenceSeen]) -> SprtPath:
    """The test's path: the origin, then one point per published comparison count."""
    latest = evidence[-1]
    origin = SprtPoint(
        comparisons=0,
        wins=0,
        losses=0,
        draws=0,
        llr=0.0,
        at=evidence[0].at,
        policy_changed=evidence[0].policy != latest.policy,
    )
    points = [origin]
    for e in evidence:
        point = _point(e, latest)
        if point.comparisons > points[-1].comparisons:
            points.append(point)
        elif point.comparisons == points[-1].comparisons and point.comparisons > 0:
            points[-1] = point  # republished with no new comparison: keep the newest
    last = points[-1].llr
    decision: Literal["accept", "reject", "continue"] = (
        "accept" if last >= latest.upper else "reject" if last <= latest.lower else "continue"
    )
    p = latest.policy
    return SprtPath(
        p0=p.p0,
        p1=p.p1,
        alpha=p.alpha,
        beta=p.beta,
        upper=latest.upper,
        lower=latest.lower,
        points=points,
        decision=decision,
    )


def strengths(e: EvidenceSeen) -> list[Strength]:
    """The challenger's strengths from control: on selection tasks, and held-out ones."""
    held = e.held_out.strength if e.held_out is not None else None
    given: list[tuple[Literal["selection", "held_out"], StrengthSummary | None]] = [
        ("selection", e.strength),
        ("held_out", held),
    ]
    out = []
    for tasks, s in given:
        if s is None or s.episodes == 0:
            continue
        label = "selection tasks" if tasks == "selection" else "held-out tasks"
        out.append(
            Strength(
                label=f"{e.workflow_version[:12]} on {label}",
                version=e.workflow_version,
                tasks=tasks,
                mean=s.mean,
                low=s.interval[0],
                high=s.interval[1],
                episodes=s.episodes,
            )
        )
    return out


def _within(record: WinRecord, bound: WinRecord) -> bool:
    """Whether a cumulative record is at or before `bound` (no count past it)."""
    mine, theirs = record.model_dump(), bound.model_dump()
    return all(mine[k] <= theirs[k] for k in mine)


def challenger_of(
    evidence: list[EvidenceSeen], live: bool, decision: DecisionEntry | None
) -> Challenger:
    """A challenger's evidence up to its decision (the latest, while it is live), with
    the test's path over it. Evidence published after the decision — its runs still in
    flight when it ended — moved nothing, so neither the path nor the figures show it."""
    if decision is not None:
        evidence = [e for e in evidence if _within(e.record, decision.record)] or evidence[:1]
    e = evidence[-1]
    held = None
    gap = None
    if e.held_out is not None:
        h = e.held_out
        held = HeldOut(
            runs=h.runs, passes=h.passes, pass_rate=_rate(h.passes, h.runs), record=h.record
        )
        selection = _rate(e.passes, e.runs)
        if selection is not None and held.pass_rate is not None:
            gap = selection - held.pass_rate
    return Challenger(
        version=e.workflow_version,
        baseline=e.baseline_version,
        live=live,
        outcome=decision.outcome if decision else None,
        record=e.record,
        runs=e.runs,
        passes=e.passes,
        pass_rate=_rate(e.passes, e.runs),
        baseline_pass_rate=_rate(e.baseline_passes, e.baseline_runs),
        held_out=held,
        gap=gap,
        order_checked=e.order_checked,
        order_inconsistent=e.order_inconsistent,
        sprt=sprt_path(evidence),
        strengths=strengths(e),
    )


def _status(
    version: str,
    row: WorkflowRow,
    ended: dict[str, str],
    proposed: dict[str, ProposalEntry],
) -> str:
    if version == row.current:
        return "current"
    if version in {c.version for c in row.live} or version == row.challenger:
        return "challenger"
    if version in ended:
        return ended[version]
    proposal = proposed.get(version)
    if proposal is not None and proposal.status != "approved":
        return "proposed" if proposal.status == "pending" else "proposal_rejected"
    return "registered"


def _node(v: VersionSeen) -> VersionNode:
    return VersionNode(
        version=v.workflow_version,
        parents=list(v.parents),
        registered_at=v.at,
        description=v.description,
        grading=v.grading,
        proposal=None,
        status="registered",
    )


def _rung(a: AllocationSeen) -> RungEntry:
    return RungEntry(
        at=a.at,
        generation=a.generation,
        current=a.current,
        challenger=a.challenger,
        rung=a.rung.value if a.rung else None,
        share=a.share,
        shares=a.shares,
    )


def _decision(d: DecisionSeen) -> DecisionEntry:
    return DecisionEntry(
        at=d.at,
        version=d.workflow_version,
        outcome=d.outcome,
        reason=d.reason,
        trigger=d.trigger,
        rung=d.rung.value if d.rung else None,
        llr=d.llr,
        record=d.record,
    )


def _proposal(p: ProposalSeen, review: ReviewSeen | None) -> ProposalEntry:
    status: Literal["pending", "approved", "rejected"] = "pending" if p.gated else "approved"
    if review is not None:
        status = "approved" if review.approve else "rejected"
    return ProposalEntry(
        proposal_id=p.proposal_id,
        at=p.at,
        version=p.workflow_version,
        parent=p.parent,
        after=p.after,
        rationale=p.rationale,
        proposer=p.proposer,
        evidence=p.evidence,
        status=status,
        review=review.reason if review else None,
    )


def _proposed_node(p: ProposalEntry) -> VersionNode:
    return VersionNode(
        version=p.version,
        parents=[p.parent],
        registered_at=None,
        description="",
        grading=None,
        proposal=p.proposal_id,
        status="registered",
    )


async def workflow_detail(
    log: EventLog, tenant: TenantId, workflow_id: str
) -> WorkflowDetail | None:
    """One workflow of the tenant; None when the tenant has no such workflow.

    The console's stream interleaves topics, so nothing here relies on their order
    across topics (a review may come before its proposal, evidence after a decision).
    """
    doc = await log.get(WorkflowRow.at(tenant, workflow_id))
    if doc is None:
        return None
    row = WorkflowRow.model_validate(doc)
    events = [r.event for r in await _records(log, tenant, workflow_id)]
    nodes: dict[str, VersionNode] = {}
    for v in (e for e in events if isinstance(e, VersionSeen)):
        nodes.setdefault(v.workflow_version, _node(v))
    reviews = {e.proposal_id: e for e in events if isinstance(e, ReviewSeen)}
    proposals = [
        _proposal(e, reviews.get(e.proposal_id)) for e in events if isinstance(e, ProposalSeen)
    ]
    for p in proposals:  # a proposal not (yet) registered is a node too
        nodes.setdefault(p.version, _proposed_node(p)).proposal = p.proposal_id
    rungs = [_rung(e) for e in events if isinstance(e, AllocationSeen)]
    decisions = sorted(
        (_decision(e) for e in events if isinstance(e, DecisionSeen)), key=lambda d: d.at
    )
    ended = {d.version: d.outcome for d in decisions}
    ended |= {r.current: "retired" for r in rungs if r.current != row.current}
    by_version = {p.version: p for p in proposals}
    for node in nodes.values():
        node.status = _status(node.version, row, ended, by_version)
    evidence: dict[str, list[EvidenceSeen]] = {}
    for e in (e for e in events if isinstance(e, EvidenceSeen)):
        evidence.setdefault(e.workflow_version, []).append(e)
    decided = {d.version: d for d in decisions}
    live = {c.version for c in row.live} | ({row.challenger} if row.challenger else set())
    return WorkflowDetail(
        workflow=summary_of(row),
        versions=list(nodes.values()),
        rungs=rungs,
        challengers=[
            challenger_of(evs, live=v in live, decision=decided.get(v))
            for v, evs in evidence.items()
        ],
        decisions=decisions,
        proposals=proposals,
    )


def _when(at: str | None) -> datetime | None:
    return datetime.fromisoformat(at) if at else None


def proposal_view(row: ProposalRow) -> ProposalView:
    """A proposal as the API shows it, from its document."""
    status: Literal["pending", "approved", "rejected"] = "pending" if row.gated else "approved"
    if row.approve is not None:
        status = "approved" if row.approve else "rejected"
    return ProposalView(
        proposal_id=row.proposal_id,
        workflow_id=row.workflow_id,
        at=_when(row.proposed_at),
        version=row.workflow_version,
        parent=row.parent,
        after=row.after,
        rationale=row.rationale,
        proposer=row.proposer,
        evidence=row.evidence,
        status=status,
        review=row.review,
        reviewed_at=_when(row.reviewed_at),
    )


async def proposal_row(log: EventLog, tenant: TenantId, proposal_id: str) -> ProposalRow | None:
    """The tenant's proposal; None when the console has seen no such proposal of it."""
    doc = await log.get(ProposalRow.at(tenant, proposal_id))
    row = ProposalRow.model_validate(doc) if doc is not None else None
    return row if row is not None and row.gated is not None else None


async def open_proposals(log: EventLog, tenant: TenantId) -> ProposalsList:
    """The tenant's proposals waiting for an operator's review, oldest first."""
    found = await log.scan(tenant, ProposalRow.kind)
    rows = [ProposalRow.model_validate(doc) for _, doc in found]
    waiting = sorted(
        (r for r in rows if r.open), key=lambda r: (r.proposed_at or "", r.proposal_id)
    )
    return ProposalsList(proposals=[proposal_view(r) for r in waiting])
