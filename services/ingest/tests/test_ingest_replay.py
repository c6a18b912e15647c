"""Replay's own spend ceiling at admission (§12.4, §14.1): shadow runs reserve their
workflow's model-call budget against the tenant's replay ceiling; one that does not fit
is cut, recorded and announced, and work runs are never touched. On SQLite and Postgres.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import assay_ingest
from assay.bus import DECISIONS, RUN_STATUS, RUNS, TASKS, WORKFLOWS, BusMessage, producer_entry
from assay.devstack.base import Service
from assay.devstack.postgres import scratch_database
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import StubJudge
from assay.grading.replay import ReplayPolicy
from assay.kernel import RunState, TenantId, WorkflowId
from assay.messages import (
    AllocationChanged,
    Purpose,
    Role,
    Rung,
    RunSpawned,
    RunStatusChanged,
    TaskSubmitted,
    Versioned,
    WorkflowRegistered,
)
from assay.runtime import StageDeps, StageHarness, StageSpec
from assay.runtime.metrics import StageCollector, stage_registry
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.store import EventLog, FsBlobStore, SqliteEventLog
from assay.store.postgres import PostgresEventLog
from assay.workflow import WorkflowDef, from_document
from assay_ingest.state import INGEST_EVENTS, fold_ingest

SMALL = TenantId(uuid.UUID(int=61))  # a low replay ceiling
LARGE = TenantId(uuid.UUID(int=62))  # no ceiling (the default)
BUDGET = 10  # model calls each run of the test workflows may make: what a shadow run reserves
CEILING = 25  # SMALL's ceiling: two shadow runs a day fit, a third does not
DAY = datetime(2026, 11, 29, 9, tzinfo=UTC)


def workflow(prompt: str) -> dict[str, Any]:
    return {
        "id": "arith",
        "budget": {"max_model_calls": BUDGET},
        "steps": [
            {"id": "solve", "kind": "model", "prompt": prompt},
            {"id": "answer", "kind": "tool", "tool": "extract_number", "args": {"text": "x"}},
        ],
        "verifiers": [
            {"id": "correct", "kind": "exact", "step": "answer", "expected": "{{ task.answer }}"}
        ],
    }


V1_DOC = workflow("What is {{ task.question }}?")
V2_DOC = workflow("Step by step: {{ task.question }}?")


# -- the ingest stage's store, in both modes --------------------------------------------


@pytest.fixture(scope="module")
def replay_database(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_replay") as dsn:
        yield dsn


class Stores:
    """Opens the ingest stage's store in one mode; reopening gives the same store."""

    def __init__(self, where: Path | str) -> None:
        self.where = where
        self.schema = f"ingest_{uuid.uuid4().hex[:10]}"
        self.opened: list[EventLog] = []

    async def open(self) -> EventLog:
        log: EventLog
        if isinstance(self.where, Path):
            log = SqliteEventLog(self.where / "ingest.sqlite", INGEST_EVENTS, fold_ingest)
        else:
            log = PostgresEventLog(self.where, self.schema, INGEST_EVENTS, fold_ingest)
        await log.open()
        self.opened.append(log)
        return log


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    where: Path | str = tmp_path
    if request.param == "postgres":
        where = str(request.getfixturevalue("replay_database"))
    s = Stores(where)
    yield s
    for log in reversed(s.opened):
        await log.close()


def spec(tmp_path: Path, policy: ReplayPolicy) -> StageSpec:
    deps = StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        replay=policy,
    )
    return assay_ingest.create_stage(deps)


POLICY = ReplayPolicy(ceilings={str(SMALL): CEILING})


