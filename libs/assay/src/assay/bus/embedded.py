"""The embedded transport: Kafka semantics in one process, durable in one file.

Topics have partitions (`assay.bus.topics.partition_count`: the control topics
fewer), keys pick a partition with Kafka's murmur2, and each partition is an
append-only sequence of offsets. As on Kafka, a topic keeps the count it was
created with: the file records it at the topic's first record, and a topic of a
file written before it did keeps the bus's `partitions`. Records live in SQLite (WAL,
`synchronous=FULL`) so a process that dies loses nothing that was published;
a tail of each partition is kept in memory for reads.

Each record also notes its tenant (the envelope's, from its `tenant` header), so a
deleted tenant's records can be deleted from the middle of a partition (`forget`).
Offsets are then no longer contiguous, as in a compacted Kafka topic: a read from an
offset in a hole starts at the next record, a read past the last record waits for
the next one, and each partition's end offset is kept in `ends` whenever the records
that said it are deleted, so an offset is never given twice.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from assay.bus.headers import DLQ_REASON
from assay.bus.partitioner import partition_for
from assay.bus.topics import partition_count
from assay.bus.transport import BusMessage, Handle, Positions
from assay.store.ports import OutboxEntry
from assay.store.sqlite import add_column, connect, decode_headers, encode_headers, truncate_wal

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    topic TEXT NOT NULL, partition INTEGER NOT NULL, offset INTEGER NOT NULL,
    key TEXT NOT NULL, value BLOB NOT NULL, headers BLOB NOT NULL,
    at_ms INTEGER NOT NULL DEFAULT 0,
    tenant TEXT,
    PRIMARY KEY (topic, partition, offset)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS ends (
    topic TEXT NOT NULL, partition INTEGER NOT NULL, next INTEGER NOT NULL,
    PRIMARY KEY (topic, partition)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS topics (
    topic TEXT PRIMARY KEY, partitions INTEGER NOT NULL
) WITHOUT ROWID;
"""
_TAIL = 20_000


def tenant_of(value: bytes, headers: Iterable[tuple[str, bytes]]) -> str:
    """The tenant a record belongs to: its `tenant` header (every envelope mirrors its
    tenant there, and a dead letter keeps the headers of what it refused), else the
    `tenant` field of its JSON body (an envelope, or a bare `TaskSubmitted`); "" when
    neither names one."""
    for k, v in headers:
        if k == "tenant":
            return v.decode("utf-8", "replace")
    try:
        doc = json.loads(value)
    except (ValueError, RecursionError):
        return ""
    tenant = doc.get("tenant") if isinstance(doc, dict) else None
    return tenant if isinstance(tenant, str) else ""


def _offset(m: BusMessage) -> int:
    return m.offset


