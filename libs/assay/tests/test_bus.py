"""The bus (DESIGN §3–§5, §9.2, §9.3): partitioner, embedded transport, relay, envelope, topics."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from assay.bus import (
    AGGREGATES,
    DECISIONS,
    EPISODES,
    GRADED,
    RESULTS,
    RUN_COMMANDS,
    RUN_STATUS,
    RUNS,
    TASKS,
    TENANTS,
    TOPICS,
    USAGE,
    VERIFIED,
    WORKFLOWS,
    BusMessage,
    EmbeddedBus,
    FileLock,
    OutboxRelay,
    UnknownTopic,
    all_topics,
    dlq,
    murmur2,
    partition_for,
    topic_for,
)
from assay.kernel.canonical import canonical_bytes, digest
from assay.kernel.errors import Refused
from assay.kernel.ids import (
    RunId,
    StepId,
    TaskId,
    TenantId,
    WorkflowId,
    WorkflowVersion,
    tenant_id,
)
from assay.kernel.lifecycle import RunState
from assay.kernel.schema import Versioned
from assay.kernel.scores import Ungraded, UngradedReason, WinRecord
from assay.messages import (
    MAX_MESSAGE_BYTES,
    MESSAGES,
    AcknowledgeDrift,
    AllocationChanged,
    AttemptIndeterminate,
    BranchChild,
    BranchRun,
    CalibrationDue,
    CancelGrading,
    CancelRollout,
    CancelRun,
    ChallengerRejected,
    Envelope,
    EpisodeReduced,
    GradingCancelled,
    GroupDue,
    JudgeCalibrated,
    Promoted,
    ProposalRequested,
    Purpose,
    ReviewProposal,
    RewindRun,
    Role,
    RolledBack,
    RolloutClosed,
    RolloutProgress,
    RolloutResult,
    RolloutSpec,
    RunExecuted,
    Rung,
    RunGraded,
    RunRef,
    RunResult,
    RunSpawned,
    RunStatusChanged,
    RunVerified,
    SelectionRecord,
    SignalRun,
    TaskMixDrifted,
    TaskMixRebased,
    TaskSubmitted,
    TenantDeleted,
    TenantStageDeleted,
    ToolUnavailableDelta,
    Usage,
    UsageRecorded,
    VariantAggregate,
    WorkflowRegistered,
    message_id,
    open_envelope,
    seal,
)
from assay.record import EventRegistry
from assay.store import CommitBatch, OutboxEntry, PendingOutbox, SqliteEventLog

PARTITIONS = 4

# -- murmur2 ---------------------------------------------------------------------

KAFKA_MURMUR2 = [  # Kafka's UtilsTest.testMurmur2
    ("21", -973932308),
    ("foobar", -790332482),
    ("a-little-bit-long-string", -985981536),
    ("a-little-bit-longer-string", -1486304829),
    ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    ("abc", 479470107),
]


@pytest.mark.parametrize(("text", "expected"), KAFKA_MURMUR2)
def test_murmur2_matches_kafka(text: str, expected: int) -> None:
    assert murmur2(text.encode()) == expected


def test_partition_for_is_positive_murmur2_modulo() -> None:
    assert partition_for(b"foobar", 10) == 6
    for text, h in KAFKA_MURMUR2:
        for n in (1, 3, 12, 64):
            assert partition_for(text.encode(), n) == (h & 0x7FFFFFFF) % n
    with pytest.raises(ValueError, match="at least one partition"):
        partition_for(b"k", 0)


# -- EmbeddedBus -----------------------------------------------------------------


@pytest.fixture
def topic() -> str:
    return f"test.{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def bus(tmp_path: Path) -> AsyncIterator[EmbeddedBus]:
    b = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=PARTITIONS).open()
    yield b
    await b.close()


def key_on(partition: int, n: int = PARTITIONS, prefix: str = "k") -> str:
    """A key that murmur2 sends to `partition` of `n`."""
    return next(
        f"{prefix}{i}"
        for i in range(10_000)
        if partition_for(f"{prefix}{i}".encode(), n) == partition
    )


async def everything(bus: EmbeddedBus, topic: str) -> dict[int, list[BusMessage]]:
    ends = await bus.end_offsets(topic)
    return {p: await bus.fetch(topic, p, 0, 100_000, 0) if end else [] for p, end in ends.items()}


async def test_embedded_bus_orders_each_partition_with_offsets_from_zero(
    bus: EmbeddedBus, topic: str
) -> None:
    keys = [f"tenant:run-{i}" for i in range(6)]
    sent: dict[str, list[bytes]] = {k: [] for k in keys}
    for round_ in range(5):
        entries = [
            OutboxEntry(topic, k, f"{k}#{round_}".encode(), (("r", b"%d" % round_),)) for k in keys
        ]
        await bus.publish(entries)
        for e in entries:
            sent[e.key].append(e.value)
    await bus.publish([])

    got = await everything(bus, topic)
    assert sum(len(ms) for ms in got.values()) == 30
    for p, messages in got.items():
        assert [m.offset for m in messages] == list(range(len(messages)))
        assert all(m.topic == topic and m.partition == p for m in messages)
    for k in keys:
        home = partition_for(k.encode(), PARTITIONS)
        assert [m.value for m in got[home] if m.key == k] == sent[k]
        assert all(m.key != k for p, ms in got.items() if p != home for m in ms)
    assert await bus.end_offsets(topic) == {p: len(got[p]) for p in range(PARTITIONS)}
    assert await bus.end_offsets("never.used") == dict.fromkeys(range(PARTITIONS), 0)


async def test_fetch_from_an_offset_respects_the_limit(bus: EmbeddedBus, topic: str) -> None:
    key = key_on(2)
    await bus.publish([OutboxEntry(topic, key, b"%d" % i) for i in range(10)])
    page = await bus.fetch(topic, 2, 4, 3, 0)
    assert [(m.offset, m.value) for m in page] == [(4, b"4"), (5, b"5"), (6, b"6")]
    assert [m.offset for m in await bus.fetch(topic, 2, 9, 100, 0)] == [9]


async def test_fetch_waits_for_the_timeout_and_wakes_on_publish(
    bus: EmbeddedBus, topic: str
) -> None:
    started = time.monotonic()
    assert await bus.fetch(topic, 1, 0, 10, 0.1) == []
    assert time.monotonic() - started >= 0.09

    waiting = asyncio.create_task(bus.fetch(topic, 1, 0, 10, 10.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    started = time.monotonic()
    await bus.publish([OutboxEntry(topic, key_on(1), b"hello")])
    [message] = await asyncio.wait_for(waiting, 5.0)
    assert time.monotonic() - started < 2.0
    assert (message.offset, message.value) == (0, b"hello")
    # Past the end it waits again; a publish to another partition brings it nothing.
    tail = asyncio.create_task(bus.fetch(topic, 1, 1, 10, 0.2))
    await bus.publish([OutboxEntry(topic, key_on(3), b"other partition")])
    assert await tail == []


async def test_records_survive_close_and_reopen_and_offsets_continue(
    tmp_path: Path, topic: str
) -> None:
    path = tmp_path / "bus.sqlite"
    key = key_on(0)
    headers = (("bin", bytes(range(256))), ("id", b"x"))
    first = await EmbeddedBus(path, PARTITIONS).open()
    await first.publish([OutboxEntry(topic, key, b"a", headers), OutboxEntry(topic, key, b"b")])
    await first.close()

    second = await EmbeddedBus(path, PARTITIONS).open()
    try:
        assert (await second.end_offsets(topic))[0] == 2
        await second.publish([OutboxEntry(topic, key, b"c")])
        messages = await second.fetch(topic, 0, 0, 10, 0)
        assert [(m.offset, m.value) for m in messages] == [(0, b"a"), (1, b"b"), (2, b"c")]
        assert messages[0].headers == headers
    finally:
        await second.close()


# -- OutboxRelay -----------------------------------------------------------------


@pytest.fixture
async def stage_log(tmp_path: Path) -> AsyncIterator[SqliteEventLog]:
    log = await SqliteEventLog(tmp_path / "stage.sqlite", EventRegistry(), lambda _r: []).open()
    yield log
    await log.close()


class FlakyTransport:
    """A real in-process transport in front of the embedded bus that can be taken down."""

    def __init__(self, bus: EmbeddedBus) -> None:
        self.partitions = bus.partitions
        self.bus = bus
        self.down = True
        self.refused = 0

    async def publish(self, entries: list[OutboxEntry]) -> None:
        if self.down:
            self.refused += 1
            raise ConnectionError("broker unreachable")
        await self.bus.publish(entries)

    async def fetch(
        self, topic: str, partition: int, offset: int, limit: int, timeout_s: float
    ) -> list[BusMessage]:
        return await self.bus.fetch(topic, partition, offset, limit, timeout_s)

    async def end_offsets(self, topic: str) -> dict[int, int]:
        return await self.bus.end_offsets(topic)

    async def close(self) -> None:
        await self.bus.close()


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def rows(topic: str, keys: list[str], start: int, n: int) -> list[OutboxEntry]:
    """`n` rows spread over `keys`, values numbered from `start` (commit order)."""
    return [
        OutboxEntry(topic, keys[i % len(keys)], b"%d" % i, (("seq", b"%d" % i),))
        for i in range(start, start + n)
    ]


def per_key(messages: list[BusMessage] | list[OutboxEntry]) -> dict[str, list[bytes]]:
    """Values by key, in order: the only order the bus promises (§9.2)."""
    out: dict[str, list[bytes]] = {}
    for m in messages:
        out.setdefault(m.key, []).append(m.value)
    return out


async def published(bus: EmbeddedBus, topic: str) -> int:
    return sum((await bus.end_offsets(topic)).values())


def has_published(bus: EmbeddedBus, topic: str, n: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await published(bus, topic) == n

    return check


async def test_relay_ships_committed_rows_in_commit_order_and_empties_the_outbox(
    stage_log: SqliteEventLog, bus: EmbeddedBus, topic: str, tmp_path: Path
) -> None:
    keys = ["t:run-a", "t:run-b", "t:run-c"]
    sent = rows(topic, keys, 0, 12)
    for chunk in (sent[:5], sent[5:6], sent[6:]):
        await stage_log.commit(CommitBatch(outbox=chunk))

    lock_path = tmp_path / "stage.relay.lock"
    relay = OutboxRelay("stage", stage_log, bus, FileLock(lock_path), batch=4, poll_s=0.01)
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    await eventually(has_published(bus, topic, 12))

    more = rows(topic, keys, 12, 5)
    await stage_log.commit(CommitBatch(outbox=more))
    relay.wake.set()
    await eventually(has_published(bus, topic, 17))
    stop.set()
    await asyncio.wait_for(running, 5.0)

    assert await stage_log.drain_outbox(100) == []
    assert relay.shipped == 17
    got = await everything(bus, topic)
    assert per_key([m for ms in got.values() for m in ms]) == per_key(sent + more)
    assert all(m.headers == (("seq", m.value),) for ms in got.values() for m in ms)
    other = FileLock(lock_path)  # the leader let go of the lock when it stopped
    assert other.try_acquire()
    other.release()


class CommitDuringEmptyDrain(SqliteEventLog):
    """A stage log whose first empty outbox read sees a commit land (and wake the relay)
    while the read is in flight, as a commit on another task can."""

    relay: OutboxRelay | None = None
    late: tuple[OutboxEntry, ...] = ()

    async def drain_outbox(self, limit: int) -> list[PendingOutbox]:
        rows = await super().drain_outbox(limit)
        if not rows and self.late and self.relay is not None:
            late, self.late = self.late, ()
            await self.commit(CommitBatch(outbox=list(late)))
            self.relay.wake.set()
        return rows


async def test_a_wake_during_an_empty_outbox_read_is_not_lost(
    tmp_path: Path, bus: EmbeddedBus, topic: str
) -> None:
    log_ = CommitDuringEmptyDrain(tmp_path / "late.sqlite", EventRegistry(), lambda _r: [])
    await log_.open()
    relay = OutboxRelay("stage", log_, bus, FileLock(tmp_path / "late.lock"), poll_s=30.0)
    log_.relay, log_.late = relay, tuple(rows(topic, ["t:run-a"], 0, 3))
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        # The poll is 30 s: only the wake set during the empty read can ship these now.
        await eventually(has_published(bus, topic, 3), timeout_s=5.0)
    finally:
        stop.set()
        relay.wake.set()
        await asyncio.wait_for(running, 5.0)
        await log_.close()


class CountingReads(SqliteEventLog):
    """A stage log counting the relay's reads of its outbox."""

    reads = 0

    async def drain_outbox(self, limit: int) -> list[PendingOutbox]:
        self.reads += 1
        return await super().drain_outbox(limit)


