"""The Kafka transport against a real Kafka-protocol broker.

Every test makes its own topics and consumer groups. Stored positions are a
dict the handler updates, as a stage's commit would.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from assay.bus import (
    DECISIONS,
    TENANTS,
    WORKFLOWS,
    BusMessage,
    FileLock,
    KafkaSource,
    KafkaTransport,
    OutboxRelay,
    TopicMismatch,
    dlq,
    ensure_topics,
    original_headers,
    partition_for,
)
from assay.bus.kafka import log_end
from assay.bus.topics import partition_counts
from assay.devstack import Service
from assay.devstack.kafka import broker_outage, start_tansu
from assay.kernel import TenantId, WorkflowId
from assay.messages import TaskSubmitted, message_id, seal
from assay.record import EventRegistry, LogRecord, StateDelta
from assay.runtime import StageRunner, StageSpec, UnitOfWork, stage_log
from assay.runtime.distributed import create_topics
from assay.runtime.embedded import STAGES
from assay.runtime.settings import AssaySettings
from assay.store import CommitBatch, FsBlobStore, OutboxEntry, SqliteEventLog

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

TENANT = TenantId(uuid.UUID("00000000-0000-4000-8000-0000000000aa"))
Store = dict[tuple[str, int], int]


async def eventually(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Wait until `check()` holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def unique(prefix: str) -> str:
    return f"test.{prefix}.{uuid.uuid4().hex[:10]}"


def source(kafka: Service, group: str) -> KafkaSource:
    """A source with short group timeouts: every join costs a session of waiting otherwise."""
    return KafkaSource(
        kafka.address, group_id=group, member_timeout_ms=2000, heartbeat_interval_ms=500
    )


def entries(topic: str, n: int, keys: int, *, start: int = 0) -> list[OutboxEntry]:
    """`n` records over `keys` keys; the value is `key/seq`, seq counting per key."""
    out = []
    for i in range(start, start + n):
        key = f"key-{i % keys}"
        out.append(OutboxEntry(topic, key, f"{key}/{i // keys}".encode(), (("n", b"%d" % i),)))
    return out


async def publish(kafka: Service, batch: list[OutboxEntry]) -> None:
    async with KafkaTransport(kafka.address, client_id=unique("producer")) as transport:
        await transport.publish(batch)


async def consume(
    src: KafkaSource,
    topics: list[str],
    store: Store,
    done: Callable[[list[BusMessage]], bool],
    *,
    on_message: Callable[[BusMessage], Awaitable[None]] | None = None,
    timeout_s: float = 20.0,
) -> list[BusMessage]:
    """Run `src` until `done(seen)`; the handler stores each position like a stage commit."""
    seen: list[BusMessage] = []
    stop = asyncio.Event()

    async def handle(m: BusMessage) -> None:
        if on_message is not None:
            await on_message(m)
        seen.append(m)
        store[(m.topic, m.partition)] = m.offset + 1
        if done(seen):
            stop.set()

    async def positions() -> Store:
        return dict(store)

    task = asyncio.create_task(src.consume(topics, handle, positions, stop))
    try:
        await asyncio.wait_for(stop.wait(), timeout_s)
    finally:
        stop.set()
        stopping = time.monotonic()
        await asyncio.wait_for(task, 10)
    assert time.monotonic() - stopping < 3.0, "the source stops promptly"
    return seen


async def read_all(
    kafka: Service, topic: str, partitions: int, expected: int, timeout_s: float = 10.0
) -> list[Any]:
    """Every record of `topic` (at least `expected`; then until a poll finds nothing more)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.address, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=300)
            for records in batch.values():
                out.extend(records)
            if not batch and len(out) >= expected:
                break
        return out
    finally:
        await consumer.stop()


