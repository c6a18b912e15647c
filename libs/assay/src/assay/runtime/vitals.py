"""Liveness and readiness of a stage process (`/healthz`, `/readyz`).

Liveness is the event loop answering. Readiness says the stage does its work: its
consumer has joined its group and every assigned partition either has nothing
waiting or has made progress lately; its store answers (a commit or a probe has
succeeded lately); its relay ships or has nothing to ship. A stage whose store
has not answered for `exit_after_s` gives up and exits non-zero, so that its
supervisor restarts it: a clean crash beats a silent freeze, and the protocol
makes a restart safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from assay.kernel.health import Failing
from assay.kernel.waiting import sleep_or

log = logging.getLogger(__name__)


@dataclass
class Vitals:
    """What a stage knows of its own health; written by its parts, read by `/readyz`."""

    unready_after_s: float
    exit_after_s: float
    """0: never exit on its own."""
    clock: Callable[[], float] = time.monotonic
    store: Failing = field(default_factory=Failing)
    """The store's probe."""
    handling: Failing = field(default_factory=Failing)
    """Handling messages: failing while a service it needs (Postgres, S3) is away."""
    relay: Failing = field(default_factory=Failing)
    """Shipping the outbox (only while this replica leads): the relay's own."""
    gave_up: str | None = None
    """Why the stage decided to exit, once it has."""

    def readiness(
        self, consumer: dict[str, object] | None = None, *, stopping: bool = False
    ) -> dict[str, object]:
        """The `/readyz` document: `ready`, and each check with what it saw."""
        now = self.clock()
        checks: dict[str, object] = {}
        reasons: list[str] = []
        for name, path in self._paths():
            failing = path.failing_for(now)
            checks[name] = {"failing_s": round(failing, 1), "last_error": path.last_error}
            if failing > self.unready_after_s:
                reasons.append(f"{name} failing for {failing:.0f} s: {path.last_error}")
        if consumer is not None:
            checks["consumer"] = consumer
            if not consumer.get("joined"):
                reasons.append("consumer has not joined its group")
            if stalled := consumer.get("stalled"):
                reasons.append(f"partitions with records waiting and no progress: {stalled}")
        if stopping:
            reasons.append("stopping")
        return {"ready": not reasons, "reasons": reasons, "checks": checks}

    def _paths(self) -> tuple[tuple[str, Failing], ...]:
        return (("store", self.store), ("handling", self.handling), ("relay", self.relay))

    async def watch(
        self, probe: Callable[[], Awaitable[None]], stop: asyncio.Event, every_s: float = 2.0
    ) -> None:
        """Probe the store every `every_s`; give up (set `gave_up` and `stop`) once the
        store or the handling of messages has failed for `exit_after_s`."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(probe(), timeout=max(every_s, 5.0))
                self.store.ok()
            except Exception as exc:  # any failure to answer is the store failing
                self.store.failed(f"{type(exc).__name__}: {exc}", self.clock())
            now = self.clock()
            for name, path in self._paths()[:2]:
                failing = path.failing_for(now)
                if self.exit_after_s and failing > self.exit_after_s:
                    self.gave_up = (
                        f"{name} has failed for {failing:.0f} s "
                        f"(ASSAY_EXIT_AFTER_S={self.exit_after_s:g}): {path.last_error}"
                    )
                    log.error("giving up: %s", self.gave_up)
                    stop.set()
                    return
            await sleep_or(stop, every_s)
