"""A Postgres commit that deletes branches: the general path, one explicit transaction.

The tuned commit (`pg_commit`, `pg_batch_sql`) appends and never deletes. A batch
with `deletions` (tiering, §8.6), `truncations` or `forget` (retention's compaction)
is rare, so it takes this slower path instead: one transaction that first locks
`state` then `log` against writers (the order every commit takes their row locks in,
so a commit in flight finishes first and none deadlocks with this one; reads go on),
checks the fence and the inbox, checks that each branch to delete (or truncate)
still ends where the caller read it and deletes it, forgets documents, then folds
and writes the batch's records as the other paths do: document rows before log rows,
a deleted document kept as a tombstone, the same canonical bytes.
"""

from __future__ import annotations

import time
from typing import Any

from assay.kernel.ids import Lsn, TenantId
from assay.record.events import LogRecord
from assay.record.state import Fold, Patch, StateKey
from assay.store.pg_fold import apply_to
from assay.store.pg_schema import Connection
from assay.store.ports import (
    BranchDeletion,
    BranchTruncation,
    CommitBatch,
    DuplicateMessage,
    StaleFence,
    StreamChanged,
)
from assay.store.sqlite import encode_headers


async def commit_deleting(
    conn: Connection, s: str, channel: str, fold: Fold, batch: CommitBatch
) -> list[Lsn]:
    """Write `batch`, deletions included, in one transaction on `conn`; its LSNs.

    Args:
        s: the quoted schema.
        channel: the outbox notification channel, notified when rows were added.

    Raises:
        StaleFence, DuplicateMessage, StreamChanged: as `EventLog.commit`; nothing
            was written.
        asyncpg.PostgresError: the server refused (a deadlock with a `rebuild` is
            `40P01`; the caller may try again).
    """
    async with conn.transaction():
        await conn.execute(f"LOCK TABLE {s}.state, {s}.log IN SHARE ROW EXCLUSIVE MODE")
        if (lease := batch.fence) is not None:
            held = await conn.fetchval(
                f"SELECT fence FROM {s}.leases WHERE tenant = $1 AND stream = $2 FOR SHARE",
                lease.tenant,
                lease.stream,
            )
            if held != lease.fence:
                raise StaleFence(
                    f"stream {lease.stream}: fence {lease.fence} is stale; the run was taken over"
                )
        if batch.erase is not None:
            await erase_tenant(conn, s, batch.erase)
        if batch.inbox is not None:
            landed = await conn.fetchval(
                f"INSERT INTO {s}.inbox VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING 1",
                *batch.inbox,
            )
            if landed is None:
                raise DuplicateMessage(f"message {batch.inbox[1]} was already handled")
        for deletion in batch.deletions:
            await _delete_branch(conn, s, deletion)
        for tenant, stream in {(d.key.tenant, d.key.stream) for d in batch.deletions}:
            await conn.execute(  # a stream left with no record has no fence left to guard
                f"DELETE FROM {s}.leases WHERE tenant = $1 AND stream = $2 AND NOT EXISTS"
                f" (SELECT 1 FROM {s}.log WHERE tenant = $1 AND stream = $2)",
                tenant,
                stream,
            )
        for cut in batch.truncations:
            await _truncate_branch(conn, s, cut)
        for at in batch.forget:  # outright, not as a tombstone: the log is locked
            await conn.execute(
                f"DELETE FROM {s}.state WHERE tenant = $1 AND kind = $2 AND key = $3",
                at.tenant,
                at.kind,
                at.key,
            )
        lsns, logs, docs = await _fold(conn, s, fold, batch)
        for at in sorted(docs):  # documents first, then the log rows (`pg_schema`)
            await conn.execute(
                f"INSERT INTO {s}.state VALUES ($1, $2, $3, $4)"
                " ON CONFLICT (tenant, kind, key) DO UPDATE SET value = excluded.value",
                at.tenant,
                at.kind,
                at.key,
                docs[at],
            )
        if logs:
            await conn.executemany(
                f"INSERT INTO {s}.log"
                " (tenant, stream, branch, lsn, type, schema_version, at_ms, payload)"
                " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                logs,
            )
        if (p := batch.position) is not None:
            await conn.execute(
                f"INSERT INTO {s}.positions VALUES ($1, $2, $3) ON CONFLICT (topic, partition)"
                " DO UPDATE SET next_offset = excluded.next_offset",
                p.topic,
                p.partition,
                p.next_offset,
            )
        if batch.outbox:
            await conn.executemany(
                f"INSERT INTO {s}.outbox (topic, key, value, headers) VALUES ($1, $2, $3, $4)",
                [(e.topic, e.key, e.value, encode_headers(e.headers)) for e in batch.outbox],
            )
            await conn.execute("SELECT pg_notify($1, '')", channel)
    return lsns