def assert_in_order(seen: list[BusMessage]) -> None:
    """Per partition, offsets ascend by one; per key, the sequence numbers ascend by one."""
    by_part: dict[tuple[str, int], list[int]] = defaultdict(list)
    by_key: dict[str, list[int]] = defaultdict(list)
    for m in seen:
        by_part[(m.topic, m.partition)].append(m.offset)
        key, seq = m.value.decode().split("/")
        assert key == m.key
        by_key[key].append(int(seq))
    for offsets in by_part.values():
        assert offsets == list(range(offsets[0], offsets[0] + len(offsets))), offsets
    for seqs in by_key.values():
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs


# -- topics and partitioning --------------------------------------------------------------


async def test_topics_are_created_with_the_configured_partition_count(kafka: Service) -> None:
    a, b = unique("topics-a"), unique("topics-b")
    assert sorted(await ensure_topics(kafka.address, [a, b, a], partitions=5)) == sorted([a, b])
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.address)
    await admin.start()
    try:
        described = await admin.describe_topics([a, b])
    finally:
        await admin.close()
    assert {d["topic"]: len(d["partitions"]) for d in described} == {a: 5, b: 5}
    assert await ensure_topics(kafka.address, [a, b], partitions=5) == []  # idempotent
    with pytest.raises(TopicMismatch, match=a):
        await ensure_topics(kafka.address, [a], partitions=7)


async def test_each_topic_is_created_with_its_own_count_and_checked_by_it(
    kafka: Service,
) -> None:
    a, b = unique("counts-a"), unique("counts-b")
    assert sorted(await ensure_topics(kafka.address, [a, b], {a: 3, b: 1})) == sorted([a, b])
    assert await partition_counts_of(kafka, [a, b]) == {a: 3, b: 1}
    assert await ensure_topics(kafka.address, [a, b], {a: 3, b: 1}) == []
    with pytest.raises(TopicMismatch, match=b):
        await ensure_topics(kafka.address, [a, b], {a: 3, b: 3})
    # an upgraded deployment whose control topics were created with ASSAY_PARTITIONS is
    # told which settings keep its counts
    with pytest.raises(TopicMismatch, match="ASSAY_CONTROL_PARTITIONS"):
        await ensure_topics(kafka.address, [a, b], {a: 3, b: 3})


async def test_the_deployments_topics_have_their_partition_counts(tmp_path: Path) -> None:
    """`assay topics create` (and every stage at start): the topics with a record or more
    per run get ASSAY_PARTITIONS, the control and dead-letter topics
    ASSAY_CONTROL_PARTITIONS; a stage configured otherwise is refused. A broker of its
    own: these are the deployment's fixed topic names."""
    broker = await asyncio.to_thread(start_tansu, tmp_path)
    try:
        env = {"ASSAY_KAFKA_BOOTSTRAP": broker.address, "ASSAY_PARTITIONS": "6"}
        names = await create_topics(AssaySettings.from_env(env))
        counts = await partition_counts_of(broker, names)
        assert counts == partition_counts(names, 6, 1)
        assert {n for n, c in counts.items() if c == 1} == {
            TENANTS,
            WORKFLOWS,
            DECISIONS,
            *(dlq(s) for s in STAGES),
        }
        assert await create_topics(AssaySettings.from_env(env)) == names  # checked, kept
        with pytest.raises(TopicMismatch, match=TENANTS):
            await create_topics(AssaySettings.from_env({**env, "ASSAY_CONTROL_PARTITIONS": "2"}))
    finally:
        broker.stop()


async def partition_counts_of(kafka: Service, names: list[str]) -> dict[str, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.address)
    await admin.start()
    try:
        described = await admin.describe_topics(names)
    finally:
        await admin.close()
    return {d["topic"]: len(d["partitions"]) for d in described}


async def test_topics_are_created_with_the_retention_asked_for(kafka: Service) -> None:
    """The broker takes `retention.ms` at creation (Kafka's own retention then deletes
    old segments); a topic that exists keeps its own."""
    a = unique("retained")
    assert await ensure_topics(kafka.address, [a], partitions=2, retention_ms=3_600_000) == [a]
    assert await ensure_topics(kafka.address, [a], partitions=2, retention_ms=60_000) == []
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.address)
    await admin.start()
    try:
        (described,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, a)])
    finally:
        await admin.close()
    (resource,) = described.resources
    configs = {entry[0]: entry[1] for entry in resource[4]}
    assert configs["retention.ms"] == "3600000"


