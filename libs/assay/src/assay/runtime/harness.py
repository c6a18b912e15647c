"""Drive one stage by hand: deliver messages, read what it emitted.

For tests of a stage's handlers and for people writing their own stages. It is
the real consumer path (envelope, inbox, handler, one commit with the position)
on a real SQLite store; only the broker is replaced by direct delivery.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from assay.bus.embedded import EmbeddedBus
from assay.bus.headers import DLQ_REASON
from assay.bus.relay import FileLock, OutboxRelay
from assay.bus.topics import producer_entry
from assay.bus.transport import BusMessage
from assay.kernel.canonical import content_hash
from assay.kernel.ids import TenantId
from assay.kernel.schema import Versioned
from assay.messages import MESSAGES, open_envelope
from assay.record.state import StateKey
from assay.runtime.consumer import StageRunner
from assay.runtime.embedded import stage_log
from assay.runtime.stage import StageSpec
from assay.store.ports import BlobStore, EventLog, PendingOutbox
from assay.store.sqlite import SqliteEventLog


class StageHarness:
    """One stage on its own store in `directory`. Use as an async context manager.

    `log` replaces that store with one the caller opened (and closes), for
    instance a Postgres schema, or a store another harness shares.
    """

    def __init__(
        self, spec: StageSpec, blobs: BlobStore, directory: Path, log: EventLog | None = None
    ) -> None:
        self.spec = spec
        self.blobs = blobs
        self.directory = directory
        self._own_log: SqliteEventLog | None = None
        self.log: EventLog
        if log is None:
            self.log = self._own_log = stage_log(directory, spec)
        else:
            self.log = log
        self.bus = EmbeddedBus(directory / "bus.sqlite", partitions=1)
        self._offsets: dict[str, int] = {}
        self.runner: StageRunner | None = None

    async def __aenter__(self) -> StageHarness:
        if self._own_log is not None:
            await self._own_log.open()
        await self.bus.open()
        relay = OutboxRelay(
            self.spec.name, self.log, self.bus, FileLock(self.directory / "relay.lock")
        )
        self.runner = StageRunner(self.spec, self.log, self.blobs, relay)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._own_log is not None:
            await self._own_log.close()
        await self.bus.close()

    async def deliver_raw(self, topic: str, value: bytes, key: str = "k") -> None:
        """Hand bytes to the stage as the next record of `topic`."""
        assert self.runner is not None, "use StageHarness as an async context manager"
        offset = self._offsets.get(topic, 0)
        self._offsets[topic] = offset + 1
        await self.runner.handle(BusMessage(topic, 0, offset, key, value, ()))

    async def deliver(
        self, topic: str, msg: Versioned, tenant: TenantId, *, idem: str | None = None
    ) -> None:
        """Seal `msg` as a producer would and hand it to the stage."""
        entry = producer_entry(
            topic, msg, tenant, idem or content_hash(msg.model_dump(mode="json"))
        )
        await self.deliver_raw(topic, entry.value, entry.key)

    async def outbox(self) -> list[PendingOutbox]:
        """Everything committed for publication and not yet shipped."""
        return await self.log.drain_outbox(100_000)

    async def emitted(self, topic: str | None = None) -> list[Versioned]:
        """Decoded messages in the outbox (dead letters excluded), optionally of one topic."""
        out = []
        for row in await self.outbox():
            if row.entry.topic.startswith("assay.dlq.") or (topic and row.entry.topic != topic):
                continue
            env = open_envelope(row.entry.value)
            out.append(MESSAGES.decode(env.type, env.schema_version, env.payload))
        return out

    async def dead_letters(self) -> list[tuple[bytes, str]]:
        """(original bytes, reason) of everything the stage refused."""
        return [
            (row.entry.value, dict(row.entry.headers)[DLQ_REASON].decode())
            for row in await self.outbox()
            if row.entry.topic.startswith("assay.dlq.")
        ]

    async def state(self, tenant: TenantId, kind: str, key: str) -> dict[str, Any] | None:
        """One derived document of the stage."""
        return await self.log.get(StateKey(tenant, kind, key))
