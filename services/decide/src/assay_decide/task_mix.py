"""Task-mix drift holds promotion (§12.5, §12.3: "drift check clean").

Ingest watches a workflow's incoming tasks against the mix its current version was
promoted under and says when a window drifted (`TaskMixDrifted`) and when it took a
new reference (`TaskMixRebased`: at a promotion, or when an operator acknowledged the
drift with `assay ladder ack-drift`). Decide notes the first on the workflow's stream
(`task_mix_hold/<workflow>`) and drops it on the second. While it is there, a
challenger that would be promoted stays on its rung, the standing saying why: the
evidence it climbed on was gathered on a task mix that is no longer the one it would
serve. Rollback and rejection are never held. Once released, a challenger the drift
held is stepped again at once on the evidence it was held on.
"""

from __future__ import annotations

from assay.messages import TaskMixDrifted, TaskMixRebased
from assay_decide.deciding import DecideUnitOfWork
from assay_decide.events import TaskMixHeld, TaskMixReleased
from assay_decide.moves import step_held_again
from assay_decide.state import MixHold
from assay_decide.workflow import Workflow

__all__ = ["on_task_mix_drifted", "on_task_mix_rebased"]


async def on_task_mix_drifted(msg: TaskMixDrifted, uow: DecideUnitOfWork) -> None:
    """Hold the workflow's promotion on a drifted task mix (the latest drift is kept)."""
    w = await Workflow.open(uow, msg.workflow_id)
    w.record(TaskMixHeld(workflow_id=msg.workflow_id, drift=msg))


async def on_task_mix_rebased(msg: TaskMixRebased, uow: DecideUnitOfWork) -> None:
    """A new reference mix: whatever drift held the workflow's promotion no longer does,
    and a challenger it held is stepped again at once on the evidence it was held on.

    The release commits first, so the move reads it; a move that loses the workflow's
    compare-and-swap runs the handler again, which finds nothing left to release and
    steps what is still held.
    """
    w = await Workflow.open(uow, msg.workflow_id)
    if await uow.get(MixHold, msg.workflow_id) is not None:
        async with uow.step():
            w.record(TaskMixReleased(workflow_id=msg.workflow_id, rebased=msg))
    await step_held_again(uow, [msg.workflow_id])