async def test_the_kafka_partition_of_a_key_is_partition_for(kafka: Service) -> None:
    topic = unique("murmur")
    await ensure_topics(kafka.address, [topic], partitions=12)
    batch = [OutboxEntry(topic, f"{TENANT}:run-{i}", b"%d" % i) for i in range(200)]
    await publish(kafka, batch)
    records = await read_all(kafka, topic, 12, len(batch))
    assert len(records) == len(batch)
    used = set()
    for r in records:
        assert r.partition == partition_for(r.key, 12), r.key
        used.add(r.partition)
    assert len(used) == 12


# -- publish and consume ------------------------------------------------------------------


async def test_publish_then_consume_preserves_order_per_partition_and_key(
    kafka: Service,
) -> None:
    topic = unique("order")
    await ensure_topics(kafka.address, [topic], partitions=4)
    first, second = entries(topic, 240, 16), entries(topic, 160, 16, start=240)
    await publish(kafka, first)
    await publish(kafka, second)
    store: Store = {}
    seen = await consume(source(kafka, unique("g")), [topic], store, lambda s: len(s) >= 400)
    assert len(seen) == 400
    assert Counter(m.value for m in seen) == Counter(e.value for e in first + second)
    assert_in_order(seen)
    for m in seen:
        assert m.partition == partition_for(m.key.encode(), 4)
    # FastStream's publish always writes a `content-type` header, empty for bytes
    sent = {e.value: (("content-type", b""), *e.headers) for e in first + second}
    assert all(m.headers == sent[m.value] for m in seen)


async def test_source_starts_from_stored_positions_and_else_from_the_beginning(
    kafka: Service,
) -> None:
    topic = unique("positions")
    await ensure_topics(kafka.address, [topic], partitions=3)
    batch = entries(topic, 90, 9)
    await publish(kafka, batch)
    per_part: dict[int, list[bytes]] = defaultdict(list)
    for e in batch:
        per_part[partition_for(e.key.encode(), 3)].append(e.value)
    group = unique("g")
    # the group's committed offsets point at the end: a hint the source must not follow
    hint = AIOKafkaConsumer(bootstrap_servers=kafka.address, group_id=group)
    await hint.start()
    try:
        ends = {TopicPartition(topic, p): len(v) for p, v in per_part.items()}
        hint.assign(list(ends))
        await hint.commit(ends)
    finally:
        await hint.stop()

    skip = {0: 2, 1: 5}  # partition 2 has no stored position: from its beginning
    store: Store = {(topic, p): n for p, n in skip.items()}
    expected = [v for p, vs in per_part.items() for v in vs[skip.get(p, 0) :]]
    seen = await consume(source(kafka, group), [topic], store, lambda s: len(s) >= len(expected))
    await asyncio.sleep(0)
    assert sorted(m.value for m in seen) == sorted(expected)
    for p, n in skip.items():
        assert min(m.offset for m in seen if m.partition == p) == n
    assert min(m.offset for m in seen if m.partition == 2) == 0
    assert_in_order(seen)


