"""Pooled Postgres connections that the server may end at any moment.

When the server ends a connection (a restart, a failover, `pg_terminate_backend`,
a proxy's idle timeout), asyncpg returns it to its pool at once and detaches the
handle its holder still has: every call on that handle, `is_closed()` and
`terminate()` included, then raises `InterfaceError` ("released back to the
pool"). Whoever holds a connection across awaits asks `alive` before using it
and gives a doubtful one back with `discard`, which never raises.
"""

from __future__ import annotations

import contextlib

import asyncpg
from asyncpg.pool import PoolConnectionProxy


def alive(conn: PoolConnectionProxy) -> bool:
    """Whether a held pool connection can still be used."""
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:  # the server ended it and the pool took it back
        return False


async def discard(pool: asyncpg.Pool, conn: PoolConnectionProxy) -> None:
    """Close a held connection whose state is unknown and give it back to the pool.

    Never raises: a connection already taken back by the pool is left to it.
    """
    with contextlib.suppress(asyncpg.InterfaceError):
        conn.terminate()
    with contextlib.suppress(asyncpg.InterfaceError):
        await pool.release(conn)
