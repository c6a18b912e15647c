"""Branch commands in the execute stage (DESIGN §13): `BranchRun` -> K children, a tree.

A `BranchRun` forks K children of an ended run from the checkpoint at a stage
boundary (after one step of the parent branch), each with its declared deltas,
drives each child to its end, then records the lineage. In order:

1. **Check, then fork, in one commit.** Under the run's lease, the command is
   checked against the parent branch (`assay.engine.branching.plan_branch`): a
   boundary the parent never reached, or a delta its snapshot already
   contradicts, refuses the whole command with the reason (it is dead-lettered)
   before any child exists. Otherwise every child's branch — the parent's
   records below the boundary, then `Forked` with the child's deltas — is
   committed at once: branches `live + 1 .. live + K`, in the command's order.
2. **Drive each child to its end**, one after the other, under the same lease,
   with its deltas applied (`Forked` records carry them; a resumed or rewound
   child re-reads them). Each child is verified and graded like any run: its
   episode is frozen, its end recorded, and its `RunExecuted` — marked with its
   branch, parent and child number (`RunRef.branch`) — goes to verification; its
   verifier outcome comes back with its result (`on_result`). A cancel of the run
   stops the child being driven and the ones after it.
3. **Record the lineage.** Each child's `BranchChildResult` (its outcome, the
   first step at which it differs from the parent, its provenance — kind
   `assay-branch`) and the command's `BranchTree` are JSON blobs in the tenant's
   blob store; `BranchTreeRecorded` (the tree and its ref) goes on the run's
   commands stream in the command's final commit.

A redelivered command (a crash, a lost lease) finds the children it forked by
the command id in their `Forked` records, and only finishes what is left: no
child is forked twice, none is driven again once it ended, and the tree is
recorded once.
"""

from __future__ import annotations

from assay.engine import RunFinished, RunSpec
from assay.engine.branching import plan_branch
from assay.engine.events import BranchTreeRecorded, Forked, RunStarted, commands_stream
from assay.engine.lineage import branch_outcome, first_divergence
from assay.engine.run_state import BranchingDone
from assay.kernel import BranchId, Refused, RunId, StepId
from assay.messages import Episode
from assay.messages.branching import (
    PROVENANCE_KIND,
    BranchBoundary,
    BranchChildResult,
    BranchProvenance,
    BranchRun,
    BranchTree,
    BranchTreeChild,
    StageAttribution,
)
from assay.record import BranchKey, LogRecord
from assay.runtime.leases import acquire
from assay.workflow import SubworkflowStep
from assay_execute.driving import ExecuteUnitOfWork, conclude, pin, recorded
from assay_execute.forks import (
    Fork,
    forks_of,
    record_fork,
    refuse_if_driven,
    run_ended,
    source_branch,
)


async def on_branch(msg: BranchRun, uow: ExecuteUnitOfWork) -> None:
    """Fork, drive and record the children of one branch command (see the module)."""
    run = msg.run_id
    mine = await forks_of(uow, run)
    if not mine:
        await refuse_if_driven(uow, run, "branching")
    # An ended run's last worker may hold its lease a while longer: wait it out.
    lease = await acquire(uow.log, uow.tenant, run, uow.deps.worker, uow.deps.ttl_s)
    uow = uow.fenced(lease)
    if not mine:
        if not await run_ended(uow, run):  # again, under the lease
            await refuse_if_driven(uow, run, "branching")
        mine = await _fork(msg, uow)
    for fork in mine:
        if not fork.ended:
            async with uow.step():  # its end is durable before the next child starts
                spec = await recorded(uow, BranchKey.for_run(uow.tenant, run, fork.branch))
                await conclude(spec, uow, lease)  # verified and graded, as any branch
    if await uow.get(BranchingDone, f"{run}/{uow.envelope.id}") is None:
        await _record_tree(msg, uow, mine)


async def _fork(msg: BranchRun, uow: ExecuteUnitOfWork) -> list[Fork]:
    """Check the command against the parent and fork every child in one commit.

    Raises:
        Refused: the command is refused as a whole; nothing was forked.
    """
    run = msg.run_id
    source, live, records = await source_branch(uow, run, msg.branch, rewinds_children=False)
    started = records[0].event
    assert isinstance(started, RunStarted)
    base = pin(uow.deps, started, source)
    plan = plan_branch(
        base,
        records,
        msg.at_step,
        msg.children,
        known_tools=uow.deps.known_tools,
        known_verifiers=uow.deps.known_verifiers,
        ran_subworkflows=await _subworkflows_run(uow, run, source, base),
    )
    forks = []
    async with uow.step():
        for n, child in enumerate(msg.children, start=1):
            forked = Forked(
                from_branch=source,
                at=plan.boundary.at,
                reason=msg.reason,
                command=str(uow.envelope.id),
                deltas=list(child.deltas),
                child=n,
                after_step=msg.at_step,
                label=child.label,
            )
            branch = BranchId(live + n)
            record_fork(uow, run, branch, records, forked)
            forks.append(Fork(branch, forked, ended=False))
    return forks


