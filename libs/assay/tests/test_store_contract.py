"""Contract suites for the storage ports (§7, §8.2, §8.3): `EventLog` and `BlobStore`.

Each suite is written against the Protocol only. Adapters join by adding a name
to `EVENT_LOG_ADAPTERS` / `BLOB_STORE_ADAPTERS` and a branch to the fixture that
builds them; an adapter that passes is interchangeable. Tests that look inside
one adapter (its file, its pragmas) are at the end and say so in their name.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any, ClassVar

import blake3
import pytest
from pydantic import Field

from assay.devstack import Service
from assay.devstack.postgres import scratch_database
from assay.kernel.ids import BranchId, Lsn, MessageId, TenantId, tenant_id
from assay.record import (
    BranchKey,
    Delete,
    Event,
    EventRegistry,
    LogRecord,
    Patch,
    Put,
    StateDelta,
    StateKey,
)
from assay.store import (
    BadBlobRef,
    BlobStore,
    BranchDeletion,
    Checkpoint,
    CommitBatch,
    ConsumerPosition,
    DuplicateMessage,
    EventLog,
    FsBlobStore,
    LeaseLost,
    OutboxEntry,
    S3BlobStore,
    SqliteEventLog,
    StaleFence,
    StreamChanged,
    connect,
)
from assay.store.postgres import PostgresEventLog
from assay.store.sqlite import WAL_CHECKPOINT_PAGES, WAL_SIZE_LIMIT

EVENT_LOG_ADAPTERS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
BLOB_STORE_ADAPTERS = ["fs", pytest.param("s3", marks=pytest.mark.s3)]

# -- the suite's own events and fold ---------------------------------------------


class ItemPut(Event):
    type: ClassVar[str] = "contract.ItemPut"
    version: ClassVar[int] = 1
    item: str
    value: dict[str, Any]


class ItemChanged(Event):
    """Merge fields into an item, delete it, or (poison) make the fold fail."""

    type: ClassVar[str] = "contract.ItemChanged"
    version: ClassVar[int] = 1
    item: str
    fields: dict[str, Any] = Field(default_factory=dict)
    delete: bool = False
    poison: bool = False


class Renamed(Event):  # version 2 splits `name` in two
    type: ClassVar[str] = "contract.Renamed"
    version: ClassVar[int] = 1
    name: str


class RenamedV2(Event):
    type: ClassVar[str] = "contract.Renamed"
    version: ClassVar[int] = 2
    first: str
    last: str


class Restated(Event):
    """Put documents as they stand (what a tiering record does for the records it moves)."""

    type: ClassVar[str] = "contract.Restated"
    version: ClassVar[int] = 1
    documents: list[tuple[str, str, dict[str, Any]]]


class PoisonError(Exception):
    pass


def fold(record: LogRecord) -> list[StateDelta]:
    """Items by name, plus the last LSN seen per stream. Pure: reads the record only."""
    ev = record.event
    key = record.key
    last = Put(
        StateKey(key.tenant, "last", f"{key.stream}/{key.branch}"),
        {"lsn": record.lsn, "type": ev.type},
    )
    if isinstance(ev, ItemPut):
        return [Put(StateKey(key.tenant, "item", ev.item), dict(ev.value)), last]
    if isinstance(ev, ItemChanged):
        if ev.poison:
            raise PoisonError(f"poison event for {ev.item}")
        at = StateKey(key.tenant, "item", ev.item)
        return [Delete(at) if ev.delete else Patch(at, dict(ev.fields)), last]
    if isinstance(ev, Restated):
        return [Put(StateKey(key.tenant, kind, k), dict(v)) for kind, k, v in ev.documents]
    return [last]


REGISTRY = EventRegistry([ItemPut, ItemChanged, Renamed, Restated])


def new_tenant() -> TenantId:
    return tenant_id(uuid.uuid4())


def put(item: str, **value: Any) -> ItemPut:
    return ItemPut(item=item, value=value)


def poison(item: str = "p") -> ItemChanged:
    return ItemChanged(item=item, poison=True)


def main(tenant: TenantId, stream: str) -> BranchKey:
    return BranchKey.main(tenant, stream)


def on(key: BranchKey, *events: Event) -> CommitBatch:
    """A batch appending `events` to one stream."""
    return CommitBatch(records=[(key, e) for e in events])


# -- EventLog fixtures -----------------------------------------------------------


class LogOpener:
    """Opens the adapter's store — always the same one — with a given registry.

    `where` is a directory for SQLite and a database DSN for Postgres (each opener
    gets a schema of its own there).
    """

    def __init__(self, adapter: str, where: Path | str) -> None:
        self.adapter = adapter
        self._where = where
        self._schema = f"contract_{uuid.uuid4().hex[:12]}"
        self.opened: list[EventLog] = []

    async def open(self, registry: EventRegistry = REGISTRY) -> EventLog:
        log: EventLog
        if self.adapter == "sqlite":
            assert isinstance(self._where, Path)
            log = await SqliteEventLog(self._where / "stage.sqlite", registry, fold).open()
        elif self.adapter == "postgres":
            assert isinstance(self._where, str)
            log = await PostgresEventLog(self._where, self._schema, registry, fold).open()
        else:
            raise AssertionError(f"no such EventLog adapter: {self.adapter}")
        self.opened.append(log)
        return log

    async def close(self, log: EventLog) -> None:
        self.opened.remove(log)
        await log.close()


@pytest.fixture(scope="module")
def contract_database(postgres: Service) -> Iterator[str]:
    """A database of this module's own on the Postgres server (dropped at the end)."""
    with scratch_database(postgres, "assay_contract") as dsn:
        yield dsn


@pytest.fixture(params=EVENT_LOG_ADAPTERS)
async def opener(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LogOpener]:
    where: Path | str = tmp_path
    if request.param == "postgres":
        where = str(request.getfixturevalue("contract_database"))
    lo = LogOpener(str(request.param), where)
    yield lo
    for log in reversed(lo.opened):
        await log.close()


@pytest.fixture
async def event_log(opener: LogOpener) -> EventLog:
    return await opener.open()


async def assert_nothing_of(
    log: EventLog,
    inbox: tuple[TenantId, MessageId],
    topic: str,
    streams: list[str],
    items: list[str],
) -> None:
    """None of a failed batch's writes is visible (its streams, items, inbox id, topic)."""
    tenant = inbox[0]
    for stream in streams:
        assert await log.read(main(tenant, stream)) == []
    for name in items:
        assert await log.get(StateKey(tenant, "item", name)) is None
    assert not await log.seen(*inbox)
    assert all(t != topic for t, _ in await log.positions())
    assert all(p.entry.topic != topic for p in await log.drain_outbox(1000))


