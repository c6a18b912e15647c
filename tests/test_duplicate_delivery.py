"""Duplicate delivery: every stage's source redelivers a consumed record with probability 0.3
across a 500-task workload, and the final state is identical to a clean run's.

The free-running embedded runtime consumes partitions and stages concurrently, with blob I/O
on worker threads, so two clean runs interleave differently: aggregate's running tallies,
tournament's comparison indices and the record at which the sequential test decides change
from run to run. Here the same `Embedded` runtime (stores, bus, `StageRunner.handle`,
outbox relays) is driven by a deterministic schedule instead: stages in pipeline order, each
handing over every record present on its topics in (topic, partition, offset) order and then
shipping its outbox, until nothing moves. Wall-clock inputs are pinned: producer messages
take their time from a stepping clock (ingest derives run ids from it), and the driver's
attempt timer is frozen (the durations are hashed into every episode ref downstream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import sqlite3
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from assay.bus.embedded import EmbeddedBus
from assay.bus.topics import RESULTS, TASKS, WORKFLOWS
from assay.bus.transport import Handle, Positions
from assay.cli.rebuild import rebuild
from assay.cli.tasks import read_tasks
from assay.engine import attempts
from assay.engine.models import StubModel
from assay.grading.judges import StubJudge
from assay.grading.sprt import SprtPolicy
from assay.kernel.ids import TenantId, WorkflowId
from assay.messages import MESSAGES, RunResult, TaskSubmitted, WorkflowRegistered, open_envelope
from assay.record import StateKey
from assay.runtime import STAGES, Embedded, RedeliveringSource
from assay.workflow import WorkflowDef, load_workflow

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TENANT = TenantId(uuid.uuid5(uuid.NAMESPACE_URL, "assay:test:duplicate-delivery"))
TASK_COUNT = 500
WAVE = 50
"""Tasks submitted at a time; the pipeline settles between waves, like a paced producer,
so the promotion of v2 lands mid-workload and later waves are routed by the new allocation."""
REDELIVERY_RATE = 0.3
SEED = "duplicate-delivery"

WALL_CLOCK_FIELDS = {
    ("execute", "run"): ("started_ms", "finished_ms"),
    ("execute", "tiering"): ("reduced_ms",),
}
"""Derived fields left out of the comparison, by (stage, document kind): execute's run
documents copy the commit time of a log record (`at_ms`, which the store stamps from
`time.time()`), and so does its tiering queue (when the wait before tiering began).
They are the only wall-clock readings in any stage's state."""


class CatchUpSource:
    """`Source` that hands over every record on its topics when called, then returns
    (without waiting for `stop`).

    Topics in the order given, partitions and offsets ascending, one record at a time, from
    the stored positions: the same store contents give the same deliveries in the same order
    on every run.
    """

    def __init__(self, bus: EmbeddedBus) -> None:
        self.bus = bus
        self.delivered = 0

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
                        self.delivered += 1
                        offset = m.offset + 1


