"""Promotion waits while the tenant's calibrated judge disagrees with the verifier (§11,
§12.3), and goes ahead once a later calibration finds it recovered."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from assay.bus import AGGREGATES, WORKFLOWS
from assay.grading.calibration_policy import CalibrationPolicy
from assay.kernel import TenantId
from assay.kernel.scores import WinRecord
from assay.messages import AllocationChanged, JudgeCalibrated, Promoted
from services.decide.tests.decide_harness import (
    LADDER,
    TENANT,
    Stage,
    evidence,
    ir,
    open_stage,
)
from services.decide.tests.test_decide_task_mix import drifted, rebased

OTHER = TenantId(uuid.UUID("00000000-0000-4000-8000-0000000000d2"))
WINS = WinRecord(judge_wins=6, verifier_wins=3)
SOME = WinRecord(judge_wins=3, judge_losses=1)
SCHEDULED = CalibrationPolicy(interval_s=3600, min_agreement=0.7, min_judged=4)


def calibrated(due_ms: int, agreed: int, judged: int) -> JudgeCalibrated:
    return JudgeCalibrated(
        tenant=TENANT,
        judge="judge-model",
        due_ms=due_ms,
        source="verified_runs",
        pairs=judged // 2,
        judged=judged,
        agreed=agreed,
        draws=0,
        failures=0,
        checked=judged // 2,
        inconsistent=0,
        agreement=agreed / judged if judged else None,
        order_inconsistency_rate=0.0 if judged else None,
        model_calls=judged,
        cost_usd=0.0,
    )


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    async with open_stage(tmp_path, calibration=SCHEDULED) as s:
        await s.register(1)
        await s.register(2)
        await s.evidence(evidence(2, record=SOME, screened=LADDER.min_shadow_runs))  # -> trial
        yield s


async def standing(stage: Stage) -> dict[str, Any]:
    doc = await stage.standing()
    assert doc is not None
    return doc


async def test_low_agreement_holds_promotion_until_a_calibration_finds_it_recovered(
    stage: Stage,
) -> None:
    await stage.send(AGGREGATES, calibrated(1_000, agreed=4, judged=10))  # 40% < 70%
    served = LADDER.min_trial_runs
    assert await stage.evidence(evidence(2, record=WINS, served=served)) == []
    held = (await standing(stage))["held"]
    assert held == (
        "judge-versus-verifier agreement 40% over 10 calibration orderings is below 70% "
        "(judge judge-model)"
    )
    assert (await stage.allocation())["rung"] == "trial"
    health = await stage.state("judge_health", "latest")
    assert health is not None
    assert (health["agreed"], health["judged"], health["due_ms"]) == (4, 10, 1_000)

    # A later round finds the judge recovered (90%): the held challenger is promoted at
    # once, on the evidence it was held on — no new evidence is needed.
    await stage.send(AGGREGATES, calibrated(2_000, agreed=9, judged=10))
    out = await stage.take()
    assert [type(m) for m in out] == [Promoted, AllocationChanged]
    assert (out[0].workflow_version, out[0].record) == (ir(2).version, WINS)
    assert await stage.state("held_evidence", f"arith/{ir(2).version}") is None


async def test_a_round_that_still_finds_the_judge_low_releases_nothing(stage: Stage) -> None:
    await stage.send(AGGREGATES, calibrated(1_000, agreed=4, judged=10))
    held = evidence(2, record=WINS, served=LADDER.min_trial_runs)
    assert await stage.evidence(held) == []
    stored = await stage.state("held_evidence", f"arith/{ir(2).version}")
    assert stored is not None
    assert stored["served"] == LADDER.min_trial_runs
    newer = evidence(2, record=WINS, served=LADDER.min_trial_runs + 1)
    assert await stage.evidence(newer) == []  # still held: the newest evidence is kept
    stored = await stage.state("held_evidence", f"arith/{ir(2).version}")
    assert stored is not None
    assert stored["served"] == LADDER.min_trial_runs + 1
    await stage.send(AGGREGATES, calibrated(2_000, agreed=5, judged=10))  # 50%: still low
    assert await stage.take() == []
    assert (await standing(stage))["held"].startswith("judge-versus-verifier agreement 50%")
    await stage.send(AGGREGATES, calibrated(3_000, agreed=8, judged=10))  # 80%: recovered
    out = await stage.take()
    assert [type(m) for m in out] == [Promoted, AllocationChanged]


async def test_a_recovery_waits_on_a_drift_that_still_holds(stage: Stage) -> None:
    await stage.send(AGGREGATES, calibrated(1_000, agreed=4, judged=10))
    assert await stage.evidence(evidence(2, record=WINS, served=LADDER.min_trial_runs)) == []
    await stage.send(WORKFLOWS, drifted())
    await stage.send(AGGREGATES, calibrated(2_000, agreed=9, judged=10))  # judge recovered
    assert await stage.take() == []
    assert (await standing(stage))["held"].startswith("task mix drifted")
    await stage.send(WORKFLOWS, rebased())  # the drift acknowledged: nothing holds it now
    assert [type(m) for m in await stage.take()] == [Promoted, AllocationChanged]


async def test_an_older_or_empty_calibration_changes_nothing(stage: Stage) -> None:
    await stage.send(AGGREGATES, calibrated(2_000, agreed=9, judged=10))
    await stage.send(AGGREGATES, calibrated(1_000, agreed=1, judged=10))  # overtaken round
    await stage.send(AGGREGATES, calibrated(3_000, agreed=0, judged=0))  # judged nothing
    health = await stage.state("judge_health", "latest")
    assert health is not None
    assert health["due_ms"] == 2_000
    out = await stage.evidence(evidence(2, record=WINS, served=LADDER.min_trial_runs))
    assert [type(m) for m in out] == [Promoted, AllocationChanged]


async def test_too_few_orderings_hold_nothing(stage: Stage) -> None:
    await stage.send(AGGREGATES, calibrated(1_000, agreed=0, judged=2))  # below min_judged
    out = await stage.evidence(evidence(2, record=WINS, served=LADDER.min_trial_runs))
    assert [type(m) for m in out] == [Promoted, AllocationChanged]


async def test_without_a_schedule_the_last_calibration_holds_nothing(tmp_path: Path) -> None:
    async with open_stage(tmp_path, calibration=CalibrationPolicy()) as s:
        await s.register(1)
        await s.register(2)
        await s.evidence(evidence(2, record=SOME, screened=LADDER.min_shadow_runs))
        await s.send(AGGREGATES, calibrated(1_000, agreed=0, judged=10))
        out = await s.evidence(evidence(2, record=WINS, served=LADDER.min_trial_runs))
        assert [type(m) for m in out] == [Promoted, AllocationChanged]


async def test_another_tenants_calibration_holds_nothing_here(tmp_path: Path) -> None:
    async with open_stage(tmp_path, calibration=SCHEDULED) as s:
        await s.register(1)
        await s.register(2)
        await s.evidence(evidence(2, record=SOME, screened=LADDER.min_shadow_runs))
        theirs = calibrated(1_000, agreed=0, judged=10).model_copy(update={"tenant": OTHER})
        await s.send(AGGREGATES, theirs, tenant=OTHER)
        assert await s.state("judge_health", "latest") is None
        out = await s.evidence(evidence(2, record=WINS, served=LADDER.min_trial_runs))
        assert [type(m) for m in out] == [Promoted, AllocationChanged]