async def test_end_offsets_are_the_log_ends_of_the_partitions_the_member_holds(
    kafka: Service,
) -> None:
    topic, other = unique("ends"), unique("ends-other")
    await ensure_topics(kafka.address, [topic, other], partitions=3)
    batch = entries(topic, 30, 6)
    # one record per produce request: Tansu answers ListOffsets(latest) with the base
    # offset of a partition's last record batch plus one, not its last offset plus one
    async with KafkaTransport(kafka.address, client_id=unique("producer")) as transport:
        for e in batch:
            await transport.publish([e])
    counts = Counter(partition_for(e.key.encode(), 3) for e in batch)
    src, store, stop = source(kafka, unique("g")), Store(), asyncio.Event()
    seen: list[BusMessage] = []

    async def handle(m: BusMessage) -> None:
        seen.append(m)
        store[(m.topic, m.partition)] = m.offset + 1

    async def positions() -> Store:
        return dict(store)

    assert await src.end_offsets([topic]) == {}  # not a member yet
    run = asyncio.create_task(src.consume([topic], handle, positions, stop))
    try:
        await eventually(lambda: len(seen) == len(batch))
        assert await src.end_offsets([topic]) == {(topic, p): counts[p] for p in range(3)}
        assert await src.end_offsets([other]) == {}  # not a topic this member consumes
        async with KafkaTransport(kafka.address, client_id=unique("producer")) as transport:
            for e in entries(topic, 6, 6, start=30):  # one more on each key
                await transport.publish([e])
        await eventually(lambda: len(seen) == len(batch) + 6)
        more = Counter(partition_for(e.key.encode(), 3) for e in entries(topic, 36, 6))
        assert await src.end_offsets([topic]) == {(topic, p): more[p] for p in range(3)}
    finally:
        stop.set()
        await asyncio.wait_for(run, 10)


async def test_a_restarted_consumer_resumes_from_the_positions_the_handler_stored(
    kafka: Service,
) -> None:
    topic = unique("restart")
    await ensure_topics(kafka.address, [topic], partitions=4)
    await publish(kafka, entries(topic, 200, 20))
    group, store = unique("g"), Store()
    t0 = time.monotonic()
    before = await consume(source(kafka, group), [topic], store, lambda s: len(s) >= 70)
    assert 70 <= len(before) < 200
    assert time.monotonic() - t0 < 15
    stored = dict(store)
    await publish(kafka, entries(topic, 100, 20, start=200))
    after = await consume(
        source(kafka, group), [topic], store, lambda s: len(before) + len(s) >= 300
    )
    for p in range(4):
        resumed = [m.offset for m in after if m.partition == p]
        if resumed:
            assert resumed[0] == stored.get((topic, p), 0)
    values = [m.value for m in before + after]
    assert len(values) == len(set(values)) == 300  # every record once
    assert_in_order(before + after)


@pytest.mark.timeout(120)
async def test_two_sources_in_one_group_split_the_partitions_and_see_every_record_once(
    kafka: Service,
) -> None:
    topic = unique("split")
    await ensure_topics(kafka.address, [topic], partitions=6)
    group, store = unique("g"), Store()  # one stage: both replicas share its store
    seen: dict[str, list[BusMessage]] = {"a": [], "b": []}
    stop = asyncio.Event()
    published = 0

    def member(name: str) -> Callable[[BusMessage], Awaitable[None]]:
        async def handle(m: BusMessage) -> None:
            await asyncio.sleep(0.005)  # the work; its commit stores the position last
            seen[name].append(m)
            store[(m.topic, m.partition)] = m.offset + 1

        return handle

    async def positions() -> Store:
        return dict(store)

    runs = [
        asyncio.create_task(source(kafka, group).consume([topic], member(n), positions, stop))
        for n in ("a", "b")
    ]

    def handled() -> int:
        return len(seen["a"]) + len(seen["b"])

    try:
        # publish while the group forms, until both members have handled records; then
        # let them drain what was published (a loaded machine lags; it must not lose)
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            await publish(kafka, entries(topic, 60, 12, start=published))
            published += 60
            await asyncio.sleep(0.3)
            if seen["a"] and seen["b"] and published >= 600:
                break
        await eventually(lambda: handled() >= published, 30)
    finally:
        stop.set()
        await asyncio.gather(*runs)
    assert seen["a"], "both members handled records"
    assert seen["b"], "both members handled records"
    values = [m.value for m in seen["a"] + seen["b"]]
    assert len(values) == len(set(values)) == published
    both = sorted(seen["a"] + seen["b"], key=lambda m: (m.partition, m.offset))
    assert_in_order(both)


