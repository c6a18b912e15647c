"""The console's queries over its own store: the runs list (keyset pages), one run, and
a tenant's overview. Every query is scoped to one tenant.

The runs list reads the `console_runs` table (`RUNS_TABLE`) through a read-only
connection of its own: the tenant and the filters select one index range, walked in
descending run-id order (newest first) from the cursor, `limit + 1` rows at most.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import sqlite3
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, time, timedelta
from pathlib import Path
from typing import Any, Protocol

import asyncpg
from pydantic import BaseModel, ConfigDict, Field

from assay.kernel import RunState
from assay.kernel.canonical import content_hash
from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId, is_run_id, new_run_id, tenant_id
from assay.kernel.scores import Score
from assay.messages import RolloutResult, Usage, VerifierResult
from assay.record.erasure import Tombstone, tombstone_at
from assay.runtime.settings import AssaySettings
from assay.store.pg_schema import quoted
from assay.store.ports import EventLog
from assay_console.ladder import ProposalRow, WorkflowRow
from assay_console.spend import calibration_stream
from assay_console.spend_views import (
    MAX_DAYS,
    JudgeHealth,
    SpendReport,
    bucket_rows,
    calibration_points,
    ceilings,
)
from assay_console.stage import (
    GradeSeen,
    IndeterminateSeen,
    ResultSeen,
    RolloutRow,
    RunRow,
    RunSeen,
    StatusSeen,
    VerdictSeen,
    run_stream,
)
from assay_console.workflow_views import ProposalsList, WorkflowDetail, WorkflowsList
from assay_console.workflows import list_workflows, open_proposals, proposal_row, workflow_detail

MAX_LIMIT = 200
"""The largest page the server returns, whatever `limit` asks."""
MAX_KEY = 500
"""The longest idempotency-key filter (and rollout group key) the console takes."""


class BadQuery(AssayError):
    """A query the console cannot answer as asked (a malformed cursor, a bad filter)."""


class RunFilters(BaseModel):
    """Filters of the runs list; every one optional, all of them combined."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    workflow: str | None = Field(None, description="Workflow id.")
    version: str | None = Field(None, description="Workflow version (needs `workflow`).")
    state: RunState | None = Field(None, description="Current lifecycle state.")
    passed: bool | None = Field(None, description="Verification outcome.")
    since: datetime | None = Field(None, description="Created at or after (ISO 8601).")
    until: datetime | None = Field(None, description="Created before (ISO 8601).")
    key: str | None = Field(
        None, max_length=MAX_KEY, description="Idempotency keys starting with this text."
    )


class RunSummary(BaseModel):
    """One row of the runs list."""

    run_id: str = Field(description="The run (ULID).")
    created_at: datetime = Field(description="When the run was created (from its id).")
    workflow_id: str = Field(description="Workflow.")
    workflow_version: str = Field(description="Pinned version.")
    idempotency_key: str = Field(description="The submitting task's idempotency key.")
    role: str = Field(description="Current or challenger.")
    purpose: str = Field(description="Work or shadow.")
    state: str | None = Field(description="Latest lifecycle state seen.")
    passed: bool | None = Field(description="Verification outcome, once known.")
    status: str | None = Field(description="Result status: graded, ungraded or cancelled.")
    score_kind: str | None = Field(description="The score's variant.")
    ungraded_reason: str | None = Field(description="Why the run is ungraded, if it is.")
    indeterminate: bool = Field(description="An attempt ended Indeterminate.")


class RunsPage(BaseModel):
    """One page of the runs list, newest first."""

    runs: list[RunSummary] = Field(description="The page's runs.")
    next_cursor: str | None = Field(description="Opaque cursor of the next page; None: last.")


class StatusEntry(BaseModel):
    """One step of a run's lifecycle timeline."""

    state: str = Field(description="State entered.")
    detail: str = Field(description="Why, for people.")
    at: datetime = Field(description="When the console recorded it.")


class IndeterminateEntry(BaseModel):
    """An attempt whose outcome is unknown."""

    step: str = Field(description="Step.")
    attempt: int = Field(description="Attempt number.")
    tool: str = Field(description="Tool.")
    reason: str = Field(description="Why unknown.")


class RunDetail(BaseModel):
    """Everything the console knows of one run."""

    run: RunSummary = Field(description="The run's row.")
    input: dict[str, Any] | None = Field(description="The task input, once seen.")
    timeline: list[StatusEntry] = Field(description="Lifecycle states, in order.")
    indeterminate: list[IndeterminateEntry] = Field(description="Indeterminate attempts.")
    verdict: list[VerifierResult] | None = Field(description="Each verifier's result.")
    score: Score | None = Field(description="The score.")
    usage: Usage | None = Field(description="Model usage.")
    termination: str | None = Field(description="How execution ended.")
    output: str | None = Field(description="The run's output, when small.")


