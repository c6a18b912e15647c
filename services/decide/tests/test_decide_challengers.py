"""Several live challengers through the decide stage (§12.1, §12.3): admission up to the
workflow's `grading.challengers`, traffic split by rung, one promotion at a time (the
strongest first) that ends every other challenger's time."""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from assay.bus import AGGREGATES, dlq
from assay.cli.ladder import reports
from assay.grading.ladder import LadderPolicy
from assay.kernel import TenantId
from assay.kernel.scores import WinRecord
from assay.messages import (
    AllocationChanged,
    ChallengerRejected,
    Promoted,
    RolledBack,
    Rung,
    VariantAggregate,
)
from assay.store import OutboxEntry
from services.decide.tests.decide_harness import (
    LADDER,
    TENANT,
    Stage,
    ir,
    open_stage,
    strength,
)

TWO = {"grading": {"strategy": "tournament", "quorum": 2, "challengers": 2}}
"""The current version: tournament-graded, two live challengers at once."""
TOURNAMENT = {"grading": {"strategy": "tournament", "quorum": 2}}
WINS = WinRecord(judge_wins=6, verifier_wins=3)  # crosses the accept boundary
SOME = WinRecord(judge_wins=3, judge_losses=1)  # within the boundaries
NO_RAMP = LadderPolicy(ramp_shares=())  # canary -> current


def version(n: int) -> str:
    return ir(n, **(TWO if n == 1 else TOURNAMENT)).version


def agg(n: int, record: WinRecord, mean: float, episodes: int, **fields: Any) -> VariantAggregate:
    """Challenger n's evidence against version 1: every episode clean and passing."""
    runs = record.comparisons + record.capped
    return VariantAggregate(
        tenant=TENANT,
        workflow_id=ir(n).id,
        workflow_version=version(n),
        baseline_version=version(1),
        record=record,
        runs=fields.pop("runs", runs),
        passes=fields.pop("passes", runs),
        screened=runs - record.capped,
        strength=strength(mean, mean - 0.4, mean + 0.4, episodes),
        **fields,
    )


def canary(n: int, mean: float = 0.6) -> VariantAggregate:
    return agg(n, SOME, mean, LADDER.min_strength_episodes + 3)


def qualifies(n: int, mean: float = 0.6, **fields: Any) -> VariantAggregate:
    """Evidence that promotes a challenger on canary (without ramp shares)."""
    return agg(n, WINS, mean, 20, served=LADDER.min_trial_runs, **fields)


INCONSISTENT = {"order_checked": 10, "order_inconsistent": 9}  # the drift check holds


@pytest.fixture
async def two(tmp_path: Path) -> AsyncIterator[Stage]:
    """Version 1 current; versions 2 and 3 live challengers in shadow; no ramp."""
    async with open_stage(tmp_path, ladder=NO_RAMP) as s:
        await s.register(1, **TWO)
        await s.register(2, **TOURNAMENT)
        await s.register(3, **TOURNAMENT)
        yield s


def allocation_of(out: list[Any]) -> AllocationChanged:
    (alloc,) = [m for m in out if isinstance(m, AllocationChanged)]
    return alloc


async def test_two_challengers_are_admitted_in_shadow(two: Stage) -> None:
    alloc = AllocationChanged.model_validate(await two.allocation())
    assert [(c.version, c.rung) for c in alloc.challengers] == [
        (version(2), Rung.SHADOW),
        (version(3), Rung.SHADOW),
    ]
    assert alloc.shares == {version(1): 1.0, version(2): 0.0, version(3): 0.0}
    assert set(await two.standings()) == {version(2), version(3)}


async def test_a_third_challenger_beyond_the_workflows_two_is_refused(two: Stage) -> None:
    (entry,) = await two.register(4, **TOURNAMENT)
    assert isinstance(entry, OutboxEntry)
    assert entry.topic == dlq("decide")
    reason = dict(entry.headers)["assay-dlq-reason"].decode()
    assert "at most 2 at a time" in reason
    assert version(2) in reason
    assert version(3) in reason
    assert len((await two.allocation())["challengers"]) == 2


