"""Embedded mode: every installed stage in one process, on SQLite, over the embedded bus.

One SQLite file per stage plus one for the bus, and content-addressed blobs,
all under one data directory that only one process may hold at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from assay.bus.embedded import DeadLetterWatch, EmbeddedBus, EmbeddedSource
from assay.bus.relay import FileLock, OutboxRelay
from assay.bus.topics import TENANTS, dlq, producer_entry
from assay.engine.models import Model
from assay.grading.judges import Judge
from assay.grading.ladder import LadderPolicy
from assay.grading.sprt import SprtPolicy
from assay.kernel.canonical import content_hash
from assay.kernel.errors import AssayError, Refused
from assay.kernel.ids import TenantId
from assay.kernel.schema import Versioned
from assay.kernel.waiting import sleep_or
from assay.messages.envelope import open_envelope
from assay.record.erasure import ERASED_KIND
from assay.runtime.bootstrap import stage_deps
from assay.runtime.consumer import ERASED_REFRESH_S, StageRunner
from assay.runtime.retention import StageRetention, truncate_bus
from assay.runtime.sections import PIPELINE_STAGES
from assay.runtime.settings import AssaySettings
from assay.runtime.signals import Signals
from assay.runtime.stage import StageDeps, StageFactory, StageSpec
from assay.store.fs_blobs import FsBlobStore
from assay.store.ports import EventLog, OutboxEntry
from assay.store.sqlite import SqliteEventLog

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from assay.runtime.http import StatusServer

log = logging.getLogger(__name__)
T = TypeVar("T")

STAGES = PIPELINE_STAGES
"""The pipeline's stages, in pipeline order (what `Embedded` runs unless told otherwise;
the console is added where it is served)."""
LATE_GRACE_S = 30.0
"""How long a deleted tenant's message published after its deletion stays on the embedded
bus: the stage reading it refuses it, and its sender can read the dead letter, with the
reason (`Embedded.command`); a later pass deletes both."""


class DataDirBusy(AssayError):
    """Another process holds the data directory."""


class StageMissing(AssayError):
    """A stage is not installed (its `assay-<stage>` distribution is missing)."""


def default_data_dir() -> Path:
    """`ASSAY_DATA_DIR`, or `./assay-data`.

    Raises:
        SettingsInvalid: a setting is invalid.
    """
    return AssaySettings.from_env().data_dir


def discover_stages() -> dict[str, StageFactory]:
    """Stage factories registered under the `assay.stages` entry-point group.

    A stage's module is imported when its factory is first called, not here: `assay
    serve verify` does not import the five other stages (nor what they import).
    """
    return {ep.name: _on_first_call(ep) for ep in entry_points(group="assay.stages")}


def _on_first_call(entry: EntryPoint) -> StageFactory:
    """The factory `entry` names, imported when first called."""

    def factory(deps: StageDeps) -> StageSpec:
        loaded: StageFactory = entry.load()
        return loaded(deps)

    return factory


def stage_log(data_dir: Path, spec: StageSpec) -> SqliteEventLog:
    """The SQLite event log of one stage in a data directory."""
    return SqliteEventLog(
        data_dir / f"{spec.name}.sqlite", spec.events, spec.fold, tables=spec.tables
    )


def wall_clock() -> datetime:
    """The current UTC time: when a message produced now occurred."""
    return datetime.now(UTC)


class Embedded:
    """The whole pipeline in one process. Use as an async context manager.

    `settings` default to `AssaySettings.from_env()`; `model`, `judge`, `sprt`,
    `shadow_rate` and `ladder` override them.

    `clock` stamps what `publish` produces (the envelope's `occurred_at`, which
    every message it causes inherits and from which ingest derives run ids); a
    fixed or stepping clock makes two runs of one workload produce the same ids.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        partitions: int = 12,
        control_partitions: int | None = None,
        model: Model | None = None,
        judge: Judge | None = None,
        sprt: SprtPolicy | None = None,
        shadow_rate: float | None = None,
        ladder: LadderPolicy | None = None,
        stages: tuple[str, ...] = STAGES,
        clock: Callable[[], datetime] = wall_clock,
        settings: AssaySettings | None = None,
    ) -> None:
        self.clock = clock
        settings = AssaySettings.from_env() if settings is None else settings
        self.data_dir = Path(data_dir) if data_dir is not None else settings.data_dir
        self.partitions = partitions
        """Partitions of the topics with a record or more per run (`assay.results` among
        them); the control topics have `settings.control_partitions` unless given."""
        if control_partitions is None:
            control_partitions = settings.control_partitions
        self.bus = EmbeddedBus(self.data_dir / "bus.sqlite", partitions, control_partitions)
        self.blobs = FsBlobStore(self.data_dir / "blobs")
        # A model or judge passed in belongs to the caller; what the bootstrap builds from
        # the settings is ours to close.
        self._wiring = stage_deps(
            settings,
            self.blobs,
            data_dir=self.data_dir,
            model=model,
            judge=judge,
            sprt=sprt,
            shadow_rate=shadow_rate,
            ladder=ladder,
        )
        self.deps = self._wiring.deps
        self._stage_names = stages
        self._lock = FileLock(self.data_dir / "assay.lock")
        self.runners: dict[str, StageRunner] = {}
        self.signals = Signals()
        """The §15 signals every stage of this process counts into (one `/metrics`)."""
        self.logs: dict[str, SqliteEventLog] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Future[Any] | None = None

    async def __aenter__(self) -> Embedded:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self._lock.try_acquire():
            raise DataDirBusy(f"{self.data_dir} is in use by another Assay process")
        factories = discover_stages()
        missing = [s for s in self._stage_names if s not in factories]
        if missing:
            self._lock.release()
            await self._close_owned()
            raise StageMissing(
                f"stages not installed: {', '.join(missing)} (install assay-{missing[0]})"
            )
        await self.bus.open()
        for name in self._stage_names:
            spec = factories[name](self.deps)
            log = await stage_log(self.data_dir, spec).open()
            relay = OutboxRelay(name, log, self.bus, FileLock(self.data_dir / f"{name}.relay.lock"))
            self.logs[name] = log
            source = EmbeddedSource(self.bus)
            retention = StageRetention(name, spec.fold, self.deps.retention)
            self.runners[name] = StageRunner(
                spec, log, self.blobs, relay, source, signals=self.signals, retention=retention
            )
        return self

    async def serve_status(self, port: int, host: str = "127.0.0.1") -> StatusServer:
        """Serve `/healthz`, `/readyz` and `/metrics` for the whole process on `port` (0: any
        free port; the server's `port` says which). Close it before leaving the context."""
        # Here: a run without a metrics port loads no Prometheus client.
        from assay.runtime.http import StatusServer

        registry, refresh = self.metrics()
        server = StatusServer(registry, self.health, port, refresh)
        await server.start(host)
        return server

    def metrics(self) -> tuple[CollectorRegistry, Callable[[], Awaitable[None]]]:
        """The process's Prometheus registry (every stage's §15 signals), and what to call
        before each scrape (gauges read from the stages' state)."""
        from assay.runtime.metrics import StagesCollector, process_registry

        collector = StagesCollector(list(self.runners.values()))
        return process_registry(collector), collector.refresh

    def health(self) -> dict[str, object]:
        """`/healthz` and `/readyz`: ready once the stages consume; messages handled per stage."""
        handled = {name: r.handled for name, r in self.runners.items()}
        return {"ok": True, "ready": self._task is not None, "handled": handled}

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        for log in self.logs.values():
            await log.close()
        await self.bus.close()
        await self._close_owned()
        self._lock.release()

    async def _close_owned(self) -> None:
        """Close the model, judge and proposer built from the settings (not ones passed in)."""
        await self._wiring.aclose()

    def start(self) -> None:
        """Start every stage's consumers and relay in the background."""
        self._stop.clear()
        self._task = asyncio.ensure_future(
            asyncio.gather(
                *(r.run(self._stop) for r in self.runners.values()),
                self._keep_bus(self._stop),
                self._forget_deleted(self._stop),
            )
        )

    async def truncate_bus(self) -> int:
        """Delete the bus records every stage reading their topic has handled and that are
        older than the topic retention (`assay.runtime.retention.truncate_bus`); how many."""
        readers: dict[str, list[EventLog]] = {}
        for name, runner in self.runners.items():
            for topic in runner.spec.topics:
                readers.setdefault(topic, []).append(self.logs[name])
        policy = self.deps.retention
        older_than_ms = int((time.time() - policy.topic_retention_s) * 1000)
        return await truncate_bus(self.bus, readers, self.bus.topics(), older_than_ms)

    async def deleted_tenants(self) -> dict[str, int]:
        """The tenants every stage of this process deleted (each holds their tombstone),
        with when the last of them did (ms since the epoch)."""
        found: dict[str, int] | None = None
        for log_ in self.logs.values():
            here = {str(t): int(doc["at_ms"]) for t, _, doc in await log_.scan_kind(ERASED_KIND)}
            if found is None:
                found = here
            else:
                found = {t: max(at, here[t]) for t, at in found.items() if t in here}
        return found or {}

    async def forget_deleted_tenants(self) -> int:
        """Delete from the bus every record of a tenant every stage deleted; how many.

        Every topic but `assay.tenants`: its `TenantDeleted` is the command a stage not
        running in this process (the console, of a data directory it was served from)
        has yet to carry out, and it and the stages' `TenantStageDeleted` answers hold the
        tenant's id, the reason and counts, nothing of its data; retention truncates them
        as any record. A record published after the deletion (a late task, its dead
        letter) stays `LATE_GRACE_S`. Idempotent; a crash leaves the records for the
        next pass (at the next start)."""
        late_ms = int((time.time() - LATE_GRACE_S) * 1000)
        before = {t: max(at, late_ms) for t, at in (await self.deleted_tenants()).items()}
        return await self.bus.forget(before, keep=(TENANTS,))

    async def _forget_deleted(self, stop: asyncio.Event) -> None:
        """`forget_deleted_tenants` every `ERASED_REFRESH_S` until `stop` is set (a tenant's
        records go within seconds of its deletion's last stage; after a restart, at once)."""
        while not stop.is_set():
            try:
                await self.forget_deleted_tenants()
            except Exception:  # housekeeping: the pipeline goes on, the next round tries again
                log.warning("deleting a deleted tenant's bus records failed", exc_info=True)
            await sleep_or(stop, ERASED_REFRESH_S)

    async def _keep_bus(self, stop: asyncio.Event) -> None:
        """Truncate the bus every `prune_interval_s` until `stop` is set."""
        while not stop.is_set():
            try:
                await self.truncate_bus()
                self.bus.reclaim_space()
            except Exception:  # housekeeping: the pipeline goes on, the next round tries again
                log.warning("truncating the embedded bus failed", exc_info=True)
            await sleep_or(stop, self.deps.retention.prune_interval_s)

    async def stop(self) -> None:
        """Stop consuming; relays drain what was committed."""
        self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def command(
        self,
        stage: str,
        entry: OutboxEntry,
        outcome: Callable[[], Awaitable[T | None]],
        timeout_s: float,
        poll_s: float = 0.05,
    ) -> T:
        """Start the pipeline, produce `entry` as an outside producer would, and return
        `outcome()` once it is not None.

        Raises:
            Refused: `stage` dead-lettered the entry (with the reason it gave).
            TimeoutError: no outcome within `timeout_s`.
        """
        message = open_envelope(entry.value).id
        watch = await DeadLetterWatch.opened(self.bus, dlq(stage), message)
        self.start()
        await self.bus.publish([entry])
        deadline = time.monotonic() + timeout_s
        while (found := await outcome()) is None:
            if (reason := await watch.refused()) is not None:
                raise Refused(reason)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no outcome of {message} within {timeout_s:g}s")
            await asyncio.sleep(poll_s)
        return found

    async def publish(
        self,
        topic: str,
        msg: Versioned,
        tenant: TenantId,
        *,
        idem: str = "",
        traceparent: str | None = None,
    ) -> None:
        """Produce a message as an outside producer would (tasks, workflow registrations).

        The message id derives from `idem` (or the content), so producing the same
        thing twice is deduplicated by the consumers' inboxes. With a W3C `traceparent`,
        everything the message causes belongs to that trace.
        """
        key = idem or content_hash(msg.model_dump(mode="json"))
        entry = producer_entry(
            topic, msg, tenant, key, occurred_at=self.clock(), traceparent=traceparent
        )
        await self.bus.publish([entry])

    async def publish_many(self, items: Sequence[tuple[str, Versioned, TenantId, str]]) -> None:
        """Produce many messages in one durable write; each tuple ends with its `idem`."""
        await self.bus.publish([producer_entry(*item, occurred_at=self.clock()) for item in items])
