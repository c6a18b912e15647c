"""The judge's calibrated health, as decide holds promotion by it (§11, §12.3).

The tournament stage calibrates each tenant's judge on a schedule and publishes
what it found (`JudgeCalibrated`). Decide keeps the tenant's last finding that
judged anything; while scheduled calibration is on and that finding's agreement
with the verifier is below `ASSAY_CALIBRATION_MIN_AGREEMENT`, a challenger that
would be promoted stays on its rung, the standing saying why (`holds.py`). Each later
round steps every held challenger of the tenant again at once on the evidence it was
held on (`moves.step_held_again`): promoted when the round found the judge recovered
(and nothing else holds it), else still held, saying why anew.
"""

from __future__ import annotations

from assay.messages import JudgeCalibrated
from assay.record import BranchKey
from assay_decide.deciding import DecideUnitOfWork
from assay_decide.events import JUDGE_HEALTH_STREAM, JudgeHealthNoted
from assay_decide.moves import step_held_again
from assay_decide.state import LATEST, Allocation, JudgeHealth

__all__ = ["on_judge_calibrated"]


async def on_judge_calibrated(msg: JudgeCalibrated, uow: DecideUnitOfWork) -> None:
    """Note the tenant's judge calibration, unless it judged nothing or is not newer than
    the one noted (a redelivery, or a round overtaken); then step the tenant's held
    challengers again: promoted if nothing holds them now, else held saying why anew.

    The note commits first, so the moves read it; a move that loses its workflow's
    compare-and-swap runs the handler again, which finds this round noted and steps
    what is still held.
    """
    if msg.judged == 0:
        return
    last = await uow.get(JudgeHealth, LATEST)
    if last is not None and last.due_ms > msg.due_ms:
        return
    if last is None or last.due_ms < msg.due_ms:
        async with uow.step():
            uow.record(
                BranchKey.main(uow.tenant, JUDGE_HEALTH_STREAM), JudgeHealthNoted(calibration=msg)
            )
    await step_held_again(uow, [a.workflow_id for _, a in await uow.scan(Allocation)])
