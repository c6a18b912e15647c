"""The FastStream side of the Kafka transport, in memory (FastStream's `TestKafkaBroker`).

The relay publishes through `KafkaTransport` on a `KafkaBroker`; a stage's
records reach `StageRunner.handle` through a FastStream subscriber. The same
scenarios run against a real broker in `test_bus_kafka.py`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from faststream.kafka import KafkaBroker, TestKafkaBroker
from faststream.kafka.annotations import KafkaMessage

from assay.bus import (
    ORIGINAL_HEADERS,
    BadOriginalHeaders,
    FileLock,
    KafkaTransport,
    OutboxRelay,
    dlq,
    original_headers,
)
from assay.bus.partitions import bus_message
from assay.kernel import TenantId, WorkflowId
from assay.messages import TaskSubmitted, message_id, seal
from assay.record import EventRegistry, LogRecord, StateDelta
from assay.runtime import StageRunner, StageSpec, UnitOfWork, stage_log
from assay.store import CommitBatch, FsBlobStore, OutboxEntry

TENANT = TenantId(uuid.UUID("00000000-0000-4000-8000-0000000000ab"))
INBOUND = "assay.test.inbound"
reasons: list[bytes] = []
"""The `assay-dlq-reason` header of each dead letter the stage fixture received."""


def _no_fold(record: LogRecord) -> list[StateDelta]:
    return []


def _task(key: str) -> bytes:
    msg = TaskSubmitted(
        tenant=TENANT, workflow_id=WorkflowId("wf"), idempotency_key=key, input={"q": key}
    )
    env = seal(msg, tenant=TENANT, key=key, id=message_id("test", key), causation=None)
    return env.encode()


async def test_the_relay_publishes_each_row_with_its_key_value_and_headers(
    tmp_path: Path,
) -> None:
    broker = KafkaBroker(logger=None, id_generator=lambda: "")
    received: list[tuple[bytes | None, bytes, dict[str, bytes]]] = []

    @broker.subscriber("assay.test.out")
    async def on_record(message: KafkaMessage) -> None:
        record: Any = message.raw_message
        received.append((record.key, record.value, dict(record.headers)))

    rows = [
        OutboxEntry("assay.test.out", f"{TENANT}:run-{i}", b"v%d" % i, (("assay-type", b"T"),))
        for i in range(3)
    ]
    async with TestKafkaBroker(broker):
        log = await stage_log(tmp_path, _spec("relay", {})).open()
        transport = await KafkaTransport("", client_id="relay", broker=broker).open()
        try:
            relay = OutboxRelay("relay", log, transport, FileLock(tmp_path / "relay.lock"))
            await log.commit(CommitBatch(outbox=rows))
            assert await relay.ship_once() == 3
            assert await log.drain_outbox(10) == []
        finally:
            await log.close()
    assert [(k, v) for k, v, _ in received] == [(r.key.encode(), r.value) for r in rows]
    assert all(h["assay-type"] == b"T" for _, _, h in received)


async def test_headers_a_dict_cannot_hold_travel_whole_beside_it() -> None:
    broker = KafkaBroker(logger=None, id_generator=lambda: "")
    received: list[tuple[tuple[str, bytes], ...]] = []

    @broker.subscriber("assay.test.out")
    async def on_record(message: KafkaMessage) -> None:
        record: Any = message.raw_message
        received.append(tuple(record.headers))

    plain = (("assay-type", b"T"), ("x-producer", b"p1"))
    foreign = (("x-trace", b"a"), ("x-bin", b"\xff\x00"), ("x-trace", b"b"), ("x-empty", b""))
    rows = [OutboxEntry("assay.test.out", "k", b"v", h) for h in (plain, foreign)]
    async with TestKafkaBroker(broker):
        transport = await KafkaTransport("", client_id="relay", broker=broker).open()
        await transport.publish(rows)
    exact, whole = received
    assert ORIGINAL_HEADERS not in dict(exact)  # what fits a dict goes as it is
    assert original_headers(exact)[-2:] == plain
    assert ORIGINAL_HEADERS in dict(whole)
    assert original_headers(whole) == foreign
    with pytest.raises(BadOriginalHeaders):
        original_headers(((ORIGINAL_HEADERS, b'[["x", "not base64!"]]'),))


def _spec(name: str, handlers: dict[str, dict[str, object]]) -> StageSpec:
    return StageSpec(
        name=name,
        events=EventRegistry([]),
        fold=_no_fold,
        handlers=handlers,  # type: ignore[arg-type]
    )


@pytest.fixture
async def stage(
    tmp_path: Path,
) -> AsyncIterator[tuple[KafkaBroker, StageRunner, list[str], list[bytes]]]:
    """A stage whose records come through a FastStream subscriber, and what its
    dead-letter topic received."""
    handled: list[str] = []
    letters: list[bytes] = []
    reasons.clear()

    async def on_task(msg: TaskSubmitted, uow: UnitOfWork[Any]) -> None:
        handled.append(msg.idempotency_key)

    spec = _spec("echo", {INBOUND: {TaskSubmitted.type: on_task}})
    broker = KafkaBroker(logger=None, id_generator=lambda: "")
    log = await stage_log(tmp_path, spec).open()
    transport = KafkaTransport("", client_id="echo", broker=broker)
    relay = OutboxRelay("echo", log, transport, FileLock(tmp_path / "relay.lock"))
    runner = StageRunner(spec, log, FsBlobStore(tmp_path / "blobs"), relay)

    @broker.subscriber(INBOUND)
    async def on_record(message: KafkaMessage) -> None:
        record: Any = message.raw_message
        await runner.handle(bus_message(record))

    @broker.subscriber(dlq("echo"))
    async def on_letter(message: KafkaMessage) -> None:
        record: Any = message.raw_message
        letters.append(record.value)
        reasons.append(dict(record.headers)["assay-dlq-reason"])

    async with TestKafkaBroker(broker):
        await transport.open()
        yield broker, runner, handled, letters
    await log.close()


async def test_undecodable_input_is_dead_lettered_with_its_reason(
    stage: tuple[KafkaBroker, StageRunner, list[str], list[bytes]],
) -> None:
    broker, runner, handled, letters = stage
    poison = b"\x00{not json"
    await broker.publish(poison, INBOUND, key=b"k")
    await broker.publish(_task("t-1"), INBOUND, key=b"k")
    assert await runner.relay.ship_once() == 1
    assert (handled, letters, runner.dead_lettered) == (["t-1"], [poison], 1)
    assert [r[:8] for r in reasons] == [b"not JSON"]


async def test_a_message_delivered_twice_is_handled_once(
    stage: tuple[KafkaBroker, StageRunner, list[str], list[bytes]],
) -> None:
    broker, runner, handled, _ = stage
    for _ in range(2):
        await broker.publish(_task("t-1"), INBOUND, key=b"k")
    assert handled == ["t-1"]
    assert (runner.handled, runner.duplicates) == (1, 1)