async def test_a_revoked_partition_finishes_its_record_before_another_member_takes_it(
    kafka: Service,
) -> None:
    topic = unique("revoke")
    await ensure_topics(kafka.address, [topic], partitions=2)
    batch = entries(topic, 8, 2)
    await publish(kafka, batch)
    group, store = unique("g"), Store()
    seen: dict[str, list[BusMessage]] = {"a": [], "b": []}
    a_busy, stop = asyncio.Event(), asyncio.Event()

    def member(name: str) -> Callable[[BusMessage], Awaitable[None]]:
        async def handle(m: BusMessage) -> None:
            if name == "a" and m.offset == 0:  # both partitions in flight through the rebalance
                a_busy.set()
                await asyncio.sleep(2.5)
            seen[name].append(m)
            store[(m.topic, m.partition)] = m.offset + 1

        return handle

    async def positions() -> Store:
        return dict(store)

    a = asyncio.create_task(source(kafka, group).consume([topic], member("a"), positions, stop))
    b: asyncio.Task[None] | None = None
    try:
        await asyncio.wait_for(a_busy.wait(), 10)
        b = asyncio.create_task(source(kafka, group).consume([topic], member("b"), positions, stop))
        await eventually(lambda: len(seen["a"]) + len(seen["b"]) >= len(batch) and bool(seen["b"]))
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        await asyncio.gather(a, *([b] if b else []))
    values = [m.value for m in seen["a"] + seen["b"]]
    assert sorted(values) == sorted(e.value for e in batch)  # each once: none handled twice
    assert {m.offset for m in seen["b"]} <= set(range(1, 4))


async def test_a_handler_that_raises_is_retried_from_the_failed_record(kafka: Service) -> None:
    topic = unique("raises")
    await ensure_topics(kafka.address, [topic], partitions=2)
    await publish(kafka, entries(topic, 40, 4))
    failed: list[int] = []

    async def flaky(m: BusMessage) -> None:
        if m.partition == 0 and m.offset == 3 and not failed:
            failed.append(m.offset)
            raise RuntimeError("the store blinked")

    store: Store = {}
    src = source(kafka, unique("g"))
    src.retry_backoff_s = 0.05
    seen = await consume(src, [topic], store, lambda s: len(s) >= 40, on_message=flaky)
    assert failed == [3]
    assert sorted(m.value for m in seen) == sorted(e.value for e in entries(topic, 40, 4))
    assert_in_order(seen)


async def test_partitions_wait_while_the_stored_positions_cannot_be_read(
    kafka: Service,
) -> None:
    topic = unique("store-down")
    await ensure_topics(kafka.address, [topic], partitions=2)
    await publish(kafka, entries(topic, 20, 2))
    store: Store = {(topic, 0): 4, (topic, 1): 6}
    calls: list[int] = []
    seen: list[BusMessage] = []
    stop = asyncio.Event()

    async def positions() -> Store:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("the stage's database is restarting")
        return dict(store)

    async def handle(m: BusMessage) -> None:
        seen.append(m)

    run = asyncio.create_task(source(kafka, unique("g")).consume([topic], handle, positions, stop))
    try:
        await eventually(lambda: len(seen) >= 10)
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        await asyncio.wait_for(run, 10)
    assert len(calls) >= 2
    assert sorted((m.partition, m.offset) for m in seen) == [
        *((0, o) for o in range(4, 10)),
        *((1, o) for o in range(6, 10)),
    ]


# -- a stage on Kafka -----------------------------------------------------------------------


def _no_fold(record: LogRecord) -> list[StateDelta]:
    return []


def _task(topic: str, key: str) -> bytes:
    msg = TaskSubmitted(
        tenant=TENANT, workflow_id=WorkflowId("wf"), idempotency_key=key, input={"q": key}
    )
    env = seal(msg, tenant=TENANT, key=key, id=message_id("test", topic, key), causation=None)
    return env.encode()