async def test_the_relay_reads_again_only_after_a_full_batch_or_a_wake(
    tmp_path: Path, bus: EmbeddedBus, topic: str
) -> None:
    log_ = CountingReads(tmp_path / "count.sqlite", EventRegistry(), lambda _r: [])
    await log_.open()
    await log_.commit(CommitBatch(outbox=rows(topic, ["t:run-a"], 0, 5)))
    relay = OutboxRelay("stage", log_, bus, FileLock(tmp_path / "c.lock"), batch=2, poll_s=30.0)
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await eventually(has_published(bus, topic, 5))
        await asyncio.sleep(0.2)
        assert log_.reads == 3  # 2 + 2 + 1: the short batch emptied what was committed
        await log_.commit(CommitBatch(outbox=rows(topic, ["t:run-a"], 5, 1)))
        relay.wake.set()
        await eventually(has_published(bus, topic, 6))
        await asyncio.sleep(0.2)
        assert log_.reads == 4
    finally:
        stop.set()
        relay.wake.set()
        await asyncio.wait_for(running, 5.0)
        await log_.close()
    assert relay.shipped == 6


async def test_relay_keeps_rows_while_the_transport_is_down_and_loses_nothing(
    stage_log: SqliteEventLog, bus: EmbeddedBus, topic: str, tmp_path: Path
) -> None:
    keys = ["t:run-a", "t:run-b"]
    before = rows(topic, keys, 0, 6)
    await stage_log.commit(CommitBatch(outbox=before[:3]))
    await stage_log.commit(CommitBatch(outbox=before[3:]))
    flaky = FlakyTransport(bus)
    relay = OutboxRelay("stage", stage_log, flaky, FileLock(tmp_path / "r.lock"), poll_s=0.01)
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))

    async def refused_thrice() -> bool:
        return flaky.refused >= 3

    await eventually(refused_thrice)
    during = rows(topic, keys, 6, 4)
    await stage_log.commit(CommitBatch(outbox=during))  # the stage keeps committing
    assert [p.entry for p in await stage_log.drain_outbox(100)] == before + during
    assert await published(bus, topic) == 0

    flaky.down = False
    await eventually(has_published(bus, topic, 10))
    stop.set()
    await asyncio.wait_for(running, 5.0)

    assert await stage_log.drain_outbox(100) == []
    got = await everything(bus, topic)
    assert per_key([m for ms in got.values() for m in ms]) == per_key(before + during)
    assert relay.shipped == 10


