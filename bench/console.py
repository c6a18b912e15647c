"""The console's runs list at a million runs: one filtered keyset page, p95; and the
overview over time at the same million runs, p95.

The console's read model — each run's document in `state` and its row in
`console_runs` — is filled in bulk with `CONSOLE_RUNS` runs of one tenant (the worst
case: every run in one tenant's index ranges), on SQLite and on Postgres. Then
`ConsoleReads.runs`, what `GET /api/runs` calls, answers `PAGES` pages under filters
drawn at random from what an operator asks (a workflow, a version, a state, failed
runs, an idempotency-key prefix, a time window, combinations; first pages and pages
further on by cursor); the figure is the 95th percentile of their latencies.

Then `overview_series`, what `GET /api/overview/series` calls, answers `SERIES`
windows (each window by its default bucket, ending at a random point of the runs'
span; a 7- or 30-day window holds every run); the figure is the 95th percentile.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sqlite3
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from assay.devstack import InfraUnavailable
from assay.devstack.postgres import create_database, drop_database, resolve_postgres
from assay.kernel import RunState, TenantId
from assay.kernel.ids import new_run_id
from assay.store import SqliteEventLog
from assay.store.postgres import PostgresEventLog
from assay_console.overview_series import (
    DEFAULT_BUCKET,
    DEFAULT_WINDOW,
    WINDOWS,
    SeriesQuery,
    overview_series,
)
from assay_console.reads import ConsoleReads, PostgresRunsTable, RunFilters, SqliteRunsTable
from assay_console.stage import CONSOLE_EVENTS, CONSOLE_TABLES, RUNS_TABLE, RunRow, fold_console

CONSOLE_RUNS = int(os.environ.get("ASSAY_BENCH_CONSOLE_RUNS", "1000000"))
PAGES = 400
SERIES = 60
LIMIT = 50
T0_MS = 1_780_000_000_000
STEP_MS = 250
"""Four runs a second: a million runs span about 2.9 days."""
WORKFLOWS = [f"wf-{i}" for i in range(10)]
STATES = [
    (RunState.UNGRADED, 20),
    (RunState.VERIFIED_FAIL, 3),
    (RunState.RUNNING, 2),
    (RunState.SUSPENDED, 1),
    (RunState.CANCELLED, 1),
    (RunState.GRADED, 73),
]
TENANT = TenantId(uuid.UUID("cccccccc-0000-4000-8000-000000000003"))


def rows(n: int) -> Iterator[RunRow]:
    """`n` runs of one tenant, oldest first, deterministic."""
    rng = random.Random(7)
    states = [s.value for s, _ in STATES]
    weights = [w for _, w in STATES]
    for i in range(n):
        ms = T0_MS + i * STEP_MS
        workflow = WORKFLOWS[i % len(WORKFLOWS)]
        state = rng.choices(states, weights)[0]
        passed = None if state in ("running", "suspended", "cancelled") else rng.random() < 0.7
        status = "graded" if state == "graded" else ("ungraded" if state == "ungraded" else None)
        # a result 2 s to about 2 min after creation (log-normal), for every ended run
        latency = round(1000 * min(rng.lognormvariate(2.5, 0.8), 600) + 2000)
        yield RunRow(
            run_id=new_run_id(ms, i.to_bytes(10, "big")),
            task_id=f"task-{i}",
            idempotency_key=f"task-{i:07d}",
            workflow_id=workflow,
            workflow_version=f"v{(i // 100_000) % 3}-{workflow}".ljust(64, "0"),
            role="current",
            purpose="work",
            created_ms=ms,
            state=state,
            passed=passed if state != "verified_fail" else False,
            status=status,
            result_ms=ms + latency if status else None,
            score_kind="relative" if state == "graded" else None,
            ungraded_reason="no_reference" if state == "ungraded" else None,
        )


def table_row(row: RunRow) -> tuple[object, ...]:
    """The `console_runs` row of a run, in `RUNS_TABLE`'s column order."""
    doc = row.model_dump()
    return tuple(doc.get(c.name) for c in RUNS_TABLE.columns)


