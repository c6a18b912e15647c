"""`DocumentTable`s in both `EventLog` adapters: the table follows its kind of documents
inside the commit (put, patch, delete), leaves other kinds alone, and is rebuilt with
them; its composite indexes are there for the planner."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import asyncpg
import pytest
from pydantic import Field

from assay.devstack import Service
from assay.devstack.postgres import scratch_database
from assay.kernel.ids import MessageId, TenantId
from assay.record import (
    BranchKey,
    Delete,
    DocumentTable,
    Event,
    EventRegistry,
    LogRecord,
    Patch,
    Put,
    StateDelta,
    StateKey,
    TableColumn,
)
from assay.store import CommitBatch, DuplicateMessage, EventLog, SqliteEventLog
from assay.store.postgres import PostgresEventLog

ADAPTERS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
TENANT = TenantId(uuid.UUID("11111111-0000-4000-8000-000000000001"))
TABLE = DocumentTable(
    kind="thing",
    table="things",
    columns=(
        TableColumn("colour", "text"),
        TableColumn("size", "integer"),
        TableColumn("ok", "boolean"),
    ),
    indexes=(("colour", "size"),),
)


class Changed(Event):
    type: ClassVar[str] = "tables.Changed"
    version: ClassVar[int] = 1
    name: str
    fields: dict[str, Any] = Field(default_factory=dict)
    put: bool = False
    delete: bool = False


def fold(record: LogRecord) -> list[StateDelta]:
    e = record.event
    assert isinstance(e, Changed)
    at = StateKey(record.key.tenant, "thing", e.name)
    other = Put(StateKey(record.key.tenant, "other", e.name), {"colour": "none"})
    if e.delete:
        return [Delete(at)]
    return [Put(at, e.fields) if e.put else Patch(at, e.fields), other]


@pytest.fixture(scope="module")
def tables_database(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_tables") as dsn:
        yield dsn


@pytest.fixture(params=ADAPTERS)
async def log(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[EventLog]:
    registry = EventRegistry([Changed])
    opened: EventLog
    if request.param == "sqlite":
        opened = await SqliteEventLog(tmp_path / "s.sqlite", registry, fold, tables=(TABLE,)).open()
        opened.rows = lambda: _sqlite_rows(tmp_path / "s.sqlite")  # type: ignore[attr-defined]
    else:
        dsn = str(request.getfixturevalue("tables_database"))
        schema = f"t_{uuid.uuid4().hex[:12]}"
        opened = await PostgresEventLog(dsn, schema, registry, fold, tables=(TABLE,)).open()
        opened.rows = lambda: _pg_rows(dsn, schema)  # type: ignore[attr-defined]
    yield opened
    await opened.close()


async def _sqlite_rows(path: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as conn:
        found = conn.execute("SELECT key, colour, size, ok FROM things ORDER BY key").fetchall()
    return [(k, c, s, None if ok is None else bool(ok)) for k, c, s, ok in found]


async def _pg_rows(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    conn = await asyncpg.connect(dsn)
    try:
        found = await conn.fetch(
            f'SELECT key, colour, size, ok FROM "{schema}".things ORDER BY key'
        )
    finally:
        await conn.close()
    return [tuple(r) for r in found]


async def _commit(log: EventLog, n: int, *events: Changed) -> None:
    key = BranchKey.main(TENANT, "things")
    await log.commit(
        CommitBatch(records=[(key, e) for e in events], inbox=(TENANT, MessageId(f"m{n}")))
    )


async def rows(log: EventLog) -> list[tuple[Any, ...]]:
    return await log.rows()  # type: ignore[attr-defined, no-any-return]


async def test_the_table_follows_puts_patches_and_deletes(log: EventLog) -> None:
    await _commit(
        log,
        1,
        Changed(name="a", put=True, fields={"colour": "red", "size": 3, "ok": True}),
        Changed(name="b", fields={"colour": "blue"}),
    )
    assert await rows(log) == [("a", "red", 3, True), ("b", "blue", None, None)]
    await _commit(log, 2, Changed(name="b", fields={"size": 9, "ok": False}))
    await _commit(log, 3, Changed(name="a", delete=True))
    assert await rows(log) == [("b", "blue", 9, False)]


async def test_a_refused_commit_leaves_the_table_as_it_was(log: EventLog) -> None:
    await _commit(log, 1, Changed(name="a", put=True, fields={"colour": "red"}))
    with pytest.raises(DuplicateMessage):
        await _commit(log, 1, Changed(name="z", put=True, fields={"colour": "green"}))
    assert await rows(log) == [("a", "red", None, None)]


async def test_a_rebuild_rebuilds_the_table(log: EventLog) -> None:
    await _commit(log, 1, Changed(name="a", put=True, fields={"colour": "red", "size": 1}))
    await _commit(log, 2, Changed(name="a", fields={"size": 2}))
    report = await log.rebuild(keep=True)
    assert report.identical
    assert await rows(log) == [("a", "red", 2, None)]


def test_a_table_refuses_what_it_cannot_name() -> None:
    with pytest.raises(ValueError, match="does not have"):
        DocumentTable(kind="k", table="t", columns=(TableColumn("a", "text"),), indexes=(("b",),))
    with pytest.raises(ValueError, match="bad column"):
        TableColumn("a; drop", "text")
    with pytest.raises(ValueError, match="bad document table"):
        DocumentTable(kind="k", table="t", columns=(TableColumn("tenant", "text"),))
    with pytest.raises(ValueError, match="bad document table"):
        DocumentTable(kind="k' OR 1=1", table="t", columns=(TableColumn("a", "text"),))


@pytest.mark.parametrize("adapter", ADAPTERS)
async def test_a_store_of_an_earlier_version_gains_a_new_column(
    adapter: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A table an earlier version made, without a column added since, still opens; the
    column is filled from the documents already there and follows every later write."""
    older = DocumentTable(
        kind=TABLE.kind, table=TABLE.table, columns=TABLE.columns[:2], indexes=TABLE.indexes
    )
    registry = EventRegistry([Changed])
    path = tmp_path / "old.sqlite"
    dsn = str(request.getfixturevalue("tables_database")) if adapter == "postgres" else ""
    schema = f"t_{uuid.uuid4().hex[:12]}"

    def opened(t: DocumentTable) -> SqliteEventLog | PostgresEventLog:
        if adapter == "sqlite":
            return SqliteEventLog(path, registry, fold, tables=(t,))
        return PostgresEventLog(dsn, schema, registry, fold, tables=(t,))

    async def read() -> list[tuple[Any, ...]]:
        return await (_sqlite_rows(path) if adapter == "sqlite" else _pg_rows(dsn, schema))

    log = await opened(older).open()
    await _commit(log, 1, Changed(name="a", put=True, fields={"colour": "red", "ok": True}))
    await log.close()
    log = await opened(TABLE).open()
    try:
        assert await read() == [("a", "red", None, True)]
        await _commit(log, 2, Changed(name="b", put=True, fields={"size": 2, "ok": False}))
        await _commit(log, 3, Changed(name="a", fields={"ok": False}))
        assert await read() == [("a", "red", None, False), ("b", None, 2, False)]
    finally:
        await log.close()