async def _subworkflows_run(
    uow: ExecuteUnitOfWork, run: RunId, branch: BranchId, base: RunSpec
) -> list[StepId]:
    """The sub-workflow steps that ran on `branch` (their streams exist)."""
    ran = []
    for step in base.definition.steps:
        if isinstance(step, SubworkflowStep):
            key = BranchKey(uow.tenant, f"{run}/sub/{step.id}/0", branch)
            if await uow.log.read(key, limit=1):
                ran.append(step.id)
    return ran


async def _record_tree(msg: BranchRun, uow: ExecuteUnitOfWork, forks: list[Fork]) -> None:
    """Write each child's result and the tree as blobs; record `BranchTreeRecorded`."""
    run, first = msg.run_id, forks[0].forked
    if first.after_step is None:  # a branch command's forks always name their step
        raise Refused(f"run {run}: branch {forks[0].branch} was not forked by a branch command")
    boundary = BranchBoundary(step=first.after_step, branch=first.from_branch, at=first.at)
    parent = await uow.history(BranchKey.for_run(uow.tenant, run, BranchId(boundary.branch)))
    started = parent[0].event
    assert isinstance(started, RunStarted)
    children = [await _child(msg, uow, fork, boundary, parent) for fork in forks]
    tree = BranchTree(
        kind=PROVENANCE_KIND,
        tenant=uow.tenant,
        run_id=run,
        command=str(uow.envelope.id),
        reason=msg.reason,
        workflow_id=started.run.workflow_id,
        workflow_version=started.run.workflow_version,
        boundary=boundary,
        parent=branch_outcome(parent, boundary.at, await _output(uow, parent)),
        children=children,
        attribution=_attribution(children),
    )
    tree_ref = await uow.blobs.put(uow.tenant, tree.encode())
    uow.record(
        BranchKey.main(uow.tenant, commands_stream(run)),
        BranchTreeRecorded(tree_ref=tree_ref, tree=tree),
    )


async def _child(
    msg: BranchRun,
    uow: ExecuteUnitOfWork,
    fork: Fork,
    boundary: BranchBoundary,
    parent: list[LogRecord],
) -> BranchTreeChild:
    """One child's place in the tree, its `BranchChildResult` written as a blob."""
    run, child = msg.run_id, fork.forked.child
    if child is None:
        raise Refused(f"run {run}: branch {fork.branch} was not forked by a branch command")
    started = parent[0].event
    assert isinstance(started, RunStarted)
    key = BranchKey.for_run(uow.tenant, run, fork.branch)
    records = await uow.history(key)
    outcome = branch_outcome(records, boundary.at, await _output(uow, records))
    provenance = BranchProvenance(
        kind=PROVENANCE_KIND,
        tenant=uow.tenant,
        run_id=run,
        command=str(uow.envelope.id),
        boundary=boundary,
        child=child,
        branch=fork.branch,
        label=fork.forked.label,
        deltas=fork.forked.deltas,
        workflow_id=started.run.workflow_id,
        workflow_version=started.run.workflow_version,
        effective_version=(await recorded(uow, key)).definition.version,
    )
    result = BranchChildResult(
        provenance=provenance,
        outcome=outcome,
        diverged_at=first_divergence(parent, records, boundary.at),
    )
    return BranchTreeChild(
        child=provenance.child,
        branch=fork.branch,
        label=provenance.label,
        deltas=provenance.deltas,
        outcome=outcome,
        diverged_at=result.diverged_at,
        result=await uow.blobs.put(uow.tenant, result.encode()),
    )


def _attribution(children: list[BranchTreeChild]) -> list[StageAttribution]:
    """The children grouped by the step of their first difference (None last)."""
    steps: dict[StepId | None, list[int]] = {}
    for c in children:
        steps.setdefault(c.diverged_at.step if c.diverged_at else None, []).append(c.child)
    ordered = [s for s in steps if s is not None] + ([None] if None in steps else [])
    return [StageAttribution(step=s, children=steps[s]) for s in ordered]


async def _output(uow: ExecuteUnitOfWork, records: list[LogRecord]) -> str | None:
    """The output of a branch's frozen episode, when its blob is still there."""
    ref = next((r.event.episode for r in records if isinstance(r.event, RunFinished)), None)
    raw = None if ref is None else await uow.blobs.get(uow.tenant, ref)
    if raw is None:  # reduced since (§8.6), or never finished
        return None
    try:
        return Episode.model_validate_json(raw).output
    except ValueError:
        return None