async def test_a_relay_that_cannot_take_the_lock_never_ships(
    stage_log: SqliteEventLog, bus: EmbeddedBus, topic: str, tmp_path: Path
) -> None:
    lock_path = tmp_path / "stage.relay.lock"
    leader = FileLock(lock_path)
    assert leader.try_acquire()
    sent = rows(topic, ["t:run-a"], 0, 3)
    await stage_log.commit(CommitBatch(outbox=sent))

    follower = OutboxRelay("stage", stage_log, bus, FileLock(lock_path), poll_s=0.01)
    stop = asyncio.Event()
    running = asyncio.create_task(follower.run(stop))
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(running, 5.0)
    assert await published(bus, topic) == 0
    assert [p.entry for p in await stage_log.drain_outbox(100)] == sent
    assert follower.shipped == 0

    leader.release()
    relay = OutboxRelay("stage", stage_log, bus, FileLock(lock_path), poll_s=0.01)
    stop = asyncio.Event()
    stop.set()  # already stopping: it still takes the free lock and drains what was committed
    await asyncio.wait_for(relay.run(stop), 5.0)
    assert await published(bus, topic) == 3
    assert await stage_log.drain_outbox(100) == []


class Revocable:
    """A `Leadership` the test grants and takes away (as a lock whose connection died)."""

    def __init__(self) -> None:
        self.granted = True
        self.released = 0

    async def try_acquire(self) -> bool:
        return self.granted

    async def release(self) -> None:
        self.released += 1


