"""Reading a stage's log from the command line, as it is: nothing is migrated or written."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId, tenant_id
from assay.record.events import EventRegistry, LogRecord
from assay.record.state import Fold, StateDelta
from assay.store.ports import EventLog

NO_EVENTS = EventRegistry([])
"""For reading a stage's derived state only: no record is decoded."""


def no_fold(record: LogRecord) -> list[StateDelta]:
    """For reading a stage's derived state only: nothing is folded."""
    return []


@asynccontextmanager
async def postgres_log(
    dsn: str, schema: str, events: EventRegistry = NO_EVENTS, fold: Fold = no_fold
) -> AsyncIterator[EventLog]:
    """The stage log in `schema` of the database at `dsn`, read-only.

    Raises:
        AssayError: the database cannot be reached, holds no such log, or the read fails.
    """
    import asyncpg

    from assay.store.postgres import PostgresEventLog

    log = PostgresEventLog(dsn, schema, events, fold, pool_size=1)
    try:
        await log.open(migrate_schema=False)
    except (OSError, asyncpg.PostgresError) as exc:
        raise AssayError(f"cannot connect to $ASSAY_DATABASE_URL: {exc}") from exc
    try:
        yield log
    except asyncpg.UndefinedTableError as exc:
        raise AssayError(f"no {schema} log in $ASSAY_DATABASE_URL's database") from exc
    except asyncpg.PostgresError as exc:
        raise AssayError(f"cannot read the {schema} log: {exc}") from exc
    finally:
        await log.close()


def tenant_arg(value: str) -> TenantId:
    """A `--tenant` argument as a tenant id.

    Raises:
        AssayError: it is not a UUID.
    """
    try:
        return tenant_id(value)
    except ValueError as exc:
        raise AssayError(f"--tenant must be a UUID, not {value!r}") from exc


@asynccontextmanager
async def stage_state(data_dir: Path, stage: str, missing: str) -> AsyncIterator[EventLog]:
    """A stage's derived state, read-only: its schema in `ASSAY_DATABASE_URL` when that is
    set, else its SQLite file in `data_dir`.

    Raises:
        AssayError: no such state (`missing` says what that means), or it cannot be read.
    """
    from assay.runtime.settings import AssaySettings
    from assay.store.sqlite import SqliteEventLog

    database_url = AssaySettings.from_env().database.url
    if database_url:
        async with postgres_log(database_url, stage) as log:
            yield log
        return
    path = data_dir / f"{stage}.sqlite"
    if not path.is_file():
        raise AssayError(f"no {stage} state in {data_dir}: {missing}")
    sqlite = await SqliteEventLog(path, NO_EVENTS, no_fold).open()
    try:
        yield sqlite
    finally:
        await sqlite.close()
