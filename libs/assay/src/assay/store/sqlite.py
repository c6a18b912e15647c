"""SQLite adapter of `EventLog`: WAL, `synchronous=FULL`, group commit.

One connection lives on one dedicated thread. Concurrent `commit` calls that
arrive while a transaction is being made durable are coalesced into the next
transaction — one fsync for many batches, each batch isolated in a savepoint
so one failing batch never takes another down (batching across runs).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from assay.kernel.canonical import document_bytes
from assay.kernel.ids import BranchId, Lsn, MessageId, TenantId, tenant_id
from assay.record.events import BranchKey, Event, EventRegistry, LogRecord
from assay.record.state import Delete, DocumentTable, Fold, Patch, Put, StateDelta, StateKey
from assay.store.ports import (
    BranchTruncation,
    Checkpoint,
    CommitBatch,
    DuplicateMessage,
    Lease,
    LeaseLost,
    OutboxEntry,
    PendingOutbox,
    RebuildReport,
    StaleBranch,
    StaleFence,
    StreamChanged,
)
from assay.store.sqlite_spend import SPEND_SCHEMA, SqliteSpendLedger

_SCHEMA = """
CREATE TABLE IF NOT EXISTS log (
    seq INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL, stream TEXT NOT NULL, branch INTEGER NOT NULL, lsn INTEGER NOT NULL,
    type TEXT NOT NULL, schema_version INTEGER NOT NULL, at_ms INTEGER NOT NULL,
    payload BLOB NOT NULL,
    UNIQUE (tenant, stream, branch, lsn)
);
CREATE TABLE IF NOT EXISTS state (
    tenant TEXT NOT NULL, kind TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY (tenant, kind, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS positions (
    topic TEXT NOT NULL, partition INTEGER NOT NULL, next_offset INTEGER NOT NULL,
    PRIMARY KEY (topic, partition)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS inbox (
    tenant TEXT NOT NULL, message_id TEXT NOT NULL, at_ms INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, message_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    topic TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL, headers BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
    tenant TEXT NOT NULL, stream TEXT NOT NULL, holder TEXT, fence INTEGER NOT NULL,
    expires_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, stream)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS checkpoints (
    tenant TEXT NOT NULL, stream TEXT NOT NULL, branch INTEGER NOT NULL, upto INTEGER NOT NULL,
    state BLOB NOT NULL,
    PRIMARY KEY (tenant, stream, branch, upto)
) WITHOUT ROWID;
"""


_NOW_MS = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"
"""The database clock in milliseconds since the epoch: lease time is never the caller's."""

_Row = tuple[str, str, int]
"""A branch key as stored: (tenant, stream, branch)."""


def _others_ready(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether other callbacks are ready to run in this loop iteration (they might
    commit too and share the fsync). Unknown loops are assumed busy."""
    ready = getattr(loop, "_ready", None)
    return ready is None or len(ready) > 0


@functools.lru_cache(maxsize=4096)
def _t(tenant: TenantId) -> str:
    """The stored form of a tenant id (cached: `str(UUID)` is hot on the commit path)."""
    return str(tenant)


WAL_CHECKPOINT_PAGES = 10_000
"""Checkpoint the WAL every this many pages (SQLite's default is 1,000). A commit
dirties the same few pages again and again (the log's tail, hot documents); a
checkpoint copies each distinct page once, so checkpointing ten times less often
copies far fewer pages per commit. The WAL file is truncated back to
`WAL_SIZE_LIMIT` after each checkpoint."""
WAL_SIZE_LIMIT = 64 * 1024 * 1024


BUSY_TIMEOUT_S = 10.0
"""How long a statement waits for another connection's lock before it fails."""


def connect(path: Path) -> sqlite3.Connection:
    """A connection with Assay's durability pragmas: WAL and `synchronous=FULL`."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
    _into_wal(conn)
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
    conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
    return conn


def _into_wal(conn: sqlite3.Connection) -> None:
    """Put the file in WAL mode. Turning a new file to WAL takes an exclusive lock, and
    SQLite answers "database is locked" at once, without calling the busy handler, while
    another connection holds any lock on it: processes opening a new file together (a
    stage and a command) raced. So the switch is asked again, for up to
    `BUSY_TIMEOUT_S`, until the file is in WAL mode (whoever switched it)."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    pause = 0.001
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(pause)  # no busy handler to wait in: the lock is held for a moment
        pause = min(pause * 2, 0.05)


def truncate_wal(conn: sqlite3.Connection) -> bool:
    """Checkpoint the WAL of `conn`'s file into the database and truncate it to zero
    bytes, unless another connection is reading it (then nothing waits: it is tried
    again next time); whether it was truncated. Between two of these the WAL holds what
    was written since, so retention's sweep bounds it as well as the tables: pages
    freed by deletes stay in the file and are reused, the WAL would otherwise keep its
    high-water mark (up to `WAL_SIZE_LIMIT`).

    Call it outside a transaction, on the thread that writes through `conn`."""
    (timeout,) = conn.execute("PRAGMA busy_timeout").fetchone()
    conn.execute("PRAGMA busy_timeout=0")  # a reader makes it busy: never block the loop
    try:
        (busy, _, _) = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        conn.execute(f"PRAGMA busy_timeout={int(timeout)}")
    return not busy


class SqliteEventLog(SqliteSpendLedger):
    """`EventLog` on one SQLite file (one per stage in embedded mode).

    All work runs on the event loop's thread: a commit is a few SQLite calls and
    one fsync, cheaper than a hop to a worker thread and back. Commits issued in
    the same loop iteration are written as one transaction (group commit), each
    batch in its own savepoint so a failing batch never takes another down.
    """

    def __init__(
        self,
        path: str | Path,
        registry: EventRegistry,
        fold: Fold,
        *,
        tables: tuple[DocumentTable, ...] = (),
    ) -> None:
        self._path = Path(path)
        self._tables = tables
        self._registry = registry
        self._fold = fold
        self._conn: sqlite3.Connection | None = None
        self._cursor: sqlite3.Cursor
        self._queue: list[tuple[CommitBatch, asyncio.Future[list[Lsn]] | None]] = []
        self._scheduled = False
        # Next LSN per branch, learnt from committed writes. This process is the
        # file's only writer (the data directory is locked); the UNIQUE index
        # on (tenant, stream, branch, lsn) would refuse a stale guess anyway.
        self._next_lsn: dict[_Row, int] = {}
        self.transactions = 0
        """Transactions `commit` has committed since the log was made (a group commit of
        several batches is one): what each durable step costs, counted."""
        self._acks_unsynced = False  # rows marked shipped since the WAL was last fsynced

    async def open(self) -> SqliteEventLog:
        """Create the file and tables if missing."""
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = connect(self._path)
        self._conn.executescript(_SCHEMA)
        self._conn.executescript(SPEND_SCHEMA)
        add_column(self._conn, "inbox", "at_ms INTEGER NOT NULL DEFAULT 0")  # files of before
        for table in self._tables:
            add_table_columns(self._conn, table)
            self._conn.executescript(document_table_ddl(table))
        self._cursor = self._conn.cursor()
        return self

    async def close(self) -> None:
        """Finish queued commits and close the connection."""
        if self._queue:  # commits scheduled for this loop iteration: write them now
            self._flush()
        if self._conn is not None:
            self._sync_acks()
            self._conn.close()
            self._conn = None

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"event log {self._path} is not open")
        return self._conn

    # -- commit -----------------------------------------------------------------

    async def commit(self, batch: CommitBatch) -> list[Lsn]:
        loop = asyncio.get_running_loop()
        if not self._queue and not _others_ready(loop):
            # Nothing else can commit before this write finishes: write it now
            # rather than paying a loop iteration to discover there is no group.
            return self._write_one(batch)
        fut: asyncio.Future[list[Lsn]] = loop.create_future()
        self._queue.append((batch, fut))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return await fut

    def _flush(self) -> None:
        self._scheduled = False
        if not self._queue:
            return
        group: list[tuple[CommitBatch, asyncio.Future[list[Lsn]] | None]] = [*self._queue]
        self._queue = []
        try:
            outcomes = self._write_group(group)
        except BaseException as exc:  # the COMMIT itself failed: every batch failed
            for _, fut in group:
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), outcome in zip(group, outcomes, strict=True):
            if fut is None or fut.done():
                continue
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

    def _write_one(self, batch: CommitBatch) -> list[Lsn]:
        db = self._cursor
        learnt: dict[_Row, int] = {}
        db.execute("BEGIN")
        try:
            lsns = self._write_batch(db, batch, learnt)
            db.execute("COMMIT")
            self.transactions += 1
        except BaseException:
            if self._db.in_transaction:
                db.execute("ROLLBACK")
            raise
        self._learn(learnt)
        return lsns

    def _learn(self, learnt: dict[_Row, int]) -> None:
        if len(self._next_lsn) > 100_000:  # bounded: a miss costs one indexed MAX query
            self._next_lsn.clear()
        self._next_lsn.update(learnt)

    def _write_group(
        self, group: list[tuple[CommitBatch, asyncio.Future[list[Lsn]] | None]]
    ) -> list[list[Lsn] | BaseException]:
        db = self._cursor  # one cursor for every write: Connection.execute makes a new one
        outcomes: list[list[Lsn] | BaseException] = []
        learnt: dict[_Row, int] = {}  # next LSNs of the batches that succeeded
        db.execute("BEGIN")  # this process is the only writer: no need to lock early
        try:
            single = len(group) == 1
            for batch, _ in group:
                if single:
                    outcomes.append(self._write_batch(db, batch, learnt))
                    continue
                db.execute("SAVEPOINT b")
                mine = dict(learnt)
                try:
                    outcomes.append(self._write_batch(db, batch, mine))
                    db.execute("RELEASE b")
                    learnt = mine
                except Exception as exc:
                    db.execute("ROLLBACK TO b")
                    db.execute("RELEASE b")
                    outcomes.append(exc)
            db.execute("COMMIT")
            self.transactions += 1
        except Exception as exc:
            if self._db.in_transaction:
                db.execute("ROLLBACK")
            if len(group) == 1 and isinstance(exc, DuplicateMessage):
                return [exc]
            raise
        self._learn(learnt)
        return outcomes

    def _write_batch(
        self, db: sqlite3.Cursor, batch: CommitBatch, next_lsn: dict[_Row, int]
    ) -> list[Lsn]:
        if batch.fence is not None:
            lease = batch.fence
            held = db.execute(
                "SELECT fence FROM leases WHERE tenant=? AND stream=?",
                (_t(lease.tenant), lease.stream),
            ).fetchone()
            if held is None or held[0] != lease.fence:
                raise StaleFence(
                    f"stream {lease.stream}: fence {lease.fence} is stale "
                    f"(now {held[0] if held else 'none'}); the run was taken over"
                )
        if batch.erase is not None:
            erase_tenant(db, batch.erase)
            gone = _t(batch.erase)
            for cache in (next_lsn, self._next_lsn):
                for stale in [r for r in cache if r[0] == gone]:
                    del cache[stale]
        if batch.inbox is not None:
            tenant, mid = batch.inbox
            try:
                db.execute(
                    "INSERT INTO inbox VALUES (?, ?, ?)", (_t(tenant), mid, int(time.time() * 1000))
                )
            except sqlite3.IntegrityError as exc:
                raise DuplicateMessage(f"message {mid} was already handled") from exc
        for deletion in batch.deletions:
            _delete_branch(db, deletion.key, deletion.end)
            next_lsn[(_t(deletion.key.tenant), deletion.key.stream, deletion.key.branch)] = 0
        for tenant_, stream in {(_t(d.key.tenant), d.key.stream) for d in batch.deletions}:
            db.execute(  # a stream left with no record has no fence left to guard
                "DELETE FROM leases WHERE tenant=? AND stream=? AND NOT EXISTS "
                "(SELECT 1 FROM log WHERE tenant=? AND stream=?)",
                (tenant_, stream, tenant_, stream),
            )
        for cut in batch.truncations:
            cut_row: _Row = (_t(cut.key.tenant), cut.key.stream, cut.key.branch)
            _truncate_branch(db, cut)
            if cut.head is not None:
                self._append(db, cut.key, Lsn(0), cut.head, int(time.time() * 1000))
            next_lsn[cut_row] = cut.end if cut.below < cut.end else int(cut.head is not None)
        for at in batch.forget:
            _apply(db, Delete(at))
        if batch.expect:
            batch.check_expect()
            for key, end in batch.expect:  # the file's own records, never the cached guess
                expected: _Row = (_t(key.tenant), key.stream, key.branch)
                (top,) = db.execute(
                    "SELECT MAX(lsn) FROM log WHERE tenant=? AND stream=? AND branch=?", expected
                ).fetchone()
                found = 0 if top is None else top + 1
                if found != end:
                    raise StreamChanged(
                        f"stream {key.stream} ends at {found}, not {end}: another writer moved it"
                    )
                next_lsn[expected] = end
        lsns: list[Lsn] = []
        now = int(time.time() * 1000)
        docs: dict[_Doc, dict[str, Any] | None] = {}  # the batch's documents, written once
        for key, event in batch.records:
            row: _Row = (_t(key.tenant), key.stream, key.branch)
            lsn = next_lsn.get(row)
            if lsn is None:
                lsn = self._next_lsn.get(row)
            if lsn is None:
                (top,) = db.execute(
                    "SELECT MAX(lsn) FROM log WHERE tenant=? AND stream=? AND branch=?", row
                ).fetchone()
                lsn = 0 if top is None else top + 1
            next_lsn[row] = lsn + 1
            db.execute(
                "INSERT INTO log (tenant, stream, branch, lsn, type, schema_version, at_ms,"
                " payload) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (*row, lsn, event.type, event.version, now, event.model_dump_json().encode()),
            )
            record = LogRecord(key, Lsn(lsn), event.version, now, event)
            for delta in self._fold(record):
                _merge(db, docs, delta)
            lsns.append(Lsn(lsn))
        _write_docs(db, docs)
        if batch.position is not None:
            p = batch.position
            db.execute(
                "INSERT INTO positions VALUES (?, ?, ?) ON CONFLICT (topic, partition) "
                "DO UPDATE SET next_offset = excluded.next_offset",
                (p.topic, p.partition, p.next_offset),
            )
        for e in batch.outbox:
            db.execute(
                "INSERT INTO outbox (topic, key, value, headers) VALUES (?, ?, ?, ?)",
                (e.topic, e.key, e.value, encode_headers(e.headers)),
            )
        return lsns

    def _append(self, db: sqlite3.Cursor, key: BranchKey, lsn: Lsn, event: Event, now: int) -> None:
        """Insert one record at `lsn` and apply its fold."""
        db.execute(
            "INSERT INTO log (tenant, stream, branch, lsn, type, schema_version, at_ms,"
            " payload) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                _t(key.tenant),
                key.stream,
                key.branch,
                lsn,
                event.type,
                event.version,
                now,
                event.model_dump_json().encode(),
            ),
        )
        for delta in self._fold(LogRecord(key, lsn, event.version, now, event)):
            _apply(db, delta)

    # -- leases -----------------------------------------------------------------

    async def claim(self, tenant: TenantId, stream: str, holder: str, ttl_ms: int) -> Lease | None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute(
                "INSERT INTO leases VALUES (?, ?, ?, 1, " + _NOW_MS + " + ?) "
                "ON CONFLICT (tenant, stream) DO UPDATE SET holder = excluded.holder, "
                "fence = leases.fence + 1, expires_ms = excluded.expires_ms "
                "WHERE leases.holder IS NULL OR leases.holder = excluded.holder "
                "OR leases.expires_ms <= " + _NOW_MS + " RETURNING fence, expires_ms",
                (_t(tenant), stream, holder, ttl_ms),
            ).fetchone()
        return None if row is None else Lease(tenant, stream, holder, row[0], row[1])

    async def renew(self, lease: Lease, ttl_ms: int) -> Lease:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute(
                "UPDATE leases SET expires_ms = " + _NOW_MS + " + ? "
                "WHERE tenant=? AND stream=? AND fence=? AND holder=? RETURNING expires_ms",
                (ttl_ms, _t(lease.tenant), lease.stream, lease.fence, lease.holder),
            ).fetchone()
        if row is None:
            raise LeaseLost(f"stream {lease.stream}: lease {lease.fence} was taken over")
        return replace(lease, expires_at_ms=row[0])

    async def release(self, lease: Lease) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "UPDATE leases SET holder = NULL, expires_ms = " + _NOW_MS + " "
                "WHERE tenant=? AND stream=? AND fence=?",
                (_t(lease.tenant), lease.stream, lease.fence),
            )

    # -- reads ------------------------------------------------------------------

    async def read(
        self, key: BranchKey, from_lsn: Lsn = Lsn(0), limit: int = 10_000
    ) -> list[LogRecord]:
        rows = self._db.execute(
            "SELECT lsn, type, schema_version, at_ms, payload FROM log "
            "WHERE tenant=? AND stream=? AND branch=? AND lsn>=? ORDER BY lsn LIMIT ?",
            (_t(key.tenant), key.stream, key.branch, from_lsn, limit),
        ).fetchall()
        return [
            LogRecord(key, Lsn(lsn), ver, at, self._registry.decode(typ, ver, json.loads(p)))
            for lsn, typ, ver, at, p in rows
        ]

    async def branches(self, stream: str, tenant: TenantId | None = None) -> list[BranchKey]:
        if tenant is None:
            rows = self._db.execute(
                "SELECT DISTINCT tenant, branch FROM log WHERE stream=? ORDER BY tenant, branch",
                (stream,),
            ).fetchall()
        else:
            rows = self._db.execute(
                "SELECT DISTINCT tenant, branch FROM log WHERE tenant=? AND stream=? "
                "ORDER BY tenant, branch",
                (_t(tenant), stream),
            ).fetchall()
        return [BranchKey(tenant_id(t), stream, BranchId(b)) for t, b in rows]

    async def stale_branches(self, pattern: str, before_ms: int, limit: int) -> list[StaleBranch]:
        rows = self._db.execute(
            "SELECT tenant, stream, branch, MIN(lsn), MAX(lsn) FROM log WHERE stream GLOB ? "
            "GROUP BY tenant, stream, branch "
            "HAVING MIN(CASE WHEN type <> ? THEN at_ms END) < ? "
            "ORDER BY MIN(at_ms) LIMIT ?",
            (_glob(pattern), COMPACTED, before_ms, limit),
        ).fetchall()
        return [
            StaleBranch(BranchKey(tenant_id(t), s, BranchId(b)), Lsn(lo), Lsn(hi + 1))
            for t, s, b, lo, hi in rows
        ]

    async def prune_inbox(self, before_ms: int) -> int:
        with self._db:
            self._db.execute("BEGIN")
            cur = self._db.execute("DELETE FROM inbox WHERE at_ms < ?", (before_ms,))
        return cur.rowcount

    async def reclaim_space(self) -> int:
        """See `EventLog.reclaim_space`: the WAL is checkpointed and truncated
        (`truncate_wal`); its bytes before."""
        wal = self._path.with_name(self._path.name + "-wal")
        size = wal.stat().st_size if wal.exists() else 0
        return size if truncate_wal(self._db) else 0

    async def put_checkpoint(self, key: BranchKey, upto: Lsn, state: bytes) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?)",
                (_t(key.tenant), key.stream, key.branch, upto, state),
            )

    async def latest_checkpoint(self, key: BranchKey, upto: Lsn | None = None) -> Checkpoint | None:
        bound = (1 << 62) if upto is None else upto
        row = self._db.execute(
            "SELECT upto, state FROM checkpoints WHERE tenant=? AND stream=? AND branch=? "
            "AND upto<=? ORDER BY upto DESC LIMIT 1",
            (_t(key.tenant), key.stream, key.branch, bound),
        ).fetchone()
        return None if row is None else Checkpoint(key, Lsn(row[0]), row[1])

    async def delete_checkpoints(self, key: BranchKey) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "DELETE FROM checkpoints WHERE tenant=? AND stream=? AND branch=?",
                (_t(key.tenant), key.stream, key.branch),
            )

    async def get(self, at: StateKey) -> dict[str, Any] | None:
        row = self._db.execute(
            "SELECT value FROM state WHERE tenant=? AND kind=? AND key=?",
            (_t(at.tenant), at.kind, at.key),
        ).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    async def scan(
        self, tenant: TenantId, kind: str, prefix: str = ""
    ) -> list[tuple[str, dict[str, Any]]]:
        rows = self._db.execute(
            "SELECT key, value FROM state WHERE tenant=? AND kind=? AND substr(key, 1, ?)=? "
            "ORDER BY key",
            (_t(tenant), kind, len(prefix), prefix),
        ).fetchall()
        return [(k, dict(json.loads(v))) for k, v in rows]

    async def scan_kind(self, kind: str) -> list[tuple[TenantId, str, dict[str, Any]]]:
        rows = self._db.execute(
            "SELECT tenant, key, value FROM state WHERE kind=? ORDER BY tenant, key", (kind,)
        ).fetchall()
        return [(tenant_id(t), k, dict(json.loads(v))) for t, k, v in rows]

    async def positions(self) -> dict[tuple[str, int], int]:
        rows = self._db.execute("SELECT topic, partition, next_offset FROM positions").fetchall()
        return {(t, p): o for t, p, o in rows}

    async def seen(self, tenant: TenantId, message_id: MessageId) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM inbox WHERE tenant=? AND message_id=?", (_t(tenant), message_id)
        ).fetchone()
        return row is not None

    async def drain_outbox(self, limit: int) -> list[PendingOutbox]:
        rows = self._db.execute(
            "SELECT seq, topic, key, value, headers FROM outbox ORDER BY seq LIMIT ?", (limit,)
        ).fetchall()
        if not rows:
            self._sync_acks()
        headers = decode_headers_of([row[4] for row in rows])
        return [
            PendingOutbox(seq, OutboxEntry(topic, key, value, h))
            for (seq, topic, key, value, _), h in zip(rows, headers, strict=True)
        ]

    async def ack_outbox(self, seqs: list[int]) -> None:
        """See `EventLog.ack_outbox`. The removal is committed without an fsync of its own
        (`synchronous=NORMAL` for this one transaction): it survives the process being
        killed at once, and is made durable by the next commit's fsync or, at the latest,
        when the relay next finds the outbox empty (or the log closes). A power cut before
        that can undo it; the rows then ship again, which the consumers' inboxes drop (§5),
        as when a relay is killed between publishing and marking. A relay keeping up
        with a busy stage so pays one fsync when it catches up, not one per batch."""
        if not seqs:
            return
        db = self._db
        self._acks_unsynced = True
        db.execute("PRAGMA synchronous=NORMAL")
        try:
            with db:
                db.execute("BEGIN")
                first, last = seqs[0], seqs[-1]
                if last - first + 1 == len(seqs) and seqs == list(range(first, last + 1)):
                    db.execute("DELETE FROM outbox WHERE seq BETWEEN ? AND ?", (first, last))
                else:
                    db.executemany("DELETE FROM outbox WHERE seq=?", [(s,) for s in seqs])
        finally:
            db.execute("PRAGMA synchronous=FULL")

    def _sync_acks(self) -> None:
        """fsync the WAL if rows were marked shipped since it last was: what a
        `synchronous=FULL` commit does once it has written its frames."""
        if not self._acks_unsynced:
            return
        try:
            fd = os.open(self._path.with_name(self._path.name + "-wal"), os.O_RDONLY)
        except FileNotFoundError:  # no WAL: a checkpoint moved everything into the database
            pass
        else:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._acks_unsynced = False

    # -- rebuild ----------------------------------------------------------------

    async def rebuild(self, *, keep: bool) -> RebuildReport:
        return self._rebuild(keep)

    def _rebuild(self, keep: bool) -> RebuildReport:
        db = self._db
        cur = db.cursor()
        db.execute("BEGIN IMMEDIATE")
        try:
            before = db.execute(
                "SELECT tenant, kind, key, value FROM state ORDER BY tenant, kind, key"
            ).fetchall()
            db.execute("DELETE FROM state")
            n = 0
            for tenant, stream, branch, lsn, typ, ver, at, payload in db.execute(
                "SELECT tenant, stream, branch, lsn, type, schema_version, at_ms, payload "
                "FROM log ORDER BY seq"
            ).fetchall():
                event = self._registry.decode(typ, ver, json.loads(payload))
                key = BranchKey(tenant_id(tenant), stream, branch)
                for delta in self._fold(LogRecord(key, Lsn(lsn), ver, at, event)):
                    _apply(cur, delta)
                n += 1
            after = db.execute(
                "SELECT tenant, kind, key, value FROM state ORDER BY tenant, kind, key"
            ).fetchall()
            db.execute("COMMIT" if keep else "ROLLBACK")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return RebuildReport(n, len(before), len(after), _differences(before, after))