async def test_a_relay_that_loses_leadership_stops_shipping_until_it_leads_again(
    stage_log: SqliteEventLog, bus: EmbeddedBus, topic: str
) -> None:
    leadership = Revocable()
    relay = OutboxRelay("stage", stage_log, bus, leadership, poll_s=0.01)
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await stage_log.commit(CommitBatch(outbox=rows(topic, ["t:run-a"], 0, 2)))
        await eventually(has_published(bus, topic, 2))
        leadership.granted = False  # another replica leads now

        async def gave_up() -> bool:
            return leadership.released == 1

        await eventually(gave_up)
        await stage_log.commit(CommitBatch(outbox=rows(topic, ["t:run-a"], 2, 2)))
        relay.wake.set()
        await asyncio.sleep(0.2)
        assert await published(bus, topic) == 2
        leadership.granted = True
        await eventually(has_published(bus, topic, 4))  # it asks again every second
    finally:
        stop.set()
        relay.wake.set()
        await asyncio.wait_for(running, 5.0)
    assert relay.shipped == 4


def test_file_lock_excludes_a_second_holder(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "stage.lock"
    first, second = FileLock(path), FileLock(path)
    assert first.try_acquire()
    assert first.try_acquire()  # already held by this instance
    assert not second.try_acquire()
    first.release()
    assert second.try_acquire()
    assert not first.try_acquire()
    second.release()
    second.release()  # releasing twice is harmless


def test_file_lock_held_by_another_process_is_freed_when_it_dies(tmp_path: Path) -> None:
    path = tmp_path / "stage.lock"
    holder = (
        "import sys; from assay.bus import FileLock; "
        "assert FileLock(sys.argv[1]).try_acquire(); print('held', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", holder, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "held"
        mine = FileLock(path)
        assert not mine.try_acquire()
        child.kill()
        child.wait(10)
        assert mine.try_acquire()
        mine.release()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


# -- Envelope --------------------------------------------------------------------

TENANT: TenantId = tenant_id("2f1d6c3e-8a4b-4c5d-9e6f-0a1b2c3d4e5f")
RUN = RunId("01HZX3K9Q8R7S6T5V4W3X2Y1Z0")
TASK = TaskId(digest(b"task input"))
WORKFLOW = WorkflowId("wf-support")
VERSION = WorkflowVersion(digest(b"workflow ir"))


def task(idem: str = "idem-1") -> TaskSubmitted:
    return TaskSubmitted(tenant=TENANT, workflow_id=WORKFLOW, idempotency_key=idem, input={"q": 1})


def sealed(msg: TaskSubmitted, cause: Envelope | None = None) -> Envelope:
    key = f"{TENANT}:{msg.idempotency_key}"
    return seal(msg, tenant=TENANT, key=key, id=message_id("producer", key), causation=cause)


def test_envelope_round_trips_through_its_wire_body() -> None:
    msg = task()
    env = sealed(msg)
    body = env.encode()
    assert body == canonical_bytes(json.loads(body))
    opened = open_envelope(body)
    assert opened == env
    assert MESSAGES.decode(opened.type, opened.schema_version, opened.payload) == msg
    assert (opened.type, opened.schema_version, opened.tenant) == ("TaskSubmitted", 5, TENANT)


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param({"q": 1}, id="plain"),
        pytest.param({}, id="empty"),
        pytest.param({"z": [1.5, 2e-05, None], "a": {"é": '\u2028\x1f"payload":null'}}, id="odd"),
    ],
)
def test_a_body_from_the_payloads_bytes_is_the_body(payload: dict[str, Any]) -> None:
    """`encode(payload=...)` splices bytes the caller encoded once into the body; the
    bytes are those `encode()` writes (the wire and every message id depend on them)."""
    env = sealed(task()).model_copy(update={"payload": payload})
    child = sealed(task("other"), cause=env).model_copy(update={"payload": payload})
    for e in (env, child):
        assert e.encode(payload=canonical_bytes(e.payload)) == e.encode()


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"\xef\xbb\xbf" + sealed(task()).encode(), id="utf8-bom"),
        pytest.param(
            sealed(task()).encode().replace(b'"q":1', rb'"q":"\ud800"'),
            id="lone-surrogate-escape",
        ),
    ],
)
def test_open_envelope_reads_what_json_reads(body: bytes) -> None:
    """Bodies the fast parser refuses but `json.loads` reads open as they always did."""
    assert open_envelope(body) == Envelope.model_validate(json.loads(body))


