"""Scheduled calibration (§11, §16): each tenant's judge, replayed on its calibration set.

The schedule lives here, in the tournament stage, because this stage owns the
judge — the same model, endpoint and prompts that grade are the ones measured —
and it sees every verified run with its episode, so a tenant's calibration set can
be its own: the first verified pass and the first verified fail of a workflow on a
task (`keep_for_calibration`), or the tenant's lines of a calibration file.

A background timer (`calibration_timer`) sends `CalibrationDue` to this stage on
`assay.verified`, keyed by the tenant, so a tenant's rounds are handled on one
partition, one at a time, like any other input. A round (`on_calibration_due`)
judges at most `pairs` pairs in both orderings within the tenant's daily budget,
meters each call as usage purpose `calibration` (no run), records what it found
(`CalibrationRan`: it folds, and rebuilds) and tells decide (`JudgeCalibrated`
on `assay.aggregates`), which holds promotion while agreement is low.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Literal

from pydantic import ValidationError

from assay.bus.topics import AGGREGATES, USAGE, VERIFIED, producer_entry
from assay.grading.calibration import CalibrationPair, CalibrationReport, calibrate
from assay.grading.judges import JudgeUsage
from assay.kernel.ids import TenantId
from assay.kernel.waiting import sleep_or
from assay.messages import CalibrationDue, JudgeCalibrated, Purpose, RunVerified, UsageRecorded
from assay.record import BranchKey
from assay.runtime.stage import Background
from assay.store import CommitBatch, EventLog
from assay.workflow import WorkflowDef
from assay_tournament.calibration_state import (
    ROUND,
    CalibrationPairKept,
    CalibrationRound,
    due_rounds,
)
from assay_tournament.events import CALIBRATION_STREAM, CalibrationEpisodeKept, CalibrationRan
from assay_tournament.grading import TournamentUnitOfWork, load_episode

CALIBRATION_TICK_S = 1.0

Source = Literal["verified_runs", "file"]


async def keep_for_calibration(uow: TournamentUnitOfWork, msg: RunVerified) -> None:
    """Keep the run's episode as its task's calibration pass or fail, if that side is
    still empty (scheduled calibration on, from the tenant's own runs)."""
    policy = uow.deps.calibration
    if not policy.scheduled or policy.file is not None:
        return
    r = msg.run
    kept = await uow.get(CalibrationPairKept, f"{r.workflow_id}/{r.task_id}")
    if kept is None:
        mine = other = None
    elif msg.passed:
        mine, other = kept.passed, kept.failed
    else:
        mine, other = kept.failed, kept.passed
    if mine is not None:
        return
    uow.record(
        BranchKey.main(uow.tenant, f"task:{r.task_id}"),
        CalibrationEpisodeKept(
            workflow_id=r.workflow_id,
            task_id=r.task_id,
            passed=msg.passed,
            run_id=r.run_id,
            episode=msg.episode,
            completes=other is not None,
        ),
    )


def calibration_timer(
    tenants: frozenset[TenantId],
    clock: Callable[[], float],
    tick_s: float = CALIBRATION_TICK_S,
) -> Background:
    """A background task sending `CalibrationDue` for each tenant whose round is due
    (`tenants`: a calibration file's, scheduled before any run of theirs), once each.

    `clock` returns seconds since the epoch (the stage's own clock, for tests).
    """

    async def run(log: EventLog, stop: asyncio.Event) -> None:
        sent: set[tuple[TenantId, int]] = set()
        while not stop.is_set():
            for tenant, due_ms in await due_rounds(log, tenants, clock() * 1000):
                if (tenant, due_ms) in sent:
                    continue
                due = CalibrationDue(tenant=tenant, due_ms=due_ms)
                entry = producer_entry(VERIFIED, due, tenant, f"calibration/{due_ms}")
                await log.commit(CommitBatch(outbox=[entry]))
                sent.add((tenant, due_ms))
            await sleep_or(stop, tick_s)

    return run


async def on_calibration_due(msg: CalibrationDue, uow: TournamentUnitOfWork) -> None:
    """Replay the tenant's calibration set through the judge within its budget; record
    and publish what the round found, and meter its calls as `calibration`."""
    policy, judge = uow.deps.calibration, uow.deps.judge
    kept = await uow.get(CalibrationRound, ROUND)
    if policy.interval_s is None or (kept is not None and kept.next_due_ms > msg.due_ms):
        return  # not scheduled here, or this round already ran
    at = uow.envelope.occurred_at
    day = at.date().isoformat()
    spent = kept.calls_today if kept is not None and kept.day == day else 0
    affordable = min(policy.pairs, (policy.budget_for(str(uow.tenant)) - spent) // 2)
    pairs, source = await _pairs(uow, affordable)
    calls: list[JudgeUsage] = []
    report = await calibrate(judge, pairs, None, on_usage=calls.append) if pairs else None
    skipped = None
    if report is None:
        skipped = "the daily calibration budget is spent" if affordable <= 0 else "no pairs yet"
    found = _found(msg, judge.name, source, report, calls, skipped)
    uow.record(
        BranchKey.main(uow.tenant, CALIBRATION_STREAM),
        CalibrationRan(
            found=found.model_dump(mode="json"),
            day=day,
            calls_today=spent + len(calls),
            next_due_ms=max(msg.due_ms, int(at.timestamp() * 1000)) + int(policy.interval_s * 1000),
        ),
    )
    _meter(uow, calls)
    if report is not None:
        uow.emit(AGGREGATES, found)


async def _pairs(uow: TournamentUnitOfWork, n: int) -> tuple[list[CalibrationPair], Source]:
    """Up to `n` of the tenant's pairs: its lines of the calibration file, else its kept
    pairs (by workflow and task) whose episodes are still there and pin a valid workflow."""
    given = uow.deps.calibration_set
    if given is not None:
        return [p for p in given if p.passed.run.tenant == uow.tenant][: max(n, 0)], "file"
    pairs: list[CalibrationPair] = []
    for key, kept in await uow.scan(CalibrationPairKept):
        if len(pairs) >= n:
            break
        if kept.passed is None or kept.failed is None:
            continue
        passed = await load_episode(uow, kept.passed.episode)
        failed = await load_episode(uow, kept.failed.episode)
        if passed is None or failed is None:
            continue  # retention tiered it away, or it was never readable
        try:
            rubric = list(WorkflowDef.model_validate(passed.definition).rubric)
        except ValidationError:
            continue
        pairs.append(CalibrationPair(key, passed, failed, rubric))
    return pairs, "verified_runs"


def _found(
    msg: CalibrationDue,
    judge: str,
    source: Source,
    report: CalibrationReport | None,
    calls: list[JudgeUsage],
    skipped: str | None,
) -> JudgeCalibrated:
    details = report.details if report else []
    checked = [d for d in details if d.consistent is not None]
    return JudgeCalibrated(
        tenant=msg.tenant,
        judge=judge,
        due_ms=msg.due_ms,
        source=source,
        pairs=report.pairs if report else 0,
        judged=report.judged if report else 0,
        agreed=sum(d.agreed for d in details),
        draws=report.draws if report else 0,
        failures=report.failures if report else 0,
        checked=len(checked),
        inconsistent=sum(not d.consistent for d in checked),
        agreement=report.agreement if report else None,
        order_inconsistency_rate=report.order_inconsistency_rate if report else None,
        model_calls=len(calls),
        cost_usd=sum(c.cost_usd for c in calls),
        skipped=skipped,
    )


def _meter(uow: TournamentUnitOfWork, calls: list[JudgeUsage]) -> None:
    """Each call the endpoint billed, as usage purpose `calibration` serving no run."""
    emitted: Counter[str] = Counter()
    for call in calls:
        recorded = UsageRecorded(
            tenant=uow.tenant,
            run_id=None,
            purpose=Purpose.CALIBRATION,
            model=call.model,
            prompt_tokens=call.prompt_tokens,
            completion_tokens=call.completion_tokens,
            cost_usd=call.cost_usd,
            failed=call.failed,
        )
        content = recorded.model_dump_json()
        uow.emit(USAGE, recorded, occurrence=emitted[content])
        emitted[content] += 1
