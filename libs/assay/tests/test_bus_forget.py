"""A deleted tenant's records leave the embedded bus (`EmbeddedBus.forget`) from the
middle of its partitions: reads, stored positions, lag, truncation and the partition's
end offset all still hold across the holes, and another tenant's records are untouched."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from contextlib import closing
from pathlib import Path

from assay.bus.embedded import EmbeddedBus, EmbeddedSource, tenant_of
from assay.bus.relay import FileLock, OutboxRelay
from assay.bus.topics import TENANTS
from assay.bus.transport import BusMessage
from assay.record import EventRegistry, LogRecord, StateDelta
from assay.runtime.consumer import StageRunner
from assay.runtime.retention import truncate_bus
from assay.runtime.stage import StageSpec
from assay.store import CommitBatch, ConsumerPosition, OutboxEntry, SqliteEventLog
from assay.store.fs_blobs import FsBlobStore

TOPIC = "assay.episodes"
DLQ = "assay.dlq.verify"
GONE, KEPT = "tenant-gone", "tenant-kept"


def _nothing(_: LogRecord) -> list[StateDelta]:
    return []


def _all_of(tenant: str) -> dict[str, int]:
    """`forget`'s argument for every record of `tenant` published until now."""
    return {tenant: int(time.time() * 1000) + 1}


def _of(tenant: str, n: int, topic: str = TOPIC) -> OutboxEntry:
    return OutboxEntry(topic, "k", f"{tenant}/{n}".encode(), (("tenant", tenant.encode()),))


def _mixed(topic: str = TOPIC) -> list[OutboxEntry]:
    """Offsets 0-9: the kept tenant at 0, 1, 5 and 9, the deleted one at 2-4 and 6-8."""
    owners = [KEPT, KEPT, GONE, GONE, GONE, KEPT, GONE, GONE, GONE, KEPT]
    return [_of(t, i, topic) for i, t in enumerate(owners)]


async def _offsets(bus: EmbeddedBus, topic: str = TOPIC, start: int = 0) -> list[int]:
    return [m.offset for m in await bus.fetch(topic, 0, start, 1000, 0.0)]


async def test_a_tenants_records_leave_the_middle_of_a_partition_and_reads_cross_the_holes(
    tmp_path: Path,
) -> None:
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    await bus.publish(_mixed())
    await bus.publish([_of(GONE, 0, TENANTS)])
    kept_before = [m for m in await bus.fetch(TOPIC, 0, 0, 100, 0.0) if b"kept" in m.value]

    assert await bus.forget(_all_of(GONE), keep=(TENANTS,)) == 6
    assert await _offsets(bus) == [0, 1, 5, 9]
    assert [m for m in await bus.fetch(TOPIC, 0, 0, 100, 0.0)] == kept_before
    assert await _offsets(bus, start=2) == [5, 9]  # from inside a hole: the next record
    assert await _offsets(bus, start=6) == [9]
    assert [m.offset for m in await bus.fetch(TOPIC, 0, 2, 1, 0.0)] == [5]
    assert await _offsets(bus, TENANTS) == [0]  # the deletion's own topic is kept
    assert await bus.end_offsets(TOPIC) == {0: 10}
    assert await bus.forget(_all_of(GONE), keep=(TENANTS,)) == 0  # again: nothing left to delete

    await bus.close()  # the file says the same as the in-memory tail did
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    assert [m for m in await bus.fetch(TOPIC, 0, 0, 100, 0.0)] == kept_before
    assert await _offsets(bus, start=3) == [5, 9]
    await bus.close()


async def test_a_partition_whose_last_records_go_keeps_its_end_and_waits_past_them(
    tmp_path: Path,
) -> None:
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    await bus.publish([_of(KEPT, 0), *(_of(GONE, i) for i in range(1, 4))])
    assert await bus.forget(_all_of(GONE)) == 3
    assert await _offsets(bus) == [0]
    assert await bus.end_offsets(TOPIC) == {0: 4}

    # A reader past the last record waits for the next one instead of spinning.
    waiting = asyncio.create_task(bus.fetch(TOPIC, 0, 1, 100, 30.0))
    await asyncio.sleep(0)  # the reader is parked on the partition's wake-up
    assert not waiting.done()
    await bus.publish([_of(KEPT, 4)])
    got = await asyncio.wait_for(waiting, 5.0)
    assert [(m.offset, m.value) for m in got] == [(4, f"{KEPT}/4".encode())]
    started = time.monotonic()
    assert await bus.fetch(TOPIC, 0, 5, 100, 0.2) == []
    assert time.monotonic() - started >= 0.15  # it waited out its timeout

    # Every record of the partition gone: reopening still knows where it ends.
    await bus.publish([_of(GONE, 5)])
    assert await bus.forget(_all_of(GONE)) == 1
    await bus.close()
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    assert await bus.end_offsets(TOPIC) == {0: 6}
    await bus.publish([_of(KEPT, 6)])
    assert await _offsets(bus) == [0, 4, 6]  # offset 6 is new: none is given twice
    await bus.close()


