"""The Postgres event log beyond the shared contract (DESIGN §3, §5, §9; seed §7–§9.3).

Stage provisioning and role isolation, versioned migrations, the commit's round
trips, replicas sharing one schema, relay leadership by advisory lock and the
outbox notification. The `EventLog` contract itself runs over Postgres in
`test_store_contract.py`.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import asyncpg
import pytest
from asyncpg.connection import LoggedQuery

from assay.bus.embedded import EmbeddedBus
from assay.bus.relay import OutboxRelay
from assay.devstack import InfraUnavailable, Service
from assay.devstack.base import port_open
from assay.devstack.postgres import (
    DATABASE_URL_ENV,
    resolve_postgres,
    scratch_database,
    start_cluster,
)
from assay.kernel.ids import MessageId, TenantId, tenant_id
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
from assay.store import CommitBatch, OutboxEntry, PostgresEventLog
from assay.store.pg_provision import provision_stage, stage_role
from assay.store.pg_relay import PgAdvisoryLeader, listen_for_outbox
from assay.store.pg_schema import MIGRATIONS, migrate
from assay.store.ports import StaleFence

pytestmark = pytest.mark.postgres


class ItemPut(Event):
    type: ClassVar[str] = "pgtest.ItemPut"
    version: ClassVar[int] = 1
    item: str
    value: dict[str, Any]


class ItemChanged(Event):
    type: ClassVar[str] = "pgtest.ItemChanged"
    version: ClassVar[int] = 1
    item: str
    fields: dict[str, Any]
    delete: bool = False


def fold(record: LogRecord) -> list[StateDelta]:
    """Items by name: put, patched, deleted."""
    ev = record.event
    at = StateKey(record.key.tenant, "item", getattr(ev, "item", ""))
    if isinstance(ev, ItemPut):
        return [Put(at, dict(ev.value))]
    assert isinstance(ev, ItemChanged)
    return [Delete(at) if ev.delete else Patch(at, dict(ev.fields))]


REGISTRY = EventRegistry([ItemPut, ItemChanged])


def put(item: str, **value: Any) -> ItemPut:
    return ItemPut(item=item, value=value)


def main(tenant: TenantId, stream: str) -> BranchKey:
    return BranchKey.main(tenant, stream)


def on(key: BranchKey, *events: Event) -> CommitBatch:
    return CommitBatch(records=[(key, e) for e in events])


@pytest.fixture(scope="module")
def admin_dsn(postgres: Service) -> Iterator[str]:
    """A superuser DSN of a database of this module's own (dropped at the end)."""
    with scratch_database(postgres, "assay_pgtest") as dsn:
        yield dsn


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def new_tenant() -> TenantId:
    return tenant_id(uuid.uuid4())


@pytest.fixture
async def pg_log(admin_dsn: str) -> AsyncIterator[PostgresEventLog]:
    log = await PostgresEventLog(admin_dsn, unique("log"), REGISTRY, fold).open()
    yield log
    await log.close()


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# -- provisioning ----------------------------------------------------------------


@pytest.fixture
async def stages(admin_dsn: str) -> AsyncIterator[dict[str, str]]:
    """Two provisioned stages, `ingest` and `verify` (suffixed: roles are cluster-wide);
    stage name -> its role's DSN. The roles are dropped afterwards."""
    suffix = uuid.uuid4().hex[:8]
    names = {"ingest": f"ingest_{suffix}", "verify": f"verify_{suffix}"}
    dsns: dict[str, str] = {}
    try:
        for stage, name in names.items():
            dsns[stage] = await provision_stage(admin_dsn, name, f"secret-{stage}")
        dsns.update({f"{stage}:schema": name for stage, name in names.items()})
        yield dsns
    finally:
        conn = await asyncpg.connect(admin_dsn)
        try:
            for name in names.values():
                role = stage_role(name)
                await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
                if await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
                    await conn.execute(f'DROP OWNED BY "{role}"')
                    await conn.execute(f'DROP ROLE "{role}"')
        finally:
            await conn.close()