def queries(n: int, rng: random.Random) -> list[tuple[RunFilters, int]]:
    """`PAGES` filtered lists, each with how many pages deep to read (by cursor)."""
    span_ms = n * STEP_MS

    def at(frac: float) -> datetime:
        return datetime.fromtimestamp((T0_MS + frac * span_ms) / 1000, UTC)

    out = []
    for _ in range(PAGES):
        wf = rng.choice(WORKFLOWS)
        start = rng.random() * 0.9
        kind = rng.randrange(8)
        filters = [
            RunFilters(),
            RunFilters(workflow=wf),
            RunFilters(workflow=wf, version=f"v{rng.randrange(3)}-{wf}".ljust(64, "0")),
            RunFilters(state=rng.choice([RunState.GRADED, RunState.UNGRADED])),
            RunFilters(passed=False),
            RunFilters(key=f"task-{rng.randrange(n // 1000):04d}"),
            RunFilters(since=at(start), until=at(start + 0.05)),
            RunFilters(workflow=wf, passed=False),
        ][kind]
        out.append((filters, rng.choice([1, 1, 1, 3, 10])))
    return out


async def page_p95(reads: ConsoleReads, n: int) -> float:
    """The p95 latency (ms) of one page, over every page read by `queries`."""
    latencies = []
    for filters, depth in queries(n, random.Random(11)):
        cursor = None
        for _ in range(depth):
            t0 = time.perf_counter()
            page = await reads.runs(TENANT, filters, cursor, LIMIT)
            latencies.append((time.perf_counter() - t0) * 1000)
            cursor = page.next_cursor
            if cursor is None:
                break
    return statistics.quantiles(latencies, n=100)[94]


async def series_p95(reads: ConsoleReads, n: int) -> tuple[float, float]:
    """The p95 latency (ms) of one tenant's overview over time, over `SERIES` windows,
    and the median of the default window's (the overview page's, refreshed while open)."""
    rng = random.Random(13)
    span_ms = n * STEP_MS
    latencies: dict[str, list[float]] = {w: [] for w in WINDOWS}
    for i in range(SERIES):
        window = list(WINDOWS)[i % len(WINDOWS)]
        end = T0_MS + round(rng.random() * span_ms) + WINDOWS[window]
        q = SeriesQuery(window, DEFAULT_BUCKET[window], end)
        t0 = time.perf_counter()
        await overview_series(reads.table, TENANT, q)
        latencies[window].append((time.perf_counter() - t0) * 1000)
    medians = {w: round(statistics.median(ms), 1) for w, ms in latencies.items()}
    print(f"overview series, median ms by window: {medians}", file=sys.stderr)
    every = [ms for by_window in latencies.values() for ms in by_window]
    return statistics.quantiles(every, n=100)[94], medians[DEFAULT_WINDOW]


async def timed(reads: ConsoleReads, n: int) -> tuple[float, float, float]:
    """The runs list's p95, the overview series' p95 and its default window's median (ms)."""
    return await page_p95(reads, n), *await series_p95(reads, n)


async def sqlite_p95(workdir: Path, n: int) -> tuple[float, float, float]:
    """Fill the console's SQLite store in bulk, then time pages through its reads."""
    store = workdir / "console.sqlite"
    log = await SqliteEventLog(store, CONSOLE_EVENTS, fold_console, tables=CONSOLE_TABLES).open()
    await log.close()
    db = sqlite3.connect(store)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=OFF")
    with db:  # the store's triggers fill console_runs from each document
        db.executemany(
            "INSERT INTO state (tenant, kind, key, value) VALUES (?, ?, ?, ?)",
            (
                (str(TENANT), RunRow.kind, r.run_id, json.dumps(r.model_dump()).encode())
                for r in rows(n)
            ),
        )
    db.execute("ANALYZE")
    db.close()
    log = await SqliteEventLog(store, CONSOLE_EVENTS, fold_console, tables=CONSOLE_TABLES).open()
    reads = ConsoleReads(log, SqliteRunsTable(store))
    try:
        return await timed(reads, n)
    finally:
        await reads.close()
        await log.close()


