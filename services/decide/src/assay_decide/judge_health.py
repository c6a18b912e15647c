"""The judge's calibrated health, as decide holds promotion by it (§11, §12.3).

The tournament stage calibrates each tenant's judge on a schedule and publishes
what it found (`JudgeCalibrated`). Decide keeps the tenant's last finding that
judged anything; while scheduled calibration is on and that finding's agreement
with the verifier is below `ASSAY_CALIBRATION_MIN_AGREEMENT`, a challenger that
would be promoted stays on its rung, the standing saying why, until a later round
finds the judge recovered and the challenger's next evidence arrives.
"""

from __future__ import annotations

from assay.messages import JudgeCalibrated
from assay.record import BranchKey
from assay_decide.deciding import DecideUnitOfWork
from assay_decide.events import JUDGE_HEALTH_STREAM, JudgeHealthNoted
from assay_decide.state import LATEST, JudgeHealth


async def on_judge_calibrated(msg: JudgeCalibrated, uow: DecideUnitOfWork) -> None:
    """Note the tenant's judge calibration, unless it judged nothing or is not newer than
    the one noted (a redelivery, or a round overtaken)."""
    if msg.judged == 0:
        return
    last = await uow.get(JudgeHealth, LATEST)
    if last is not None and last.due_ms >= msg.due_ms:
        return
    uow.record(BranchKey.main(uow.tenant, JUDGE_HEALTH_STREAM), JudgeHealthNoted(calibration=msg))


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
