"""The whole distributed pipeline on this machine with the stub model.

Six `assay serve` processes on a local broker, Postgres and S3. Throughput: a burst
of tasks produced at once, graded runs per second until the last result. Latency:
tasks paced at half that rate, produce-to-result time of each (both timestamps
are the broker's record times, from one clock). Memory: the peak resident set of
every stage process (VmHWM).

Cost, which holds on a loaded machine where throughput does not: over the burst,
the CPU time (user + system, from `/proc/<pid>/stat`) of every process the pipeline
runs on — the six stages, the broker, the S3 double when this bench started it,
and the Postgres backends serving the bench's database (by their pids in
`pg_stat_activity`; the cluster's shared background processes are not counted) —
and what they did: broker records produced on every topic (end offsets before
and after), Postgres transactions and rows written (`pg_stat_database`; statements
from `pg_stat_statements` when the server has it loaded), S3 requests (the moto
server's request log). Each figure is per graded run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from assay.devstack.base import Service
from assay.devstack.deployment import ASSAY, Deployment, deploy
from assay.devstack.postgres import resolve_postgres
from assay.devstack.s3 import resolve_s3
from assay.runtime.embedded import STAGES

ROOT = Path(__file__).resolve().parents[1]
BURST = int(os.environ.get("ASSAY_BENCH_BURST", "1500"))  # smaller for a profiled run
PACED = 100
IDLE_S = 5.0
STARTUP_S = 300  # six processes importing at once on a loaded two-core machine
_TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def _tasks(tenant: str, n: int, tag: str) -> list[tuple[str, bytes]]:
    rng = random.Random(tag)
    out = []
    for i in range(n):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        task = {
            "tenant": tenant,
            "workflow_id": "arith",
            "idempotency_key": f"{tag}-{i}",
            "input": {"question": f"{a} + {b}", "answer": str(a + b)},
        }
        out.append((f"{tenant}:{tag}-{i}", json.dumps(task).encode()))
    return out


async def _results(bootstrap: str, keys: set[str], timeout_s: float) -> dict[str, int]:
    """idempotency key -> broker timestamp (ms) of its first result."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    seen: dict[str, int] = {}
    try:
        await consumer.topics()
        parts = [
            TopicPartition("assay.results", p)
            for p in consumer.partitions_for_topic("assay.results") or ()
        ]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        deadline = time.monotonic() + timeout_s
        while not keys <= seen.keys() and time.monotonic() < deadline:
            for batch in (await consumer.getmany(timeout_ms=200, max_records=5000)).values():
                for r in batch:
                    key = json.loads(r.value)["payload"]["idempotency_key"]
                    seen.setdefault(key, r.timestamp)
    finally:
        await consumer.stop()
    missing = keys - seen.keys()
    if missing:
        raise RuntimeError(f"{len(missing)} task(s) got no result in {timeout_s}s")
    return seen


async def _produce(
    bootstrap: str, records: list[tuple[str, bytes]], per_s: float | None
) -> dict[str, int]:
    """Send tasks; return idempotency key -> the broker timestamp of its task record."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=2)
    await producer.start()
    sent: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        for i, (key, value) in enumerate(records):
            if per_s is not None:
                await asyncio.sleep(max(0.0, t0 + i / per_s - time.monotonic()))
            sent[key.split(":", 1)[1]] = await producer.send("assay.tasks", value, key=key.encode())
        await producer.flush()
        return {k: (await fut).timestamp for k, fut in sent.items()}
    finally:
        await producer.stop()


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu_ms(pid: int) -> float:
    """User + system CPU time of a process (every thread), 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) * _TICK_MS  # utime, stime: fields 14 and 15


@dataclass
class _Meter:
    """What the pipeline's processes have used and done so far."""

    cpu_ms: dict[str, float]
    backends: dict[int, float]
    records: int
    pg: dict[str, int]
    s3_requests: int | None
    at: float = field(default_factory=time.monotonic)


