"""Ingest under several live challengers (§12.1): the shares split live traffic, a
replayed task runs under every challenger, and a workflow asking for more challengers
than it may have is refused at registration."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import assay_ingest
from assay.bus import DECISIONS, TASKS, WORKFLOWS
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import StubJudge
from assay.grading.ladder import LadderPolicy, split_shares
from assay.kernel import TaskId, WorkflowId, WorkflowVersion
from assay.messages import (
    AllocationChanged,
    LiveChallenger,
    Purpose,
    Role,
    Rung,
    WorkflowRegistered,
)
from assay.record import StateKey
from assay.runtime import StageDeps
from assay.store import FsBlobStore
from assay_ingest.routing import Allocation, route
from services.ingest.tests.test_ingest_consumer import (
    ARITH,
    TENANT,
    Harness,
    arith,
    assert_dead_lettered,
    open_harness,
    task,
)
from services.ingest.tests.test_ingest_routing import spawned

TOURNAMENT = {"strategy": "tournament", "quorum": 3}
CEILING = 3


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    deps = StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        ladder=LadderPolicy(held_out_fraction=0.0, max_challengers=CEILING),
    )
    harness = await open_harness(tmp_path, assay_ingest.create_stage(deps))
    try:
        yield harness
    finally:
        await harness.log.close()
        await harness.bus.close()


def version_doc(n: int, **grading: Any) -> dict[str, Any]:
    solve = {"id": "solve", "kind": "model", "prompt": f"v{n}: {{{{ task.question }}}}"}
    return arith(steps=[solve, ARITH["steps"][1]], grading={**TOURNAMENT, **grading})


# -- the split: pure ------------------------------------------------------------------------

VERSIONS = [WorkflowVersion(f"v{i}") for i in range(1, 6)]


@given(
    requested=st.lists(st.floats(0, 0.5), min_size=0, max_size=4),
    ceiling=st.floats(0.01, 0.99),
)
def test_shares_always_sum_to_the_live_traffic(requested: list[float], ceiling: float) -> None:
    current, live = VERSIONS[0], VERSIONS[1 : len(requested) + 1]
    shares = split_shares(current, list(zip(live, requested, strict=True)), ceiling)
    assert set(shares) == {current, *live}
    assert math.isclose(math.fsum(shares.values()), 1.0, abs_tol=1e-12)
    assert all(v >= 0 for v in shares.values())
    together = math.fsum(shares[v] for v in live)
    assert together <= ceiling + 1e-12
    if math.fsum(requested) <= ceiling:  # within the ceiling each keeps its rung share
        assert [shares[v] for v in live] == requested
    # the allocation carrying them validates, and routes every draw to one live version
    alloc = Allocation(
        tenant=TENANT,
        workflow_id=WorkflowId("arith"),
        generation=1,
        current=current,
        challengers=[LiveChallenger(version=v, rung=Rung.CANARY) for v in live],
        shares=shares,
        challenger_share=shares[live[0]] if live else 0.0,
        shadow_rate=0.0,
        definitions={},
    )
    grid = 2000
    served = [alloc.serving((i + 0.5) / grid) or current for i in range(grid)]
    for v in (current, *live):  # each version serves its share of the draws
        assert abs(served.count(v) / grid - shares[v]) <= 1.5 / grid * (len(live) + 1)


def test_an_allocation_whose_shares_do_not_sum_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="shares must sum to 1"):
        AllocationChanged(
            tenant=TENANT,
            workflow_id=WorkflowId("arith"),
            generation=1,
            current=VERSIONS[0],
            challengers=[LiveChallenger(version=VERSIONS[1], rung=Rung.CANARY)],
            shares={VERSIONS[0]: 0.9, VERSIONS[1]: 0.05},
            definitions={},
        )
    with pytest.raises(ValueError, match="every challenger"):
        AllocationChanged(
            tenant=TENANT,
            workflow_id=WorkflowId("arith"),
            generation=1,
            current=VERSIONS[0],
            challengers=[LiveChallenger(version=VERSIONS[1], rung=Rung.CANARY)],
            shares={VERSIONS[0]: 1.0},
            definitions={},
        )


def test_a_replayed_task_runs_under_every_challenger_once() -> None:
    current, a, b = VERSIONS[:3]
    alloc = Allocation(
        tenant=TENANT,
        workflow_id=WorkflowId("arith"),
        generation=3,
        current=current,
        challengers=[
            LiveChallenger(version=a, rung=Rung.SHADOW),
            LiveChallenger(version=b, rung=Rung.SHADOW),
        ],
        shares={current: 1.0, a: 0.0, b: 0.0},
        challenger_share=0.0,
        shadow_rate=1.0,
        definitions={},
    )
    plan = route(alloc, TaskId("t"))
    assert plan.arm is Role.CURRENT
    assert [(r.role, r.purpose, r.version) for r in plan.runs] == [
        (Role.CURRENT, Purpose.WORK, current),
        (Role.CHALLENGER, Purpose.SHADOW, a),
        (Role.CHALLENGER, Purpose.SHADOW, b),
    ]
    assert all(plan.reference_expected(r) for r in plan.runs[1:])


# -- through the stage ----------------------------------------------------------------------


async def test_each_challenger_gets_its_own_run_and_the_served_one_its_reference(
    h: Harness,
) -> None:
    v1, v2, v3 = [await h.register(version_doc(n, challengers=2)) for n in (1, 2, 3)]
    defs = {v.version: v.model_dump(mode="json", by_alias=True) for v in (v1, v2, v3)}

    async def allocate(generation: int, shares: dict[str, float]) -> None:
        await h.send(
            DECISIONS,
            AllocationChanged(
                tenant=TENANT,
                workflow_id=v1.id,
                generation=generation,
                current=v1.version,
                challengers=[LiveChallenger(version=v.version, rung=Rung.CANARY) for v in (v2, v3)],
                shares=shares,
                shadow_rate=1.0,
                definitions=defs,
            ),
        )
        assert await h.take() == []

    await allocate(2, {v1.version: 1.0, v2.version: 0.0, v3.version: 0.0})
    await h.send(TASKS, task("t-1"))
    runs = await spawned(h)
    assert [(r.run.role, r.run.workflow_version) for r in runs] == [
        (Role.CURRENT, v1.version),
        (Role.CHALLENGER, v2.version),
        (Role.CHALLENGER, v3.version),
    ]
    assert len({r.run.run_id for r in runs}) == 3
    assert all(r.run.baseline_version == v1.version for r in runs[1:])
    # all live traffic to the second challenger: it serves, the current is its reference
    await allocate(3, {v1.version: 0.0, v2.version: 0.0, v3.version: 1.0})
    await h.send(TASKS, task("t-2"))
    served, reference = await spawned(h)
    assert (served.run.role, served.run.workflow_version) == (Role.CHALLENGER, v3.version)
    assert (reference.run.role, reference.run.purpose) == (Role.CURRENT, Purpose.SHADOW)
    doc = await h.log.get(StateKey(TENANT, "task", "t-2"))
    assert doc is not None
    assert (doc["arm"], doc["rung"]) == ("challenger", "canary")


async def _refused(h: Harness, doc: dict[str, Any], *needles: str) -> None:
    m = await h.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=doc))
    await assert_dead_lettered(h, m, *needles)
    assert await h.log.scan_kind("definition") == []  # nothing of it was stored


async def test_more_challengers_than_the_ceiling_are_refused_at_registration(
    h: Harness,
) -> None:
    await _refused(
        h, version_doc(1, challengers=CEILING + 1), "grading.challengers is 4", "ceiling of 3"
    )


async def test_several_challengers_without_a_grouped_strategy_are_refused(h: Harness) -> None:
    doc = {**ARITH, "grading": {"strategy": "pairwise_sequential", "challengers": 2}}
    await _refused(h, doc, "grouped strategy", "pairwise_sequential")


async def test_fewer_than_one_challenger_is_refused(h: Harness) -> None:
    await _refused(h, version_doc(1, challengers=0), "challengers", "greater than or equal to 1")