class Overview(BaseModel):
    """One tenant at a glance."""

    tenant: TenantId = Field(description="The tenant.")
    runs: int = Field(description="Runs seen.")
    by_state: dict[str, int] = Field(description="Runs by current state.")
    results: int = Field(description="Runs with a result.")
    pass_rate: float | None = Field(description="Passed over verified; None: none verified.")
    indeterminate: int = Field(description="Runs with an Indeterminate attempt.")
    graded: int = Field(description="Results that carry a score.")
    ungraded: dict[str, int] = Field(description="Ungraded results by reason.")
    open_proposals: int = Field(0, description="Proposals waiting for an operator's review.")


def encode_cursor(filters: RunFilters, after: str) -> str:
    """An opaque cursor: the last run id shown, bound to the filters it was shown under."""
    raw = f"1:{_filters_tag(filters)}:{after}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(filters: RunFilters, cursor: str) -> str:
    """The run id a cursor continues after.

    Raises:
        BadQuery: the cursor is malformed or belongs to other filters.
    """
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        version, tag, after = raw.split(":")
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise BadQuery("cursor is malformed") from exc
    if version != "1" or not is_run_id(after):
        raise BadQuery("cursor is malformed")
    if tag != _filters_tag(filters):
        raise BadQuery("cursor belongs to other filters: start again from the first page")
    return after


def _filters_tag(filters: RunFilters) -> str:
    return content_hash(filters.model_dump(mode="json"))[:12]


def _bound(at: datetime) -> str:
    """The lowest run id created at `at`."""
    ms = int(at.timestamp() * 1000) if at.tzinfo else int(at.replace(tzinfo=UTC).timestamp() * 1000)
    return new_run_id(max(ms, 0), bytes(10))


def runs_query(
    tenant: TenantId, filters: RunFilters, after: str | None, limit: int
) -> tuple[str, list[Any]]:
    """The SQL (`?` placeholders) of one page: one index range of `console_runs`."""
    where: list[str] = ["tenant = ?"]
    args: list[Any] = [str(tenant)]
    equal = [
        ("workflow_id", filters.workflow),
        ("workflow_version", filters.version),
        ("state", filters.state.value if filters.state else None),
        ("passed", filters.passed),
    ]
    for column, value in equal:
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    if filters.key:
        where.append("idempotency_key >= ? AND idempotency_key < ?")
        args += [filters.key, filters.key + "\U0010ffff"]
    if filters.since is not None:
        where.append("key >= ?")
        args.append(_bound(filters.since))
    if filters.until is not None:
        where.append("key < ?")
        args.append(_bound(filters.until))
    if after is not None:
        where.append("key < ?")
        args.append(after)
    sql = f"SELECT key FROM console_runs WHERE {' AND '.join(where)} ORDER BY key DESC LIMIT ?"
    return sql, [*args, limit + 1]


class RunsTable(Protocol):
    """Read access to the `console_runs` table of the console's own store."""

    async def fetch(self, sql: str, args: Sequence[Any]) -> list[tuple[Any, ...]]:
        """Rows of a query written with `?` placeholders over `console_runs`."""
        ...

    async def close(self) -> None:
        """Release the connection."""
        ...


class SqliteRunsTable:
    """The table in embedded mode: a read-only connection of its own to the console's file."""

    def __init__(self, path: Path) -> None:
        self._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)

    async def fetch(self, sql: str, args: Sequence[Any]) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, list(args)).fetchall()

    async def close(self) -> None:
        self._conn.close()


class PostgresRunsTable:
    """The table in distributed mode: the console schema's, through a small pool."""

    def __init__(self, pool: asyncpg.Pool, schema: str) -> None:
        self._pool = pool
        self._schema = quoted(schema)

    @classmethod
    async def connect(cls, dsn: str, schema: str) -> PostgresRunsTable:
        """Open a pool of two connections to the console's own role and schema."""
        return cls(await asyncpg.create_pool(dsn, min_size=1, max_size=2), schema)

    async def fetch(self, sql: str, args: Sequence[Any]) -> list[tuple[Any, ...]]:
        for table in ("console_runs", "console_usage"):
            sql = sql.replace(table, f"{self._schema}.{table}")
        parts = sql.split("?")
        numbered = parts[0] + "".join(f"${i}{part}" for i, part in enumerate(parts[1:], 1))
        async with self._pool.acquire() as conn:
            return [tuple(r) for r in await conn.fetch(numbered, *args)]

    async def close(self) -> None:
        await self._pool.close()