# -- leases and fencing (§9.4) ------------------------------------------------------


async def test_a_lease_is_granted_once_until_it_lapses_and_each_grant_bumps_the_fence(
    event_log: EventLog,
) -> None:
    tenant = new_tenant()
    a = await event_log.claim(tenant, "run-1", "worker-a", ttl_ms=300)
    assert a is not None
    assert (a.holder, a.fence) == ("worker-a", 1)
    assert await event_log.claim(tenant, "run-1", "worker-b", ttl_ms=300) is None
    again = await event_log.claim(tenant, "run-1", "worker-a", ttl_ms=300)  # a restart
    assert again is not None
    assert again.fence == 2
    await asyncio.sleep(0.5)  # lapsed
    b = await event_log.claim(tenant, "run-1", "worker-b", ttl_ms=10_000)
    assert b is not None
    assert (b.holder, b.fence) == ("worker-b", 3)
    # Another tenant's stream of the same name is another lease.
    other = await event_log.claim(new_tenant(), "run-1", "worker-a", ttl_ms=10_000)
    assert other is not None
    assert other.fence == 1


async def test_a_stale_fence_is_refused_and_writes_nothing(event_log: EventLog) -> None:
    tenant = new_tenant()
    key = main(tenant, "run-2")
    old = await event_log.claim(tenant, "run-2", "worker-a", ttl_ms=200)
    assert old is not None
    assert await event_log.commit(CommitBatch(records=[(key, put("a"))], fence=old)) == [0]
    await asyncio.sleep(0.4)
    new = await event_log.claim(tenant, "run-2", "worker-b", ttl_ms=10_000)
    assert new is not None
    inbox = (tenant, MessageId("m-stale"))
    stale = CommitBatch(
        records=[(key, put("stale"))],
        position=ConsumerPosition("stale.topic", 0, 7),
        inbox=inbox,
        outbox=[OutboxEntry("stale.topic", "k", b"v")],
        fence=old,
    )
    with pytest.raises(StaleFence, match="taken over"):
        await event_log.commit(stale)
    await assert_nothing_of(event_log, inbox, "stale.topic", [], ["stale"])
    assert [r.lsn for r in await event_log.read(key)] == [0]
    # The new holder's writes land where the old one's stopped.
    assert await event_log.commit(CommitBatch(records=[(key, put("b"))], fence=new)) == [1]
    with pytest.raises(LeaseLost):
        await event_log.renew(old, ttl_ms=1000)


async def test_a_stale_fence_in_a_group_commit_fails_alone(event_log: EventLog) -> None:
    tenant = new_tenant()
    old = await event_log.claim(tenant, "run-3", "worker-a", ttl_ms=100)
    assert old is not None
    await asyncio.sleep(0.3)
    new = await event_log.claim(tenant, "run-3", "worker-b", ttl_ms=10_000)
    assert new is not None
    key = main(tenant, "run-3")
    batches = [CommitBatch(records=[(main(tenant, f"free-{i}"), put(f"f{i}"))]) for i in range(5)]
    batches.insert(2, CommitBatch(records=[(key, put("old"))], fence=old))
    batches.insert(4, CommitBatch(records=[(key, put("new"))], fence=new))
    outcomes = await asyncio.gather(*(event_log.commit(b) for b in batches), return_exceptions=True)
    assert isinstance(outcomes[2], StaleFence)
    assert [o for i, o in enumerate(outcomes) if i != 2] == [[0]] * 6
    assert [r.event for r in await event_log.read(key)] == [put("new")]


async def test_renewal_extends_a_lease_from_the_database_clock(event_log: EventLog) -> None:
    tenant = new_tenant()
    lease = await event_log.claim(tenant, "run-4", "worker-a", ttl_ms=300)
    assert lease is not None
    for _ in range(4):
        await asyncio.sleep(0.15)
        lease = await event_log.renew(lease, ttl_ms=300)
    assert await event_log.claim(tenant, "run-4", "worker-b", ttl_ms=300) is None
    assert lease.fence == 1


async def test_lease_time_is_the_databases_not_the_callers(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = new_tenant()
    lease = await event_log.claim(tenant, "run-5", "worker-a", ttl_ms=60_000)
    assert lease is not None
    hour_later = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: hour_later)  # the worker's clock jumps
    assert await event_log.claim(tenant, "run-5", "worker-b", ttl_ms=60_000) is None


async def test_a_released_lease_is_free_at_once_and_fences_keep_growing(
    event_log: EventLog,
) -> None:
    tenant = new_tenant()
    a = await event_log.claim(tenant, "run-6", "worker-a", ttl_ms=60_000)
    assert a is not None
    await event_log.release(a)
    b = await event_log.claim(tenant, "run-6", "worker-b", ttl_ms=60_000)
    assert b is not None
    assert b.fence == a.fence + 1
    await event_log.release(a)  # a stale release changes nothing
    assert await event_log.claim(tenant, "run-6", "worker-c", ttl_ms=60_000) is None


# -- commit, LSNs, read ----------------------------------------------------------


async def test_commit_assigns_lsns_from_zero_per_tenant_stream_and_branch(
    event_log: EventLog,
) -> None:
    t1, t2 = new_tenant(), new_tenant()
    a = main(t1, "s1")
    a_fork = BranchKey(t1, "s1", BranchId(1))
    b = main(t1, "s2")
    other_tenant = main(t2, "s1")

    first = CommitBatch(records=[(a, put("x")), (a, put("y")), (a_fork, put("z")), (b, put("w"))])
    assert await event_log.commit(first) == [0, 1, 0, 0]
    second = CommitBatch(records=[(a, put("x")), (other_tenant, put("x")), (a_fork, put("z"))])
    assert await event_log.commit(second) == [2, 0, 1]
    assert await event_log.commit(on(b, put("v"))) == [1]

    assert [r.lsn for r in await event_log.read(a)] == [0, 1, 2]
    assert [r.lsn for r in await event_log.read(a_fork)] == [0, 1]
    assert [r.lsn for r in await event_log.read(b)] == [0, 1]
    assert [r.lsn for r in await event_log.read(other_tenant)] == [0]


