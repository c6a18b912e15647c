"""Waiting that a stop (or a wake) cuts short."""

from __future__ import annotations

import asyncio
import contextlib


async def sleep_or(event: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or until `event` is set, whichever comes first."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
