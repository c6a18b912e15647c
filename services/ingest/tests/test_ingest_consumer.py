"""The stage consumer: decode, dedupe, handle, commit; poison input to the dead-letter topic.

A real stage (ingest) runs behind a `StageRunner` on a SQLite event log; records
are fed straight into `handle`, and the outbox, positions and derived state are
read back from the log.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import assay_ingest
from assay.bus import (
    DECISIONS,
    RUN_STATUS,
    RUNS,
    TASKS,
    WORKFLOWS,
    BusMessage,
    EmbeddedBus,
    EmbeddedSource,
    FileLock,
    OutboxRelay,
    dlq,
    topic_for,
)
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import StubJudge
from assay.kernel import (
    MessageId,
    Refused,
    RunState,
    TaskId,
    TenantId,
    WorkflowId,
    WorkflowVersion,
    run_id_from,
)
from assay.kernel.scores import WinRecord
from assay.messages import (
    MAX_MESSAGE_BYTES,
    MESSAGES,
    AllocationChanged,
    Envelope,
    Promoted,
    Purpose,
    Role,
    RunRef,
    RunSpawned,
    RunStatusChanged,
    TaskSubmitted,
    Versioned,
    WorkflowRegistered,
    message_id,
    open_envelope,
    seal,
)
from assay.record import EventRegistry, LogRecord, StateDelta, StateKey
from assay.runtime import StageDeps, StageRunner, StageSpec, UnitOfWork, decode, stage_log
from assay.store import FsBlobStore, OutboxEntry, SqliteEventLog
from assay.workflow import WorkflowDef, from_document

TENANT = TenantId(uuid.UUID("00000000-0000-4000-8000-000000000001"))
OTHER = TenantId(uuid.UUID("00000000-0000-4000-8000-000000000002"))
STAGE_DLQ = dlq("ingest")

ARITH: dict[str, Any] = {
    "id": "arith",
    "steps": [
        {"id": "solve", "kind": "model", "prompt": "What is {{ task.question }}?"},
        {"id": "answer", "kind": "tool", "tool": "extract_number", "args": {"text": "x"}},
    ],
    "verifiers": [
        {"id": "correct", "kind": "exact", "step": "answer", "expected": "{{ task.answer }}"}
    ],
}


def arith(**changes: Any) -> dict[str, Any]:
    """The test workflow document with top-level fields replaced."""
    return {**ARITH, **changes}


def ir(doc: dict[str, Any]) -> WorkflowDef:
    return from_document(doc)


def envelope_bytes(
    topic: str,
    msg: Versioned,
    *,
    tenant: TenantId = TENANT,
    mid: str | None = None,
) -> bytes:
    """A message as a producer would write it: canonical JSON of its envelope."""
    ident = (
        MessageId(mid)
        if mid
        else message_id("test", topic, json.dumps(msg.model_dump(mode="json")))
    )
    env = seal(
        msg,
        tenant=tenant,
        key=topic_for(topic, msg).key(msg),
        id=ident,
        causation=None,
    )
    return env.encode()


def raw_envelope(type_: str, version: int, payload: dict[str, Any]) -> bytes:
    """An envelope with any type and schema version (things this code cannot read)."""
    env = Envelope(
        id=message_id("raw", type_, str(version)),
        type=type_,
        schema_version=version,
        tenant=TENANT,
        key=f"{TENANT}:raw",
        occurred_at=datetime(2024, 1, 1, tzinfo=UTC),
        correlation_id="raw",
        traceparent="00-" + "0" * 31 + "1-" + "0" * 15 + "1-01",
        payload=payload,
    )
    return env.encode()


def task(key: str = "t-1", workflow: str = "arith", **fields: Any) -> TaskSubmitted:
    return TaskSubmitted(
        tenant=fields.pop("tenant", TENANT),
        workflow_id=WorkflowId(workflow),
        idempotency_key=key,
        input=fields.pop("input", {"question": "2 + 3", "answer": "5"}),
        **fields,
    )


def allocation(wf: WorkflowDef, generation: int = 1) -> AllocationChanged:
    """What decide publishes for the first registered version."""
    return AllocationChanged(
        tenant=TENANT,
        workflow_id=wf.id,
        generation=generation,
        current=wf.version,
        definitions={wf.version: wf.model_dump(mode="json", by_alias=True)},
    )


def decoded(entry: OutboxEntry) -> tuple[Envelope, object]:
    env = open_envelope(entry.value)
    return env, MESSAGES.decode(env.type, env.schema_version, env.payload)


@dataclass
class Harness:
    """A stage runner over its own log, an embedded bus and a relay, in one directory."""

    runner: StageRunner
    log: SqliteEventLog
    bus: EmbeddedBus
    relay: OutboxRelay
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)

    async def feed(
        self,
        topic: str,
        value: bytes,
        *,
        key: str = "k",
        partition: int = 0,
        offset: int | None = None,
        headers: tuple[tuple[str, bytes], ...] = (),
    ) -> BusMessage:
        """Deliver one record to the runner, at the partition's next offset unless given."""
        if offset is None:
            offset = self.offsets.get((topic, partition), 0)
        self.offsets[(topic, partition)] = max(self.offsets.get((topic, partition), 0), offset + 1)
        m = BusMessage(topic, partition, offset, key, value, headers)
        await self.runner.handle(m)
        return m

    async def send(self, topic: str, msg: Versioned, **kw: Any) -> BusMessage:
        return await self.feed(topic, envelope_bytes(topic, msg, **kw))

    async def take(self) -> list[OutboxEntry]:
        """Committed outbox rows since the last call (marked shipped, as the relay does)."""
        rows = await self.log.drain_outbox(10_000)
        await self.log.ack_outbox([r.seq for r in rows])
        return [r.entry for r in rows]

    async def position(self, topic: str, partition: int = 0) -> int | None:
        return (await self.log.positions()).get((topic, partition))

    async def register(self, doc: dict[str, Any], *, rewrite: bool = False) -> WorkflowDef:
        wf = ir(doc)
        await self.send(
            WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=doc, rewrite=rewrite)
        )
        return wf

    async def ready(self, doc: dict[str, Any] = ARITH) -> WorkflowDef:
        """Register a workflow and route tasks to it, as decide would; clear the outbox."""
        wf = await self.register(doc)
        await self.send(DECISIONS, allocation(wf))
        assert await self.take() == []
        return wf