async def test_read_returns_decoded_records_in_lsn_order_from_lsn(event_log: EventLog) -> None:
    key = main(new_tenant(), "run")
    events: list[Event] = [put(f"i{n}", n=n, tags=["a", "b"]) for n in range(5)]
    events.append(ItemChanged(item="i0", fields={"note": "ünïcödé"}))
    before = int(time.time() * 1000)
    await event_log.commit(on(key, *events[:3]))
    await event_log.commit(on(key, *events[3:]))
    after = int(time.time() * 1000)

    records = await event_log.read(key)
    assert [r.lsn for r in records] == list(range(6))
    assert [r.event for r in records] == events
    assert all(r.key == key and r.schema_version == 1 for r in records)
    assert isinstance(records[5].event, ItemChanged)
    assert all(before - 60_000 <= r.at_ms <= after + 60_000 for r in records)

    assert [r.lsn for r in await event_log.read(key, Lsn(3))] == [3, 4, 5]
    assert [r.event for r in await event_log.read(key, Lsn(2), limit=2)] == events[2:4]
    assert await event_log.read(key, Lsn(6)) == []
    assert await event_log.read(main(key.tenant, "never-written")) == []


async def test_branches_of_a_stream_by_tenant_then_branch_and_only_of_a_given_tenant(
    event_log: EventLog,
) -> None:
    a, b = sorted([new_tenant(), new_tenant()])  # as the stores order them: by UUID
    run = "run_1"
    fork = BranchKey(a, run, BranchId(2))
    await event_log.commit(
        CommitBatch(
            records=[
                (fork, put("x")),
                (main(a, run), put("x")),
                (main(a, run), put("y")),
                (main(b, run), put("x")),
                (main(a, "run_10"), put("x")),  # equality, not a prefix or a pattern
                (BranchKey(a, "runx1", BranchId(5)), put("x")),
            ]
        )
    )
    assert await event_log.branches(run, a) == [main(a, run), fork]
    assert await event_log.branches(run, b) == [main(b, run)]
    assert await event_log.branches(run) == [main(a, run), fork, main(b, run)]
    assert await event_log.branches(run, new_tenant()) == []
    assert await event_log.branches("never-written") == []


async def test_derived_state_reflects_the_fold_with_patch_and_delete(event_log: EventLog) -> None:
    tenant = new_tenant()
    key = main(tenant, "s")
    await event_log.commit(on(key, put("b2", v=2), put("a1", v=1, keep="yes"), put("b1", v=1)))
    await event_log.commit(on(key, put("c", v=3)))
    await event_log.commit(
        on(
            key,
            ItemChanged(item="a1", fields={"v": 10, "added": [1, 2]}),
            ItemChanged(item="c", delete=True),
            ItemChanged(item="new", fields={"made": True}),
            ItemChanged(item="gone", delete=True),
        )
    )

    def item(name: str) -> StateKey:
        return StateKey(tenant, "item", name)

    assert await event_log.get(item("a1")) == {"v": 10, "keep": "yes", "added": [1, 2]}
    assert await event_log.get(item("b2")) == {"v": 2}
    assert await event_log.get(item("c")) is None
    assert await event_log.get(item("gone")) is None
    assert await event_log.get(item("new")) == {"made": True}
    last = {"lsn": 7, "type": "contract.ItemChanged"}
    assert await event_log.get(StateKey(tenant, "last", "s/0")) == last

    everything = await event_log.scan(tenant, "item")
    assert [k for k, _ in everything] == ["a1", "b1", "b2", "new"]
    assert await event_log.scan(tenant, "item", "b") == [("b1", {"v": 1}), ("b2", {"v": 2})]
    assert await event_log.scan(tenant, "item", "zzz") == []
    assert await event_log.scan(tenant, "no-such-kind") == []


async def test_scan_prefix_is_literal_not_a_pattern(event_log: EventLog) -> None:
    tenant = new_tenant()
    key = main(tenant, "s")
    names = ["a_1", "ab1", "a%2", "aX2", "a/b", "a.b"]
    await event_log.commit(on(key, *(put(n) for n in names)))
    for prefix in ["a_", "a%", "a/", "a."]:
        found = {k for k, _ in await event_log.scan(tenant, "item", prefix)}
        assert found == {n for n in names if n.startswith(prefix)}, prefix


# -- atomicity -------------------------------------------------------------------


async def test_scan_kind_reads_one_kind_across_tenants_without_deleted_documents(
    event_log: EventLog,
) -> None:
    t1, t2 = new_tenant(), new_tenant()
    await event_log.commit(on(main(t1, "s"), put("a", v=1), put("b", v=2)))
    await event_log.commit(on(main(t2, "s"), put("a", v=3)))
    await event_log.commit(on(main(t1, "s"), ItemChanged(item="b", delete=True)))
    found = {(t, k, d.get("v")) for t, k, d in await event_log.scan_kind("item")}
    assert found == {(t1, "a", 1), (t2, "a", 3)}
    assert all(k != "item" for _, k, _ in await event_log.scan_kind("last"))


async def test_batch_whose_fold_raises_writes_nothing(event_log: EventLog) -> None:
    tenant = new_tenant()
    key, other = main(tenant, "s"), main(tenant, "s2")
    inbox = (tenant, MessageId("m-poison"))
    batch = CommitBatch(
        records=[(key, put("fine")), (other, put("also-fine")), (key, poison())],
        position=ConsumerPosition("poison-topic", 3, 42),
        inbox=inbox,
        outbox=[OutboxEntry("poison-topic", "k", b"v")],
    )
    with pytest.raises(PoisonError):
        await event_log.commit(batch)

    await assert_nothing_of(event_log, inbox, "poison-topic", ["s", "s2"], ["fine", "also-fine"])
    # Nothing was remembered, so the same message can be handled properly later.
    healed = CommitBatch(records=[(key, put("fine"))], inbox=inbox)
    assert await event_log.commit(healed) == [0]
    assert await event_log.seen(*inbox)