class Ingest:
    """One ingest stage over a store, fed as producers and decide would feed it."""

    def __init__(self, harness: StageHarness) -> None:
        self.h = harness
        self.offsets: dict[tuple[str, int], int] = {}

    async def send(
        self,
        topic: str,
        msg: Versioned,
        tenant: TenantId,
        *,
        idem: str,
        at: datetime = DAY,
        partition: int = 0,
    ) -> None:
        entry = producer_entry(topic, msg, tenant, idem, occurred_at=at)
        offset = self.offsets.get((topic, partition), 0)
        self.offsets[(topic, partition)] = offset + 1
        assert self.h.runner is not None
        await self.h.runner.handle(
            BusMessage(topic, partition, offset, entry.key, entry.value, entry.headers)
        )

    async def contest(self, tenant: TenantId, *, share: float) -> tuple[WorkflowDef, WorkflowDef]:
        """Two versions of the workflow, the second the challenger with every task shadowed."""
        v1, v2 = from_document(V1_DOC), from_document(V2_DOC)
        for doc in (V1_DOC, V2_DOC):
            registered = WorkflowRegistered(tenant=tenant, definition=doc)
            await self.send(WORKFLOWS, registered, tenant, idem=f"wf-{doc['steps'][0]['prompt']}")
        alloc = AllocationChanged(
            tenant=tenant,
            workflow_id=v1.id,
            generation=2,
            current=v1.version,
            challenger=v2.version,
            challenger_share=share,
            shadow_rate=1.0,
            rung=Rung.TRIAL if share else Rung.SHADOW,
            definitions={v.version: v.model_dump(mode="json", by_alias=True) for v in (v1, v2)},
        )
        await self.send(DECISIONS, alloc, tenant, idem=f"alloc-{tenant}")
        return v1, v2

    async def task(
        self, tenant: TenantId, i: int, *, idem: str | None = None, **kw: Any
    ) -> TaskSubmitted:
        msg = TaskSubmitted(
            tenant=tenant,
            workflow_id=WorkflowId("arith"),
            idempotency_key=f"t-{i}",
            input={"question": f"{i} + 1", "answer": str(i + 1)},
        )
        await self.send(TASKS, msg, tenant, idem=idem or f"t-{i}", **kw)
        return msg

    async def spawned(self, tenant: TenantId) -> list[RunSpawned]:
        return [
            m
            for m in await self.h.emitted(RUNS)
            if isinstance(m, RunSpawned) and m.run.tenant == tenant
        ]

    async def cut_statuses(self, tenant: TenantId) -> list[RunStatusChanged]:
        return [
            m
            for m in await self.h.emitted(RUN_STATUS)
            if isinstance(m, RunStatusChanged)
            and m.run.tenant == tenant
            and m.state is RunState.CANCELLED
        ]

    async def meter(self, tenant: TenantId) -> dict[str, Any]:
        doc = await self.h.state(tenant, "meter", "replay")
        assert doc is not None
        return doc


async def ingest(tmp_path: Path, log: EventLog, policy: ReplayPolicy = POLICY) -> StageHarness:
    return await StageHarness(
        spec(tmp_path, policy), FsBlobStore(tmp_path), tmp_path, log
    ).__aenter__()


@pytest.fixture
async def stage(stores: Stores, tmp_path: Path) -> AsyncIterator[Ingest]:
    harness = await ingest(tmp_path, await stores.open())
    yield Ingest(harness)
    await harness.__aexit__(None, None, None)


# -- the ceiling -------------------------------------------------------------------------


