"""The embedded bus's retention: each partition is truncated below what every stage reading
it has handled (and older than the topic retention), and nothing a lagging stage still
needs is dropped."""

from __future__ import annotations

import time
from pathlib import Path

from assay.bus.embedded import EmbeddedBus
from assay.record import EventRegistry, LogRecord, StateDelta
from assay.runtime.retention import truncate_bus
from assay.store import CommitBatch, ConsumerPosition, EventLog, OutboxEntry, SqliteEventLog

TOPIC = "assay.episodes"
UNREAD = "assay.dlq.verify"


def _nothing(_: LogRecord) -> list[StateDelta]:
    return []


async def _stage(path: Path) -> EventLog:
    return await SqliteEventLog(path, EventRegistry([]), _nothing).open()


async def _handled(stage: EventLog, offset: int) -> None:
    await stage.commit(CommitBatch(position=ConsumerPosition(TOPIC, 0, offset)))


def _entries(topic: str, n: int) -> list[OutboxEntry]:
    return [OutboxEntry(topic, "k", f"m{i}".encode()) for i in range(n)]


async def _offsets(bus: EmbeddedBus, topic: str) -> list[int]:
    return [m.offset for m in await bus.fetch(topic, 0, 0, 1000, 0.0)]


async def test_a_lagging_stage_keeps_what_it_has_not_handled(tmp_path: Path) -> None:
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    fast, slow = await _stage(tmp_path / "fast.sqlite"), await _stage(tmp_path / "slow.sqlite")
    await bus.publish(_entries(TOPIC, 10))
    await _handled(fast, 10)
    await _handled(slow, 3)
    now_ms = int(time.time() * 1000) + 1
    readers = {TOPIC: [fast, slow]}
    assert await truncate_bus(bus, readers, [TOPIC], now_ms) == 3
    assert await _offsets(bus, TOPIC) == list(range(3, 10))
    for m in await bus.fetch(TOPIC, 0, 3, 100, 0.0):  # the lagging stage reads on from 3
        assert m.value == f"m{m.offset}".encode()
    await _handled(slow, 10)
    assert await truncate_bus(bus, readers, [TOPIC], now_ms) == 6
    assert await _offsets(bus, TOPIC) == [9]  # the last record says where it ends
    assert bus.reclaim_space()
    assert (tmp_path / "bus.sqlite-wal").stat().st_size == 0
    assert await _offsets(bus, TOPIC) == [9]
    await bus.close()
    reopened = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    assert await reopened.end_offsets(TOPIC) == {0: 10}
    await reopened.publish(_entries(TOPIC, 1))
    assert await _offsets(reopened, TOPIC) == [9, 10]
    await reopened.close()
    await fast.close()
    await slow.close()


async def test_records_younger_than_the_topic_retention_stay_though_handled(
    tmp_path: Path,
) -> None:
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    stage = await _stage(tmp_path / "s.sqlite")
    await bus.publish(_entries(TOPIC, 5))
    await _handled(stage, 5)
    old_enough = int(time.time() * 1000) - 3_600_000  # published within the last hour
    assert await truncate_bus(bus, {TOPIC: [stage]}, [TOPIC], old_enough) == 0
    assert await _offsets(bus, TOPIC) == list(range(5))
    await bus.close()
    await stage.close()


async def test_a_topic_no_stage_reads_loses_what_is_older_than_the_retention(
    tmp_path: Path,
) -> None:
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    await bus.publish(_entries(UNREAD, 4))
    assert await truncate_bus(bus, {}, [UNREAD], int(time.time() * 1000) + 1) == 3
    assert await _offsets(bus, UNREAD) == [3]
    await bus.close()
