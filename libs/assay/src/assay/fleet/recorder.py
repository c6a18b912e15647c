"""`assay fleet record -- CMD`: an observe-only recorder for agents outside Assay.

It runs the command with stdin, stdout and stderr passed through and never read,
samples the command's process tree — CPU seconds, resident memory, process count —
from `/proc` into a sibling metrics file, and turns the wait marks the command makes
(`assay.fleet.markers`, `assay fleet mark`) into a lifecycle trace when it exits. It
reads no argument, environment value, file or network traffic of the command. The
samples are best-effort observations (a process that exits between samples takes its
CPU time with it), not billing-grade accounting.

Both files are created owner-only before the command starts and never over an
existing file; if the marks do not form a valid trace, both are removed and the
error names the rule. This module is the I/O edge: the rest of `assay.fleet` is pure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from assay.fleet.errors import FleetError
from assay.fleet.markers import MARKS_ENV
from assay.fleet.metrics import METRICS_FORMAT
from assay.fleet.trace import TRACE_FORMAT, TRACE_VERSION, Trace
from assay.fleet.validate import parse_trace


@dataclass(frozen=True)
class Recording:
    """What to record, and where."""

    output: Path
    name: str
    workflow_version: str
    cpu_cores: float
    memory_gib: float
    sample_interval_s: float = 1.0

    @property
    def metrics(self) -> Path:
        """The sibling metrics file: `x.jsonl` -> `x.metrics.jsonl`."""
        return self.output.with_name(self.output.name.removesuffix(".jsonl") + ".metrics.jsonl")


@dataclass(frozen=True)
class Sample:
    """The process tree at one moment."""

    cpu_seconds: float
    rss_bytes: int
    processes: int


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # it exited
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def sample_tree(root: int) -> Sample:
    """CPU, RSS and process count of `root` and every descendant alive now."""
    tree, todo, seen = _children(), [root], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo.extend(tree.get(pid, []))
    ticks, pages, alive = 0, 0, 0
    for pid in seen:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            statm = Path(f"/proc/{pid}/statm").read_text().split()
        except OSError:
            continue
        if fields[0] == "Z":
            continue  # a zombie holds nothing
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
        pages += int(statm[1])
        alive += 1
    hz = os.sysconf("SC_CLK_TCK")
    return Sample(ticks / hz, pages * os.sysconf("SC_PAGE_SIZE"), alive)


def trace_from_marks(rec: Recording, marks: str, origin_ns: int, end_ns: int) -> Trace:
    """The trace of a recording from its marks, validated as any trace is.

    Raises:
        TraceInvalid: the marks do not pair up (a wait that never ends, overlapping
            waits, a mark of another kind than the open wait).
        FleetError: a mark line is not one the markers write.
    """
    got = []
    for n, line in enumerate(marks.splitlines(), start=1):
        try:
            doc = json.loads(line)
            got.append((int(doc["t_ns"]), str(doc["kind"]), str(doc["edge"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise FleetError(f"{rec.output}: mark {n} is malformed") from exc
    end_ms = max(0, (end_ns - origin_ns) // 1_000_000)
    lines: list[dict[str, Any]] = [
        {
            "type": "header",
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "workflow_id": rec.name,
            "workflow_version": rec.workflow_version,
            "run": rec.output.name.removesuffix(".jsonl"),
            "cpu_cores": rec.cpu_cores,
            "memory_gib": rec.memory_gib,
            "source": "record",
        },
        {"type": "run_started", "t_ms": 0},
    ]
    for t_ns, kind, edge in sorted(got, key=lambda m: m[0]):
        t_ms = min(end_ms, max(0, (t_ns - origin_ns) // 1_000_000))
        lines.append({"type": f"wait_{edge}", "t_ms": t_ms, "kind": kind})
    lines.append({"type": "run_finished", "t_ms": end_ms, "outcome": "exited"})
    text = "".join(json.dumps(x, sort_keys=True) + "\n" for x in lines)
    return parse_trace(text, f"{rec.output} (from its marks)")


def _create(path: Path) -> int:
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise FleetError(f"{path} exists: refusing to overwrite it") from exc
    except OSError as exc:
        raise FleetError(f"{path}: cannot create: {exc}") from exc


def record(rec: Recording, command: Sequence[str]) -> int:
    """Run `command`, record it, and return its exit status (negative: killed by a signal).

    Raises:
        FleetError: an output file exists (nothing is written), the command cannot be
            started, or its marks do not form a valid trace (both files are removed).
    """
    if not command:
        raise FleetError("no command to record: give it after --")
    if not rec.sample_interval_s > 0:
        raise FleetError("--sample-interval must be positive")
    for path in (rec.output, rec.metrics):
        if path.exists():
            raise FleetError(f"{path} exists: refusing to overwrite it")
    trace_out = os.fdopen(_create(rec.output), "w", encoding="utf-8")
    try:
        metrics = os.fdopen(_create(rec.metrics), "w", encoding="utf-8")
    except FleetError:
        trace_out.close()
        rec.output.unlink()
        raise
    private = Path(tempfile.mkdtemp(prefix="assay-fleet-"))  # 0700
    marks = private / "marks.jsonl"
    try:
        with trace_out, metrics:
            os.close(os.open(marks, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            head = {"type": "header", "format": METRICS_FORMAT, "version": 1}
            metrics.write(json.dumps(head, sort_keys=True) + "\n")
            origin = time.monotonic_ns()
            try:
                child = subprocess.Popen(list(command), env={**os.environ, MARKS_ENV: str(marks)})
            except OSError as exc:
                raise FleetError(f"cannot start {command[0]!r}: {exc}") from exc
            status = _observe(child, metrics, origin, rec.sample_interval_s)
            trace = trace_from_marks(rec, marks.read_text(), origin, time.monotonic_ns())
            trace_out.write(trace.to_jsonl())
        return status
    except BaseException:
        rec.output.unlink(missing_ok=True)
        rec.metrics.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _observe(child: subprocess.Popen[bytes], metrics: Any, origin: int, every_s: float) -> int:
    """Sample the child's tree every `every_s` until it exits; its exit status."""
    while True:
        s = sample_tree(child.pid)
        doc = {
            "type": "sample",
            "t_ms": (time.monotonic_ns() - origin) // 1_000_000,
            "cpu_seconds": round(s.cpu_seconds, 3),
            "rss_bytes": s.rss_bytes,
            "processes": s.processes,
        }
        metrics.write(json.dumps(doc, sort_keys=True) + "\n")
        metrics.flush()
        try:
            return child.wait(timeout=every_s)  # the exit ends the wait at once
        except subprocess.TimeoutExpired:
            continue
