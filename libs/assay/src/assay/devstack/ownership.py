"""What a stack made on a Postgres server it did not start — and only that.

`assay up` on a borrowed server (the one on this machine, or the one
`ASSAY_TEST_DATABASE_URL` names) uses a database and stage roles named for the
stack, `assay_<id>` and `assay_<id>_<stage>`, where `<id>` is a short random id kept
in the work directory's `owned.json`. An object is the stack's only if the stack's
own `CREATE` made it: `owned.json` lists each one as soon as its `CREATE` succeeded.
The record outlives `assay down`, so the next `assay up` in that directory reuses the
id and may empty its own database again; `assay down --purge` drops what it lists
and nothing else. A name the stack did not create is never dropped or altered: `up`
refuses and says what to do instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg

from assay.devstack.postgres import with_database
from assay.kernel.errors import AssayError
from assay.store.pg_provision import stage_role

OWNED = "owned.json"
"""The record of a work directory's objects on a borrowed Postgres server."""


class StackConflict(AssayError):
    """The server holds an object of the stack's name that the stack did not create,
    or this work directory's objects are on another server."""


class OwnedRecordInvalid(AssayError):
    """`owned.json` is not a record this module wrote."""


@dataclass
class StackObjects:
    """A stack's id and the Postgres objects its own `CREATE`s made."""

    stack: str
    """Short random id: the stack's database and roles are named for it."""
    server: str | None = None
    """Superuser DSN of the server the objects are on (None: nothing made yet)."""
    database: str | None = None
    """The database, once created by the stack."""
    roles: list[str] = field(default_factory=list)
    """The stage roles created by the stack."""

    @property
    def database_name(self) -> str:
        """The stack's database: `assay_<id>`."""
        return f"assay_{self.stack}"

    def role(self, stage: str) -> str:
        """The stack's login role of `stage`: `assay_<id>_<stage>`."""
        return stage_role(stage, self.stack)

    def is_empty(self) -> bool:
        """Whether the record lists no object."""
        return self.database is None and not self.roles


def new_stack_id() -> str:
    """Eight random lower-case letters (26^8 ids): a plain identifier, as names need."""
    return "".join(secrets.choice(string.ascii_lowercase) for _ in range(8))


def load_objects(workdir: Path) -> StackObjects:
    """The work directory's record, or a new stack id when it has none (not yet saved).

    Raises:
        OwnedRecordInvalid: `owned.json` exists but cannot be read as a record.
    """
    path = workdir / OWNED
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return StackObjects(new_stack_id())
    except (OSError, ValueError) as exc:
        raise OwnedRecordInvalid(f"cannot read {path}: {exc}") from exc
    try:
        objects = StackObjects(
            str(data["stack"]),
            None if data["server"] is None else str(data["server"]),
            None if data["database"] is None else str(data["database"]),
            [str(r) for r in data["roles"]],
        )
        objects.role("ingest")  # the id must make plain names
    except (KeyError, TypeError, ValueError) as exc:
        raise OwnedRecordInvalid(f"{path} is not a record of a stack's objects: {exc}") from exc
    return objects


def _save(workdir: Path, objects: StackObjects) -> None:
    """Write the record atomically, readable only by its owner (the DSN may hold a password)."""
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = workdir / f".{OWNED}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(
            {
                "stack": objects.stack,
                "server": objects.server,
                "database": objects.database,
                "roles": objects.roles,
            },
            out,
            indent=2,
        )
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(workdir / OWNED)


def _server(dsn: str) -> tuple[str, int]:
    parts = urlsplit(dsn)
    return parts.hostname or "", parts.port or 5432


def server_name(dsn: str) -> str:
    """`host:port` of a DSN, for messages (never its password)."""
    host, port = _server(dsn)
    return f"{host}:{port}"