def test_headers_mirror_the_envelope_fields() -> None:
    env = sealed(task())
    headers = dict(env.headers())
    assert len(headers) == len(env.headers())
    fields = env.model_dump(mode="json")
    assert set(headers) == {k for k, v in fields.items() if v is not None} - {"payload"}
    assert "causation_id" not in headers
    for name, value in headers.items():
        assert value == str(fields[name]).encode()
    assert headers["id"] == env.id.encode()
    assert headers["tenant"] == str(TENANT).encode()
    assert headers["schema_version"] == b"5"
    assert datetime.fromisoformat(headers["occurred_at"].decode()) == env.occurred_at

    child = sealed(task("other"), cause=env)
    child_headers = dict(child.headers())
    assert child_headers["causation_id"] == env.id.encode()
    assert child.correlation_id == env.correlation_id == env.id
    assert child.occurred_at == env.occurred_at
    pattern = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")
    parent_trace, child_trace = (
        pattern.fullmatch(env.traceparent),
        pattern.fullmatch(child.traceparent),
    )
    assert parent_trace is not None
    assert child_trace is not None
    assert parent_trace.group(1) == child_trace.group(1)
    assert parent_trace.group(2) != child_trace.group(2)


def envelope_doc(**changes: Any) -> bytes:
    doc = json.loads(sealed(task()).encode())
    doc.update(changes)
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"not json", id="not-json"),
        pytest.param(b"\xff\xfe\x00garbage", id="not-utf8"),
        pytest.param(b"", id="empty"),
        pytest.param(b"[1, 2]", id="json-array"),
        pytest.param(b'"just a string"', id="json-string"),
        pytest.param(b'{"id": "x", "type": "TaskSubmitted"}', id="partial-object"),
        pytest.param(envelope_doc(extra="field"), id="extra-field"),
        pytest.param(envelope_doc(tenant="not-a-uuid"), id="bad-tenant"),
        pytest.param(envelope_doc(schema_version=0), id="bad-version"),
        pytest.param(envelope_doc(payload=...), id="no-payload"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deeply-nested"),
    ],
)
def test_open_envelope_refuses_what_is_not_an_envelope(body: bytes) -> None:
    with pytest.raises(Refused):
        open_envelope(body)


