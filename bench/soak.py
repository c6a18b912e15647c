"""The soak figure: the embedded pipeline run continuously with shortened retention.

A fixed stream of tasks (the arithmetic examples, each sent again under a new
idempotency key every cycle) runs through every stage for `SOAK_S` seconds while
retention periods of a few seconds turn over many times. The runs are under the
token ceiling, so they are tiered unreduced as soon as their grading ended. The data directory's
stores (every SQLite file: the stage logs and `bus.sqlite`, WAL included) are
sampled once a second; `soak.bytes_growth_last_half` is their growth over the
second half, beside `soak.bytes_growth_first_half`. Blobs are reported apart:
tiered runs' archives are cold storage that retention keeps by design. At the
end every task must have its result and `assay rebuild --check` must pass.

`soak_pg_figures` does the same for the distributed pipeline (section `soak-pg`): the
six stages and the console as `assay serve` processes on a local broker, S3 and a
Postgres cluster of its own made with `initdb` (autovacuum on, as by default — it is
what reuses the space of deleted rows, and a shared test server may run without it —
every 10 s instead of 60, each vacuum, cancellation and skip logged and counted),
for `ASSAY_SOAK_PG_S` seconds (180 by default), on the same fixed stream of tasks (the
240 arithmetic examples, produced as bare `TaskSubmitted` records: a task's grading
state is kept per task, so new tasks are new state), sampling every 2 s the
`pg_total_relation_size` of every table (indexes and TOAST included) of every stage's
schema. Kafka's topics keep a message for `topic_retention_s` whether it was read or
not, so the topic retention here is 20 s (a stage on two busy cores may lag seconds
behind) and the other periods exceed it; `soak.pg.bytes_growth_last_half` is the
growth over the second half beside `soak.pg.bytes_growth_first_half`, and the table
that grew most in the second half is named on stderr (`ASSAY_SOAK_PG_SAMPLES=<file>`
writes every sample there as JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from pipeline import routed_tenant

from assay.bus.topics import RESULTS, TASKS, WORKFLOWS
from assay.cli.rebuild import check_postgres, rebuild
from assay.cli.tasks import read_tasks
from assay.devstack.deployment import Deployment, deploy
from assay.devstack.postgres import start_cluster
from assay.devstack.s3 import resolve_s3
from assay.kernel import WorkflowId, tenant_id
from assay.messages import MESSAGES, RunResult, TaskSubmitted, WorkflowRegistered, open_envelope
from assay.record import StateKey
from assay.runtime.embedded import Embedded
from assay.runtime.sections import PIPELINE_STAGES, STAGE_ROLES
from assay.runtime.settings import AssaySettings
from assay.workflow import load_workflow

ROOT = Path(__file__).resolve().parents[1]
TENANT = tenant_id("00000000-0000-4000-8000-00000000500a")
SOAK_S = float(__import__("os").environ.get("ASSAY_SOAK_S", "60"))
IN_FLIGHT = 32
RETENTION = {
    "ASSAY_RETENTION_TOPIC_RETENTION_S": "2",
    "ASSAY_RETENTION_INBOX_KEEP_S": "3",
    "ASSAY_RETENTION_RECORDS_KEEP_S": "4",
    "ASSAY_RETENTION_PRUNE_INTERVAL_S": "1",
    "ASSAY_RETENTION_TIER_AFTER_S": "0",
    "ASSAY_RETENTION_SWEEP_INTERVAL_S": "0.5",
}


def _store_bytes(data: Path) -> int:
    return sum(p.stat().st_size for p in data.glob("*.sqlite*") if p.is_file())


def _blob_bytes(data: Path) -> int:
    return sum(p.stat().st_size for p in (data / "blobs").rglob("*") if p.is_file())


async def _soak(data: Path) -> dict[str, float]:
    settings = AssaySettings.from_env({**RETENTION, "ASSAY_DATA_DIR": str(data)})
    wf = load_workflow(ROOT / "examples" / "workflows" / "arith-v1.yaml")
    tasks = read_tasks(ROOT / "examples" / "tasks" / "arith.jsonl", TENANT, wf.id)
    samples: list[tuple[float, int, int]] = []
    sent: set[str] = set()
    got: set[str] = set()
    async with Embedded(data, settings=settings) as rt:
        rt.start()
        definition = wf.model_dump(mode="json", by_alias=True)
        reg = WorkflowRegistered(tenant=TENANT, definition=definition)
        await rt.publish(WORKFLOWS, reg, TENANT, idem=wf.version)
        ingest = rt.logs["ingest"]
        while await ingest.get(StateKey(TENANT, "allocation", wf.id)) is None:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # ingest's state has no event to wait on
        offsets = dict.fromkeys(range(rt.partitions), 0)
        t0 = time.monotonic()
        cycle = n = 0
        next_sample = t0
        while (now := time.monotonic()) - t0 < SOAK_S:
            for p in range(rt.partitions):
                for m in await rt.bus.fetch(RESULTS, p, offsets[p], 500, 0.0):
                    offsets[p] = m.offset + 1
                    env = open_envelope(m.value)
                    res = MESSAGES.decode(env.type, env.schema_version, env.payload)
                    if isinstance(res, RunResult) and res.idempotency_key in sent:
                        got.add(res.idempotency_key)
            batch = []
            while len(sent) - len(got) < IN_FLIGHT:
                task = tasks[n % len(tasks)]
                cycle, n = (n + 1) // len(tasks), n + 1
                key = f"{task.idempotency_key}-soak-{cycle}-{n}"
                sent.add(key)
                batch.append((TASKS, task.model_copy(update={"idempotency_key": key}), TENANT, key))
            if batch:
                await rt.publish_many(batch)
            if now >= next_sample:
                samples.append((now - t0, _store_bytes(data), _blob_bytes(data)))
                next_sample += 1.0
            await asyncio.sleep(0.01)
        deadline = time.monotonic() + 30
        while got != sent and time.monotonic() < deadline:
            for p in range(rt.partitions):
                for m in await rt.bus.fetch(RESULTS, p, offsets[p], 500, 0.01):
                    offsets[p] = m.offset + 1
                    env = open_envelope(m.value)
                    res = MESSAGES.decode(env.type, env.schema_version, env.payload)
                    if isinstance(res, RunResult):
                        got.add(res.idempotency_key)
        await rt.stop()
    with contextlib.redirect_stdout(io.StringIO()):
        check = await rebuild(data, check=True)
    half = len(samples) // 2
    first, mid, last = samples[0][1], samples[half][1], samples[-1][1]
    return {
        "soak.seconds": round(samples[-1][0], 1),
        "soak.tasks": float(len(sent)),
        "soak.results_missing": float(len(sent - got)),
        "soak.store_bytes_start": float(first),
        "soak.store_bytes_mid": float(mid),
        "soak.store_bytes_end": float(last),
        "soak.bytes_growth_first_half": float(mid - first),
        "soak.bytes_growth_last_half": float(last - mid),
        "soak.blob_bytes_end": float(samples[-1][2]),
        "soak.rebuild_check_ok": float(check == 0),
    }


def soak_figures(workdir: Path) -> dict[str, float]:
    """The soak section's figures (see the module docstring)."""
    workdir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_soak(workdir / "data"))


