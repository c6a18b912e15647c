"""The stage consumer's per-partition queues against a real Kafka-protocol broker.

The fetch loop waits long in aiokafka's `getmany` (it returns when a fetch brings
records), so a record must never be left in aiokafka's buffer behind a busy or
paused partition until that wait runs out; and a partition given to another member
drops what its queue still held.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
from aiokafka import TopicPartition

from assay.bus import BusMessage, KafkaSource, ensure_topics
from assay.devstack import Service
from libs.assay.tests.test_bus_kafka import (
    Store,
    assert_in_order,
    entries,
    eventually,
    publish,
    source,
    unique,
)

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]

LONG_WAIT_MS = 3_000
"""The fetch loop's wait in these tests: a record stranded behind it would show."""


def waiting_source(kafka: Service, group: str, **kw: int) -> KafkaSource:
    src = source(kafka, group)
    src.wait_ms = LONG_WAIT_MS
    for name, value in kw.items():
        setattr(src, name, value)
    return src


async def run_until(
    src: KafkaSource,
    topic: str,
    handle: Callable[[BusMessage], Awaitable[None]],
    store: Store,
    done: Callable[[], bool],
    during: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Consume `topic` with `handle` until `done()`, running `during()` meanwhile."""
    stop = asyncio.Event()

    async def positions() -> Store:
        return dict(store)

    run = asyncio.create_task(src.consume([topic], handle, positions, stop))
    try:
        if during is not None:
            await during()
        await eventually(done, 30)
    finally:
        stop.set()
        await asyncio.wait_for(run, 10)


async def test_a_record_behind_a_busy_one_is_handled_as_soon_as_its_partition_is_free(
    kafka: Service,
) -> None:
    topic = unique("behind")
    await ensure_topics(kafka.address, [topic], partitions=1)
    store: Store = {}
    handled: dict[int, float] = {}
    busy = asyncio.Event()

    async def handle(m: BusMessage) -> None:
        if m.offset == 0:
            busy.set()
            await asyncio.sleep(1.0)  # the partition is busy while more records come
        handled[m.offset] = time.monotonic()
        store[(m.topic, m.partition)] = m.offset + 1

    async def behind() -> None:
        await publish(kafka, entries(topic, 1, 1))
        await asyncio.wait_for(busy.wait(), 20)
        await publish(kafka, entries(topic, 3, 1, start=1))

    src = waiting_source(kafka, unique("g"))
    await run_until(src, topic, handle, store, lambda: len(handled) >= 4, behind)
    assert sorted(handled) == [0, 1, 2, 3]
    # fetched while offset 0 was handled; taken at once, not after the loop's long wait
    assert handled[1] - handled[0] < 0.3 * LONG_WAIT_MS / 1000, handled


async def test_a_partition_paused_at_its_high_water_mark_is_read_again_promptly(
    kafka: Service,
) -> None:
    topic = unique("high-water")
    await ensure_topics(kafka.address, [topic], partitions=1)
    first, more = entries(topic, 12, 1), entries(topic, 6, 1, start=12)
    await publish(kafka, first)
    store: Store = {}
    handled: dict[int, float] = {}
    held_seen: list[bool] = []
    src = waiting_source(kafka, unique("g"), high_water=4)
    tp = TopicPartition(topic, 0)

    async def handle(m: BusMessage) -> None:
        workers = src._workers
        assert workers is not None
        if m.offset == 0:
            await asyncio.sleep(0.5)  # let the fetch fill the queue past its mark
            held_seen.append(tp in workers.full and tp in workers.consumer.paused())
            await publish(kafka, more)  # these come only after the partition resumes
        await asyncio.sleep(0.02)
        handled[m.offset] = time.monotonic()
        store[(m.topic, m.partition)] = m.offset + 1

    await run_until(src, topic, handle, store, lambda: len(handled) >= 18)
    assert held_seen == [True], "the queue's high-water mark paused the partition"
    assert sorted(handled) == list(range(18))
    # resumed when the queue fell to half the mark: the rest came well within the long wait
    gap = handled[12] - handled[11]
    assert gap < 0.3 * LONG_WAIT_MS / 1000, gap


async def test_a_revoked_partition_drops_its_queue_and_another_member_takes_it_from_there(
    kafka: Service,
) -> None:
    topic = unique("revoke-queue")
    await ensure_topics(kafka.address, [topic], partitions=2)
    batch = entries(topic, 40, 2)  # 20 records a partition, fetched at once into a's queues
    await publish(kafka, batch)
    group, store = unique("g"), Store()  # one stage: both replicas share its store
    seen: dict[str, list[tuple[BusMessage, float]]] = {"a": [], "b": []}
    queued: list[int] = []
    a_src, b_src = source(kafka, group), source(kafka, group)
    a_busy, stop = asyncio.Event(), asyncio.Event()

    def member(name: str) -> Callable[[BusMessage], Awaitable[None]]:
        async def handle(m: BusMessage) -> None:
            if name == "a":
                workers = a_src._workers
                assert workers is not None
                queued.append(len(workers.queues.get(TopicPartition(m.topic, m.partition), ())))
                a_busy.set()
                await asyncio.sleep(0.2)  # slow: most of a's records are still queued
            seen[name].append((m, time.monotonic()))
            store[(m.topic, m.partition)] = m.offset + 1

        return handle

    async def positions() -> Store:
        return dict(store)

    a = asyncio.create_task(a_src.consume([topic], member("a"), positions, stop))
    b: asyncio.Task[None] | None = None
    try:
        await asyncio.wait_for(a_busy.wait(), 20)
        b = asyncio.create_task(b_src.consume([topic], member("b"), positions, stop))
        await eventually(lambda: len(seen["a"]) + len(seen["b"]) >= len(batch), 40)
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        await asyncio.gather(a, *([b] if b else []))
    assert seen["b"], "the new member took a partition"
    assert max(queued) > 5, "a's queue held records when its partitions were revoked"
    values = [m.value for m, _ in seen["a"] + seen["b"]]
    assert sorted(values) == sorted(e.value for e in batch)  # each once: none handled twice
    for p in {m.partition for m, _ in seen["b"]}:
        a_last = max((t for m, t in seen["a"] if m.partition == p), default=0.0)
        b_first = min(t for m, t in seen["b"] if m.partition == p)
        assert a_last < b_first, "nothing of a partition handled by a after b took it"
    assert_in_order(sorted((m for m, _ in seen["a"] + seen["b"]), key=lambda m: m.offset))