async def _pg_counters(d: Deployment) -> tuple[dict[int, float], dict[str, int]]:
    database = d.admin_dsn.rsplit("/", 1)[1].split("?")[0]
    rows = await d.query(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()", database
    )
    (db,) = await d.query(
        "SELECT xact_commit + xact_rollback AS xacts, tup_inserted + tup_updated + tup_deleted"
        " AS written FROM pg_stat_database WHERE datname = $1",
        database,
    )
    counters = {"xacts": int(db["xacts"]), "written": int(db["written"])}
    with contextlib.suppress(asyncpg.PostgresError):  # not loaded: no statement counts
        (st,) = await d.query(
            "SELECT coalesce(sum(s.calls), 0) AS calls FROM pg_stat_statements s"
            " JOIN pg_database b ON b.oid = s.dbid WHERE b.datname = $1",
            database,
        )
        counters["statements"] = int(st["calls"])
    return {r["pid"]: _cpu_ms(r["pid"]) for r in rows}, counters


async def _records(bootstrap: str) -> int:
    """Records produced so far on every topic: the sum of the partitions' end offsets."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        topics = [t for t in await consumer.topics() if not t.startswith("__")]
        parts = [
            TopicPartition(t, p) for t in topics for p in consumer.partitions_for_topic(t) or ()
        ]
        return sum((await consumer.end_offsets(parts)).values())
    finally:
        await consumer.stop()


def _s3_requests(s3: Service, log: Path) -> int | None:
    """Requests the moto server has logged (one line each), or None for another S3."""
    if s3.process is None or not log.exists():
        return None
    return sum(1 for line in log.read_text(errors="replace").splitlines() if '" 20' in line)


async def _meter(d: Deployment, s3: Service, s3_log: Path) -> _Meter:
    cpu = {name: _cpu_ms(p.pid) for name, p in d.procs.items()}
    if d.broker.pid is not None:
        cpu["broker"] = _cpu_ms(d.broker.pid)
    if s3.pid is not None:
        cpu["s3"] = _cpu_ms(s3.pid)
    backends, pg = await _pg_counters(d)
    return _Meter(cpu, backends, await _records(d.bootstrap), pg, _s3_requests(s3, s3_log))


def _cost(before: _Meter, after: _Meter, runs: int) -> dict[str, float]:
    """Per graded run, between two meters."""

    def per_run(x: float) -> float:
        return round(x / runs, 2)

    by_process = {n: after.cpu_ms[n] - before.cpu_ms.get(n, 0.0) for n in after.cpu_ms}
    # a backend that started during the burst counts whole; one that ended is lost
    by_process["postgres"] = sum(
        ms - before.backends.get(pid, 0.0) for pid, ms in after.backends.items()
    )
    stages = sum(v for n, v in by_process.items() if n not in ("broker", "s3", "postgres"))
    out = {
        "pipeline.cpu_ms_per_run": per_run(sum(by_process.values())),
        "pipeline.stage_cpu_ms_per_run": per_run(stages),
        **{f"pipeline.process_cpu_ms_per_run.{n}": per_run(v) for n, v in by_process.items()},
        "pipeline.records_per_run": per_run(after.records - before.records),
        "pipeline.pg_xacts_per_run": per_run(after.pg["xacts"] - before.pg["xacts"]),
        "pipeline.pg_rows_written_per_run": per_run(after.pg["written"] - before.pg["written"]),
    }
    if "statements" in before.pg and "statements" in after.pg:
        out["pipeline.pg_statements_per_run"] = per_run(
            after.pg["statements"] - before.pg["statements"]
        )
    if before.s3_requests is not None and after.s3_requests is not None:
        out["pipeline.s3_requests_per_run"] = per_run(after.s3_requests - before.s3_requests)
    return out


async def routed_tenant(d: Deployment, workflow: str, timeout_s: float) -> str:
    """A new tenant with the example `workflow` registered through the CLI, once ingest
    holds its allocation (tasks before it are refused as unknown)."""
    tenant = str(uuid.uuid4())
    registered = await asyncio.to_thread(
        subprocess.run,
        [ASSAY, "register", str(ROOT / "examples/workflows" / workflow), "--tenant", tenant],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert registered.returncode == 0, registered.stderr
    deadline = time.monotonic() + timeout_s
    while not await d.query(
        "SELECT 1 FROM ingest.state WHERE tenant = $1 AND kind = 'allocation'", uuid.UUID(tenant)
    ):
        assert time.monotonic() < deadline, "the workflow was never allocated"
        await asyncio.sleep(0.1)  # ingest's state has no event to wait on
    return tenant


async def _measure(d: Deployment, s3: Service, s3_log: Path) -> dict[str, float]:
    tenant = await routed_tenant(d, "arith-v2.yaml", 60)
    warm = _tasks(tenant, 50, "warm")
    await _produce(d.bootstrap, warm, None)
    await _results(d.bootstrap, {k.split(":", 1)[1] for k, _ in warm}, 120)

    idle = await _meter(d, s3, s3_log)
    await asyncio.sleep(IDLE_S)  # nothing in flight: what waiting for work costs
    idle_end = await _meter(d, s3, s3_log)
    idle_ms_per_s = _cost(idle, idle_end, 1)["pipeline.cpu_ms_per_run"] / (idle_end.at - idle.at)

    burst = _tasks(tenant, BURST, "burst")
    before = await _meter(d, s3, s3_log)
    sent = await _produce(d.bootstrap, burst, None)
    done = await _results(d.bootstrap, set(sent), 600)
    after = await _meter(d, s3, s3_log)
    runs_per_s = BURST / ((max(done.values()) - min(sent.values())) / 1000)

    paced = _tasks(tenant, PACED, "paced")
    sent = await _produce(d.bootstrap, paced, runs_per_s / 2)
    done = await _results(d.bootstrap, set(sent), 300)
    latencies = sorted(done[k] - sent[k] for k in sent)
    cost = _cost(before, after, BURST)
    return {
        "pipeline.runs_per_s": round(runs_per_s, 1),
        "pipeline.latency_p50_ms": float(statistics.median(latencies)),
        "pipeline.latency_p99_ms": float(latencies[int(0.99 * (len(latencies) - 1))]),
        "pipeline.max_stage_rss_mb": round(max(_peak_rss_mb(p.pid) for p in d.procs.values()), 1),
        **cost,
        "pipeline.idle_cpu_ms_per_s": round(idle_ms_per_s, 1),
        "pipeline.idle_broker_cpu_ms_per_s": round(
            _cost(idle, idle_end, 1)["pipeline.process_cpu_ms_per_run.broker"]
            / (idle_end.at - idle.at),
            1,
        ),
        # the six stages alone: their consumers' loops and fetches, relays, timers
        "pipeline.idle_stage_cpu_ms_per_s": round(
            _cost(idle, idle_end, 1)["pipeline.stage_cpu_ms_per_run"] / (idle_end.at - idle.at),
            1,
        ),
        # What one more run costs: the burst's CPU less what the same processes use
        # waiting for work over as long (the consumers' polls, heartbeats, timers),
        # which a loaded machine's lower throughput spreads over fewer runs.
        "pipeline.marginal_cpu_ms_per_run": round(
            cost["pipeline.cpu_ms_per_run"] - idle_ms_per_s * (after.at - before.at) / BURST, 2
        ),
    }


def pipeline_figures(workdir: Path) -> dict[str, float]:
    """Deploy, measure, tear down."""
    postgres = resolve_postgres(workdir / "postgres")
    s3 = resolve_s3(workdir / "s3")
    try:
        d = asyncio.run(
            deploy(workdir / "pipeline", postgres, s3, partitions=12, stages=(), extra_env=_env())
        )
        try:
            for stage in STAGES:
                d.start(stage)
            d.wait_healthy(STARTUP_S)
            return asyncio.run(_measure(d, s3, workdir / "s3" / "moto-s3.log"))
        finally:
            d.stop()
    finally:
        s3.stop()
        postgres.stop()


def _env() -> dict[str, str]:
    """With `ASSAY_BENCH_PROFILE=<dir>`, every stage profiles its CPU time with cProfile
    and writes `<dir>/<stage>-<pid>.pstats` when it stops (`bench/profiling/top.py`)."""
    out = os.environ.get("ASSAY_BENCH_PROFILE")
    if not out:
        return {}
    path = [str(ROOT / "bench" / "profiling"), os.environ.get("PYTHONPATH", "")]
    return {"ASSAY_BENCH_PROFILE": out, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
