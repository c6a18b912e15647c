"""What a tenant holds in an embedded data directory, read straight from the files: every
table of every stage's SQLite file, every record of the embedded bus naming it, its blob
prefix and its workspace root. For the tenant-deletion tests: the deleted tenant's
leftovers, another tenant's bytes."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

STAGES = ("ingest", "execute", "verify", "tournament", "aggregate", "decide", "console")
BUS = "bus.sqlite"
"""The embedded bus: not a stage's store; its records are read by `bus_rows_of`."""
TENANTS_TOPIC = "assay.tenants"
"""The deletion's own topic (the command and the stages' answers), which stays."""


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


def bus_rows_of(data_dir: Path, tenant: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every record of the embedded bus that names `tenant` anywhere — in its key, its
    body or its headers, not by the bus's own note of its tenant — by `bus.sqlite/topic`:
    (partition, offset, key, value, headers), in offset order."""
    path = data_dir / BUS
    if not path.exists():
        return {}
    needle = tenant.encode()
    out: dict[str, list[tuple[Any, ...]]] = {}
    with closing(sqlite3.connect(path)) as db:
        rows = db.execute(
            "SELECT topic, partition, offset, key, value, headers FROM records"
            " ORDER BY topic, partition, offset"
        ).fetchall()
    for topic, *row in rows:
        key, value, headers = row[2], row[3], row[4]
        if needle in key.encode() or needle in value or needle in headers:
            out.setdefault(f"{BUS}/{topic}", []).append(tuple(row))
    return out


def files_of(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by relative path (empty when there is no `root`)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def holdings(data_dir: Path, tenant: str) -> dict[str, Any]:
    """Everything of `tenant`: its rows, its bus records, its blobs and its workspaces."""
    return {
        "rows": rows_of(data_dir, tenant),
        "bus": bus_rows_of(data_dir, tenant),
        "blobs": files_of(data_dir / "blobs" / tenant),
        "workspaces": files_of(data_dir / "sandbox" / tenant),
    }


def leftovers(data_dir: Path, tenant: str, command: str) -> dict[str, list[tuple[Any, ...]]]:
    """The rows of a deleted `tenant` that are not its tombstone (the `tenant` stream's
    record, the `tenant_erased` document, the inbox entry of deletion `command`), and
    its records on the embedded bus but the deletion's own on `assay.tenants`."""
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
    for where, records in bus_rows_of(data_dir, tenant).items():
        if where != f"{BUS}/{TENANTS_TOPIC}":
            found[where] = records
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


async def pg_rows_of(admin_dsn: str, tenant: str) -> dict[str, list[dict[str, Any]]]:
    """`rows_of` for a distributed deployment: every row of `tenant` in every table of
    every stage's schema (the outbox by key), as column -> value."""
    import asyncpg

    conn = await asyncpg.connect(admin_dsn)
    try:
        tables = await conn.fetch(
            "SELECT table_schema, table_name, array_agg(column_name::text) AS columns"
            " FROM information_schema.columns WHERE table_schema = ANY($1::text[])"
            " GROUP BY 1, 2 ORDER BY 1, 2",
            list(STAGES),
        )
        out: dict[str, list[dict[str, Any]]] = {}
        for t in tables:
            name = f'"{t["table_schema"]}"."{t["table_name"]}"'
            if "tenant" in t["columns"]:
                rows = await conn.fetch(f"SELECT * FROM {name} WHERE tenant = $1::uuid", tenant)
            elif t["table_name"] == "outbox":
                query = (
                    f"SELECT topic, key, value, headers FROM {name} WHERE key = $1 OR key LIKE $2"
                )
                rows = await conn.fetch(query, tenant, f"{tenant}:%")
            else:
                continue
            out[f"{t['table_schema']}/{t['table_name']}"] = sorted(
                (dict(r) for r in rows), key=repr
            )
        return out
    finally:
        await conn.close()


async def pg_leftovers(admin_dsn: str, tenant: str, command: str) -> dict[str, list[Any]]:
    """`leftovers` for a distributed deployment."""
    found: dict[str, list[Any]] = {}
    for where, rows in (await pg_rows_of(admin_dsn, tenant)).items():
        left = [r for r in rows if not _tombstone(where, r, command)]
        if left:
            found[where] = left
    return found


async def bucket_objects(env: dict[str, str], prefix: str) -> dict[str, bytes]:
    """Every object under `prefix` in the deployment's bucket, by key."""
    import aioboto3

    session = aioboto3.Session(
        aws_access_key_id=env["ASSAY_S3_ACCESS_KEY_ID"],
        aws_secret_access_key=env["ASSAY_S3_SECRET_ACCESS_KEY"],
        region_name=env["ASSAY_S3_REGION"],
    )
    out: dict[str, bytes] = {}
    async with session.client("s3", endpoint_url=env["ASSAY_S3_ENDPOINT"]) as s3:
        paginator = s3.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=env["ASSAY_S3_BUCKET"], Prefix=prefix):
            for obj in page.get("Contents", []):
                got = await s3.get_object(Bucket=env["ASSAY_S3_BUCKET"], Key=obj["Key"])
                async with got["Body"] as body:
                    out[obj["Key"]] = await body.read()
    return out