TENANT_TABLES = ("log", "state", "checkpoints", "leases", "inbox", "spend")
"""The tables of a stage's store with a tenant column (its document tables follow `state`
by trigger); the outbox is keyed by the tenant instead."""


def erase_tenant(db: sqlite3.Cursor, tenant: TenantId) -> None:
    """Delete every row of `tenant` (`CommitBatch.erase`)."""
    t = _t(tenant)
    for table in TENANT_TABLES:
        db.execute(f"DELETE FROM {table} WHERE tenant=?", (t,))
    db.execute("DELETE FROM outbox WHERE key=? OR substr(key, 1, ?)=?", (t, len(t) + 1, f"{t}:"))


def _delete_branch(db: sqlite3.Cursor, key: BranchKey, end: int) -> None:
    """Delete a branch's records and checkpoints if it holds exactly LSNs 0 .. end - 1."""
    row = (_t(key.tenant), key.stream, key.branch)
    count, top = db.execute(
        "SELECT COUNT(*), MAX(lsn) FROM log WHERE tenant=? AND stream=? AND branch=?", row
    ).fetchone()
    if count != end or (count and top != end - 1):
        raise StreamChanged(
            f"stream {key.stream} branch {key.branch}: holds {count} records, not the {end} "
            "the deletion was computed on"
        )
    db.execute("DELETE FROM log WHERE tenant=? AND stream=? AND branch=?", row)
    db.execute("DELETE FROM checkpoints WHERE tenant=? AND stream=? AND branch=?", row)