async def open_harness(tmp_path: Path, spec: StageSpec) -> Harness:
    log = await stage_log(tmp_path, spec).open()
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=4).open()
    blobs = FsBlobStore(tmp_path / "blobs")
    relay = OutboxRelay(spec.name, log, bus, FileLock(tmp_path / f"{spec.name}.relay.lock"))
    return Harness(StageRunner(spec, log, blobs, relay, EmbeddedSource(bus)), log, bus, relay)


def ingest_spec(tmp_path: Path) -> StageSpec:
    deps = StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
    )
    return assay_ingest.create_stage(deps)


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await open_harness(tmp_path, ingest_spec(tmp_path))
    try:
        yield harness
    finally:
        await harness.log.close()
        await harness.bus.close()


async def assert_dead_lettered(h: Harness, m: BusMessage, *needles: str) -> str:
    """One dead letter of `m` with the original key and bytes; the position moved past it."""
    out = await h.take()
    assert len(out) == 1, out
    entry = out[0]
    assert entry.topic == STAGE_DLQ
    assert entry.key == m.key
    assert entry.value == m.value
    headers = dict(entry.headers)
    assert headers["assay-dlq-stage"] == b"ingest"
    assert headers["assay-dlq-source"] == f"{m.topic}/{m.partition}/{m.offset}".encode()
    reason = headers["assay-dlq-reason"].decode()
    for needle in needles:
        assert needle in reason, reason
    for k, v in m.headers:
        assert (k, v) in entry.headers
    assert await h.position(m.topic, m.partition) == m.offset + 1
    return reason


# -- poison input -------------------------------------------------------------------------


async def test_not_json_is_dead_lettered_with_original_bytes_and_headers(h: Harness) -> None:
    m = await h.feed(
        WORKFLOWS, b"\x00{definitely not json", key="k-1", headers=(("x-producer", b"p1"),)
    )
    await assert_dead_lettered(h, m, "not JSON")
    assert h.runner.dead_lettered == 1
    assert h.runner.handled == 0


