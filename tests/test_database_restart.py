"""The database server restarts under a stream of tasks, on a throwaway cluster of the
test's own: a short restart is ridden out with no stage restarting; an outage longer
than a stage's patience (`ASSAY_EXIT_AFTER_S`) makes every stage exit with status 3,
a stopping stage ends within its grace period, and stages restarted by their
supervisor (here, the test) finish the work. Either way every task gets exactly one
result and the stages re-fold identical.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from assay.devstack import InfraUnavailable, Service
from assay.devstack.deployment import Deployment, deploy
from assay.devstack.postgres import cluster_down, start_cluster
from assay.runtime.embedded import STAGES
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

# RECOVERY_S (tests/pipeline.py) bounds the time from the server's return (after a long
# outage: from the restarted stages' first answer) to the last result. Measured on two
# cores: 6.2 s after a restart, 9.4 s after a long outage.
EXIT_AFTER_S = 8
GRACE_S = 5
PATIENT = {
    "ASSAY_LEASE_TTL_S": "3",
    "ASSAY_KAFKA_MEMBER_TIMEOUT_MS": "6000",
    "ASSAY_UNREADY_AFTER_S": "2",
    "ASSAY_EXIT_AFTER_S": str(EXIT_AFTER_S),
    "ASSAY_SHUTDOWN_GRACE_S": str(GRACE_S),
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    try:
        server = start_cluster(tmp_path_factory.mktemp("cluster"))
    except InfraUnavailable as exc:
        pytest.fail(f"a throwaway Postgres cluster could not be started: {exc}")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def deployment(
    cluster: Service, s3: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    d = asyncio.run(deploy(tmp_path_factory.mktemp("restart"), cluster, s3, extra_env=PATIENT))
    try:
        yield d
    finally:
        d.stop()


async def test_a_server_restart_mid_stream_is_ridden_out(
    deployment: Deployment, cluster: Service
) -> None:
    d = deployment
    tenant = await set_up_tenant(d, challenger=False)
    tasks = TASKS[:80]
    async with ResultWatch(d.bootstrap, tenant) as results:
        await produce(d.bootstrap, task_records(tenant, tasks))
        await results.until(10, timeout_s=60)
        with cluster_down(cluster):
            pass  # a restart: down only as long as a fast shutdown and a start take
        healed = time.monotonic()
        await results.until(len(tasks), timeout_s=RECOVERY_S + 60)
        recovery = max(0.0, results.last_at - healed)
    print(f"recovery: {recovery:.1f} s from the restart to the last result")
    assert recovery < RECOVERY_S, f"{recovery:.1f} s from the restart to the last result"
    assert all(p.poll() is None for p in d.procs.values()), "a stage exited on a restart"
    results.exactly_once({t["idempotency_key"] for t in tasks})
    await refold_identical(d)
    await asyncio.to_thread(d.wait_ready, 30)


async def test_a_long_outage_ends_every_stage_and_a_restart_finishes_the_work(
    deployment: Deployment, cluster: Service
) -> None:
    d = deployment
    tenant = await set_up_tenant(d, challenger=False)
    tasks = TASKS[80:160]
    async with ResultWatch(d.bootstrap, tenant) as results:
        await produce(d.bootstrap, task_records(tenant, tasks[:40]))
        await results.until(5, timeout_s=60)
        with cluster_down(cluster):
            await produce(d.bootstrap, task_records(tenant, tasks[40:]))
            ingest = d.procs["ingest"]
            ingest.send_signal(signal.SIGTERM)
            stopping = time.monotonic()
            await asyncio.to_thread(ingest.wait, GRACE_S + 5)
            assert time.monotonic() - stopping < GRACE_S + 2, "SIGTERM took past the grace"
            others = [p for name, p in d.procs.items() if name != "ingest"]
            for proc in others:
                try:
                    code = await asyncio.to_thread(proc.wait, EXIT_AFTER_S + 20)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"a stage still runs {EXIT_AFTER_S + 20} s into the outage")
                assert code == 3, f"a stage exited with {code}, not 3"
        for stage in STAGES:  # the supervisor's part
            d.start(stage)
        await asyncio.to_thread(d.wait_healthy)
        healed = time.monotonic()  # the stages' start-up (imports, mostly) is not recovery
        await results.until(len(tasks), timeout_s=RECOVERY_S + 60)
        recovery = max(0.0, results.last_at - healed)
    print(f"recovery: {recovery:.1f} s from the restart to the last result")
    assert recovery < RECOVERY_S, f"{recovery:.1f} s from the restart to the last result"
    assert "gave up" in d.log("execute")
    results.exactly_once({t["idempotency_key"] for t in tasks})
    await refold_identical(d)
    await asyncio.to_thread(d.wait_ready, 30)