async def test_poisoned_batch_in_a_group_commit_leaves_the_others_intact(
    event_log: EventLog,
) -> None:
    tenant = new_tenant()
    shared = main(tenant, "shared")
    bad = 5  # the poisoned batch

    def batch(i: int) -> CommitBatch:
        records: list[tuple[BranchKey, Event]] = [
            (shared, put(f"s{i}", i=i)),
            (main(tenant, f"own-{i}"), put(f"o{i}")),
        ]
        if i == bad:
            records.append((shared, poison()))
        topic = "poison-topic" if i == bad else f"topic-{i}"
        return CommitBatch(
            records=records,
            position=ConsumerPosition(topic, 0, i + 1),
            inbox=(tenant, MessageId(f"m{i}")),
            outbox=[OutboxEntry(topic, f"k{i}", f"v{i}".encode())],
        )

    results = await asyncio.gather(
        *(event_log.commit(batch(i)) for i in range(10)), return_exceptions=True
    )
    assert isinstance(results[bad], PoisonError)
    good = [i for i in range(10) if i != bad]
    inbox = (tenant, MessageId(f"m{bad}"))
    await assert_nothing_of(
        event_log, inbox, "poison-topic", [f"own-{bad}"], [f"s{bad}", f"o{bad}"]
    )
    # The poisoned batch burned no LSN on the stream it shared: the good ones are dense.
    shared_records = await event_log.read(shared)
    assert [r.lsn for r in shared_records] == list(range(len(good)))
    by_lsn = {r.lsn: r.event for r in shared_records}
    for i in good:
        lsns = results[i]
        assert isinstance(lsns, list)
        assert lsns[1] == 0
        assert by_lsn[lsns[0]] == put(f"s{i}", i=i)
        assert await event_log.seen(tenant, MessageId(f"m{i}"))
        assert await event_log.get(StateKey(tenant, "item", f"o{i}")) == {}
    assert await event_log.positions() == {(f"topic-{i}", 0): i + 1 for i in good}
    assert [p.entry.key for p in await event_log.drain_outbox(100)] == [f"k{i}" for i in good]


# -- inbox -----------------------------------------------------------------------


async def test_duplicate_message_raises_and_writes_nothing_of_the_second_batch(
    event_log: EventLog,
) -> None:
    a, b = new_tenant(), new_tenant()
    mid = MessageId("msg-1")
    key = main(a, "s")
    first = CommitBatch(
        records=[(key, put("x", n=1))],
        position=ConsumerPosition("in", 0, 1),
        inbox=(a, mid),
        outbox=[OutboxEntry("out", "k", b"first")],
    )
    assert await event_log.commit(first) == [0]
    assert await event_log.seen(a, mid)

    again = CommitBatch(
        records=[(key, put("x", n=2)), (main(a, "other"), put("y"))],
        position=ConsumerPosition("in", 0, 2),
        inbox=(a, mid),
        outbox=[OutboxEntry("out", "k", b"second")],
    )
    with pytest.raises(DuplicateMessage):
        await event_log.commit(again)

    assert [r.event for r in await event_log.read(key)] == [put("x", n=1)]
    assert await event_log.read(main(a, "other")) == []
    assert await event_log.get(StateKey(a, "item", "x")) == {"n": 1}
    assert await event_log.get(StateKey(a, "item", "y")) is None
    assert await event_log.positions() == {("in", 0): 1}
    assert [p.entry.value for p in await event_log.drain_outbox(10)] == [b"first"]

    # The same id under another tenant is another message.
    assert not await event_log.seen(b, mid)
    assert await event_log.commit(CommitBatch(records=[(main(b, "s"), put("x"))], inbox=(b, mid)))
    assert await event_log.seen(b, mid)


async def test_concurrent_duplicates_in_one_group_commit_land_once(event_log: EventLog) -> None:
    tenant = new_tenant()
    key = main(tenant, "s")
    batches = [
        CommitBatch(records=[(key, put("x", n=i))], inbox=(tenant, MessageId("same")))
        for i in range(4)
    ]
    results = await asyncio.gather(*(event_log.commit(b) for b in batches), return_exceptions=True)
    assert sum(isinstance(r, DuplicateMessage) for r in results) == 3
    assert [r for r in results if not isinstance(r, BaseException)] == [[0]]
    assert len(await event_log.read(key)) == 1


# -- positions, outbox, checkpoints ----------------------------------------------


async def test_positions_are_stored_and_overwritten_by_topic_and_partition(
    event_log: EventLog,
) -> None:
    assert await event_log.positions() == {}
    assert await event_log.commit(CommitBatch()) == []
    assert await event_log.commit(CommitBatch(position=ConsumerPosition("t", 0, 5))) == []
    await event_log.commit(CommitBatch(position=ConsumerPosition("t", 1, 3)))
    await event_log.commit(CommitBatch(position=ConsumerPosition("u", 0, 7)))
    await event_log.commit(CommitBatch(position=ConsumerPosition("t", 0, 9)))
    assert await event_log.positions() == {("t", 0): 9, ("t", 1): 3, ("u", 0): 7}


async def test_outbox_drains_in_commit_order_byte_exact_and_acks_remove(
    event_log: EventLog,
) -> None:
    headers = (
        ("id", b"abc"),
        ("binary", bytes(range(256))),
        ("utf8", "ünïcödé ✓".encode()),
        ("empty", b""),
        ("id", b"repeated"),
    )
    entries = [
        OutboxEntry("t1", "k1", b"\x00\xff first", headers),
        OutboxEntry("t2", "k2", "zwei ✓".encode()),
        OutboxEntry("t1", "k1", b"third"),
        OutboxEntry("t1", "k3", b"", (("h", b"\x80"),)),
        OutboxEntry("t3", "", b"fifth"),
    ]
    key = main(new_tenant(), "s")
    await event_log.commit(CommitBatch(records=[(key, put("a"))], outbox=entries[:2]))
    await event_log.commit(CommitBatch(outbox=entries[2:3]))
    await event_log.commit(CommitBatch(position=ConsumerPosition("x", 0, 1)))
    await event_log.commit(CommitBatch(outbox=entries[3:]))

    pending = await event_log.drain_outbox(100)
    assert [p.entry for p in pending] == entries
    assert pending[0].entry.headers == headers
    seqs = [p.seq for p in pending]
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == len(seqs)
    assert await event_log.drain_outbox(2) == pending[:2]
    assert await event_log.drain_outbox(100) == pending  # draining does not consume

    await event_log.ack_outbox([])
    await event_log.ack_outbox(seqs[:2])
    assert await event_log.drain_outbox(100) == pending[2:]
    await event_log.ack_outbox(seqs[2:])
    assert await event_log.drain_outbox(100) == []

    # A seq names one row forever: repeating an ack never removes a later row.
    later = OutboxEntry("t1", "k1", b"later")
    await event_log.commit(CommitBatch(outbox=[later]))
    await event_log.ack_outbox(seqs)
    assert [p.entry for p in await event_log.drain_outbox(100)] == [later]


