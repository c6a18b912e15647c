"""Group commit for the Postgres event log: one round trip per commit, or per group.

A commit that finds the writer idle is written at once, on the caller's task, as
one statement of its shape (`pg_batch_sql`). Commits that arrive while a write
is in flight form the next group: one call of the server-side `assay_commit`,
one transaction, each batch under its own savepoint (`assay_commit_fenced` when
some are fenced: each checks its lease there). A batch that fails on the server
(a duplicate message, a stale guess, a stale fence) never takes the others down; a later
batch that built on it in the same group is not attempted and goes again with
the next group, with fresh guesses, so LSNs stay dense. A batch that deletes
branches (tiering, rare) goes alone, as one explicit transaction (`pg_deleting`).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from assay.kernel.ids import Lsn
from assay.record.state import Fold
from assay.store.pg_batch_sql import FENCE_CHECK, Shape, fence_cte, one_batch, statement
from assay.store.pg_connections import alive, discard
from assay.store.pg_deleting import commit_deleting
from assay.store.pg_fold import Branch, Doc, Folded, WriterView
from assay.store.pg_schema import (
    DUPLICATE_MESSAGE,
    STALE_FENCE,
    STALE_GUESS,
    Outcome,
    outbox_channel,
    quoted,
)
from assay.store.ports import CommitBatch, DuplicateMessage, Lease, StaleFence
from assay.store.sqlite import encode_headers

_MAX_GROUP = 500
_MAX_TRIES = 8
_STALE = {STALE_GUESS, "23505"}  # 23505: only the log's primary key raises it, a stale LSN
_AGAIN = {*_STALE, "40P01", "40001"}  # and replicas' transactions deadlocked or conflicted


@dataclass(slots=True)
class _Pending:
    batch: CommitBatch
    fut: asyncio.Future[list[Lsn]]
    order: int
    tries: int = 0
    alone: bool = False


class GroupCommitter:
    """Turns `commit` calls into as few round trips as possible, one write at a time,
    on one connection held for writing."""

    def __init__(self, pool: asyncpg.Pool, schema: str, fold: Fold) -> None:
        self._pool = pool
        self._s = s = quoted(schema)
        self._channel = outbox_channel(schema)
        self._fold = fold
        self._view = WriterView(s, fold)
        self._commit_sql = (
            f"SELECT {s}.assay_commit($1::{s}.commit_batch[], $2::{s}.log_row[],"
            f" $3::{s}.state_row[], $4::{s}.outbox_row[])"
        )
        self._fenced_commit_sql = (
            f"WITH {fence_cte(s, 5, 6, 7)} SELECT {FENCE_CHECK.format(s=s)},"
            f" {s}.assay_commit($1::{s}.commit_batch[], $2::{s}.log_row[],"
            f" $3::{s}.state_row[], $4::{s}.outbox_row[])"
        )
        self._fenced_group_sql = (
            f"SELECT {s}.assay_commit_fenced($1::{s}.commit_batch[], $2::{s}.log_row[],"
            f" $3::{s}.state_row[], $4::{s}.outbox_row[], $5::{s}.fence_row[])"
        )
        self._statements: dict[Shape, str] = {}
        self._conn: PoolConnectionProxy | None = None
        self._queue: collections.deque[_Pending] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()  # set while nothing is being written
        self._idle.set()
        self._order = 0
        self._retries: list[_Pending] = []
        self._seen_sql = f"SELECT 1 FROM {s}.inbox WHERE tenant = $1 AND message_id = $2"

    @property
    def connection(self) -> PoolConnectionProxy | None:
        """The connection commits are written on, if one is held."""
        return self._conn

    async def commit(self, batch: CommitBatch) -> list[Lsn]:
        """Write a batch and return its LSNs (see `EventLog.commit`).

        Raises:
            DuplicateMessage: the batch's inbox id was committed before.
        """
        if not batch:
            return []
        if self._idle.is_set():  # nothing in flight: write it now, on this task
            self._idle.clear()
            try:
                return await self._alone(batch)
            finally:
                self._resume()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Lsn]] = loop.create_future()
        self._order += 1
        # A batch that deletes branches goes alone (its own transaction), and so does
        # one that expects branches to end somewhere (checked just before its
        # statement). A fenced batch joins the group: its fence is checked in its own
        # savepoint, so a stale one fails alone (§9.4).
        alone = batch.removes or bool(batch.expect)
        self._queue.append(_Pending(batch, fut, self._order, alone=alone))
        return await fut

    def forget_documents(self) -> None:
        """Drop cached documents (derived state was replaced under this writer)."""
        self._view.docs.clear()

    async def close(self) -> None:
        """Write what is queued, then give the connection back."""
        await self._idle.wait()
        conn, self._conn = self._conn, None
        if conn is not None:
            if alive(conn):
                await self._pool.release(conn)
            else:
                await discard(self._pool, conn)

    def _resume(self) -> None:
        """After a write: the next group if commits queued meanwhile, else idle."""
        if self._queue:
            self._task = asyncio.get_running_loop().create_task(self._run())
        else:
            self._idle.set()

    async def _run(self) -> None:
        try:
            while self._queue:
                await self._round(self._take())
        finally:
            self._task = None
            self._idle.set()

    # -- one batch, nothing else in flight --------------------------------------

    async def _alone(self, batch: CommitBatch) -> list[Lsn]:
        if batch.removes:
            return await self._deleting(batch)
        view = self._view
        f: Folded | None = None
        for tries in range(_MAX_TRIES + 1):
            conn = await self._connection()
            try:
                if batch.expect:
                    await view.check_ends(conn, batch)
                if (unknown := view.unknown_branches([batch])) and (
                    learn := view.guess_new(unknown)
                ):
                    await view.learn_lsns(conn, learn)
                try:
                    f = view.fold(batch, {})
                except Exception as exc:
                    raise await self._refusal(conn, batch, exc) from None
                if missing := view.unknown_docs([f]):
                    await view.learn_docs(conn, missing)
                view.state_rows(f, {})
                await conn.execute(*self._write(f))
            except asyncpg.PostgresError as exc:
                if exc.sqlstate == DUPLICATE_MESSAGE:
                    raise _duplicate(batch) from exc
                if exc.sqlstate == STALE_FENCE:
                    raise _stale(batch) from exc
                if exc.sqlstate not in _AGAIN or tries == _MAX_TRIES:
                    raise
                if f is not None and exc.sqlstate in _STALE:
                    view.forget(f)  # another writer moved on: learn again
                continue
            except (OSError, asyncpg.InterfaceError, asyncio.CancelledError):
                await self._unknown_outcome()
                raise
            view.committed(f)
            return f.lsns
        raise AssertionError("unreachable")

    async def _deleting(self, batch: CommitBatch) -> list[Lsn]:
        """A batch that deletes branches, as its own transaction on the writer's
        connection; the writer's guesses are dropped after it, since it wrote around them."""
        for tries in range(_MAX_TRIES + 1):
            conn = await self._connection()
            try:
                lsns = await commit_deleting(conn, self._s, self._channel, self._fold, batch)
            except asyncpg.PostgresError as exc:
                if exc.sqlstate not in _AGAIN or tries == _MAX_TRIES:
                    raise
                continue
            except (OSError, asyncpg.InterfaceError, asyncio.CancelledError):
                await self._unknown_outcome()
                raise
            self._view.clear()
            return lsns
        raise AssertionError("unreachable")

    def _write(self, f: Folded) -> tuple[Any, ...]:
        """The statement and arguments that write a batch alone: one statement of its
        shape if it is small, else the general function."""
        b = f.batch
        p = b.position
        outs = _outbox_rows(b) if b.outbox else []
        position = (p.topic, p.partition, p.next_offset) if p is not None else None
        lease = b.fence
        fence = (lease.tenant, lease.stream, lease.fence) if lease is not None else None
        fast = one_batch(b.inbox, f.logs, f.states, position, outs, fence)
        if fast is None:
            general = ([_batch_row(f, len(outs), [], [])], f.logs, f.states, outs)
            if fence is None:
                return (self._commit_sql, *general)
            return (self._fenced_commit_sql, *general, *fence)
        shape, args = fast
        sql = self._statements.get(shape)
        if sql is None:
            if len(self._statements) > 1000:  # bounded: a miss costs one prepare
                self._statements.clear()
            sql = self._statements[shape] = statement(self._s, shape)
        return (sql, *args)

    async def _refusal(
        self, conn: PoolConnectionProxy, batch: CommitBatch, exc: Exception
    ) -> Exception:
        """What a batch whose fold (or documents) failed raises: `DuplicateMessage` if
        its message was handled before — the inbox is checked first, as in SQLite —
        else the fold's own error."""
        if batch.inbox is not None and await conn.fetchval(self._seen_sql, *batch.inbox):
            return _duplicate(batch)
        return exc

    # -- groups -----------------------------------------------------------------

    def _take(self) -> list[_Pending]:
        """The next group, in queue order: up to `_MAX_GROUP` batches, or one that
        must go alone."""
        group: list[_Pending] = []
        while self._queue and len(group) < _MAX_GROUP:
            if self._queue[0].alone:
                if not group:
                    group.append(self._queue.popleft())
                break
            group.append(self._queue.popleft())
        return group

    async def _round(self, group: list[_Pending]) -> None:
        self._retries = []
        try:
            if len(group) == 1 and group[0].alone:  # alone, so that its own error surfaces
                p = group[0]
                try:
                    p.fut.set_result(await self._alone(p.batch))
                except Exception as exc:
                    p.fut.set_exception(exc)
                return
            conn = await self._connection()
            view = self._view
            if (unknown := view.unknown_branches([p.batch for p in group])) and (
                learn := view.guess_new(unknown)
            ):
                await view.learn_lsns(conn, learn)
            folded, refused = self._fold_all(group)
            if missing := view.unknown_docs([f for f, _ in folded]):
                await view.learn_docs(conn, missing)
            group_docs: dict[Doc, bytes | None] = {}
            for f, _ in folded:
                self._view.state_rows(f, group_docs)
                group_docs.update(f.docs)
            seen = [await self._seen(conn, p.batch) for p, _ in refused]
            landed: dict[object, int] = {}  # inbox id -> order of the batch that landed it
            if len(folded) == 1:  # no savepoint needed: the faster statement of its shape
                await self._send_one(conn, *folded[0], landed)
            elif folded:
                await self._send(conn, folded, landed)
            pending = {r.batch.inbox: r.order for r in reversed(self._retries) if r.batch.inbox}
            for (p, error), before in zip(refused, seen, strict=True):
                # The inbox comes first, as in SQLite: a message handled before this one
                # (in an earlier commit, or earlier in this group) is a duplicate; and
                # if an earlier batch of the same message goes again, so does this one.
                if p.batch.inbox and pending.get(p.batch.inbox, p.order) < p.order:
                    self._retries.append(p)
                    continue
                dup = before or landed.get(p.batch.inbox, p.order) < p.order
                p.fut.set_exception(_duplicate(p.batch) if dup else error)
        except BaseException as exc:
            # The connection failed or this task was cancelled: the outcome of what
            # was sent is unknown. Forget the guesses; the next group re-learns them.
            self._retries = []
            await self._unknown_outcome()
            for p in group:
                if not p.fut.done():
                    if isinstance(exc, asyncio.CancelledError):
                        p.fut.cancel()
                    else:
                        p.fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            # Back to the front, in the order they were committed in.
            self._queue.extendleft(reversed(sorted(self._retries, key=lambda p: p.order)))
            self._retries = []

    def _fold_all(
        self, group: list[_Pending]
    ) -> tuple[list[tuple[Folded, _Pending]], list[tuple[_Pending, Exception]]]:
        """Fold every batch in order. A batch whose fold raises is out (refused), and
        the LSNs it would have taken go to the next batch of its branch."""
        out: list[tuple[Folded, _Pending]] = []
        refused: list[tuple[_Pending, Exception]] = []
        group_lsn: dict[Branch, int] = {}
        for p in group:
            try:
                f = self._view.fold(p.batch, group_lsn)
            except Exception as exc:
                refused.append((p, exc))
                continue
            group_lsn.update(f.next_lsn)
            out.append((f, p))
        return out, refused

    async def _seen(self, conn: PoolConnectionProxy, batch: CommitBatch) -> bool:
        if batch.inbox is None:
            return False
        return bool(await conn.fetchval(self._seen_sql, *batch.inbox))

    async def _send_one(
        self, conn: PoolConnectionProxy, f: Folded, p: _Pending, landed: dict[object, int]
    ) -> None:
        try:
            await conn.execute(*self._write(f))
        except asyncpg.PostgresError as exc:
            if exc.sqlstate == DUPLICATE_MESSAGE:
                p.fut.set_exception(_duplicate(p.batch))
            elif exc.sqlstate == STALE_FENCE:
                p.fut.set_exception(_stale(p.batch))
            elif exc.sqlstate in _AGAIN and p.tries < _MAX_TRIES:
                if exc.sqlstate in _STALE:
                    self._view.forget(f)
                p.tries += 1
                p.alone = True
                self._retries.append(p)
            else:
                p.fut.set_exception(exc)
            return
        self._landed(f, p, landed)

    async def _send(
        self,
        conn: PoolConnectionProxy,
        sent: list[tuple[Folded, _Pending]],
        landed: dict[object, int],
    ) -> None:
        batches: list[tuple[Any, ...]] = []
        logs: list[tuple[Any, ...]] = []
        states: list[tuple[Any, ...]] = []
        outs: list[tuple[Any, ...]] = []
        fences: list[tuple[Any, Any, Any]] = []
        guessed_from: dict[object, int] = {}  # the last batch to write a branch or document
        after: dict[object, int] = {}  # the last batch to write the outbox, a position, an inbox
        for i, (f, _) in enumerate(sent, start=1):
            guesses, order = f.guesses, f.order
            deps = sorted({guessed_from[r] for r in guesses if r in guessed_from})
            follows = sorted({after[r] for r in order if r in after})
            guessed_from.update(dict.fromkeys(guesses, i))
            after.update(dict.fromkeys(order, i))
            out = _outbox_rows(f.batch)
            batches.append(_batch_row(f, len(out), deps, follows))
            logs += f.logs
            states += f.states
            outs += out
            lease = f.batch.fence
            fences.append((None, None, None) if lease is None else _fence_row(lease))
        if any(f.batch.fence is not None for f, _ in sent):
            outcomes = await conn.fetchval(
                self._fenced_group_sql, batches, logs, states, outs, fences
            )
        else:
            outcomes = await conn.fetchval(self._commit_sql, batches, logs, states, outs)
        for (f, p), outcome in zip(sent, outcomes, strict=True):
            match outcome:
                case Outcome.COMMITTED:
                    self._landed(f, p, landed)
                case Outcome.DUPLICATE:
                    p.fut.set_exception(_duplicate(p.batch))
                case Outcome.STALE_FENCE:
                    p.fut.set_exception(_stale(p.batch))
                case Outcome.STALE:  # again alone, where tries are counted
                    self._view.forget(f)
                    p.alone = True
                    self._retries.append(p)
                case _:  # FAILED: again alone, so that its own error reaches the caller
                    p.alone = outcome == Outcome.FAILED
                    self._retries.append(p)

    def _landed(self, f: Folded, p: _Pending, landed: dict[object, int]) -> None:
        self._view.committed(f)
        if p.batch.inbox is not None:
            landed.setdefault(p.batch.inbox, p.order)
        p.fut.set_result(f.lsns)

    # -- the connection ---------------------------------------------------------

    async def _connection(self) -> PoolConnectionProxy:
        conn = self._conn
        if conn is not None and alive(conn):
            return conn
        await self._drop_connection()
        self._conn = await self._pool.acquire()
        return self._conn

    async def _unknown_outcome(self) -> None:
        """What was sent may or may not have landed: forget every guess and the
        connection."""
        self._view.clear()
        await self._drop_connection()

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await discard(self._pool, conn)