async def test_each_challenger_climbs_on_its_own_evidence_and_shares_split(two: Stage) -> None:
    alloc = allocation_of(await two.evidence(canary(3)))
    assert [(c.version, c.rung) for c in alloc.challengers] == [
        (version(2), Rung.SHADOW),
        (version(3), Rung.CANARY),
    ]
    assert alloc.shares == {
        version(1): pytest.approx(1 - LADDER.trial_share),
        version(2): 0.0,
        version(3): LADDER.trial_share,
    }
    assert (alloc.challenger, alloc.challenger_share) == (version(2), 0.0)  # the first one
    alloc = allocation_of(await two.evidence(canary(2)))  # together within the ceiling
    assert NO_RAMP.challengers_ceiling == NO_RAMP.trial_share  # no ramp: canary's share
    assert alloc.shares[version(2)] == alloc.shares[version(3)] == NO_RAMP.trial_share / 2
    assert math.isclose(math.fsum(alloc.shares.values()), 1.0)


async def test_promoting_one_ends_the_others_time_as_superseded(two: Stage) -> None:
    await two.evidence(canary(2))
    await two.evidence(canary(3))
    out = await two.evidence(qualifies(3))
    assert [type(m) for m in out] == [Promoted, ChallengerRejected, AllocationChanged]
    assert out[0].workflow_version == version(3)
    assert out[1].workflow_version == version(2)
    assert out[1].reason.startswith("superseded")
    assert (out[2].current, out[2].challengers) == (version(3), [])
    assert out[2].shares == {version(3): 1.0}
    assert await two.standings() == {}
    decided = await two.state("decision", version(2))
    assert decided is not None
    assert decided["outcome"] == "rejected"
    # the superseded one's later evidence (against the old current) moves nothing
    assert await two.evidence(qualifies(2)) == []


async def test_a_weaker_challenger_waits_while_a_stronger_one_is_held(two: Stage) -> None:
    await two.evidence(canary(2))
    await two.evidence(canary(3))
    assert await two.evidence(qualifies(2, mean=0.9, **INCONSISTENT)) == []  # held by drift
    assert (await two.standings())[version(2)]["held_strength"] == 0.9
    assert await two.evidence(qualifies(3, mean=0.5)) == []  # qualifies, but weaker
    held = (await two.standings())[version(3)]["held"]
    assert held is not None
    assert f"challenger {version(2)} qualified stronger" in held
    out = await two.evidence(qualifies(2, mean=0.9))  # the drift check is clean again
    assert [type(m) for m in out] == [Promoted, ChallengerRejected, AllocationChanged]
    assert (out[0].workflow_version, out[1].workflow_version) == (version(2), version(3))


async def test_a_stronger_challenger_is_not_kept_waiting_by_a_weaker_held_one(two: Stage) -> None:
    await two.evidence(canary(2))
    await two.evidence(canary(3))
    assert await two.evidence(qualifies(2, mean=0.5, **INCONSISTENT)) == []
    out = await two.evidence(qualifies(3, mean=0.8))
    assert [type(m) for m in out] == [Promoted, ChallengerRejected, AllocationChanged]
    assert out[0].workflow_version == version(3)


async def test_on_equal_strength_the_challenger_admitted_first_goes_first(two: Stage) -> None:
    await two.evidence(canary(2))
    await two.evidence(canary(3))
    assert await two.evidence(qualifies(2, mean=0.7, **INCONSISTENT)) == []
    assert await two.evidence(qualifies(3, mean=0.7)) == []  # tie: version 2 was first


async def test_a_rollback_frees_a_place_and_the_other_keeps_climbing(two: Stage) -> None:
    await two.evidence(canary(2))
    await two.evidence(canary(3))
    capped = agg(3, WinRecord(judge_wins=2, capped=1), 0.6, 8)
    out = await two.evidence(capped)
    assert isinstance(out[0], RolledBack)  # then the allocation, and the proposer is asked
    alloc = allocation_of(out)
    assert alloc.current == version(1)
    assert [c.version for c in alloc.challengers] == [version(2)]
    assert alloc.shares == {version(1): 1 - LADDER.trial_share, version(2): LADDER.trial_share}
    assert set(alloc.definitions) == {version(1), version(2)}
    assert set(await two.standings()) == {version(2)}
    out = await two.register(4, **TOURNAMENT)  # the freed place takes a new one
    assert [c.version for c in allocation_of(out).challengers] == [version(2), version(4)]


