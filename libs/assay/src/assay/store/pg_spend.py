"""The spend ledger on Postgres (`assay.kernel.spend`): one row per (tenant, purpose, day)
in the stage's own schema.

A reservation is one statement: an insert of the day's row holding the amount if
the amount fits a fresh day, or else, the row being there, an update of it `WHERE
spent + held + amount <= ceiling`. Under READ COMMITTED a concurrent update of the
same row makes the second wait, then re-check its condition against the first's
result, so replicas of the stage that reserve at once are ordered by the row lock
and none passes a ceiling another filled.
"""

from __future__ import annotations

from typing import Protocol

import asyncpg

from assay.kernel.ids import TenantId
from assay.kernel.spend import Reservation, Spend, SpendDay, SpendLimit

SPEND_MIGRATION = """
CREATE TABLE {s}.spend (
    tenant uuid NOT NULL, purpose text NOT NULL, day date NOT NULL,
    calls bigint NOT NULL DEFAULT 0, tokens bigint NOT NULL DEFAULT 0,
    micro_usd bigint NOT NULL DEFAULT 0,
    held_calls bigint NOT NULL DEFAULT 0, held_tokens bigint NOT NULL DEFAULT 0,
    held_micro_usd bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, purpose, day)
);
"""
"""The ledger's table (a migration of the event log's schema)."""


class _HasPool(Protocol):
    _s: str

    @property
    def _db(self) -> asyncpg.Pool: ...


class PgSpendLedger:
    """`EventLog.reserve`, `settle` and `spend_of` for `PostgresEventLog`."""

    async def reserve(
        self: _HasPool, tenant: TenantId, purpose: str, day: str, amount: Spend, limit: SpendLimit
    ) -> Reservation | None:
        """See `EventLog.reserve`."""
        # One statement: a day's first reservation inserts the row holding it (if it
        # fits a fresh day's limit); a later one adds to the row under its lock, if it fits.
        s = self._s
        row = await self._db.fetchval(
            f"INSERT INTO {s}.spend AS d (tenant, purpose, day, held_calls, held_tokens,"
            " held_micro_usd) SELECT $1, $2, $3::text::date, $4, $5, $6"
            " WHERE ($7::bigint IS NULL OR $4 <= $7) AND ($8::bigint IS NULL OR $5 <= $8)"
            " AND ($9::bigint IS NULL OR $6 <= $9)"
            " ON CONFLICT (tenant, purpose, day) DO UPDATE SET"
            " held_calls = d.held_calls + $4, held_tokens = d.held_tokens + $5,"
            " held_micro_usd = d.held_micro_usd + $6"
            " WHERE ($7::bigint IS NULL OR d.calls + d.held_calls + $4 <= $7)"
            " AND ($8::bigint IS NULL OR d.tokens + d.held_tokens + $5 <= $8)"
            " AND ($9::bigint IS NULL OR d.micro_usd + d.held_micro_usd + $6 <= $9)"
            " RETURNING 1",
            tenant,
            purpose,
            day,
            amount.calls,
            amount.tokens,
            amount.micro_usd,
            limit.calls,
            limit.tokens,
            limit.micro_usd,
        )
        return None if row is None else Reservation(tenant, purpose, day, amount)

    async def settle(self: _HasPool, reservation: Reservation, actual: Spend) -> None:
        """See `EventLog.settle`."""
        r, held = reservation, reservation.held
        await self._db.execute(
            f"UPDATE {self._s}.spend SET held_calls = greatest(held_calls - $4, 0),"
            " held_tokens = greatest(held_tokens - $5, 0),"
            " held_micro_usd = greatest(held_micro_usd - $6, 0),"
            " calls = calls + $7, tokens = tokens + $8, micro_usd = micro_usd + $9"
            " WHERE tenant = $1 AND purpose = $2 AND day = $3::text::date",
            r.tenant,
            r.purpose,
            r.day,
            held.calls,
            held.tokens,
            held.micro_usd,
            actual.calls,
            actual.tokens,
            actual.micro_usd,
        )

    async def spend_of(self: _HasPool, tenant: TenantId, purpose: str, day: str) -> SpendDay:
        """See `EventLog.spend_of`."""
        row = await self._db.fetchrow(
            "SELECT calls, tokens, micro_usd, held_calls, held_tokens, held_micro_usd"
            f" FROM {self._s}.spend WHERE tenant = $1 AND purpose = $2 AND day = $3::text::date",
            tenant,
            purpose,
            day,
        )
        if row is None:
            return SpendDay()
        return SpendDay(Spend(*row[:3]), Spend(*row[3:]))
