"""The aggregate stage: win records per challenger and pass rates per version."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from assay.bus import GRADED
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import StubJudge
from assay.kernel import RunId, TaskId, TenantId, WorkflowId, WorkflowVersion, new_run_id
from assay.kernel.scores import (
    Capped,
    CoreViolation,
    DecidedBy,
    Outcome,
    Relative,
    Score,
    Ungraded,
    UngradedReason,
    Verdict,
    WinRecord,
)
from assay.messages import Purpose, Role, RunGraded, RunRef, VariantAggregate
from assay.runtime import StageDeps, StageHarness
from assay.store import FsBlobStore
from assay_aggregate import create_stage

TENANT = TenantId(uuid.UUID(int=21))
V1, V2 = WorkflowVersion("1" * 64), WorkflowVersion("2" * 64)


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[StageHarness]:
    blobs = FsBlobStore(tmp_path / "blobs")
    deps = StageDeps(blobs=blobs, model=StubModel(), judge=StubJudge(), tools=dict(BUILTIN_TOOLS))
    async with StageHarness(create_stage(deps), blobs, tmp_path) as h:
        yield h


def graded(score: Score, *, role: Role = Role.CHALLENGER, passed: bool = True) -> RunGraded:
    ref = RunRef(
        tenant=TENANT,
        run_id=new_run_id(),
        task_id=TaskId("cd" * 32),
        idempotency_key="k",
        workflow_id=WorkflowId("arith"),
        workflow_version=V2 if role is Role.CHALLENGER else V1,
        role=role,
        purpose=Purpose.SHADOW if role is Role.CHALLENGER else Purpose.WORK,
        baseline_version=V1 if role is Role.CHALLENGER else None,
    )
    return RunGraded(run=ref, passed=passed, score=score)


def rel(outcome: Outcome, by: DecidedBy) -> Relative:
    return Relative(
        against=RunId(new_run_id()),
        verdict=Verdict.A,
        position="a",
        outcome=outcome,
        decided_by=by,
    )


async def aggregates(stage: StageHarness) -> list[VariantAggregate]:
    out = await stage.emitted(topic="assay.aggregates")
    assert all(isinstance(m, VariantAggregate) for m in out)
    return [m for m in out if isinstance(m, VariantAggregate)]


async def test_judge_and_verifier_outcomes_accumulate_apart(stage: StageHarness) -> None:
    for score in [
        rel(Outcome.WIN, DecidedBy.JUDGE),
        rel(Outcome.WIN, DecidedBy.VERIFIER),
        rel(Outcome.LOSS, DecidedBy.JUDGE),
        rel(Outcome.DRAW, DecidedBy.JUDGE),
        rel(Outcome.LOSS, DecidedBy.VERIFIER),
    ]:
        await stage.deliver(GRADED, graded(score), TENANT)
    last = (await aggregates(stage))[-1]
    assert last.record == WinRecord(
        judge_wins=1, verifier_wins=1, judge_losses=1, draws=1, verifier_losses=1
    )
    assert last.baseline_version == V1
    assert last.runs == 5


async def test_capped_is_counted_never_scored(stage: StageHarness) -> None:
    capped = Capped(violations=[CoreViolation(criterion="safe", evidence="said X")])
    await stage.deliver(GRADED, graded(capped), TENANT)
    (agg,) = await aggregates(stage)
    assert agg.record.capped == 1
    assert agg.record.comparisons == 0


async def test_ungraded_and_current_runs_count_pass_rates_only(stage: StageHarness) -> None:
    await stage.deliver(
        GRADED, graded(Ungraded(reason=UngradedReason.NO_REFERENCE), passed=False), TENANT
    )
    await stage.deliver(
        GRADED, graded(Ungraded(reason=UngradedReason.BASELINE), role=Role.CURRENT), TENANT
    )
    assert await aggregates(stage) == []
    v1 = await stage.state(TENANT, "version", V1)
    v2 = await stage.state(TENANT, "version", V2)
    assert v1 is not None
    assert v2 is not None
    assert (v1["runs"], v1["passes"]) == (1, 1)
    assert (v2["runs"], v2["passes"]) == (1, 0)


async def test_a_redelivered_grade_is_folded_once(stage: StageHarness) -> None:
    msg = graded(rel(Outcome.WIN, DecidedBy.JUDGE))
    await stage.deliver(GRADED, msg, TENANT, idem="once")
    await stage.deliver(GRADED, msg, TENANT, idem="once")
    (agg,) = await aggregates(stage)
    assert agg.record.judge_wins == 1