def _truncate_branch(db: sqlite3.Cursor, cut: BranchTruncation) -> None:
    """Delete a branch's records below `cut.below` if it still ends at `cut.end`."""
    row = (_t(cut.key.tenant), cut.key.stream, cut.key.branch)
    (top,) = db.execute(
        "SELECT MAX(lsn) FROM log WHERE tenant=? AND stream=? AND branch=?", row
    ).fetchone()
    if top is None or top != cut.end - 1:
        raise StreamChanged(
            f"stream {cut.key.stream} branch {cut.key.branch}: ends at "
            f"{0 if top is None else top + 1}, not at {cut.end} where it was read"
        )
    db.execute(
        "DELETE FROM log WHERE tenant=? AND stream=? AND branch=? AND lsn<?", (*row, cut.below)
    )
    db.execute("DELETE FROM checkpoints WHERE tenant=? AND stream=? AND branch=?", row)


COMPACTED = "Compacted"
"""The type of retention's compaction record (`assay.record.compaction`): a branch holding
only one is not compacted again."""


def _glob(pattern: str) -> str:
    """`pattern` (`*` the only wildcard) as a SQLite GLOB pattern."""
    return "".join(f"[{c}]" if c in "?[]" else c for c in pattern)


def add_column(conn: sqlite3.Connection, table: str, column: str) -> None:
    """Add `column` (its DDL) to `table` unless a file of an earlier version lacks it."""
    name = column.split()[0]
    if all(row[1] != name for row in conn.execute(f"PRAGMA table_info({table})")):
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column}")