async def test_a_stage_before_a_hole_reads_across_it_and_its_lag_counts_no_hole(
    tmp_path: Path,
) -> None:
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    handled: list[int] = []

    async def on_any(msg: object, uow: object) -> None:
        return None

    spec = StageSpec("reader", EventRegistry([]), _nothing, {TOPIC: {"Anything": on_any}})
    log = await SqliteEventLog(tmp_path / "reader.sqlite", spec.events, spec.fold).open()
    relay = OutboxRelay("reader", log, bus, FileLock(tmp_path / "relay.lock"))
    source = EmbeddedSource(bus, poll_s=0.05)
    runner = StageRunner(spec, log, FsBlobStore(tmp_path / "blobs"), relay, source)
    try:
        await bus.publish(_mixed())
        await log.commit(CommitBatch(position=ConsumerPosition(TOPIC, 0, 1)))  # read 0
        assert (await runner.lag())[(TOPIC, 0)] == 9
        await bus.forget(_all_of(GONE))
        # 1, 5 and 9 remain: the holes between them count until the stage passes them, as
        # in a compacted Kafka topic; a hole right after the position does not.
        assert (await runner.lag())[(TOPIC, 0)] == 9
        await log.commit(CommitBatch(position=ConsumerPosition(TOPIC, 0, 6)))  # read 5
        assert (await runner.lag())[(TOPIC, 0)] == 1  # 9 is next: 6-8 are a hole
        await log.commit(CommitBatch(position=ConsumerPosition(TOPIC, 0, 2)))  # read 1
        stop = asyncio.Event()

        async def handle(m: BusMessage) -> None:
            handled.append(m.offset)
            await log.commit(CommitBatch(position=ConsumerPosition(TOPIC, 0, m.offset + 1)))
            if m.offset == 9:
                stop.set()

        await asyncio.wait_for(source.consume([TOPIC], handle, log.positions, stop), 10.0)
        assert handled == [5, 9]
        assert (await log.positions())[(TOPIC, 0)] == 10
        assert (await runner.lag())[(TOPIC, 0)] == 0

        # The partition's last records deleted after the stage's position: no lag either.
        await bus.publish([_of(GONE, 10), _of(GONE, 11)])
        assert (await runner.lag())[(TOPIC, 0)] == 2
        await bus.forget(_all_of(GONE))
        assert (await runner.lag())[(TOPIC, 0)] == 0
    finally:
        await log.close()
        await bus.close()


async def test_truncation_after_a_tenants_records_left_keeps_what_a_stage_needs(
    tmp_path: Path,
) -> None:
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    stage = await SqliteEventLog(tmp_path / "s.sqlite", EventRegistry([]), _nothing).open()
    try:
        await bus.publish(_mixed())
        await bus.forget(_all_of(GONE))
        await stage.commit(CommitBatch(position=ConsumerPosition(TOPIC, 0, 6)))  # read 5
        now_ms = int(time.time() * 1000) + 1
        assert await truncate_bus(bus, {TOPIC: [stage]}, [TOPIC], now_ms) == 3  # 0, 1, 5
        assert await _offsets(bus) == [9]
        assert await _offsets(bus, start=6) == [9]
        assert await bus.end_offsets(TOPIC) == {0: 10}
    finally:
        await stage.close()
        await bus.close()


async def test_records_published_after_a_tenants_time_stay_until_a_later_call(
    tmp_path: Path,
) -> None:
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    await bus.publish([_of(GONE, 0), _of(KEPT, 1, DLQ)])
    with closing(sqlite3.connect(tmp_path / "bus.sqlite")) as db, db:
        db.execute("UPDATE records SET at_ms = at_ms - 60000")  # published a minute ago
    deleted_ms = int(time.time() * 1000) - 30_000  # the tenant was deleted half a minute ago
    await bus.publish([_of(GONE, 2, DLQ)])  # a late message's dead letter, say
    assert await bus.forget({GONE: deleted_ms}) == 1
    assert await _offsets(bus) == []
    assert await _offsets(bus, DLQ) == [0, 1]
    await bus.publish([_of(GONE, 3)])  # on a partition already read through: still late
    assert await bus.forget({GONE: deleted_ms}) == 0
    assert await _offsets(bus) == [1]
    assert await bus.forget(_all_of(GONE)) == 2  # their time came: the held ones go too
    assert [m.value for m in await bus.fetch(DLQ, 0, 0, 10, 0.0)] == [f"{KEPT}/1".encode()]
    assert await _offsets(bus) == []
    await bus.close()


async def test_records_of_a_file_from_before_get_their_tenant_from_the_envelope(
    tmp_path: Path,
) -> None:
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    bare = json.dumps({"tenant": GONE, "idempotency_key": "x"}).encode()
    await bus.publish([OutboxEntry(TOPIC, "k", bare), _of(KEPT, 1), _of(GONE, 2)])
    await bus.close()
    with closing(sqlite3.connect(tmp_path / "bus.sqlite")) as db, db:
        db.execute("ALTER TABLE records DROP COLUMN tenant")  # a file of before the column
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=1).open()
    assert await bus.forget(_all_of(GONE)) == 2
    assert await _offsets(bus) == [1]
    await bus.close()


def test_a_records_tenant_is_its_header_else_its_bodys() -> None:
    assert tenant_of(b"{}", (("tenant", b"t-1"),)) == "t-1"
    assert tenant_of(json.dumps({"tenant": "t-2"}).encode(), ()) == "t-2"
    assert tenant_of(b"not json", ()) == ""
    assert tenant_of(b"[1, 2]", ()) == ""
    assert tenant_of(json.dumps({"tenant": 3}).encode(), ()) == ""
