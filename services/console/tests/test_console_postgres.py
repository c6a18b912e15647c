"""The console's reads in distributed mode: its Postgres schema's `console_runs` table
(kept by the store's triggers) answers the same pages, filters and counts, and its
workflow streams the same ladders."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from assay.devstack import Service
from assay.devstack.postgres import scratch_database
from assay.kernel import RunState
from assay.kernel.ids import MessageId
from assay.messages import RunResult, RunSpawned, RunStatusChanged
from assay.record import Event
from assay.store import CommitBatch
from assay.store.postgres import PostgresEventLog
from assay.store.sqlite import SqliteEventLog
from assay_console.ladder import workflow_stream
from assay_console.reads import ConsoleReads, PostgresRunsTable, RunFilters
from assay_console.stage import (
    CONSOLE_EVENTS,
    RUNS_TABLE,
    ResultSeen,
    RunSeen,
    StatusSeen,
    fold_console,
    run_stream,
)
from assay_console.workflows import list_workflows, workflow_detail
from services.console.tests.console_seed import TENANT_A, TENANT_B, messages, run_ref
from services.console.tests.ladder_seed import TOURNEY, seed_ladder

pytestmark = pytest.mark.postgres


def as_event(msg: object) -> tuple[str, Event]:
    match msg:
        case RunSpawned(run=run, input=task_input):
            return run.run_id, RunSeen(run=run, input=task_input)
        case RunStatusChanged(run=run, state=state, detail=detail):
            return run.run_id, StatusSeen(run=run, state=state, detail=detail)
        case RunResult() as r:
            return r.run_id, ResultSeen(result=r)
    raise AssertionError(msg)


@pytest.fixture
async def reads(postgres: Service) -> AsyncIterator[ConsoleReads]:
    schema = f"console_{uuid.uuid4().hex[:8]}"
    with scratch_database(postgres, "assay_console") as dsn:
        log = await PostgresEventLog(
            dsn, schema, CONSOLE_EVENTS, fold_console, tables=(RUNS_TABLE,)
        ).open()
        for tenant, count in ((TENANT_A, 5), (TENANT_B, 2)):
            for n, (_, msg, idem) in enumerate(messages(tenant, count)):
                run_id, event = as_event(msg)
                batch = CommitBatch(
                    records=[(run_stream(tenant, run_id), event)],
                    inbox=(tenant, MessageId(f"{idem}-{n}")),
                )
                await log.commit(batch)
        found = ConsoleReads(log, await PostgresRunsTable.connect(dsn, schema))
        yield found
        await found.close()
        await log.close()


async def test_pages_filters_and_counts_from_postgres(reads: ConsoleReads) -> None:
    first = await reads.runs(TENANT_A, RunFilters(), None, 2)
    assert [r.run_id for r in first.runs] == [run_ref(TENANT_A, n).run_id for n in (4, 3)]
    assert first.next_cursor is not None
    rest = await reads.runs(TENANT_A, RunFilters(), first.next_cursor, 10)
    assert [r.run_id for r in rest.runs] == [run_ref(TENANT_A, n).run_id for n in (2, 1, 0)]
    failed = await reads.runs(TENANT_A, RunFilters(passed=False), None, 10)
    assert [r.run_id for r in failed.runs] == [run_ref(TENANT_A, n).run_id for n in (3, 1)]
    ungraded = await reads.runs(TENANT_A, RunFilters(state=RunState.UNGRADED), None, 10)
    assert len(ungraded.runs) == 5
    view = await reads.overview(TENANT_A)
    assert (view.runs, view.results, view.ungraded) == (5, 5, {"no_reference": 5})
    assert await reads.tenants() == [TENANT_A, TENANT_B]


async def test_another_tenants_run_is_none_from_postgres(reads: ConsoleReads) -> None:
    assert await reads.run(TENANT_A, run_ref(TENANT_B, 0).run_id) is None
    detail = await reads.run(TENANT_B, run_ref(TENANT_B, 0).run_id)
    assert detail is not None
    assert [t.state for t in detail.timeline][-1] == "ungraded"


async def test_workflows_read_the_same_from_postgres(postgres: Service, tmp_path: Path) -> None:
    """The ladder seeded into an embedded store, copied record for record into Postgres,
    reads back the same: lists, DAGs, paths, strengths, and nothing across tenants."""
    await seed_ladder(tmp_path)
    store = tmp_path / "console.sqlite"
    lite = await SqliteEventLog(store, CONSOLE_EVENTS, fold_console, tables=(RUNS_TABLE,)).open()
    schema = f"console_{uuid.uuid4().hex[:8]}"
    workflows = [(TENANT_A, "arith"), (TENANT_A, TOURNEY), (TENANT_B, "secret")]
    with scratch_database(postgres, "assay_console") as dsn:
        pg = await PostgresEventLog(
            dsn, schema, CONSOLE_EVENTS, fold_console, tables=(RUNS_TABLE,)
        ).open()
        try:
            for tenant, workflow in workflows:
                stream = workflow_stream(tenant, workflow)
                for n, record in enumerate(await lite.read(stream)):
                    inbox = (tenant, MessageId(f"{workflow}-{n}"))
                    await pg.commit(CommitBatch(records=[(stream, record.event)], inbox=inbox))
            for tenant in (TENANT_A, TENANT_B):
                assert await list_workflows(pg, tenant) == await list_workflows(lite, tenant)
            for tenant, workflow in workflows:
                found = await workflow_detail(pg, tenant, workflow)
                assert found is not None
                assert found == await workflow_detail(lite, tenant, workflow)
            assert await workflow_detail(pg, TENANT_A, "secret") is None
            assert await workflow_detail(pg, TENANT_B, TOURNEY) is None
        finally:
            await pg.close()
            await lite.close()
