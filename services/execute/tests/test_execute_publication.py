"""Publishing a rollout group's staged effects after its selection, through execute's real
consumer path: the winner's once, the others' discarded, each recorded."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from assay.bus import RESULTS, RUN_STATUS, RUNS
from assay.engine import BUILTIN_TOOLS, StubModel, Tool, ToolCall, ToolError, Unsafe
from assay.engine.events import commands_stream
from assay.engine.staging import (
    EffectDiscarded,
    EffectPublished,
    EffectPublishing,
    EffectStaged,
    Publication,
)
from assay.grading import StubJudge
from assay.kernel import BranchId, IntentState, RunId, TaskId, TenantId, new_run_id
from assay.messages import (
    AttemptIndeterminate,
    Purpose,
    Role,
    RolloutRef,
    RolloutResult,
    RunRef,
    RunSpawned,
    SelectionRecord,
    SiblingResult,
    Usage,
)
from assay.messages.rollout_spec import RolloutMode
from assay.record import BranchKey, Event
from assay.runtime import StageDeps, StageHarness
from assay.store import CommitBatch, FsBlobStore
from assay.workflow import WorkflowDef, validate
from assay_execute import create_stage
from assay_execute.publication import discard_reason

TENANT = TenantId(uuid.UUID(int=7))
OTHER = TenantId(uuid.UUID(int=8))


@dataclass
class Card:
    """The outside world: every charge that reached it; `how` scripts the next answers."""

    charges: list[ToolCall] = field(default_factory=list)
    how: list[str] = field(default_factory=list)

    async def charge(self, call: ToolCall) -> str:
        how = self.how.pop(0) if self.how else "ok"
        if how == "refuse":
            raise ToolError("card declined")
        if how == "hang":
            await asyncio.sleep(30)
        self.charges.append(call)
        return f"charged {call.args['amount']}"


WORKFLOW = WorkflowDef.model_validate(
    {
        "id": "pay",
        "steps": [
            {
                "id": "pay",
                "kind": "tool",
                "tool": "charge",
                "args": {"amount": "{{ task.amount }}"},
                "timeout_s": 0.5,
            }
        ],
    }
)


@pytest.fixture
def card() -> Card:
    return Card()


@pytest.fixture
async def stage(tmp_path: Path, card: Card) -> AsyncIterator[StageHarness]:
    tools = dict(BUILTIN_TOOLS, charge=Tool("charge", card.charge, Unsafe(), "charges a card"))
    blobs = FsBlobStore(tmp_path / "blobs")
    deps = StageDeps(blobs=blobs, model=StubModel(), judge=StubJudge(), tools=tools)
    async with StageHarness(create_stage(deps), blobs, tmp_path) as h:
        yield h


def sibling(index: int, mode: RolloutMode = "best_of_n") -> RunSpawned:
    wf = validate(WORKFLOW, frozenset({*BUILTIN_TOOLS, "charge"}))
    ref = RunRef(
        tenant=TENANT,
        run_id=new_run_id(),
        task_id=TaskId("t-pay"),
        idempotency_key="group-1",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
        rollout=RolloutRef(group="group-1", index=index, size=2, mode=mode),
    )
    definition = wf.model_dump(mode="json", by_alias=True)
    return RunSpawned(run=ref, definition=definition, input={"amount": f"{10 + index}"})


def result(
    runs: list[RunSpawned],
    winner: int | None,
    *,
    mode: RolloutMode = "best_of_n",
    closed: Literal["completed", "cancelled", "deadline"] = "completed",
    passed: bool = True,
) -> RolloutResult:
    siblings = [
        SiblingResult(
            run_id=r.run.run_id,
            index=i,
            ended="verified",
            passed=passed,
            verification=[],
            usage=Usage(),
        )
        for i, r in enumerate(runs)
    ]
    first = runs[0].run
    return RolloutResult(
        tenant=first.tenant,
        idempotency_key="group-1",
        task_id=first.task_id,
        workflow_id=first.workflow_id,
        workflow_version=first.workflow_version,
        mode=mode,
        requested=len(runs),
        admitted=len(runs),
        siblings=siblings,
        passes=len(runs) if passed else 0,
        pass_at_k=[],
        best_of_n_passed=passed and winner is not None,
        winner=None if winner is None else runs[winner].run.run_id,
        selection=SelectionRecord(
            policy="verifier_then_judge",
            policy_version=1,
            decided_by="index",
            evidence="test",
            judge_calls=0,
        ),
        closed=closed,
        model_calls=0,
        peak_concurrency=1,
    )


async def settled(stage: StageHarness, run: RunId) -> list[Event]:
    key = BranchKey.main(TENANT, commands_stream(run))
    return [r.event for r in await stage.log.read(key)]


async def two_staged(stage: StageHarness, mode: RolloutMode = "best_of_n") -> list[RunSpawned]:
    runs = [sibling(0, mode), sibling(1, mode)]
    for r in runs:
        await stage.deliver(RUNS, r, TENANT)
        records = await stage.log.read(BranchKey.for_run(TENANT, r.run.run_id, BranchId(0)))
        assert any(isinstance(x.event, EffectStaged) for x in records)
    return runs


async def test_only_the_winners_staged_effect_is_published_once(
    stage: StageHarness, card: Card
) -> None:
    runs = await two_staged(stage)
    assert card.charges == []  # staged, not made
    await stage.deliver(RESULTS, result(runs, winner=1), TENANT, idem="result")
    (charge,) = card.charges
    assert charge.run_id == runs[1].run.run_id
    assert charge.args == {"amount": "11"}
    won = await settled(stage, runs[1].run.run_id)
    staged = next(
        x.event
        for x in await stage.log.read(BranchKey.for_run(TENANT, charge.run_id, BranchId(0)))
        if isinstance(x.event, EffectStaged)
    )
    assert charge.idempotency_key == staged.effect_key
    assert [(type(e).__name__, getattr(e, "state", None)) for e in won] == [
        ("EffectPublishing", IntentState.PENDING),
        ("EffectPublishing", IntentState.DISPATCHED),
        ("EffectPublished", Publication.PUBLISHED),
    ]
    assert isinstance(won[-1], EffectPublished)
    assert won[-1].output == "charged 11"
    (lost,) = await settled(stage, runs[0].run.run_id)
    assert isinstance(lost, EffectDiscarded)
    assert lost.reason == "sibling #0 was not selected (#1 was)"
    doc = await stage.state(TENANT, "staged-effect", f"{runs[1].run.run_id}/0/{staged.effect_key}")
    assert doc is not None
    assert doc["state"] == "published"

    await stage.deliver(RESULTS, result(runs, winner=1), TENANT, idem="result-again")
    assert len(card.charges) == 1  # a result handled again publishes nothing twice
    assert len(await settled(stage, runs[1].run.run_id)) == 3


@pytest.mark.parametrize("mode", ["trajectory_collection", "shadow"])
async def test_a_group_that_publishes_nothing_discards_every_staged_effect(
    stage: StageHarness, card: Card, mode: RolloutMode
) -> None:
    runs = await two_staged(stage, mode)
    winner = None if mode == "trajectory_collection" else 0
    await stage.deliver(RESULTS, result(runs, winner, mode=mode), TENANT)
    assert card.charges == []
    for r in runs:
        (discarded,) = await settled(stage, r.run.run_id)
        assert isinstance(discarded, EffectDiscarded)
        assert discarded.reason == f"a {mode} group publishes no staged effect"


def test_why_a_siblings_effects_are_discarded() -> None:
    runs = [sibling(0), sibling(1)]
    done = result(runs, winner=0)
    assert discard_reason(done, done.siblings[0]) is None
    assert discard_reason(done, done.siblings[1]) == "sibling #1 was not selected (#0 was)"
    evaluation = result(runs, winner=0, mode="evaluation")
    assert discard_reason(evaluation, evaluation.siblings[0]) is None
    deadline = result(runs, winner=0, closed="deadline")
    assert discard_reason(deadline, deadline.siblings[0]) is None
    cancelled = result(runs, winner=0, closed="cancelled")
    assert discard_reason(cancelled, cancelled.siblings[0]) == (
        "the group was cancelled: no reason given"
    )
    failed = result(runs, winner=0, passed=False)
    assert discard_reason(failed, failed.siblings[0]) == "the selected sibling failed verification"
    nobody = result(runs, winner=None)
    assert discard_reason(nobody, nobody.siblings[0]) == "the group selected no sibling"


async def test_a_publication_dispatched_before_a_crash_is_indeterminate_and_never_repeated(
    stage: StageHarness, card: Card
) -> None:
    """The worker died between `Dispatched` and the outcome's commit: the charge may have
    gone through. It is never dispatched again; operators are alerted."""
    runs = await two_staged(stage)
    run = runs[0].run.run_id
    records = await stage.log.read(BranchKey.for_run(TENANT, run, BranchId(0)))
    staged = next(x.event for x in records if isinstance(x.event, EffectStaged))
    left = [
        EffectPublishing(
            branch=0,
            effect_key=staged.effect_key,
            state=state,
            tool="charge",
            request_id=f"{TENANT}/{run}/publish/{staged.effect_key}",
        )
        for state in (IntentState.PENDING, IntentState.DISPATCHED)
    ]
    commands = BranchKey.main(TENANT, commands_stream(run))
    for event in left:
        await stage.log.commit(CommitBatch(records=[(commands, event)]))
    await stage.deliver(RESULTS, result(runs, winner=0), TENANT)
    assert card.charges == []
    end = (await settled(stage, run))[-1]
    assert isinstance(end, EffectPublished)
    assert end.state is Publication.INDETERMINATE
    (alert,) = [m for m in await stage.emitted(RUN_STATUS) if isinstance(m, AttemptIndeterminate)]
    assert (alert.run, alert.step, alert.tool) == (runs[0].run, "pay", "charge")
    assert alert.request_id == left[0].request_id


@pytest.mark.parametrize(
    ("how", "state"), [("refuse", Publication.FAILED), ("hang", Publication.INDETERMINATE)]
)
async def test_a_publication_the_tool_refuses_or_never_answers(
    stage: StageHarness, card: Card, how: str, state: Publication
) -> None:
    runs = await two_staged(stage)
    card.how.append(how)
    await stage.deliver(RESULTS, result(runs, winner=0), TENANT)
    assert card.charges == []
    end = (await settled(stage, runs[0].run.run_id))[-1]
    assert isinstance(end, EffectPublished)
    assert end.state is state
    assert end.error == ("card declined" if how == "refuse" else "timed out after 0.5s")


async def test_another_tenants_result_publishes_nothing(stage: StageHarness, card: Card) -> None:
    runs = await two_staged(stage)
    forged = result(runs, winner=0).model_copy(update={"tenant": OTHER})
    await stage.deliver(RESULTS, forged, OTHER)
    assert card.charges == []
    assert await settled(stage, runs[0].run.run_id) == []
