"""Admission by capacity at ingest (§14.2): each planned run's demand is held against
the declared VRAM beside the runs in flight; a shadow run that cannot fit is cut alone,
a work run that cannot fit refuses its task whole — recorded, announced, and given its
result — and a run that stops executing lets its KV go."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import assay_ingest
from assay.bus import DECISIONS, RUN_STATUS, TASKS
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import StubJudge
from assay.kernel import RunState
from assay.messages import (
    AllocationChanged,
    Purpose,
    RolloutBudget,
    RolloutProgress,
    RolloutSpec,
    RunResult,
    RunSpawned,
    RunStatusChanged,
    message_id,
    open_envelope,
    seal,
)
from assay.record import StateKey
from assay.runtime import StageDeps, UnitOfWork
from assay.runtime.admission import Admission
from assay.runtime.capacity_plan import plan_capacity
from assay.runtime.settings import AssaySettings
from assay.store import FsBlobStore
from services.ingest.tests.test_ingest_consumer import (
    ARITH,
    TENANT,
    Harness,
    arith,
    decoded,
    envelope_bytes,
    ir,
    open_harness,
    task,
)

# 40 GB, 10 GB of weights, 1 MB of KV a token: a run of 10,000 tokens holds 10 GB, so
# three runs fit beside the weights and a fourth does not.
CAPACITY = {
    "ASSAY_CAPACITY_VRAM_BYTES_PER_DEVICE": "40GB",
    "ASSAY_CAPACITY_PINNED": "m",
    "ASSAY_CAPACITY_MODELS": '[{"id": "m", "weights_bytes": "10GB", "kv_bytes_per_token": "1MB"}]',
}
RESOURCES = {"model": "m", "max_context_tokens": 10_000}


@pytest.fixture
def admission() -> Admission:
    return Admission(plan_capacity(AssaySettings.from_env(CAPACITY)))


@pytest.fixture
async def h(tmp_path: Path, admission: Admission) -> AsyncIterator[Harness]:
    deps = StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        admission=admission,
    )
    harness = await open_harness(tmp_path, assay_ingest.create_stage(deps))
    try:
        yield harness
    finally:
        await harness.log.close()
        await harness.bus.close()


async def contest(h: Harness) -> None:
    """v1 serves every task; v2 runs in its shadow on every one."""
    v1 = await h.register(arith(resources=RESOURCES))
    solve = {**ARITH["steps"][0], "prompt": "Compute {{ task.question }}."}
    v2 = await h.register(arith(resources=RESOURCES, steps=[solve, ARITH["steps"][1]]))
    await h.send(
        DECISIONS,
        AllocationChanged(
            tenant=TENANT,
            workflow_id=v1.id,
            generation=2,
            current=v1.version,
            challenger=v2.version,
            challenger_share=0.0,
            shadow_rate=1.0,
            definitions={v.version: v.model_dump(mode="json", by_alias=True) for v in (v1, v2)},
        ),
    )
    assert await h.take() == []


async def submit(h: Harness, key: str) -> tuple[dict[str, Any], list[Any]]:
    await h.send(TASKS, task(key, input={"question": key, "answer": "1"}))
    doc = await h.log.get(StateKey(TENANT, "task", key))
    assert doc is not None
    return doc, [decoded(e)[1] for e in await h.take()]


async def test_shadow_runs_are_cut_first_and_a_work_run_that_cannot_fit_refuses_its_task(
    h: Harness, admission: Admission
) -> None:
    await contest(h)
    first, sent = await submit(h, "t-1")
    assert [r["purpose"] for r in first["runs"]] == ["work", "shadow"]
    assert first["cut"] == []
    work_1 = next(m for m in sent if isinstance(m, RunSpawned) and m.run.purpose is Purpose.WORK)

    second, _ = await submit(h, "t-2")  # its work run is the third that fits
    assert [r["purpose"] for r in second["runs"]] == ["work"]
    [shadow_cut] = second["cut"]
    assert (shadow_cut["purpose"], shadow_cut["reason"]) == ("shadow", "capacity")

    third, sent = await submit(h, "t-3")  # nothing of it fits: refused, never queued
    assert third["runs"] == []
    assert [(c["purpose"], c["reason"]) for c in third["cut"]] == [
        ("work", "capacity"),
        ("shadow", "capacity"),
    ]
    assert (
        "50.00 GB exceed vram_bytes_per_device x devices = 40.00 GB x 1"
        in third["cut"][0]["detail"]
    )
    assert not any(isinstance(m, RunSpawned) for m in sent)
    [result] = [m for m in sent if isinstance(m, RunResult)]
    assert (result.idempotency_key, result.status, result.score) == ("t-3", "cancelled", None)
    cancelled = [m for m in sent if isinstance(m, RunStatusChanged)]
    assert {m.state for m in cancelled} == {RunState.CANCELLED}
    assert all(m.detail.startswith("capacity: ") for m in cancelled)
    # counted once per refusal: the shadow run t-3's work run took with it is not another
    assert admission.refused == {"capacity_vram_bytes_per_device": 2}

    # the first task's work run has executed: its KV is let go, and a task fits again
    await h.send(RUN_STATUS, RunStatusChanged(run=work_1.run, state=RunState.VERIFYING))
    fourth, _ = await submit(h, "t-4")
    assert [r["purpose"] for r in fourth["runs"]] == ["work"]
    assert admission.ledger is not None
    assert admission.ledger.held == 3
    gauges = {g.name: g.samples for g in admission.gauges()}
    assert gauges["assay_admission_refusals"] == ((("capacity_vram_bytes_per_device",), 3.0),)
    assert gauges["assay_capacity_kv_bytes_held"] == ((("m",), 30e9),)


async def test_a_redelivered_task_holds_nothing_twice(h: Harness, admission: Admission) -> None:
    await h.ready(arith(resources=RESOURCES))
    await submit(h, "t-1")
    await submit(h, "t-1")
    assert admission.ledger is not None
    assert admission.ledger.held == 1


async def test_what_a_discarded_unit_of_work_held_is_let_go(
    h: Harness, admission: Admission, tmp_path: Path
) -> None:
    env = open_envelope(envelope_bytes(TASKS, task()))
    uow: UnitOfWork[None] = UnitOfWork("ingest", h.log, FsBlobStore(tmp_path / "b"), env)
    undone: list[str] = []
    uow.on_discard(lambda: undone.append("first"))
    uow.take()  # committed: nothing to undo any more
    uow.on_discard(lambda: undone.append("second"))
    uow.discard()
    uow.discard()
    assert undone == ["second"]


async def test_registration_refuses_a_run_that_could_never_fit(h: Harness) -> None:
    too_long = arith(resources={"model": "m", "max_context_tokens": 31_000})
    m = await h.register(too_long)
    assert await h.log.get(StateKey(TENANT, "workflow", m.id)) is None
    dead = [e for e in await h.take() if e.topic.startswith("assay.dlq")]
    assert len(dead) == 1
    reason = dict(dead[0].headers)["assay-dlq-reason"].decode()
    assert "41.00 GB exceed vram_bytes_per_device x devices = 40.00 GB" in reason


async def rollout(h: Harness, key: str, n: int) -> dict[str, Any]:
    await h.send(TASKS, task(key, rollout=RolloutSpec(n=n, budget=RolloutBudget())))
    doc = await h.log.get(StateKey(TENANT, "rollout", key))
    assert doc is not None
    return doc


async def test_rollout_siblings_start_as_capacity_admits_and_a_group_that_cannot_start_closes(
    h: Harness, admission: Admission
) -> None:
    await h.ready(arith(resources=RESOURCES))
    group = await rollout(h, "g-1", n=4)
    assert [r["state"] for r in group["runs"]] == ["running"] * 3  # the fourth does not fit
    first = group["runs"][0]
    ended = RolloutProgress(
        tenant=TENANT,
        idempotency_key="g-1",
        run_id=first["run_id"],
        index=0,
        ended="verified",
        model_calls=1,
        tokens=10,
        cost_usd=0.0,
    )
    await h.send(TASKS, ended)
    after = await h.log.get(StateKey(TENANT, "rollout", "g-1"))
    assert after is not None
    assert len(after["runs"]) == 4  # its end let the fourth start
    assert admission.ledger is not None
    assert admission.ledger.held == 3

    other = await rollout(h, "g-2", n=2)  # nothing of it fits beside g-1's siblings
    assert (other["runs"], other["closed"]) == ([], True)
    assert other["detail"].startswith("the declared capacity admits no further sibling")


async def test_runs_in_flight_do_not_refuse_a_registration(
    h: Harness, admission: Admission
) -> None:
    await h.ready(arith(resources=RESOURCES))
    for key in ("t-1", "t-2", "t-3"):
        await submit(h, key)
    assert admission.ledger is not None
    assert admission.ledger.held == 3  # full
    again = await h.register(arith(resources={**RESOURCES, "concurrent_calls": 2}))
    stored = await h.log.get(StateKey(TENANT, "workflow", again.id))
    assert stored is not None
    assert stored["latest"] == again.version


def _uow(h: Harness, tmp_path: Path) -> UnitOfWork[Any]:
    env = seal(task("t-x"), tenant=TENANT, key="t-x", id=message_id("t", "t-x"), causation=None)
    return UnitOfWork("ingest", h.log, FsBlobStore(tmp_path / "blobs"), env)


async def test_a_refusal_is_counted_only_when_its_commit_lands(
    h: Harness, admission: Admission, tmp_path: Path
) -> None:
    """A handler run again after a failed commit refuses the same run again; the gauge
    counts the refusal once, from the attempt whose writes were committed."""
    wf = ir(arith(resources=RESOURCES))
    for n in range(3):  # three runs fill the device beside the weights
        assert admission.admit(f"held-{n}", wf, _uow(h, tmp_path)) is None
    dropped = _uow(h, tmp_path)
    assert admission.admit("fourth", wf, dropped) is not None
    dropped.discard()  # the handler failed: its writes and its count go together
    assert admission.refused == {}
    landed = _uow(h, tmp_path)
    assert admission.admit("fourth", wf, landed) is not None
    assert admission.refused == {}  # nothing counts before the commit
    await landed.commit()
    assert admission.refused == {"capacity_vram_bytes_per_device": 1}