class ConsoleReads:
    """The console's queries: documents and streams through its log, the runs list and
    counts through its `console_runs` table."""

    def __init__(self, log: EventLog, table: RunsTable) -> None:
        self._log = log
        self._table = table

    async def close(self) -> None:
        """Close the table's connection (the log is its owner's)."""
        await self._table.close()

    @property
    def table(self) -> RunsTable:
        """The `console_runs` table, for queries of their own (`overview_series.py`)."""
        return self._table

    async def tombstone(self, tenant: TenantId) -> Tombstone | None:
        """The console's tombstone of a deleted tenant (its own part of the deletion)."""
        doc = await self._log.get(tombstone_at(tenant))
        return None if doc is None else Tombstone.model_validate(doc)

    async def knows(self, tenant: TenantId) -> bool:
        """Whether the console's read model holds a workflow or a run of `tenant`, or its
        tombstone: the tenants the console's API can delete."""
        if await self.tombstone(tenant) is not None:
            return True
        if await self._log.scan(tenant, WorkflowRow.kind):
            return True
        return bool((await self.runs(tenant, RunFilters(), None, 1)).runs)

    async def runs(
        self, tenant: TenantId, filters: RunFilters, cursor: str | None, limit: int
    ) -> RunsPage:
        """One page of the tenant's runs, newest first.

        Raises:
            BadQuery: a malformed cursor, or `version` without `workflow`.
        """
        if filters.version is not None and filters.workflow is None:
            raise BadQuery("version filters need a workflow")
        after = decode_cursor(filters, cursor) if cursor else None
        limit = max(1, min(limit, MAX_LIMIT))
        sql, args = runs_query(tenant, filters, after, limit)
        keys = [k for (k,) in await self._table.fetch(sql, args)]
        more = len(keys) > limit
        # One document per row, asked together: a pooled store answers them at once.
        docs = await asyncio.gather(*(self._log.get(RunRow.at(tenant, k)) for k in keys[:limit]))
        rows = [summary(RunRow.model_validate(doc)) for doc in docs if doc is not None]
        nxt = encode_cursor(filters, keys[limit - 1]) if more else None
        return RunsPage(runs=rows, next_cursor=nxt)

    async def run(self, tenant: TenantId, run_id: str) -> RunDetail | None:
        """One run of the tenant; None when the tenant has no such run."""
        doc = await self._log.get(RunRow.at(tenant, run_id))
        if doc is None:
            return None
        detail = RunDetail(
            run=summary(RunRow.model_validate(doc)),
            input=None,
            timeline=[],
            indeterminate=[],
            verdict=None,
            score=None,
            usage=None,
            termination=None,
            output=None,
        )
        for record in await self._log.read(run_stream(tenant, run_id)):
            at = datetime.fromtimestamp(record.at_ms / 1000, UTC)
            match record.event:
                case RunSeen(input=task_input):
                    detail.input = task_input
                case StatusSeen(state=state, detail=why):
                    detail.timeline.append(StatusEntry(state=state.value, detail=why, at=at))
                case IndeterminateSeen() as e:
                    detail.indeterminate.append(
                        IndeterminateEntry(
                            step=e.step, attempt=e.attempt, tool=e.tool, reason=e.reason
                        )
                    )
                case VerdictSeen(results=results, usage=usage):
                    detail.verdict, detail.usage = results, usage
                case GradeSeen(score=score):
                    detail.score = detail.score or score
                case ResultSeen(result=r):
                    detail.verdict, detail.score, detail.usage = r.verification, r.score, r.usage
                    detail.termination, detail.output = r.termination, r.output
        return detail

    async def group_runs(self, tenant: TenantId, group: str) -> list[RunSummary]:
        """The tenant's runs whose task key is `group` (a rollout group's siblings),
        newest first, at most a page of them."""
        if len(group) > MAX_KEY:
            return []
        page = await self.runs(tenant, RunFilters(key=group), None, MAX_LIMIT)
        return [r for r in page.runs if r.idempotency_key == group]

    async def rollout_result(self, tenant: TenantId, group: str) -> RolloutResult | None:
        """The tenant's rollout group's result; None until it closed (or no such group)."""
        doc = await self._log.get(RolloutRow.at(tenant, group))
        row = None if doc is None else RolloutRow.model_validate(doc)
        return (
            None if row is None or row.result is None else RolloutResult.model_validate(row.result)
        )

    async def workflows(self, tenant: TenantId) -> WorkflowsList:
        """The tenant's workflows, by id."""
        return await list_workflows(self._log, tenant)

    async def workflow(self, tenant: TenantId, workflow_id: str) -> WorkflowDetail | None:
        """One workflow's ladder; None when the tenant has no such workflow."""
        return await workflow_detail(self._log, tenant, workflow_id)

    async def proposals(self, tenant: TenantId) -> ProposalsList:
        """The tenant's open proposals, oldest first."""
        return await open_proposals(self._log, tenant)

    async def proposal(self, tenant: TenantId, proposal_id: str) -> ProposalRow | None:
        """One proposal of the tenant; None when the console has seen no such one."""
        return await proposal_row(self._log, tenant, proposal_id)

    async def spend(
        self, tenant: TenantId, days: int, bucket: str, settings: AssaySettings | None
    ) -> SpendReport:
        """The tenant's spend by purpose over the last `days` UTC days (today included),
        by `hour` or `day`, its ceilings, and its judge's calibration rounds.

        Raises:
            BadQuery: `days` out of range or an unknown bucket.
        """
        if not 1 <= days <= MAX_DAYS:
            raise BadQuery(f"days: between 1 and {MAX_DAYS}")
        if bucket not in ("hour", "day"):
            raise BadQuery(f"bucket: {bucket!r} is not hour or day")
        now = datetime.now(UTC)
        since = datetime.combine(now.date() - timedelta(days=days - 1), time(), UTC)
        width = 3_600_000 if bucket == "hour" else 86_400_000
        sql = (
            f"SELECT hour_ms - hour_ms % {width}, purpose, count(*),"
            " CAST(sum(CASE WHEN failed THEN 1 ELSE 0 END) AS BIGINT),"
            " CAST(sum(prompt_tokens) AS BIGINT), CAST(sum(completion_tokens) AS BIGINT),"
            " CAST(sum(cost_micro_usd) AS BIGINT)"
            " FROM console_usage WHERE tenant = ? AND hour_ms >= ? GROUP BY 1, 2 ORDER BY 1, 2"
        )
        rows = await self._table.fetch(sql, (str(tenant), int(since.timestamp() * 1000)))
        buckets = bucket_rows(
            [
                (int(t), str(p), int(c), int(f), int(i), int(o), int(m))
                for t, p, c, f, i, o, m in rows
            ]
        )
        limits, notes = ceilings(settings, tenant, buckets, now.date())
        rounds = calibration_points(await self._log.read(calibration_stream(tenant)))
        minimum = settings.calibration.min_agreement if settings is not None else None
        return SpendReport(
            tenant=tenant,
            bucket="hour" if bucket == "hour" else "day",
            since=since,
            buckets=buckets,
            ceilings=limits,
            judge=JudgeHealth(min_agreement=minimum, rounds=rounds),
            notes=notes,
        )

    async def tenants(self) -> list[TenantId]:
        """Tenants with a run (for an administrator's overview)."""
        rows = await self._table.fetch("SELECT DISTINCT tenant FROM console_runs ORDER BY 1", ())
        return [tenant_id(str(t)) for (t,) in rows]

    async def overview(self, tenant: TenantId) -> Overview:
        """The tenant's runs by state, results, pass rate, Indeterminate and Ungraded."""
        sql = (
            "SELECT state, passed, status, ungraded_reason, indeterminate, count(*)"
            " FROM console_runs WHERE tenant = ? GROUP BY 1, 2, 3, 4, 5"
        )
        by_state: Counter[str] = Counter()
        ungraded: Counter[str] = Counter()
        runs = results = passed = verified = indeterminate = graded = 0
        for state, ok, status, reason, indet, n in await self._table.fetch(sql, (str(tenant),)):
            runs += n
            by_state[state or "unknown"] += n
            if ok is not None:
                verified += n
                passed += n if ok else 0
            if status is not None:
                results += n
            if status == "graded":
                graded += n
            if status == "ungraded":
                ungraded[reason or "unknown"] += n
            if indet:
                indeterminate += n
        return Overview(
            tenant=tenant,
            runs=runs,
            by_state=dict(sorted(by_state.items())),
            results=results,
            pass_rate=passed / verified if verified else None,
            indeterminate=indeterminate,
            graded=graded,
            ungraded=dict(sorted(ungraded.items())),
            open_proposals=len((await self.proposals(tenant)).proposals),
        )


def summary(row: RunRow) -> RunSummary:
    """A row of the list from a run's document."""
    return RunSummary(
        run_id=row.run_id,
        created_at=datetime.fromtimestamp(row.created_ms / 1000, UTC),
        workflow_id=row.workflow_id,
        workflow_version=row.workflow_version,
        idempotency_key=row.idempotency_key,
        role=row.role,
        purpose=row.purpose,
        state=row.state,
        passed=row.passed,
        status=row.status,
        score_kind=row.score_kind,
        ungraded_reason=row.ungraded_reason,
        indeterminate=row.indeterminate,
    )
