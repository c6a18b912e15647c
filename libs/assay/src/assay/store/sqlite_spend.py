"""The spend ledger on SQLite (`assay.kernel.spend`): one row per (tenant, purpose, day).

A reservation is one `UPDATE ... WHERE spent + held + amount <= ceiling` in a
`BEGIN IMMEDIATE` transaction: SQLite runs one writer at a time, so reservations on
the file are ordered and none can pass a ceiling that another already filled.
"""

from __future__ import annotations

import sqlite3
from typing import Protocol

from assay.kernel.ids import TenantId
from assay.kernel.spend import Reservation, Spend, SpendDay, SpendLimit

SPEND_SCHEMA = """
CREATE TABLE IF NOT EXISTS spend (
    tenant TEXT NOT NULL, purpose TEXT NOT NULL, day TEXT NOT NULL,
    calls INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0,
    micro_usd INTEGER NOT NULL DEFAULT 0,
    held_calls INTEGER NOT NULL DEFAULT 0, held_tokens INTEGER NOT NULL DEFAULT 0,
    held_micro_usd INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, purpose, day)
) WITHOUT ROWID;
"""

_RESERVE = (
    "UPDATE spend SET held_calls = held_calls + ?, held_tokens = held_tokens + ?,"
    " held_micro_usd = held_micro_usd + ?"
    " WHERE tenant = ? AND purpose = ? AND day = ?"
    " AND (? IS NULL OR calls + held_calls + ? <= ?)"
    " AND (? IS NULL OR tokens + held_tokens + ? <= ?)"
    " AND (? IS NULL OR micro_usd + held_micro_usd + ? <= ?)"
    " RETURNING 1"
)

_SETTLE = (
    "UPDATE spend SET held_calls = max(held_calls - ?, 0), held_tokens = max(held_tokens - ?, 0),"
    " held_micro_usd = max(held_micro_usd - ?, 0),"
    " calls = calls + ?, tokens = tokens + ?, micro_usd = micro_usd + ?"
    " WHERE tenant = ? AND purpose = ? AND day = ?"
)


class _HasDb(Protocol):
    @property
    def _db(self) -> sqlite3.Connection: ...


class SqliteSpendLedger:
    """`EventLog.reserve`, `settle` and `spend_of` for `SqliteEventLog`."""

    async def reserve(
        self: _HasDb, tenant: TenantId, purpose: str, day: str, amount: Spend, limit: SpendLimit
    ) -> Reservation | None:
        """See `EventLog.reserve`."""
        key = (str(tenant), purpose, day)
        bounds: list[int | None] = []
        for used, cap in (
            (amount.calls, limit.calls),
            (amount.tokens, limit.tokens),
            (amount.micro_usd, limit.micro_usd),
        ):
            bounds += [cap, used, cap]
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "INSERT INTO spend (tenant, purpose, day) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                key,
            )
            row = self._db.execute(
                _RESERVE, (amount.calls, amount.tokens, amount.micro_usd, *key, *bounds)
            ).fetchone()
        return None if row is None else Reservation(tenant, purpose, day, amount)

    async def settle(self: _HasDb, reservation: Reservation, actual: Spend) -> None:
        """See `EventLog.settle`."""
        r, held = reservation, reservation.held
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                _SETTLE,
                (
                    held.calls,
                    held.tokens,
                    held.micro_usd,
                    actual.calls,
                    actual.tokens,
                    actual.micro_usd,
                    str(r.tenant),
                    r.purpose,
                    r.day,
                ),
            )

    async def spend_of(self: _HasDb, tenant: TenantId, purpose: str, day: str) -> SpendDay:
        """See `EventLog.spend_of`."""
        row = self._db.execute(
            "SELECT calls, tokens, micro_usd, held_calls, held_tokens, held_micro_usd"
            " FROM spend WHERE tenant = ? AND purpose = ? AND day = ?",
            (str(tenant), purpose, day),
        ).fetchone()
        if row is None:
            return SpendDay()
        return SpendDay(Spend(*row[:3]), Spend(*row[3:]))