class SteppingClock:
    """A clock that starts at a fixed instant and moves one second per reading."""

    def __init__(self) -> None:
        self.now = datetime(2025, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


@dataclass
class Outcome:
    """What a run left behind, normalised for comparison, and how it got there."""

    stores: dict[str, dict[str, list[Any]]]
    bus: list[tuple[Any, ...]]
    blobs: list[str]
    handled: dict[str, int]
    duplicates: dict[str, int]
    delivered: dict[str, int]
    handled_types: dict[str, dict[str, set[str]]]
    """Per stage, per topic, the message types it has a handler for."""
    sources: dict[str, RedeliveringSource] = field(default_factory=dict)
    seconds: float = 0.0


def workload(workflow_id: WorkflowId) -> list[TaskSubmitted]:
    """The example arithmetic tasks, then distinct generated ones up to `TASK_COUNT`."""
    tasks = read_tasks(EXAMPLES / "tasks" / "arith.jsonl", TENANT, workflow_id)
    questions = {t.input["question"] for t in tasks}
    rng = random.Random(SEED)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    while len(tasks) < TASK_COUNT:
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice(sorted(ops))
        question = f"{a} {op} {b}"
        if question in questions:
            continue
        questions.add(question)
        tasks.append(
            TaskSubmitted(
                tenant=TENANT,
                workflow_id=workflow_id,
                idempotency_key=f"arith-extra-{len(tasks):03d}",
                input={"question": question, "answer": str(ops[op](a, b))},
            )
        )
    assert len({t.idempotency_key for t in tasks}) == TASK_COUNT
    return tasks


async def settle(rt: Embedded, sources: dict[str, CatchUpSource]) -> None:
    """Run the stages in pipeline order until a round delivers and ships nothing."""
    while True:
        before = sum(s.delivered for s in sources.values())
        shipped = 0
        for name in STAGES:
            runner = rt.runners[name]
            assert runner.source is not None
            await runner.source.consume(
                runner.spec.topics, runner.handle, runner.log.positions, asyncio.Event()
            )
            while n := await runner.relay.ship_once():
                shipped += n
        if not shipped and sum(s.delivered for s in sources.values()) == before:
            return


async def run(data: Path, *, redeliver: bool) -> Outcome:
    """Register v1 and v2, submit the workload in waves, and read back what is left."""
    t0 = time.monotonic()
    v1 = load_workflow(EXAMPLES / "workflows" / "arith-v1.yaml")
    v2 = load_workflow(EXAMPLES / "workflows" / "arith-v2.yaml")
    catch_up: dict[str, CatchUpSource] = {}
    chaos: dict[str, RedeliveringSource] = {}
    async with Embedded(
        data,
        model=StubModel(),
        judge=StubJudge(),
        sprt=SprtPolicy(),
        shadow_rate=1.0,
        clock=SteppingClock(),
    ) as rt:
        for name, runner in rt.runners.items():
            catch_up[name] = CatchUpSource(rt.bus)
            runner.source = catch_up[name]
            if redeliver:
                chaos[name] = RedeliveringSource(
                    catch_up[name], seed=f"{SEED}:{name}", rate=REDELIVERY_RATE
                )
                runner.source = chaos[name]
        for wf in (v1, v2):
            definition = wf.model_dump(mode="json", by_alias=True)
            msg = WorkflowRegistered(tenant=TENANT, definition=definition)
            await rt.publish(WORKFLOWS, msg, TENANT, idem=wf.version)
            await settle(rt, catch_up)
        tasks = workload(v1.id)
        for i in range(0, len(tasks), WAVE):
            await rt.publish_many(
                [(TASKS, t, TENANT, t.idempotency_key) for t in tasks[i : i + WAVE]]
            )
            await settle(rt, catch_up)
        await check_the_workload_ran(rt, v1, v2)
        handled = {n: r.handled for n, r in rt.runners.items()}
        duplicates = {n: r.duplicates for n, r in rt.runners.items()}
        assert not any(r.dead_lettered for r in rt.runners.values())
        handled_types = {
            n: {t: set(h) for t, h in r.spec.handlers.items()} for n, r in rt.runners.items()
        }
    delivered = {n: s.delivered for n, s in catch_up.items()}
    return Outcome(
        stores={name: dump_store(data / f"{name}.sqlite") for name in STAGES},
        bus=dump_bus(data / "bus.sqlite"),
        blobs=sorted(str(p.relative_to(data)) for p in (data / "blobs").rglob("*") if p.is_file()),
        handled=handled,
        duplicates=duplicates,
        delivered=delivered,
        handled_types=handled_types,
        sources=chaos,
        seconds=time.monotonic() - t0,
    )


async def check_the_workload_ran(rt: Embedded, v1: WorkflowDef, v2: WorkflowDef) -> None:
    """The workload did what it is for: v2 was promoted mid-way, every task was graded."""
    decision = await rt.logs["decide"].get(StateKey(TENANT, "decision", v2.version))
    alloc = await rt.logs["decide"].get(StateKey(TENANT, "allocation", v1.id))
    assert decision is not None
    assert decision["accepted"] is True
    assert alloc is not None
    assert alloc["current"] == v2.version
    accepted = [doc for _, doc in await rt.logs["ingest"].scan(TENANT, "task")]
    assert len(accepted) == TASK_COUNT
    generations = Counter(doc["generation"] for doc in accepted)
    assert len(generations) > 1, f"every task was routed by one allocation: {generations}"
    spawned = sum(len(doc["runs"]) for doc in accepted)
    assert len(await rt.logs["tournament"].scan(TENANT, "scored")) == spawned


def dump_store(path: Path) -> dict[str, list[Any]]:
    """Every table of a stage's store, in a stable order, wall-clock readings left out."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        state = []
        for tenant, kind, key, value in db.execute(
            "SELECT tenant, kind, key, value FROM state ORDER BY tenant, kind, key"
        ):
            doc = json.loads(value)
            for name in WALL_CLOCK_FIELDS.get((path.stem, kind), ()):
                del doc[name]  # a KeyError means the field is gone: drop it from the list
            state.append((tenant, kind, key, doc))
        return {
            # `at_ms` is left out: the store stamps each record with the commit's wall clock.
            "log": db.execute(
                "SELECT seq, tenant, stream, branch, lsn, type, schema_version, payload "
                "FROM log ORDER BY seq"
            ).fetchall(),
            "state": state,
            "positions": db.execute("SELECT * FROM positions ORDER BY 1, 2").fetchall(),
            # `at_ms`, when an entry was committed (retention prunes by it), is wall-clock
            "inbox": db.execute("SELECT tenant, message_id FROM inbox ORDER BY 1, 2").fetchall(),
            "outbox": [untraced(r) for r in db.execute("SELECT * FROM outbox ORDER BY seq")],
            "checkpoints": db.execute("SELECT * FROM checkpoints ORDER BY 1, 2, 3, 4").fetchall(),
        }


TRACEPARENT = re.compile(rb"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
TRACEPARENT_TEXT = re.compile(TRACEPARENT.pattern.decode())
"""A W3C `traceparent`. Its span id is random whenever this process records spans (a
tracer provider is set once per process, for good: `tests/test_traces.py` sets one, and
a pytest worker runs other modules after it), so it is left out of the comparison: it
identifies a span, it is not state."""


def untraced(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """`row` with every traceparent in its byte values replaced by a placeholder."""
    return tuple(
        TRACEPARENT.sub(b"00-traceparent", v)
        if isinstance(v, bytes)
        else TRACEPARENT_TEXT.sub("00-traceparent", v)
        if isinstance(v, str)
        else v
        for v in row
    )


def dump_bus(path: Path) -> list[tuple[Any, ...]]:
    """Every record of every topic, by topic, partition and offset (traceparents apart)."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        rows = db.execute(  # not `at_ms`: when the record was appended (retention cuts by it)
            "SELECT topic, partition, offset, key, value, headers FROM records "
            "ORDER BY topic, partition, offset"
        ).fetchall()
    return [untraced(r) for r in rows]


