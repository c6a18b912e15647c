"""The spend ledger's values (§14.1): amounts, ceilings and reservations.

A stage that spends on a purpose keeps, in its own schema (or SQLite file), one row
per (tenant, purpose, UTC day): what was spent and what is held by reservations in
flight. A caller reserves its worst case before a model call — one conditional
update of that row, admitted only while spent + held + the new reservation stays
within every ceiling — then settles the reservation to what the call really cost
(or releases it when no call was billed). Every partition of the stage, in one
process or many, writes the same row, so concurrent handlers cannot overshoot the
ceiling: the database orders their reservations.

Dollars are kept as whole micro-dollars (`micro_usd`), rounded up, so sums are exact
and a reservation never holds less than its call can cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from assay.kernel.ids import TenantId

MICRO = 1_000_000
"""Micro-dollars per US dollar."""


def micro_usd(usd: float) -> int:
    """`usd` in whole micro-dollars, rounded up (a reservation errs toward holding more).

    Raises:
        ValueError: a negative or non-finite amount.
    """
    if not math.isfinite(usd) or usd < 0:
        raise ValueError(f"a dollar amount must be finite and >= 0: {usd}")
    return math.ceil(round(usd * MICRO, 6))


@dataclass(frozen=True)
class Spend:
    """Model calls, tokens (prompt and completion) and dollars, as one amount."""

    calls: int = 0
    tokens: int = 0
    micro_usd: int = 0

    def __post_init__(self) -> None:
        if min(self.calls, self.tokens, self.micro_usd) < 0:
            raise ValueError(f"a spend is never negative: {self}")

    @classmethod
    def of(cls, calls: int, tokens: int, usd: float) -> Spend:
        """An amount with its dollars given in US dollars."""
        return cls(calls, tokens, micro_usd(usd))

    @property
    def usd(self) -> float:
        """The dollars, in US dollars."""
        return self.micro_usd / MICRO

    def __add__(self, other: Spend) -> Spend:
        return Spend(
            self.calls + other.calls,
            self.tokens + other.tokens,
            self.micro_usd + other.micro_usd,
        )

    def __sub__(self, other: Spend) -> Spend:
        """What was added since `other` (a running total then); never below zero."""
        return Spend(
            max(self.calls - other.calls, 0),
            max(self.tokens - other.tokens, 0),
            max(self.micro_usd - other.micro_usd, 0),
        )

    def __mul__(self, times: int) -> Spend:
        return Spend(self.calls * times, self.tokens * times, self.micro_usd * times)


def worst_case(calls: int, tokens_per_call: int, per_mtok: float) -> Spend:
    """`calls` model calls at their worst: each `tokens_per_call` tokens (prompt and
    answer), every token priced at `per_mtok` US dollars per million — the higher of the
    model's two per-token prices, so no split of the context between prompt and answer
    costs more. What a judge call (the tournament's grading ledger) and a shadow run or
    replay candidate (ingest's replay meter) reserve before they are made.

    Raises:
        ValueError: a negative count or a negative or non-finite price.
    """
    if calls < 0 or tokens_per_call < 0:
        raise ValueError(f"calls and tokens must be >= 0: {calls}, {tokens_per_call}")
    tokens = calls * tokens_per_call
    return Spend(calls, tokens, micro_usd(tokens * per_mtok / 1_000_000))


@dataclass(frozen=True)
class SpendLimit:
    """A ceiling per UTC day in calls, tokens and dollars; None: that unit is unbounded."""

    calls: int | None = None
    tokens: int | None = None
    micro_usd: int | None = None

    @property
    def usd(self) -> float | None:
        """The dollar ceiling in US dollars (None: unbounded)."""
        return None if self.micro_usd is None else self.micro_usd / MICRO

    @property
    def bounded(self) -> bool:
        """Whether any unit has a ceiling."""
        return (self.calls, self.tokens, self.micro_usd) != (None, None, None)

    def admits(self, total: Spend) -> bool:
        """Whether `total` is within every ceiling."""
        return all(
            cap is None or used <= cap
            for used, cap in (
                (total.calls, self.calls),
                (total.tokens, self.tokens),
                (total.micro_usd, self.micro_usd),
            )
        )

    def describe(self) -> str:
        """The ceiling in words, for a refusal."""
        parts = [
            f"{self.calls} calls" if self.calls is not None else "",
            f"{self.tokens} tokens" if self.tokens is not None else "",
            f"${self.micro_usd / MICRO:.6f}" if self.micro_usd is not None else "",
        ]
        return ", ".join(p for p in parts if p) or "no ceiling"


@dataclass(frozen=True)
class Reservation:
    """An amount held against a tenant's ceiling for one purpose and day, until settled."""

    tenant: TenantId
    purpose: str
    day: str
    held: Spend


@dataclass(frozen=True)
class SpendDay:
    """A tenant's ledger row for one purpose and day: settled spend, and what is held."""

    spent: Spend = Spend()
    held: Spend = Spend()

    @property
    def committed(self) -> Spend:
        """Spent plus held: what the ceiling is checked against."""
        return self.spent + self.held