async def test_json_that_is_not_an_envelope_is_dead_lettered(h: Harness) -> None:
    m = await h.feed(WORKFLOWS, b'{"hello": "world"}')
    await assert_dead_lettered(h, m, "not an envelope")


async def test_garbage_on_the_tasks_topic_is_neither_envelope_nor_task(h: Harness) -> None:
    m = await h.feed(TASKS, b"\xff\xfe\x00garbage")
    await assert_dead_lettered(h, m, "not JSON")
    m = await h.feed(TASKS, b'{"workflow_id": "arith"}')
    await assert_dead_lettered(h, m, "neither an envelope nor a TaskSubmitted")
    assert await h.position(TASKS) == 2


async def test_oversized_envelope_is_dead_lettered(h: Harness) -> None:
    big = WorkflowRegistered(tenant=TENANT, definition=arith(description="x" * MAX_MESSAGE_BYTES))
    value = envelope_bytes(WORKFLOWS, big)
    assert len(value) > MAX_MESSAGE_BYTES
    m = await h.feed(WORKFLOWS, value)
    await assert_dead_lettered(h, m, "exceeds", str(MAX_MESSAGE_BYTES))
    assert await h.log.get(StateKey(TENANT, "workflow", "arith")) is None


async def test_oversized_task_is_dead_lettered_in_either_form(h: Harness) -> None:
    await h.ready()
    huge = task("huge", input={"question": "1 + 1", "answer": "2", "pad": "x" * MAX_MESSAGE_BYTES})
    for value in (
        envelope_bytes(TASKS, huge),
        json.dumps(huge.model_dump(mode="json")).encode(),  # a bare task, as any producer writes
    ):
        assert len(value) > MAX_MESSAGE_BYTES
        m = await h.feed(TASKS, value)
        await assert_dead_lettered(h, m, "exceeds")
    assert await h.log.get(StateKey(TENANT, "task", "huge")) is None


async def test_unknown_message_type_is_dead_lettered(h: Harness) -> None:
    m = await h.feed(WORKFLOWS, raw_envelope("WorkflowDeleted", 1, {"id": "arith"}))
    await assert_dead_lettered(h, m, "unknown type 'WorkflowDeleted'")


async def test_unknown_schema_version_is_dead_lettered(h: Harness) -> None:
    payload = WorkflowRegistered(tenant=TENANT, definition=ARITH).model_dump(mode="json")
    m = await h.feed(WORKFLOWS, raw_envelope("WorkflowRegistered", 99, payload))
    await assert_dead_lettered(h, m, "schema version 99")
    assert await h.log.get(StateKey(TENANT, "workflow", "arith")) is None


async def test_payload_that_does_not_validate_is_dead_lettered(h: Harness) -> None:
    m = await h.feed(TASKS, raw_envelope("TaskSubmitted", 1, {"tenant": str(TENANT)}))
    await assert_dead_lettered(h, m, "TaskSubmitted", "workflow_id")


async def test_task_for_unknown_workflow_is_refused(h: Harness) -> None:
    m = await h.send(TASKS, task(workflow="nope"))
    await assert_dead_lettered(h, m, "unknown workflow 'nope'")
    assert await h.log.get(StateKey(TENANT, "task", "t-1")) is None
    assert not await h.log.seen(TENANT, open_envelope(m.value).id)


async def test_task_whose_payload_tenant_differs_from_the_envelope_is_refused(
    h: Harness,
) -> None:
    await h.ready()
    m = await h.send(TASKS, task(tenant=OTHER))
    reason = await assert_dead_lettered(h, m, "differs")
    assert str(OTHER) in reason
    assert await h.log.get(StateKey(TENANT, "task", "t-1")) is None
    assert await h.log.get(StateKey(OTHER, "task", "t-1")) is None


async def test_workflow_whose_payload_tenant_differs_from_the_envelope_is_refused(
    h: Harness,
) -> None:
    m = await h.send(WORKFLOWS, WorkflowRegistered(tenant=OTHER, definition=ARITH))
    await assert_dead_lettered(h, m, str(OTHER))
    assert await h.log.get(StateKey(TENANT, "workflow", "arith")) is None
    assert await h.log.get(StateKey(OTHER, "workflow", "arith")) is None