async def test_a_stage_dead_letters_poison_through_the_relay_and_keeps_going(
    kafka: Service, tmp_path: Path
) -> None:
    stage = f"echo-{uuid.uuid4().hex[:8]}"
    inbound = unique("inbound")
    await ensure_topics(kafka.address, [inbound, dlq(stage)], partitions=3)
    handled: list[str] = []

    async def on_task(msg: TaskSubmitted, uow: UnitOfWork[Any]) -> None:
        handled.append(msg.idempotency_key)

    spec = StageSpec(
        name=stage,
        events=EventRegistry([]),
        fold=_no_fold,
        handlers={inbound: {TaskSubmitted.type: on_task}},
    )
    log = await stage_log(tmp_path, spec).open()
    transport = await KafkaTransport(kafka.address, client_id=stage).open()
    try:
        relay = OutboxRelay(stage, log, transport, FileLock(tmp_path / "relay.lock"))
        blobs = FsBlobStore(tmp_path / "blobs")
        runner = StageRunner(spec, log, blobs, relay, source(kafka, stage))
        key = f"{TENANT}:run-1"
        poison = b"\x00{definitely not json"
        await publish(
            kafka,
            [
                OutboxEntry(inbound, key, _task(inbound, "t-1")),
                OutboxEntry(inbound, key, poison, (("x-producer", b"p1"),)),
                OutboxEntry(inbound, key, _task(inbound, "t-2")),
            ],
        )
        stop = asyncio.Event()
        run = asyncio.create_task(runner.run(stop))
        try:
            await eventually(lambda: len(handled) == 2 and relay.shipped == 1)
        finally:
            stop.set()
            await asyncio.wait_for(run, 10)
        assert handled == ["t-1", "t-2"]
        assert (runner.handled, runner.dead_lettered, relay.shipped) == (2, 1, 1)
        part = partition_for(key.encode(), 3)
        assert await log.positions() == {(inbound, part): 3}
        (letter,) = await read_all(kafka, dlq(stage), 3, 1)
        assert (letter.key, letter.value) == (key.encode(), poison)
        headers = dict(letter.headers)
        assert headers["x-producer"] == b"p1"
        assert headers["assay-dlq-source"] == f"{inbound}/{part}/1".encode()
        assert headers["assay-dlq-reason"].startswith(b"not JSON")
    finally:
        await transport.close()
        await log.close()


async def test_a_dead_letter_carries_repeated_and_binary_headers_exactly(
    kafka: Service, tmp_path: Path
) -> None:
    stage = f"echo-{uuid.uuid4().hex[:8]}"
    inbound = unique("inbound")
    await ensure_topics(kafka.address, [inbound, dlq(stage)], partitions=1)
    sent = (("x-trace", b"first"), ("x-bin", b"\xff\xfe\x00\x80"), ("x-trace", b"second"))
    producer = AIOKafkaProducer(bootstrap_servers=kafka.address)  # another producer's record
    await producer.start()
    try:
        await producer.send_and_wait(inbound, b"\x00not json", key=b"k", headers=list(sent))
    finally:
        await producer.stop()
    spec = StageSpec(name=stage, events=EventRegistry([]), fold=_no_fold, handlers={inbound: {}})
    log = await stage_log(tmp_path, spec).open()
    transport = await KafkaTransport(kafka.address, client_id=stage).open()
    try:
        relay = OutboxRelay(stage, log, transport, FileLock(tmp_path / "relay.lock"))
        runner = StageRunner(
            spec, log, FsBlobStore(tmp_path / "blobs"), relay, source(kafka, stage)
        )
        stop = asyncio.Event()
        run = asyncio.create_task(runner.run(stop))
        try:
            await eventually(lambda: relay.shipped == 1)
        finally:
            stop.set()
            await asyncio.wait_for(run, 10)
    finally:
        await transport.close()
        await log.close()
    (letter,) = await read_all(kafka, dlq(stage), 1, 1)
    assert (letter.key, letter.value) == (b"k", b"\x00not json")
    headers = original_headers(letter.headers)
    assert headers[: len(sent)] == sent
    assert [k for k, _ in headers[len(sent) :]] == [
        "assay-dlq-reason",
        "assay-dlq-stage",
        "assay-dlq-source",
    ]
    assert dict(headers)["assay-dlq-source"] == f"{inbound}/0/0".encode()


