"""The server ends every connection (a restart, a failover, a proxy's timeout): each
Postgres connection Assay holds recovers — the commit writer, group commit, the pool's
readers, the relay's LISTEN and its advisory-lock leadership — and a stage tells a lost
service apart from a bad message: the message goes again, it is never dead-lettered.
"""

from __future__ import annotations

import asyncio
import errno
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import botocore.exceptions
import pytest

from assay.bus.embedded import EmbeddedBus
from assay.bus.relay import FileLock, OutboxRelay
from assay.bus.transport import BusMessage
from assay.devstack import Service
from assay.devstack.postgres import scratch_database
from assay.devstack.proxy import FaultProxy
from assay.kernel.health import Failing
from assay.kernel.ids import WorkflowId, tenant_id
from assay.messages import TaskSubmitted, message_id, seal
from assay.record import BranchKey, Event, EventRegistry, LogRecord, StateDelta
from assay.runtime.consumer import StageRunner
from assay.runtime.stage import StageSpec, UnitOfWork
from assay.runtime.vitals import Vitals
from assay.store import CommitBatch, OutboxEntry, PostgresEventLog, SqliteEventLog
from assay.store.faults import Outage, is_outage
from assay.store.fs_blobs import FsBlobStore
from assay.store.pg_relay import PgAdvisoryLeader, listen_for_outbox

TENANT = tenant_id(uuid.UUID(int=7))
CONNECTION_ERRORS = (
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)


class Noted(Event):
    type: ClassVar[str] = "losstest.Noted"
    version: ClassVar[int] = 1
    n: int


def _no_fold(record: LogRecord) -> list[StateDelta]:
    return []


REGISTRY = EventRegistry([Noted])


def noted(stream: str, n: int) -> CommitBatch:
    return CommitBatch(records=[(BranchKey.main(TENANT, stream), Noted(n=n))])


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# -- telling an outage from a bad message -------------------------------------------------


def s3_error(code: str, status: int) -> botocore.exceptions.ClientError:
    response: Any = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return botocore.exceptions.ClientError(response, "PutObject")


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError(errno.ECONNREFUSED, "refused"),
        OSError(errno.EHOSTUNREACH, "no route"),
        asyncpg.InterfaceError("connection has been released back to the pool"),
        asyncpg.exceptions.AdminShutdownError("terminating connection"),
        asyncpg.exceptions.CannotConnectNowError("the database system is starting up"),
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed"),
        botocore.exceptions.EndpointConnectionError(endpoint_url="http://s3"),
        s3_error("SlowDown", 503),
    ],
)
def test_lost_and_refused_connections_are_outages(exc: Exception) -> None:
    assert is_outage(exc)
    wrapped = RuntimeError("while handling")
    wrapped.__cause__ = exc
    assert is_outage(wrapped), "an outage under another error is still one"


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad input"),
        KeyError("field"),
        asyncpg.exceptions.UniqueViolationError("duplicate"),
        OSError(errno.ENOSPC, "no space"),
        s3_error("AccessDenied", 403),
    ],
)
def test_failures_of_the_work_itself_are_not_outages(exc: Exception) -> None:
    assert not is_outage(exc)


# -- a stage: an outage is retried, never dead-lettered -------------------------------------


