"""The decide stage behind a real `StageRunner` on SQLite, fed by hand (shared by its tests)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import assay_decide
from assay.bus import (
    AGGREGATES,
    DECISIONS,
    USAGE,
    WORKFLOWS,
    BusMessage,
    EmbeddedBus,
    EmbeddedSource,
    FileLock,
    OutboxRelay,
    dlq,
    topic_for,
)
from assay.bus.partitioner import partition_for
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.engine.sandbox_tools import sandbox_tools
from assay.grading import SprtPolicy, StubJudge
from assay.grading.ladder import LadderPolicy
from assay.kernel import TenantId
from assay.kernel.scores import WinRecord
from assay.messages import (
    MESSAGES,
    AllocationChanged,
    StrengthSummary,
    UsageRecorded,
    VariantAggregate,
    Versioned,
    WorkflowRegistered,
    message_id,
    open_envelope,
    seal,
)
from assay.record import StateKey
from assay.runtime import StageDeps, StageRunner, stage_log
from assay.store import EventLog, FsBlobStore, SqliteEventLog
from assay.store.ports import OutboxEntry
from assay.workflow import WorkflowDef, from_document

TENANT = TenantId(uuid.UUID("00000000-0000-4000-8000-0000000000d1"))
SHADOW_RATE = 0.25
POLICY = SprtPolicy()  # accept at 9 straight wins, reject at 6 straight losses
LADDER = LadderPolicy()  # trial at 5 clean shadow episodes, current after 5 clean trial ones


def version_doc(n: int, **extra: Any) -> dict[str, Any]:
    """Version n of one workflow; every version keeps the step id `solve`."""
    return {
        "id": "arith",
        "steps": [{"id": "solve", "kind": "model", "prompt": f"v{n}: {{{{ task.question }}}}"}],
        **extra,
    }


TOURNAMENT = {"grading": {"strategy": "tournament", "quorum": 2}}


def ir(n: int, **extra: Any) -> WorkflowDef:
    return from_document(version_doc(n, **extra))


def definition(n: int, **extra: Any) -> dict[str, Any]:
    return ir(n, **extra).model_dump(mode="json", by_alias=True)


def evidence(
    version: int,
    baseline: int = 1,
    record: WinRecord | None = None,
    *,
    screened: int | None = None,
    extra: dict[str, Any] | None = None,
    **fields: Any,
) -> VariantAggregate:
    """A challenger's evidence: by default every comparison screened clean, all passing."""
    record = record or WinRecord()
    n = record.comparisons + record.capped
    return VariantAggregate(
        tenant=TENANT,
        workflow_id=ir(version, **(extra or {})).id,
        workflow_version=ir(version, **(extra or {})).version,
        baseline_version=ir(baseline).version,
        record=record,
        runs=fields.pop("runs", n),
        passes=fields.pop("passes", n),
        screened=n - record.capped if screened is None else screened,
        **fields,
    )


def strength(mean: float, low: float, high: float, episodes: int) -> StrengthSummary:
    return StrengthSummary(episodes=episodes, mean=mean, interval=(low, high), unanchored=0)


@dataclass
class Stage:
    runner: StageRunner
    log: EventLog
    bus: EmbeddedBus
    """What the stage is fed is published here first and handled as read back, so the
    positions it stores are the bus's own: a pipeline later opened on the same directory
    reads on from them."""
    offsets: dict[str, int]
    usage: list[UsageRecorded] = field(default_factory=list)
    """What the stage metered on `assay.usage` (the proposer's drafts), kept apart."""

    async def send(
        self, topic: str, msg: Versioned, mid: str | None = None, tenant: TenantId = TENANT
    ) -> BusMessage:
        offset = self.offsets.get(topic, 0)
        env = seal(
            msg,
            tenant=tenant,
            key=topic_for(topic, msg).key(msg),
            id=message_id("test", topic, mid or str(offset)),
            causation=None,
        )
        self.offsets[topic] = offset + 1
        part = partition_for(env.key.encode(), self.bus.partitions_of(topic))
        end = (await self.bus.end_offsets(topic))[part]
        await self.bus.publish([OutboxEntry(topic, env.key, env.encode(), tuple(env.headers()))])
        (m,) = await self.bus.fetch(topic, part, end, 1, 0.0)
        await self.runner.handle(m)
        return m

    async def register(self, n: int, **extra: Any) -> list[Any]:
        doc = version_doc(n, **extra)
        await self.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=doc))
        return await self.take()

    async def evidence(self, agg: VariantAggregate) -> list[Any]:
        await self.send(AGGREGATES, agg)
        return await self.take()

    async def take(self) -> list[Any]:
        """Decoded outbox rows since the last call (decisions, and registrations of
        approved proposals); dead letters stay raw entries."""
        rows = await self.log.drain_outbox(10_000)
        await self.log.ack_outbox([r.seq for r in rows])
        out: list[Any] = []
        for r in rows:
            assert r.entry.topic in (DECISIONS, WORKFLOWS, USAGE, dlq("decide")), r.entry.topic
            if r.entry.topic == USAGE:
                env = open_envelope(r.entry.value)
                self.usage.append(UsageRecorded.model_validate(env.payload))
                continue
            if r.entry.topic == dlq("decide"):
                out.append(r.entry)
                continue
            env = open_envelope(r.entry.value)
            assert env.key == f"{TENANT}:arith", env.key
            out.append(MESSAGES.decode(env.type, env.schema_version, env.payload))
        return out

    async def allocation(self) -> dict[str, Any]:
        doc = await self.log.get(StateKey(TENANT, "allocation", "arith"))
        assert doc is not None
        return doc

    async def standings(self) -> dict[str, dict[str, Any]]:
        """Where each live challenger of the workflow stands, by version."""
        return {
            key.split("/", 1)[1]: doc
            for who, key, doc in await self.log.scan_kind("ladder")
            if who == TENANT and key.startswith("arith/")
        }

    async def standing(self) -> dict[str, Any] | None:
        """Where the one live challenger stands (None: no challenger)."""
        docs = list((await self.standings()).values())
        assert len(docs) <= 1, docs
        return docs[0] if docs else None

    async def state(self, kind: str, key: str) -> dict[str, Any] | None:
        return await self.log.get(StateKey(TENANT, kind, key))


def deps(tmp_path: Path, **overrides: Any) -> StageDeps:
    return StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools={**BUILTIN_TOOLS, **sandbox_tools()},
        sprt=POLICY,
        shadow_rate=SHADOW_RATE,
        ladder=overrides.pop("ladder", LADDER),
        **overrides,
    )


@asynccontextmanager
async def open_stage(
    tmp_path: Path, log: EventLog | None = None, **overrides: Any
) -> AsyncIterator[Stage]:
    """The stage on its SQLite log in `tmp_path` (or on `log`, which the caller closes)."""
    d = deps(tmp_path, **overrides)
    spec = assay_decide.create_stage(d)
    own: SqliteEventLog | None = None
    if log is None:
        log = own = await stage_log(tmp_path, spec).open()
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=4, control_partitions=1).open()
    relay = OutboxRelay(spec.name, log, bus, FileLock(tmp_path / "decide.relay.lock"))
    try:
        yield Stage(StageRunner(spec, log, d.blobs, relay, EmbeddedSource(bus)), log, bus, {})
    finally:
        if own is not None:
            await own.close()
        await bus.close()


def only_allocation(out: list[Any]) -> AllocationChanged:
    (alloc,) = out
    assert isinstance(alloc, AllocationChanged), out
    return alloc
