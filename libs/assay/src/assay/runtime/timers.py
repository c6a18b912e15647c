"""Timers: a stage's background task that sends a message when a document falls due.

Execute's await deadlines, the tournament's group timeouts and ingest's rollout
deadlines are all the same loop: every tick, scan the stage's documents of one
kind; for each one due now, commit the message it calls for to the outbox, as an
outside producer would, so the stage receives it on its own partition like any
other input. Each is sent once per process; a message id derived from the
`idem` makes a repeat from another process a duplicate every inbox drops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from assay.bus.topics import producer_entry
from assay.kernel.ids import TenantId
from assay.kernel.schema import Versioned
from assay.kernel.waiting import sleep_or
from assay.runtime.stage import Background
from assay.store.ports import CommitBatch, EventLog

TIMER_TICK_S = 1.0

Fired = tuple[str, Versioned, str]
"""What a due document sends: the topic, the message, and its producer idempotency key."""

DueCheck = Callable[[TenantId, str, dict[str, Any], float], Fired | None]
"""Given a document (tenant, key, value) and now in milliseconds: what it sends, or None."""


def timer(
    kind: str, due: DueCheck, clock: Callable[[], float], tick_s: float = TIMER_TICK_S
) -> Background:
    """A background task sending what `due` says for each document of `kind`, once each.

    `clock` returns seconds since the epoch (the stage's own clock, for tests).
    """

    async def run(log: EventLog, stop: asyncio.Event) -> None:
        sent: set[tuple[TenantId, str]] = set()
        while not stop.is_set():
            now_ms = clock() * 1000
            for tenant, key, doc in await log.scan_kind(kind):
                fired = due(tenant, key, doc, now_ms)
                if fired is None:
                    continue
                topic, msg, idem = fired
                if (tenant, idem) in sent:
                    continue
                await log.commit(CommitBatch(outbox=[producer_entry(topic, msg, tenant, idem)]))
                sent.add((tenant, idem))
            await sleep_or(stop, tick_s)

    return run