async def test_a_handler_that_loses_its_store_raises_outage_and_dead_letters_nothing(
    tmp_path: Path,
) -> None:
    failures = [ConnectionResetError(errno.ECONNRESET, "reset by peer")] * 5
    handled: list[str] = []

    async def on_task(msg: TaskSubmitted, uow: UnitOfWork[Any]) -> None:
        if failures:
            raise failures.pop()
        handled.append(msg.idempotency_key)

    spec = StageSpec(
        name="flaky",
        events=REGISTRY,
        fold=_no_fold,
        handlers={"inbound": {TaskSubmitted.type: on_task}},
    )
    log = await SqliteEventLog(tmp_path / "flaky.sqlite", REGISTRY, _no_fold).open()
    bus = await EmbeddedBus(tmp_path / "bus.sqlite").open()
    try:
        relay = OutboxRelay("flaky", log, bus, FileLock(tmp_path / "relay.lock"))
        clock = [100.0]
        vitals = Vitals(unready_after_s=3, exit_after_s=0, clock=lambda: clock[0])
        runner = StageRunner(spec, log, FsBlobStore(tmp_path / "blobs"), relay, None, vitals)
        task = TaskSubmitted(
            tenant=TENANT, workflow_id=WorkflowId("wf"), idempotency_key="k-1", input={}
        )
        env = seal(task, tenant=TENANT, key="k", id=message_id("t", "k-1"), causation=None)
        m = BusMessage("inbound", 0, 0, "k", env.encode(), ())
        for _ in range(5):  # more than the handler's retries for a bad message
            with pytest.raises(Outage, match="ConnectionResetError"):
                await runner.handle(m)
            clock[0] += 1
        assert runner.dead_lettered == 0
        assert await log.drain_outbox(10) == [], "nothing was dead-lettered"
        ready = vitals.readiness()
        assert not ready["ready"]
        assert "handling failing for 5 s" in str(ready["reasons"])
        await runner.handle(m)
        assert handled == ["k-1"]
        assert vitals.readiness()["ready"]
    finally:
        await bus.close()
        await log.close()


def test_readiness_names_each_failing_path_and_waits_out_short_failures() -> None:
    clock = [0.0]
    relay = Failing()
    vitals = Vitals(unready_after_s=5, exit_after_s=30, clock=lambda: clock[0], relay=relay)
    assert vitals.readiness({"joined": True, "stalled": []})["ready"]
    vitals.store.failed("ConnectionRefusedError", clock[0])
    relay.failed("KafkaTimeoutError", clock[0])
    clock[0] = 4.0
    assert vitals.readiness({"joined": True, "stalled": []})["ready"], "a blip is not unready"
    clock[0] = 6.0
    doc = vitals.readiness({"joined": False, "stalled": ["assay.runs/3"]})
    assert not doc["ready"]
    reasons = str(doc["reasons"])
    for word in ("store failing", "relay failing", "not joined", "assay.runs/3"):
        assert word in reasons
    vitals.store.ok()
    relay.ok()
    assert vitals.readiness({"joined": True, "stalled": []})["ready"]
    assert not vitals.readiness({"joined": True}, stopping=True)["ready"]


async def test_a_stage_whose_store_stays_away_gives_up() -> None:
    clock = [0.0]
    vitals = Vitals(unready_after_s=1, exit_after_s=3, clock=lambda: clock[0])
    stop = asyncio.Event()

    async def probe() -> None:
        clock[0] += 1
        raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")

    await asyncio.wait_for(vitals.watch(probe, stop, every_s=0.01), 5)
    assert stop.is_set()
    assert vitals.gave_up is not None
    assert "ConnectionRefusedError" in vitals.gave_up


# -- Postgres: every connection ended by the server ---------------------------------------


