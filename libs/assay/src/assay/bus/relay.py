"""The outbox relay (§9.3): ships committed rows in order, marks them shipped.

One relay leads per stage (a `Leadership`: a file lock in embedded mode, a
Postgres advisory lock in distributed mode). It is woken after commits that
enqueue rows, with a short poll as the fallback. A transport outage stalls only
the relay: rows stay in the outbox until they ship.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Protocol

from assay.bus.transport import Transport
from assay.crash import crash_point
from assay.kernel.health import Failing
from assay.kernel.waiting import sleep_or
from assay.store.ports import EventLog

log = logging.getLogger(__name__)


class FileLock:
    """An exclusive, non-blocking advisory lock on a file (released when the process dies)."""

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock if free; True if this process now holds it."""
        if self._fd is not None:
            return True
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        """Let go of the lock."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class Leadership(Protocol):
    """The right to ship one stage's outbox: at most one holder at a time (§9.3)."""

    async def try_acquire(self) -> bool:
        """Take leadership if free, never waiting; True if this holder now has it."""
        ...

    async def release(self) -> None:
        """Give leadership up (harmless when not held)."""
        ...


class FileLeadership:
    """`Leadership` over a `FileLock`: one leader per stage among local processes."""

    def __init__(self, lock: FileLock) -> None:
        self.lock = lock

    async def try_acquire(self) -> bool:
        """See `Leadership.try_acquire`."""
        return self.lock.try_acquire()

    async def release(self) -> None:
        """See `Leadership.release`."""
        self.lock.release()


class OutboxRelay:
    """Moves one stage's outbox onto the transport.

    `lock` decides who leads: any `Leadership`, or a `FileLock` (used as one).
    """

    def __init__(
        self,
        stage: str,
        log_: EventLog,
        transport: Transport,
        lock: Leadership | FileLock,
        batch: int = 500,
        poll_s: float = 0.1,
    ) -> None:
        self.stage = stage
        self._log = log_
        self._transport = transport
        self._lock: Leadership = FileLeadership(lock) if isinstance(lock, FileLock) else lock
        self._batch = batch
        self._poll_s = poll_s
        self.wake = asyncio.Event()
        self.shipped = 0
        self.health = Failing()
        """Publishing: failing while the transport refuses what this leader ships."""
        self._after_drain = f"{stage}.relay.after_drain"
        self._after_publish = f"{stage}.relay.after_publish"
        self._after_ack = f"{stage}.relay.after_ack"

    async def ship_once(self) -> int:
        """Ship one batch; return how many rows shipped (0 when the outbox is empty).

        Crash points: `<stage>.relay.after_drain` (read, not published),
        `<stage>.relay.after_publish` (published, not acknowledged) and
        `<stage>.relay.after_ack`.
        """
        rows = await self._log.drain_outbox(self._batch)
        if not rows:
            return 0
        crash_point(self._after_drain)
        await self._transport.publish([r.entry for r in rows])
        crash_point(self._after_publish)
        await self._log.ack_outbox([r.seq for r in rows])
        crash_point(self._after_ack)
        self.shipped += len(rows)
        return len(rows)

    async def run(self, stop: asyncio.Event) -> None:
        """Lead when the lock is free; ship until `stop` is set, then drain what is left.

        Leadership is confirmed before every batch: a relay that lost it (say its
        lock's connection timed out while its process was stopped) stops shipping and
        waits to lead again. A batch it had in flight may then ship twice; each row
        keeps its message id, so the consumers' inboxes drop the repeat.
        """
        while True:
            while not await self._leading():
                self.health.ok()  # a replica that does not lead has nothing to ship
                if stop.is_set():
                    return  # never led: the leader ships what is committed
                await sleep_or(stop, 1.0)
            try:
                if await self._lead(stop):
                    return
            finally:
                await self._lock.release()

    async def _lead(self, stop: asyncio.Event) -> bool:
        """Ship while leading; True once stopped and drained, False if leadership was lost."""
        backoff = self._poll_s
        while not stop.is_set():
            if not await self._leading():
                log.warning("relay %s: leadership lost; shipping stops", self.stage)
                return False
            # Cleared before the outbox is read, never after: a commit that wakes the
            # relay while a read is in flight (its rows not yet visible to it) must not
            # wait for the poll. So a read that found less than a batch emptied the
            # outbox of every row not announced since: no second read to be sure.
            self.wake.clear()
            try:
                shipped = await self.ship_once()
                self.health.ok()
                if shipped:
                    backoff = self._poll_s
                if shipped >= self._batch:
                    continue
            except Exception as exc:  # the transport is down: keep the rows, retry later
                self.health.failed(f"{type(exc).__name__}: {exc}", time.monotonic())
                log.warning("relay %s: shipping failed (%r); retrying", self.stage, exc)
                await sleep_or(stop, backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            await sleep_or(self.wake, self._poll_s)
        try:
            while await self.ship_once():
                pass
        except Exception:  # the transport is down at shutdown: rows wait for the next start
            log.warning("relay %s: stopping with rows still in the outbox", self.stage)
        return True

    async def _leading(self) -> bool:
        """Whether this relay leads (taking the lock if free); False when that is unknown."""
        try:
            return await self._lock.try_acquire()
        except Exception as exc:  # the lock's server is unreachable: not leading, try later
            log.warning("relay %s: leadership unknown (%r)", self.stage, exc)
            return False
