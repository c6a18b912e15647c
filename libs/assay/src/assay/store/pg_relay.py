"""Relay coordination on Postgres (§9.3): one leader per stage, woken by NOTIFY.

`PgAdvisoryLeader` is the distributed counterpart of the embedded `FileLock`: a
session-level advisory lock, keyed by the stage's schema, held on a connection
of its own — so it is released when the holder releases it, closes, or dies.
`listen_for_outbox` sets the relay's wake event whenever a commit that added
outbox rows notifies `<schema>_outbox`; polling stays the fallback.
"""

from __future__ import annotations

import asyncio
import logging

import asyncpg

from assay.store.pg_schema import checked_schema, lock_key, outbox_channel

log = logging.getLogger(__name__)


class PgAdvisoryLeader:
    """Relay leadership for one schema: `try_acquire` / `release`, never blocking.

    Satisfies `assay.bus.relay.Leadership`. If the lock's connection is lost the
    lock is gone with it (the server frees it) and `held` turns false.
    """

    def __init__(self, dsn: str, schema: str) -> None:
        """Describe the lock; nothing connects until `try_acquire`.

        Raises:
            ValueError: `schema` is not a plain lower-case identifier.
        """
        self._dsn = dsn
        self._schema = checked_schema(schema)
        self._key = lock_key("relay", schema)
        self._conn: asyncpg.Connection | None = None
        self._held = False

    @property
    def held(self) -> bool:
        """Whether this instance holds the lock on a live connection."""
        return self._held and self._conn is not None and not self._conn.is_closed()

    async def try_acquire(self) -> bool:
        """Take the lock if free; True if this instance now holds it.

        Raises:
            OSError, asyncpg.PostgresError: the server cannot be reached.
        """
        if self.held:
            return True
        if self._conn is None or self._conn.is_closed():
            self._held = False
            self._conn = await asyncpg.connect(
                self._dsn, server_settings={"application_name": f"assay:{self._schema}:relay"}
            )
            self._conn.add_termination_listener(self._lost)
        self._held = bool(await self._conn.fetchval("SELECT pg_try_advisory_lock($1)", self._key))
        return self._held

    async def release(self) -> None:
        """Let go of the lock and its connection (harmless when not held)."""
        conn, self._conn = self._conn, None
        held, self._held = self._held, False
        if conn is None or conn.is_closed():
            return
        try:
            if held:
                await conn.fetchval("SELECT pg_advisory_unlock($1)", self._key)
        finally:
            await conn.close()

    def _lost(self, _conn: object) -> None:
        if self._held:
            log.warning("relay leadership on %s lost with its connection", self._schema)
        self._held = False


class OutboxListener:
    """A LISTEN on `<schema>_outbox` that sets an `asyncio.Event` on every notification."""

    def __init__(self, dsn: str, schema: str, wake: asyncio.Event) -> None:
        self._dsn = dsn
        self._schema = checked_schema(schema)
        self._channel = outbox_channel(schema)
        self._wake = wake
        self._conn: asyncpg.Connection | None = None
        self.notified = 0

    async def open(self) -> OutboxListener:
        """Connect and listen.

        Raises:
            OSError, asyncpg.PostgresError: the server cannot be reached.
        """
        self._conn = await asyncpg.connect(
            self._dsn, server_settings={"application_name": f"assay:{self._schema}:listen"}
        )
        await self._conn.add_listener(self._channel, self._notified)
        return self

    def _notified(self, _conn: object, _pid: int, _channel: str, _payload: object) -> None:
        self.notified += 1
        self._wake.set()

    async def close(self) -> None:
        """Stop listening and close the connection."""
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            await conn.close()


async def listen_for_outbox(dsn: str, schema: str, wake: asyncio.Event) -> OutboxListener:
    """Set `wake` whenever a commit to `schema` adds outbox rows; close the result to stop."""
    return await OutboxListener(dsn, schema, wake).open()
