"""The embedded transport: Kafka semantics in one process, durable in one file.

Topics have N partitions, keys pick a partition with Kafka's murmur2, and each
partition is an append-only sequence of offsets. Records live in SQLite (WAL,
`synchronous=FULL`) so a process that dies loses nothing that was published;
a tail of each partition is kept in memory for reads.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections import defaultdict
from pathlib import Path

from assay.bus.headers import DLQ_REASON
from assay.bus.partitioner import partition_for
from assay.bus.transport import BusMessage, Handle, Positions
from assay.store.ports import OutboxEntry
from assay.store.sqlite import add_column, connect, decode_headers, encode_headers, truncate_wal

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    topic TEXT NOT NULL, partition INTEGER NOT NULL, offset INTEGER NOT NULL,
    key TEXT NOT NULL, value BLOB NOT NULL, headers BLOB NOT NULL,
    at_ms INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (topic, partition, offset)
) WITHOUT ROWID;
"""
_TAIL = 20_000


class EmbeddedBus:
    """`Transport` for embedded mode. One instance per data directory and process.

    Like the event logs, it does its SQLite work on the event loop's thread: a
    publish is one transaction for the whole batch a relay hands over.
    """

    def __init__(self, path: str | Path, partitions: int = 12) -> None:
        self.partitions = partitions
        self._path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._next: dict[tuple[str, int], int] = {}
        self._tail: dict[tuple[str, int], list[BusMessage]] = defaultdict(list)
        self._wake: dict[tuple[str, int], asyncio.Event] = defaultdict(asyncio.Event)

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
        return self

    async def publish(self, entries: list[OutboxEntry]) -> None:
        if not entries:
            return
        staged: list[BusMessage] = []
        nxt = dict(self._next)
        for e in entries:
            part = partition_for(e.key.encode(), self.partitions)
            off = nxt.get((e.topic, part), 0)
            nxt[(e.topic, part)] = off + 1
            staged.append(BusMessage(e.topic, part, off, e.key, e.value, e.headers))
        db = self._db
        now = int(time.time() * 1000)
        db.execute("BEGIN")
        try:
            db.executemany(
                "INSERT INTO records VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (m.topic, m.partition, m.offset, m.key, m.value, encode_headers(m.headers), now)
                    for m in staged
                ],
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
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
        tp = (topic, partition)
        if self._next.get(tp, 0) <= offset:
            wake = self._wake[tp]
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), timeout_s)
            except TimeoutError:
                return []
        tail = self._tail[tp]
        if tail and tail[0].offset <= offset:
            start = offset - tail[0].offset
            return tail[start : start + limit]
        rows = self._db.execute(
            "SELECT offset, key, value, headers FROM records WHERE topic=? AND partition=? "
            "AND offset>=? ORDER BY offset LIMIT ?",
            (topic, partition, offset, limit),
        ).fetchall()
        return [BusMessage(topic, partition, o, k, v, decode_headers(h)) for o, k, v, h in rows]

    def topics(self) -> list[str]:
        """Every topic a record was ever published to (in this process or before)."""
        return sorted({topic for topic, _ in self._next})

    async def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: self._next.get((topic, p), 0) for p in range(self.partitions)}

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
                del tail[: max(0, first - tail[0].offset)]
        return deleted

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

        await asyncio.gather(*(partition(t, p) for t in topics for p in range(self.bus.partitions)))


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