async def test_invalid_workflow_definition_is_dead_lettered_with_the_check(h: Harness) -> None:
    dupes = arith(
        steps=[
            {"id": "solve", "kind": "model", "prompt": "a"},
            {"id": "solve", "kind": "model", "prompt": "b"},
        ],
        verifiers=[],
    )
    m = await h.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=dupes))
    await assert_dead_lettered(h, m, "invalid workflow", "duplicate step ids ['solve']")
    unknown_tool = arith(steps=[{"id": "s", "kind": "tool", "tool": "rm_rf"}], verifiers=[])
    m = await h.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=unknown_tool))
    await assert_dead_lettered(h, m, "invalid workflow", "unknown tool 'rm_rf'")
    not_ir = {"id": "arith", "steps": []}
    m = await h.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=not_ir))
    await assert_dead_lettered(h, m, "invalid workflow", "steps")
    assert await h.log.scan(TENANT, "definition") == []


async def test_version_bump_retaining_no_step_id_needs_rewrite(h: Harness) -> None:
    v1 = await h.register(ARITH)
    assert await h.take() == []
    renumbered = arith(
        steps=[{"id": "s1", "kind": "model", "prompt": "What is {{ task.question }}?"}],
        verifiers=[{"id": "correct", "kind": "exact", "expected": "{{ task.answer }}"}],
    )
    m = await h.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=renumbered))
    await assert_dead_lettered(h, m, "retains none", "rewrite")
    assert await h.log.get(StateKey(TENANT, "workflow", "arith")) == {"latest": v1.version}

    v2 = await h.register(renumbered, rewrite=True)
    assert await h.take() == []
    assert await h.log.get(StateKey(TENANT, "workflow", "arith")) == {"latest": v2.version}
    stored = await h.log.get(StateKey(TENANT, "definition", v2.version))
    assert stored is not None
    assert stored["parent"] == v1.version


async def test_version_bump_that_retains_a_step_joins_the_dag(h: Harness) -> None:
    v1 = await h.register(ARITH)
    changed = arith(
        steps=[
            {"id": "solve", "kind": "model", "prompt": "Step by step: {{ task.question }}?"},
            {"id": "answer", "kind": "tool", "tool": "extract_number", "args": {"text": "x"}},
        ]
    )
    v2 = await h.register(changed)
    assert await h.take() == []
    stored = await h.log.get(StateKey(TENANT, "definition", v2.version))
    assert stored is not None
    assert stored["parent"] == v1.version
    # registering v1 again is idempotent: latest stays v2
    await h.register(ARITH)
    assert await h.log.get(StateKey(TENANT, "workflow", "arith")) == {"latest": v2.version}


async def test_handler_that_keeps_failing_is_dead_lettered_after_three_attempts(
    tmp_path: Path,
) -> None:
    calls: list[str] = []

    async def explode(msg: TaskSubmitted, uow: UnitOfWork[Any]) -> None:
        calls.append(msg.idempotency_key)
        raise RuntimeError("the database fell over")

    spec = StageSpec(
        name="flaky",
        events=EventRegistry([]),
        fold=_no_fold,
        handlers={TASKS: {TaskSubmitted.type: explode}},
    )
    h = await open_harness(tmp_path, spec)
    try:
        m = await h.send(TASKS, task())
        out = await h.take()
        assert calls == ["t-1"] * 3
        assert [e.topic for e in out] == [dlq("flaky")]
        assert out[0].value == m.value
        reason = dict(out[0].headers)["assay-dlq-reason"].decode()
        assert reason.startswith("handler failed 3 times")
        assert "RuntimeError: the database fell over" in reason
        assert await h.position(TASKS) == 1
        assert not await h.log.seen(TENANT, open_envelope(m.value).id)
    finally:
        await h.log.close()
        await h.bus.close()


