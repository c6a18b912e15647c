"""The Postgres writer's side of a commit: the fold, run in the client (§8.3).

The writer assigns LSNs from a per-branch cache of the next LSN (a branch it has
not seen is taken to be new, at LSN 0, as most are: a run's or a task's first
record; one `max(lsn)` query learns it once the server refused that guess) and
merges a patch onto a
cached copy of the document it patches (read once when unknown). These are
guesses: the server refuses a stale one (the log's primary key; a patched
document must still hold the base it was merged onto), and the writer then
forgets it and tries again. Documents are stored as the same canonical bytes the
SQLite adapter writes, so a re-fold compares byte for byte.
"""

from __future__ import annotations

import json
import time
from typing import Any

from asyncpg.pool import PoolConnectionProxy

from assay.kernel.canonical import document_bytes
from assay.kernel.ids import Lsn
from assay.record.events import LogRecord
from assay.record.state import Delete, Fold, Patch, Put, StateDelta, StateKey
from assay.store.pg_batch_sql import DELETE, PATCH, PUT
from assay.store.ports import CommitBatch, StreamChanged

Branch = tuple[int, str, int]
"""A branch as the LSN cache keys it: (tenant as an int, stream, branch). An int
hashes in C; a `UUID` hashes in Python, and the commit path hashes keys often."""

Doc = tuple[int, str, str]
"""A document as the caches key it: (tenant as an int, kind, key)."""


def doc_key(at: StateKey) -> Doc:
    """The cache key of a document."""
    return (at.tenant.int, at.kind, at.key)


_CACHE_LIMIT = 100_000


def merged(base: bytes | None, fields: dict[str, Any]) -> bytes:
    """The canonical bytes of `fields` shallow-merged onto the stored document `base`."""
    return document_bytes({**(json.loads(base) if base is not None else {}), **fields})


def apply_to(docs: dict[StateKey, bytes | None], delta: StateDelta) -> None:
    """Apply one delta to an in-memory view of the state (None: absent)."""
    match delta:
        case Put(value=value):
            docs[delta.at] = document_bytes(value)
        case Patch(fields=fields):
            docs[delta.at] = merged(docs.get(delta.at), fields)
        case Delete():
            docs[delta.at] = None


class Folded:
    """One batch after its fold: the rows to write, and what they assumed."""

    __slots__ = ("batch", "deltas", "docs", "encoded", "logs", "lsns", "next_lsn", "states")

    def __init__(
        self,
        batch: CommitBatch,
        lsns: list[Lsn],
        next_lsn: dict[Branch, int],
        logs: list[tuple[Any, ...]],
        deltas: list[StateDelta],
        encoded: list[bytes | None],
    ) -> None:
        self.batch = batch
        self.encoded = encoded  # each `Put`'s canonical bytes, beside `deltas`
        self.lsns = lsns
        self.next_lsn = next_lsn
        self.logs = logs
        self.deltas = deltas
        self.docs: dict[Doc, bytes | None] = {}
        self.states: list[tuple[Any, ...]] = []

    @property
    def guesses(self) -> set[object]:
        """The branches and documents whose state this batch's rows were computed on:
        if an earlier batch of its group that wrote one fails, these rows are wrong."""
        return {*self.next_lsn, *(doc_key(d.at) for d in self.deltas)}

    @property
    def order(self) -> set[object]:
        """What this batch must write after the earlier batches of its group that wrote
        it too: the outbox (rows ship in commit order), its consumer position, its
        inbox id. If such a batch is to be tried again, so is this one."""
        out: set[object] = set()
        b = self.batch
        if b.outbox:
            out.add("outbox")
        if b.position is not None:
            out.add(("position", b.position.topic, b.position.partition))
        if b.inbox is not None:
            out.add(("inbox", *b.inbox))
        return out