async def test_an_ack_of_rows_with_gaps_between_them_removes_those_rows_only(
    event_log: EventLog,
) -> None:
    entries = [OutboxEntry("gaps", f"k{i}", b"%d" % i, (("n", b"%d" % i),)) for i in range(6)]
    await event_log.commit(CommitBatch(outbox=entries))
    pending = [p for p in await event_log.drain_outbox(1000) if p.entry.topic == "gaps"]
    assert [p.entry for p in pending] == entries

    await event_log.ack_outbox([pending[0].seq, pending[2].seq, pending[3].seq, pending[5].seq])
    left = [p for p in await event_log.drain_outbox(1000) if p.entry.topic == "gaps"]
    assert left == [pending[1], pending[4]]


async def test_checkpoints_newest_at_or_below_and_delete(event_log: EventLog) -> None:
    tenant = new_tenant()
    a, a_fork, b = main(tenant, "a"), BranchKey(tenant, "a", BranchId(1)), main(tenant, "b")
    assert await event_log.latest_checkpoint(a) is None
    for n in (3, 7, 12):
        await event_log.put_checkpoint(a, Lsn(n), f"a@{n}".encode())
    await event_log.put_checkpoint(a_fork, Lsn(5), b"fork@5")
    await event_log.put_checkpoint(b, Lsn(1), b"\x00b@1")

    def upto(cp: Checkpoint | None) -> int:
        assert cp is not None
        return cp.upto

    assert upto(await event_log.latest_checkpoint(a, Lsn(10))) == 7
    assert upto(await event_log.latest_checkpoint(a, Lsn(7))) == 7
    assert upto(await event_log.latest_checkpoint(a, Lsn(100))) == 12
    assert upto(await event_log.latest_checkpoint(a)) == 12
    assert await event_log.latest_checkpoint(a, Lsn(2)) is None
    assert await event_log.latest_checkpoint(a, Lsn(3)) == Checkpoint(a, Lsn(3), b"a@3")
    assert await event_log.latest_checkpoint(a_fork) == Checkpoint(a_fork, Lsn(5), b"fork@5")

    await event_log.put_checkpoint(a, Lsn(7), b"a@7 again")
    assert await event_log.latest_checkpoint(a, Lsn(8)) == Checkpoint(a, Lsn(7), b"a@7 again")

    await event_log.delete_checkpoints(a)
    assert await event_log.latest_checkpoint(a) is None
    assert await event_log.latest_checkpoint(a_fork) is not None
    assert await event_log.latest_checkpoint(b) == Checkpoint(b, Lsn(1), b"\x00b@1")
    await event_log.delete_checkpoints(main(tenant, "never"))


# -- rebuild, group commit, upcasting, tenancy -----------------------------------


async def test_rebuild_of_an_untouched_store_is_identical(event_log: EventLog) -> None:
    empty = await event_log.rebuild(keep=False)
    assert (empty.identical, empty.records, empty.documents_before) == (True, 0, 0)

    t1, t2 = new_tenant(), new_tenant()
    await event_log.commit(on(main(t1, "s"), put("a", v=1), put("b")))
    changes = [ItemChanged(item="a", fields={"w": 2}), ItemChanged(item="b", delete=True)]
    await event_log.commit(on(main(t1, "s"), *changes))
    await event_log.commit(on(main(t2, "s"), put("a", v=9)))
    state_before = await event_log.scan(t1, "item") + await event_log.scan(t2, "item")

    report = await event_log.rebuild(keep=False)
    assert (report.identical, report.differences, report.records) == (True, [], 5)
    # t1: item a + last/s/0; t2: item a + last/s/0.
    assert report.documents_before == report.documents_after == 4
    assert (await event_log.rebuild(keep=True)).identical
    assert await event_log.scan(t1, "item") + await event_log.scan(t2, "item") == state_before


async def test_group_commit_gives_each_of_200_concurrent_commits_its_own_lsn(
    event_log: EventLog,
) -> None:
    tenant = new_tenant()
    shared = main(tenant, "shared")
    n = 200

    def batch(i: int) -> CommitBatch:
        records: list[tuple[BranchKey, Event]] = [(shared, put("s", i=i))]
        records.append((main(tenant, f"own-{i}"), put(f"o{i}")))
        return CommitBatch(records=records, inbox=(tenant, MessageId(f"m{i}")))

    results = await asyncio.gather(*(event_log.commit(batch(i)) for i in range(n)))
    assert sorted(r[0] for r in results) == list(range(n))
    assert all(r[1] == 0 for r in results)
    records = await event_log.read(shared, limit=1000)
    assert [r.lsn for r in records] == list(range(n))
    for i, lsns in enumerate(results):
        assert records[lsns[0]].event == put("s", i=i)
    assert (await event_log.rebuild(keep=False)).identical


async def test_records_are_upcast_on_read(opener: LogOpener) -> None:
    key = main(new_tenant(), "s")
    old = await opener.open(EventRegistry([Renamed]))
    await old.commit(on(key, Renamed(name="Ada Lovelace")))
    assert [r.event for r in await old.read(key)] == [Renamed(name="Ada Lovelace")]
    await opener.close(old)

    registry = EventRegistry([RenamedV2])

    @registry.upcaster("contract.Renamed", 1)
    def split(payload: dict[str, Any]) -> dict[str, Any]:
        first, _, last = payload["name"].partition(" ")
        return {"first": first, "last": last}

    new = await opener.open(registry)
    await new.commit(on(key, RenamedV2(first="Grace", last="Hopper")))
    records = await new.read(key)
    assert [r.event for r in records] == [
        RenamedV2(first="Ada", last="Lovelace"),
        RenamedV2(first="Grace", last="Hopper"),
    ]
    assert all(isinstance(r.event, RenamedV2) for r in records)
    # Storage is never rewritten: each record keeps the version it was written at.
    assert [r.schema_version for r in records] == [1, 2]


