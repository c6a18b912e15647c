"""Decide handlers through a StageRunner: allocation, one challenger at a time, SPRT decisions."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import assay_decide
from assay.bus import (
    AGGREGATES,
    DECISIONS,
    WORKFLOWS,
    BusMessage,
    EmbeddedBus,
    EmbeddedSource,
    FileLock,
    OutboxRelay,
    dlq,
    topic_for,
)
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import SprtPolicy, StubJudge
from assay.kernel import TenantId, WorkflowVersion
from assay.kernel.scores import WinRecord
from assay.messages import (
    MESSAGES,
    AllocationChanged,
    ChallengerRejected,
    Promoted,
    VariantAggregate,
    Versioned,
    WorkflowRegistered,
    message_id,
    open_envelope,
    seal,
)
from assay.record import BranchKey, StateKey
from assay.runtime import StageDeps, StageRunner, stage_log
from assay.store import FsBlobStore, OutboxEntry, SqliteEventLog
from assay.workflow import WorkflowDef, from_document
from assay_decide.stage import AllocationSet

TENANT = TenantId(uuid.UUID("00000000-0000-4000-8000-0000000000d1"))
SHADOW_RATE = 0.25
POLICY = SprtPolicy()  # accept at 9 straight wins, reject at 6 straight losses


def version_doc(n: int) -> dict[str, Any]:
    """Version n of one workflow; every version keeps the step id `solve`."""
    return {
        "id": "arith",
        "steps": [{"id": "solve", "kind": "model", "prompt": f"v{n}: {{{{ task.question }}}}"}],
    }


def ir(n: int) -> WorkflowDef:
    return from_document(version_doc(n))


def definition(n: int) -> dict[str, Any]:
    return ir(n).model_dump(mode="json", by_alias=True)


@dataclass
class Stage:
    runner: StageRunner
    log: SqliteEventLog
    offsets: dict[str, int]

    async def send(self, topic: str, msg: Versioned, mid: str | None = None) -> BusMessage:
        env = seal(
            msg,
            tenant=TENANT,
            key=topic_for(topic, msg).key(msg),
            id=message_id("test", topic, mid or str(self.offsets.get(topic, 0))),
            causation=None,
        )
        offset = self.offsets.get(topic, 0)
        self.offsets[topic] = offset + 1
        m = BusMessage(topic, 0, offset, env.key, env.encode(), tuple(env.headers()))
        await self.runner.handle(m)
        return m

    async def register(self, n: int) -> list[Any]:
        await self.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=version_doc(n)))
        return await self.take()

    async def aggregate(self, version: int, baseline: int, record: WinRecord) -> list[Any]:
        msg = VariantAggregate(
            tenant=TENANT,
            workflow_id=ir(version).id,
            workflow_version=ir(version).version,
            baseline_version=ir(baseline).version,
            record=record,
            runs=record.comparisons,
            passes=record.comparisons,
        )
        await self.send(AGGREGATES, msg)
        return await self.take()

    async def take(self) -> list[Any]:
        """Decoded outbox rows since the last call; dead letters stay raw entries."""
        rows = await self.log.drain_outbox(10_000)
        await self.log.ack_outbox([r.seq for r in rows])
        out: list[Any] = []
        for r in rows:
            assert r.entry.topic in (DECISIONS, dlq("decide")), r.entry.topic
            if r.entry.topic != DECISIONS:
                out.append(r.entry)
                continue
            env = open_envelope(r.entry.value)
            assert env.key == f"{TENANT}:arith"
            out.append(MESSAGES.decode(env.type, env.schema_version, env.payload))
        return out

    async def allocation(self) -> dict[str, Any] | None:
        return await self.log.get(StateKey(TENANT, "allocation", "arith"))


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    deps = StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        sprt=POLICY,
        shadow_rate=SHADOW_RATE,
    )
    spec = assay_decide.create_stage(deps)
    log = await stage_log(tmp_path, spec).open()
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=4).open()
    relay = OutboxRelay(spec.name, log, bus, FileLock(tmp_path / "decide.relay.lock"))
    try:
        yield Stage(StageRunner(spec, log, deps.blobs, relay, EmbeddedSource(bus)), log, {})
    finally:
        await log.close()
        await bus.close()


@pytest.fixture
async def contest(stage: Stage) -> Stage:
    """v1 current, v2 challenger (generation 2)."""
    await stage.register(1)
    await stage.register(2)
    return stage


def only_allocation(out: list[Any]) -> AllocationChanged:
    (alloc,) = out
    assert isinstance(alloc, AllocationChanged)
    return alloc


# -- registration --------------------------------------------------------------------------


async def test_first_registration_makes_the_version_current(stage: Stage) -> None:
    alloc = only_allocation(await stage.register(1))
    assert alloc.generation == 1
    assert alloc.current == ir(1).version
    assert alloc.challenger is None
    assert alloc.challenger_share == 0.0
    assert alloc.definitions == {ir(1).version: definition(1)}
    stored = await stage.allocation()
    assert stored == alloc.model_dump(mode="json")


async def test_second_registration_becomes_the_shadow_challenger(stage: Stage) -> None:
    await stage.register(1)
    alloc = only_allocation(await stage.register(2))
    assert alloc.generation == 2
    assert alloc.current == ir(1).version
    assert alloc.challenger == ir(2).version
    assert alloc.shadow_rate == SHADOW_RATE
    assert alloc.challenger_share == 0.0
    assert alloc.definitions == {ir(1).version: definition(1), ir(2).version: definition(2)}


async def test_third_version_while_a_challenger_is_live_is_dead_lettered(contest: Stage) -> None:
    out = await contest.register(3)
    (entry,) = out
    assert isinstance(entry, OutboxEntry)
    assert entry.topic == dlq("decide")
    reason = dict(entry.headers)["assay-dlq-reason"].decode()
    assert "already has challenger" in reason
    assert ir(2).version in reason
    alloc = await contest.allocation()
    assert alloc is not None
    assert alloc["generation"] == 2
    assert alloc["challenger"] == ir(2).version
    assert await contest.log.positions() == {(WORKFLOWS, 0): 3}


async def test_re_registering_a_known_version_is_a_no_op(contest: Stage) -> None:
    before = await contest.allocation()
    assert await contest.register(1) == []
    assert await contest.register(2) == []
    assert await contest.allocation() == before
    assert await contest.log.positions() == {(WORKFLOWS, 0): 4}


async def test_invalid_definition_is_left_to_ingest(stage: Stage) -> None:
    bad = {"id": "arith", "steps": [{"id": "s", "kind": "tool", "tool": "nope"}]}
    await stage.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=bad))
    assert await stage.take() == []
    assert await stage.allocation() is None
    assert stage.runner.dead_lettered == 0


# -- decisions -----------------------------------------------------------------------------


async def test_crossing_the_accept_boundary_promotes_the_challenger(contest: Stage) -> None:
    record = WinRecord(judge_wins=5, verifier_wins=4)
    out = await contest.aggregate(2, 1, record)
    assert [type(m) for m in out] == [Promoted, AllocationChanged]
    promoted, alloc = out
    assert promoted.workflow_version == ir(2).version
    assert promoted.previous == ir(1).version
    assert promoted.record == record
    assert promoted.llr >= POLICY.upper
    assert alloc.generation == 3
    assert alloc.current == ir(2).version
    assert alloc.challenger is None
    assert alloc.definitions == {ir(2).version: definition(2)}
    decision = await contest.log.get(StateKey(TENANT, "decision", ir(2).version))
    assert decision is not None
    assert decision["accepted"] is True
    assert "accept boundary" in decision["reason"]


async def test_crossing_the_reject_boundary_rejects_the_challenger(contest: Stage) -> None:
    record = WinRecord(judge_losses=4, verifier_losses=2)
    out = await contest.aggregate(2, 1, record)
    assert [type(m) for m in out] == [ChallengerRejected, AllocationChanged]
    rejected, alloc = out
    assert rejected.workflow_version == ir(2).version
    assert "reject boundary" in rejected.reason
    assert rejected.llr <= POLICY.lower
    assert alloc.generation == 3
    assert alloc.current == ir(1).version
    assert alloc.challenger is None
    assert alloc.definitions == {ir(1).version: definition(1)}
    decision = await contest.log.get(StateKey(TENANT, "decision", ir(2).version))
    assert decision is not None
    assert decision["accepted"] is False


async def test_draw_rate_above_the_ceiling_rejects_the_challenger(contest: Stage) -> None:
    record = WinRecord(judge_wins=3, judge_losses=2, draws=15)
    out = await contest.aggregate(2, 1, record)
    assert [type(m) for m in out] == [ChallengerRejected, AllocationChanged]
    rejected, alloc = out
    assert "draw rate 15/20" in rejected.reason
    assert alloc.challenger is None
    assert alloc.current == ir(1).version


async def test_record_within_the_boundaries_changes_nothing(contest: Stage) -> None:
    assert await contest.aggregate(2, 1, WinRecord(judge_wins=4, judge_losses=1)) == []
    assert await contest.aggregate(2, 1, WinRecord(draws=15, judge_wins=4)) == []  # n < 20
    alloc = await contest.allocation()
    assert alloc is not None
    assert alloc["generation"] == 2


async def test_aggregate_for_a_version_that_is_not_the_live_challenger_is_ignored(
    contest: Stage,
) -> None:
    wins = WinRecord(judge_wins=20)
    assert await contest.aggregate(1, 1, wins) == []  # the current version itself
    assert await contest.aggregate(3, 1, wins) == []  # never registered
    assert await contest.aggregate(2, 3, wins) == []  # measured against another baseline
    alloc = await contest.allocation()
    assert alloc is not None
    assert alloc["generation"] == 2
    assert alloc["challenger"] == ir(2).version


async def test_aggregate_before_any_registration_is_ignored(stage: Stage) -> None:
    assert await stage.aggregate(2, 1, WinRecord(judge_wins=20)) == []
    assert stage.runner.dead_lettered == 0


async def test_decided_challenger_is_not_decided_again(contest: Stage) -> None:
    await contest.aggregate(2, 1, WinRecord(judge_losses=6))
    assert await contest.aggregate(2, 1, WinRecord(judge_losses=7)) == []
    assert await contest.aggregate(2, 1, WinRecord(judge_wins=20)) == []
    alloc = await contest.allocation()
    assert alloc is not None
    assert alloc["generation"] == 3


async def test_after_a_rejection_a_new_version_can_challenge(contest: Stage) -> None:
    await contest.aggregate(2, 1, WinRecord(judge_losses=6))
    alloc = only_allocation(await contest.register(3))
    assert alloc.generation == 4
    assert alloc.current == ir(1).version
    assert alloc.challenger == ir(3).version
    assert set(alloc.definitions) == {ir(1).version, ir(3).version}
    # the rejected version stays known: registering it again does not revive it
    assert await contest.register(2) == []


async def test_after_a_promotion_the_old_current_cannot_return_as_challenger(
    contest: Stage,
) -> None:
    await contest.aggregate(2, 1, WinRecord(judge_wins=9))
    assert await contest.register(1) == []
    alloc = only_allocation(await contest.register(3))
    assert alloc.generation == 4
    assert alloc.current == ir(2).version
    assert alloc.challenger == ir(3).version
    promoted_twice = await contest.aggregate(3, 2, WinRecord(judge_wins=9))
    assert [type(m) for m in promoted_twice] == [Promoted, AllocationChanged]
    assert promoted_twice[1].current == ir(3).version
    assert promoted_twice[1].generation == 5


async def test_every_allocation_records_the_generation_it_replaced(contest: Stage) -> None:
    await contest.aggregate(2, 1, WinRecord(judge_wins=9))
    records = await contest.log.read(BranchKey.main(TENANT, "workflow:arith"))
    sets = [r.event for r in records if isinstance(r.event, AllocationSet)]
    assert [(e.expected_generation, e.allocation.generation) for e in sets] == [
        (0, 1),
        (1, 2),
        (2, 3),
    ]
    assert [e.cause.split(":")[0] for e in sets] == [
        "first version registered",
        "challenger registered (shadow)",
        "promoted",
    ]


async def test_decide_keeps_no_stale_version_in_the_allocation(contest: Stage) -> None:
    await contest.aggregate(2, 1, WinRecord(judge_wins=9))
    alloc = await contest.allocation()
    assert alloc is not None
    assert list(alloc["definitions"]) == [ir(2).version]
    known = [k for k, _ in await contest.log.scan(TENANT, "known")]
    assert sorted(known) == sorted([ir(1).version, ir(2).version])


async def test_allocation_key_and_causation_follow_the_message(stage: Stage) -> None:
    m = await stage.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=version_doc(1)))
    (row,) = await stage.log.drain_outbox(10)
    env = open_envelope(row.entry.value)
    assert row.entry.key == f"{TENANT}:arith"
    assert env.causation_id == open_envelope(m.value).id
    assert env.tenant == TENANT
    assert WorkflowVersion(env.payload["current"]) == ir(1).version
