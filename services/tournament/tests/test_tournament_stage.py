"""Tournament handlers through a StageRunner: references, pairwise comparisons, parking, caps."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import assay_tournament.groups as groups_module
from assay.bus import RESULTS, TASKS, dlq
from assay.cli.health import merged
from assay.engine.retention import reduce_episode
from assay.grading.judges import JudgeFailed
from assay.grading.strategies import GradingPolicy
from assay.kernel import AttemptState, RunState, WorkflowVersion
from assay.kernel.scores import (
    Capped,
    DecidedBy,
    Outcome,
    Ranked,
    Relative,
    Ungraded,
    UngradedReason,
    Verdict,
)
from assay.messages import (
    MESSAGES,
    Episode,
    EpisodeReduced,
    GroupDue,
    Purpose,
    RunRef,
    open_envelope,
)
from assay.record import StateKey
from assay_tournament.state import backlog_gauges
from services.tournament.tests.tournament_harness import (
    D1,
    D2,
    OTHER,
    T1,
    T2,
    TENANT,
    V1,
    V2,
    Stage,
    challenger,
    closed,
    current,
    deliver,
    due,
    graded_workflow,
    open_stage,
    pinned,
    sibling,
    task_id,
    view,
)


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0)) as opened:
        yield opened


# -- references ----------------------------------------------------------------------------


async def test_first_current_episode_is_ungraded_and_becomes_the_reference(stage: Stage) -> None:
    t = task_id(1)
    cur = current(t)
    out = await stage.verified(cur, output="5")
    assert [g.score for g in out.graded()] == [Ungraded(reason=UngradedReason.NO_REFERENCE)]
    assert out.graded()[0].judge_calls == 0
    (status,) = out.statuses()
    assert status.state is RunState.UNGRADED
    assert status.detail == "no_reference"
    ref = await stage.reference(t, V1.version)
    assert ref is not None
    assert ref["run_id"] == cur.run_id
    assert ref["passed"] is True
    assert stage.judge.compared == []
    assert stage.judge.screened == []  # the current version is not screened


async def test_a_later_current_episode_is_baseline_and_keeps_the_first_reference(
    stage: Stage,
) -> None:
    t = task_id(1)
    first, second = current(t, "first"), current(t, "second")
    await stage.verified(first)
    out = await stage.verified(second)
    assert out.score_of(second) == Ungraded(reason=UngradedReason.BASELINE)
    ref = await stage.reference(t, V1.version)
    assert ref is not None
    assert ref["run_id"] == first.run_id


async def test_unreadable_episode_degrades_to_ungraded_and_sets_no_reference(
    stage: Stage,
) -> None:
    t = task_id(1)
    cur = current(t)
    out = await stage.verified(cur, episode="0" * 64)
    assert out.score_of(cur) == Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE)
    (result,) = out.results()
    assert result.status == "ungraded"
    assert result.output is None
    assert await stage.reference(t, V1.version) is None


# -- comparisons ---------------------------------------------------------------------------


async def test_challenger_with_a_reference_is_compared_by_the_judge(stage: Stage) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t)
    await stage.verified(cur)
    stage.judge.verdicts = [Verdict.A]
    out = await stage.verified(chal)
    score = out.score_of(chal)
    assert score == Relative(
        against=cur.run_id,
        verdict=Verdict.A,
        position="a",
        outcome=Outcome.WIN,
        decided_by=DecidedBy.JUDGE,
    )
    assert out.graded()[0].judge_calls == 1
    assert stage.judge.compared == [(chal.run_id, cur.run_id)]
    (usage,) = out.usage()
    assert usage.purpose is Purpose.GRADING
    assert usage.run_id == chal.run_id
    assert usage.model == "scripted-judge"
    (status,) = out.statuses()
    assert status.state is RunState.GRADED
    assert status.detail == "relative"
    scored = await stage.log.get(StateKey(TENANT, "scored", chal.run_id))
    assert scored is not None
    assert scored["judge_calls"] == 1


@pytest.mark.parametrize(
    ("challenger_passed", "reference_passed", "outcome"),
    [(True, False, Outcome.WIN), (False, True, Outcome.LOSS)],
)
async def test_pass_against_fail_is_decided_by_the_verifier_without_a_judge(
    stage: Stage, challenger_passed: bool, reference_passed: bool, outcome: Outcome
) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t)
    await stage.verified(cur, passed=reference_passed)
    out = await stage.verified(chal, passed=challenger_passed)
    score = out.score_of(chal)
    assert isinstance(score, Relative)
    assert score.decided_by is DecidedBy.VERIFIER
    assert score.outcome is outcome
    assert score.position == "a"
    assert score.verdict is (Verdict.A if outcome is Outcome.WIN else Verdict.B)
    assert out.graded()[0].judge_calls == 0
    assert stage.judge.compared == []
    assert out.usage() == []


async def test_challenger_position_alternates_across_comparisons(stage: Stage) -> None:
    stage.judge.verdicts = [Verdict.A, Verdict.A, Verdict.A]
    positions, outcomes = [], []
    for n in range(3):
        t = task_id(n)
        cur, chal = current(t), challenger(t)
        await stage.verified(cur)
        out = await stage.verified(chal)
        score = out.score_of(chal)
        assert isinstance(score, Relative)
        positions.append(score.position)
        outcomes.append(score.outcome)
        shown_as_a = stage.judge.compared[-1][0]
        assert shown_as_a == (chal.run_id if score.position == "a" else cur.run_id)
    assert positions == ["a", "b", "a"]
    assert outcomes == [Outcome.WIN, Outcome.LOSS, Outcome.WIN]
    counter = await stage.log.get(StateKey(TENANT, "comparisons", V2.version))
    assert counter == {"next": 3}


async def test_verifier_decided_comparisons_keep_the_alternation(stage: Stage) -> None:
    positions = []
    for n, (cp, rp) in enumerate([(True, True), (True, False), (True, True)]):
        t = task_id(n)
        cur, chal = current(t), challenger(t)
        await stage.verified(cur, passed=rp)
        score = (await stage.verified(chal, passed=cp)).score_of(chal)
        assert isinstance(score, Relative)
        positions.append(score.position)
    assert positions == ["a", "b", "a"]
    assert len(stage.judge.compared) == 2


async def test_challenger_without_a_reference_or_a_paired_run_is_ungraded(stage: Stage) -> None:
    chal = challenger(task_id(1), purpose=Purpose.WORK)
    out = await stage.verified(chal)
    assert out.score_of(chal) == Ungraded(reason=UngradedReason.NO_REFERENCE)
    assert await stage.log.scan(TENANT, "parked") == []


async def test_redelivered_verification_under_a_new_id_is_not_graded_twice(stage: Stage) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t)
    await stage.verified(cur)
    await stage.verified(chal)
    again = await stage.verified(chal, mid="another-id")
    assert again.entries == []
    assert len(stage.judge.compared) == 1


# -- parking -------------------------------------------------------------------------------


async def test_challenger_waits_for_its_reference_run_and_is_graded_when_it_arrives(
    stage: Stage,
) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t, reference_expected=True)
    early = await stage.verified(chal)
    assert early.graded() == []
    assert early.results() == []
    (status,) = early.statuses()
    assert status.state is RunState.GRADING
    assert status.run == chal
    assert len(await stage.log.scan(TENANT, "parked", f"{t}/")) == 1
    backlog = {g.name: dict(g.samples) for g in await backlog_gauges(stage.log)}
    assert backlog["assay_tournament_runs_parked"] == {(str(TENANT),): 1.0}
    assert await stage.log.get(StateKey(TENANT, "scored", chal.run_id)) is None

    stage.judge.verdicts = [Verdict.B]
    late = await stage.verified(cur)
    assert late.score_of(cur) == Ungraded(reason=UngradedReason.NO_REFERENCE)
    assert late.score_of(chal) == Relative(
        against=cur.run_id,
        verdict=Verdict.B,
        position="a",
        outcome=Outcome.LOSS,
        decided_by=DecidedBy.JUDGE,
    )
    assert stage.judge.compared == [(chal.run_id, cur.run_id)]
    assert await stage.log.scan(TENANT, "parked") == []
    ref = await stage.reference(t, V1.version)
    assert ref is not None
    assert ref["run_id"] == cur.run_id
    # the parked comparison took an index: the next one shows the challenger as B
    t2 = task_id(2)
    await stage.verified(current(t2))
    score = (await stage.verified(challenger(t2))).score_of(challenger(t2))
    assert isinstance(score, Relative)
    assert score.position == "b"


async def test_a_reference_reduced_by_retention_is_compared_through_its_summary(
    stage: Stage,
) -> None:
    """Execute deletes an episode over the token ceiling once its grading ended and says
    so (`EpisodeReduced`); a later challenger on the task reads the reference's summary,
    and is judged, instead of going ungraded for want of the original."""
    t = task_id(1)
    cur = current(t)
    original = await stage.episode(cur, output="5 " + "x" * 5_000)
    await stage.verified(cur, episode=original)
    raw = await stage.blobs.get(TENANT, original)
    assert raw is not None
    summary = reduce_episode(Episode.model_validate_json(raw), original, keep_chars=40)
    summary_ref = await stage.blobs.put(TENANT, summary.encode())
    await stage.blobs.delete(TENANT, original)
    reduced = EpisodeReduced(
        tenant=TENANT,
        run_id=cur.run_id,
        task_id=t,
        original=original,
        summary=summary_ref,
    )
    assert (await stage.deliver(reduced)).entries == []  # noted, nothing published
    stage.judge.verdicts = [Verdict.A]
    chal = challenger(t)
    score = (await stage.verified(chal)).score_of(chal)
    assert isinstance(score, Relative)
    assert score.decided_by is DecidedBy.JUDGE
    assert stage.judge.compared == [(chal.run_id, cur.run_id)]
    assert (await stage.deliver(reduced, mid="again")).entries == []  # redelivered: nothing
    assert await stage.log.get(StateKey(TENANT, "summary", original)) == {"summary": summary_ref}
    # a run that is no reference is never read again: nothing is kept for it
    other = challenger(task_id(1), "other")
    await stage.deliver(reduced.model_copy(update={"run_id": other.run_id, "original": "a" * 64}))
    assert await stage.log.get(StateKey(TENANT, "summary", "a" * 64)) is None


async def test_parked_challenger_is_released_when_its_reference_episode_is_unreadable(
    stage: Stage,
) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t, reference_expected=True)
    await stage.verified(chal)
    out = await stage.verified(cur, episode="f" * 64)
    assert out.score_of(cur) == Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE)
    assert out.score_of(chal) == Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE)
    assert await stage.log.scan(TENANT, "parked") == []
    backlog = {g.name: dict(g.samples) for g in await backlog_gauges(stage.log)}
    assert backlog["assay_tournament_runs_parked"] == {}


async def test_parked_challenger_ignores_a_run_of_another_baseline(stage: Stage) -> None:
    t = task_id(1)
    chal = challenger(t, reference_expected=True)
    await stage.verified(chal)
    other = RunRef(
        **{**current(t, "other").model_dump(), "workflow_version": WorkflowVersion("e" * 64)}
    )
    out = await stage.verified(other)
    assert [g.run.run_id for g in out.graded()] == [other.run_id]
    assert len(await stage.log.scan(TENANT, "parked")) == 1


# -- results -------------------------------------------------------------------------------


async def test_results_are_emitted_only_for_work_runs(stage: Stage) -> None:
    t = task_id(1)
    cur = current(t)
    out = await stage.verified(cur, output="5")
    (result,) = out.results()
    assert result.run_id == cur.run_id
    assert result.idempotency_key == cur.idempotency_key
    assert result.task_id == t
    assert result.workflow_version == V1.version
    assert result.status == "ungraded"
    assert result.passed is True
    assert result.termination == "succeeded"
    assert result.output == "5"
    assert result.usage.prompt_tokens == 10
    assert [v.verifier for v in result.verification] == ["correct"]
    assert result.held_out is False
    (entry,) = [e for e in out.entries if e.topic == RESULTS]
    assert entry.key == f"{TENANT}:{cur.run_id}"

    shadow = await stage.verified(challenger(t, "shadow"))
    assert shadow.results() == []
    assert len(shadow.graded()) == 1

    serving = challenger(t, "serving", purpose=Purpose.WORK)
    stage.judge.verdicts = [Verdict.B]
    out = await stage.verified(serving, output="five")
    (result,) = out.results()
    assert result.run_id == serving.run_id
    assert result.idempotency_key == serving.idempotency_key
    assert result.task_id == t
    assert result.status == "graded"
    assert result.output == "five"
    assert isinstance(result.score, Relative)


async def test_a_result_says_whether_its_task_was_held_out(stage: Stage) -> None:
    held = current(task_id(2)).model_copy(update={"held_out": True})
    (result,) = (await stage.verified(held)).results()
    assert result.held_out is True


async def test_shadow_run_of_the_current_version_has_no_result(stage: Stage) -> None:
    out = await stage.verified(current(task_id(1), purpose=Purpose.SHADOW))
    assert out.results() == []
    assert len(out.graded()) == 1


# -- caps ----------------------------------------------------------------------------------


async def test_core_violation_caps_the_challenger_and_it_never_becomes_a_reference(
    stage: Stage,
) -> None:
    t = task_id(1)
    cur, chal = current(t), challenger(t, purpose=Purpose.WORK)
    await stage.verified(cur)
    stage.judge.violating = {"rm -rf /"}
    out = await stage.verified(chal, output="rm -rf /")
    score = out.score_of(chal)
    assert isinstance(score, Capped)
    assert [v.criterion for v in score.violations] == ["safe"]
    assert stage.judge.compared == []
    assert stage.judge.screened == [chal.run_id]
    (status,) = out.statuses()
    assert status.state is RunState.GRADED
    assert status.detail == "capped"
    (result,) = out.results()
    assert isinstance(result.score, Capped)
    assert await stage.reference(t, V2.version) is None
    # a clean episode of the challenger version on the same task becomes its reference
    clean = challenger(t, "clean")
    await stage.verified(clean, output="5")
    ref = await stage.reference(t, V2.version)
    assert ref is not None
    assert ref["run_id"] == clean.run_id


async def test_capped_challenger_is_not_parked(stage: Stage) -> None:
    t = task_id(1)
    chal = challenger(t, reference_expected=True)
    stage.judge.violating = {"rm -rf /"}
    out = await stage.verified(chal, output="rm -rf /")
    assert isinstance(out.score_of(chal), Capped)
    assert await stage.log.scan(TENANT, "parked") == []


# -- tenancy -------------------------------------------------------------------------------


async def test_run_of_another_tenant_than_its_envelope_is_dead_lettered(stage: Stage) -> None:
    cur = current(task_id(1))
    out = await stage.verified(cur, envelope_tenant=OTHER)
    (entry,) = out.entries
    assert entry.topic == dlq("tournament")
    reason = dict(entry.headers)["assay-dlq-reason"].decode()
    assert "differs" in reason
    assert await stage.log.scan(TENANT, "reference") == []
    assert await stage.log.scan(OTHER, "reference") == []


async def test_episode_of_another_tenant_is_not_readable(stage: Stage) -> None:
    t = task_id(1)
    cur = current(t)
    foreign = await stage.episode(cur, tenant=OTHER)
    out = await stage.verified(cur, episode=foreign)
    assert out.score_of(cur) == Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE)


# == tournament mode, deterministic grading, budgets, order checks, attempt credit ==========


# -- tournament groups -------------------------------------------------------------------------


async def test_a_group_closes_at_quorum_and_ranks_everyone_against_control(stage: Stage) -> None:
    t = task_id(1)
    runs = [pinned(current(t), T1)] + [pinned(challenger(t, f"c{i}"), T2) for i in range(3)]
    outputs = ["xx", "x", "xxxx", "xxx"]
    stage.judge.prefer_longer = True
    for run, out in zip(runs[:3], outputs[:3], strict=True):
        waiting = await deliver(stage, run, T1 if run.role.value == "current" else T2, out)
        assert waiting.graded() == []
        (status,) = waiting.statuses()
        assert status.state is RunState.GRADING
        assert "of 4" in status.detail
    backlog = {g.name: dict(g.samples) for g in await backlog_gauges(stage.log)}
    assert backlog["assay_tournament_groups_open"] == {(str(TENANT),): 1.0}
    assert backlog["assay_tournament_runs_waiting"] == {(str(TENANT),): 3.0}
    closing = await deliver(stage, runs[3], T2, outputs[3])
    backlog = {g.name: dict(g.samples) for g in await backlog_gauges(stage.log)}
    assert backlog["assay_tournament_groups_open"] == {}, "closed at quorum: no backlog"
    scores = {g.run.run_id: g.score for g in closing.graded()}
    assert set(scores) == {r.run_id for r in runs}
    assert all(isinstance(s, Ranked) and s.group_size == 4 and s.anchored for s in scores.values())
    control = scores[runs[0].run_id]
    assert isinstance(control, Ranked)
    assert control.strength == 0.0
    order = sorted(runs, key=lambda r: scores[r.run_id].strength)  # type: ignore[union-attr]
    # Two Swiss rounds: the shortest output lost both its pairs, the longest won both.
    assert (order[0].run_id, order[-1].run_id) == (runs[1].run_id, runs[2].run_id)
    # 2 rounds of 2 pairs, both orderings; every call metered as grading.
    assert len(stage.judge.compared) == 8 == len(closing.usage())
    assert sum(g.judge_calls for g in closing.graded()) == 8
    # Each of the 4 bouts was judged in both orders: an order check on /metrics (§15).
    labels = {"tenant": str(TENANT), "workflow": str(runs[0].workflow_id), "consistent": "true"}
    checks = stage.runner.signals.registry.get_sample_value(
        "assay_judge_order_checks_total", labels
    )
    assert checks == 4
    group = await stage.log.get(StateKey(TENANT, "group", f"{t}/pass"))
    assert group == {"epoch": 1, "members": 0}


@pytest.mark.parametrize("biased", [True, False])
async def test_each_entrants_grade_carries_the_order_checks_of_the_bouts_it_was_in(
    stage: Stage, biased: bool
) -> None:
    """The ladder's drift check reads them from RunGraded: a judge that always prefers the
    episode shown first contradicts itself on every bout; one that prefers the longer
    output, on none. Three entrants on timeout: one sits out each round, so the runs were
    in different numbers of bouts."""
    t = task_id(3)
    runs = [pinned(current(t), T1)] + [pinned(challenger(t, f"c{i}"), T2) for i in range(2)]
    if biased:
        stage.judge.verdicts = [Verdict.A] * 8
    else:
        stage.judge.prefer_longer = True
    for i, run in enumerate(runs):
        await deliver(stage, run, T1 if i == 0 else T2, "x" * (i + 1))
    closing = await due(stage, t, True, 0)
    bouts = {r.run_id: 0 for r in runs}
    for a, b in stage.judge.compared:  # each bout asked twice, the second time swapped
        bouts[a] += 1
        bouts[b] += 1
    got = {g.run.run_id: (g.order_checked, g.order_inconsistent) for g in closing.graded()}
    assert got == {run: (n // 2, n // 2 if biased else 0) for run, n in bouts.items()}, (
        stage.judge.compared
    )
    assert sorted(n // 2 for n in bouts.values()) == [1, 1, 2]  # a bye each round


async def test_late_arrivals_start_the_next_epoch_and_a_stale_timer_changes_nothing(
    stage: Stage,
) -> None:
    t = task_id(2)
    for i in range(4):
        run = pinned(current(t) if i == 0 else challenger(t, f"c{i}"), T1 if i == 0 else T2)
        await deliver(stage, run, T1 if i == 0 else T2, "x" * (i + 1))
    late = pinned(challenger(t, "late"), T2)
    out = await deliver(stage, late, T2, "xx")
    assert out.graded() == []
    group = await stage.log.get(StateKey(TENANT, "group", f"{t}/pass"))
    assert group is not None
    assert group["epoch"] == 1
    assert group["members"] == 1
    assert (await due(stage, t, True, 0)).graded() == []  # epoch 0 closed already
    closed = await due(stage, t, True, 1)
    (graded,) = closed.graded()
    assert graded.score == Ungraded(reason=UngradedReason.INSUFFICIENT_GROUP)
    assert (await due(stage, t, True, 1)).graded() == []  # closed: never reopened


async def test_outcome_classes_never_share_a_group(stage: Stage) -> None:
    t = task_id(3)
    await deliver(stage, pinned(current(t), T1), T1, "x", passed=True)
    await deliver(stage, pinned(challenger(t, "f"), T2), T2, "xx", passed=False)
    assert (await stage.log.get(StateKey(TENANT, "group", f"{t}/pass")))["members"] == 1  # type: ignore[index]
    assert (await stage.log.get(StateKey(TENANT, "group", f"{t}/fail")))["members"] == 1  # type: ignore[index]


async def test_a_timed_out_group_without_control_is_graded_but_not_anchored(stage: Stage) -> None:
    t = task_id(4)
    for i in range(2):
        await deliver(stage, pinned(challenger(t, f"c{i}"), T2), T2, "x" * (i + 1))
    out = await due(stage, t, True, 0)
    scores = [g.score for g in out.graded()]
    assert len(scores) == 2
    assert all(isinstance(s, Ranked) and not s.anchored for s in scores)


async def test_a_capped_episode_leaves_the_bracket(stage: Stage) -> None:
    t = task_id(5)
    stage.judge.violating = {"rm -rf /"}
    out = await deliver(stage, pinned(current(t), T1), T1, "rm -rf /")
    (graded,) = out.graded()
    assert isinstance(graded.score, Capped)
    assert await stage.log.get(StateKey(TENANT, "group", f"{t}/pass")) is None


async def test_the_timer_sends_each_due_group_its_closing_message(tmp_path: Path) -> None:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0)) as stage:
        t = task_id(6)
        quick = graded_workflow(
            "Fast {{ task.question }}", {"strategy": "tournament", "group_timeout_s": 0.05}
        )
        await deliver(stage, pinned(current(t), quick), quick, "x")
        await asyncio.sleep(0.1)
        stop = asyncio.Event()
        timer = asyncio.create_task(stage.spec.background[0](stage.log, stop))
        try:
            for _ in range(100):
                rows = await stage.log.drain_outbox(100)
                if rows:
                    break
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await timer
        (row,) = rows
        env = open_envelope(row.entry.value)
        msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
        assert msg == GroupDue(tenant=TENANT, task_id=t, passed=True, epoch=0)
        assert row.entry.key == f"{TENANT}:{t}"  # the task's partition, with its episodes


def test_the_group_clock_is_wall_time() -> None:
    assert abs(groups_module.clock_ms() / 1000 - time.time()) < 5


# -- deterministic ----------------------------------------------------------------------------


async def test_deterministic_grading_ranks_the_number_against_control(stage: Stage) -> None:
    t = task_id(7)
    await deliver(stage, pinned(current(t), D1), D1, '{"score": 0.5}')
    out = await deliver(
        stage, pinned(challenger(t, reference_expected=False), D2), D2, '{"score": 0.75}'
    )
    (graded,) = out.graded()
    assert graded.score == Ranked(strength=0.25, interval=(0.25, 0.25), group_size=2)
    assert graded.judge_calls == 0
    assert stage.judge.compared == []
    assert stage.judge.screened == []
    missing = await deliver(
        stage, pinned(challenger(t, "m", reference_expected=False), D2), D2, "{}"
    )
    assert missing.graded()[0].score == Ungraded(reason=UngradedReason.NO_METRIC)


# -- budgets, order checks, judge failures ------------------------------------------------------


async def test_a_tenant_at_its_ceiling_is_ungraded_budget_exhausted(tmp_path: Path) -> None:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0, calls_per_day=1)) as stage:
        for n in (8, 9):
            t = task_id(n)
            await stage.verified(current(t))
            stage.judge.verdicts = [Verdict.A]
            out = await stage.verified(challenger(t))
            score = out.graded()[0].score
            if n == 8:
                assert isinstance(score, Relative)
            else:
                assert score == Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED)
        meter = await stage.log.get(StateKey(TENANT, "meter", "grading@0"))
        assert meter is not None
        assert meter["calls_today"] >= 1
        assert meter["by_purpose"].get("compare") == 1


async def test_handlers_on_two_partitions_never_lose_each_others_judge_calls(
    stage: Stage,
) -> None:
    """The meter is one document per partition: two handlers that judge at the same time
    each add their call (one shared document lost one of them)."""
    tasks = [task_id(30), task_id(31)]
    for t in tasks:
        await stage.verified(current(t))
    stage.judge.pause_s = 0.05  # both read the meter before either commits
    await asyncio.gather(
        *(stage.verified(challenger(t), partition=p) for p, t in enumerate(tasks, start=1))
    )
    shards = dict(await stage.log.scan(TENANT, "meter", "grading"))
    tenant_meter = merged(list(shards.values()))
    assert tenant_meter["calls_today"] == 2
    assert tenant_meter["by_purpose"] == {"compare": 2}
    assert sorted(shards) == ["grading@0", "grading@1", "grading@2"]


async def test_the_ceiling_counts_every_partitions_calls(tmp_path: Path) -> None:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0, calls_per_day=1)) as stage:
        t1, t2 = task_id(32), task_id(33)
        for t in (t1, t2):
            await stage.verified(current(t))
        first = await stage.verified(challenger(t1), partition=1)
        assert isinstance(first.graded()[0].score, Relative)
        second = await stage.verified(challenger(t2), partition=2)  # another partition's call
        assert second.graded()[0].score == Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED)


async def test_what_shadow_runs_spent_is_recorded_once_and_work_runs_are_not_replay(
    stage: Stage,
) -> None:
    t = task_id(12)
    work = current(t)
    await stage.verified(work)  # the work run: not replay
    stage.judge.verdicts = [Verdict.A]
    shadow = challenger(t)
    await stage.verified(shadow)
    await stage.verified(shadow)  # redelivered: its grading ended once, its spend counts once
    reference = current(task_id(13), purpose=Purpose.SHADOW)  # a reference run is replay too
    await stage.verified(reference)
    spent = dict(await stage.log.scan(TENANT, "replay"))
    assert set(spent) == {shadow.run_id, reference.run_id}
    assert [(d["model_calls"], d["tokens"]) for d in spent.values()] == [(1, 12), (1, 12)]


async def test_a_sampled_order_check_records_consistency(tmp_path: Path) -> None:
    async with open_stage(tmp_path, GradingPolicy(order_check=1.0)) as stage:
        t = task_id(10)
        await stage.verified(current(t))
        stage.judge.verdicts = [Verdict.A, Verdict.A]  # the same letter twice: position bias
        out = await stage.verified(challenger(t))
        (graded,) = out.graded()
        assert isinstance(graded.score, Relative)
        assert graded.score.order_consistent is False
        assert graded.judge_calls == 2
        assert len(out.usage()) == 2
        meter = await stage.log.get(StateKey(TENANT, "meter", "grading@0"))
        assert meter is not None
        assert (meter["order_checked"], meter["order_inconsistent"]) == (1, 1)


async def test_a_failed_judge_is_recorded_never_a_guessed_verdict(stage: Stage) -> None:
    t = task_id(11)
    await stage.verified(current(t))
    stage.judge.fail_with = JudgeFailed("answer is not JSON: 'A, I think'")
    out = await stage.verified(challenger(t))
    assert out.graded()[0].score == Ungraded(reason=UngradedReason.JUDGE_FAILED)
    meter = await stage.log.get(StateKey(TENANT, "meter", "grading@0"))
    assert meter is not None
    assert meter["judge_failures"] == 1
    assert "not JSON" in meter["last_failure"]


# -- attempt tournaments -----------------------------------------------------------------------


async def test_attempt_ranks_and_step_credit_reach_graded_and_results(stage: Stage) -> None:
    t = task_id(12)
    run = current(t)
    attempts = [
        view(1, AttemptState.FAILED, None, "p"),
        view(2, AttemptState.FAILED, None, "p"),
        view(3, AttemptState.SUCCEEDED, "5", "p, carefully"),
    ]
    wf = graded_workflow("What is {{ task.question }}?", {"strategy": "pairwise_sequential"})
    out = await deliver(
        stage, run.model_copy(update={"workflow_version": wf.version}), wf, "5", attempts=attempts
    )
    (graded,) = out.graded()
    assert [(r.attempt, r.succeeded) for r in graded.attempt_ranks] == [(1, False), (2, False)]
    assert [(c.failed_attempt, c.passed_attempt) for c in graded.step_credit] == [(1, 3), (2, 3)]
    assert graded.judge_calls == 2  # the two failures, in both orders
    (result,) = out.results()
    assert result.step_credit == graded.step_credit
    assert result.step_credit[0].changed == ["prompt (1 -> 12 characters)"]
    assert run.purpose is Purpose.WORK


# -- rollout selection ---------------------------------------------------------------------


async def test_rollout_siblings_wait_then_one_selection_is_published(stage: Stage) -> None:
    t = task_id(20)
    runs = [sibling(t, i) for i in range(4)]
    for i, run in enumerate(runs):
        out = await stage.verified(run, passed=i != 2, output="x" * (i + 1))
        assert out.graded() == []
        assert out.by_topic.get(RESULTS, []) == []
        (progress,) = out.by_topic[TASKS]
        assert (progress.run_id, progress.ended) == (run.run_id, "verified")
    stage.judge.prefer_longer = True
    out = await stage.deliver(closed(t, runs))
    (result,) = out.rollout_results()
    assert result.passes == 3
    assert result.pass_at_k == pytest.approx([0.75, 1.0, 1.0, 1.0])
    assert result.winner == runs[3].run_id  # the longest output of those that passed
    assert result.selection.decided_by == "judge"
    assert len(out.graded()) == 4  # each sibling's score within its group
    assert (await stage.deliver(closed(t, runs))).rollout_results() == []  # selected once


async def test_a_selection_redelivered_after_a_crash_asks_the_judge_nothing_twice(
    stage: Stage,
) -> None:
    t = task_id(21)
    runs = [sibling(t, i) for i in range(4)]
    for i, run in enumerate(runs):
        await stage.verified(run, output="x" * (i + 1))
    stage.judge.prefer_longer = True
    stage.judge.crash_after = 3  # the process dies after the third verdict
    out = await stage.deliver(closed(t, runs))  # the runner retries the handler
    (result,) = out.rollout_results()
    assert result.selection.decided_by == "judge"
    asked = stage.judge.compared
    assert len(asked) == len(set(asked)) == 8  # 2 rounds x 2 pairs x 2 orders, once each