async def test_reads_under_one_tenant_never_see_another_tenants_data(
    event_log: EventLog,
) -> None:
    a, b = new_tenant(), new_tenant()
    records: list[tuple[BranchKey, Event]] = [(main(a, "s"), put("secret", v="a"))]
    records.append((main(a, "only-a"), put("x")))
    await event_log.commit(CommitBatch(records=records, inbox=(a, MessageId("m"))))
    await event_log.put_checkpoint(main(a, "s"), Lsn(0), b"a-state")
    await event_log.commit(on(main(b, "s"), put("mine", v="b")))

    b_records = await event_log.read(main(b, "s"))
    assert [(r.lsn, r.event) for r in b_records] == [(0, put("mine", v="b"))]
    assert all(r.key.tenant == b for r in b_records)
    assert await event_log.read(main(b, "only-a")) == []
    assert await event_log.get(StateKey(b, "item", "secret")) is None
    assert await event_log.scan(b, "item") == [("mine", {"v": "b"})]
    assert await event_log.scan(b, "last") == [("s/0", {"lsn": 0, "type": "contract.ItemPut"})]
    assert not await event_log.seen(b, MessageId("m"))
    assert await event_log.latest_checkpoint(main(b, "s")) is None
    assert await event_log.scan(a, "item") == [("secret", {"v": "a"}), ("x", {})]


# -- deleting branches (tiering, §8.6) ---------------------------------------------


async def test_a_deletion_moves_a_branch_out_in_the_commit_that_appends_its_tombstone(
    event_log: EventLog,
) -> None:
    tenant = new_tenant()
    a, a_fork, b, tomb = (
        main(tenant, "a"),
        BranchKey(tenant, "a", BranchId(1)),
        main(tenant, "b"),
        main(tenant, "a/tomb"),
    )
    await event_log.commit(on(a, put("x", n=1), put("y"), ItemChanged(item="x", fields={"m": 2})))
    await event_log.commit(CommitBatch(records=[(a_fork, put("z")), (b, put("w"))]))
    await event_log.put_checkpoint(a, Lsn(1), b"a@1")
    documents = await event_log.scan(tenant, "item")

    batch = CommitBatch(
        records=[(tomb, put("moved", to="archive"))],
        deletions=[BranchDeletion(a, Lsn(3))],
        position=ConsumerPosition("in", 0, 5),
        inbox=(tenant, MessageId("tier-a")),
        outbox=[OutboxEntry("out", "k", b"tiered")],
    )
    assert await event_log.commit(batch) == [0]

    assert await event_log.read(a) == []
    assert await event_log.latest_checkpoint(a) is None
    assert await event_log.branches("a", tenant) == [a_fork]  # the other branch stays
    assert [r.event for r in await event_log.read(b)] == [put("w")]
    assert [r.event for r in await event_log.read(tomb)] == [put("moved", to="archive")]
    # The fold is not run backwards: what the moved records folded to is still there.
    assert await event_log.scan(tenant, "item") == sorted(
        [*documents, ("moved", {"to": "archive"})]
    )
    assert await event_log.seen(tenant, MessageId("tier-a"))
    assert await event_log.positions() == {("in", 0): 5}
    assert [p.entry.value for p in await event_log.drain_outbox(10)] == [b"tiered"]


async def test_a_deletion_of_a_branch_that_moved_on_writes_nothing(event_log: EventLog) -> None:
    tenant = new_tenant()
    a, tomb = main(tenant, "a"), main(tenant, "a/tomb")
    await event_log.commit(on(a, put("x"), put("y")))
    inbox = (tenant, MessageId("tier"))
    for end in (1, 3):  # read before the last append; or a record it never saw
        stale = CommitBatch(
            records=[(tomb, put("moved"))],
            deletions=[BranchDeletion(a, Lsn(end))],
            position=ConsumerPosition("tier.topic", 0, 1),
            inbox=inbox,
            outbox=[OutboxEntry("tier.topic", "k", b"v")],
        )
        with pytest.raises(StreamChanged, match="holds 2 records"):
            await event_log.commit(stale)
        await assert_nothing_of(event_log, inbox, "tier.topic", ["a/tomb"], ["moved"])
        assert [r.lsn for r in await event_log.read(a)] == [0, 1]
    await event_log.commit(CommitBatch(deletions=[BranchDeletion(a, Lsn(2))]))
    with pytest.raises(StreamChanged):  # already gone: a second mover finds nothing to move
        await event_log.commit(CommitBatch(deletions=[BranchDeletion(a, Lsn(2))]))


async def test_a_deletion_refused_by_its_inbox_or_fence_deletes_nothing(
    event_log: EventLog,
) -> None:
    tenant = new_tenant()
    a = main(tenant, "a")
    await event_log.commit(CommitBatch(records=[(a, put("x"))], inbox=(tenant, MessageId("m"))))
    with pytest.raises(DuplicateMessage):
        await event_log.commit(
            CommitBatch(deletions=[BranchDeletion(a, Lsn(1))], inbox=(tenant, MessageId("m")))
        )
    old = await event_log.claim(tenant, "a", "worker-a", ttl_ms=100)
    assert old is not None
    await asyncio.sleep(0.3)
    assert await event_log.claim(tenant, "a", "worker-b", ttl_ms=10_000) is not None
    with pytest.raises(StaleFence):
        await event_log.commit(CommitBatch(deletions=[BranchDeletion(a, Lsn(1))], fence=old))
    assert [r.event for r in await event_log.read(a)] == [put("x")]


async def test_a_deleted_branch_written_again_starts_over_at_lsn_zero(
    event_log: EventLog,
) -> None:
    tenant = new_tenant()
    a = main(tenant, "a")
    await event_log.commit(on(a, put("x"), put("y")))
    await event_log.commit(CommitBatch(deletions=[BranchDeletion(a, Lsn(2))]))
    assert await event_log.commit(on(a, put("z"))) == [0]
    assert [r.event for r in await event_log.read(a)] == [put("z")]


async def test_rebuild_after_a_deletion_is_identical_when_the_tombstone_restates_the_documents(
    event_log: EventLog,
) -> None:
    tenant = new_tenant()
    a, other = main(tenant, "a"), main(tenant, "other")
    await event_log.commit(on(a, put("x", n=1), ItemChanged(item="x", fields={"m": 2})))
    await event_log.commit(on(other, put("o")))
    await event_log.commit(CommitBatch(deletions=[BranchDeletion(a, Lsn(2))]))
    # Without a restatement, what the moved records folded to has no record left.
    report = await event_log.rebuild(keep=False)
    assert report.differences == [
        f"{tenant}/item/x: missing after rebuild",
        f"{tenant}/last/a/0: missing after rebuild",
    ]
    await event_log.rebuild(keep=True)  # the state is what the log says again

    b = main(tenant, "b")
    await event_log.commit(on(b, put("y", v=[1, 2.5, "ü"]), put("z")))
    documents = [
        (kind, key, doc)
        for kind in ("item", "last")
        for key, doc in await event_log.scan(tenant, kind)
        if key in ("y", "z", "b/0")
    ]
    tomb = CommitBatch(
        records=[(main(tenant, "b/tomb"), Restated(documents=documents))],
        deletions=[BranchDeletion(b, Lsn(2))],
    )
    await event_log.commit(tomb)
    assert await event_log.read(b) == []
    report = await event_log.rebuild(keep=False)
    assert (report.identical, report.differences) == (True, [])