def _differences(before: list[Any], after: list[Any]) -> list[str]:
    old = {tuple(r[:3]): r[3] for r in before}
    new = {tuple(r[:3]): r[3] for r in after}
    out = []
    for k in sorted(old.keys() | new.keys()):
        if old.get(k) != new.get(k):
            what = (
                "missing after rebuild"
                if k not in new
                else ("missing from the stored state" if k not in old else "differs")
            )
            out.append(f"{'/'.join(str(p) for p in k)}: {what}")
    return out


_Doc = tuple[str, str, str]
"""A document as stored: (tenant, kind, key)."""


def _merge(db: sqlite3.Cursor, docs: dict[_Doc, dict[str, Any] | None], delta: StateDelta) -> None:
    """Apply `delta` to the batch's view of its documents (None: deleted). A document the
    batch patches is read once; each is written once, at the end (`_write_docs`): two
    records of one commit patching the same run document cost one read and one write,
    and the stored bytes are what applying the deltas one by one would leave."""
    at = delta.at
    ident = (_t(at.tenant), at.kind, at.key)
    match delta:
        case Put(value=value):
            docs[ident] = value
        case Patch(fields=fields):
            if ident in docs:
                base = docs[ident]
            else:
                row = db.execute(
                    "SELECT value FROM state WHERE tenant=? AND kind=? AND key=?", ident
                ).fetchone()
                base = json.loads(row[0]) if row else None
            docs[ident] = {**(base or {}), **fields}
        case Delete():
            docs[ident] = None


