"""What holds a challenger's promotion (§12.3): the judge's calibration, a drifted task
mix. Each says why, or None; the moves read them (`moves.py`), and the handlers that
note and release them live beside what they note (`judge_health.py`, `task_mix.py`)."""

from __future__ import annotations

from assay.kernel import WorkflowId
from assay_decide.deciding import DecideUnitOfWork
from assay_decide.state import LATEST, JudgeHealth, MixHold


async def calibration_hold(uow: DecideUnitOfWork) -> str | None:
    """Why the tenant's promotions wait on its judge's calibration, or None."""
    policy = uow.deps.calibration
    if not policy.scheduled:
        return None
    health = await uow.get(JudgeHealth, LATEST)
    if health is None:
        return None
    why = policy.hold(health.agreement, health.judged)
    return None if why is None else f"{why} (judge {health.judge})"


async def task_mix_hold(uow: DecideUnitOfWork, workflow: WorkflowId) -> str | None:
    """Why the workflow's promotion waits on its task mix, or None."""
    held = await uow.get(MixHold, workflow)
    if held is None:
        return None
    feature, psi = held.worst()
    return (
        f"task mix drifted: PSI {psi:.3f} on {feature} above {held.threshold:g} over the "
        f"last {held.window} tasks (acknowledge it with `assay ladder ack-drift {workflow}`)"
    )
