"""Grading spend reserved before each judge call (§14.1), in the tournament's own ledger.

Grading is spent by this stage only, so the ledger rows of purpose `grading` live in
this stage's schema (or SQLite file): the partitions of this stage — one process or
several replicas — are the concurrency the ceiling must hold against, and they share
the row. No other stage reads or writes it. (Calibration, also this stage's, keeps
its own call budget: `assay_tournament.calibration`.)

A `Purse` is one handler's view: each judge call reserves its worst case (the
judge's largest context at the higher of its two per-token prices) before it is
made, and settles to what the endpoint billed after; a call that does not fit is
not made (`GradingCeilingReached`). A caller that knows how many calls it will make
(a tournament group, a run's attempt tournaments) reserves them as one block first:
a group plays fewer rounds when the whole does not fit (`rounds`), attempts are
ranked whole or not at all (`block`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from assay.engine.models import Prices
from assay.grading.attempts import ranking_groups
from assay.grading.judges import Judge, JudgeFailed, JudgeUsage, UsageCallback
from assay.grading.swiss import rounds_for
from assay.kernel.ids import TenantId
from assay.kernel.scores import CoreViolation, Verdict
from assay.kernel.spend import Reservation, Spend, SpendLimit, worst_case
from assay.messages import Episode, Purpose
from assay.store import EventLog
from assay.workflow import RubricItem

GRADING = Purpose.GRADING.value
"""The ledger purpose of judge calls that grade runs."""


class GradingCeilingReached(JudgeFailed):
    """The tenant's grading ceiling for the day has no room for the call: it was not made."""


def attempt_calls(episode: Episode) -> int:
    """The judge calls ranking `episode`'s same-outcome attempts takes: a Swiss tournament
    judged in both orders per group."""
    return sum(2 * rounds_for(len(g)) * (len(g) // 2) for *_, g in ranking_groups(episode))


def worst_call(judge: Judge) -> Spend:
    """One judge call at its worst: the judge's largest context, every token priced at
    the higher of its prompt and completion prices (free without declared prices)."""
    prices = getattr(judge, "prices", None)
    per_mtok = prices.worst_per_mtok if isinstance(prices, Prices) else 0.0
    return worst_case(1, judge.max_context_tokens, per_mtok)


@dataclass
class Purse:
    """A tenant's grading ledger row for one day, as one handler spends from it."""

    log: EventLog
    tenant: TenantId
    day: str
    limit: SpendLimit
    per_call: Spend
    billed: Spend = field(default_factory=Spend)
    """What the endpoint billed for this handler's calls so far."""
    _block: Reservation | None = None
    _block_left: int = 0
    _block_spent: Spend = field(default_factory=Spend)

    async def reserve(self, calls: int) -> Reservation | None:
        """Hold `calls` worst-case calls; None when they do not fit."""
        return await self.log.reserve(
            self.tenant, GRADING, self.day, self.per_call * calls, self.limit
        )

    def seen(self, usage: JudgeUsage) -> None:
        """A call the endpoint billed."""
        self.billed += Spend.of(1, usage.prompt_tokens + usage.completion_tokens, usage.cost_usd)

    @asynccontextmanager
    async def rounds(self, planned: int, calls_per_round: int) -> AsyncIterator[int]:
        """Reserve the most of `planned` rounds of `calls_per_round` calls that fit, as one
        block (0: not even one round fits, nothing held). The calls made inside draw
        from the block, which is settled to what they cost at the end."""
        for rounds in range(planned, 0, -1):
            held = await self.reserve(rounds * calls_per_round)
            if held is not None:
                break
        else:
            yield 0
            return
        async with self._drawn(held, rounds * calls_per_round):
            yield rounds

    @asynccontextmanager
    async def block(self, calls: int) -> AsyncIterator[bool]:
        """Reserve `calls` calls as one block (False: they do not fit, nothing held)."""
        held = await self.reserve(calls)
        if held is None:
            yield False
            return
        async with self._drawn(held, calls):
            yield True

    @asynccontextmanager
    async def _drawn(self, held: Reservation, calls: int) -> AsyncIterator[None]:
        """`held` is the open block for `calls` calls, settled to their cost at the end."""
        self._block, self._block_left, self._block_spent = held, calls, Spend()
        try:
            yield
        finally:
            self._block, self._block_left = None, 0
            await self.log.settle(held, self._block_spent)

    @asynccontextmanager
    async def call(self) -> AsyncIterator[None]:
        """One judge call: drawn from the open block, else reserved on its own.

        Raises:
            GradingCeilingReached: the call does not fit under the tenant's ceiling.
        """
        before = self.billed
        if self._block is not None and self._block_left > 0:
            self._block_left -= 1
            try:
                yield
            finally:
                self._block_spent += self.billed - before
            return
        held = await self.reserve(1)
        if held is None:
            raise GradingCeilingReached(
                f"the tenant's grading ceiling for {self.day} ({self.limit.describe()}) "
                "has no room for another judge call"
            )
        try:
            yield
        finally:
            await self.log.settle(held, self.billed - before)


class PursedJudge:
    """`judge`, each call reserved from `purse` before it is made and settled after."""

    def __init__(self, judge: Judge, purse: Purse) -> None:
        self.judge, self.purse = judge, purse
        self.name = judge.name
        self.max_context_tokens = judge.max_context_tokens

    def _billing(self, on_usage: UsageCallback | None) -> UsageCallback:
        def billed(usage: JudgeUsage) -> None:
            self.purse.seen(usage)
            if on_usage is not None:
                on_usage(usage)

        return billed

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        """See `Judge.compare`; `GradingCeilingReached` when the call does not fit."""
        async with self.purse.call():
            return await self.judge.compare(a, b, rubric, on_usage=self._billing(on_usage))

    async def screen(
        self,
        episode: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> list[CoreViolation]:
        """See `Judge.screen`; `GradingCeilingReached` when the call does not fit."""
        async with self.purse.call():
            return await self.judge.screen(episode, rubric, on_usage=self._billing(on_usage))
