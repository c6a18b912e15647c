"""Assay benchmarks: each figure beside its baseline, measured in the same run.

Prints a table and writes `bench/results/latest.json` (flat: figure name -> number;
names are stable across commits).
"""

from __future__ import annotations

import asyncio
import json
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import ClassVar

from assay.kernel import TenantId
from assay.record import BranchKey, Event, EventRegistry, LogRecord, Put, StateDelta, StateKey
from assay.store import CommitBatch, SqliteEventLog, connect

ROOT = Path(__file__).resolve().parents[1]
N_COMMITS = 1000
WARM_UP = 3000  # past the first WAL checkpoint: steady state reuses the WAL file
ROUNDS = 5
PAYLOAD = "x" * 160


class Tick(Event):
    """A small event, about the size of an attempt record."""

    type: ClassVar[str] = "Tick"
    version: ClassVar[int] = 1
    n: int
    note: str


def _fold(record: LogRecord) -> list[StateDelta]:
    assert isinstance(record.event, Tick)
    return [Put(StateKey(record.key.tenant, "tick", record.key.stream), {"n": record.event.n})]


async def eventlog_events_per_s(path: Path) -> float:
    """`EventLog.commit`, one event per commit, awaited one after another."""
    log = await SqliteEventLog(path, EventRegistry([Tick]), _fold).open()
    key = BranchKey.main(TenantId(uuid.uuid4()), "bench")
    for i in range(WARM_UP):
        await log.commit(CommitBatch(records=[(key, Tick(n=i, note=PAYLOAD))]))
    t0 = time.perf_counter()
    for i in range(N_COMMITS):
        await log.commit(CommitBatch(records=[(key, Tick(n=i, note=PAYLOAD))]))
    elapsed = time.perf_counter() - t0
    await log.close()
    return N_COMMITS / elapsed


def eventlog_vs_raw(tmp: Path) -> tuple[float, float, float]:
    """Both loops in alternating rounds on fresh files (fsync latency drifts on shared
    disks); the medians of each and of the per-round ratio."""
    ours, raw, ratios = [], [], []
    for r in range(ROUNDS):
        raw.append(raw_sqlite_per_s(tmp / f"raw-{r}.sqlite"))
        ours.append(asyncio.run(eventlog_events_per_s(tmp / f"log-{r}.sqlite")))
        ratios.append(ours[-1] / raw[-1])
    return statistics.median(ours), statistics.median(raw), statistics.median(ratios)


def raw_sqlite_per_s(path: Path) -> float:
    """A raw sqlite3 loop: one comparable row per transaction, the same pragmas and disk."""
    conn = connect(path)
    conn.execute(  # the same shape as the event log's table: a comparable row
        "CREATE TABLE log (seq INTEGER PRIMARY KEY, tenant TEXT NOT NULL, stream TEXT NOT NULL,"
        " branch INTEGER NOT NULL, lsn INTEGER NOT NULL, type TEXT NOT NULL,"
        " schema_version INTEGER NOT NULL, at_ms INTEGER NOT NULL, payload BLOB NOT NULL,"
        " UNIQUE (tenant, stream, branch, lsn))"
    )
    row = json.dumps({"n": 0, "note": PAYLOAD}).encode()
    tenant = str(uuid.uuid4())
    sql = "INSERT INTO log VALUES (NULL, ?, 'bench', 0, ?, 'Tick', 1, ?, ?)"
    for i in range(WARM_UP):
        conn.execute("BEGIN")
        conn.execute(sql, (tenant, i, int(time.time() * 1000), row))
        conn.execute("COMMIT")
    t0 = time.perf_counter()
    for i in range(WARM_UP, WARM_UP + N_COMMITS):
        conn.execute("BEGIN")
        conn.execute(sql, (tenant, i, int(time.time() * 1000), row))
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - t0
    conn.close()
    return N_COMMITS / elapsed


def demo_figures(data: Path) -> tuple[float, float]:
    """Runs per second of the embedded demo, and its peak RSS in MB (a child process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "assay"),
            "--data-dir",
            str(data),
            "demo",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    elapsed = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with sqlite3.connect(data / "execute.sqlite") as db:
        runs = db.execute("SELECT COUNT(*) FROM log WHERE type = 'RunFinished'").fetchone()[0]
    assert "PROMOTED v2" in done.stdout, done.stdout
    del before
    return runs / elapsed, peak_kb / 1024


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="assay-bench-", dir=ROOT / "bench"))
    try:
        ours, raw, ratio = eventlog_vs_raw(tmp)
        runs_per_s, rss = demo_figures(tmp / "demo")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures = {
        "eventlog.sqlite.events_per_s": round(ours, 1),
        "eventlog.sqlite.raw_per_s": round(raw, 1),
        "eventlog.sqlite.ratio": round(ratio, 3),
        "demo.runs_per_s": round(runs_per_s, 1),
        "demo.peak_rss_mb": round(rss, 1),
    }
    targets = {"eventlog.sqlite.ratio": ">= 0.8", "demo.peak_rss_mb": "<= 300"}
    width = max(len(k) for k in figures)
    print(f"{'figure':<{width}}  {'value':>10}  target")
    for k, v in figures.items():
        print(f"{k:<{width}}  {v:>10}  {targets.get(k, '')}")
    out = ROOT / "bench" / "results" / "latest.json"
    out.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