# -- distributed: Postgres table sizes -------------------------------------------------

SOAK_PG_S = float(os.environ.get("ASSAY_SOAK_PG_S", "180"))
PG_IN_FLIGHT = 32
PG_SAMPLE_S = 2.0
PG_STARTUP_S = 300  # seven processes importing at once on a loaded two-core machine
AUTOVACUUM_NAPTIME_S = 10
"""The soak cluster's autovacuum period (Postgres's default is 60 s: three visits in a
three-minute soak, too few to tell a table that levels off from one that grows)."""
PG_RETENTION = {
    "ASSAY_RETENTION_TOPIC_RETENTION_S": "20",
    "ASSAY_RETENTION_INBOX_KEEP_S": "25",
    "ASSAY_RETENTION_RECORDS_KEEP_S": "30",
    "ASSAY_RETENTION_USAGE_KEEP_S": "30",
    "ASSAY_RETENTION_PRUNE_INTERVAL_S": "2",
    "ASSAY_RETENTION_TIER_AFTER_S": "0",
    "ASSAY_RETENTION_SWEEP_INTERVAL_S": "0.5",
}


async def _table_bytes(d: Deployment) -> dict[str, int]:
    """`schema.table` -> `pg_total_relation_size` of every table of every stage's schema."""
    rows = await d.query(
        "SELECT n.nspname AS schema, c.relname AS name, pg_total_relation_size(c.oid) AS bytes"
        " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relkind IN ('r', 'p') AND n.nspname = ANY($1::text[])",
        list(STAGE_ROLES),
    )
    return {f"{r['schema']}.{r['name']}": int(r["bytes"]) for r in rows}


