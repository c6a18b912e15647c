"""Scheduled calibration in the tournament stage (§11, §16): the round falls due on the
stage's own clock, judges the tenant's own pass/fail pairs in both orderings within its
budget, meters every call as purpose `calibration`, records what it found and exports
it as a gauge."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import assay_tournament
from assay.cli.health import health_command
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import StubJudge
from assay.grading.calibration_policy import CalibrationPolicy
from assay.grading.strategies import GradingPolicy
from assay.kernel import AssayError, TenantId
from assay.kernel.scores import Verdict
from assay.messages import (
    MESSAGES,
    CalibrationDue,
    Episode,
    JudgeCalibrated,
    Purpose,
    RunRef,
    Usage,
    open_envelope,
)
from assay.record import StateKey
from assay.runtime import StageDeps
from assay.runtime.metrics import StageCollector, process_registry
from assay.store import FsBlobStore
from assay_tournament.calibration import calibration_timer
from services.tournament.tests.tournament_harness import (
    OTHER,
    TENANT,
    V1,
    Graded,
    Stage,
    current,
    open_stage,
    task_id,
)

NOON = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
HOUR_MS = 3_600_000
SCHEDULED = CalibrationPolicy(interval_s=3600, pairs=10, calls_per_day=200)


def ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0), SCHEDULED) as opened:
        yield opened


async def fire(
    stage: Stage, *at: datetime, tenants: frozenset[TenantId] = frozenset()
) -> list[CalibrationDue]:
    """Run the calibration timer once per instant in `at` (the clock driven by hand, no
    sleeping), then stop it; what it sent."""
    stop = asyncio.Event()
    instants = iter(at)

    def clock() -> float:
        instant = next(instants, None)
        if instant is None:
            stop.set()
            instant = at[-1]
        return instant.timestamp()

    await calibration_timer(tenants, clock, tick_s=0)(stage.log, stop)
    rows = await stage.log.drain_outbox(1000)
    await stage.log.ack_outbox([r.seq for r in rows])
    sent = []
    for row in rows:
        env = open_envelope(row.entry.value)
        msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
        assert isinstance(msg, CalibrationDue)
        assert (row.entry.topic, env.tenant, env.key) == (
            "assay.verified",
            msg.tenant,
            f"{msg.tenant}:calibration",
        )
        sent.append(msg)
    return sent


def run_of(n: int, name: str, tenant: TenantId = TENANT) -> RunRef:
    return current(task_id(n), name).model_copy(update={"tenant": tenant})


async def pair(stage: Stage, n: int, tenant: TenantId = TENANT) -> None:
    """A verified pass and a verified fail of one workflow on task n."""
    for name, passed in (("pass", True), ("fail", False)):
        run = run_of(n, name, tenant)
        ref = await stage.episode(run, "5" if passed else "6", tenant=tenant)
        await stage.verified(run, passed=passed, episode=ref, envelope_tenant=tenant)


async def round_at(stage: Stage, due_ms: int, at: datetime, tenant: TenantId = TENANT) -> Graded:
    stage.judge.compared.clear()
    return await stage.deliver(
        CalibrationDue(tenant=tenant, due_ms=due_ms),
        envelope_tenant=tenant,
        occurred_at=at,
        mid=f"due-{tenant}-{due_ms}",
    )


async def test_the_round_falls_due_once_a_pair_is_whole_then_every_interval(
    stage: Stage,
) -> None:
    assert await fire(stage, NOON) == []  # the tenant has no pair
    run = run_of(1, "pass")
    await stage.verified(run, passed=True)
    assert await fire(stage, NOON) == []  # half a pair
    fail = run_of(1, "fail")
    await stage.verified(fail, passed=False)
    due = await fire(stage, NOON, NOON + timedelta(seconds=1), NOON + timedelta(seconds=2))
    assert due == [CalibrationDue(tenant=TENANT, due_ms=0)]  # once, however often it ticks
    await round_at(stage, 0, NOON)
    assert await fire(stage, NOON + timedelta(seconds=3599)) == []
    assert await fire(stage, NOON + timedelta(hours=1)) == [
        CalibrationDue(tenant=TENANT, due_ms=ms(NOON) + HOUR_MS)
    ]


async def test_agreement_and_order_inconsistency_are_the_hand_computed_ones(
    stage: Stage,
) -> None:
    for n in (1, 2, 3):
        await pair(stage, n)
    # Each pair pass-first then fail-first: A,B agrees twice, mirrored; A,A agrees once,
    # not mirrored; draw,B agrees once (a draw disagrees), not mirrored.
    stage.judge.verdicts = [Verdict.A, Verdict.B, Verdict.A, Verdict.A, Verdict.DRAW, Verdict.B]
    out = await round_at(stage, 0, NOON)
    (found,) = out.aggregates()
    assert isinstance(found, JudgeCalibrated)
    assert (found.pairs, found.judged, found.agreed, found.draws) == (3, 6, 4, 1)
    assert (found.checked, found.inconsistent, found.failures) == (3, 2, 0)
    assert found.agreement == pytest.approx(4 / 6)
    assert found.order_inconsistency_rate == pytest.approx(2 / 3)
    assert (found.judge, found.source, found.model_calls) == ("scripted-judge", "verified_runs", 6)
    assert found.cost_usd == pytest.approx(6 * 0.0002)
    assert len(stage.judge.compared) == 6

    usage = out.usage()
    assert len(usage) == 6
    assert {(u.purpose, u.run_id, u.judge_purpose, u.tenant) for u in usage} == {
        (Purpose.CALIBRATION, None, None, TENANT)
    }

    kept = await stage.log.get(StateKey(TENANT, "judge_agreement", "scripted-judge"))
    assert kept is not None
    assert kept["agreed"] == 4

    collector = StageCollector(stage.runner)
    await collector.refresh()
    text = generate_latest(process_registry(collector)).decode()
    samples = {
        (s.name, s.labels.get("tenant"), s.labels.get("judge")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    key = (str(TENANT), "scripted-judge")
    assert samples[("assay_judge_verifier_agreement", *key)] == pytest.approx(4 / 6)
    assert samples[("assay_judge_calibration_order_inconsistency", *key)] == pytest.approx(2 / 3)
    assert samples[("assay_judge_calibration_orderings", *key)] == 6


async def test_the_daily_budget_bounds_each_round_and_the_day(tmp_path: Path) -> None:
    policy = CalibrationPolicy(interval_s=60, pairs=10, calls_per_day=4)
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0), policy) as stage:
        for n in (1, 2, 3):
            await pair(stage, n)
        out = await round_at(stage, 0, NOON)
        (found,) = out.aggregates()
        assert (found.pairs, found.model_calls) == (2, 4)  # 4 calls: two pairs of three
        later = await round_at(stage, ms(NOON) + 60_000, NOON + timedelta(minutes=1))
        assert later.aggregates() == []
        assert later.usage() == []
        assert stage.judge.compared == []
        kept = await stage.log.get(StateKey(TENANT, "calibration_round", "round"))
        assert kept is not None
        assert kept["calls_today"] == 4
        tomorrow = NOON + timedelta(days=1)
        out = await round_at(stage, ms(NOON) + 120_000, tomorrow)
        assert [f.model_calls for f in out.aggregates()] == [4]


async def test_a_due_already_handled_runs_no_second_round(stage: Stage) -> None:
    await pair(stage, 1)
    await round_at(stage, 0, NOON)
    stage.judge.compared.clear()
    again = await stage.deliver(
        CalibrationDue(tenant=TENANT, due_ms=0), occurred_at=NOON, mid="another-process"
    )
    assert again.aggregates() == []
    assert again.usage() == []
    assert stage.judge.compared == []


async def test_a_tenant_is_calibrated_on_its_own_runs_only(stage: Stage) -> None:
    await pair(stage, 1, tenant=OTHER)
    assert await fire(stage, NOON) == [CalibrationDue(tenant=OTHER, due_ms=0)]
    mine = await round_at(stage, 0, NOON)
    assert mine.aggregates() == []
    assert stage.judge.compared == []
    kept = await stage.log.get(StateKey(TENANT, "calibration_round", "round"))
    assert kept is not None
    assert kept["calls_today"] == 0  # skipped: no pairs yet
    theirs = await round_at(stage, 0, NOON, tenant=OTHER)
    (found,) = theirs.aggregates()
    assert (found.tenant, found.pairs) == (OTHER, 1)


async def test_without_a_schedule_nothing_is_kept_or_judged(tmp_path: Path) -> None:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0)) as stage:
        await pair(stage, 1)
        assert await stage.log.scan(TENANT, "calibration_pair", "") == []
        out = await round_at(stage, 0, NOON)
        assert out.aggregates() == []
        assert stage.judge.compared == []


def episode(tenant: TenantId, name: str, output: str) -> Episode:
    return Episode(
        run=run_of(7, name, tenant),
        definition=V1.model_dump(mode="json", by_alias=True),
        input={"question": "2 + 3"},
        attempts=[],
        outputs={"solve": output},
        output=output,
        succeeded=True,
        usage=Usage(model_calls=1),
    )


async def test_a_calibration_file_schedules_each_tenant_on_its_own_lines(tmp_path: Path) -> None:
    lines = [
        {
            "task": f"{who}-{i}",
            "passed": episode(who, f"p{i}", "5").model_dump(mode="json"),
            "failed": episode(who, f"f{i}", "6").model_dump(mode="json"),
        }
        for who, count in ((TENANT, 2), (OTHER, 1))
        for i in range(count)
    ]
    path = tmp_path / "calibration.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    policy = CalibrationPolicy(interval_s=3600, file=path)
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0), policy) as stage:
        tenants = frozenset({TENANT, OTHER})
        due = await fire(stage, NOON, tenants=tenants)
        assert {d.tenant for d in due} == tenants
        (found,) = (await round_at(stage, 0, NOON)).aggregates()
        assert (found.source, found.pairs, found.model_calls) == ("file", 2, 4)


def test_a_bad_calibration_file_stops_the_stage_at_start_up(tmp_path: Path) -> None:
    path = tmp_path / "calibration.jsonl"
    path.write_text('{"task": "t"}\n')
    deps = StageDeps(
        blobs=FsBlobStore(tmp_path),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        calibration=CalibrationPolicy(interval_s=60, file=path),
    )
    with pytest.raises(AssayError, match=r"calibration.jsonl:1: not a calibration line"):
        assay_tournament.create_stage(deps)


async def test_grade_health_shows_the_calibration_and_the_hold_it_implies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [v for v in os.environ if v.startswith("ASSAY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ASSAY_CALIBRATION_INTERVAL_S", "3600")
    monkeypatch.setenv("ASSAY_CALIBRATION_MIN_JUDGED", "2")
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0), SCHEDULED) as stage:
        await pair(stage, 1)
        stage.judge.verdicts = [Verdict.A, Verdict.A]  # agrees once in two: 50% < 70%
        today = datetime.now(UTC)
        await round_at(stage, 0, today)
        capsys.readouterr()
        assert await health_command(tmp_path, TENANT) == 0
    (shown,) = json.loads(capsys.readouterr().out)
    calibration = shown["calibration"]
    assert (calibration["scheduled"], calibration["calls_today"]) == (True, 2)
    assert calibration["calls_budget"] == 200
    next_due = datetime.fromisoformat(calibration["next_due"])
    assert abs(next_due - (today + timedelta(hours=1))) < timedelta(milliseconds=1)
    (judge,) = calibration["judges"]
    assert (judge["judge"], judge["agreement"], judge["judged"]) == ("scripted-judge", 0.5, 2)
    assert judge["order_inconsistency_rate"] == 1.0
    assert calibration["promotion_held"] == (
        "judge-versus-verifier agreement 50% over 2 calibration orderings is below 70%"
    )
