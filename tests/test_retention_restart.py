"""Retention, then a second run of every stage from the same bus: nothing is handled again.

The first run takes tasks through the embedded pipeline (runs tiered as soon as grading
ended); then every stage's retention sweep runs with a clock past every retention period
(the defaults), so every inbox
entry is forgotten and every finished record compacted, and the bus is truncated down
to each partition's last record. A second runtime on the same data directory starts
from the stored positions: it handles none of the old messages again (their inbox
entries are gone, so only the positions keep them from being handled twice), new tasks
go through with every stage's deliveries duplicated, and `assay rebuild --check` passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import sqlite3
import time
import uuid
from pathlib import Path

import pytest

from assay.bus.embedded import EmbeddedBus
from assay.bus.topics import RESULTS, TASKS, WORKFLOWS
from assay.bus.transport import BusMessage, Handle, Positions
from assay.cli.rebuild import rebuild
from assay.cli.tasks import read_tasks
from assay.engine.models import StubModel
from assay.grading.judges import StubJudge
from assay.kernel.ids import TenantId
from assay.messages import MESSAGES, RunResult, TaskSubmitted, WorkflowRegistered, open_envelope
from assay.runtime import STAGES, Embedded, RedeliveringSource
from assay.runtime.retention import StageRetention, truncate_bus
from assay.runtime.settings import AssaySettings
from assay.store.ports import EventLog
from assay.workflow import load_workflow

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TENANT = TenantId(uuid.uuid5(uuid.NAMESPACE_URL, "assay:test:retention-restart"))
DAY_S = 86_400.0
Delivery = tuple[str, str, int, int]
"""(stage, topic, partition, offset) of one record handed to a stage's handler."""


class CatchUpSource:
    """Hands over every record on its topics from the stored positions, then returns."""

    def __init__(self, bus: EmbeddedBus) -> None:
        self.bus = bus

    async def consume(
        self, topics: list[str], handle: Handle, positions: Positions, stop: asyncio.Event
    ) -> None:
        stored = await positions()
        for topic in topics:
            for p, end in sorted((await self.bus.end_offsets(topic)).items()):
                offset = stored.get((topic, p), 0)
                while offset < end:
                    batch = await self.bus.fetch(topic, p, offset, end - offset, 0.0)
                    assert batch, f"{topic}/{p}@{offset} below the end offset {end} is missing"
                    for m in batch:
                        await handle(m)
                        offset = m.offset + 1


async def settle(rt: Embedded, seen: list[Delivery]) -> None:
    """Run the stages in pipeline order until a round delivers and ships nothing; every
    delivery is noted in `seen`."""
    while True:
        moved = 0
        for name in STAGES:
            runner = rt.runners[name]
            assert runner.source is not None

            async def handle(m: BusMessage, name: str = name) -> None:
                seen.append((name, m.topic, m.partition, m.offset))
                await rt.runners[name].handle(m)

            before = len(seen)
            await runner.source.consume(
                runner.spec.topics, handle, runner.log.positions, asyncio.Event()
            )
            moved += len(seen) - before
            while n := await runner.relay.ship_once():
                moved += n
        if not moved:
            return


def settings_for(data: Path) -> AssaySettings:
    return AssaySettings.from_env(
        {
            "ASSAY_DATA_DIR": str(data),
            "ASSAY_RETENTION_TIER_AFTER_S": "0",  # every run tiered once grading ended
            "ASSAY_RETENTION_SWEEP_INTERVAL_S": "0",
        }
    )


def runtime(data: Path) -> Embedded:
    return Embedded(data, model=StubModel(), judge=StubJudge(), settings=settings_for(data))


async def results(bus: EmbeddedBus, after: dict[int, int] | None = None) -> list[str]:
    """Idempotency keys of the `RunResult`s on the bus (from `after`'s offsets)."""
    keys = []
    for p in range(bus.partitions):
        start = (after or {}).get(p, 0)
        for m in await bus.fetch(RESULTS, p, start, 100_000, 0.0):
            env = open_envelope(m.value)
            msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
            if isinstance(msg, RunResult):
                keys.append(msg.idempotency_key)
    return keys


