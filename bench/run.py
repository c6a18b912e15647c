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
WARM_UP = 3000
N_TOTAL = WARM_UP + 5000
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


async def eventlog_vs_raw(tmp: Path) -> tuple[float, float]:
    """`EventLog.commit` (one event per commit, awaited one after another) and a raw
    sqlite3 loop writing one row of the log's own shape per transaction, the same
    pragmas, the same disk. The two alternate commit by commit, so both see the same
    fsync latency (it drifts on shared disks); both first write past the first WAL
    checkpoint, since steady state reuses the WAL file."""
    log = await SqliteEventLog(tmp / "log.sqlite", EventRegistry([Tick]), _fold).open()
    key = BranchKey.main(TenantId(uuid.uuid4()), "bench")
    raw = connect(tmp / "raw.sqlite")
    raw.execute(
        "CREATE TABLE log (seq INTEGER PRIMARY KEY, tenant TEXT NOT NULL, stream TEXT NOT NULL,"
        " branch INTEGER NOT NULL, lsn INTEGER NOT NULL, type TEXT NOT NULL,"
        " schema_version INTEGER NOT NULL, at_ms INTEGER NOT NULL, payload BLOB NOT NULL,"
        " UNIQUE (tenant, stream, branch, lsn))"
    )
    row = json.dumps({"n": 0, "note": PAYLOAD}).encode()
    tenant = str(uuid.uuid4())
    sql = "INSERT INTO log VALUES (NULL, ?, 'bench', 0, ?, 'Tick', 1, ?, ?)"
    batches = [CommitBatch(records=[(key, Tick(n=i, note=PAYLOAD))]) for i in range(N_TOTAL)]
    ours_s = raw_s = 0.0
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        raw.execute("BEGIN")
        raw.execute(sql, (tenant, i, int(time.time() * 1000), row))
        raw.execute("COMMIT")
        t1 = time.perf_counter()
        await log.commit(batch)
        t2 = time.perf_counter()
        if i >= WARM_UP:
            raw_s += t1 - t0
            ours_s += t2 - t1
    await log.close()
    raw.close()
    n = N_TOTAL - WARM_UP
    return n / ours_s, n / raw_s


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
        ours, raw = asyncio.run(eventlog_vs_raw(tmp))
        runs_per_s, rss = demo_figures(tmp / "demo")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures = {
        "eventlog.sqlite.events_per_s": round(ours, 1),
        "eventlog.sqlite.raw_per_s": round(raw, 1),
        "eventlog.sqlite.ratio": round(ours / raw, 3),
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