def _write_docs(db: sqlite3.Cursor, docs: dict[_Doc, dict[str, Any] | None]) -> None:
    for ident, value in docs.items():
        if value is None:
            db.execute("DELETE FROM state WHERE tenant=? AND kind=? AND key=?", ident)
        else:
            db.execute(
                "INSERT OR REPLACE INTO state VALUES (?, ?, ?, ?)", (*ident, document_bytes(value))
            )


def _apply(db: sqlite3.Cursor, delta: StateDelta) -> None:
    at = delta.at
    ident = (_t(at.tenant), at.kind, at.key)
    match delta:
        case Put(value=value):
            db.execute(
                "INSERT OR REPLACE INTO state VALUES (?, ?, ?, ?)", (*ident, document_bytes(value))
            )
        case Patch(fields=fields):
            row = db.execute(
                "SELECT value FROM state WHERE tenant=? AND kind=? AND key=?", ident
            ).fetchone()
            merged = {**(json.loads(row[0]) if row else {}), **fields}
            db.execute(
                "INSERT OR REPLACE INTO state VALUES (?, ?, ?, ?)",
                (*ident, document_bytes(merged)),
            )
        case Delete():
            db.execute("DELETE FROM state WHERE tenant=? AND kind=? AND key=?", ident)


def encode_headers(headers: tuple[tuple[str, bytes], ...]) -> bytes:
    """Headers as JSON bytes (values kept byte-exact via latin-1)."""
    return json.dumps([[k, v.decode("latin-1")] for k, v in headers]).encode()


