"""Faults of the infrastructure under a stream of tasks, with real processes: every
Postgres connection ended by the server (repeatedly), S3 away, the broker paused, a
stage stopped past its lease and its group membership. After each, with no manual
restart, every task has exactly one result, the stages re-fold to identical state, and
every stage reports ready again; the time from heal to the last result stays under a
stated bound (RECOVERY_S).

A Postgres server restart and an outage longer than a stage's patience are in
`test_database_restart.py`: they need a cluster of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import asyncpg
import pytest

from assay.devstack import Service
from assay.devstack.deployment import Deployment, deploy
from assay.devstack.kafka import broker_outage
from assay.devstack.proxy import FaultProxy
from tests.pipeline import (
    DISTRIBUTED,
    RECOVERY_S,
    TASKS,
    ResultWatch,
    produce,
    refold_identical,
    set_up_tenant,
    task_records,
)

pytestmark = [*DISTRIBUTED, pytest.mark.timeout(300)]

# RECOVERY_S (tests/pipeline.py) bounds the time from a heal to the last result. Measured
# on two cores: 2.7 s after connections end, 6.9 s after S3 returns, 3.7 s after the
# broker resumes, 5.4 s after a stopped stage continues.

TTL_S = 3
MEMBER_TIMEOUT_S = 6
FAST = {
    "ASSAY_LEASE_TTL_S": str(TTL_S),
    "ASSAY_KAFKA_MEMBER_TIMEOUT_MS": str(MEMBER_TIMEOUT_S * 1000),
    "ASSAY_UNREADY_AFTER_S": "3",
}


@pytest.fixture(scope="module")
def s3_link(s3: Service) -> Iterator[FaultProxy]:
    """The stages reach S3 through this, so that a test can cut them off from it."""
    proxy = FaultProxy.for_url(s3.address).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def deployment(
    postgres: Service,
    s3: Service,
    s3_link: FaultProxy,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Deployment]:
    through = Service("s3", s3_link.url_of(s3.address), details=s3.details)
    d = asyncio.run(deploy(tmp_path_factory.mktemp("faults"), postgres, through, extra_env=FAST))
    try:
        yield d
    finally:
        d.stop()


async def wait_unready(d: Deployment, stage: str, reason: str, timeout_s: float = 30) -> None:
    """Wait until `stage` answers /readyz with 503 for `reason` (a word of its reasons)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready, doc = await asyncio.to_thread(d.readiness, stage)
        if not ready and any(reason in r for r in doc.get("reasons", [])):
            return
        assert time.monotonic() < deadline, f"{stage} still ready: {doc}"
        await asyncio.sleep(0.2)


async def stream_through(
    d: Deployment,
    tasks: list[dict[str, Any]],
    fault: Callable[[], AbstractAsyncContextManager[None]],
) -> float:
    """Produce `tasks` in two halves, the second while `fault` is on; return the seconds
    from its heal to the last result, having checked every task got exactly one."""
    tenant = await set_up_tenant(d, challenger=False)
    half = len(tasks) // 2
    async with ResultWatch(d.bootstrap, tenant) as results:
        await produce(d.bootstrap, task_records(tenant, tasks[:half]))
        await results.until(5, timeout_s=60)
        async with fault():
            await produce(d.bootstrap, task_records(tenant, tasks[half:]))
        healed = time.monotonic()
        await results.until(len(tasks), timeout_s=RECOVERY_S + 60)
    results.exactly_once({t["idempotency_key"] for t in tasks})
    await refold_identical(d)
    await asyncio.to_thread(d.wait_ready, 30)
    return max(0.0, results.last_at - healed)


async def end_every_connection(d: Deployment) -> int:
    """What a Postgres restart, a failover or a proxy timeout does to a client."""
    database = d.admin_dsn.rpartition("/")[2]
    conn = await asyncpg.connect(d.admin_dsn)
    try:
        ended = await conn.fetchval(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = $1 AND pid <> pg_backend_pid()",
            database,
        )
    finally:
        await conn.close()
    return int(ended)


async def test_every_connection_ended_three_times_mid_stream(deployment: Deployment) -> None:
    d = deployment
    tenant = await set_up_tenant(d, challenger=False)
    tasks = TASKS[:150]
    keys = {t["idempotency_key"] for t in tasks}
    async with ResultWatch(d.bootstrap, tenant) as results:
        await produce(d.bootstrap, task_records(tenant, tasks[:50]))
        for upto in (10, 60, 110):
            await results.until(upto, timeout_s=120)
            assert await end_every_connection(d) > 0
            healed = time.monotonic()
            if upto < 110:
                await produce(d.bootstrap, task_records(tenant, tasks[upto + 40 : upto + 90]))
        await results.until(len(tasks), timeout_s=RECOVERY_S + 60)
        recovery = results.last_at - healed
        print(f"recovery: {recovery:.1f} s from the last fault to the last result")
        assert recovery < RECOVERY_S, f"{recovery:.1f} s from the last fault to the last result"
    results.exactly_once(keys)
    await refold_identical(d)
    await asyncio.to_thread(d.wait_ready, 30)


async def test_s3_away_for_ten_seconds(deployment: Deployment, s3_link: FaultProxy) -> None:
    d = deployment

    @contextlib.asynccontextmanager
    async def s3_away() -> AsyncIterator[None]:
        with s3_link.outage():
            yield
            await wait_unready(d, "execute", "handling")
            await asyncio.sleep(10)  # the outage's length, not a wait for an event

    recovery = await stream_through(d, TASKS[:60], s3_away)
    print(f"recovery: {recovery:.1f} s from S3's return to the last result")
    assert recovery < RECOVERY_S, f"{recovery:.1f} s from S3's return to the last result"


async def test_the_broker_paused_for_ten_seconds(deployment: Deployment) -> None:
    d = deployment

    @contextlib.asynccontextmanager
    async def paused() -> AsyncIterator[None]:
        yield  # the second half is produced, then the broker stops mid-stream
        with broker_outage(d.broker):
            await asyncio.sleep(10)  # the outage's length

    recovery = await stream_through(d, TASKS[60:120], paused)
    print(f"recovery: {recovery:.1f} s from the broker's return to the last result")
    assert recovery < RECOVERY_S, f"{recovery:.1f} s from the broker's return to the last result"


async def test_a_stage_stopped_beyond_its_lease_and_membership(deployment: Deployment) -> None:
    d = deployment

    @contextlib.asynccontextmanager
    async def execute_stopped() -> AsyncIterator[None]:
        d.procs["execute"].send_signal(signal.SIGSTOP)
        try:
            yield
            await asyncio.sleep(TTL_S + MEMBER_TIMEOUT_S + 3)  # past both, by design
        finally:
            d.procs["execute"].send_signal(signal.SIGCONT)

    recovery = await stream_through(d, TASKS[120:180], execute_stopped)
    print(f"recovery: {recovery:.1f} s from SIGCONT to the last result")
    assert recovery < RECOVERY_S, f"{recovery:.1f} s from SIGCONT to the last result"