async def test_a_deletion_among_concurrent_commits_leaves_them_dense_and_intact(
    event_log: EventLog,
) -> None:
    tenant = new_tenant()
    doomed, shared = main(tenant, "doomed"), main(tenant, "shared")
    await event_log.commit(on(doomed, put("d0"), put("d1")))
    batches = [CommitBatch(records=[(shared, put("s", i=i))]) for i in range(20)]
    batches.insert(7, CommitBatch(deletions=[BranchDeletion(doomed, Lsn(2))]))
    results = await asyncio.gather(*(event_log.commit(b) for b in batches))
    assert sorted(r[0] for r in results if r) == list(range(20))
    assert [r.lsn for r in await event_log.read(shared)] == list(range(20))
    assert await event_log.read(doomed) == []


async def test_a_deletion_never_touches_another_tenants_stream_of_the_same_name(
    event_log: EventLog,
) -> None:
    a, b = new_tenant(), new_tenant()
    await event_log.commit(on(main(a, "s"), put("x")))
    await event_log.commit(on(main(b, "s"), put("x"), put("y")))
    await event_log.put_checkpoint(main(b, "s"), Lsn(0), b"b@0")
    await event_log.commit(CommitBatch(deletions=[BranchDeletion(main(a, "s"), Lsn(1))]))
    assert await event_log.read(main(a, "s")) == []
    assert [r.event for r in await event_log.read(main(b, "s"))] == [put("x"), put("y")]
    assert await event_log.latest_checkpoint(main(b, "s")) is not None
    with pytest.raises(StreamChanged):  # a's deletion counted b's records: it does not
        await event_log.commit(CommitBatch(deletions=[BranchDeletion(main(a, "s"), Lsn(2))]))


# -- compare-and-swap on a branch's end (CommitBatch.expect) -------------------------


async def test_an_expected_end_that_holds_commits_at_exactly_that_lsn(event_log: EventLog) -> None:
    tenant = new_tenant()
    a = main(tenant, "alloc")
    assert await event_log.commit(CommitBatch(records=[(a, put("g1"))], expect=[(a, Lsn(0))])) == [
        0
    ]
    batch = CommitBatch(records=[(a, put("g2")), (a, put("g2b"))], expect=[(a, Lsn(1))])
    assert await event_log.commit(batch) == [1, 2]


async def test_an_expected_end_that_moved_writes_nothing(event_log: EventLog) -> None:
    tenant = new_tenant()
    a = main(tenant, "alloc")
    await event_log.commit(on(a, put("x"), put("y")))
    inbox = (tenant, MessageId("cas"))
    for end in (1, 3):  # read before the last append; or past the end
        stale = CommitBatch(
            records=[(a, put("lost")), (main(tenant, "other"), put("lost2"))],
            expect=[(a, Lsn(end))],
            position=ConsumerPosition("cas.topic", 0, 1),
            inbox=inbox,
            outbox=[OutboxEntry("cas.topic", "k", b"v")],
        )
        with pytest.raises(StreamChanged, match=f"ends at 2, not {end}"):
            await event_log.commit(stale)
        await assert_nothing_of(event_log, inbox, "cas.topic", ["other"], ["lost", "lost2"])
        assert [r.lsn for r in await event_log.read(a)] == [0, 1]


async def test_an_expectation_on_a_branch_the_batch_does_not_write_is_refused(
    event_log: EventLog,
) -> None:
    tenant = new_tenant()
    batch = CommitBatch(
        records=[(main(tenant, "b"), put("x"))], expect=[(main(tenant, "a"), Lsn(0))]
    )
    with pytest.raises(ValueError, match="must append"):
        await event_log.commit(batch)
    assert await event_log.read(main(tenant, "b")) == []


async def test_writers_that_read_the_same_end_land_once(opener: LogOpener) -> None:
    """Replicas of a single-writer stage decided on the same state: one wins each round."""
    logs = [await opener.open() for _ in range(3)]
    tenant = new_tenant()
    a = main(tenant, "alloc")
    await logs[0].commit(on(a, put("g1")))
    for end in range(1, 6):
        outcomes = await asyncio.gather(
            *(
                log.commit(CommitBatch(records=[(a, put(f"g{end}-{i}"))], expect=[(a, Lsn(end))]))
                for i, log in enumerate(logs)
            ),
            return_exceptions=True,
        )
        won = [o for o in outcomes if isinstance(o, list)]
        assert won == [[end]], outcomes
        assert all(isinstance(o, StreamChanged) for o in outcomes if not isinstance(o, list))
    assert [r.lsn for r in await logs[1].read(a)] == list(range(6))


# -- SQLite adapter specifics ----------------------------------------------------


@pytest.fixture
async def sqlite_log(tmp_path: Path) -> AsyncIterator[SqliteEventLog]:
    log = await SqliteEventLog(tmp_path / "stage.sqlite", REGISTRY, fold).open()
    yield log
    await log.close()


async def test_sqlite_rebuild_reports_tampering_and_keep_repairs_it(
    sqlite_log: SqliteEventLog, tmp_path: Path
) -> None:
    tenant = new_tenant()
    key = main(tenant, "s")
    await sqlite_log.commit(on(key, put("changed", v=1), put("dropped", v=2)))
    good = {k: v for k, v in await sqlite_log.scan(tenant, "item")}

    with closing(connect(tmp_path / "stage.sqlite")) as db:
        db.execute("UPDATE state SET value=? WHERE key='changed'", (b'{"v":666}',))
        db.execute("DELETE FROM state WHERE key='dropped'")
        db.execute("INSERT INTO state VALUES (?, 'item', 'invented', ?)", (str(tenant), b"{}"))

    report = await sqlite_log.rebuild(keep=False)
    assert not report.identical
    assert (report.records, report.documents_before, report.documents_after) == (2, 3, 3)
    assert sorted(report.differences) == sorted(
        [
            f"{tenant}/item/changed: differs",
            f"{tenant}/item/dropped: missing from the stored state",
            f"{tenant}/item/invented: missing after rebuild",
        ]
    )
    # keep=False left the tampered state in place.
    assert await sqlite_log.get(StateKey(tenant, "item", "changed")) == {"v": 666}

    repaired = await sqlite_log.rebuild(keep=True)
    assert repaired.differences == report.differences
    assert {k: v for k, v in await sqlite_log.scan(tenant, "item")} == good
    assert (await sqlite_log.rebuild(keep=False)).identical


