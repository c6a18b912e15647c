"""Distributed mode: one stage per process on Postgres, Kafka and S3 (DESIGN §3).

The same `StageSpec` and `StageRunner` as embedded mode; only the adapters
differ: the stage's own Postgres schema and role, a Kafka consumer group per
stage, an S3 bucket for blobs, and an outbox relay led by one replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from importlib.metadata import entry_points
from typing import Protocol

from assay.bus.kafka import KafkaSource, KafkaTransport, ensure_topics
from assay.bus.relay import OutboxRelay
from assay.bus.topics import all_topics, partition_counts
from assay.kernel.errors import AssayError
from assay.runtime.bootstrap import stage_deps
from assay.runtime.consumer import StageRunner
from assay.runtime.embedded import STAGES, discover_stages
from assay.runtime.http import StatusServer
from assay.runtime.metrics import StageCollector, stage_registry
from assay.runtime.retention import StageRetention
from assay.runtime.settings import AssaySettings
from assay.runtime.vitals import Vitals
from assay.store.postgres import PgAdvisoryLeader, PostgresEventLog, listen_for_outbox
from assay.store.s3_blobs import S3BlobStore

log = logging.getLogger(__name__)


def blob_store(settings: AssaySettings) -> S3BlobStore:
    """The S3 blob store the settings describe."""
    return S3BlobStore(
        settings.s3.endpoint,
        settings.s3.bucket,
        access_key_id=settings.s3.access_key_id,
        secret_access_key=settings.s3.secret_access_key,
        region=settings.s3.region,
    )


async def create_topics(settings: AssaySettings) -> list[str]:
    """Create every topic (and each stage's dead-letter topic) if missing, each with its
    partition count (`assay.bus.topics.partition_count`)."""
    settings.require("kafka.bootstrap")
    assert settings.kafka.bootstrap is not None
    names = all_topics(list(STAGES))
    retention_ms = int(settings.retention.topic_retention_s * 1000)
    counts = partition_counts(names, settings.partitions, settings.control_partitions)
    await ensure_topics(settings.kafka.bootstrap, names, counts, retention_ms=retention_ms)
    return names


async def serve(stage: str, settings: AssaySettings, stop: asyncio.Event) -> None:
    """Run one stage until `stop` is set: migrate its schema, consume, relay, report.

    Raises:
        AssayError: unknown stage, or missing settings.
    """
    factories = discover_stages()
    if stage not in factories:
        raise AssayError(f"no stage {stage!r} is installed (have: {', '.join(sorted(factories))})")
    settings.require("kafka.bootstrap", "database.url")
    assert settings.kafka.bootstrap is not None
    assert settings.database.url is not None
    await create_topics(settings)
    async with AsyncExitStack() as stack:
        blobs = blob_store(settings)
        await blobs.open()
        stack.push_async_callback(blobs.close)
        wiring = stage_deps(settings, blobs)
        stack.push_async_callback(wiring.aclose)
        deps = wiring.deps
        spec = factories[stage](deps)
        event_log = PostgresEventLog(
            settings.database.url, stage, spec.events, spec.fold, tables=spec.tables
        )
        await event_log.open()
        stack.push_async_callback(event_log.close)
        transport = KafkaTransport(settings.kafka.bootstrap, client_id=f"assay-{stage}")
        await transport.open()
        stack.push_async_callback(transport.close)
        # A replica that stalls (SIGSTOP, a frozen VM) gives relay leadership up after the
        # lease TTL, as it gives its runs up: the stage's messages keep flowing meanwhile.
        leader = PgAdvisoryLeader(
            settings.database.url, stage, stalled_after_s=settings.lease_ttl_s
        )
        relay = OutboxRelay(stage, event_log, transport, leader)
        listener = await listen_for_outbox(settings.database.url, stage, relay.wake)
        stack.push_async_callback(listener.close)
        source = kafka_source(settings, stage)
        vitals = Vitals(
            unready_after_s=settings.unready_after_s,
            exit_after_s=settings.exit_after_s,
            relay=relay.health,
        )
        retention = StageRetention(stage, spec.fold, deps.retention)
        runner = StageRunner(spec, event_log, blobs, relay, source, vitals, retention=retention)

        def health() -> dict[str, object]:
            return {
                "ok": True,  # liveness: the event loop answers
                "stage": stage,
                "handled": runner.handled,
                "duplicates": runner.duplicates,
                "dead_lettered": runner.dead_lettered,
            }

        def readiness() -> dict[str, object]:
            consumer = source.status(settings.unready_after_s)
            return {"stage": stage, **vitals.readiness(consumer, stopping=stop.is_set())}

        collector = StageCollector(runner)
        status = StatusServer(
            stage_registry(runner, collector),
            health,
            settings.http.port,
            collector.refresh,
            readiness=readiness,
            queries=[(q.pattern, functools.partial(q.answer, event_log)) for q in spec.queries],
        )
        await status.start()
        stack.push_async_callback(status.close)
        for start_server in stage_servers(stage):
            server = await start_server(event_log, settings)
            stack.push_async_callback(server.aclose)
        log.info("stage %s serving; status on port %d", stage, status.port)
        watch = asyncio.create_task(vitals.watch(event_log.ping, stop), name=f"{stage}-vitals")
        stack.push_async_callback(_cancelled, watch)
        await runner.run(stop)
        if vitals.gave_up is not None:
            raise StageGaveUp(f"stage {stage} gave up: {vitals.gave_up}")


class StageServer(Protocol):
    """A server an installed package runs beside a stage (the console's pages and API)."""

    async def aclose(self) -> None:
        """Stop serving."""
        ...


def stage_servers(
    stage: str,
) -> list[Callable[[PostgresEventLog, AssaySettings], Awaitable[StageServer]]]:
    """Servers registered for `stage` under the `assay.stage_servers` entry-point group:
    each is started with the stage's store and the settings, and closed when it stops."""
    return [ep.load() for ep in entry_points(group="assay.stage_servers") if ep.name == stage]


class StageGaveUp(AssayError):
    """A stage stopped itself because a service it needs stayed away too long."""


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def kafka_source(settings: AssaySettings, stage: str) -> KafkaSource:
    """The stage's consumer-group source, as the `kafka` settings declare it."""
    kafka = settings.kafka
    assert kafka.bootstrap is not None  # checked when the stage's settings were read
    return KafkaSource(
        kafka.bootstrap,
        group_id=f"assay-{stage}",
        client_id=f"assay-{stage}-{socket.gethostname()}-{os.getpid()}",
        member_timeout_ms=kafka.member_timeout_ms,
        heartbeat_interval_ms=min(3_000, kafka.member_timeout_ms // 3),
        fetch_max_wait_ms=kafka.fetch_max_wait_ms,
    )
