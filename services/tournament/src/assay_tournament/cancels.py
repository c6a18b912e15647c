"""Cancel means stop (§5.2): a branch cancelled while it is verified or graded.

Verify passes the execute stage's `CancelGrading` on as `GradingCancelled`, keyed by
task like the branch's `RunVerified`, so this stage handles the two in order,
whichever comes first. A branch not yet scored leaves the group or the reference
it waited for (`GradingStopped`), gets no judge call from then on, and ends
`Cancelled` with a `cancelled` result and no score — never a grade. One scored
before the cancel reached it keeps its result: the work was done and the record
stands.
"""

from __future__ import annotations

from assay.bus.topics import RUN_STATUS
from assay.kernel import RunState
from assay.messages import GradingCancelled, Purpose, RunResult, RunStatusChanged
from assay.record import BranchKey
from assay_tournament.events import GradingStopped
from assay_tournament.grading import Scoring, TournamentUnitOfWork
from assay_tournament.state import Scored, Stopped


async def on_grading_cancelled(msg: GradingCancelled, uow: TournamentUnitOfWork) -> None:
    """End a cancelled branch's grading before any (further) judge call."""
    r = msg.run
    if r.rollout is not None:
        return  # a sibling's grading is its group's; `CancelRollout` stops the group
    if await uow.get(Scored, r.graded_as) or await uow.get(Stopped, r.graded_as):
        return  # graded before the cancel reached it, or stopped already
    stopped = GradingStopped(
        run_id=r.run_id, branch=r.branch_id, task_id=r.task_id, reason=msg.reason
    )
    uow.record(BranchKey.main(uow.tenant, f"task:{r.task_id}"), stopped)
    detail = msg.reason or "cancelled by an operator"
    uow.emit(RUN_STATUS, RunStatusChanged(run=r, state=RunState.CANCELLED, detail=detail))
    if r.purpose is not Purpose.WORK:
        return
    s = await Scoring.open(uow)
    await s.issue(
        RunResult(
            tenant=r.tenant,
            run_id=r.run_id,
            task_id=r.task_id,
            idempotency_key=r.idempotency_key,
            workflow_id=r.workflow_id,
            workflow_version=r.workflow_version,
            status="cancelled",
            passed=False,
            verification=[],
            score=None,
            usage=msg.usage,
            termination="succeeded" if msg.succeeded else "failed",
            held_out=r.held_out,
            branch=r.branch_id,
            parent_branch=None if r.branch is None else r.branch.parent,
        )
    )
