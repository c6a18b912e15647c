"""Fixtures shared by the library's tests: the execute stage's log in both modes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from assay.devstack.base import Service
from assay.devstack.postgres import scratch_database
from assay.engine import WORK_EVENTS, fold_work
from assay.store import SqliteEventLog
from assay.store.ports import EventLog
from assay.store.postgres import PostgresEventLog

BOTH_MODES = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(scope="module")
def work_database(postgres: Service) -> Iterator[str]:
    """A database of the module's own on the Postgres server."""
    with scratch_database(postgres, "assay_work") as dsn:
        yield dsn


class WorkLogs:
    """Opens the execute stage's event log in one mode; reopening gives the same store."""

    def __init__(self, mode: str, where: Path | str) -> None:
        self.mode = mode
        self.where = where
        self.schema = f"work_{uuid.uuid4().hex[:12]}"
        self.opened: list[EventLog] = []

    async def open(self) -> EventLog:
        """A fresh connection to the same store."""
        log: EventLog
        if isinstance(self.where, Path):
            log = await SqliteEventLog(self.where / "execute.sqlite", WORK_EVENTS, fold_work).open()
        else:
            log = await PostgresEventLog(self.where, self.schema, WORK_EVENTS, fold_work).open()
        self.opened.append(log)
        return log


@pytest.fixture(params=BOTH_MODES)
async def work_logs(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[WorkLogs]:
    """The execute stage's store, on SQLite and on Postgres."""
    where: Path | str = tmp_path
    if request.param == "postgres":
        where = str(request.getfixturevalue("work_database"))
    logs = WorkLogs(str(request.param), where)
    yield logs
    for log in reversed(logs.opened):
        await log.close()


@pytest.fixture
async def work_log(work_logs: WorkLogs) -> EventLog:
    """One open execute-stage log, in each mode."""
    log: EventLog = await work_logs.open()
    return log
