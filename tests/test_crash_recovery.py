"""SIGKILL the embedded demo mid-run, restart it on the same data directory, and check
that every submitted task has exactly one result and nothing was recorded twice."""

from __future__ import annotations

import collections
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from assay.kernel.schema import UnknownSchema
from assay.messages import MESSAGES, RunResult, open_envelope

pytestmark = pytest.mark.slow

ASSAY = str(Path(sys.executable).parent / "assay")
TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks" / "arith.jsonl"


def _count(db: Path, sql: str) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        try:
            return int(conn.execute(sql).fetchone()[0])
        except sqlite3.OperationalError:
            return 0


def _demo(data: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [ASSAY, "--data-dir", str(data), "demo", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _log_rows(db: Path, type_: str) -> list[dict[str, Any]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT payload FROM log WHERE type = ?", (type_,)).fetchall()
    return [json.loads(p) for (p,) in rows]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill_after_results", [15, 120])
def test_sigkill_mid_demo_loses_and_duplicates_nothing(
    tmp_path: Path, kill_after_results: int
) -> None:
    data = tmp_path / "data"
    proc = _demo(data)
    deadline = time.monotonic() + 120
    while _count(
        data / "bus.sqlite", "SELECT COUNT(*) FROM records WHERE topic='assay.results'"
    ) < (kill_after_results):
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
        assert time.monotonic() < deadline, "the demo made no progress"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    again = _demo(data)
    _, err = again.communicate(timeout=240)
    assert again.returncode == 0, err.decode()
    assert b"Traceback" not in err

    expected = {json.loads(line)["idempotency_key"] for line in TASKS.read_text().splitlines()}
    results: dict[str, set[str]] = collections.defaultdict(set)
    with sqlite3.connect(data / "bus.sqlite") as conn:
        rows = conn.execute("SELECT value FROM records WHERE topic='assay.results'").fetchall()
    for (value,) in rows:
        env = open_envelope(value)
        try:
            msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
        except UnknownSchema as exc:  # pragma: no cover - a failure message, not a branch
            pytest.fail(str(exc))
        assert isinstance(msg, RunResult)
        results[msg.idempotency_key].add(env.id)  # a relay re-publish keeps its id
    assert set(results) == expected
    assert all(len(ids) == 1 for ids in results.values()), "a task got two different results"

    accepted = [e["idempotency_key"] for e in _log_rows(data / "ingest.sqlite", "TaskAccepted")]
    assert sorted(accepted) == sorted(expected), "a task was accepted twice or not at all"
    starts = [
        (r["step"], r["attempt"]) for r in _log_rows(data / "execute.sqlite", "AttemptStarted") if r
    ]
    assert starts  # the log holds attempts
    with sqlite3.connect(data / "execute.sqlite") as conn:
        dup_attempts = conn.execute(
            "SELECT COUNT(*) FROM (SELECT tenant, stream, branch, "
            "json_extract(payload, '$.step'), json_extract(payload, '$.attempt') "
            "FROM log WHERE type='AttemptStarted' GROUP BY 1, 2, 3, 4, 5 HAVING COUNT(*) > 1)"
        ).fetchone()[0]
        dup_runs = conn.execute(
            "SELECT COUNT(*) FROM (SELECT stream FROM log WHERE type='RunFinished' "
            "GROUP BY stream, branch HAVING COUNT(*) > 1)"
        ).fetchone()[0]
    assert dup_attempts == 0
    assert dup_runs == 0
    for db, type_, field in [
        ("verify.sqlite", "RunVerdictRecorded", "run_id"),
        ("tournament.sqlite", "RunScored", "run_id"),
        ("aggregate.sqlite", "VersionTallied", "run_id"),
    ]:
        ids = [e[field] for e in _log_rows(data / db, type_)]
        assert len(ids) == len(set(ids)), f"{db}: {type_} recorded twice for one run"

    check = subprocess.run(
        [ASSAY, "--data-dir", str(data), "rebuild", "--check"], capture_output=True, timeout=120
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
