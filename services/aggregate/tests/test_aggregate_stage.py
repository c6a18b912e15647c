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
    Ranked,
    Relative,
    Score,
    Ungraded,
    UngradedReason,
    Verdict,
    WinRecord,
)
from assay.messages import Purpose, Role, RunGraded, RunRef, VariantAggregate, VerifierResult
from assay.messages.proposals import EVIDENCE_CHARS, FAILURES_KEPT
from assay.runtime import StageDeps, StageHarness
from assay.runtime.metrics import StageCollector, stage_registry
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


def graded(
    score: Score,
    *,
    role: Role = Role.CHALLENGER,
    passed: bool = True,
    held_out: bool = False,
    purpose: Purpose | None = None,
) -> RunGraded:
    ref = RunRef(
        tenant=TENANT,
        run_id=new_run_id(),
        task_id=TaskId("cd" * 32),
        idempotency_key="k",
        workflow_id=WorkflowId("arith"),
        workflow_version=V2 if role is Role.CHALLENGER else V1,
        role=role,
        purpose=purpose or (Purpose.SHADOW if role is Role.CHALLENGER else Purpose.WORK),
        baseline_version=V1 if role is Role.CHALLENGER else None,
        held_out=held_out,
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
    (agg,) = await aggregates(stage)  # a challenger run always publishes its evidence
    assert agg.record == WinRecord()
    assert (agg.runs, agg.passes, agg.screened, agg.served) == (1, 0, 1, 0)
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


async def test_what_grading_each_version_cost_is_tallied_and_refolds_the_same(
    stage: StageHarness,
) -> None:
    """Judge calls billed (answered and failed) and their dollars, every run counted."""
    spends = [(Role.CHALLENGER, 2, 1, 0.03), (Role.CHALLENGER, 1, 0, 0.01), (Role.CURRENT, 0, 0, 0)]
    for role, calls, failures, usd in spends:
        msg = graded(rel(Outcome.WIN, DecidedBy.JUDGE), role=role).model_copy(
            update={"judge_calls": calls, "judge_failures": failures, "judge_cost_usd": usd}
        )
        await stage.deliver(GRADED, msg, TENANT)
    v2 = await stage.state(TENANT, "version", V2)
    v1 = await stage.state(TENANT, "version", V1)
    assert v2 is not None
    assert v1 is not None
    assert (v2["judge_calls"], v2["judge_micro_usd"]) == (4, 40_000)
    assert (v1["judge_calls"], v1["judge_micro_usd"]) == (0, 0)
    report = await stage.log.rebuild(keep=False)
    assert report.identical


# -- what the ladder reads, and the held-out split -------------------------------------------


async def test_held_out_tasks_are_tallied_apart_and_never_in_the_evidence(
    stage: StageHarness,
) -> None:
    capped = Capped(violations=[CoreViolation(criterion="safe", evidence="said X")])
    await stage.deliver(GRADED, graded(rel(Outcome.WIN, DecidedBy.JUDGE)), TENANT)
    await stage.deliver(GRADED, graded(rel(Outcome.LOSS, DecidedBy.JUDGE), held_out=True), TENANT)
    await stage.deliver(GRADED, graded(capped, held_out=True, passed=False), TENANT)
    await stage.deliver(
        GRADED,
        graded(Ungraded(reason=UngradedReason.NO_REFERENCE), role=Role.CURRENT, held_out=True),
        TENANT,
    )
    last = (await aggregates(stage))[-1]
    assert last.record == WinRecord(judge_wins=1)  # the gates read selection tasks only
    assert (last.runs, last.passes, last.screened) == (1, 1, 1)
    held = last.held_out
    assert held is not None
    assert held.record == WinRecord(judge_losses=1, capped=1)
    assert (held.runs, held.passes) == (2, 1)
    tally = await stage.state(TENANT, "version", V2)
    assert tally is not None
    assert (tally["runs"], tally["held_out"]["runs"]) == (3, 2)
    await stage.deliver(
        GRADED, graded(Ungraded(reason=UngradedReason.BASELINE), role=Role.CURRENT), TENANT
    )
    await stage.deliver(GRADED, graded(rel(Outcome.WIN, DecidedBy.JUDGE)), TENANT)
    last = (await aggregates(stage))[-1]
    assert (last.baseline_runs, last.baseline_passes) == (1, 1)  # selection only
    assert last.held_out is not None
    assert (last.held_out.baseline_runs, last.held_out.baseline_passes) == (1, 1)


async def test_served_screened_and_order_checks_are_counted_for_the_ladder(
    stage: StageHarness,
) -> None:
    checked = rel(Outcome.WIN, DecidedBy.JUDGE).model_copy(update={"order_consistent": False})
    await stage.deliver(GRADED, graded(checked, purpose=Purpose.WORK), TENANT)
    await stage.deliver(
        GRADED, graded(Ungraded(reason=UngradedReason.JUDGE_FAILED), purpose=Purpose.WORK), TENANT
    )  # maybe never screened: not clean
    await stage.deliver(
        GRADED, graded(Ungraded(reason=UngradedReason.NO_REFERENCE), purpose=Purpose.WORK), TENANT
    )
    last = (await aggregates(stage))[-1]
    assert (last.screened, last.served) == (2, 2)
    assert (last.order_checked, last.order_inconsistent) == (1, 1)


async def test_a_tournament_runs_bout_order_checks_are_counted_per_run_for_the_ladder(
    stage: StageHarness,
) -> None:
    """Each selection-set challenger run adds the order checks of the tournament bouts it
    was in (RunGraded v9) beside any pairwise score's own; current and held-out runs add
    none, and the tallies refold the same."""
    ranked = Ranked(strength=0.3, interval=(-0.1, 0.7), group_size=3, anchored=True)
    checks = [
        (Role.CHALLENGER, False, 2, 1),
        (Role.CHALLENGER, False, 2, 2),
        (Role.CHALLENGER, False, 0, 0),  # no bout answered in both orders
        (Role.CHALLENGER, True, 2, 2),  # held out: never the ladder's evidence
        (Role.CURRENT, False, 2, 2),  # the baseline's own runs: not the challenger's
    ]
    for role, held_out, checked, inconsistent in checks:
        msg = graded(ranked, role=role, held_out=held_out).model_copy(
            update={"order_checked": checked, "order_inconsistent": inconsistent}
        )
        await stage.deliver(GRADED, msg, TENANT)
    pairwise = rel(Outcome.WIN, DecidedBy.JUDGE).model_copy(update={"order_consistent": True})
    await stage.deliver(GRADED, graded(pairwise), TENANT)
    last = (await aggregates(stage))[-1]
    assert (last.order_checked, last.order_inconsistent) == (5, 3)
    report = await stage.log.rebuild(keep=False)
    assert report.identical


async def test_anchored_deltas_count_in_the_record_by_their_sign(stage: StageHarness) -> None:
    for delta, anchored in [(0.4, True), (-0.2, True), (0.0, True), (0.9, False)]:
        score = Ranked(
            strength=delta, interval=(delta - 1, delta + 1), group_size=2, anchored=anchored
        )
        await stage.deliver(GRADED, graded(score), TENANT)
    last = (await aggregates(stage))[-1]
    assert last.record == WinRecord(judge_wins=1, judge_losses=1, draws=1)
    assert last.strength is not None
    assert (last.strength.episodes, last.strength.unanchored) == (3, 1)


async def test_metrics_export_the_held_out_gap_per_version(stage: StageHarness) -> None:
    assert stage.runner is not None
    collector = StageCollector(stage.runner)
    registry = stage_registry(stage.runner, collector)
    await collector.refresh()
    assert registry.get_sample_value("assay_held_out_gap", {"tenant": str(TENANT)}) is None
    win = rel(Outcome.WIN, DecidedBy.JUDGE)
    for passed in (True, True, True, False):  # selection: 3 of 4 pass
        await stage.deliver(GRADED, graded(win, passed=passed), TENANT)
    await stage.deliver(GRADED, graded(win, held_out=True, passed=False), TENANT)
    await collector.refresh()
    labels = {"tenant": str(TENANT), "workflow": "arith", "version": str(V2)}
    # held-out: 0 of 1 pass; a baseline without held-out runs has no gap yet
    assert registry.get_sample_value("assay_held_out_gap", labels) == pytest.approx(0.75)
    assert registry.get_sample_value("assay_graded_runs", {**labels, "split": "held_out"}) == 1
    assert registry.get_sample_value("assay_graded_runs", {**labels, "split": "selection"}) == 4
    await stage.deliver(GRADED, graded(win, held_out=True, passed=True), TENANT)
    await collector.refresh()
    assert registry.get_sample_value("assay_held_out_gap", labels) == pytest.approx(0.25)
    v1 = {**labels, "version": str(V1)}
    assert registry.get_sample_value("assay_held_out_gap", v1) is None


def failing(*, role: Role = Role.CHALLENGER, held_out: bool = False, check: str) -> RunGraded:
    """A run that failed verification, with the failed check's evidence."""
    failed = VerifierResult(
        verifier="correct", kind="exact", verifier_version="1", passed=False, evidence=check
    )
    msg = graded(rel(Outcome.LOSS, DecidedBy.VERIFIER), role=role, passed=False, held_out=held_out)
    return msg.model_copy(update={"failed_checks": [failed]})


async def test_selection_failures_reach_the_evidence_and_held_out_ones_never_do(
    stage: StageHarness,
) -> None:
    """§12.5: the proposer reads these; a held-out failure here would leak the held-out set
    into the generator."""
    await stage.deliver(GRADED, failing(role=Role.CURRENT, check="baseline: 4 != 5"), TENANT)
    await stage.deliver(GRADED, failing(held_out=True, check="held-out: 7 != 8"), TENANT)
    await stage.deliver(GRADED, failing(check="selection: " + "x" * 2000), TENANT)
    last = (await aggregates(stage))[-1]
    checks = [c.evidence for f in last.failures for c in f.failed_checks]
    assert [c[:20] for c in checks] == ["baseline: 4 != 5", "selection: " + "x" * 9]
    assert all(len(c) <= EVIDENCE_CHARS for c in checks)  # evidence is cut, not carried whole
    assert [f.workflow_version for f in last.failures] == [V1, V2]
    assert await stage.state(TENANT, "failures", V2) is not None
    kept = await stage.state(TENANT, "failures", V2)
    assert kept is not None
    assert all("held-out" not in str(f) for f in kept["failures"])


async def test_only_the_latest_failures_are_kept(stage: StageHarness) -> None:
    for i in range(FAILURES_KEPT + 3):
        await stage.deliver(GRADED, failing(check=f"run {i}"), TENANT)
    last = (await aggregates(stage))[-1]
    checks = [c.evidence for f in last.failures for c in f.failed_checks]
    assert checks == [f"run {i}" for i in range(3, FAILURES_KEPT + 3)]