async def test_a_stage_opened_with_its_own_role_migrates_and_uses_its_schema(
    stages: dict[str, str], admin_dsn: str
) -> None:
    schema = stages["ingest:schema"]
    log = await PostgresEventLog(stages["ingest"], schema, REGISTRY, fold).open()
    try:
        tenant = new_tenant()
        batch = on(main(tenant, "s"), put("a", v=1))
        batch.inbox = (tenant, MessageId("m1"))
        batch.outbox = [OutboxEntry("t", "k", b"v")]
        assert await log.commit(batch) == [0]
        assert await log.get(StateKey(tenant, "item", "a")) == {"v": 1}
        assert (await log.rebuild(keep=True)).identical
    finally:
        await log.close()
    conn = await asyncpg.connect(admin_dsn)
    try:
        owners = await conn.fetch(
            "SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1",
            schema,
        )
    finally:
        await conn.close()
    assert [o[0] for o in owners] == [stage_role(schema)]


async def test_a_stage_role_cannot_read_or_write_another_stages_schema(
    stages: dict[str, str],
) -> None:
    ingest = stages["ingest:schema"]
    log = await PostgresEventLog(stages["ingest"], ingest, REGISTRY, fold).open()
    await log.close()

    verify = await asyncpg.connect(stages["verify"])
    try:
        for sql in (
            f'SELECT * FROM "{ingest}".log',
            f'SELECT * FROM "{ingest}".state',
            f"INSERT INTO \"{ingest}\".inbox VALUES (gen_random_uuid(), 'forged')",
            f'DELETE FROM "{ingest}".outbox',
            f'CREATE TABLE "{ingest}".intruder (x int)',
            "CREATE TABLE public.intruder (x int)",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await verify.execute(sql)
    finally:
        await verify.close()
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await PostgresEventLog(stages["verify"], ingest, REGISTRY, fold).open()


async def test_provisioning_adopts_a_schema_the_admin_migrated_first(admin_dsn: str) -> None:
    stage = unique("early")
    early = await PostgresEventLog(admin_dsn, stage, REGISTRY, fold).open()  # as superuser
    tenant = new_tenant()
    await early.commit(on(main(tenant, "s"), put("before")))
    await early.close()
    role = stage_role(stage)
    try:
        dsn = await provision_stage(admin_dsn, stage, "pw")
        log = await PostgresEventLog(dsn, stage, REGISTRY, fold).open()
        try:
            assert await log.commit(on(main(tenant, "s"), put("after"))) == [1]
            assert await log.get(StateKey(tenant, "item", "before")) == {}
            assert (await log.rebuild(keep=True)).identical
        finally:
            await log.close()
    finally:
        conn = await asyncpg.connect(admin_dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{stage}" CASCADE')
            await conn.execute(f'DROP OWNED BY "{role}"')
            await conn.execute(f'DROP ROLE "{role}"')
        finally:
            await conn.close()


async def test_provisioning_again_is_harmless_and_keeps_the_stages_data(
    stages: dict[str, str], admin_dsn: str
) -> None:
    schema = stages["ingest:schema"]
    tenant = new_tenant()
    log = await PostgresEventLog(stages["ingest"], schema, REGISTRY, fold).open()
    await log.commit(on(main(tenant, "s"), put("kept")))
    await log.close()

    again = await provision_stage(admin_dsn, schema, "rotated")
    assert again != stages["ingest"]  # the new password is in the DSN
    log = await PostgresEventLog(again, schema, REGISTRY, fold).open()
    try:
        assert await log.get(StateKey(tenant, "item", "kept")) == {}
        assert await log.commit(on(main(tenant, "s"), put("more"))) == [1]
    finally:
        await log.close()


# -- migrations ------------------------------------------------------------------


async def versions(conn: asyncpg.Connection, schema: str) -> list[tuple[int, object]]:
    rows = await conn.fetch(
        f'SELECT version, applied_at FROM "{schema}".assay_migrations ORDER BY version'
    )
    return [(r[0], r[1]) for r in rows]


async def test_migrations_are_versioned_and_applying_them_twice_is_a_no_op(
    admin_dsn: str,
) -> None:
    schema = unique("mig")
    conn = await asyncpg.connect(admin_dsn)
    try:
        assert await migrate(conn, schema) == list(range(1, len(MIGRATIONS) + 1))
        first = await versions(conn, schema)
        assert await migrate(conn, schema) == []
        assert await versions(conn, schema) == first  # same versions, same applied_at

        extra = "CREATE TABLE {s}.extra (x integer)"
        assert await migrate(conn, schema, [*MIGRATIONS, extra]) == [len(MIGRATIONS) + 1]
        assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".extra') == 0

        broken = [*MIGRATIONS, extra, "CREATE TABLE {s}.half (x integer)", "NOT SQL"]
        with pytest.raises(asyncpg.PostgresSyntaxError):
            await migrate(conn, schema, broken)
        assert len(await versions(conn, schema)) == len(MIGRATIONS) + 1  # nothing half-applied
        assert await conn.fetchval("SELECT to_regclass($1)", f"{schema}.half") is None
    finally:
        await conn.close()


async def test_replicas_opening_together_apply_each_migration_once(admin_dsn: str) -> None:
    schema = unique("race")
    logs = await asyncio.gather(
        *(PostgresEventLog(admin_dsn, schema, REGISTRY, fold).open() for _ in range(4))
    )
    try:
        tenant = new_tenant()
        assert await logs[0].commit(on(main(tenant, "s"), put("a"))) == [0]
        assert await logs[3].commit(on(main(tenant, "s"), put("b"))) == [1]
    finally:
        for log in logs:
            await log.close()
    conn = await asyncpg.connect(admin_dsn)
    try:
        assert [v for v, _ in await versions(conn, schema)] == list(range(1, len(MIGRATIONS) + 1))
    finally:
        await conn.close()


# -- the commit ------------------------------------------------------------------


async def test_a_commit_is_one_round_trip_and_concurrent_commits_share_one(
    pg_log: PostgresEventLog,
) -> None:
    tenant = new_tenant()
    key = main(tenant, "s")

    def batch(i: int) -> CommitBatch:
        patch = ItemChanged(item="warm", fields={f"f{i}": i})  # a patch of a known document
        b = on(key, put(f"i{i}"), patch)
        b.inbox = (tenant, MessageId(f"m{i}"))
        b.outbox = [OutboxEntry("t", "k", b"%d" % i)]
        return b

    await pg_log.commit(on(key, put("warm")))  # learns the branch's next LSN
    await pg_log.commit(batch(-1))  # prepares the statement of this batch's shape
    await asyncio.gather(*(pg_log.commit(on(key, put(f"w{i}"))) for i in range(3)))  # a group
    conn = pg_log.writer.connection
    assert conn is not None
    queries: list[str] = []

    def logged(query: LoggedQuery) -> None:
        queries.append(query.query)

    conn.add_query_logger(logged)
    try:
        for i in range(20):
            await pg_log.commit(batch(i))
        await asyncio.sleep(0)  # query loggers are called soon after the query
        assert len(queries) == 20, queries
        queries.clear()
        results = await asyncio.gather(*(pg_log.commit(on(key, put(f"c{i}"))) for i in range(100)))
        await asyncio.sleep(0)
        assert sorted(r[0] for r in results) == list(range(46, 146))
        assert len(queries) <= 3, queries
    finally:
        conn.remove_query_logger(logged)
    assert (await pg_log.rebuild(keep=False)).identical


async def test_a_batch_that_puts_then_patches_a_new_document_reads_nothing_first(
    pg_log: PostgresEventLog,
) -> None:
    """A Pure step's one commit puts its attempt's document and patches it: the patch
    rests on the put, so the commit is its one round trip, no read of the store first."""
    tenant = new_tenant()
    key = main(tenant, "s")
    await pg_log.commit(on(key, put("warm")))  # learns the branch's next LSN
    await pg_log.commit(on(key, put("x0"), ItemChanged(item="x0", fields={"b": 2})))  # prepares
    conn = pg_log.writer.connection
    assert conn is not None
    queries: list[str] = []

    def logged(query: LoggedQuery) -> None:
        queries.append(query.query)

    conn.add_query_logger(logged)
    try:
        for i in range(1, 6):
            await pg_log.commit(
                on(key, put(f"x{i}", a=1), ItemChanged(item=f"x{i}", fields={"b": 2}))
            )
        await asyncio.sleep(0)  # query loggers are called soon after the query
        assert len(queries) == 5, queries
    finally:
        conn.remove_query_logger(logged)
    assert await pg_log.get(StateKey(tenant, "item", "x5")) == {"a": 1, "b": 2}
    assert (await pg_log.rebuild(keep=False)).identical


async def test_fenced_commits_of_many_runs_share_a_round_trip_and_a_stale_fence_fails_alone(
    pg_log: PostgresEventLog,
) -> None:
    tenant = new_tenant()
    leases = []
    for i in range(12):
        lease = await pg_log.claim(tenant, f"run-{i}", "worker-a", ttl_ms=60_000)
        assert lease is not None
        leases.append(lease)
        await pg_log.commit(
            CommitBatch(records=[(main(tenant, f"run-{i}"), put(f"r{i}-0"))], fence=lease)
        )
    # A fenced group first, so that the connection knows the statement's types.
    warm = [await pg_log.claim(tenant, f"warm-{i}", "worker-a", ttl_ms=60_000) for i in range(3)]
    await asyncio.gather(
        *(
            pg_log.commit(CommitBatch(records=[(main(tenant, f"warm-{i}"), put(f"w{i}"))], fence=w))
            for i, w in enumerate(warm)
        )
    )
    taken = await pg_log.claim(tenant, "run-5", "worker-a", ttl_ms=60_000)  # a restart
    assert taken is not None
    conn = pg_log.writer.connection
    assert conn is not None
    queries: list[str] = []

    def logged(query: LoggedQuery) -> None:
        queries.append(query.query)

    conn.add_query_logger(logged)
    try:
        outcomes = await asyncio.gather(
            *(
                pg_log.commit(
                    CommitBatch(
                        records=[(main(tenant, f"run-{i}"), put(f"r{i}-1"))],
                        inbox=(tenant, MessageId(f"m-{i}")),
                        outbox=[OutboxEntry("t", f"k{i}", b"%d" % i)],
                        fence=lease,
                    )
                )
                for i, lease in enumerate(leases)
            ),
            return_exceptions=True,
        )
        await asyncio.sleep(0)
    finally:
        conn.remove_query_logger(logged)
    assert isinstance(outcomes[5], StaleFence)
    assert [o for i, o in enumerate(outcomes) if i != 5] == [[1]] * 11
    # The first alone, then the other eleven as one group (on distinct documents: a
    # batch built on a document the stale one wrote would go again, after the group).
    assert len(queries) == 2, queries
    assert any("assay_commit_fenced" in q for q in queries)
    # The stale batch wrote nothing: no record, no inbox entry, no outbox row.
    assert [r.event for r in await pg_log.read(main(tenant, "run-5"))] == [put("r5-0")]
    assert not await pg_log.seen(tenant, MessageId("m-5"))
    assert sorted(r.entry.key for r in await pg_log.drain_outbox(100)) == sorted(
        f"k{i}" for i in range(12) if i != 5
    )
    # The new holder's write lands where the old one's stopped.
    assert await pg_log.commit(
        CommitBatch(records=[(main(tenant, "run-5"), put("new"))], fence=taken)
    ) == [1]
    assert (await pg_log.rebuild(keep=False)).identical


async def test_a_branch_the_writer_has_not_seen_is_taken_to_be_new_until_refused(
    admin_dsn: str,
) -> None:
    schema = unique("guess")
    a = await PostgresEventLog(admin_dsn, schema, REGISTRY, fold).open()
    b = await PostgresEventLog(admin_dsn, schema, REGISTRY, fold).open()
    try:
        tenant = new_tenant()
        for i in range(3):
            await a.commit(on(main(tenant, "old"), put(f"a{i}")))
        await b.commit(on(main(tenant, "warm"), put("w")))
        conn = b.writer.connection
        assert conn is not None
        queries: list[str] = []

        def logged(query: LoggedQuery) -> None:
            queries.append(" ".join(query.query.split()))

        conn.add_query_logger(logged)
        try:
            assert await b.commit(on(main(tenant, "new"), put("n"))) == [0]
            await asyncio.sleep(0)
            assert len(queries) == 1, queries  # the commit alone: nothing learnt first
            queries.clear()
            # A branch another writer wrote: the guess is refused, then learnt once.
            assert await b.commit(on(main(tenant, "old"), put("b0"), put("b1"))) == [3, 4]
            assert await b.commit(on(main(tenant, "old"), put("b2"))) == [5]
            await asyncio.sleep(0)
            assert sum("max(l.lsn)" in q for q in queries) == 1, queries
        finally:
            conn.remove_query_logger(logged)
        assert [r.lsn for r in await a.read(main(tenant, "old"))] == list(range(6))
        assert (await a.rebuild(keep=False)).identical
    finally:
        await b.close()
        await a.close()


def tally(record: LogRecord) -> list[StateDelta]:
    """Each event patches its own field into one shared document."""
    assert isinstance(record.event, ItemChanged)
    at = StateKey(record.key.tenant, "tally", record.key.stream)
    return [Patch(at, dict(record.event.fields))]


async def test_replicas_sharing_a_schema_keep_lsns_dense_and_patches_whole(
    admin_dsn: str,
) -> None:
    schema = unique("replicas")
    registry = EventRegistry([ItemChanged])
    a = await PostgresEventLog(admin_dsn, schema, registry, tally).open()
    b = await PostgresEventLog(admin_dsn, schema, registry, tally).open()
    try:
        tenant = new_tenant()
        key = main(tenant, "shared")

        def change(side: str, i: int) -> CommitBatch:
            return on(key, ItemChanged(item="x", fields={f"{side}{i}": i}))

        # Each replica's cached next LSN and cached document go stale at every turn.
        for i in range(10):
            await a.commit(change("a", i))
            await b.commit(change("b", i))
        both = await asyncio.gather(
            *(
                log.commit(change(f"{side}-c", i))
                for i in range(20)
                for side, log in [("a", a), ("b", b)]
            )
        )
        assert sorted(r[0] for r in both) == list(range(20, 60))
        records = await a.read(key, limit=1000)
        assert [r.lsn for r in records] == list(range(60))
        doc = await b.get(StateKey(tenant, "tally", "shared"))
        assert doc is not None
        assert len(doc) == 60
        assert (await a.rebuild(keep=False)).identical
    finally:
        await a.close()
        await b.close()


async def test_replicas_writing_the_same_documents_at_once_still_rebuild_identically(
    admin_dsn: str,
) -> None:
    # `rebuild` re-folds in log order; two replicas racing on one document must leave
    # the state that order gives, deletes of absent documents included.
    schema = unique("race_docs")
    a = await PostgresEventLog(admin_dsn, schema, REGISTRY, fold).open()
    b = await PostgresEventLog(admin_dsn, schema, REGISTRY, fold).open()
    rng = random.Random(7)
    tenant = new_tenant()

    def change() -> CommitBatch:
        key = main(tenant, rng.choice(["s0", "s1", "s2"]))
        item, roll = rng.choice(["x", "y"]), rng.random()
        if roll < 0.4:
            return on(key, put(item, v=rng.randint(0, 9)))
        if roll < 0.8:
            return on(key, ItemChanged(item=item, fields={rng.choice("pqr"): rng.randint(0, 9)}))
        return on(key, ItemChanged(item=item, fields={}, delete=True))

    try:
        for _ in range(12):
            await asyncio.gather(*(rng.choice([a, b]).commit(change()) for _ in range(12)))
        report = await a.rebuild(keep=False)
        assert report.identical, report.differences
        assert report.records == 12 * 12
        for stream in ["s0", "s1", "s2"]:
            lsns = [r.lsn for r in await b.read(main(tenant, stream), limit=1000)]
            assert lsns == list(range(len(lsns)))
    finally:
        await a.close()
        await b.close()


async def blocked_on_a_lock(admin: asyncpg.Connection, schema: str) -> bool:
    waiting = await admin.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
        " AND wait_event_type = 'Lock'",
        f"assay:{schema}",
    )
    return bool(waiting)


@pytest.mark.parametrize("held", ["a document", "an absent document being created"])
async def test_a_commit_takes_its_log_position_only_once_it_holds_its_documents(
    admin_dsn: str, held: str
) -> None:
    # Replicas: A writes document `y` while another transaction holds it; B commits
    # meanwhile. A must land after B in the log, since its write lands after B's
    # commit — so a re-fold in log order sees what the state saw.
    schema = unique("lockorder")
    a = await PostgresEventLog(admin_dsn, schema, REGISTRY, fold).open()
    b = await PostgresEventLog(admin_dsn, schema, REGISTRY, fold).open()
    tenant = new_tenant()
    admin = await asyncpg.connect(admin_dsn)
    other = await asyncpg.connect(admin_dsn)
    try:
        s = f'"{schema}"'
        blocker = other.transaction()
        if held == "a document":
            await a.commit(on(main(tenant, "a"), put("y", v=0)))
            await blocker.start()
            await other.execute(
                f"SELECT 1 FROM {s}.state WHERE tenant = $1 AND key = 'y' FOR UPDATE", tenant
            )
            change: Event = put("y", v=1)
        else:
            await blocker.start()
            await other.execute(f"INSERT INTO {s}.state VALUES ($1, 'item', 'y', '{{}}')", tenant)
            change = ItemChanged(item="y", fields={}, delete=True)
        writing = asyncio.create_task(a.commit(on(main(tenant, "a"), change)))

        async def a_waits() -> bool:
            return await blocked_on_a_lock(admin, schema)

        await eventually(a_waits)
        await b.commit(on(main(tenant, "b"), put("z")))
        await blocker.commit()
        await asyncio.wait_for(writing, 5.0)

        rows = await admin.fetch(f"SELECT stream, max(seq) FROM {s}.log GROUP BY stream")
        seqs: dict[str, int] = {r[0]: r[1] for r in rows}
        assert seqs["a"] > seqs["b"]
        assert (await a.rebuild(keep=False)).identical
    finally:
        await other.close()
        await admin.close()
        await a.close()
        await b.close()


async def test_rebuild_reports_tampering_and_keep_repairs_it(
    pg_log: PostgresEventLog, admin_dsn: str
) -> None:
    tenant = new_tenant()
    await pg_log.commit(on(main(tenant, "s"), put("changed", v=1), put("dropped", v=2)))
    good = dict(await pg_log.scan(tenant, "item"))
    s = f'"{pg_log.schema}"'
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f"UPDATE {s}.state SET value = $1 WHERE key = 'changed'", b'{"v":666}')
        await conn.execute(f"DELETE FROM {s}.state WHERE key = 'dropped'")
        await conn.execute(f"INSERT INTO {s}.state VALUES ($1, 'item', 'invented', '{{}}')", tenant)
    finally:
        await conn.close()

    report = await pg_log.rebuild(keep=False)
    assert (report.records, report.documents_before, report.documents_after) == (2, 2, 2)
    assert sorted(report.differences) == [
        f"{tenant}/item/changed: differs",
        f"{tenant}/item/dropped: missing from the stored state",
        f"{tenant}/item/invented: missing after rebuild",
    ]
    assert await pg_log.get(StateKey(tenant, "item", "changed")) == {"v": 666}
    assert (await pg_log.rebuild(keep=True)).differences == report.differences
    assert dict(await pg_log.scan(tenant, "item")) == good
    # A patch after the repair merges onto the repaired document, not a cached one.
    await pg_log.commit(on(main(tenant, "s"), ItemChanged(item="changed", fields={"w": 2})))
    assert await pg_log.get(StateKey(tenant, "item", "changed")) == {"v": 1, "w": 2}
    assert (await pg_log.rebuild(keep=False)).identical


