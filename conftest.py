"""Infrastructure fixtures shared by every test directory.

Each resolves its service in order: an address from the environment, a
testcontainers container when a Docker engine answers, or a local process it
starts itself (`assay.devstack`). In CI (`CI=true`) a service that cannot be
had fails the test run; elsewhere the tests that need it are skipped.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from assay.devstack import InfraUnavailable, Service
from assay.devstack.postgres import scratch_database
from assay.engine import WORK_EVENTS, fold_work
from assay.store import SqliteEventLog
from assay.store.ports import EventLog
from assay.store.postgres import PostgresEventLog

# pytest caches each test module with its asserts rewritten only where bytecode may be
# written; under PYTHONDONTWRITEBYTECODE every run rewrote all of them again, about
# half of collecting the suite. This process only: the processes tests start keep
# the environment they are given.
sys.dont_write_bytecode = False

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _unavailable(what: str, exc: Exception) -> None:
    message = f"{what} is not available here: {exc}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def infra_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where locally started services keep their files and logs."""
    return tmp_path_factory.mktemp("infra")


def _service(what: str, resolve: Callable[[Path], Service], workdir: Path) -> Iterator[Service]:
    try:
        service = resolve(workdir)
    except InfraUnavailable as exc:
        _unavailable(what, exc)
        raise
    yield service
    service.stop()


@pytest.fixture(scope="session")
def postgres(infra_dir: Path) -> Iterator[Service]:
    """A Postgres server (its superuser DSN in `.address`)."""
    from assay.devstack.postgres import resolve_postgres

    yield from _service("Postgres", resolve_postgres, infra_dir)


@pytest.fixture(scope="module")
def own_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A throwaway Postgres cluster of the module's own (its superuser DSN in `.address`),
    for tests of server-wide names — roles, database names — that other tests sharing a
    server would create, alter or drop meanwhile."""
    from assay.devstack.postgres import start_cluster

    yield from _service(
        "a throwaway Postgres cluster", start_cluster, tmp_path_factory.mktemp("pg")
    )


@pytest.fixture(scope="session")
def kafka(infra_dir: Path) -> Iterator[Service]:
    """A Kafka-protocol broker (its bootstrap address in `.address`)."""
    from assay.devstack.kafka import resolve_kafka

    yield from _service("a Kafka-protocol broker", resolve_kafka, infra_dir)


@pytest.fixture(scope="session")
def s3(infra_dir: Path) -> Iterator[Service]:
    """An S3 API (its endpoint URL in `.address`; credentials in `.details`)."""
    from assay.devstack.s3 import resolve_s3

    yield from _service("an S3 API", resolve_s3, infra_dir)


# -- the execute stage's log, in both modes (library and execute-stage tests) ------------

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
