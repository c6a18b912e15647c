"""The execute stage through its real consumer path."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from assay.bus import RUN_STATUS, RUNS
from assay.engine import BUILTIN_TOOLS, StubModel, Tool, ToolCall, Unsafe
from assay.grading import StubJudge
from assay.kernel import BranchId, RunState, TaskId, TenantId, content_hash, new_run_id
from assay.messages import (
    AttemptIndeterminate,
    Episode,
    Purpose,
    Role,
    RunExecuted,
    RunRef,
    RunSpawned,
    RunStatusChanged,
    UsageRecorded,
)
from assay.record import BranchKey
from assay.runtime import StageDeps, StageHarness
from assay.runtime.metrics import stage_registry
from assay.store import FsBlobStore
from assay.workflow import WorkflowDef, load_workflow, validate
from assay_execute import create_stage

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TENANT = TenantId(uuid.UUID(int=7))


@pytest.fixture
async def stage(tmp_path: Path) -> AsyncIterator[StageHarness]:
    blobs = FsBlobStore(tmp_path / "blobs")
    deps = StageDeps(blobs=blobs, model=StubModel(), judge=StubJudge(), tools=dict(BUILTIN_TOOLS))
    async with StageHarness(create_stage(deps), blobs, tmp_path) as h:
        yield h


def spawned(tenant: TenantId = TENANT, *, run_tenant: TenantId | None = None) -> RunSpawned:
    wf = load_workflow(EXAMPLES / "workflows" / "arith-v2.yaml")
    task = {"question": "(5 + 12) * 9", "answer": "153"}
    ref = RunRef(
        tenant=run_tenant or tenant,
        run_id=new_run_id(),
        task_id=TaskId(content_hash(task)),
        idempotency_key="t-1",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpawned(run=ref, definition=wf.model_dump(mode="json", by_alias=True), input=task)


async def test_a_spawned_run_is_executed_and_its_episode_frozen(stage: StageHarness) -> None:
    msg = spawned()
    await stage.deliver(RUNS, msg, TENANT)
    out = await stage.emitted()
    statuses = [m.state for m in out if isinstance(m, RunStatusChanged)]
    assert statuses == [RunState.RUNNING, RunState.VERIFYING]
    assert [m.purpose for m in out if isinstance(m, UsageRecorded)] == [Purpose.WORK]
    (executed,) = [m for m in out if isinstance(m, RunExecuted)]
    assert executed.run == msg.run
    assert executed.succeeded
    raw = await stage.blobs.get(TENANT, executed.episode)
    assert raw is not None
    episode = Episode.model_validate_json(raw)
    assert episode.run == msg.run
    assert [a.step for a in episode.attempts] == ["solve", "answer"]
    doc = await stage.state(TENANT, "run", msg.run.run_id)
    assert doc is not None
    assert doc["status"] == "verifying"
    assert doc["episode"] == executed.episode


async def test_redelivery_executes_nothing_twice(stage: StageHarness) -> None:
    msg = spawned()
    await stage.deliver(RUNS, msg, TENANT, idem="same")
    records = await stage.log.read(_key(msg))
    await stage.deliver(RUNS, msg, TENANT, idem="same")
    assert await stage.log.read(_key(msg)) == records
    assert len([m for m in await stage.emitted() if isinstance(m, RunExecuted)]) == 1


async def test_a_definition_that_is_not_the_pinned_version_is_refused(
    stage: StageHarness,
) -> None:
    msg = spawned()
    tampered = dict(msg.definition, description="edited after pinning")
    await stage.deliver(RUNS, msg.model_copy(update={"definition": tampered}), TENANT)
    ((_, reason),) = await stage.dead_letters()
    assert "not the pinned" in reason
    assert await stage.emitted() == []


async def test_an_invalid_pinned_definition_is_refused(stage: StageHarness) -> None:
    msg = spawned()
    broken = dict(msg.definition, steps=[])
    await stage.deliver(RUNS, msg.model_copy(update={"definition": broken}), TENANT)
    ((_, reason),) = await stage.dead_letters()
    assert "invalid pinned workflow" in reason


async def test_a_run_of_another_tenant_cannot_be_written_under_this_one(
    stage: StageHarness,
) -> None:
    other = TenantId(uuid.UUID(int=8))
    await stage.deliver(RUNS, spawned(TENANT, run_tenant=other), TENANT)
    ((_, reason),) = await stage.dead_letters()
    assert "differs from the envelope" in reason
    assert str(other) in reason


def _key(msg: RunSpawned) -> BranchKey:
    return BranchKey.for_run(msg.run.tenant, msg.run.run_id, BranchId(0))


async def test_an_unresolved_unsafe_call_alerts_operators_by_message_and_metric(
    tmp_path: Path,
) -> None:
    async def hangs(call: ToolCall) -> str:
        await asyncio.sleep(30)
        return "never"

    tools = dict(BUILTIN_TOOLS, charge=Tool("charge", hangs, Unsafe(), "charges a card"))
    blobs = FsBlobStore(tmp_path / "blobs")
    deps = StageDeps(blobs=blobs, model=StubModel(), judge=StubJudge(), tools=tools)
    wf = validate(
        WorkflowDef.model_validate(
            {
                "id": "pay",
                "steps": [
                    {
                        "id": "pay",
                        "kind": "tool",
                        "tool": "charge",
                        "args": {"amount": "{{ task.amount }}"},
                        "timeout_s": 0.2,
                        "retry": {"max_attempts": 3},
                    }
                ],
            }
        ),
        frozenset(tools),
    )
    task = {"amount": "12"}
    ref = spawned().run.model_copy(
        update={"workflow_id": wf.id, "workflow_version": wf.version, "task_id": "t-pay"}
    )
    msg = RunSpawned(run=ref, definition=wf.model_dump(mode="json", by_alias=True), input=task)
    async with StageHarness(create_stage(deps), blobs, tmp_path) as stage:
        await stage.deliver(RUNS, msg, TENANT)
        (alert,) = [
            m for m in await stage.emitted(RUN_STATUS) if isinstance(m, AttemptIndeterminate)
        ]
        assert (alert.run, alert.step, alert.attempt, alert.tool) == (ref, "pay", 1, "charge")
        (executed,) = [m for m in await stage.emitted() if isinstance(m, RunExecuted)]
        assert not executed.succeeded
        assert stage.runner is not None
        registry = stage_registry(stage.runner)
        value = registry.get_sample_value(
            "assay_indeterminate_attempts_total", {"stage": "execute"}
        )
        assert value == 1.0