async def test_a_relay_keeps_its_rows_through_a_broker_outage_and_ships_them_after(
    kafka: Service, tmp_path: Path
) -> None:
    if kafka.details.get("kind") != "tansu":
        pytest.skip("needs a broker process started here (pausing it is the outage)")
    topic = unique("outage")
    await ensure_topics(kafka.address, [topic], partitions=3)
    log = await SqliteEventLog(tmp_path / "relay.sqlite", EventRegistry([]), _no_fold).open()
    transport = await KafkaTransport(
        kafka.address, client_id=unique("relay"), request_timeout_ms=1500
    ).open()
    relay = OutboxRelay("outage", log, transport, FileLock(tmp_path / "relay.lock"), batch=25)
    stop = asyncio.Event()
    run = asyncio.create_task(relay.run(stop))
    batch = entries(topic, 120, 6)
    try:
        await log.commit(CommitBatch(outbox=batch[:20]))
        relay.wake.set()
        await eventually(lambda: relay.shipped == 20)
        with broker_outage(kafka):
            for i in range(20, 120, 10):
                await log.commit(CommitBatch(outbox=batch[i : i + 10]))
                relay.wake.set()
            await asyncio.sleep(3.5)  # longer than the request timeout: publishes fail
            assert relay.shipped < 120
            assert await log.drain_outbox(1000), "unshipped rows stay in the outbox"
        await eventually(lambda: relay.shipped == 120)
        assert await log.drain_outbox(1000) == []
    finally:
        stop.set()
        await asyncio.wait_for(run, 15)
        await transport.close()
        await log.close()
    records = await read_all(kafka, topic, 3, 120)
    values = [r.value for r in records]
    assert set(values) == {e.value for e in batch}  # nothing lost (a timed-out send may repeat)
    first: dict[bytes, list[int]] = defaultdict(list)
    for r in records:
        key, seq = r.value.decode().split("/")
        if int(seq) not in first[key.encode()]:
            first[key.encode()].append(int(seq))
    assert all(seqs == sorted(seqs) for seqs in first.values())


async def test_a_partitions_end_counts_every_record_of_its_last_batch(kafka: Service) -> None:
    """Three single records, then a batch of four: the end is 7. Tansu 0.6 answers
    ListOffsets with 4 (the last batch's first offset plus one); `log_end` takes the high
    watermark a fetch saw, so lag and `assay results` do not stop short."""
    topic = unique("end")
    await ensure_topics(kafka.address, [topic], partitions=1)
    tp = TopicPartition(topic, 0)
    producer = AIOKafkaProducer(bootstrap_servers=kafka.address, linger_ms=50)
    await producer.start()
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.address, enable_auto_commit=False)
    await consumer.start()
    try:
        for _ in range(3):
            await producer.send_and_wait(topic, b"single", partition=0)
        batch = [await producer.send(topic, b"batched", partition=0) for _ in range(4)]
        await asyncio.gather(*batch)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        read = 0
        deadline = time.monotonic() + 20
        while read < 7:
            assert time.monotonic() < deadline, f"read {read} of 7 records"
            read += sum(len(rs) for rs in (await consumer.getmany(timeout_ms=500)).values())
        listed = (await consumer.end_offsets([tp]))[tp]
        assert listed in (4, 7)  # 4 on Tansu 0.6, 7 on Kafka
        assert log_end(consumer, tp, listed) == 7
    finally:
        await consumer.stop()
        await producer.stop()