async def test_handler_that_fails_then_succeeds_commits_once(tmp_path: Path) -> None:
    attempts: list[int] = []

    async def wobbly(msg: TaskSubmitted, uow: UnitOfWork[Any]) -> None:
        attempts.append(1)
        spawned = _status(msg)
        uow.emit(RUN_STATUS, spawned)  # written on every attempt, kept only on the last
        if len(attempts) < 3:
            raise RuntimeError("transient")  # a lost connection is an outage: redelivered

    spec = StageSpec(
        name="wobbly",
        events=EventRegistry([]),
        fold=_no_fold,
        handlers={TASKS: {TaskSubmitted.type: wobbly}},
    )
    h = await open_harness(tmp_path, spec)
    try:
        m = await h.send(TASKS, task())
        out = await h.take()
        assert len(attempts) == 3
        assert [e.topic for e in out] == [RUN_STATUS]
        assert h.runner.handled == 1
        assert h.runner.dead_lettered == 0
        assert await h.log.seen(TENANT, open_envelope(m.value).id)
    finally:
        await h.log.close()
        await h.bus.close()


def _no_fold(record: LogRecord) -> list[StateDelta]:
    return []


def _status(msg: TaskSubmitted) -> RunStatusChanged:
    ref = RunRef(
        tenant=msg.tenant,
        run_id=run_id_from(0, msg.idempotency_key),
        task_id=TaskId("t"),
        idempotency_key=msg.idempotency_key,
        workflow_id=msg.workflow_id,
        workflow_version=WorkflowVersion("v"),
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunStatusChanged(run=ref, state=RunState.SCHEDULED)


async def test_refused_handler_discards_its_pending_writes(tmp_path: Path) -> None:
    async def half_then_refuse(msg: TaskSubmitted, uow: UnitOfWork[Any]) -> None:
        uow.emit(RUN_STATUS, _status(msg))
        raise Refused("not today")

    spec = StageSpec(
        name="picky",
        events=EventRegistry([]),
        fold=_no_fold,
        handlers={TASKS: {TaskSubmitted.type: half_then_refuse}},
    )
    h = await open_harness(tmp_path, spec)
    try:
        await h.send(TASKS, task())
        out = await h.take()
        assert [e.topic for e in out] == [dlq("picky")]
        assert dict(out[0].headers)["assay-dlq-reason"] == b"not today"
    finally:
        await h.log.close()
        await h.bus.close()


async def test_dead_letter_is_relayed_onto_the_stage_dlq_topic(h: Harness) -> None:
    m = await h.feed(WORKFLOWS, b"nope", key=f"{TENANT}:arith")
    assert await h.relay.ship_once() == 1
    ends = await h.bus.end_offsets(STAGE_DLQ)
    (part,) = [p for p, end in ends.items() if end == 1]
    (shipped,) = await h.bus.fetch(STAGE_DLQ, part, 0, 10, 0.0)
    assert shipped.value == b"nope"
    assert shipped.key == m.key
    assert dict(shipped.headers)["assay-dlq-reason"].startswith(b"not JSON")
    assert await h.log.drain_outbox(10) == []


# -- the happy path -----------------------------------------------------------------------


async def test_registered_workflow_and_allocation_route_a_task_to_a_run(h: Harness) -> None:
    wf = await h.register(ARITH)
    stored = await h.log.get(StateKey(TENANT, "definition", wf.version))
    assert stored is not None
    assert stored["workflow_id"] == "arith"
    assert stored["parent"] is None
    await h.send(DECISIONS, allocation(wf))
    applied = await h.log.get(StateKey(TENANT, "allocation", "arith"))
    assert applied is not None
    assert applied["generation"] == 1
    assert await h.take() == []

    m = await h.send(TASKS, task("t-1"))
    out = await h.take()
    assert [e.topic for e in out] == [RUNS, RUN_STATUS]
    env, spawned = decoded(out[0])
    assert isinstance(spawned, RunSpawned)
    assert env.tenant == TENANT
    assert env.causation_id == open_envelope(m.value).id
    assert spawned.run.workflow_version == wf.version
    assert spawned.run.role is Role.CURRENT
    assert spawned.run.purpose is Purpose.WORK
    assert spawned.run.idempotency_key == "t-1"
    assert spawned.input == {"question": "2 + 3", "answer": "5"}
    assert out[0].key == f"{TENANT}:{spawned.run.run_id}"
    _, status = decoded(out[1])
    assert isinstance(status, RunStatusChanged)
    assert status.state is RunState.SCHEDULED
    assert status.run == spawned.run

    doc = await h.log.get(StateKey(TENANT, "task", "t-1"))
    assert doc is not None
    assert doc["task_id"] == spawned.run.task_id
    assert doc["generation"] == 1
    assert [r["run_id"] for r in doc["runs"]] == [spawned.run.run_id]
    assert await h.position(TASKS) == 1
    assert h.runner.handled == 3
    assert h.runner.dead_lettered == 0


async def test_same_message_delivered_twice_is_handled_once(h: Harness) -> None:
    await h.ready()
    value = envelope_bytes(TASKS, task("t-1"))
    await h.feed(TASKS, value)
    assert len(await h.take()) == 2
    await h.feed(TASKS, value)  # a relay re-publish after a crash: a new offset, the same id
    assert await h.take() == []
    assert await h.position(TASKS) == 2
    await h.feed(TASKS, value, offset=1)  # a redelivery of the same offset
    assert await h.take() == []
    assert await h.position(TASKS) == 2
    assert (h.runner.handled, h.runner.duplicates) == (3, 2)  # registration, allocation, task


async def test_concurrent_redelivery_spawns_once(h: Harness) -> None:
    await h.ready()
    m = BusMessage(TASKS, 0, 0, "k", envelope_bytes(TASKS, task("t-1")), ())
    await asyncio.gather(h.runner.handle(m), h.runner.handle(m))
    out = await h.take()
    assert [e.topic for e in out] == [RUNS, RUN_STATUS]
    assert await h.position(TASKS) == 1


async def test_same_idempotency_key_under_another_message_id_spawns_nothing(h: Harness) -> None:
    await h.ready()
    await h.send(TASKS, task("t-1"), mid="first")
    first = await h.take()
    assert len(first) == 2
    before = await h.log.get(StateKey(TENANT, "task", "t-1"))
    await h.send(TASKS, task("t-1", input={"question": "9 * 9", "answer": "81"}), mid="second")
    assert await h.take() == []
    assert await h.log.get(StateKey(TENANT, "task", "t-1")) == before
    assert await h.position(TASKS) == 2
    assert await h.log.seen(TENANT, MessageId("second"))


async def test_idempotency_keys_are_per_tenant(h: Harness) -> None:
    await h.ready()
    await h.send(TASKS, task("t-1"))
    assert len(await h.take()) == 2
    m = await h.send(TASKS, task("t-1", tenant=OTHER), tenant=OTHER)
    # the other tenant has no allocation of its own: its task is refused, not deduplicated
    await assert_dead_lettered(h, m, "unknown workflow 'arith'", str(OTHER))


async def test_bare_task_json_is_accepted(h: Harness) -> None:
    await h.ready()
    t = task("bare-1")
    value = json.dumps(t.model_dump(mode="json")).encode()
    m = await h.feed(TASKS, value, key=f"{TENANT}:bare-1")
    out = await h.take()
    assert [e.topic for e in out] == [RUNS, RUN_STATUS]
    env, spawned = decoded(out[0])
    assert isinstance(spawned, RunSpawned)
    assert env.tenant == TENANT
    assert spawned.run.idempotency_key == "bare-1"
    assert await h.log.get(StateKey(TENANT, "task", "bare-1")) is not None
    # the same bare task again is the same message: deduplicated by the inbox
    await h.feed(TASKS, m.value, key=m.key)
    assert await h.take() == []
    assert await h.position(TASKS) == 2


async def test_bare_task_is_only_accepted_on_the_tasks_topic(h: Harness) -> None:
    value = json.dumps(task().model_dump(mode="json")).encode()
    m = await h.feed(WORKFLOWS, value)
    await assert_dead_lettered(h, m, "not an envelope")


async def test_producer_task_key_decides_the_task_id(h: Harness) -> None:
    await h.ready()
    await h.send(TASKS, task("a", task_key="shared"))
    await h.send(TASKS, task("b", task_key="shared", input={"question": "1 + 1", "answer": "2"}))
    await h.send(TASKS, task("c"))
    docs = dict(await h.log.scan(TENANT, "task"))
    assert docs["a"]["task_id"] == docs["b"]["task_id"] != docs["c"]["task_id"]


async def test_type_without_a_handler_is_skipped_without_a_dead_letter(h: Harness) -> None:
    wf = ir(ARITH)
    promoted = Promoted(
        tenant=TENANT,
        workflow_id=wf.id,
        workflow_version=wf.version,
        previous=WorkflowVersion("0" * 64),
        record=WinRecord(judge_wins=9),
        llr=3.0,
    )
    m = await h.send(DECISIONS, promoted)
    assert await h.take() == []
    assert await h.position(DECISIONS) == 1
    assert h.runner.dead_lettered == 0
    assert h.runner.handled == 0
    assert not await h.log.seen(TENANT, open_envelope(m.value).id)


async def test_allocation_generations_only_move_forward(h: Harness) -> None:
    wf = await h.register(ARITH)
    await h.send(DECISIONS, allocation(wf, generation=2))
    await h.send(DECISIONS, allocation(wf, generation=1), mid="late")
    applied = await h.log.get(StateKey(TENANT, "allocation", "arith"))
    assert applied is not None
    assert applied["generation"] == 2


async def test_positions_are_kept_per_topic_and_partition(h: Harness) -> None:
    await h.feed(WORKFLOWS, b"x", partition=2, offset=41)
    await h.feed(TASKS, b"y", partition=3, offset=7)
    assert await h.log.positions() == {(WORKFLOWS, 2): 42, (TASKS, 3): 8}
    assert len(await h.take()) == 2


async def test_deeply_nested_json_on_the_task_topic_is_dead_lettered() -> None:
    """A bare-task fallback must not crash on input that nests past the recursion limit."""
    value = b"[" * 100_000
    with pytest.raises(Refused):
        decode(BusMessage("assay.tasks", 0, 0, "k", value, ()))


# -- sub-workflows: cycles refused at load, `latest` pinned at spawn (§4.4) ---------------


def caller(child_version: str = "latest", wf_id: str = "outer") -> dict[str, Any]:
    return {
        "id": wf_id,
        "steps": [
            {
                "id": "call",
                "kind": "subworkflow",
                "workflow": "inner",
                "version": child_version,
                "input": {"text": "{{ task.question }}"},
            }
        ],
    }


def inner(prompt: str = "Say {{ task.text }}") -> dict[str, Any]:
    return {"id": "inner", "steps": [{"id": "say", "kind": "model", "prompt": prompt}]}


async def test_a_spawned_run_carries_its_subworkflows_pinned_at_spawn(h: Harness) -> None:
    first = await h.register(inner())
    await h.ready(caller())
    await h.send(TASKS, task("t-sub", workflow="outer"))
    (spawned,) = [m for _, m in map(decoded, await h.take()) if isinstance(m, RunSpawned)]
    assert ir(spawned.subworkflows["inner@latest"]).version == first.version
    # A newer inner version changes what later spawns pin, never an earlier run.
    second = await h.register(inner("Now say {{ task.text }}"))
    await h.send(TASKS, task("t-sub-2", workflow="outer"))
    (later,) = [m for _, m in map(decoded, await h.take()) if isinstance(m, RunSpawned)]
    assert ir(later.subworkflows["inner@latest"]).version == second.version
    assert ir(spawned.subworkflows["inner@latest"]).version == first.version


async def test_a_subworkflow_cycle_is_refused_at_registration(h: Harness) -> None:
    await h.register(inner())
    outer = await h.register(caller())
    await h.take()
    # inner, version 2, calls outer: outer -> inner@latest -> outer@... is a cycle.
    cyclic = {
        "id": "inner",
        "steps": [
            {"id": "say", "kind": "model", "prompt": "x"},
            {"id": "back", "kind": "subworkflow", "workflow": "outer", "version": outer.version},
        ],
    }
    m = await h.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=cyclic))
    reason = await assert_dead_lettered(h, m, "cycle")
    assert "outer" in reason


async def test_a_call_of_an_unregistered_workflow_is_refused_at_registration(h: Harness) -> None:
    m = await h.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=caller()))
    await assert_dead_lettered(h, m, "inner")
