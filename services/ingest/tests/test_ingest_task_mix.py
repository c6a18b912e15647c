"""Task-mix drift at the door (§12.5): ingest samples each admitted task's declared
features, takes the first full window as the reference, measures every later window
by its population stability index, announces a drift, retakes the reference at a
promotion and on an operator's acknowledgement, and refuses a feature that is not in
the task at registration. On SQLite and Postgres."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import assay_ingest
from assay.bus import DECISIONS, TASKS, WORKFLOWS, BusMessage, dlq, producer_entry
from assay.devstack.base import Service
from assay.devstack.postgres import scratch_database
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import StubJudge
from assay.kernel import TenantId, WorkflowId
from assay.messages import (
    AcknowledgeDrift,
    AllocationChanged,
    TaskMixDrifted,
    TaskMixRebased,
    TaskSubmitted,
    Versioned,
    WorkflowRegistered,
)
from assay.runtime import StageDeps, StageHarness
from assay.runtime.metrics import StageCollector, stage_registry
from assay.store import EventLog, FsBlobStore, SqliteEventLog
from assay.store.postgres import PostgresEventLog
from assay.workflow import WorkflowDef, from_document
from assay_ingest.state import INGEST_EVENTS, fold_ingest

TENANT = TenantId(uuid.UUID(int=71))
OTHER = TenantId(uuid.UUID(int=72))
WINDOW = 20
DRIFT = {"features": ["input.language", "input.difficulty"], "window": WINDOW, "threshold": 0.2}


def workflow(prompt: str, drift: dict[str, Any] | None = DRIFT) -> dict[str, Any]:
    return {
        "id": "arith",
        "steps": [{"id": "solve", "kind": "model", "prompt": prompt}],
        **({"drift": drift} if drift is not None else {}),
    }


V1 = workflow("What is {{ task.question }}?")
V2 = workflow("Step by step: {{ task.question }}?")


@pytest.fixture(scope="module")
def mix_database(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_task_mix") as dsn:
        yield dsn


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def log(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[EventLog]:
    opened: EventLog
    if request.param == "postgres":
        dsn = str(request.getfixturevalue("mix_database"))
        schema = f"ingest_{uuid.uuid4().hex[:10]}"
        opened = PostgresEventLog(dsn, schema, INGEST_EVENTS, fold_ingest)
    else:
        opened = SqliteEventLog(tmp_path / "ingest.sqlite", INGEST_EVENTS, fold_ingest)
    await opened.open()
    yield opened
    await opened.close()


class Ingest:
    """The ingest stage, fed as producers, operators and decide would feed it."""

    def __init__(self, h: StageHarness) -> None:
        self.h = h
        self.offsets: dict[tuple[str, int], int] = {}
        self.seen = 0

    async def send(
        self,
        topic: str,
        msg: Versioned,
        idem: str,
        *,
        tenant: TenantId = TENANT,
        partition: int = 0,
    ) -> None:
        entry = producer_entry(topic, msg, tenant, idem)
        offset = self.offsets.get((topic, partition), 0)
        self.offsets[(topic, partition)] = offset + 1
        assert self.h.runner is not None
        await self.h.runner.handle(
            BusMessage(topic, partition, offset, entry.key, entry.value, entry.headers)
        )

    async def offer(self, doc: dict[str, Any], tenant: TenantId = TENANT) -> None:
        reg = WorkflowRegistered(tenant=tenant, definition=doc)
        await self.send(WORKFLOWS, reg, f"wf-{doc['steps'][0]['prompt']}", tenant=tenant)

    async def register(self, doc: dict[str, Any], tenant: TenantId = TENANT) -> WorkflowDef:
        await self.offer(doc, tenant)
        return from_document(doc)

    async def allocate(
        self, generation: int, current: WorkflowDef, *known: WorkflowDef, tenant: TenantId = TENANT
    ) -> None:
        alloc = AllocationChanged(
            tenant=tenant,
            workflow_id=current.id,
            generation=generation,
            current=current.version,
            challenger_share=0.0,
            shadow_rate=0.0,
            definitions={v.version: v.model_dump(mode="json", by_alias=True) for v in known},
        )
        await self.send(DECISIONS, alloc, f"alloc-{generation}", tenant=tenant)

    async def tasks(
        self, n: int, tenant: TenantId = TENANT, *, together: bool = False, **fields: Any
    ) -> None:
        sends = []
        for _ in range(n):
            i = self.seen
            self.seen += 1
            msg = TaskSubmitted(
                tenant=tenant,
                workflow_id=WorkflowId("arith"),
                idempotency_key=f"t-{i}",
                input={"question": f"{i} + 1", **fields, "difficulty": i % 5},
            )
            sends.append(self.send(TASKS, msg, f"t-{i}", tenant=tenant, partition=i % 4))
        if together:
            await asyncio.gather(*sends)
        else:
            for s in sends:
                await s

    async def said(self) -> list[Versioned]:
        """What ingest said about task mixes on `assay.workflows`, in order."""
        return [
            m
            for m in await self.h.emitted(WORKFLOWS)
            if isinstance(m, TaskMixDrifted | TaskMixRebased)
        ]

    async def mix(self, tenant: TenantId = TENANT) -> dict[str, Any]:
        doc = await self.h.state(tenant, "task_mix", "arith")
        assert doc is not None
        return doc

    async def refusals(self) -> list[str]:
        return [
            dict(r.entry.headers)["assay-dlq-reason"].decode()
            for r in await self.h.outbox()
            if r.entry.topic == dlq("ingest")
        ]


@pytest.fixture
async def stage(log: EventLog, tmp_path: Path) -> AsyncIterator[Ingest]:
    deps = StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
    )
    spec = assay_ingest.create_stage(deps)
    async with StageHarness(spec, deps.blobs, tmp_path, log) as h:
        yield Ingest(h)


async def watched(stage: Ingest) -> WorkflowDef:
    v1 = await stage.register(V1)
    await stage.allocate(1, v1, v1)
    return v1


async def test_the_first_full_window_is_the_reference_and_a_like_window_is_no_drift(
    stage: Ingest,
) -> None:
    v1 = await watched(stage)
    await stage.tasks(WINDOW - 1, language="en")
    assert (await stage.mix())["reference"] is None
    await stage.tasks(1, language="en")
    (rebased,) = await stage.said()
    assert isinstance(rebased, TaskMixRebased)
    assert (rebased.cause, rebased.current, rebased.reference_tasks) == (
        "first_window",
        v1.version,
        WINDOW,
    )
    await stage.tasks(WINDOW, language="en")
    mix = await stage.mix()
    assert mix["sampled"] == 2 * WINDOW
    assert mix["psi"] == {"input.language": 0.0, "input.difficulty": 0.0, "task_id.class": 0.0}
    assert mix["drifted"] is False
    assert len(await stage.said()) == 1  # nothing more to say


async def test_a_moved_mix_is_announced_exported_and_acknowledged_into_the_reference(
    stage: Ingest,
) -> None:
    v1 = await watched(stage)
    await stage.tasks(WINDOW, language="en")
    await stage.tasks(WINDOW // 2, language="en")
    await stage.tasks(WINDOW // 2, language="fr")  # half the window speaks another language
    drifted = (await stage.said())[-1]
    assert isinstance(drifted, TaskMixDrifted)
    assert drifted.worst()[0] == "input.language"
    assert drifted.psi["input.language"] > 0.2
    assert drifted.psi["input.difficulty"] == 0.0  # the same spread of difficulties
    assert (drifted.current, drifted.window, drifted.sampled) == (v1.version, WINDOW, 2 * WINDOW)

    assert stage.h.runner is not None
    collector = StageCollector(stage.h.runner)
    registry = stage_registry(stage.h.runner, collector)
    await collector.refresh()
    labels = {"tenant": str(TENANT), "workflow": "arith"}
    assert registry.get_sample_value("assay_task_mix_psi", labels) == pytest.approx(
        drifted.psi["input.language"]
    )

    ack = AcknowledgeDrift(tenant=TENANT, workflow_id=WorkflowId("arith"), reason="new market")
    await stage.send(WORKFLOWS, ack, "ack-1")
    rebased = (await stage.said())[-1]
    assert isinstance(rebased, TaskMixRebased)
    assert (rebased.cause, rebased.reason) == ("acknowledged", "new market")
    await stage.tasks(WINDOW // 2, language="en")
    await stage.tasks(WINDOW // 2, language="fr")  # the acknowledged mix again: no drift
    assert (await stage.mix())["drifted"] is False
    assert isinstance((await stage.said())[-1], TaskMixRebased)


async def test_a_promotion_takes_the_mix_it_was_promoted_under_as_the_reference(
    stage: Ingest,
) -> None:
    v1 = await watched(stage)
    v2 = await stage.register(V2)
    await stage.tasks(WINDOW, language="en")
    await stage.tasks(WINDOW, language="fr")  # drifted against the first window
    assert isinstance((await stage.said())[-1], TaskMixDrifted)
    await stage.allocate(2, v2, v1, v2)  # v2 promoted while the tasks speak French
    rebased = (await stage.said())[-1]
    assert isinstance(rebased, TaskMixRebased)
    assert (rebased.cause, rebased.current) == ("promoted", v2.version)
    await stage.tasks(WINDOW, language="fr")
    assert (await stage.mix())["drifted"] is False


async def test_a_task_lacking_a_feature_counts_as_missing(stage: Ingest) -> None:
    await watched(stage)
    await stage.tasks(WINDOW, language="en")
    await stage.tasks(WINDOW)  # no language at all
    drifted = (await stage.said())[-1]
    assert isinstance(drifted, TaskMixDrifted)
    assert drifted.worst()[0] == "input.language"


async def test_concurrent_tasks_of_a_workflow_each_take_one_slot(stage: Ingest) -> None:
    await watched(stage)
    await stage.tasks(WINDOW + 7, together=True, language="en")
    mix = await stage.mix()
    assert mix["sampled"] == WINDOW + 7
    assert mix["reference"]["tasks"] == WINDOW


async def test_features_not_in_the_task_are_refused_at_registration(stage: Ingest) -> None:
    await stage.offer(workflow("a", {"features": ["output.answer"]}))
    schema = {"type": "object", "properties": {"question": {"type": "string"}}}
    await stage.offer(workflow("b", {"features": ["input.language"], "input_schema": schema}))
    first, second = await stage.refusals()
    assert "drift feature 'output.answer' is not in the task input" in first
    assert "drift feature 'input.language' is not in the task input" in second
    assert "input_schema has no property 'language'" in second
    assert await stage.h.state(TENANT, "latest", "arith") is None  # nothing half-registered


async def test_an_acknowledgement_without_a_drift_or_a_watch_is_refused(stage: Ingest) -> None:
    await watched(stage)
    ack = AcknowledgeDrift(tenant=TENANT, workflow_id=WorkflowId("arith"))
    await stage.send(WORKFLOWS, ack, "ack-early")
    plain = from_document(workflow("plain", None))
    await stage.register(workflow("plain", None), tenant=OTHER)
    await stage.allocate(1, plain, plain, tenant=OTHER)
    await stage.send(WORKFLOWS, ack.model_copy(update={"tenant": OTHER}), "ack", tenant=OTHER)
    early, unwatched = await stage.refusals()
    assert "has no task-mix drift to acknowledge" in early
    assert "watches no task mix" in unwatched


async def test_one_tenants_drift_is_not_another_tenants(stage: Ingest) -> None:
    await watched(stage)
    v1 = await stage.register(V1, tenant=OTHER)
    await stage.allocate(1, v1, v1, tenant=OTHER)
    await stage.tasks(WINDOW, language="en")
    await stage.tasks(WINDOW, tenant=OTHER, language="fr")
    await stage.tasks(WINDOW, language="fr")
    assert (await stage.mix())["drifted"] is True
    other = await stage.mix(OTHER)
    assert (other["sampled"], other["drifted"], other["psi"]) == (WINDOW, False, None)
