"""What a tenant holds in an embedded data directory, read straight from the files: every
table of every stage's SQLite file, its blob prefix and its workspace root. For the
tenant-deletion tests: the deleted tenant's leftovers, another tenant's bytes."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

BUS = "bus.sqlite"
"""The embedded bus keeps a deleted tenant's messages until its topic retention, as
Kafka's topics do; it is not a stage's store."""


def _tables(db: sqlite3.Connection) -> list[tuple[str, list[str]]]:
    names = [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    return [(n, [c[1] for c in db.execute(f"PRAGMA table_info({n})")]) for n in sorted(names)]


def rows_of(data_dir: Path, tenant: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of `tenant` in every stage's file, by `file/table`: the rows of each table
    with a tenant column, and outbox rows by their key (`tenant` or `tenant:...`). Tables
    with neither (consumer positions, migrations) hold no tenant's data."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for path in sorted(data_dir.glob("*.sqlite")):
        if path.name == BUS:
            continue
        with closing(sqlite3.connect(path)) as db:
            for table, columns in _tables(db):
                if "tenant" in columns:
                    query = f"SELECT * FROM {table} WHERE tenant = ?"
                    rows = db.execute(query, (tenant,)).fetchall()
                elif table == "outbox":
                    query = (
                        "SELECT topic, key, value, headers FROM outbox WHERE key = ? OR key LIKE ?"
                    )
                    rows = db.execute(query, (tenant, f"{tenant}:%")).fetchall()
                else:
                    continue
                out[f"{path.name}/{table}"] = sorted(rows, key=repr)
    return out


def files_of(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by relative path (empty when there is no `root`)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def holdings(data_dir: Path, tenant: str) -> dict[str, Any]:
    """Everything of `tenant`: its rows, its blobs and its workspaces."""
    return {
        "rows": rows_of(data_dir, tenant),
        "blobs": files_of(data_dir / "blobs" / tenant),
        "workspaces": files_of(data_dir / "sandbox" / tenant),
    }


def leftovers(data_dir: Path, tenant: str, command: str) -> dict[str, list[tuple[Any, ...]]]:
    """The rows of a deleted `tenant` that are not its tombstone (the `tenant` stream's
    record, the `tenant_erased` document, the inbox entry of deletion `command`)."""
    found: dict[str, list[tuple[Any, ...]]] = {}
    with_columns: dict[str, list[str]] = {}
    for path in sorted(data_dir.glob("*.sqlite")):
        if path.name != BUS:
            with closing(sqlite3.connect(path)) as db:
                for table, columns in _tables(db):
                    with_columns[f"{path.name}/{table}"] = columns
    for where, rows in rows_of(data_dir, tenant).items():
        columns = with_columns[where]
        left = [
            r for r in rows if not _tombstone(where, dict(zip(columns, r, strict=False)), command)
        ]
        if left:
            found[where] = left
    return found


def _tombstone(where: str, row: dict[str, Any], command: str) -> bool:
    table = where.split("/", 1)[1]
    if table == "log":
        return bool(row["stream"] == "tenant")
    if table == "state":
        return bool(row["kind"] == "tenant_erased")
    if table == "inbox":
        return bool(row["message_id"] == command)
    return False