async def postgres_p95(admin_dsn: str, n: int) -> tuple[float, float, float]:
    """Fill the console's Postgres schema in bulk (COPY), then time pages through its
    reads. The bulk load writes the documents and their table rows apart (the row
    trigger, which the console's commits use, is bypassed for the load only)."""
    name = f"assay_bench_{uuid.uuid4().hex[:10]}"
    dsn = await create_database(admin_dsn, name)
    try:
        log = await PostgresEventLog(
            dsn, "console", CONSOLE_EVENTS, fold_console, tables=CONSOLE_TABLES
        ).open()
        await log.close()
        import asyncpg

        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("SET session_replication_role = replica")  # no row triggers
            batch: list[RunRow] = []
            columns = [c.name for c in RUNS_TABLE.columns]
            for row in rows(n):
                batch.append(row)
                if len(batch) == 50_000:
                    await copy(conn, batch, columns)
                    batch = []
            if batch:
                await copy(conn, batch, columns)
            await conn.execute("ANALYZE console.state; ANALYZE console.console_runs")
        finally:
            await conn.close()
        log = await PostgresEventLog(
            dsn, "console", CONSOLE_EVENTS, fold_console, tables=CONSOLE_TABLES
        ).open()
        reads = ConsoleReads(log, await PostgresRunsTable.connect(dsn, "console"))
        try:
            return await timed(reads, n)
        finally:
            await reads.close()
            await log.close()
    finally:
        await drop_database(admin_dsn, name)


async def copy(conn: object, batch: list[RunRow], columns: list[str]) -> None:
    """COPY a batch of runs into `state` and `console_runs`."""
    import asyncpg

    assert isinstance(conn, asyncpg.Connection)
    await conn.copy_records_to_table(
        "state",
        schema_name="console",
        columns=["tenant", "kind", "key", "value"],
        records=[
            (TENANT, RunRow.kind, r.run_id, json.dumps(r.model_dump()).encode()) for r in batch
        ],
    )
    await conn.copy_records_to_table(
        "console_runs",
        schema_name="console",
        columns=["tenant", "key", *columns],
        records=[(TENANT, r.run_id, *table_row(r)) for r in batch],
    )


def console_figures(workdir: Path) -> dict[str, float]:
    """`console.runs_page_p95_ms.{sqlite,postgres}`,
    `console.overview_series_p95_ms.{sqlite,postgres}` and
    `console.overview_series_24h_ms.{sqlite,postgres}` at `CONSOLE_RUNS` runs (Postgres
    when a server can be had here)."""
    (workdir / "sqlite").mkdir(parents=True, exist_ok=True)
    page, series, day = asyncio.run(sqlite_p95(workdir / "sqlite", CONSOLE_RUNS))
    figures = {
        "console.runs": float(CONSOLE_RUNS),
        "console.runs_page_p95_ms.sqlite": round(page, 2),
        "console.overview_series_p95_ms.sqlite": round(series, 2),
        "console.overview_series_24h_ms.sqlite": round(day, 2),
    }
    try:
        server = resolve_postgres(workdir / "postgres")
    except InfraUnavailable as exc:
        print(f"no Postgres console figure: {exc}")
        return figures
    try:
        page, series, day = asyncio.run(postgres_p95(server.address, CONSOLE_RUNS))
        figures["console.runs_page_p95_ms.postgres"] = round(page, 2)
        figures["console.overview_series_p95_ms.postgres"] = round(series, 2)
        figures["console.overview_series_24h_ms.postgres"] = round(day, 2)
    finally:
        server.stop()
    return figures