def differences(a: Outcome, b: Outcome) -> list[str]:
    """Where two outcomes differ: per table and topic, the row count and the first difference.

    Tables: log (`at_ms` left out), state (`WALL_CLOCK_FIELDS` left out), positions, inbox
    (`at_ms` left out),
    outbox and checkpoints of every stage. Topics: every record, `assay.results` and
    `assay.decisions` among them, by partition and offset. Blobs: every ref.
    """
    tables = [(f"{s}.{t}", a.stores[s][t], b.stores[s][t]) for s in STAGES for t in a.stores[s]]
    topics = sorted({r[0] for r in a.bus} | {r[0] for r in b.bus})
    tables += [
        (f"topic {t}", [r for r in a.bus if r[0] == t], [r for r in b.bus if r[0] == t])
        for t in topics
    ]
    out = []
    for name, rows_a, rows_b in [*tables, ("blobs", a.blobs, b.blobs)]:
        if rows_a == rows_b:
            continue
        i = next(
            (i for i, (x, y) in enumerate(zip(rows_a, rows_b, strict=False)) if x != y),
            min(len(rows_a), len(rows_b)),
        )
        first = (rows_a[i : i + 1], rows_b[i : i + 1])
        out.append(f"{name}: {len(rows_a)} vs {len(rows_b)} rows; row {i}: {first!r:.600}")
    return out


def results_by_task(bus: list[tuple[Any, ...]]) -> dict[str, list[str]]:
    """Message ids of the `RunResult`s on `assay.results`, by idempotency key."""
    out: dict[str, list[str]] = {}
    for topic, _, _, _, value, _ in bus:
        if topic != RESULTS:
            continue
        env = open_envelope(value)
        msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
        assert isinstance(msg, RunResult)
        out.setdefault(msg.idempotency_key, []).append(env.id)
    return out


def expected_skips(outcome: Outcome) -> dict[str, int]:
    """Per stage, the redeliveries of records it has a handler for (the inbox skips those)."""
    types = {(t, p, o): open_envelope(v).type for t, p, o, _, v, _ in outcome.bus}
    return {
        name: sum(
            n
            for (topic, p, o), n in source.redelivered.items()
            if types[(topic, p, o)] in outcome.handled_types[name].get(topic, set())
        )
        for name, source in outcome.sources.items()
    }


@pytest.mark.timeout(240)
async def test_redelivering_every_stage_leaves_the_state_of_a_clean_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The driver (`engine.attempts`) times attempts with `time.monotonic()` and takes no
    # clock; the durations are recorded and hashed into each episode's ref, which every
    # later message carries.
    monkeypatch.setattr(attempts, "time", SimpleNamespace(monotonic=lambda: 0.0))

    clean = await run(tmp_path / "clean", redeliver=False)
    again = await run(tmp_path / "clean-again", redeliver=False)
    assert differences(clean, again) == [], "two clean runs differ: the comparison means nothing"

    chaos = await run(tmp_path / "redelivered", redeliver=True)

    # Redelivery happened at the rate asked, on every stage, both at once and later.
    delivered = sum(s.delivered for s in chaos.sources.values())
    chosen = sum(s.chosen for s in chaos.sources.values())
    assert delivered == sum(clean.delivered.values())
    assert abs(chosen / delivered - REDELIVERY_RATE) < 0.03, (chosen, delivered)
    for name, source in chaos.sources.items():
        assert source.chosen > 0, f"{name}: nothing was redelivered"
    late = sum(s.late for s in chaos.sources.values())
    assert 0 < late < chosen
    assert sum(s.redeliveries for s in chaos.sources.values()) >= chosen

    # The inboxes caught every redelivery of a message a stage handles: no handler ran twice.
    assert chaos.handled == clean.handled
    assert chaos.duplicates == expected_skips(chaos)
    assert not any(clean.duplicates.values())

    # Every task has exactly one result, and nothing else differs from the clean run.
    results = results_by_task(chaos.bus)
    assert len(results) == TASK_COUNT
    assert all(len(ids) == 1 for ids in results.values())
    assert differences(clean, chaos) == []
    assert await rebuild(tmp_path / "redelivered", check=True) == 0
    print(
        f"clean {clean.seconds:.1f}s, redelivered {chaos.seconds:.1f}s: "
        f"{chosen}/{delivered} records delivered twice, {late} of them later"
    )