def test_open_envelope_refuses_bodies_over_the_limit() -> None:
    base = sealed(task()).model_copy(update={"payload": {"pad": ""}})
    room = MAX_MESSAGE_BYTES - len(base.encode())
    at_limit = base.model_copy(update={"payload": {"pad": "x" * room}})
    assert len(at_limit.encode()) == MAX_MESSAGE_BYTES
    assert open_envelope(at_limit.encode()) == at_limit

    over = base.model_copy(update={"payload": {"pad": "x" * (room + 1)}}).encode()
    with pytest.raises(Refused, match="exceeds"):
        open_envelope(over)
    with pytest.raises(Refused, match="exceeds"):
        open_envelope(b" " * (MAX_MESSAGE_BYTES + 1))


def test_message_id_is_deterministic() -> None:
    a = message_id("execute", str(TENANT), RUN, "0", "7")
    assert a == message_id("execute", str(TENANT), RUN, "0", "7")
    assert re.fullmatch(r"[0-9a-f]{32}", a)
    assert a != message_id("execute", str(TENANT), RUN, "0", "8")
    assert message_id("ab", "c") != message_id("a", "bc")
    assert message_id("x") != message_id("x", "")


# -- topics ----------------------------------------------------------------------


def samples() -> dict[type[Versioned], tuple[Versioned, str]]:
    """One instance of every message type and the key DESIGN §4 gives it."""
    t = str(TENANT)
    ref = RunRef(
        tenant=TENANT,
        run_id=RUN,
        task_id=TASK,
        idempotency_key="idem-1",
        workflow_id=WORKFLOW,
        workflow_version=VERSION,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    usage = Usage(model_calls=1, prompt_tokens=10, completion_tokens=5)
    ungraded = Ungraded(reason=UngradedReason.NO_REFERENCE)
    by_workflow = {"tenant": TENANT, "workflow_id": WORKFLOW}
    verdict = {**by_workflow, "workflow_version": VERSION, "record": WinRecord(), "llr": 0.5}
    items: list[tuple[Versioned, str]] = [
        (task(), f"{t}:idem-1"),
        (WorkflowRegistered(tenant=TENANT, definition={"id": WORKFLOW}), f"{t}:{WORKFLOW}"),
        (RunSpawned(run=ref, definition={}, input={}), f"{t}:{RUN}"),
        (RunStatusChanged(run=ref, state=RunState.RUNNING), f"{t}:{RUN}"),
        (CancelRun(tenant=TENANT, run_id=RunId(RUN), reason="stop"), f"{t}:{RUN}"),
        (CancelGrading(run=ref, succeeded=True, usage=Usage()), f"{t}:{RUN}"),
        (
            GradingCancelled(run=ref, succeeded=True, usage=Usage(), verified=False),
            f"{t}:{TASK}",
        ),
        (
            EpisodeReduced(
                tenant=TENANT, run_id=RunId(RUN), task_id=ref.task_id, original="a", summary="b"
            ),
            f"{t}:{TASK}",
        ),
        (RewindRun(tenant=TENANT, run_id=RunId(RUN), at=2), f"{t}:{RUN}"),
        (
            BranchRun(
                tenant=TENANT,
                run_id=RunId(RUN),
                at_step=StepId("plan"),
                children=[
                    BranchChild(deltas=[ToolUnavailableDelta(kind="tool_unavailable", tool="x")])
                ],
            ),
            f"{t}:{RUN}",
        ),
        (SignalRun(tenant=TENANT, run_id=RunId(RUN), signal="approval"), f"{t}:{RUN}"),
        (
            AttemptIndeterminate(
                run=ref, step=StepId("pay"), attempt=1, tool="charge", request_id="r", reason="?"
            ),
            f"{t}:{RUN}",
        ),
        (
            RunExecuted(run=ref, episode=TASK, succeeded=True, usage=usage, cost_usd=0.00003),
            f"{t}:{RUN}",
        ),
        (
            RunVerified(run=ref, episode=TASK, passed=True, results=[], usage=usage, executed=True),
            f"{t}:{TASK}",
        ),
        (GroupDue(tenant=TENANT, task_id=TaskId(TASK), passed=True, epoch=0), f"{t}:{TASK}"),
        (
            RolloutProgress(
                tenant=TENANT,
                idempotency_key="idem-1",
                run_id=RunId(RUN),
                index=0,
                ended="verified",
                model_calls=1,
                tokens=12,
                cost_usd=0.00003,
            ),
            f"{t}:idem-1",
        ),
        (CancelRollout(tenant=TENANT, idempotency_key="idem-1"), f"{t}:idem-1"),
        (
            RolloutClosed(
                tenant=TENANT,
                task_id=TaskId(TASK),
                idempotency_key="idem-1",
                workflow_id=WorkflowId(WORKFLOW),
                workflow_version=WorkflowVersion(VERSION),
                spec=RolloutSpec(n=2),
                admitted=2,
                runs=[],
                cancelled=[],
                reason="completed",
                model_calls=0,
                peak_concurrency=0,
            ),
            f"{t}:{TASK}",
        ),
        (
            RolloutResult(
                tenant=TENANT,
                idempotency_key="idem-1",
                task_id=TaskId(TASK),
                workflow_id=WorkflowId(WORKFLOW),
                workflow_version=WorkflowVersion(VERSION),
                mode="evaluation",
                requested=2,
                admitted=0,
                siblings=[],
                passes=0,
                pass_at_k=[],
                best_of_n_passed=False,
                winner=None,
                selection=SelectionRecord(
                    policy="verifier_then_judge",
                    policy_version=1,
                    decided_by="none",
                    evidence="no sibling ran",
                    judge_calls=0,
                ),
                closed="completed",
                model_calls=0,
                peak_concurrency=0,
            ),
            f"{t}:idem-1",
        ),
        (RunGraded(run=ref, passed=True, score=ungraded), f"{t}:{VERSION}"),
        (
            RunResult(
                tenant=TENANT,
                run_id=RUN,
                task_id=TASK,
                idempotency_key="idem-1",
                workflow_id=WORKFLOW,
                workflow_version=VERSION,
                status="ungraded",
                passed=True,
                verification=[],
                score=ungraded,
                usage=usage,
                termination="succeeded",
                held_out=False,
            ),
            f"{t}:{RUN}",
        ),
        (
            VariantAggregate(
                **by_workflow,
                workflow_version=VERSION,
                baseline_version=VERSION,
                record=WinRecord(),
                runs=0,
                passes=0,
            ),
            f"{t}:{WORKFLOW}",
        ),
        (
            JudgeCalibrated(
                tenant=TENANT,
                judge="stub",
                due_ms=0,
                source="file",
                pairs=1,
                judged=2,
                agreed=2,
                draws=0,
                failures=0,
                checked=1,
                inconsistent=0,
                agreement=1.0,
                order_inconsistency_rate=0.0,
                model_calls=2,
                cost_usd=0.0,
            ),
            f"{t}:calibration",
        ),
        (CalibrationDue(tenant=TENANT, due_ms=0), f"{t}:calibration"),
        (
            AllocationChanged(**by_workflow, generation=1, current=VERSION, definitions={}),
            f"{t}:{WORKFLOW}",
        ),
        (Promoted(**verdict, previous=VERSION), f"{t}:{WORKFLOW}"),
        (
            ProposalRequested(
                **by_workflow,
                proposal_id="0123456789abcdef",
                workflow_version=VERSION,
                parent=VERSION,
                after=VERSION,
                definition={"id": WORKFLOW},
                rationale="why",
                proposer="catalog",
                evidence=[RUN],
                usage=usage,
                gated=True,
            ),
            f"{t}:{WORKFLOW}",
        ),
        (
            ReviewProposal(**by_workflow, proposal_id="0123456789abcdef", approve=True),
            f"{t}:{WORKFLOW}",
        ),
        (ChallengerRejected(**verdict, reason="worse"), f"{t}:{WORKFLOW}"),
        (
            TaskMixDrifted(
                **by_workflow,
                current=VERSION,
                psi={"input.language": 0.3},
                threshold=0.2,
                window=500,
                sampled=1000,
                reference_tasks=500,
            ),
            f"{t}:{WORKFLOW}",
        ),
        (
            TaskMixRebased(
                **by_workflow, current=VERSION, cause="promoted", reference_tasks=500, sampled=500
            ),
            f"{t}:{WORKFLOW}",
        ),
        (AcknowledgeDrift(**by_workflow, reason="new market"), f"{t}:{WORKFLOW}"),
        (
            RolledBack(
                **by_workflow,
                workflow_version=VERSION,
                record=WinRecord(),
                current=VERSION,
                rung=Rung.SHADOW,
                trigger="capped",
                reason="capped",
                runs=1,
                passes=1,
                baseline_runs=1,
                baseline_passes=1,
            ),
            f"{t}:{WORKFLOW}",
        ),
        (
            UsageRecorded(
                tenant=TENANT,
                run_id=RUN,
                purpose=Purpose.WORK,
                model="stub",
                prompt_tokens=1,
                completion_tokens=1,
                cost_usd=0.0,
            ),
            t,
        ),
        (TenantDeleted(tenant=TENANT, reason="gone"), t),
        (TenantStageDeleted(tenant=TENANT, stage="verify", command="m", blobs=0, workspaces=0), t),
    ]
    return {type(msg): (msg, key) for msg, key in items}


def test_every_message_type_travels_on_exactly_one_topic() -> None:
    types = set(MESSAGES.types().values())
    for msg_type in types:
        carriers = [t.name for t in TOPICS.values() if msg_type in t.carries]
        assert len(carriers) == 1, (msg_type.type, carriers)
    carried = {c for t in TOPICS.values() for c in t.carries}
    assert carried == types
    assert set(TOPICS) == {
        TASKS,
        WORKFLOWS,
        RUNS,
        RUN_STATUS,
        RUN_COMMANDS,
        EPISODES,
        VERIFIED,
        GRADED,
        RESULTS,
        AGGREGATES,
        DECISIONS,
        USAGE,
        TENANTS,
    }


def test_every_topic_key_starts_with_the_tenant() -> None:
    cases = samples()
    assert set(cases) == set(MESSAGES.types().values())  # a new message type needs a sample
    for msg, expected in cases.values():
        topic = next(t for t in TOPICS.values() if isinstance(msg, t.carries))
        key = topic.key(msg)
        assert key == expected, (topic.name, key)
        if topic.name in (USAGE, TENANTS):
            assert key == str(TENANT)
        else:
            assert key.startswith(f"{TENANT}:")
            assert len(key) > len(f"{TENANT}:")
        assert topic_for(topic.name, msg) is topic


def test_topic_for_refuses_a_message_on_the_wrong_topic() -> None:
    msg = task()
    assert topic_for(TASKS, msg).name == TASKS
    for name in (RUNS, USAGE, DECISIONS):
        with pytest.raises(UnknownTopic, match="does not carry TaskSubmitted"):
            topic_for(name, msg)
    with pytest.raises(UnknownTopic, match="no topic"):
        topic_for("assay.nope", msg)
    with pytest.raises(UnknownTopic):
        topic_for(dlq("ingest"), msg)


def test_all_topics_adds_run_commands_and_dead_letters() -> None:
    names = all_topics(["ingest", "verify"])
    assert set(names) == {*TOPICS, "assay.dlq.ingest", "assay.dlq.verify"}
    assert RUN_COMMANDS in names
    assert len(names) == len(set(names))


def test_sealing_a_sample_of_each_type_round_trips() -> None:
    at = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    for msg, key in samples().values():
        env = seal(
            msg,
            tenant=TENANT,
            key=key,
            id=message_id(key, msg.type),
            causation=None,
            occurred_at=at,
        )
        opened = open_envelope(env.encode())
        assert opened == env
        assert MESSAGES.decode(opened.type, opened.schema_version, opened.payload) == msg