async def test_a_small_replay_ceiling_bounds_shadow_spend_and_every_work_run_still_runs(
    stage: Ingest,
) -> None:
    for tenant in (SMALL, LARGE):
        await stage.contest(tenant, share=0.0)
        for i in range(6):
            await stage.task(tenant, i)
    small = await stage.spawned(SMALL)
    work = [m for m in small if m.run.purpose is Purpose.WORK]
    shadow = [m for m in small if m.run.purpose is Purpose.SHADOW]
    assert len(work) == 6  # every task is served, whatever the replay budget
    assert len(shadow) == 2  # 2 x 10 reserved calls fit under 25; a third would not
    assert len(shadow) * BUDGET <= CEILING
    meter = await stage.meter(SMALL)
    assert (meter["calls_today"], meter["runs_today"], meter["cut_today"]) == (20, 2, 4)
    # each cut run is recorded with its reason and announced with a terminal state
    cut = []
    for i in range(6):
        doc = await stage.h.state(SMALL, "task", f"t-{i}")
        assert doc is not None
        cut += doc["cut"]
        assert doc["replay_calls"] == (BUDGET if i < 2 else 0)
    assert [c["reason"] for c in cut] == ["replay_budget_exhausted"] * 4
    assert all(c["purpose"] == "shadow" and c["role"] == "challenger" for c in cut)
    statuses = await stage.cut_statuses(SMALL)
    assert sorted(s.run.run_id for s in statuses) == sorted(c["run_id"] for c in cut)
    assert all("replay_budget_exhausted" in s.detail for s in statuses)
    assert not {s.run.run_id for s in statuses} & {m.run.run_id for m in small}  # never spawned
    # the other tenant, without a ceiling, is not touched by SMALL's
    large = await stage.spawned(LARGE)
    assert sum(m.run.purpose is Purpose.SHADOW for m in large) == 6
    assert await stage.cut_statuses(LARGE) == []
    meter = await stage.meter(LARGE)
    assert (meter["calls_today"], meter["runs_today"], meter["cut_today"]) == (60, 6, 0)


async def test_a_cut_reference_run_leaves_the_served_challenger_expecting_none(
    stage: Ingest,
) -> None:
    await stage.contest(SMALL, share=1.0)  # the challenger serves; the current is its reference
    for i in range(3):
        await stage.task(SMALL, i)
    runs = await stage.spawned(SMALL)
    served = [m.run for m in runs if m.run.purpose is Purpose.WORK]
    assert [r.role for r in served] == [Role.CHALLENGER] * 3
    assert [r.reference_expected for r in served] == [True, True, False]  # third: cut
    references = [m.run for m in runs if m.run.purpose is Purpose.SHADOW]
    assert [r.role for r in references] == [Role.CURRENT] * 2
    (status,) = await stage.cut_statuses(SMALL)
    assert (status.run.role, status.run.purpose) == (Role.CURRENT, Purpose.SHADOW)


async def test_a_new_day_starts_the_replay_budget_again(stage: Ingest) -> None:
    await stage.contest(SMALL, share=0.0)
    for i in range(3):
        await stage.task(SMALL, i)
    await stage.task(SMALL, 3, at=DAY + timedelta(days=1))
    meter = await stage.meter(SMALL)
    assert (meter["day"], meter["calls_today"], meter["runs_today"]) == ("2026-11-30", 10, 1)
    assert (meter["calls_total"], meter["runs_total"], meter["cut_total"]) == (30, 3, 1)


async def test_a_ceiling_of_zero_turns_replay_off_and_a_task_without_shadow_runs_is_not_metered(
    stores: Stores, tmp_path: Path
) -> None:
    harness = await ingest(tmp_path, await stores.open(), ReplayPolicy(calls_per_day=0))
    stage = Ingest(harness)
    try:
        v1 = from_document(V1_DOC)
        await stage.send(
            WORKFLOWS, WorkflowRegistered(tenant=LARGE, definition=V1_DOC), LARGE, idem="wf"
        )
        alloc = AllocationChanged(
            tenant=LARGE,
            workflow_id=v1.id,
            generation=1,
            current=v1.version,
            definitions={v1.version: v1.model_dump(mode="json", by_alias=True)},
        )
        await stage.send(DECISIONS, alloc, LARGE, idem="alloc")
        await stage.task(LARGE, 1)
        assert await harness.state(LARGE, "meter", "replay") is None  # no shadow run: no meter
        await stage.contest(SMALL, share=0.0)
        await stage.task(SMALL, 1)
        assert [m.run.purpose for m in await stage.spawned(SMALL)] == [Purpose.WORK]
        assert len(await stage.cut_statuses(SMALL)) == 1
    finally:
        await harness.__aexit__(None, None, None)


# -- exactly once ------------------------------------------------------------------------