def _task(task: TaskSubmitted, key: str) -> tuple[bytes, bytes]:
    """`task` under idempotency key `key`, bare (as a producer with any Kafka client
    sends it), keyed."""
    doc = task.model_copy(update={"idempotency_key": key}).model_dump(mode="json")
    return f"{task.tenant}:{key}".encode(), json.dumps(doc).encode()


class _Results:
    """Reads `assay.results` from its beginning: the idempotency keys that have one."""

    def __init__(self, bootstrap: str) -> None:
        self.consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        self.got: set[str] = set()

    async def start(self) -> None:
        await self.consumer.start()
        await self.consumer.topics()
        parts = [
            TopicPartition(RESULTS, p) for p in self.consumer.partitions_for_topic(RESULTS) or ()
        ]
        self.consumer.assign(parts)
        await self.consumer.seek_to_beginning(*parts)

    async def poll(self, timeout_ms: int) -> None:
        batches = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=5000)
        for batch in batches.values():
            for r in batch:
                env = open_envelope(r.value)
                if env.type == RunResult.type:
                    self.got.add(str(env.payload["idempotency_key"]))


async def _autovacuum_often(admin_dsn: str) -> None:
    """The soak's own cluster: autovacuum every `AUTOVACUUM_NAPTIME_S`, each one logged."""
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f"ALTER SYSTEM SET autovacuum_naptime = '{AUTOVACUUM_NAPTIME_S}s'")
        await conn.execute("ALTER SYSTEM SET log_autovacuum_min_duration = 0")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


