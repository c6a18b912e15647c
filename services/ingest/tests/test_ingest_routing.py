"""Ingest's routing by the latest allocation, the recorded draws, the held-out split,
and the version DAG's parents (§12.1, §12.2, §12.5)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import assay_ingest
from assay.bus import DECISIONS, RUNS, TASKS, WORKFLOWS
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import StubJudge
from assay.grading.ladder import LadderPolicy
from assay.kernel import TaskId, TenantId, WorkflowId, WorkflowVersion, content_hash
from assay.messages import (
    AllocationChanged,
    Purpose,
    Role,
    Rung,
    RunSpawned,
    WorkflowRegistered,
)
from assay.record import StateKey
from assay.runtime import StageDeps
from assay.store import FsBlobStore
from assay.workflow import WorkflowDef
from assay_ingest.routing import Allocation, draw, held_out, route
from services.ingest.tests.test_ingest_consumer import (
    ARITH,
    TENANT,
    Harness,
    arith,
    assert_dead_lettered,
    decoded,
    open_harness,
    task,
)

V2_DOC = arith(
    steps=[
        {"id": "solve", "kind": "model", "prompt": "Step by step: {{ task.question }}?"},
        {"id": "answer", "kind": "tool", "tool": "extract_number", "args": {"text": "x"}},
    ]
)
FRACTION = 0.5


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    deps = StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        ladder=LadderPolicy(held_out_fraction=FRACTION),
    )
    harness = await open_harness(tmp_path, assay_ingest.create_stage(deps))
    try:
        yield harness
    finally:
        await harness.log.close()
        await harness.bus.close()


async def contest(
    h: Harness, *, share: float, shadow_rate: float = 1.0, rung: Rung = Rung.TRIAL
) -> tuple[WorkflowDef, WorkflowDef]:
    v1, v2 = await h.register(ARITH), await h.register(V2_DOC)
    await h.send(
        DECISIONS,
        AllocationChanged(
            tenant=TENANT,
            workflow_id=v1.id,
            generation=2,
            current=v1.version,
            challenger=v2.version,
            challenger_share=share,
            shadow_rate=shadow_rate,
            rung=rung,
            definitions={v.version: v.model_dump(mode="json", by_alias=True) for v in (v1, v2)},
        ),
    )
    assert await h.take() == []
    return v1, v2


def question(i: int) -> dict[str, Any]:
    return {"question": f"{i} + 1", "answer": str(i + 1)}


def task_id(i: int) -> TaskId:
    return TaskId(content_hash(question(i)))


async def spawned(h: Harness) -> list[RunSpawned]:
    out = []
    for entry in await h.take():
        if entry.topic == RUNS:
            _, msg = decoded(entry)
            assert isinstance(msg, RunSpawned)
            out.append(msg)
    return out


# -- routing --------------------------------------------------------------------------


async def test_a_challenger_served_task_is_also_run_under_the_current_as_its_reference(
    h: Harness,
) -> None:
    v1, v2 = await contest(h, share=1.0)
    await h.send(TASKS, task("t-1"))
    served, reference = await spawned(h)
    assert (served.run.role, served.run.purpose) == (Role.CHALLENGER, Purpose.WORK)
    assert served.run.workflow_version == v2.version
    assert served.run.baseline_version == v1.version
    assert served.run.reference_expected  # it waits for the reference to be graded
    assert (reference.run.role, reference.run.purpose) == (Role.CURRENT, Purpose.SHADOW)
    assert reference.run.workflow_version == v1.version
    assert not reference.run.reference_expected
    doc = await h.log.get(StateKey(TENANT, "task", "t-1"))
    assert doc is not None
    assert (doc["arm"], doc["rung"], doc["generation"]) == ("challenger", "trial", 2)


async def test_a_current_served_task_is_replayed_under_the_challenger(h: Harness) -> None:
    await contest(h, share=0.0, rung=Rung.SHADOW)
    await h.send(TASKS, task("t-1"))
    served, replay = await spawned(h)
    assert (served.run.role, served.run.purpose) == (Role.CURRENT, Purpose.WORK)
    assert (replay.run.role, replay.run.purpose) == (Role.CHALLENGER, Purpose.SHADOW)
    assert replay.run.reference_expected
    doc = await h.log.get(StateKey(TENANT, "task", "t-1"))
    assert doc is not None
    assert (doc["arm"], doc["rung"]) == ("current", "shadow")


async def test_without_a_replay_a_served_challenger_run_expects_no_reference(h: Harness) -> None:
    await contest(h, share=1.0, shadow_rate=0.0)
    await h.send(TASKS, task("t-1"))
    (served,) = await spawned(h)
    assert served.run.role is Role.CHALLENGER
    assert not served.run.reference_expected


async def test_the_recorded_draws_decide_the_arm_and_are_the_same_for_the_same_task(
    h: Harness,
) -> None:
    await contest(h, share=0.3, shadow_rate=0.0)
    for i in range(40):
        await h.send(TASKS, task(f"t-{i}", input=question(i)))
        await h.send(TASKS, task(f"again-{i}", input=question(i)))
    docs = dict(await h.log.scan(TENANT, "task"))
    arms = set()
    for i in range(40):
        first, again = docs[f"t-{i}"], docs[f"again-{i}"]
        assert first["serve_draw"] == again["serve_draw"] == draw(task_id(i), "serve")
        expected = "challenger" if first["serve_draw"] < 0.3 else "current"
        assert first["arm"] == again["arm"] == expected
        assert [r["role"] for r in first["runs"]] == [expected]
        arms.add(expected)
    assert arms == {"challenger", "current"}


@settings(max_examples=200, deadline=None)
@given(
    st.text(min_size=1, max_size=20),
    st.floats(0, 1),
    st.floats(0, 1),
    st.floats(0, 1),
)
def test_raising_the_share_keeps_the_tasks_the_challenger_served(
    key: str, low: float, high: float, rate: float
) -> None:
    low, high = sorted((low, high))
    tid = TaskId(content_hash({"k": key}))
    alloc = Allocation(
        tenant=TenantId(uuid.UUID(int=1)),
        workflow_id=WorkflowId("w"),
        generation=1,
        current=WorkflowVersion("a" * 64),
        challenger=WorkflowVersion("b" * 64),
        challenger_share=low,
        shadow_rate=rate,
        definitions={},
    )
    before = route(alloc, tid)
    after = route(alloc.model_copy(update={"challenger_share": high}), tid)
    if before.arm is Role.CHALLENGER:
        assert after.arm is Role.CHALLENGER
    for plan in (before, after):
        assert len(plan.runs) == (2 if plan.shadow_draw < rate else 1)
        assert plan.runs[0].role is plan.arm
        assert plan.runs[0].purpose is Purpose.WORK
        versions = {r.version for r in plan.runs}
        assert versions <= {WorkflowVersion("a" * 64), WorkflowVersion("b" * 64)}


# -- the held-out split ----------------------------------------------------------------------


async def test_the_held_out_split_is_by_task_id_and_rides_on_every_run(h: Harness) -> None:
    await contest(h, share=0.0, rung=Rung.SHADOW)
    split = set()
    for i in range(30):
        await h.send(TASKS, task(f"t-{i}", input=question(i)))
        runs = await spawned(h)
        expected, d = held_out(task_id(i), FRACTION)
        assert {r.run.held_out for r in runs} == {expected}
        doc = await h.log.get(StateKey(TENANT, "task", f"t-{i}"))
        assert doc is not None
        assert (doc["held_out"], doc["held_out_draw"]) == (expected, d)
        split.add(expected)
    assert split == {True, False}


def test_the_split_follows_the_fraction_and_nothing_else() -> None:
    ids = [task_id(i) for i in range(2000)]
    assert not any(held_out(t, 0.0)[0] for t in ids)
    share = sum(held_out(t, 0.2)[0] for t in ids) / len(ids)
    assert 0.17 < share < 0.23
    # independent of routing: the held-out draw is not the serve draw
    assert all(held_out(t, 0.2)[1] != draw(t, "serve") for t in ids[:50])


# -- the version DAG -----------------------------------------------------------------------


async def test_a_merge_names_both_its_parents(h: Harness) -> None:
    v1 = await h.register(ARITH)
    v2 = await h.register(V2_DOC)
    v3_doc = arith(
        steps=[
            {"id": "solve", "kind": "model", "prompt": "Carefully: {{ task.question }}?"},
            {"id": "answer", "kind": "tool", "tool": "extract_number", "args": {"text": "x"}},
        ]
    )
    await h.send(
        WORKFLOWS,
        WorkflowRegistered(tenant=TENANT, definition=v3_doc, parents=[v1.version]),
    )
    merge_doc = {**v3_doc, "description": "merged"}
    parents = [WorkflowVersion(v2.version), WorkflowVersion(v1.version)]
    await h.send(
        WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=merge_doc, parents=parents)
    )
    assert await h.take() == []
    defs = dict(await h.log.scan(TENANT, "definition"))
    v3 = WorkflowDef.model_validate(v3_doc).version
    merge = WorkflowDef.model_validate(merge_doc).version
    assert defs[v2.version]["parents"] == [v1.version]  # by default: the latest
    assert defs[v3]["parents"] == [v1.version]  # a sibling of v2, not its child
    assert defs[merge]["parents"] == [v2.version, v1.version]
    assert defs[merge]["parent"] == v2.version


async def test_a_parent_that_is_not_a_version_of_the_workflow_is_refused(h: Harness) -> None:
    await h.register(ARITH)
    other = WorkflowVersion("0" * 64)
    m = await h.send(
        WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=V2_DOC, parents=[other])
    )
    await assert_dead_lettered(h, m, "parent", "is not a registered version")


async def test_a_new_root_beside_registered_versions_needs_rewrite(h: Harness) -> None:
    await h.register(ARITH)
    m = await h.send(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=V2_DOC, parents=[]))
    await assert_dead_lettered(h, m, "new root", "rewrite")
    await h.send(
        WORKFLOWS,
        WorkflowRegistered(tenant=TENANT, definition=V2_DOC, parents=[], rewrite=True),
    )
    stored = await h.log.get(
        StateKey(TENANT, "definition", WorkflowDef.model_validate(V2_DOC).version)
    )
    assert stored is not None
    assert stored["parents"] == []


async def test_a_stored_version_is_never_edited(h: Harness) -> None:
    v1 = await h.register(ARITH)
    v2 = await h.register(V2_DOC)
    before = await h.log.get(StateKey(TENANT, "definition", v2.version))
    await h.send(
        WORKFLOWS,
        WorkflowRegistered(tenant=TENANT, definition=V2_DOC, parents=[]),
        mid="again",
    )
    assert await h.log.get(StateKey(TENANT, "definition", v2.version)) == before
    assert before is not None
    assert before["parents"] == [v1.version]