async def test_ramp_shares_of_several_challengers_are_scaled_under_the_ceiling(
    tmp_path: Path,
) -> None:
    async with open_stage(tmp_path) as s:  # the default ramp: 20% then 50%
        await s.register(1, **TWO)
        await s.register(2, **TOURNAMENT)
        await s.register(3, **TOURNAMENT)
        k = LADDER.ramp_episodes
        for n in (2, 3):
            await s.evidence(canary(n))
            await s.evidence(agg(n, WINS, 0.6, 10, served=LADDER.min_trial_runs))  # ramp 20%
            out = await s.evidence(agg(n, WINS, 0.6, 10 + k))  # ramp 50%
        alloc = allocation_of(out)
        assert [c.rung for c in alloc.challengers] == [Rung.RAMP, Rung.RAMP]
        ceiling = LADDER.challengers_ceiling
        assert alloc.shares[version(2)] == alloc.shares[version(3)] == ceiling / 2
        assert alloc.shares[version(1)] == pytest.approx(1 - ceiling)


# -- property: one promotion at a time ---------------------------------------------------------

LOOK = st.tuples(
    st.sampled_from([2, 3]),
    st.sampled_from(["canary", "qualifies", "held", "some", "capped", "worse"]),
    st.sampled_from([0.3, 0.6, 0.9]),
)


def look(n: int, kind: str, mean: float) -> VariantAggregate:
    match kind:
        case "canary":
            return canary(n, mean)
        case "qualifies":
            return qualifies(n, mean)
        case "held":
            return qualifies(n, mean, **INCONSISTENT)
        case "capped":
            return agg(n, WinRecord(judge_wins=2, capped=1), mean, 8)
        case "worse":
            return agg(n, SOME, -mean, 8)
    return agg(n, SOME, mean, 3)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(looks=st.lists(LOOK, min_size=1, max_size=10))
async def test_no_look_ever_promotes_two_or_keeps_a_challenger_past_a_promotion(
    tmp_path_factory: pytest.TempPathFactory, looks: list[tuple[int, str, float]]
) -> None:
    async with open_stage(tmp_path_factory.mktemp("p"), ladder=NO_RAMP) as s:
        await s.register(1, **TWO)
        await s.register(2, **TOURNAMENT)
        await s.register(3, **TOURNAMENT)
        promoted = 0
        for n, kind, mean in looks:
            out = await s.evidence(look(n, kind, mean))
            wins = [m for m in out if isinstance(m, Promoted)]
            assert len(wins) <= 1
            promoted += len(wins)
            allocs = [m for m in out if isinstance(m, AllocationChanged)]
            assert len(allocs) <= 1
            for alloc in allocs:
                assert math.isclose(math.fsum(alloc.shares.values()), 1.0)
                if wins:
                    assert alloc.current == wins[0].workflow_version
                    assert alloc.challengers == []
        assert promoted <= 1  # nothing is left to promote against the old current


async def test_assay_ladder_reports_every_live_challenger(two: Stage) -> None:
    await two.evidence(canary(3))
    (report,) = await reports(two.log, two.log, TENANT)  # no aggregate state needed here
    live = report["challengers"]
    assert [(c["version"], c["rung"], c["share"]) for c in live] == [
        (version(2), "shadow", 0.0),
        (version(3), "canary", NO_RAMP.trial_share),
    ]
    assert live[1]["standing"]["entered_episodes"] == LADDER.min_strength_episodes + 3
    assert (report["challenger"], report["rung"]) == (version(2), "shadow")  # the first
    assert report["standing"] == live[0]["standing"]


async def test_another_tenants_evidence_moves_none_of_this_tenants_challengers(
    two: Stage,
) -> None:
    other = TenantId(uuid.UUID("00000000-0000-4000-8000-0000000000d2"))
    before = await two.allocation()
    theirs = qualifies(3).model_copy(update={"tenant": other})
    await two.send(AGGREGATES, theirs, tenant=other)
    assert await two.take() == []  # the other tenant holds no such workflow
    assert await two.allocation() == before
    assert set(await two.standings()) == {version(2), version(3)}