async def test_sqlite_group_commit_coalesces_concurrent_commits(
    sqlite_log: SqliteEventLog,
) -> None:
    statements: list[str] = []
    conn = sqlite_log._conn
    assert conn is not None
    conn.set_trace_callback(statements.append)
    try:
        tenant = new_tenant()
        results = await asyncio.gather(
            *(sqlite_log.commit(on(main(tenant, "s"), put("x", i=i))) for i in range(200))
        )
    finally:
        conn.set_trace_callback(None)
    assert sorted(r[0] for r in results) == list(range(200))
    commits = [s for s in statements if s.strip().upper() == "COMMIT"]
    assert 1 <= len(commits) < 20, len(commits)


async def test_sqlite_connections_are_wal_and_synchronous_full(
    sqlite_log: SqliteEventLog, tmp_path: Path
) -> None:
    with closing(connect(tmp_path / "fresh.sqlite")) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == WAL_CHECKPOINT_PAGES
        assert conn.execute("PRAGMA journal_size_limit").fetchone()[0] == WAL_SIZE_LIMIT
    # WAL is a property of the file: the log's own file is in WAL for any opener.
    with closing(sqlite3.connect(tmp_path / "stage.sqlite")) as plain:
        assert plain.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# -- BlobStore -------------------------------------------------------------------


@pytest.fixture(params=BLOB_STORE_ADAPTERS)
async def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BlobStore]:
    if request.param == "fs":
        store = FsBlobStore(tmp_path / "blobs")
        yield store
        await store.close()
    elif request.param == "s3":
        s3: Service = request.getfixturevalue("s3")
        bucket = f"assay-contract-{uuid.uuid4().hex}"
        s3_store = S3BlobStore(
            s3.address,
            bucket,
            access_key_id=s3.details["access_key_id"],
            secret_access_key=s3.details["secret_access_key"],
            region=s3.details["region"],
        )
        await s3_store.open()
        yield s3_store
        await s3_store.close()
        await drop_bucket(s3.address, s3.details, bucket)
    else:
        raise AssertionError(f"no such BlobStore adapter: {request.param}")


async def drop_bucket(endpoint: str, details: dict[str, str], bucket: str) -> None:
    """Empty and remove a test's bucket, so a shared S3 endpoint is left as it was."""
    import aioboto3
    from aiobotocore.config import AioConfig

    session = aioboto3.Session(
        aws_access_key_id=details["access_key_id"],
        aws_secret_access_key=details["secret_access_key"],
        region_name=details["region"],
    )
    path_style = AioConfig(s3={"addressing_style": "path"})
    async with session.client("s3", endpoint_url=endpoint, config=path_style) as client:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        async for page in pages:
            if contents := page.get("Contents", []):
                await client.delete_objects(
                    Bucket=bucket, Delete={"Objects": [{"Key": o["Key"]} for o in contents]}
                )
        await client.delete_bucket(Bucket=bucket)


def blake3_hex(content: bytes) -> str:
    return str(blake3.blake3(content).hexdigest())


async def test_blob_put_is_content_addressed(blobs: BlobStore) -> None:
    tenant = new_tenant()
    content = b"episode \x00\xff bytes"
    ref = await blobs.put(tenant, content)
    assert ref == blake3_hex(content)
    assert len(ref) == 64
    assert await blobs.put(tenant, content) == ref
    assert await blobs.put(tenant, content + b"!") != ref
    assert await blobs.get(tenant, ref) == content

    big = bytes(range(256)) * 8192
    big_ref = await blobs.put(tenant, big)
    assert await blobs.get(tenant, big_ref) == big
    assert await blobs.get(tenant, await blobs.put(tenant, b"")) == b""


async def test_concurrent_puts_of_one_content_all_succeed(blobs: BlobStore) -> None:
    # Siblings of a rollout group write identical workspace snapshots at once.
    tenant = new_tenant()
    content = bytes(range(256)) * 4096
    refs = await asyncio.gather(*(blobs.put(tenant, content) for _ in range(16)))
    assert set(refs) == {blake3_hex(content)}
    assert await blobs.get(tenant, refs[0]) == content


async def test_blob_missing_and_deleted_read_as_none(blobs: BlobStore) -> None:
    tenant = new_tenant()
    assert await blobs.get(tenant, blake3_hex(b"never stored")) is None
    ref = await blobs.put(tenant, b"short-lived")
    await blobs.delete(tenant, ref)
    assert await blobs.get(tenant, ref) is None
    await blobs.delete(tenant, ref)
    await blobs.delete(tenant, blake3_hex(b"never stored"))
    assert await blobs.put(tenant, b"short-lived") == ref
    assert await blobs.get(tenant, ref) == b"short-lived"


async def test_blobs_are_namespaced_per_tenant(blobs: BlobStore) -> None:
    a, b = new_tenant(), new_tenant()
    ref = await blobs.put(a, b"tenant a's episode")
    assert await blobs.get(b, ref) is None
    await blobs.delete(b, ref)
    assert await blobs.get(a, ref) == b"tenant a's episode"

    shared = await blobs.put(b, b"tenant a's episode")
    assert shared == ref
    await blobs.delete(a, ref)
    assert await blobs.get(a, ref) is None
    assert await blobs.get(b, ref) == b"tenant a's episode"


GOOD_REF = blake3_hex(b"x")
MALFORMED_REFS = ["../../etc/passwd", "", GOOD_REF[:63], GOOD_REF + "0", GOOD_REF.upper()]
MALFORMED_REFS += [GOOD_REF + "\n", "../" + GOOD_REF[3:], GOOD_REF[:32] + "/" + GOOD_REF[33:]]


@pytest.mark.parametrize("ref", MALFORMED_REFS)
async def test_malformed_blob_refs_are_refused(blobs: BlobStore, ref: str) -> None:
    tenant = new_tenant()
    with pytest.raises(BadBlobRef):
        await blobs.get(tenant, ref)
    with pytest.raises(BadBlobRef):
        await blobs.delete(tenant, ref)
