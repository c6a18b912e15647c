"""Every document the tournament stage keeps reads back as its read model, unchanged.

The stored fixture (tests/test_stored_models_grading.py) holds no open group, parked
challenger or rollout group; these scenarios write each of them, and a calibration round."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from assay.grading.calibration_policy import CalibrationPolicy
from assay.grading.strategies import GradingPolicy
from assay.messages import CalibrationDue, GradingCancelled, Usage
from assay_tournament.state import TOURNAMENT_STATE
from services.tournament.tests.tournament_harness import (
    T1,
    T2,
    TENANT,
    Stage,
    challenger,
    closed,
    current,
    deliver,
    open_stage,
    pinned,
    sibling,
    task_id,
)


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    scheduled = CalibrationPolicy(interval_s=3600)
    async with open_stage(tmp_path, GradingPolicy(order_check=1.0), scheduled) as opened:
        yield opened


async def test_every_kind_of_document_reads_back_unchanged(stage: Stage) -> None:
    await stage.verified(challenger(task_id(1), reference_expected=True))  # parked
    await stage.verified(current(task_id(2)))  # a reference
    await stage.verified(challenger(task_id(2)))  # compared, order-checked, shadow spend
    t3 = task_id(3)  # a group left open with two members of four
    await deliver(stage, pinned(current(t3), T1), T1, "xx")
    await deliver(stage, pinned(challenger(t3, "c0"), T2), T2, "x")
    t4 = task_id(4)  # a group closed at quorum
    for i, run in enumerate(
        [pinned(current(t4), T1)] + [pinned(challenger(t4, f"c{i}"), T2) for i in range(3)]
    ):
        await deliver(stage, run, T1 if i == 0 else T2, "x" * (i + 1))
    t5 = task_id(5)  # a rollout group: waiting siblings, then a selection
    runs = [sibling(t5, i) for i in range(3)]
    for i, run in enumerate(runs):
        await stage.verified(run, output="x" * (i + 1))
    stage.judge.prefer_longer = True
    await stage.deliver(closed(t5, runs))
    await stage.verified(current(task_id(2), "failing"), passed=False)  # a whole pair
    await stage.deliver(CalibrationDue(tenant=TENANT, due_ms=0))  # a calibration round
    stopped = challenger(task_id(6), reference_expected=True)  # a cancel while it waits
    await stage.verified(stopped)
    cancelled = GradingCancelled(run=stopped, succeeded=True, usage=Usage(), verified=True)
    await stage.deliver(cancelled, mid="cancel")

    kinds: set[str] = set()
    for model in TOURNAMENT_STATE:
        for _, key, doc in await stage.log.scan_kind(model.kind):
            assert model.model_validate(doc).model_dump(mode="json") == doc, (model.kind, key)
            kinds.add(model.kind)
    assert kinds == {model.kind for model in TOURNAMENT_STATE}