# -- relay: leadership and notification ------------------------------------------


async def test_one_advisory_leader_per_schema(admin_dsn: str) -> None:
    schema = unique("lead")
    first, second = PgAdvisoryLeader(admin_dsn, schema), PgAdvisoryLeader(admin_dsn, schema)
    other_schema = PgAdvisoryLeader(admin_dsn, unique("lead"))
    try:
        assert await first.try_acquire()
        assert await first.try_acquire()  # already held by this instance
        assert not await second.try_acquire()
        assert await other_schema.try_acquire()
        await first.release()
        assert await second.try_acquire()
        assert not await first.try_acquire()
    finally:
        for leader in (first, second, other_schema):
            await leader.release()
    await second.release()  # releasing twice is harmless


async def test_an_advisory_leader_that_stalls_is_ended_by_the_one_waiting_for_the_lock(
    admin_dsn: str,
) -> None:
    schema = unique("lead")
    stalled = PgAdvisoryLeader(admin_dsn, schema, stalled_after_s=1.0)
    waiting = PgAdvisoryLeader(admin_dsn, schema, stalled_after_s=1.0)
    try:
        assert await stalled.try_acquire()
        for _ in range(8):  # asked more often than the timeout: it keeps the lock
            await asyncio.sleep(0.25)
            assert await stalled.try_acquire()
            assert not await waiting.try_acquire()
        await asyncio.sleep(1.5)  # stalled (SIGSTOP): not a word to the server
        assert await waiting.try_acquire()
        assert not await stalled.try_acquire()  # it hears it lost the lock
    finally:
        for leader in (stalled, waiting):
            await leader.release()


