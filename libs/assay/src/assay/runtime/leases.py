"""Working on a run under a lease (§9.4): claim, heartbeat, fence every write.

A worker claims a run's lease before driving it; a heartbeat renews it every
third of its TTL; every commit carries the lease, so the store refuses a write
whose fence was overtaken (`StaleFence`). When a renewal finds the lease taken
over, the work is cancelled at its next await point and `LeaseLost` is raised:
the run now belongs to another worker, which recovers it from the log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from assay.kernel.ids import TenantId
from assay.store.ports import EventLog, Lease, LeaseLost

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_LEASE_TTL_S = 15.0


def new_worker_id() -> str:
    """A worker identity unique to this process incarnation (host, pid, nonce)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


async def acquire(
    store: EventLog, tenant: TenantId, stream: str, worker: str, ttl_s: float
) -> Lease:
    """Claim the stream's lease, waiting while another live worker holds it."""
    ttl_ms = int(ttl_s * 1000)
    waited = False
    while True:
        lease = await store.claim(tenant, stream, worker, ttl_ms)
        if lease is not None:
            if waited:
                log.info("took over %s with fence %d", stream, lease.fence)
            return lease
        waited = True
        await asyncio.sleep(min(ttl_s / 4, 1.0))


async def under_lease(
    store: EventLog,
    lease: Lease,
    ttl_s: float,
    work: Awaitable[T],
    watch: Callable[[], Awaitable[None]] | None = None,
) -> T:
    """Run `work` while renewing `lease`; raise `LeaseLost` if it is taken over.

    `watch`, when given, runs at every heartbeat (for instance: has someone asked
    another worker to cancel this run?).
    """
    task: asyncio.Task[T] = asyncio.ensure_future(work)
    lost: list[LeaseLost] = []

    async def heartbeat() -> None:
        held = lease
        while True:
            await asyncio.sleep(ttl_s / 3)
            try:
                held = await store.renew(held, int(ttl_s * 1000))
                if watch is not None:
                    await watch()
            except LeaseLost as exc:
                lost.append(exc)
                task.cancel()
                return
            except Exception:  # the store is unreachable: keep trying; the fence guards
                log.warning("renewing the lease on %s failed", lease.stream, exc_info=True)

    beat = asyncio.create_task(heartbeat(), name=f"lease-{lease.stream}")
    try:
        return await task
    except asyncio.CancelledError:
        if lost:
            raise lost[0] from None
        raise
    finally:
        beat.cancel()
        task.cancel()