TENANT_TABLES = ("log", "state", "checkpoints", "leases", "inbox", "spend")
"""The tables of a stage's schema with a tenant column (its document tables follow `state`
by trigger); the outbox is keyed by the tenant instead."""


async def erase_tenant(conn: Connection, s: str, tenant: TenantId) -> None:
    """Delete every row of `tenant` in schema `s` (`CommitBatch.erase`); the caller holds
    `state` and `log` against writers."""
    for table in TENANT_TABLES:
        await conn.execute(f"DELETE FROM {s}.{table} WHERE tenant = $1", tenant)
    t = str(tenant)
    await conn.execute(
        f"DELETE FROM {s}.outbox WHERE key = $1 OR left(key, $2) = $3", t, len(t) + 1, f"{t}:"
    )


async def _delete_branch(conn: Connection, s: str, deletion: BranchDeletion) -> None:
    key = deletion.key
    where = "WHERE tenant = $1 AND stream = $2 AND branch = $3"
    row = await conn.fetchrow(
        f"SELECT count(*), max(lsn) FROM {s}.log {where}", key.tenant, key.stream, key.branch
    )
    assert row is not None  # an aggregate always has its one row
    count, top = row
    if count != deletion.end or (count and top != deletion.end - 1):
        raise StreamChanged(
            f"stream {key.stream} branch {key.branch}: holds {count} records, not the "
            f"{deletion.end} the deletion was computed on"
        )
    await conn.execute(f"DELETE FROM {s}.log {where}", key.tenant, key.stream, key.branch)
    await conn.execute(f"DELETE FROM {s}.checkpoints {where}", key.tenant, key.stream, key.branch)


async def _truncate_branch(conn: Connection, s: str, cut: BranchTruncation) -> None:
    key = cut.key
    where = "WHERE tenant = $1 AND stream = $2 AND branch = $3"
    top = await conn.fetchval(
        f"SELECT max(lsn) FROM {s}.log {where}", key.tenant, key.stream, key.branch
    )
    if top is None or top != cut.end - 1:
        raise StreamChanged(
            f"stream {key.stream} branch {key.branch}: ends at "
            f"{0 if top is None else top + 1}, not at {cut.end} where it was read"
        )
    await conn.execute(
        f"DELETE FROM {s}.log {where} AND lsn < $4", key.tenant, key.stream, key.branch, cut.below
    )
    await conn.execute(f"DELETE FROM {s}.checkpoints {where}", key.tenant, key.stream, key.branch)


async def _fold(
    conn: Connection, s: str, fold: Fold, batch: CommitBatch
) -> tuple[list[Lsn], list[tuple[Any, ...]], dict[StateKey, bytes | None]]:
    """LSNs from the log itself (it is locked), the log rows, and every document the
    records' fold wrote, merged onto what the store holds."""
    next_lsn: dict[tuple[Any, str, int], int] = {}
    docs: dict[StateKey, bytes | None] = {}
    logs: list[tuple[Any, ...]] = []
    lsns: list[Lsn] = []
    now = int(time.time() * 1000)
    placed = [(cut.key, Lsn(0), cut.head) for cut in batch.truncations if cut.head is not None]
    for cut in batch.truncations:
        branch = (cut.key.tenant, cut.key.stream, cut.key.branch)
        next_lsn[branch] = cut.end if cut.below < cut.end else int(cut.head is not None)
    for key, at_lsn, event in [*placed, *((k, None, e) for k, e in batch.records)]:
        branch = (key.tenant, key.stream, key.branch)
        lsn = at_lsn if at_lsn is not None else next_lsn.get(branch)
        if lsn is None:
            top = await conn.fetchval(
                f"SELECT max(lsn) FROM {s}.log WHERE tenant = $1 AND stream = $2 AND branch = $3",
                *branch,
            )
            lsn = 0 if top is None else top + 1
        if at_lsn is None:
            next_lsn[branch] = lsn + 1
        payload = event.model_dump_json().encode()
        logs.append((*branch, lsn, event.type, event.version, now, payload))
        for delta in fold(LogRecord(key, Lsn(lsn), event.version, now, event)):
            if isinstance(delta, Patch) and delta.at not in docs:
                docs[delta.at] = await conn.fetchval(
                    f"SELECT value FROM {s}.state WHERE tenant = $1 AND kind = $2 AND key = $3",
                    delta.at.tenant,
                    delta.at.kind,
                    delta.at.key,
                )
            apply_to(docs, delta)
        if at_lsn is None:
            lsns.append(Lsn(lsn))
    return lsns, logs, docs