async def _soak_pg(d: Deployment, pg_log: Path) -> dict[str, float]:
    tenant = await routed_tenant(d, "arith-v1.yaml", 120)
    # The fixed stream: the arithmetic examples, each sent again under a new key.
    examples = ROOT / "examples" / "tasks" / "arith.jsonl"
    tasks = read_tasks(examples, tenant_id(tenant), WorkflowId("arith"))
    producer = AIOKafkaProducer(bootstrap_servers=d.bootstrap, acks="all", linger_ms=2)
    results = _Results(d.bootstrap)
    await producer.start()
    await results.start()
    samples: list[tuple[float, dict[str, int]]] = []
    sent: set[str] = set()
    try:
        t0 = time.monotonic()
        next_sample = t0
        while (now := time.monotonic()) - t0 < SOAK_PG_S:
            while len(sent) - len(results.got & sent) < PG_IN_FLIGHT:
                key = f"soak-{len(sent)}"
                sent.add(key)
                k, v = _task(tasks[len(sent) % len(tasks)], key)
                await producer.send(TASKS, v, key=k)
            await producer.flush()
            if now >= next_sample:
                samples.append((now - t0, await _table_bytes(d)))
                next_sample += PG_SAMPLE_S
            await results.poll(200)
        deadline = time.monotonic() + 120
        while not sent <= results.got and time.monotonic() < deadline:
            await results.poll(500)
    finally:
        await results.consumer.stop()
        await producer.stop()
    tuples = await d.query(
        "SELECT schemaname || '.' || relname AS t, n_live_tup AS live, n_dead_tup AS dead,"
        " autovacuum_count AS vacuums FROM pg_stat_user_tables WHERE schemaname = ANY($1::text[])",
        list(STAGE_ROLES),
    )
    rows = {r["t"]: (r["live"], r["dead"], r["vacuums"]) for r in tuples}
    # An autovacuum a conflicting lock cancelled, or kept from starting, says so.
    server_log = await asyncio.to_thread(pg_log.read_text)
    cancelled = Counter(
        re.findall(r'CONTEXT:  automatic vacuum of table "[^".]+\.([^"]+)"', server_log)
    )
    skipped = Counter(
        re.findall(r'skipping vacuum of "([^"]+)" --- lock not available', server_log)
    )
    with contextlib.redirect_stdout(io.StringIO()) as out:
        check = await check_postgres(d.admin_dsn, check=True, source="the soak's admin DSN")
    if check:
        print(out.getvalue(), file=sys.stderr)
    if trace := os.environ.get("ASSAY_SOAK_PG_SAMPLES"):  # every sample, for a closer look
        dump = json.dumps([{"at": at, **sizes} for at, sizes in samples])
        await asyncio.to_thread(Path(trace).write_text, dump)
    half = len(samples) // 2
    (_, first), (_, mid), (at, last) = samples[0], samples[half], samples[-1]
    grew = sorted(((last.get(t, 0) - mid.get(t, 0), t) for t in last), reverse=True)
    print("soak-pg: growth over the second half, largest first:", file=sys.stderr)
    for g, t in grew[:8]:
        live, dead, vacuums = rows.get(t, (0, 0, 0))
        print(
            f"  {t:<32} {g:>+12,d} B  (end {last[t]:,d} B; rows {live:,d} live,"
            f" {dead:,d} dead; autovacuumed {vacuums}x, cancelled {cancelled[t]}x;"
            f" a {t.split('.')[1]} table skipped, locked, {skipped[t.split('.')[1]]}x)",
            file=sys.stderr,
        )
    total = (sum(first.values()), sum(mid.values()), sum(last.values()))
    return {
        "soak.pg.seconds": round(at, 1),
        "soak.pg.tasks": float(len(sent)),
        "soak.pg.results_missing": float(len(sent - results.got)),
        "soak.pg.table_bytes_start": float(total[0]),
        "soak.pg.table_bytes_mid": float(total[1]),
        "soak.pg.table_bytes_end": float(total[2]),
        "soak.pg.bytes_growth_first_half": float(total[1] - total[0]),
        "soak.pg.bytes_growth_last_half": float(total[2] - total[1]),
        "soak.pg.rebuild_check_ok": float(check == 0),
    }


def soak_pg_figures(workdir: Path) -> dict[str, float]:
    """The distributed soak's figures (see the module docstring): deploy, soak, tear down."""
    postgres = start_cluster(workdir / "postgres")
    s3 = resolve_s3(workdir / "s3")
    try:
        asyncio.run(_autovacuum_often(postgres.address))
        deployed = deploy(
            workdir / "pipeline", postgres, s3, partitions=4, stages=(), extra_env=PG_RETENTION
        )
        d = asyncio.run(deployed)
        try:
            for stage in (*PIPELINE_STAGES, "console"):
                d.start(stage)
            d.wait_healthy(PG_STARTUP_S)
            return asyncio.run(_soak_pg(d, Path(postgres.details["log"])))
        finally:
            d.stop()
    finally:
        s3.stop()
        postgres.stop()
