"""SIGKILL at every named crash point of the execute stage and its relay, on SQLite and
on Postgres, then restart and check that nothing acknowledged was lost or done twice.

Each test starts the process with `ASSAY_CRASH_AT=<point>:1` and
`ASSAY_CRASH_TRACE`, waits for it to die by SIGKILL (a test fails if the point
is never reached: the process then finishes, or the trace lacks the point),
takes the execute log as the dead process left it, restarts without the crash
variable, waits until every task has its `RunResult`, and hands both logs and
the effect sink to `crash_checks.check_recovery`. "Resumed within the lease
TTL + 2 s" counts from the restarted stage's `execute.started` point: from the
moment it consumes again, so Python's start-up time is not what is measured.

The workload is one short workflow — a Pure step, an Idempotent `sink_put`
and an Unsafe `sink_charge` (`crash_sink`) — over three tasks, with a lease
TTL of half a second. Processes are forked from a server that imported Assay
once (`crash_processes`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sqlite3
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.context import ForkServerProcess
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from assay.bus import TASKS, WORKFLOWS
from assay.bus.kafka import KafkaTransport
from assay.bus.topics import producer_entry
from assay.crash import CRASH_AT_ENV, CRASH_TRACE_ENV
from assay.devstack import Service
from assay.devstack.base import free_port
from assay.devstack.deployment import Deployment, deploy
from assay.engine.driver import MAX_INTERRUPTED
from assay.kernel import TenantId, WorkflowId, tenant_id
from assay.messages import MESSAGES, RunResult, TaskSubmitted, WorkflowRegistered, open_envelope
from assay.workflow import load_workflow
from tests.crash_checks import POINTS, ExecuteLog, check_recovery
from tests.crash_processes import start_assay, stop
from tests.crash_sink import SINK_ENV, install_sink_tools, read_sink

pytestmark = pytest.mark.slow

LEASE_TTL_S = 0.5
ITEMS = ["apple", "pear", "fig"]
WORKFLOW = """\
id: sink
description: {description}
steps:
  - id: price
    kind: tool
    tool: sink_price
    args: {{item: "{{{{ task.item }}}}"}}
  - id: put
    kind: tool
    tool: sink_put
    args: {{item: "{{{{ task.item }}}}"}}
  - id: charge
    kind: tool
    tool: sink_charge
    args: {{item: "{{{{ task.item }}}}", amount: "{{{{ steps.price.output }}}}"}}
verifiers:
  - id: charged
    kind: regex
    step: charge
    pattern: "charged [0-9]+"
"""


@dataclass(frozen=True)
class Workload:
    """The files every test shares: the tools' site, two workflow versions, the tasks."""

    site: Path
    v1: Path
    v2: Path
    tasks: Path


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Workload:
    root = tmp_path_factory.mktemp("crash-workload")
    v1, v2 = root / "v1.yaml", root / "v2.yaml"
    v1.write_text(WORKFLOW.format(description="Price an item, store it, charge for it."))
    v2.write_text(WORKFLOW.format(description="The same, as the challenger."))
    tasks = root / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"idempotency_key": f"task-{i}", "input": {"item": item}}) + "\n"
            for i, item in enumerate(ITEMS)
        )
    )
    return Workload(install_sink_tools(root / "site"), v1, v2, tasks)


def _traced(trace: Path) -> list[str]:
    if not trace.exists():
        return []
    return [line.split(" ", 1)[0] for line in trace.read_text().splitlines() if line]


def _started_ms(trace: Path) -> int:
    """When the restarted execute stage came up: reached its `execute.started` point."""
    for line in trace.read_text().splitlines():
        name, _, ms = line.split(" ")
        if name == "execute.started":
            return int(ms)
    raise AssertionError("the restarted execute stage never started")