def inbox_rows(data: Path, stage: str) -> int:
    with contextlib.closing(sqlite3.connect(data / f"{stage}.sqlite")) as db:
        (n,) = db.execute("SELECT COUNT(*) FROM inbox").fetchone()
    return int(n)


async def first_run(data: Path, tasks: list[TaskSubmitted]) -> dict[str, dict[int, int]]:
    """Tasks through the pipeline, then retention past every period; the bus's end offsets."""
    async with runtime(data) as rt:
        for runner in rt.runners.values():
            runner.source = CatchUpSource(rt.bus)
        seen: list[Delivery] = []
        await publish_workflow(rt)
        await settle(rt, seen)
        await rt.publish_many([(TASKS, t, TENANT, t.idempotency_key) for t in tasks])
        await settle(rt, seen)
        assert sorted(await results(rt.bus)) == sorted(t.idempotency_key for t in tasks)
        ends = {topic: await rt.bus.end_offsets(topic) for topic in rt.bus.topics()}

        tiered = await rt.logs["execute"].stale_branches("*/tiered", 2**62, 1000)
        assert len(tiered) == len(tasks)  # under the ceiling, tiered once grading ended

        later = time.time() + rt.deps.retention.records_keep_s + DAY_S
        readers: dict[str, list[EventLog]] = {}
        compacted = 0
        for name, runner in rt.runners.items():
            sweep = StageRetention(name, runner.spec.fold, rt.deps.retention, clock=lambda: later)
            swept = await sweep.sweep(runner.log)
            compacted += swept.records
            assert inbox_rows(data, name) == 0, (name, swept)
            for topic in runner.spec.topics:
                readers.setdefault(topic, []).append(runner.log)
        assert compacted > 0
        await truncate_bus(rt.bus, readers, rt.bus.topics(), int(later * 1000))
        for topic, end in ends.items():  # only the last record of each partition is left
            for p, n in end.items():
                left = [m.offset for m in await rt.bus.fetch(topic, p, 0, 100_000, 0.0)]
                assert left == ([n - 1] if n else []), (topic, p)
    return ends


async def publish_workflow(rt: Embedded) -> None:
    wf = load_workflow(EXAMPLES / "workflows" / "arith-v1.yaml")
    definition = wf.model_dump(mode="json", by_alias=True)
    await rt.publish(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=definition), TENANT)


@pytest.mark.timeout(180)
async def test_a_second_run_from_the_pruned_bus_handles_nothing_again(tmp_path: Path) -> None:
    data = tmp_path / "data"
    wf = load_workflow(EXAMPLES / "workflows" / "arith-v1.yaml")
    tasks = read_tasks(EXAMPLES / "tasks" / "arith.jsonl", TENANT, wf.id)[:24]
    old, new = tasks[:12], tasks[12:]
    ends = await first_run(data, old)

    async with runtime(data) as rt:
        chaos = {}
        for name, runner in rt.runners.items():
            chaos[name] = RedeliveringSource(CatchUpSource(rt.bus), seed=name, rate=0.5)
            runner.source = chaos[name]
        seen: list[Delivery] = []
        await settle(rt, seen)
        assert seen == []  # every stored position is at the end of its partition
        await rt.publish_many([(TASKS, t, TENANT, t.idempotency_key) for t in new])
        await settle(rt, seen)
        below = [d for d in seen if d[3] < ends.get(d[1], {}).get(d[2], 0)]
        assert below == [], "a record the stored position says was handled came again"
        assert sum(c.redeliveries for c in chaos.values()) > 0
        assert sum(r.duplicates for r in rt.runners.values()) > 0  # each one a no-op
        assert not any(r.dead_lettered for r in rt.runners.values())
        again = await results(rt.bus, ends.get(RESULTS))
        assert sorted(again) == sorted(t.idempotency_key for t in new)  # each exactly once

    with contextlib.redirect_stdout(io.StringIO()):
        assert await rebuild(data, check=True) == 0