class WriterView:
    """What one writer believes the store holds: next LSNs and current documents."""

    def __init__(self, s: str, fold: Fold) -> None:
        self._fold = fold
        self.next_lsn: dict[Branch, int] = {}
        self.docs: dict[Doc, bytes | None] = {}
        self.suspect: set[Branch] = set()
        """Branches a refused batch wrote: learnt, not taken to be new, next time."""
        self._lsn_sql = (
            f"SELECT k.i, (SELECT max(l.lsn) FROM {s}.log l"
            " WHERE l.tenant = k.t AND l.stream = k.s AND l.branch = k.b)"
            " FROM unnest($1::uuid[], $2::text[], $3::integer[]) WITH ORDINALITY AS k(t, s, b, i)"
        )
        self._docs_sql = (
            f"SELECT k.i, d.value FROM unnest($1::uuid[], $2::text[], $3::text[])"
            f" WITH ORDINALITY AS k(t, c, n, i) JOIN {s}.state d"
            " ON d.tenant = k.t AND d.kind = k.c AND d.key = k.n"
        )

    def unknown_branches(self, batches: list[CommitBatch]) -> dict[Branch, tuple[Any, str, int]]:
        """The branches these batches write whose next LSN this writer does not know."""
        known = self.next_lsn
        if len(known) > _CACHE_LIMIT:  # bounded: a miss costs one indexed query
            known.clear()
        unknown: dict[Branch, tuple[Any, str, int]] = {}
        for batch in batches:
            for key, _ in batch.records:
                row = (key.tenant.int, key.stream, key.branch)
                if row not in known:
                    unknown[row] = (key.tenant, key.stream, key.branch)
        return unknown

    def guess_new(
        self, unknown: dict[Branch, tuple[Any, str, int]]
    ) -> dict[Branch, tuple[Any, str, int]]:
        """Take the unknown branches to be new (next LSN 0) and return those that must
        be learnt instead: the ones a refused batch wrote. A wrong guess costs one
        refused statement (the log's primary key) and then one `learn_lsns`."""
        learn: dict[Branch, tuple[Any, str, int]] = {}
        for row, key in unknown.items():
            if row in self.suspect:
                learn[row] = key
            else:
                self.next_lsn[row] = 0
        return learn

    async def learn_lsns(
        self, conn: PoolConnectionProxy, unknown: dict[Branch, tuple[Any, str, int]]
    ) -> None:
        """One query for the next LSN of every branch in `unknown`."""
        rows = list(unknown)
        columns = (list(c) for c in zip(*unknown.values(), strict=True))
        for i, top in await conn.fetch(self._lsn_sql, *columns):
            self.next_lsn[rows[i - 1]] = 0 if top is None else top + 1
        self.suspect.difference_update(rows)

    async def check_ends(self, conn: PoolConnectionProxy, batch: CommitBatch) -> None:
        """Check that each branch the batch expects ends where it expects, from the
        database (not this writer's guesses), and make the batch's first record there
        go in at that LSN: a writer that appended meanwhile makes that insert fail on
        the log's key, and the next try finds the branch moved.

        Raises:
            StreamChanged: a branch ends elsewhere.
            ValueError: the batch does not append to a branch it expects.
        """
        batch.check_expect()
        rows: dict[Branch, tuple[Any, str, int]] = {
            (k.tenant.int, k.stream, k.branch): (k.tenant, k.stream, k.branch)
            for k, _ in batch.expect
        }
        for row in rows:
            self.next_lsn.pop(row, None)
        await self.learn_lsns(conn, rows)
        for key, end in batch.expect:
            found = self.next_lsn[(key.tenant.int, key.stream, key.branch)]
            if found != end:
                raise StreamChanged(
                    f"stream {key.stream} ends at {found}, not {end}: another writer moved it"
                )

    def unknown_docs(self, folded: list[Folded]) -> dict[Doc, StateKey]:
        """The documents these batches patch that this writer does not know. A patch of a
        document its own batch put or deleted first rests on that, not on the store (a
        Pure step's start puts its attempt's document, its end patches it)."""
        docs = self.docs
        if len(docs) > _CACHE_LIMIT:
            docs.clear()
        unknown: dict[Doc, StateKey] = {}
        for f in folded:
            written: set[Doc] = set()
            for d in f.deltas:
                k = doc_key(d.at)
                if not isinstance(d, Patch):
                    written.add(k)
                elif k not in docs and k not in written:
                    unknown[k] = d.at
        return unknown

    async def learn_docs(self, conn: PoolConnectionProxy, unknown: dict[Doc, StateKey]) -> None:
        """One query for every document in `unknown` (absent ones are remembered as such)."""
        keys = list(unknown)
        ats = list(unknown.values())
        columns = [[a.tenant for a in ats], [a.kind for a in ats], [a.key for a in ats]]
        found: dict[int, bytes] = {i: v for i, v in await conn.fetch(self._docs_sql, *columns)}
        for i, k in enumerate(keys, start=1):
            self.docs[k] = found.get(i)

    def fold(self, batch: CommitBatch, group_lsn: dict[Branch, int]) -> Folded:
        """Assign the batch's LSNs (after `group_lsn`, the batches before it in its
        group) and fold its records. Raises whatever the stage's fold raises."""
        mine: dict[Branch, int] = {}
        logs: list[tuple[Any, ...]] = []
        deltas: list[StateDelta] = []
        encoded: list[bytes | None] = []
        lsns: list[Lsn] = []
        now = int(time.time() * 1000)
        for key, event in batch.records:
            tenant, stream, branch = key.tenant, key.stream, key.branch
            row: Branch = (tenant.int, stream, branch)
            lsn = mine.get(row)
            if lsn is None:
                lsn = group_lsn.get(row) if group_lsn else None
                if lsn is None:
                    lsn = self.next_lsn[row]
            mine[row] = lsn + 1
            version = event.version
            payload = event.model_dump_json().encode()
            logs.append((tenant, stream, branch, lsn, event.type, version, now, payload))
            mine_deltas = self._fold(LogRecord(key, Lsn(lsn), version, now, event))
            # Encoded record by record, as SQLite applies them: a document that cannot
            # be stored fails the batch before a later record's fold runs.
            for d in mine_deltas:
                if isinstance(d, Put):
                    encoded.append(document_bytes(d.value))
                else:
                    if isinstance(d, Patch):
                        document_bytes(d.fields)  # refuses what the merge would refuse
                    encoded.append(None)
            deltas += mine_deltas
            lsns.append(Lsn(lsn))
        return Folded(batch, lsns, mine, logs, deltas, encoded)

    def state_rows(self, f: Folded, group_docs: dict[Doc, bytes | None]) -> None:
        """Collapse the batch's deltas to one row per document (on the view after
        `group_docs`, the batches before it in its group). A document whose final
        value rests on one from before the batch is written only if that one is
        still there."""
        docs: dict[Doc, bytes | None] = {}
        ats: dict[Doc, StateKey] = {}
        bases: dict[Doc, bytes | None] = {}  # documents from before the batch it rests on
        for d, put in zip(f.deltas, f.encoded, strict=True):
            at = d.at
            k = (at.tenant.int, at.kind, at.key)
            ats.setdefault(k, at)
            if put is not None:
                docs[k] = put
            elif isinstance(d, Patch):
                if k in docs:
                    base = docs[k]
                else:
                    base = group_docs[k] if k in group_docs else self.docs[k]
                    bases[k] = base
                docs[k] = merged(base, d.fields)
                continue
            else:
                docs[k] = None
            if bases:
                bases.pop(k, None)  # what follows no longer rests on the old document
        states = f.states
        for k in sorted(docs):  # one order for every writer: fewer deadlocks between replicas
            at, value = ats[k], docs[k]
            if k in bases:
                states.append((PATCH, at.tenant, at.kind, at.key, value, bases[k]))
            else:
                states.append(
                    (DELETE if value is None else PUT, at.tenant, at.kind, at.key, value, None)
                )
        f.docs = docs

    def committed(self, f: Folded) -> None:
        """The batch landed: its guesses are now facts."""
        self.next_lsn.update(f.next_lsn)
        self.docs.update(f.docs)

    def forget(self, f: Folded) -> None:
        """Another writer moved on: drop what this batch guessed from."""
        for row in f.next_lsn:
            self.next_lsn.pop(row, None)
        self.suspect.update(f.next_lsn)
        for d in f.deltas:
            self.docs.pop(doc_key(d.at), None)

    def clear(self) -> None:
        """Forget everything (the outcome of a write is unknown)."""
        self.next_lsn.clear()
        self.docs.clear()