def _output(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def _assert_killed_at(point: str, proc: ForkServerProcess, trace: Path, output: Path) -> None:
    rc = proc.exitcode
    assert point in _traced(trace), f"crash point {point} was never reached:\n{_output(output)}"
    assert rc == -signal.SIGKILL, f"exit {rc}, not SIGKILL, at {point}:\n{_output(output)}"


# -- SQLite: the embedded pipeline (`assay demo`) ---------------------------------------


def _demo_env(sink: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSAY_")}
    return env | {
        SINK_ENV: str(sink),
        "ASSAY_LEASE_TTL_S": str(LEASE_TTL_S),
        "ASSAY_SHADOW_RATE": "0",  # one run per task
        **more,
    }


def _demo(w: Workload, data: Path, env: dict[str, str], output: Path) -> ForkServerProcess:
    """`assay demo` over the workload, run to its end (or its death) within a minute."""
    argv = ["--data-dir", str(data), "demo", "--no-progress", "--tasks", str(w.tasks)]
    proc = start_assay([*argv, "--workflows", str(w.v1), str(w.v2)], env, output, w.site)
    proc.join(60)
    stop(proc)  # still running: the test fails on its exit code
    return proc


def _sqlite_log(db: Path) -> tuple[ExecuteLog, str]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT stream, lsn, type, at_ms, payload FROM log").fetchall()
        leased = {s for (s,) in conn.execute("SELECT stream FROM leases")}
        tenants = {t for (t,) in conn.execute("SELECT DISTINCT tenant FROM log")}
    assert len(tenants) <= 1
    return ExecuteLog.from_rows(rows, leased), next(iter(tenants), "")


def _sqlite_results(bus: Path) -> dict[str, set[str]]:
    with sqlite3.connect(bus) as conn:
        rows = conn.execute("SELECT value FROM records WHERE topic='assay.results'").fetchall()
    found: dict[str, set[str]] = defaultdict(set)
    for (value,) in rows:
        env = open_envelope(value)
        msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
        assert isinstance(msg, RunResult)
        found[msg.idempotency_key].add(env.id)  # a relay re-publish keeps its id
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", POINTS)
def test_sqlite_sigkill_at(point: str, workload: Workload, tmp_path: Path) -> None:
    data, trace, sink = tmp_path / "data", tmp_path / "trace", tmp_path / "sink.jsonl"
    output, restart = tmp_path / "output", tmp_path / "restart-trace"
    crash = {CRASH_AT_ENV: f"{point}:1", CRASH_TRACE_ENV: str(trace)}
    crashing = _demo(workload, data, _demo_env(sink, **crash), output)
    _assert_killed_at(point, crashing, trace, output)
    at_crash, _ = _sqlite_log(data / "execute.sqlite")

    again = _demo(workload, data, _demo_env(sink, **{CRASH_TRACE_ENV: str(restart)}), output)
    assert again.exitcode == 0, _output(output)

    results = _sqlite_results(data / "bus.sqlite")
    assert set(results) == {f"task-{i}" for i in range(len(ITEMS))}, "a task has no result"
    assert all(len(ids) == 1 for ids in results.values()), "a task got two different results"
    final, tenant = _sqlite_log(data / "execute.sqlite")
    check_recovery(
        point,
        at_crash,
        final,
        read_sink(sink),
        tenant=tenant,
        runs_expected=len(ITEMS),
        restarted_ms=_started_ms(restart),
        ttl_s=LEASE_TTL_S,
    )


@pytest.mark.timeout(300)
def test_sqlite_a_pure_step_that_kills_every_worker_ends_the_run_failed(
    workload: Workload, tmp_path: Path
) -> None:
    """A Pure call that SIGKILLs its worker every time it runs is a poison pill only while
    nothing of it is on record. Every restart dies in it again; the first death leaves
    nothing, each later one an attempt whose start was written ahead, closed as
    interrupted on the next restart: after MAX_INTERRUPTED of them the step fails, the
    run ends failed, and the process finishes."""
    data, sink, output = tmp_path / "data", tmp_path / "sink.jsonl", tmp_path / "output"
    one = dataclasses.replace(workload, tasks=tmp_path / "one.jsonl")
    one.tasks.write_text(json.dumps({"idempotency_key": "poison", "input": {"item": "fig"}}) + "\n")
    deaths = 0
    while True:
        trace = tmp_path / f"trace-{deaths}"
        crash = {CRASH_AT_ENV: "execute.tool.sink_price.during:1", CRASH_TRACE_ENV: str(trace)}
        proc = _demo(one, data, _demo_env(sink, **crash), output)
        if proc.exitcode == 0:
            break
        _assert_killed_at("execute.tool.sink_price.during", proc, trace, output)
        deaths += 1
        assert deaths <= MAX_INTERRUPTED + 1, "the Pure step is re-run without bound"
    assert deaths == MAX_INTERRUPTED + 1  # the first death leaves nothing on record

    final, _ = _sqlite_log(data / "execute.sqlite")
    ((run, records),) = final.runs().items()
    ends = [r.doc for r in records if r.type == "AttemptFinished"]
    assert [(d["step"], d["attempt"], d["state"], d["interrupted"]) for d in ends] == [
        ("price", n, "failed", True) for n in range(1, MAX_INTERRUPTED + 1)
    ]
    assert run in final.finished()
    assert read_sink(sink) == []  # the steps after it never ran
    results = _sqlite_results(data / "bus.sqlite")
    assert set(results) == {"poison"}


def test_every_crash_point_is_reached_in_a_clean_run(workload: Workload, tmp_path: Path) -> None:
    """The trace of an uncrashed run names every point the tests crash at (20 at least)."""
    trace, output = tmp_path / "trace", tmp_path / "output"
    env = _demo_env(tmp_path / "sink.jsonl", **{CRASH_TRACE_ENV: str(trace)})
    done = _demo(workload, tmp_path / "data", env, output)
    assert done.exitcode == 0, _output(output)
    reached = set(_traced(trace))
    assert len(POINTS) >= 20
    assert not set(POINTS) - reached, f"never reached: {sorted(set(POINTS) - reached)}"


# -- Postgres: `assay serve` processes on Postgres, a Kafka-protocol broker and S3 --------
#
# The five other stages run for the whole module; only `execute` is started with the
# crash variable, killed and restarted, per test. Restarting the whole deployment per
# crash point would cost six process starts and a rebalance of every consumer group for
# nothing: the points are all in the execute process, and the other stages only carry
# tasks to it and its episodes on to a `RunResult`, which is what "no acknowledged run
# lost" is checked against. Each test uses a tenant of its own.


@dataclass
class ExecuteStage:
    """The deployment's execute stage, as forked `assay serve execute` processes."""

    deployment: Deployment
    site: Path
    proc: ForkServerProcess | None = None

    def start(self, env: dict[str, str], output: Path) -> ForkServerProcess:
        """Stop the running process (cleanly) and start one with `env` added."""
        self.stop()
        d = self.deployment
        env = d.env | {
            "ASSAY_DATABASE_URL": d.dsns["execute"],
            "ASSAY_HTTP_PORT": str(free_port()),
            **env,
        }
        self.proc = start_assay(["serve", "execute"], env, output, self.site)
        return self.proc

    def stop(self) -> None:
        """Stop the running process, if any, with SIGTERM."""
        if self.proc is not None:
            stop(self.proc)


@pytest.fixture(scope="module")
def execute_stage(
    postgres: Service, s3: Service, workload: Workload, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ExecuteStage]:
    env = {
        "PYTHONPATH": str(workload.site),  # every stage validates the workflow's tools
        "ASSAY_LEASE_TTL_S": str(LEASE_TTL_S),
        # A consumer group holds a killed member's partitions until the member times out
        # (Tansu: nearly twice the timeout the group was created with, for every rejoin):
        # at the default 10 s no restarted execute stage could resume within TTL + 2 s.
        "ASSAY_KAFKA_MEMBER_TIMEOUT_MS": "1000",
    }
    workdir = tmp_path_factory.mktemp("crash-pg")
    d = asyncio.run(deploy(workdir, postgres, s3, partitions=2, extra_env=env))
    execute = ExecuteStage(d, workload.site)
    try:
        d.procs["execute"].terminate()  # from here on, execute runs as forked processes
        d.procs["execute"].wait(30)
        yield execute
    finally:
        execute.stop()
        d.stop()


async def _produce(bootstrap: str, items: list[tuple[str, Any, Any, str]]) -> None:
    transport = KafkaTransport(bootstrap, client_id="crash-points-test")
    await transport.open()
    try:
        await transport.publish([producer_entry(*item) for item in items])
    finally:
        await transport.close()


async def _until(what: str, check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def _pg_results(bootstrap: str, tenant: str, count: int) -> dict[str, set[str]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    found: dict[str, set[str]] = defaultdict(set)
    try:
        await consumer.topics()
        parts = [
            TopicPartition("assay.results", p)
            for p in sorted(consumer.partitions_for_topic("assay.results") or ())
        ]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        deadline = time.monotonic() + 90
        while len(found) < count and time.monotonic() < deadline:
            for batch in (await consumer.getmany(timeout_ms=300)).values():
                for r in batch:
                    body = json.loads(r.value)
                    if body["payload"]["tenant"] == tenant:
                        found[body["payload"]["idempotency_key"]].add(body["id"])
    finally:
        await consumer.stop()
    return found


async def _await_disconnected(d: Deployment) -> None:
    """Wait until the execute role has no connection left to this database: a statement
    the killed process sent just before it died has committed or aborted, so the log read
    next is what it left. (Roles are the server's: other databases' stages share them.)"""
    deadline = time.monotonic() + 30
    while True:
        rows = await d.query(
            "SELECT pid, state, wait_event_type, wait_event, backend_start, query "
            "FROM pg_stat_activity WHERE usename = $1 AND datname = current_database()",
            d.roles["execute"],
        )
        if not rows:
            return
        assert time.monotonic() < deadline, f"connections outlived the process: {rows}"
        await asyncio.sleep(0.05)


async def _pg_log(d: Deployment, tenant: str) -> ExecuteLog:
    t = uuid.UUID(tenant)
    rows = await d.query(
        "SELECT stream, lsn, type, at_ms, convert_from(payload, 'UTF8') AS p "
        "FROM execute.log WHERE tenant = $1",
        t,
    )
    leased = await d.query("SELECT stream FROM execute.leases WHERE tenant = $1", t)
    return ExecuteLog.from_rows(
        [(r["stream"], r["lsn"], r["type"], r["at_ms"], r["p"]) for r in rows],
        {r["stream"] for r in leased},
    )


async def _register(d: Deployment, workload: Workload, t: TenantId) -> None:
    """Register the workload's workflow for tenant `t` and wait for its allocation."""
    wf = load_workflow(workload.v1)
    registered = WorkflowRegistered(tenant=t, definition=wf.model_dump(mode="json", by_alias=True))
    await _produce(d.bootstrap, [(WORKFLOWS, registered, t, wf.version)])

    async def allocated() -> bool:
        rows = await d.query(
            "SELECT 1 FROM ingest.state WHERE tenant = $1 AND kind = 'allocation'", t
        )
        return bool(rows)

    await _until("the workflow's allocation", allocated, 30)


@pytest.mark.postgres
@pytest.mark.kafka
@pytest.mark.s3
@pytest.mark.timeout(150)
@pytest.mark.parametrize("point", POINTS)
async def test_postgres_sigkill_at(
    point: str, execute_stage: ExecuteStage, workload: Workload, tmp_path: Path
) -> None:
    execute = execute_stage
    d = execute.deployment
    trace, sink, output = tmp_path / "trace", tmp_path / "sink.jsonl", tmp_path / "output"
    crash = {SINK_ENV: str(sink), CRASH_AT_ENV: f"{point}:1", CRASH_TRACE_ENV: str(trace)}
    crashing = execute.start(crash, output)

    tenant = str(uuid.uuid4())
    t = tenant_id(tenant)
    await _register(d, workload, t)
    tasks = [
        TaskSubmitted(
            tenant=t,
            workflow_id=WorkflowId("sink"),
            idempotency_key=f"task-{i}",
            input={"item": item},
        )
        for i, item in enumerate(ITEMS)
    ]
    await _produce(d.bootstrap, [(TASKS, task, t, task.idempotency_key) for task in tasks])

    await asyncio.to_thread(crashing.join, 60)
    _assert_killed_at(point, crashing, trace, output)
    await _await_disconnected(d)
    at_crash = await _pg_log(d, tenant)

    restart = tmp_path / "restart-trace"
    execute.start({SINK_ENV: str(sink), CRASH_TRACE_ENV: str(restart)}, output)
    results = await _pg_results(d.bootstrap, tenant, len(ITEMS))
    assert set(results) == {task.idempotency_key for task in tasks}, "a task has no result"
    assert all(len(ids) == 1 for ids in results.values()), "a task got two different results"

    async def all_finished() -> bool:
        return len((await _pg_log(d, tenant)).finished()) == len(ITEMS)

    await _until("every run to finish", all_finished, 30)
    check_recovery(
        point,
        at_crash,
        await _pg_log(d, tenant),
        read_sink(sink),
        tenant=tenant,
        runs_expected=len(ITEMS),
        restarted_ms=_started_ms(restart),
        ttl_s=LEASE_TTL_S,
    )


@pytest.mark.postgres
@pytest.mark.kafka
@pytest.mark.s3
@pytest.mark.timeout(300)
async def test_postgres_a_pure_step_that_kills_every_worker_ends_the_run_failed(
    execute_stage: ExecuteStage, workload: Workload, tmp_path: Path
) -> None:
    """As on SQLite: every execute process dies in the Pure step, until MAX_INTERRUPTED
    attempts of it are closed as interrupted; then the run ends failed and the stage,
    still started with the crash variable, lives on and publishes the run's result."""
    execute = execute_stage
    d = execute.deployment
    sink, output, point = (
        tmp_path / "sink.jsonl",
        tmp_path / "output",
        "execute.tool.sink_price.during",
    )
    tenant = str(uuid.uuid4())
    t = tenant_id(tenant)
    await _register(d, workload, t)
    task = TaskSubmitted(
        tenant=t, workflow_id=WorkflowId("sink"), idempotency_key="poison", input={"item": "fig"}
    )
    for death in range(MAX_INTERRUPTED + 1):  # the first death leaves nothing on record
        trace = tmp_path / f"trace-{death}"
        crash = {SINK_ENV: str(sink), CRASH_AT_ENV: f"{point}:1", CRASH_TRACE_ENV: str(trace)}
        crashing = execute.start(crash, output)
        if death == 0:
            await _produce(d.bootstrap, [(TASKS, task, t, task.idempotency_key)])
        await asyncio.to_thread(crashing.join, 60)
        _assert_killed_at(point, crashing, trace, output)
        await _await_disconnected(d)

    last = tmp_path / "trace-last"
    crash = {SINK_ENV: str(sink), CRASH_AT_ENV: f"{point}:1", CRASH_TRACE_ENV: str(last)}
    surviving = execute.start(crash, output)
    results = await _pg_results(d.bootstrap, tenant, 1)
    assert set(results) == {"poison"}, "the run never ended"
    assert surviving.exitcode is None
    assert point not in _traced(last)
    final = await _pg_log(d, tenant)
    ((run, records),) = final.runs().items()
    ends = [r.doc for r in records if r.type == "AttemptFinished"]
    assert [(e["step"], e["attempt"], e["state"], e["interrupted"]) for e in ends] == [
        ("price", n, "failed", True) for n in range(1, MAX_INTERRUPTED + 1)
    ]
    assert run in final.finished()
    assert read_sink(sink) == []