def _outbox_rows(batch: CommitBatch) -> list[tuple[Any, ...]]:
    return [(e.topic, e.key, e.value, encode_headers(e.headers)) for e in batch.outbox]


def _batch_row(f: Folded, n_out: int, deps: list[int], follows: list[int]) -> tuple[Any, ...]:
    """The `commit_batch` composite of one batch."""
    b = f.batch
    inbox_t, inbox_id = b.inbox if b.inbox is not None else (None, None)
    p = b.position
    pos = (p.topic, p.partition, p.next_offset) if p is not None else (None, None, None)
    return (inbox_t, inbox_id, *pos, len(f.logs), len(f.states), n_out, deps, follows)


def _fence_row(lease: Lease) -> tuple[Any, Any, Any]:
    """The `fence_row` composite of a fenced batch."""
    return (lease.tenant, lease.stream, lease.fence)


def _stale(batch: CommitBatch) -> StaleFence:
    lease = batch.fence
    what = f"stream {lease.stream}: fence {lease.fence}" if lease is not None else "fence"
    return StaleFence(f"{what} is stale; the run was taken over")


def _duplicate(batch: CommitBatch) -> DuplicateMessage:
    mid = batch.inbox[1] if batch.inbox is not None else "?"
    return DuplicateMessage(f"message {mid} was already handled")