async def claim(admin_dsn: str, workdir: Path, objects: StackObjects, stages: Iterable[str]) -> str:
    """Give the stack a fresh database of its own and a login role per stage on the
    server `admin_dsn` reaches, recording each object in `owned.json` as it is made.

    The stack's database is dropped and created again only when the record says the
    stack created it; otherwise it is created, and one of that name already there is a
    conflict. Each stage role not recorded is created (`NOLOGIN`; provisioning gives it
    a login and a password), and one already there is a conflict.

    Returns:
        A superuser DSN of the stack's database.

    Raises:
        StackConflict: a database or role of the stack's names exists that the stack
            did not create, or the record's objects are on another server. The
            message says what to do instead; nothing of the user's is touched.
        asyncpg.PostgresError, OSError: the server refused or cannot be reached.
    """
    where = server_name(admin_dsn)
    recorded = objects.server
    if recorded is not None and not objects.is_empty() and _server(recorded) != _server(admin_dsn):
        raise StackConflict(
            f"the stack recorded in {workdir / OWNED} has a database and roles on"
            f" {server_name(recorded)}, not {where}: run `assay down --purge"
            f" --dir {workdir}` to remove them first, or use another --dir"
        )
    objects.server = admin_dsn
    _save(workdir, objects)
    name = objects.database_name
    conn = await asyncpg.connect(admin_dsn)
    try:
        if objects.database == name:  # ours: every stack starts from an empty database
            await _execute(conn, "DROP DATABASE IF EXISTS %I WITH (FORCE)", name)
        try:
            await _execute(conn, "CREATE DATABASE %I", name)
        except asyncpg.DuplicateDatabaseError:
            raise StackConflict(
                f"database {name} already exists on {where} and this stack did not create"
                f" it, so it is left as it is: use another --dir for a stack of another"
                f" name, or drop {name} yourself if it is yours to drop"
            ) from None
        objects.database = name
        _save(workdir, objects)
        for stage in stages:
            role = objects.role(stage)
            if role in objects.roles:
                continue  # ours: provisioning sets its password again
            try:
                await _execute(conn, "CREATE ROLE %I NOLOGIN", role)
            except asyncpg.DuplicateObjectError:
                raise StackConflict(
                    f"role {role} already exists on {where} and this stack did not create"
                    f" it, so it is left as it is: use another --dir for a stack of another"
                    f" name, or drop {role} yourself if it is yours to drop (`assay down"
                    f" --purge --dir {workdir}` removes what this stack did create)"
                ) from None
            objects.roles.append(role)
            _save(workdir, objects)
    finally:
        await conn.close()
    return with_database(admin_dsn, name)


@dataclass
class PurgeReport:
    """What `purge` dropped, and what it could not (still recorded)."""

    dropped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


async def purge(workdir: Path) -> PurgeReport:
    """Drop the database and the roles `owned.json` records — those the stack created,
    nothing else — and forget each as it goes; remove the record once it is empty.

    A role that still owns or holds something elsewhere (someone granted it more) is
    kept, and `PurgeReport.kept` says why.

    Raises:
        OwnedRecordInvalid: `owned.json` cannot be read.
        AssayError: the server cannot be reached (the record is kept).
    """
    report = PurgeReport()
    path = workdir / OWNED
    if not path.exists():
        return report
    objects = load_objects(workdir)
    if objects.server is None or objects.is_empty():
        path.unlink()
        return report
    try:
        conn = await asyncpg.connect(objects.server, timeout=10)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        raise AssayError(
            f"cannot reach {server_name(objects.server)} to drop what {path} records: {exc}"
        ) from exc
    try:
        if objects.database is not None:
            await _execute(conn, "DROP DATABASE IF EXISTS %I WITH (FORCE)", objects.database)
            report.dropped.append(f"database {objects.database}")
            objects.database = None
            _save(workdir, objects)
        for role in list(objects.roles):
            try:
                await _execute(conn, "DROP ROLE IF EXISTS %I", role)
            except asyncpg.DependentObjectsStillExistError as exc:
                report.kept.append(f"role {role}: {exc}")
                continue
            report.dropped.append(f"role {role}")
            objects.roles.remove(role)
            _save(workdir, objects)
    finally:
        await conn.close()
    if objects.is_empty():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return report


async def _execute(conn: asyncpg.Connection, template: str, *names: str) -> None:
    """Run a statement whose identifiers (`%I`) the server's `format()` quotes."""
    placeholders = ", ".join(f"${i}::text" for i in range(1, len(names) + 2))
    await conn.execute(await conn.fetchval(f"SELECT format({placeholders})", template, *names))
