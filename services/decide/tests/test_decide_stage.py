"""Decide handlers through a StageRunner: registration, shadow's entry criteria, one
challenger at a time, the compare-and-swap, and the sequential test's decisions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from assay.bus import WORKFLOWS, dlq
from assay.kernel import WorkflowVersion
from assay.kernel.scores import WinRecord
from assay.messages import (
    AllocationChanged,
    ChallengerRejected,
    Ladder,
    Promoted,
    Rung,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import BranchKey
from assay.store import CommitBatch, EventLog, OutboxEntry
from assay_decide.stage import AllocationSet
from services.decide.tests.decide_harness import (
    LADDER,
    POLICY,
    SHADOW_RATE,
    TENANT,
    TOURNAMENT,
    Stage,
    definition,
    evidence,
    ir,
    only_allocation,
    open_stage,
    version_doc,
)


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[Stage]:
    async with open_stage(tmp_path) as s:
        yield s


@pytest.fixture
async def contest(stage: Stage) -> Stage:
    """v1 current, v2 challenger in shadow (generation 2)."""
    await stage.register(1)
    await stage.register(2)
    return stage


# -- registration --------------------------------------------------------------------------


async def test_first_registration_makes_the_version_current(stage: Stage) -> None:
    alloc = only_allocation(await stage.register(1))
    assert alloc.generation == 1
    assert alloc.current == ir(1).version
    assert alloc.challenger is None
    assert alloc.rung is None
    assert alloc.challenger_share == 0.0
    assert alloc.definitions == {ir(1).version: definition(1)}
    assert AllocationChanged.model_validate(await stage.allocation()) == alloc
    assert await stage.standing() is None


async def test_second_registration_becomes_the_shadow_challenger(stage: Stage) -> None:
    await stage.register(1)
    alloc = only_allocation(await stage.register(2))
    assert alloc.generation == 2
    assert alloc.current == ir(1).version
    assert alloc.challenger == ir(2).version
    assert (alloc.rung, alloc.ladder) == (Rung.SHADOW, Ladder.DEFAULT)
    assert alloc.shadow_rate == SHADOW_RATE
    assert alloc.challenger_share == 0.0
    assert alloc.definitions == {ir(1).version: definition(1), ir(2).version: definition(2)}
    standing = await stage.standing()
    assert standing is not None
    assert (standing["rung"], standing["accepted"]) == ("shadow", False)


async def test_a_tournament_graded_challenger_climbs_the_resourced_ladder(stage: Stage) -> None:
    await stage.register(1)
    alloc = only_allocation(await stage.register(2, **TOURNAMENT))
    assert (alloc.rung, alloc.ladder) == (Rung.SHADOW, Ladder.RESOURCED)


async def test_third_version_while_a_challenger_is_live_is_dead_lettered(contest: Stage) -> None:
    (entry,) = await contest.register(3)
    assert isinstance(entry, OutboxEntry)
    assert entry.topic == dlq("decide")
    reason = dict(entry.headers)["assay-dlq-reason"].decode()
    assert "already has challenger" in reason
    assert ir(2).version in reason
    alloc = await contest.allocation()
    assert (alloc["generation"], alloc["challenger"]) == (2, ir(2).version)
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
    assert await stage.state("allocation", "arith") is None
    assert stage.runner.dead_lettered == 0


async def test_a_version_that_is_not_sandbox_clean_never_enters_shadow(stage: Stage) -> None:
    """§12.4: a shadow replay re-executes tools; one that could act outside the sandbox
    (here: the network) would act again on every replay."""
    await stage.register(1)
    calls_out = {
        "steps": [
            {"id": "solve", "kind": "model", "prompt": "{{ task.question }}"},
            {"id": "post", "kind": "tool", "tool": "http_request", "args": {"url": "x"}},
        ]
    }
    (rejected,) = await stage.register(2, **calls_out)
    assert isinstance(rejected, ChallengerRejected)
    assert "not sandbox-clean" in rejected.reason
    assert "post (http_request)" in rejected.reason
    alloc = await stage.allocation()
    assert (alloc["generation"], alloc["challenger"]) == (1, None)
    decision = await stage.state("decision", ir(2, **calls_out).version)
    assert decision is not None
    assert (decision["outcome"], decision["rung"]) == ("rejected", None)
    assert await stage.register(2, **calls_out) == []  # turned away once, for good
    assert only_allocation(await stage.register(3)).challenger == ir(3).version


# -- the compare-and-swap ----------------------------------------------------------------------


class RacingLog:
    """An event log on which another replica commits just before this one does."""

    def __init__(self, inner: EventLog) -> None:
        self.inner = inner
        self.before: Callable[[], Awaitable[None]] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def commit(self, batch: CommitBatch) -> Any:
        if batch.expect and self.before is not None:
            race, self.before = self.before, None
            await race()
        return await self.inner.commit(batch)


async def test_a_replica_that_lost_the_race_decides_again_on_what_is_there(
    tmp_path: Path,
) -> None:
    """Two replicas register two challengers at once (the topics' partitions can sit on
    different replicas): one wins; the other's commit fails on the stream's end and its
    handler runs again — and finds a challenger already there."""
    async with open_stage(tmp_path / "a") as a:
        await a.register(1)
        racing = RacingLog(a.log)
        async with (
            open_stage(tmp_path / "b", log=cast(EventLog, racing)) as b,
            open_stage(tmp_path / "c", log=a.log) as c,
        ):

            async def other_replica() -> None:
                v2 = WorkflowRegistered(tenant=TENANT, definition=version_doc(2))
                await c.send(WORKFLOWS, v2, mid="v2")

            racing.before = other_replica
            v3 = WorkflowRegistered(tenant=TENANT, definition=version_doc(3))
            await b.send(WORKFLOWS, v3, mid="v3")
            (entry,) = [e for e in await a.take() if isinstance(e, OutboxEntry)]
            assert "already has challenger" in dict(entry.headers)["assay-dlq-reason"].decode()
        alloc = await a.allocation()
        assert (alloc["generation"], alloc["challenger"]) == (2, ir(2).version)
        records = await a.log.read(BranchKey.main(TENANT, "workflow:arith"))
        sets = [r.event for r in records if isinstance(r.event, AllocationSet)]
        assert [(e.expected_generation, e.allocation.generation) for e in sets] == [(0, 1), (1, 2)]
        assert await a.state("head", "arith") == {"next": len(records)}


async def test_every_allocation_records_the_generation_it_replaced(contest: Stage) -> None:
    await contest.evidence(evidence(2, record=WinRecord(judge_wins=9), served=0))
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
        "trial",
    ]


async def test_allocation_key_and_causation_follow_the_message(stage: Stage) -> None:
    m = await stage.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=version_doc(1)))
    (row,) = await stage.log.drain_outbox(10)
    env = open_envelope(row.entry.value)
    assert row.entry.key == f"{TENANT}:arith"
    assert env.causation_id == open_envelope(m.value).id
    assert env.tenant == TENANT
    assert WorkflowVersion(env.payload["current"]) == ir(1).version


# -- the sequential test -------------------------------------------------------------------


async def test_crossing_the_reject_boundary_rejects_the_challenger(contest: Stage) -> None:
    record = WinRecord(judge_losses=4, verifier_losses=2)
    out = await contest.evidence(evidence(2, record=record))
    assert [type(m) for m in out] == [ChallengerRejected, AllocationChanged]
    rejected, alloc = out
    assert rejected.workflow_version == ir(2).version
    assert "reject boundary" in rejected.reason
    assert rejected.llr <= POLICY.lower
    assert (alloc.generation, alloc.current, alloc.challenger) == (3, ir(1).version, None)
    assert alloc.definitions == {ir(1).version: definition(1)}
    decision = await contest.state("decision", ir(2).version)
    assert decision is not None
    assert (decision["accepted"], decision["outcome"], decision["rung"]) == (
        False,
        "rejected",
        "shadow",
    )
    assert await contest.standing() is None


async def test_draw_rate_above_the_ceiling_rejects_the_challenger(contest: Stage) -> None:
    record = WinRecord(judge_wins=3, judge_losses=2, draws=15)
    out = await contest.evidence(evidence(2, record=record, screened=1))
    assert [type(m) for m in out] == [ChallengerRejected, AllocationChanged]
    assert "draw rate 15/20" in out[0].reason
    assert (out[1].challenger, out[1].current) == (None, ir(1).version)


async def test_evidence_for_a_version_that_is_not_the_live_challenger_is_ignored(
    contest: Stage,
) -> None:
    wins = WinRecord(judge_wins=20)
    assert await contest.evidence(evidence(1, record=wins)) == []  # the current version itself
    assert await contest.evidence(evidence(3, record=wins)) == []  # never registered
    assert await contest.evidence(evidence(2, 3, record=wins)) == []  # another baseline
    alloc = await contest.allocation()
    assert (alloc["generation"], alloc["challenger"]) == (2, ir(2).version)


async def test_evidence_before_any_registration_is_ignored(stage: Stage) -> None:
    assert await stage.evidence(evidence(2, record=WinRecord(judge_wins=20))) == []
    assert stage.runner.dead_lettered == 0


async def test_a_decided_challenger_is_not_decided_again(contest: Stage) -> None:
    await contest.evidence(evidence(2, record=WinRecord(judge_losses=6)))
    assert await contest.evidence(evidence(2, record=WinRecord(judge_losses=7))) == []
    assert await contest.evidence(evidence(2, record=WinRecord(judge_wins=20))) == []
    assert (await contest.allocation())["generation"] == 3


async def test_after_a_rejection_a_new_version_can_challenge(contest: Stage) -> None:
    await contest.evidence(evidence(2, record=WinRecord(judge_losses=6)))
    alloc = only_allocation(await contest.register(3))
    assert (alloc.generation, alloc.current, alloc.challenger) == (4, ir(1).version, ir(3).version)
    assert set(alloc.definitions) == {ir(1).version, ir(3).version}
    # the rejected version stays known: registering it again does not revive it
    assert await contest.register(2) == []


async def test_after_a_promotion_the_old_current_cannot_return_as_challenger(
    contest: Stage,
) -> None:
    await contest.evidence(evidence(2, record=WinRecord(judge_wins=9)))  # -> trial
    out = await contest.evidence(
        evidence(2, record=WinRecord(judge_wins=9), served=LADDER.min_trial_runs)
    )
    assert [type(m) for m in out] == [Promoted, AllocationChanged]
    assert await contest.register(1) == []
    alloc = only_allocation(await contest.register(3))
    assert (alloc.generation, alloc.current, alloc.challenger) == (5, ir(2).version, ir(3).version)
    assert set((await contest.allocation())["definitions"]) == {ir(2).version, ir(3).version}
    known = [k for k, _ in await contest.log.scan(TENANT, "known")]
    assert sorted(known) == sorted(v.version for v in (ir(1), ir(2), ir(3)))