async def test_a_sqlite_file_that_fails_to_gain_a_column_is_left_as_it_was(
    tmp_path: Path,
) -> None:
    """Adding a column and filling it is one transaction: when the filling fails (here a
    document that is not JSON), the file keeps its old table, so the next open adds and
    fills the column again instead of finding it there, empty."""
    older = DocumentTable(
        kind=TABLE.kind, table=TABLE.table, columns=TABLE.columns[:2], indexes=TABLE.indexes
    )
    registry = EventRegistry([Changed])
    path = tmp_path / "old.sqlite"
    log = await SqliteEventLog(path, registry, fold, tables=(older,)).open()
    await _commit(log, 1, Changed(name="a", put=True, fields={"colour": "red"}))
    await log.close()
    with sqlite3.connect(path) as conn:  # the document is damaged behind the triggers' back
        for name in ("ins", "upd", "del"):
            conn.execute(f"DROP TRIGGER {TABLE.table}_{name}")
        conn.execute("UPDATE state SET value = CAST('{' AS BLOB) WHERE kind = ?", (TABLE.kind,))

    with pytest.raises(sqlite3.OperationalError, match="JSON"):
        await SqliteEventLog(path, registry, fold, tables=(TABLE,)).open()
    with sqlite3.connect(path) as conn:
        columns = [row[1] for row in conn.execute(f"PRAGMA table_info({TABLE.table})")]
    assert "ok" not in columns