def decode_headers(raw: bytes) -> tuple[tuple[str, bytes], ...]:
    """Inverse of `encode_headers`."""
    return _headers(json.loads(raw))


def _headers(pairs: list[list[str]]) -> tuple[tuple[str, bytes], ...]:
    """Headers from the parsed JSON array `encode_headers` wrote."""
    return tuple([(k, v.encode("latin-1")) for k, v in pairs])


def decode_headers_of(raws: list[bytes]) -> list[tuple[tuple[str, bytes], ...]]:
    """`decode_headers` of each of `raws`, in order, parsed as one JSON document.

    A relay reads its outbox a batch at a time; one parse of the joined arrays costs a
    fraction of one per row (`json.loads`'s own work per call is most of a row's).
    Each of `raws` is one JSON array, as `encode_headers` writes it; should the joined
    document not hold exactly one array per row, each is parsed alone.
    """
    if not raws:
        return []
    lists = json.loads(b"[" + b",".join(raws) + b"]")
    if len(lists) != len(raws):
        return [decode_headers(raw) for raw in raws]
    return [_headers(pairs) for pairs in lists]


_SQLITE_TYPES = {"text": "TEXT", "integer": "INTEGER", "boolean": "INTEGER"}


def add_table_columns(conn: sqlite3.Connection, t: DocumentTable) -> None:
    """Bring a `DocumentTable` a file of an earlier version made up to `t`: add the
    columns it lacks, filled from the documents, and drop its triggers so
    `document_table_ddl` makes them again with every column. A new table: nothing.

    In one transaction (the connection is in autocommit mode, where `with conn` is
    none): a failure or a crash half-way leaves the table as it was, so the next open
    adds and fills the columns again instead of finding them there, empty."""
    have = {row[1] for row in conn.execute(f"PRAGMA table_info({t.table})")}
    missing = [c for c in t.columns if c.name not in have]
    if not have or not missing:
        return
    sets = ", ".join(
        f"{c.name} = (SELECT json_extract(CAST(s.value AS TEXT), '$.{c.name}') FROM state s"
        f" WHERE s.tenant = {t.table}.tenant AND s.kind = '{t.kind}'"
        f" AND s.key = {t.table}.key)"
        for c in missing
    )
    conn.execute("BEGIN IMMEDIATE")
    try:
        for c in missing:
            conn.execute(f"ALTER TABLE {t.table} ADD COLUMN {c.name} {_SQLITE_TYPES[c.sql_type]}")
        for name in ("ins", "upd", "del"):
            conn.execute(f"DROP TRIGGER IF EXISTS {t.table}_{name}")
        conn.execute(f"UPDATE {t.table} SET {sets}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def document_table_ddl(t: DocumentTable) -> str:
    """A `DocumentTable`'s table, indexes and the triggers on `state` that keep it in step
    (in the writing transaction; `INSERT OR REPLACE` on `state` fires the insert trigger)."""
    cols = ", ".join(f"{c.name} {_SQLITE_TYPES[c.sql_type]}" for c in t.columns)
    names = ", ".join(c.name for c in t.columns)
    values = ", ".join(f"json_extract(CAST(NEW.value AS TEXT), '$.{c.name}')" for c in t.columns)
    upsert = (
        f"INSERT OR REPLACE INTO {t.table} (tenant, key, {names}) "
        f"VALUES (NEW.tenant, NEW.key, {values});"
    )
    when = f"WHEN NEW.kind = '{t.kind}'"
    parts = [
        f"CREATE TABLE IF NOT EXISTS {t.table} (tenant TEXT NOT NULL, key TEXT NOT NULL, "
        f"{cols}, PRIMARY KEY (tenant, key)) WITHOUT ROWID;",
        f"CREATE TRIGGER IF NOT EXISTS {t.table}_ins AFTER INSERT ON state {when} "
        f"BEGIN {upsert} END;",
        f"CREATE TRIGGER IF NOT EXISTS {t.table}_upd AFTER UPDATE ON state {when} "
        f"BEGIN {upsert} END;",
        f"CREATE TRIGGER IF NOT EXISTS {t.table}_del AFTER DELETE ON state "
        f"WHEN OLD.kind = '{t.kind}' BEGIN "
        f"DELETE FROM {t.table} WHERE tenant = OLD.tenant AND key = OLD.key; END;",
    ]
    for index in t.indexes:
        name = f"{t.table}_by_{'_'.join(index)}"
        parts.append(
            f"CREATE INDEX IF NOT EXISTS {name} ON {t.table} (tenant, {', '.join(index)}, key);"
        )
    return "\n".join(parts)