@pytest.fixture
async def bus(tmp_path: Path) -> AsyncIterator[EmbeddedBus]:
    b = await EmbeddedBus(tmp_path / "bus.sqlite", 2).open()
    yield b
    await b.close()


async def published(bus: EmbeddedBus, topic: str) -> int:
    return sum((await bus.end_offsets(topic)).values())


async def test_two_relays_on_one_schema_one_leads_and_a_notify_wakes_it(
    pg_log: PostgresEventLog, admin_dsn: str, bus: EmbeddedBus
) -> None:
    topic = unique("topic")
    relays = [
        OutboxRelay("s", pg_log, bus, PgAdvisoryLeader(admin_dsn, pg_log.schema), poll_s=60)
        for _ in range(2)
    ]
    listeners = [await listen_for_outbox(admin_dsn, pg_log.schema, r.wake) for r in relays]
    stop = asyncio.Event()
    running = [asyncio.create_task(r.run(stop)) for r in relays]
    # Another replica commits: nothing in this process wakes the relay but the notification.
    other = await PostgresEventLog(admin_dsn, pg_log.schema, REGISTRY, fold).open()
    try:
        await asyncio.sleep(0.2)  # both relays started; the leader is idle, polling every 60 s
        for n in range(3):
            await other.commit(CommitBatch(outbox=[OutboxEntry(topic, "k", b"%d" % n)]))

            async def shipped(n: int = n) -> bool:
                return await published(bus, topic) == n + 1

            await eventually(shipped, timeout_s=3.0)

        async def counted() -> bool:  # the relay counts a row once its ack is committed
            return sorted(r.shipped for r in relays) == [0, 3]

        await eventually(counted, timeout_s=3.0)
        assert all(listener.notified >= 3 for listener in listeners)
    finally:
        stop.set()
        for relay in relays:
            relay.wake.set()  # the leader sleeps on its wake event, not on `stop`
        await asyncio.wait_for(asyncio.gather(*running), 5.0)
        for listener in listeners:
            await listener.close()
        await other.close()
    assert await pg_log.drain_outbox(10) == []
    free = PgAdvisoryLeader(admin_dsn, pg_log.schema)  # the leader let go when it stopped
    assert await free.try_acquire()
    await free.release()


# -- the server itself -----------------------------------------------------------


def test_an_address_in_the_environment_is_borrowed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, postgres: Service
) -> None:
    monkeypatch.setenv(DATABASE_URL_ENV, postgres.address)
    service = resolve_postgres(tmp_path)
    assert (service.address, service.process) == (postgres.address, None)
    service.stop()  # a borrowed server is left alone


def test_a_throwaway_cluster_starts_takes_writes_and_stops(tmp_path: Path) -> None:
    try:
        service = start_cluster(tmp_path)
    except InfraUnavailable as exc:
        pytest.skip(f"no local Postgres binaries: {exc}")

    async def write() -> str:
        conn = await asyncpg.connect(service.address)
        try:
            await conn.execute("CREATE TABLE t (x integer); INSERT INTO t VALUES (1)")
            return str(await conn.fetchval("SHOW fsync"))
        finally:
            await conn.close()

    port = int(service.address.rsplit(":", 1)[1].split("/")[0])
    try:
        assert asyncio.run(write()) == "on"
    finally:
        service.stop()
    assert service.process is not None
    assert service.process.poll() is not None
    assert not port_open("127.0.0.1", port)
