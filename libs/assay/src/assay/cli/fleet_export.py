"""`assay fleet export`: lifecycle traces of recorded runs, from the execute log as it is.

The log is the data directory's (`execute.sqlite`, then `local-runs.sqlite`) or, given
`--database-url` or `ASSAY_DATABASE_URL`, the `execute` schema in Postgres, read-only.
Runs are selected on their derived run documents (tenant, workflow, version, start
time); each one's live branch is read record by record and turned into a trace by
`assay.fleet.export`. Every file is checked to be new before any is written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from assay.cli.logs import postgres_log, tenant_arg
from assay.cli.runs import EXECUTE_LOG, LOCAL_RUNS_LOG, PG_SCHEMA, read_branch
from assay.engine.events import WORK_EVENTS, fold_work
from assay.fleet.errors import FleetError
from assay.fleet.export import Resources, trace_of_run
from assay.fleet.trace import Trace
from assay.kernel.ids import BranchId, TenantId
from assay.record.events import BranchKey
from assay.store.ports import EventLog
from assay.store.sqlite import SqliteEventLog


@dataclass(frozen=True)
class Selection:
    """Which runs to export."""

    tenant: TenantId | None = None
    workflow: str | None = None
    version: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None

    def takes(self, doc: dict[str, object]) -> bool:
        """Whether a run document is selected."""
        started = doc.get("started_ms")
        if self.workflow is not None and doc.get("workflow_id") != self.workflow:
            return False
        version = doc.get("workflow_version")
        if self.version is not None and not (
            isinstance(version, str) and version.startswith(self.version)
        ):
            return False
        if not isinstance(started, int):
            return False
        if self.since_ms is not None and started < self.since_ms:
            return False
        return self.until_ms is None or started < self.until_ms


def time_arg(value: str | None, flag: str) -> int | None:
    """An ISO 8601 time (UTC when it names no zone) as epoch milliseconds.

    Raises:
        FleetError: it is not one.
    """
    if value is None:
        return None
    try:
        at = datetime.fromisoformat(value)
    except ValueError as exc:
        raise FleetError(f"{flag} must be an ISO 8601 time, not {value!r}") from exc
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return int(at.timestamp() * 1000)


@dataclass
class Exported:
    """The traces derived, and the runs passed over (and why)."""

    traces: list[Trace]
    unfinished: int = 0
    tiered: int = 0
    tenants: set[TenantId] | None = None


async def _from_log(
    log: EventLog, select: Selection, resources: Resources, sandboxed: frozenset[str]
) -> Exported:
    if select.tenant is not None:
        docs = [(select.tenant, k, d) for k, d in await log.scan(select.tenant, "run")]
    else:
        docs = await log.scan_kind("run")
    out = Exported([], tenants=set())
    for tenant, run, doc in sorted(docs, key=lambda x: (str(x[0]), x[1])):
        if "/" in run or not select.takes(doc):
            continue  # a sub-workflow's stream belongs to its parent run
        if doc.get("tiered"):
            out.tiered += 1
            continue
        branch = doc.get("branch")
        if not isinstance(branch, int):
            continue
        records = await read_branch(log, BranchKey(tenant, run, BranchId(branch)))
        trace = trace_of_run(records, resources, sandboxed)
        if trace is None:
            out.unfinished += 1
            continue
        assert out.tenants is not None
        out.tenants.add(tenant)
        out.traces.append(trace)
    return out


async def export_traces(
    data_dir: Path,
    database_url: str | None,
    select: Selection,
    resources: Resources,
    sandboxed: frozenset[str],
) -> Exported:
    """The traces of the selected, finished runs.

    Raises:
        AssayError: no log, a log that cannot be read, or runs of several tenants when
            none was named.
    """
    parts: list[Exported] = []
    if database_url:
        async with postgres_log(database_url, PG_SCHEMA, WORK_EVENTS, fold_work) as log:
            parts.append(await _from_log(log, select, resources, sandboxed))
    else:
        paths = [p for p in (data_dir / EXECUTE_LOG, data_dir / LOCAL_RUNS_LOG) if p.is_file()]
        if not paths:
            raise FleetError(f"no execute log in {data_dir}")
        for path in paths:
            sqlite = await SqliteEventLog(path, WORK_EVENTS, fold_work).open()
            try:
                parts.append(await _from_log(sqlite, select, resources, sandboxed))
            finally:
                await sqlite.close()
    tenants = set().union(*(p.tenants or set() for p in parts))
    if len(tenants) > 1:
        raise FleetError(
            f"the selected runs belong to {len(tenants)} tenants: name one with --tenant"
        )
    return Exported(
        traces=[t for p in parts for t in p.traces],
        unfinished=sum(p.unfinished for p in parts),
        tiered=sum(p.tiered for p in parts),
        tenants=tenants,
    )


def write_new(directory: Path, files: dict[str, str]) -> None:
    """Write each file under `directory`, owner-only, none of them over an existing one.

    Raises:
        FleetError: a file exists already; nothing is written.
    """
    taken = sorted(name for name in files if (directory / name).exists())
    if taken:
        raise FleetError(f"{directory / taken[0]} exists: refusing to overwrite it")
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        create_new(path, content)


def create_new(path: Path, content: str) -> None:
    """Create `path` owner-only (0600) with `content`; never over an existing file.

    Raises:
        FleetError: it exists.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise FleetError(f"{path} exists: refusing to overwrite it") from exc
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(content)


async def export_command(
    data_dir: Path,
    database_url: str | None,
    output: Path,
    *,
    tenant: str | None,
    workflow: str | None,
    version: str | None,
    since: str | None,
    until: str | None,
    cpu_cores: float,
    memory_gib: float,
    sandboxed: frozenset[str],
) -> int:
    """Export the selected runs' traces into `output`, one `<run>.jsonl` each."""
    if not (cpu_cores > 0 and memory_gib > 0):
        raise FleetError("--cpu-cores and --memory-gib must be positive")
    select = Selection(
        tenant=tenant_arg(tenant) if tenant else None,
        workflow=workflow,
        version=version,
        since_ms=time_arg(since, "--since"),
        until_ms=time_arg(until, "--until"),
    )
    got = await export_traces(
        data_dir, database_url, select, Resources(cpu_cores, memory_gib), sandboxed
    )
    write_new(output, {f"{t.header.run}.jsonl": t.to_jsonl() for t in got.traces})
    summary = {
        "directory": str(output),
        "written": len(got.traces),
        "skipped": {"unfinished": got.unfinished, "tiered": got.tiered},
    }
    print(json.dumps(summary, sort_keys=True))
    return 0