@pytest.fixture(scope="module")
def admin_dsn(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_losstest") as dsn:
        yield dsn


@pytest.fixture
async def pg_log(admin_dsn: str) -> AsyncIterator[PostgresEventLog]:
    log = await PostgresEventLog(
        admin_dsn, f"loss_{uuid.uuid4().hex[:10]}", REGISTRY, _no_fold
    ).open()
    yield log
    await log.close()


async def end_connections(dsn: str, schema: str) -> int:
    """End every connection of `schema`'s log, relay and listener, from the server side."""
    conn = await asyncpg.connect(dsn)
    try:
        ended: Any = await conn.fetchval(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name LIKE $1 AND pid <> pg_backend_pid()",
            f"assay:{schema}%",
        )
    finally:
        await conn.close()
    return int(ended)


async def commit_through(log: PostgresEventLog, batch: CommitBatch) -> None:
    """Commit, allowing one outage (a pooled connection caught mid-termination)."""
    try:
        await log.commit(batch)
    except Exception as exc:
        if not is_outage(exc):
            raise
        await log.commit(batch)


async def test_commits_go_on_after_the_server_ends_the_writers_connection(
    pg_log: PostgresEventLog, admin_dsn: str
) -> None:
    await pg_log.commit(noted("s", 0))
    assert await end_connections(admin_dsn, pg_log.schema) >= 1
    for n in range(1, 4):  # before the fix: InterfaceError forever, from is_closed()
        await commit_through(pg_log, noted("s", n))
    records = await pg_log.read(BranchKey.main(TENANT, "s"))
    assert [r.event.n for r in records] == [0, 1, 2, 3]  # type: ignore[attr-defined]


async def test_group_commit_survives_its_connection_ending_mid_group(
    pg_log: PostgresEventLog, admin_dsn: str
) -> None:
    await pg_log.commit(noted("warm", 0))
    commits = [asyncio.create_task(pg_log.commit(noted(f"g{i}", 0))) for i in range(60)]
    await asyncio.sleep(0)  # the first is in flight alone; the rest queue as a group
    await end_connections(admin_dsn, pg_log.schema)
    outcomes = await asyncio.wait_for(asyncio.gather(*commits, return_exceptions=True), 10)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert all(is_outage(e) for e in errors), errors
    for i, outcome in enumerate(outcomes):  # what failed goes again, and lands once
        if isinstance(outcome, BaseException):
            await commit_through(pg_log, noted(f"g{i}", 0))
    for i in range(60):
        stream = await pg_log.read(BranchKey.main(TENANT, f"g{i}"))
        assert len(stream) == 1
    await asyncio.wait_for(pg_log.close(), 5)  # before the fix: waited forever


async def test_listen_is_issued_again_and_wakes_the_relay(
    pg_log: PostgresEventLog, admin_dsn: str
) -> None:
    wake = asyncio.Event()
    listener = await listen_for_outbox(admin_dsn, pg_log.schema, wake)
    try:
        await end_connections(admin_dsn, pg_log.schema)

        async def back() -> bool:
            return listener.reconnects == 1 and listener.listening

        await eventually(back)
        wake.clear()
        await commit_through(pg_log, CommitBatch(outbox=[OutboxEntry("t", "k", b"v")]))
        await asyncio.wait_for(wake.wait(), 5)
        assert listener.notified >= 1
    finally:
        await listener.close()


async def test_relay_leadership_is_taken_again_after_its_connection_ends(
    pg_log: PostgresEventLog, admin_dsn: str
) -> None:
    leader = PgAdvisoryLeader(admin_dsn, pg_log.schema)
    try:
        assert await leader.try_acquire()
        await end_connections(admin_dsn, pg_log.schema)

        async def lost() -> bool:
            return not leader.held

        await eventually(lost)

        async def leads_again() -> bool:
            try:
                return await leader.try_acquire()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                return False

        await eventually(leads_again)
    finally:
        await leader.release()


async def test_commits_fail_as_outages_through_a_network_cut_and_go_on_after(
    admin_dsn: str,
) -> None:
    target = urlsplit(admin_dsn)
    link = FaultProxy(target.hostname or "127.0.0.1", target.port or 5432).start()
    log = await PostgresEventLog(
        urlunsplit(target._replace(netloc=f"{target.username}@127.0.0.1:{link.port}")),
        f"cut_{uuid.uuid4().hex[:10]}",
        REGISTRY,
        _no_fold,
    ).open()
    try:
        await log.commit(noted("c", 0))
        with link.outage():
            for n in (1, 2):  # the held connection is reset; a new one is refused
                with pytest.raises(CONNECTION_ERRORS) as caught:
                    await log.commit(noted("c", n))
                assert is_outage(caught.value), caught.value
        await commit_through(log, noted("c", 1))
        records = await log.read(BranchKey.main(TENANT, "c"))
        assert [r.event.n for r in records] == [0, 1]  # type: ignore[attr-defined]
    finally:
        await log.close()
        link.stop()