async def test_redelivery_resubmission_and_restart_never_reserve_twice(
    stores: Stores, tmp_path: Path
) -> None:
    first = await ingest(tmp_path, await stores.open())
    stage = Ingest(first)
    await stage.contest(SMALL, share=0.0)
    await stage.task(SMALL, 1)
    await stage.task(SMALL, 1)  # the same message again: the inbox has it
    await stage.task(SMALL, 1, idem="again")  # the same idempotency key, another message
    assert (await stage.meter(SMALL))["runs_today"] == 1
    await first.__aexit__(None, None, None)
    # a restarted stage on the same store: the meter was committed with the task's runs
    second = await ingest(tmp_path, await stores.open())
    again = Ingest(second)
    again.offsets = dict(stage.offsets)
    await again.task(SMALL, 1)
    await again.task(SMALL, 2)
    meter = await again.meter(SMALL)
    assert (meter["calls_today"], meter["runs_today"], meter["cut_today"]) == (20, 2, 0)
    await again.task(SMALL, 3)
    assert (await again.meter(SMALL))["cut_today"] == 1
    await second.__aexit__(None, None, None)


async def test_tasks_of_one_tenant_handled_at_once_never_reserve_the_same_calls(
    stage: Ingest,
) -> None:
    await stage.contest(SMALL, share=0.0)
    await asyncio.gather(*(stage.task(SMALL, i, partition=i) for i in range(6)))
    meter = await stage.meter(SMALL)
    assert (meter["runs_today"], meter["cut_today"]) == (2, 4)  # every task metered once
    assert meter["calls_today"] == 20
    shadow = [m for m in await stage.spawned(SMALL) if m.run.purpose is Purpose.SHADOW]
    assert len(shadow) == 2


# -- what an operator sees -------------------------------------------------------------


async def test_metrics_show_replay_reservations_and_cuts_by_tenant(stage: Ingest) -> None:
    for tenant in (SMALL, LARGE):
        await stage.contest(tenant, share=0.0)
        for i in range(4):
            await stage.task(tenant, i, at=datetime.now(UTC))
    assert stage.h.runner is not None
    collector = StageCollector(stage.h.runner)
    registry = stage_registry(stage.h.runner, collector)
    await collector.refresh()

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    small, large = str(SMALL), str(LARGE)
    assert value("assay_replay_calls_reserved", tenant=small) == 20
    assert value("assay_replay_runs", tenant=small, outcome="admitted") == 2
    assert value("assay_replay_runs", tenant=small, outcome="cut") == 2
    assert value("assay_replay_calls_ceiling", tenant=small) == CEILING
    assert value("assay_replay_calls_reserved", tenant=large) == 40
    assert value("assay_replay_runs", tenant=large, outcome="cut") == 0
    assert value("assay_replay_calls_ceiling", tenant=large) is None  # no ceiling
    # beside the capacity refusals, by their own reason: a spend ceiling, not the fleet
    assert value("assay_admission_refusals", reason="replay_budget") == 2


def test_replay_settings_read_a_default_ceiling_and_a_per_tenant_map() -> None:
    env = {"ASSAY_REPLAY_CALLS_PER_DAY": "500", "ASSAY_REPLAY_CEILINGS": f"{SMALL}=25"}
    policy = AssaySettings.from_env(env).replay
    assert (policy.ceiling_for(str(SMALL)), policy.ceiling_for(str(LARGE))) == (25, 500)
    assert AssaySettings.from_env({}).replay.ceiling_for(str(SMALL)) is None  # no ceiling
    with pytest.raises(SettingsInvalid, match="ASSAY_REPLAY_CEILINGS='acme=5'"):
        AssaySettings.from_env({"ASSAY_REPLAY_CEILINGS": "acme=5"})
    with pytest.raises(SettingsInvalid, match="ASSAY_REPLAY_CALLS_PER_DAY='-1'"):
        AssaySettings.from_env({"ASSAY_REPLAY_CALLS_PER_DAY": "-1"})
