"""Postgres adapter of `EventLog`: one schema per stage, one round trip per commit.

Tables mirror the SQLite adapter's (`pg_schema`), and so do the semantics: the
same LSNs, the same canonical document bytes, the same inbox, positions, outbox
and checkpoints, the same byte-for-byte `rebuild`. The fold runs in the client
(`pg_fold`); a commit alone is one statement, concurrent commits share one
transaction with each batch isolated (`pg_commit`, `pg_batch_sql`); a rare commit
that deletes branches (tiering) is one explicit transaction (`pg_deleting`). A commit that
adds outbox rows notifies `<schema>_outbox`, so a listening relay wakes at once
(§9.3; `pg_relay`). A deleted document is kept as a tombstone row (value NULL),
which reads as absent.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import asyncpg

from assay.kernel.ids import BranchId, Lsn, MessageId, TenantId, tenant_id
from assay.record.events import BranchKey, EventRegistry, LogRecord
from assay.record.state import DocumentTable, Fold, StateKey
from assay.store.pg_commit import GroupCommitter
from assay.store.pg_fold import apply_to
from assay.store.pg_relay import OutboxListener, PgAdvisoryLeader, listen_for_outbox
from assay.store.pg_schema import (
    MIGRATIONS,
    Connection,
    create_document_tables,
    migrate,
    quoted,
)
from assay.store.pg_spend import PgSpendLedger
from assay.store.ports import (
    Checkpoint,
    CommitBatch,
    Lease,
    LeaseLost,
    OutboxEntry,
    PendingOutbox,
    RebuildReport,
    StaleBranch,
)
from assay.store.sqlite import COMPACTED, decode_headers_of

TOMBSTONES_PER_DELETE = 5_000
"""Tombstones one statement of `reclaim_space` deletes at most."""

_StateRow = tuple[str, str, str, bytes]
"""A derived document as `rebuild` compares it: (tenant, kind, key, bytes)."""


async def _keep_session(conn: Connection) -> None:
    """Pool connections carry no session state of ours: nothing to reset on release."""


class PostgresEventLog(PgSpendLedger):
    """`EventLog` on one Postgres schema (one per stage in distributed mode).

    Several replicas of a stage may share the schema: the log's primary key and
    the commit's checks turn a stale guess into a retry, never into a lost or
    doubled write, and a replica takes its place in the log only once it holds the
    documents it writes, so `rebuild` (which re-folds in log order) still matches.
    """

    def __init__(
        self,
        dsn: str,
        schema: str,
        registry: EventRegistry,
        fold: Fold,
        *,
        pool_size: int = 4,
        tables: tuple[DocumentTable, ...] = (),
    ) -> None:
        """Describe the log; nothing connects until `open()`.

        Raises:
            ValueError: `schema` is not a plain lower-case identifier.
        """
        self._dsn = dsn
        self._schema = schema
        self._s = quoted(schema)
        self._registry = registry
        self._fold = fold
        self._pool_size = pool_size
        self._tables = tables
        self._pool: asyncpg.Pool | None = None
        self._writer: GroupCommitter | None = None

    @property
    def schema(self) -> str:
        """The schema this log lives in."""
        return self._schema

    @property
    def writer(self) -> GroupCommitter:
        """The group committer (its connection is where commits go)."""
        if self._writer is None:
            raise RuntimeError(f"event log {self._schema} is not open")
        return self._writer

    async def open(self, *, migrate_schema: bool = True) -> PostgresEventLog:
        """Connect and bring the schema to the current migration version.

        Args:
            migrate_schema: False for a reader that must change nothing (`assay runs
                show`): the schema is used as it is, and reading one that is not
                there raises `asyncpg.UndefinedTableError`.

        Raises:
            asyncpg.PostgresError: the server refused (no such role, no privilege on
                the schema, a migration failed).
            OSError: the server cannot be reached.
        """
        pool = await asyncpg.create_pool(
            self._dsn,
            min_size=1,
            max_size=self._pool_size + 1,  # one is held by the writer
            reset=_keep_session,
            server_settings={"application_name": f"assay:{self._schema}"},
        )
        try:
            if migrate_schema:
                async with pool.acquire() as conn:
                    await migrate(conn, self._schema, MIGRATIONS)
                    await create_document_tables(conn, self._schema, self._tables)
        except BaseException:
            await pool.close()
            raise
        self._pool = pool
        self._writer = GroupCommitter(pool, self._schema, self._fold)
        return self

    async def close(self) -> None:
        """Finish queued commits and close the pool."""
        if self._writer is not None:
            await self._writer.close()
            self._writer = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def _db(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError(f"event log {self._schema} is not open")
        return self._pool

    # -- commit -----------------------------------------------------------------

    async def commit(self, batch: CommitBatch) -> list[Lsn]:
        """See `EventLog.commit`."""
        return await self.writer.commit(batch)

    async def ping(self) -> None:
        """Ask the server for nothing; raises if it cannot be reached (readiness)."""
        await self._db.fetchval("SELECT 1")

    # -- reads ------------------------------------------------------------------

    async def read(
        self, key: BranchKey, from_lsn: Lsn = Lsn(0), limit: int = 10_000
    ) -> list[LogRecord]:
        """See `EventLog.read`."""
        rows = await self._db.fetch(
            f"SELECT lsn, type, schema_version, at_ms, payload FROM {self._s}.log"
            " WHERE tenant = $1 AND stream = $2 AND branch = $3 AND lsn >= $4"
            " ORDER BY lsn LIMIT $5",
            key.tenant,
            key.stream,
            key.branch,
            from_lsn,
            limit,
        )
        return [
            LogRecord(key, Lsn(lsn), ver, at, self._registry.decode(typ, ver, json.loads(p)))
            for lsn, typ, ver, at, p in rows
        ]

    async def branches(self, stream: str, tenant: TenantId | None = None) -> list[BranchKey]:
        """See `EventLog.branches`."""
        select = f"SELECT DISTINCT tenant, branch FROM {self._s}.log WHERE stream = $1"
        if tenant is None:  # a scan: whose the stream is is what the caller asks
            rows = await self._db.fetch(f"{select} ORDER BY tenant, branch", stream)
        else:  # a range of the primary key
            rows = await self._db.fetch(
                f"{select} AND tenant = $2 ORDER BY tenant, branch", stream, tenant
            )
        return [BranchKey(tenant_id(t), stream, BranchId(b)) for t, b in rows]

    async def stale_branches(self, pattern: str, before_ms: int, limit: int) -> list[StaleBranch]:
        """See `EventLog.stale_branches`."""
        like = "".join("\\" + c if c in "%_\\" else c for c in pattern).replace("*", "%")
        rows = await self._db.fetch(
            f"SELECT tenant, stream, branch, min(lsn), max(lsn) FROM {self._s}.log"
            " WHERE stream LIKE $1 GROUP BY tenant, stream, branch"
            " HAVING min(at_ms) FILTER (WHERE type <> $3) < $2"
            " ORDER BY min(at_ms) LIMIT $4",
            like,
            before_ms,
            COMPACTED,
            limit,
        )
        return [
            StaleBranch(BranchKey(tenant_id(t), st, BranchId(b)), Lsn(lo), Lsn(hi + 1))
            for t, st, b, lo, hi in rows
        ]

    async def prune_inbox(self, before_ms: int) -> int:
        """See `EventLog.prune_inbox`."""
        status = await self._db.execute(f"DELETE FROM {self._s}.inbox WHERE at_ms < $1", before_ms)
        return int(status.split()[-1])

    async def reclaim_space(self) -> int:
        """See `EventLog.reclaim_space`: the tombstones of deleted documents go, at most
        `TOMBSTONES_PER_DELETE` per statement so no commit waits long; how many went.

        A tombstone only makes a concurrent deleter of an absent document wait for its
        inserter (`pg_schema`'s commit protocol): once committed it orders nothing, and
        reads, `rebuild` and the document tables already treat it as absent. Rows a
        commit holds are skipped (left for the next sweep), so no commit waits for
        this and no lock cycle can form; a writer upserting a row this holds waits for
        the delete, then inserts."""
        total = 0
        while True:
            status = await self._db.execute(
                f"DELETE FROM {self._s}.state WHERE ctid = ANY(ARRAY(SELECT ctid FROM"
                f" {self._s}.state WHERE value IS NULL LIMIT {TOMBSTONES_PER_DELETE}"
                " FOR UPDATE SKIP LOCKED))"
            )
            n = int(status.split()[-1])
            total += n
            if n < TOMBSTONES_PER_DELETE:
                return total

    async def put_checkpoint(self, key: BranchKey, upto: Lsn, state: bytes) -> None:
        """See `EventLog.put_checkpoint`."""
        await self._db.execute(
            f"INSERT INTO {self._s}.checkpoints VALUES ($1, $2, $3, $4, $5)"
            " ON CONFLICT (tenant, stream, branch, upto) DO UPDATE SET state = excluded.state",
            key.tenant,
            key.stream,
            key.branch,
            upto,
            state,
        )

    async def latest_checkpoint(self, key: BranchKey, upto: Lsn | None = None) -> Checkpoint | None:
        """See `EventLog.latest_checkpoint`."""
        row = await self._db.fetchrow(
            f"SELECT upto, state FROM {self._s}.checkpoints"
            " WHERE tenant = $1 AND stream = $2 AND branch = $3 AND upto <= $4"
            " ORDER BY upto DESC LIMIT 1",
            key.tenant,
            key.stream,
            key.branch,
            (1 << 62) if upto is None else upto,
        )
        return None if row is None else Checkpoint(key, Lsn(row[0]), row[1])

    async def delete_checkpoints(self, key: BranchKey) -> None:
        """See `EventLog.delete_checkpoints`."""
        await self._db.execute(
            f"DELETE FROM {self._s}.checkpoints WHERE tenant = $1 AND stream = $2 AND branch = $3",
            key.tenant,
            key.stream,
            key.branch,
        )

    async def get(self, at: StateKey) -> dict[str, Any] | None:
        """See `EventLog.get`."""
        value = await self._db.fetchval(
            f"SELECT value FROM {self._s}.state WHERE tenant = $1 AND kind = $2 AND key = $3",
            at.tenant,
            at.kind,
            at.key,
        )
        return None if value is None else dict(json.loads(value))

    async def scan(
        self, tenant: TenantId, kind: str, prefix: str = ""
    ) -> list[tuple[str, dict[str, Any]]]:
        """See `EventLog.scan`. Keys sort by code point, as in SQLite.

        The keys are read as a range of the primary key: `starts_with` alone is no
        index condition, so every document of the kind was read and filtered.
        """
        select = f"SELECT key, value FROM {self._s}.state WHERE tenant = $1 AND kind = $2"
        after = _after_prefix(prefix)
        if after is None:  # no prefix (or no string above it): every key of the kind
            rows = await self._db.fetch(
                f"{select} AND starts_with(key, $3) AND value IS NOT NULL ORDER BY key",
                tenant,
                kind,
                prefix,
            )
        else:
            rows = await self._db.fetch(
                f"{select} AND key >= $3 AND key < $4 AND starts_with(key, $3)"
                " AND value IS NOT NULL ORDER BY key",
                tenant,
                kind,
                prefix,
                after,
            )
        return [(k, dict(json.loads(v))) for k, v in rows]

    async def scan_kind(self, kind: str) -> list[tuple[TenantId, str, dict[str, Any]]]:
        """See `EventLog.scan_kind`."""
        rows = await self._db.fetch(
            f"SELECT tenant, key, value FROM {self._s}.state"
            " WHERE kind = $1 AND value IS NOT NULL ORDER BY tenant, key",
            kind,
        )
        return [(tenant_id(t), k, dict(json.loads(v))) for t, k, v in rows]

    async def positions(self) -> dict[tuple[str, int], int]:
        """See `EventLog.positions`."""
        rows = await self._db.fetch(
            f"SELECT topic, partition, next_offset FROM {self._s}.positions"
        )
        return {(t, p): o for t, p, o in rows}

    # -- leases (the database's clock) ---------------------------------------------

    async def claim(self, tenant: TenantId, stream: str, holder: str, ttl_ms: int) -> Lease | None:
        """See `EventLog.claim`."""
        s = self._s
        row = await self._db.fetchrow(
            f"INSERT INTO {s}.leases VALUES ($1, $2, $3, 1,"
            " clock_timestamp() + $4 * interval '1 millisecond')"
            " ON CONFLICT (tenant, stream) DO UPDATE SET holder = excluded.holder,"
            f" fence = {s}.leases.fence + 1, expires_at = excluded.expires_at"
            f" WHERE {s}.leases.holder IS NULL OR {s}.leases.holder = excluded.holder"
            f" OR {s}.leases.expires_at <= clock_timestamp()"
            " RETURNING fence, (extract(epoch FROM expires_at) * 1000)::bigint",
            tenant,
            stream,
            holder,
            ttl_ms,
        )
        return None if row is None else Lease(tenant, stream, holder, row[0], row[1])

    async def renew(self, lease: Lease, ttl_ms: int) -> Lease:
        """See `EventLog.renew`."""
        expires = await self._db.fetchval(
            f"UPDATE {self._s}.leases"
            " SET expires_at = clock_timestamp() + $1 * interval '1 millisecond'"
            " WHERE tenant = $2 AND stream = $3 AND fence = $4 AND holder = $5"
            " RETURNING (extract(epoch FROM expires_at) * 1000)::bigint",
            ttl_ms,
            lease.tenant,
            lease.stream,
            lease.fence,
            lease.holder,
        )
        if expires is None:
            raise LeaseLost(f"stream {lease.stream}: lease {lease.fence} was taken over")
        return replace(lease, expires_at_ms=expires)

    async def release(self, lease: Lease) -> None:
        """See `EventLog.release`."""
        await self._db.execute(
            f"UPDATE {self._s}.leases SET holder = NULL, expires_at = clock_timestamp()"
            " WHERE tenant = $1 AND stream = $2 AND fence = $3",
            lease.tenant,
            lease.stream,
            lease.fence,
        )

    async def seen(self, tenant: TenantId, message_id: MessageId) -> bool:
        """See `EventLog.seen`."""
        found = await self._db.fetchval(
            f"SELECT 1 FROM {self._s}.inbox WHERE tenant = $1 AND message_id = $2",
            tenant,
            message_id,
        )
        return found is not None

    async def drain_outbox(self, limit: int) -> list[PendingOutbox]:
        """See `EventLog.drain_outbox`."""
        rows = await self._db.fetch(
            f"SELECT seq, topic, key, value, headers FROM {self._s}.outbox ORDER BY seq LIMIT $1",
            limit,
        )
        headers = decode_headers_of([row[4] for row in rows])
        return [
            PendingOutbox(seq, OutboxEntry(topic, key, value, h))
            for (seq, topic, key, value, _), h in zip(rows, headers, strict=True)
        ]

    async def ack_outbox(self, seqs: list[int]) -> None:
        """See `EventLog.ack_outbox`."""
        if seqs:
            await self._db.execute(
                f"DELETE FROM {self._s}.outbox WHERE seq = ANY($1::bigint[])", seqs
            )

    # -- rebuild ----------------------------------------------------------------

    async def rebuild(self, *, keep: bool) -> RebuildReport:
        """See `EventLog.rebuild`.

        With `keep`, commits wait while it runs (the log and the state are locked
        against writers); reads go on. Without it, nothing is locked or written: the
        log and the state are read in one read-only snapshot (`REPEATABLE READ READ
        ONLY`, which the server enforces), so a check of a live stage neither stalls its
        commits nor can change anything, and sees them all or none of each.
        """
        async with self._db.acquire() as conn:
            if not keep:
                async with conn.transaction(isolation="repeatable_read", readonly=True):
                    before, after, n = await self._refold(conn)
                return RebuildReport(n, len(before), len(after), _differences(before, after))
            async with conn.transaction():
                await conn.execute(
                    f"LOCK TABLE {self._s}.log, {self._s}.state IN SHARE ROW EXCLUSIVE MODE"
                )
                before, after, n = await self._refold(conn)
                await conn.execute(f"DELETE FROM {self._s}.state")
                await conn.copy_records_to_table(
                    "state",
                    schema_name=self._schema,
                    records=[(tenant_id(t), kind, k, v) for t, kind, k, v in after],
                )
                self.writer.forget_documents()
        return RebuildReport(n, len(before), len(after), _differences(before, after))

    async def _refold(self, conn: Connection) -> tuple[list[_StateRow], list[_StateRow], int]:
        """The stored documents, the documents re-folded from the whole log (both
        sorted), and the number of records folded; reads only."""
        before = await _state_rows(conn, self._s)
        docs: dict[StateKey, bytes | None] = {}
        n = 0
        async for tenant, stream, branch, lsn, typ, ver, at, payload in conn.cursor(
            "SELECT tenant, stream, branch, lsn, type, schema_version, at_ms, payload"
            f" FROM {self._s}.log ORDER BY seq",
            prefetch=1000,
        ):
            event = self._registry.decode(typ, ver, json.loads(payload))
            key = BranchKey(tenant_id(tenant), stream, branch)
            for delta in self._fold(LogRecord(key, Lsn(lsn), ver, at, event)):
                apply_to(docs, delta)
            n += 1
        after = sorted((str(k.tenant), k.kind, k.key, v) for k, v in docs.items() if v is not None)
        return before, after, n


def _after_prefix(prefix: str) -> str | None:
    """The least string above every string that starts with `prefix` (in code point
    order, which is the "C" collation's UTF-8 byte order), or None if there is none."""
    for i in range(len(prefix) - 1, -1, -1):
        if ord(prefix[i]) < 0x10FFFF:
            bumped = chr(ord(prefix[i]) + 1)
            if 0xD800 <= ord(bumped) <= 0xDFFF:  # surrogates are no text: skip past them
                bumped = chr(0xE000)
            return prefix[:i] + bumped
    return None


async def _state_rows(conn: Connection, s: str) -> list[_StateRow]:
    rows = await conn.fetch(
        f"SELECT tenant, kind, key, value FROM {s}.state WHERE value IS NOT NULL"
    )
    return sorted((str(t), kind, key, value) for t, kind, key, value in rows)


def _differences(before: list[_StateRow], after: list[_StateRow]) -> list[str]:
    old = {r[:3]: r[3] for r in before}
    new = {r[:3]: r[3] for r in after}
    out = []
    for k in sorted(old.keys() | new.keys()):
        if old.get(k) != new.get(k):
            what = (
                "missing after rebuild"
                if k not in new
                else ("missing from the stored state" if k not in old else "differs")
            )
            out.append(f"{'/'.join(k)}: {what}")
    return out


__all__ = ["OutboxListener", "PgAdvisoryLeader", "PostgresEventLog", "listen_for_outbox"]
