"""Agent work goes first on a shared endpoint (§14.2, §1: grading never stalls the agent).

When the judge and the proposer run on the agent's endpoint and model, their calls
share its capacity with agent steps. `PriorityLimiter` bounds the calls in flight on
one endpoint and hands a freed slot to the waiting call of the highest priority —
agent, then grading, then proposer; first come, first served within one — and keeps
`reserved` slots for agent calls alone, so that a queue of judge calls can hold every
other slot yet never the one an agent step arrives to.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["CallPriority", "PriorityLimiter"]


class CallPriority(enum.IntEnum):
    """Who is calling; a lower value goes first."""

    AGENT = 0
    GRADING = 1
    PROPOSER = 2


class PriorityLimiter:
    """At most `slots` calls in flight, granted by priority; `reserved` of them only to
    agent calls.

    Raises:
        ValueError: `slots` < 1, or `reserved` not in `[0, slots)`.
    """

    def __init__(self, slots: int, reserved: int = 0) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1: {slots}")
        if not 0 <= reserved < slots:
            raise ValueError(f"reserved must be in [0, {slots}): {reserved}")
        self.slots = slots
        self.reserved = reserved
        self.in_flight = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def _room_for(self, priority: CallPriority) -> bool:
        limit = self.slots if priority is CallPriority.AGENT else self.slots - self.reserved
        return self.in_flight < limit

    def _grant(self) -> None:
        """Hand free slots to the waiting calls, highest priority first."""
        while self._waiting:
            priority, _, future = self._waiting[0]
            if future.done():  # given up while waiting
                heapq.heappop(self._waiting)
                continue
            if not self._room_for(CallPriority(priority)):
                return  # nothing behind it may go either: it ranks below
            heapq.heappop(self._waiting)
            self.in_flight += 1
            future.set_result(None)

    @asynccontextmanager
    async def slot(self, priority: CallPriority) -> AsyncIterator[None]:
        """Hold one slot for the duration of the block, waiting for it by priority."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (int(priority), next(self._order), future))
        self._grant()  # at once, when nothing that ranks before it waits and there is room
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():  # granted as it was cancelled
                self.in_flight -= 1
                self._grant()
            future.cancel()
            raise
        try:
            yield
        finally:
            self.in_flight -= 1
            self._grant()