class EmbeddedBus:
    """`Transport` for embedded mode. One instance per data directory and process.

    Like the event logs, it does its SQLite work on the event loop's thread: a
    publish is one transaction for the whole batch a relay hands over.
    """

    def __init__(
        self, path: str | Path, partitions: int = 12, control_partitions: int | None = None
    ) -> None:
        """`partitions` for the topics with a record or more per run, `control_partitions`
        for the control and dead-letter topics (`partitions` too when None)."""
        self.partitions = partitions
        self.control_partitions = partitions if control_partitions is None else control_partitions
        self._counts: dict[str, int] = {}
        """Each created topic's partition count, as the file records it."""
        self._path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._next: dict[tuple[str, int], int] = {}
        self._tail: dict[tuple[str, int], list[BusMessage]] = defaultdict(list)
        self._wake: dict[tuple[str, int], asyncio.Event] = defaultdict(asyncio.Event)
        self._forgotten: frozenset[str] = frozenset()
        """Tenants `forget` has deleted the records of, up to `_forgotten_from`."""
        self._forgotten_from: dict[tuple[str, int], int] = {}
        """Per partition, the offset from which `forget` reads for `_forgotten`'s records."""

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"embedded bus {self._path} is not open")
        return self._conn

    async def open(self) -> EmbeddedBus:
        """Open the file and load each partition's end offset and tail."""
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = connect(self._path)
        self._conn.executescript(_SCHEMA)
        add_column(self._conn, "records", "at_ms INTEGER NOT NULL DEFAULT 0")  # files of before
        self._add_tenants()
        rows = self._conn.execute(
            "SELECT r.topic, r.partition, r.offset, r.key, r.value, r.headers FROM records r "
            "JOIN (SELECT topic, partition, MAX(offset) AS hi FROM records "
            "GROUP BY topic, partition) m ON r.topic = m.topic AND r.partition = m.partition "
            f"WHERE r.offset > m.hi - {_TAIL} ORDER BY r.topic, r.partition, r.offset"
        ).fetchall()
        for topic, part, off, key, value, headers in rows:
            self._tail[(topic, part)].append(
                BusMessage(topic, part, off, key, value, decode_headers(headers))
            )
            self._next[(topic, part)] = off + 1
        for topic, part, nxt in self._conn.execute("SELECT topic, partition, next FROM ends"):
            self._next[(topic, part)] = max(nxt, self._next.get((topic, part), 0))
        self._counts = dict(self._conn.execute("SELECT topic, partitions FROM topics"))
        # A file of before holds topics made with one count for all, the bus's.
        older = {topic: self.partitions for topic, _ in self._next if topic not in self._counts}
        if older:
            self._conn.execute("BEGIN")
            try:
                self._conn.executemany("INSERT INTO topics VALUES (?, ?)", older.items())
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._counts.update(older)
        return self

    def partitions_of(self, topic: str) -> int:
        """How many partitions `topic` has: what the file recorded at its first record,
        else what it will be created with."""
        count = self._counts.get(topic)
        if count is None:
            count = partition_count(topic, self.partitions, self.control_partitions)
        return count

    def _add_tenants(self) -> None:
        """Give a file of before the `tenant` column, and each of its records the tenant
        it names, in one transaction (a crash leaves the file as it was)."""
        db = self._db
        if any(row[1] == "tenant" for row in db.execute("PRAGMA table_info(records)")):
            return
        db.execute("BEGIN")
        try:
            db.execute("ALTER TABLE records ADD COLUMN tenant TEXT")
            rows = db.execute("SELECT topic, partition, offset, value, headers FROM records")
            db.executemany(
                "UPDATE records SET tenant=? WHERE topic=? AND partition=? AND offset=?",
                [(tenant_of(v, decode_headers(h)), t, p, o) for t, p, o, v, h in rows.fetchall()],
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    async def publish(self, entries: list[OutboxEntry]) -> None:
        if not entries:
            return
        staged: list[BusMessage] = []
        nxt = dict(self._next)
        created = {
            e.topic: self.partitions_of(e.topic) for e in entries if e.topic not in self._counts
        }
        for e in entries:
            part = partition_for(e.key.encode(), self._counts.get(e.topic) or created[e.topic])
            off = nxt.get((e.topic, part), 0)
            nxt[(e.topic, part)] = off + 1
            staged.append(BusMessage(e.topic, part, off, e.key, e.value, e.headers))
        db = self._db
        now = int(time.time() * 1000)
        db.execute("BEGIN")
        try:
            db.executemany(
                "INSERT INTO records (topic, partition, offset, key, value, headers, at_ms, tenant)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        m.topic,
                        m.partition,
                        m.offset,
                        m.key,
                        m.value,
                        encode_headers(m.headers),
                        now,
                        tenant_of(m.value, m.headers),
                    )
                    for m in staged
                ],
            )
            if created:
                db.executemany("INSERT INTO topics VALUES (?, ?)", created.items())
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self._counts.update(created)
        self._next = nxt
        for m in staged:
            tail = self._tail[(m.topic, m.partition)]
            tail.append(m)
            if len(tail) > 2 * _TAIL:
                del tail[:_TAIL]
            self._wake[(m.topic, m.partition)].set()

    async def fetch(
        self, topic: str, partition: int, offset: int, limit: int, timeout_s: float
    ) -> list[BusMessage]:
        """Up to `limit` records of the partition from `offset` on (from the next record
        when `offset` is in a hole `forget` left); none yet: wait up to `timeout_s` for
        one to be published."""
        tp = (topic, partition)
        if self._next.get(tp, 0) > offset and (found := self._read(tp, offset, limit)):
            return found
        # At the end, or past the last record with only deleted offsets after it.
        wake = self._wake[tp]
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), timeout_s)
        except TimeoutError:
            return []
        return self._read(tp, offset, limit)

    def _read(self, tp: tuple[str, int], offset: int, limit: int) -> list[BusMessage]:
        tail = self._tail[tp]
        if tail and tail[0].offset <= offset:
            start = bisect_left(tail, offset, key=_offset)
            return tail[start : start + limit]
        topic, partition = tp
        rows = self._db.execute(
            "SELECT offset, key, value, headers FROM records WHERE topic=? AND partition=? "
            "AND offset>=? ORDER BY offset LIMIT ?",
            (topic, partition, offset, limit),
        ).fetchall()
        return [BusMessage(topic, partition, o, k, v, decode_headers(h)) for o, k, v, h in rows]

    def next_present(self, topic: str, partition: int, offset: int) -> int:
        """The offset of the partition's first record at or after `offset`; its end offset
        if there is none (what a consumer stored at `offset` reads next)."""
        tp = (topic, partition)
        end = self._next.get(tp, 0)
        if offset >= end:
            return offset
        found = self._read(tp, offset, 1)
        return found[0].offset if found else end

    def topics(self) -> list[str]:
        """Every topic a record was ever published to (in this process or before)."""
        return sorted({topic for topic, _ in self._next})

    async def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: self._next.get((topic, p), 0) for p in range(self.partitions_of(topic))}

    async def truncate(self, floors: dict[tuple[str, int], int], older_than_ms: int) -> int:
        """Delete each partition's records below its floor that were published before
        `older_than_ms` (ms since the epoch); the records deleted. A partition's last
        record always stays: on reopening, it says where the partition ends."""
        cuts = [
            (topic, p, min(floor, self._next.get((topic, p), 0) - 1), older_than_ms)
            for (topic, p), floor in floors.items()
        ]
        cuts = [c for c in cuts if c[2] > 0]
        if not cuts:
            return 0
        db = self._db
        db.execute("BEGIN")
        try:
            before = db.total_changes
            db.executemany(
                "DELETE FROM records WHERE topic=? AND partition=? AND offset<? AND at_ms<?", cuts
            )
            deleted = db.total_changes - before
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        for topic, p, _, _ in cuts:
            first = db.execute(
                "SELECT MIN(offset) FROM records WHERE topic=? AND partition=?", (topic, p)
            ).fetchone()[0]
            tail = self._tail.get((topic, p))
            if tail and first is not None:
                del tail[: bisect_left(tail, first, key=_offset)]
        return deleted

    async def forget(self, before_ms: Mapping[str, int], *, keep: Collection[str] = ()) -> int:
        """Delete the records of each tenant of `before_ms` published before its time (ms
        since the epoch) from every partition of every topic but `keep`, whatever their
        offsets; a later one goes at a later call. The records deleted. Idempotent, and
        one transaction: a crash deletes nothing and the next call deletes it all.

        A call for tenants already forgotten reads each partition only from where the
        last call left off (the records published since, and those still too young); a
        new tenant reads the whole file. A partition whose last records go keeps its
        end offset in `ends`."""
        wanted = frozenset(before_ms)
        if not wanted:
            return 0
        db = self._db
        marks = ",".join("?" * len(wanted))
        if wanted <= self._forgotten:
            found = []
            for (topic, p), end in self._next.items():
                since = self._forgotten_from.get((topic, p), 0)
                if since < end and topic not in keep:
                    found += db.execute(
                        "SELECT topic, partition, offset, at_ms, tenant FROM records WHERE topic=?"
                        f" AND partition=? AND offset>=? AND tenant IN ({marks})",
                        (topic, p, since, *wanted),
                    ).fetchall()
        else:
            found = db.execute(
                "SELECT topic, partition, offset, at_ms, tenant FROM records"
                f" WHERE tenant IN ({marks})",
                tuple(wanted),
            ).fetchall()
        gone: dict[tuple[str, int], set[int]] = defaultdict(set)
        lowest_held: dict[tuple[str, int], int] = {}
        for topic, p, off, at_ms, tenant in found:
            if topic in keep:
                continue
            if at_ms >= before_ms[tenant]:
                lowest_held[(topic, p)] = min(off, lowest_held.get((topic, p), off))
                continue
            gone[(topic, p)].add(off)
        if gone:
            db.execute("BEGIN")
            try:
                db.executemany(
                    "DELETE FROM records WHERE topic=? AND partition=? AND offset=?",
                    [(t, p, o) for (t, p), offs in gone.items() for o in offs],
                )
                db.executemany(
                    "INSERT INTO ends VALUES (?, ?, ?) ON CONFLICT (topic, partition) "
                    "DO UPDATE SET next=MAX(next, excluded.next)",
                    [(t, p, self._next[(t, p)]) for t, p in gone],
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            for tp, offs in gone.items():
                tail = self._tail.get(tp)
                if tail:
                    tail[:] = [m for m in tail if m.offset not in offs]
        self._forgotten = wanted
        self._forgotten_from = {tp: lowest_held.get(tp, end) for tp, end in self._next.items()}
        return sum(len(offs) for offs in gone.values())

    def reclaim_space(self) -> bool:
        """Checkpoint and truncate the bus file's write-ahead log (`truncate_wal`), so
        the space `truncate` freed is what the file reuses; whether it was truncated."""
        return truncate_wal(self._db)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class EmbeddedSource:
    """`Source` over the embedded bus: one process holds every partition."""

    def __init__(self, bus: EmbeddedBus, poll_s: float = 0.25) -> None:
        self.bus = bus
        self._poll_s = poll_s

    async def end_offsets(self, topics: list[str]) -> dict[tuple[str, int], int]:
        """Every partition of `topics` (one process holds them all), with its end offset."""
        ends: dict[tuple[str, int], int] = {}
        for topic in topics:
            ends.update({(topic, p): end for p, end in (await self.bus.end_offsets(topic)).items()})
        return ends

    async def consume(
        self, topics: list[str], handle: Handle, positions: Positions, stop: asyncio.Event
    ) -> None:
        stored = await positions()

        async def partition(topic: str, p: int) -> None:
            offset = stored.get((topic, p), 0)
            while not stop.is_set():
                for m in await self.bus.fetch(topic, p, offset, 100, self._poll_s):
                    if stop.is_set():
                        return
                    await handle(m)
                    offset = m.offset + 1

        await asyncio.gather(
            *(partition(t, p) for t in topics for p in range(self.bus.partitions_of(t)))
        )

    async def next_present(
        self, positions: dict[tuple[str, int], int]
    ) -> dict[tuple[str, int], int]:
        """Each position moved past the offsets a tenant's deletion left empty
        (`EmbeddedBus.next_present`): what the stage reads next, for its lag."""
        return {(t, p): self.bus.next_present(t, p, o) for (t, p), o in positions.items()}


class DeadLetterWatch:
    """Whether one message was dead-lettered: reads a dead-letter topic from where it
    ended before the message was published (`opened` is called before publishing)."""

    def __init__(self, bus: EmbeddedBus, topic: str, since: dict[int, int], message: str) -> None:
        self._bus, self._topic, self._since, self._message = bus, topic, since, message

    @classmethod
    async def opened(cls, bus: EmbeddedBus, topic: str, message: str) -> DeadLetterWatch:
        """Watch `topic` for `message` (an envelope id) from its end now."""
        return cls(bus, topic, await bus.end_offsets(topic), message)

    async def refused(self) -> str | None:
        """The reason the stage gave (possibly empty), once the message is among its dead
        letters; None: not (yet)."""
        from assay.messages.envelope import open_envelope

        for p, offset in self._since.items():
            for m in await self._bus.fetch(self._topic, p, offset, 1000, 0.0):
                self._since[p] = m.offset + 1
                if open_envelope(m.value).id == self._message:
                    return dict(m.headers).get(DLQ_REASON, b"").decode()
        return None
