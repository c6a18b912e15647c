"""Relay coordination on Postgres (§9.3): one leader per stage, woken by NOTIFY.

`PgAdvisoryLeader` is the distributed counterpart of the embedded `FileLock`: a
session-level advisory lock, keyed by the stage's schema, held on a connection
of its own — so it is released when the holder releases it, closes, or dies;
and, when a silence limit is set, when the holder stalls (SIGSTOP, a frozen VM):
the replica waiting for the lock ends the silent holder's connection.
`listen_for_outbox` sets the relay's wake event whenever a commit that added
outbox rows notifies `<schema>_outbox`; polling stays the fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import asyncpg

from assay.store.pg_schema import checked_schema, lock_key, outbox_channel

log = logging.getLogger(__name__)


class PgAdvisoryLeader:
    """Relay leadership for one schema: `try_acquire` / `release`, never blocking.

    Satisfies `assay.bus.relay.Leadership`. If the lock's connection is lost the
    lock is gone with it (the server frees it) and `held` turns false.
    """

    def __init__(self, dsn: str, schema: str, *, stalled_after_s: float | None = None) -> None:
        """Describe the lock; nothing connects until `try_acquire`.

        Args:
            stalled_after_s: when set, a holder whose lock connection has been idle
                this long is taken to have stalled: an instance that finds the lock
                taken ends that connection (the server then frees the lock) and takes
                it. A live holder stays heard by calling `try_acquire` more often than
                this: while held, it pings its connection every third of it. Both
                instances must log in as one role (a stage's replicas do), or the
                caller must be allowed to signal the holder's backend.

        Raises:
            ValueError: `schema` is not a plain lower-case identifier.
        """
        self._dsn = dsn
        self._schema = checked_schema(schema)
        self._key = lock_key("relay", schema)
        self._stalled_after_s = stalled_after_s
        self._conn: asyncpg.Connection | None = None
        self._held = False
        self._pinged = 0.0

    @property
    def held(self) -> bool:
        """Whether this instance holds the lock on a live connection."""
        return self._held and self._conn is not None and not self._conn.is_closed()

    async def try_acquire(self) -> bool:
        """Take the lock if free (or held by a stalled holder); True if this instance holds it.

        Raises:
            OSError, asyncpg.PostgresError: the server cannot be reached.
        """
        if self.held:
            await self._ping()
            return self.held
        if self._conn is None or self._conn.is_closed():
            self._held = False
            self._conn = await asyncpg.connect(
                self._dsn, server_settings={"application_name": f"assay:{self._schema}:relay"}
            )
            self._conn.add_termination_listener(self._lost)
        conn = self._conn
        self._held = bool(await conn.fetchval("SELECT pg_try_advisory_lock($1)", self._key))
        if not self._held and self._stalled_after_s is not None:
            evicted = await conn.fetch(_EVICT_STALLED, self._key, self._stalled_after_s)
            if any(row[0] for row in evicted):
                log.warning("relay leadership on %s: ended a holder silent too long", self._schema)
                for _ in range(40):  # its backend frees the lock as it exits
                    await asyncio.sleep(0.05)
                    if await conn.fetchval("SELECT pg_try_advisory_lock($1)", self._key):
                        self._held = True
                        break
        self._pinged = time.monotonic()
        return self._held

    async def _ping(self) -> None:
        """Show the server this holder is alive, every third of the silence limit."""
        if self._stalled_after_s is None or self._conn is None:
            return
        if time.monotonic() - self._pinged < self._stalled_after_s / 3:
            return
        try:
            await self._conn.fetchval("SELECT 1")
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            self._lost(self._conn)  # ended as stalled, or the server went away
            self._conn.terminate()
            return
        self._pinged = time.monotonic()

    async def release(self) -> None:
        """Let go of the lock and its connection (harmless when not held)."""
        conn, self._conn = self._conn, None
        held, self._held = self._held, False
        if conn is None or conn.is_closed():
            return
        try:
            if held:
                await conn.fetchval("SELECT pg_advisory_unlock($1)", self._key)
            await asyncio.wait_for(conn.close(), 5)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
            conn.terminate()  # the server frees the lock with the connection

    def _lost(self, _conn: object) -> None:
        if self._held:
            log.warning("relay leadership on %s lost with its connection", self._schema)
        self._held = False


_EVICT_STALLED = """
SELECT pg_terminate_backend(a.pid)
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::bigint << 32) | l.objid::bigint) = $1
  AND a.state = 'idle' AND a.state_change < clock_timestamp() - make_interval(secs => $2)
"""
"""End the connections holding the advisory lock `$1` (a bigint: its high and low halves
are `classid` and `objid`) that have been idle for more than `$2` seconds."""


class OutboxListener:
    """A LISTEN on `<schema>_outbox` that sets an `asyncio.Event` on every notification.

    If the server ends the connection, the listener reconnects in the background with
    backoff, LISTENs again and sets the event once (commits made meanwhile notified no
    one); until then the relay's poll is the fallback.
    """

    def __init__(self, dsn: str, schema: str, wake: asyncio.Event) -> None:
        self._dsn = dsn
        self._schema = checked_schema(schema)
        self._channel = outbox_channel(schema)
        self._wake = wake
        self._conn: asyncpg.Connection | None = None
        self._again: asyncio.Task[None] | None = None
        self._closed = False
        self.notified = 0
        self.reconnects = 0

    @property
    def listening(self) -> bool:
        """Whether a LISTEN is in place now."""
        return self._conn is not None and not self._conn.is_closed()

    async def open(self) -> OutboxListener:
        """Connect and listen.

        Raises:
            OSError, asyncpg.PostgresError: the server cannot be reached.
        """
        conn = await asyncpg.connect(
            self._dsn, server_settings={"application_name": f"assay:{self._schema}:listen"}
        )
        try:
            await conn.add_listener(self._channel, self._notified)
        except BaseException:
            conn.terminate()
            raise
        conn.add_termination_listener(self._lost)
        self._conn = conn
        return self

    def _notified(self, _conn: object, _pid: int, _channel: str, _payload: object) -> None:
        self.notified += 1
        self._wake.set()

    def _lost(self, _conn: object) -> None:
        if self._closed or (self._again is not None and not self._again.done()):
            return
        log.warning("outbox listener on %s lost its connection; reconnecting", self._schema)
        self._again = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        backoff = 0.1
        while not self._closed:
            try:
                await self.open()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.info("outbox listener on %s: %r; trying again", self._schema, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            self.reconnects += 1
            self._wake.set()  # commits made while nobody listened notified no one
            return

    async def close(self) -> None:
        """Stop listening and close the connection."""
        self._closed = True
        if self._again is not None:
            self._again.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._again
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            try:
                await asyncio.wait_for(conn.close(), 5)
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                conn.terminate()


async def listen_for_outbox(dsn: str, schema: str, wake: asyncio.Event) -> OutboxListener:
    """Set `wake` whenever a commit to `schema` adds outbox rows; close the result to stop."""
    return await OutboxListener(dsn, schema, wake).open()
