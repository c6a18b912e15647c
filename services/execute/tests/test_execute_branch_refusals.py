"""A branch command that cannot be honoured is refused as a whole, with the reason, before
any child exists (fail closed, DESIGN §13) — on SQLite and on Postgres.

The model case is the review finding of `seeds/rollout-branching-rfc-pr.md`: a delta
the parent's snapshot already contradicts would label a child with something it
does not contain, so it is refused rather than run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from assay.bus import RUN_COMMANDS, RUNS
from assay.engine import BUILTIN_TOOLS
from assay.kernel import RunId, StepId, TaskId, content_hash, new_run_id
from assay.messages import (
    BranchChild,
    BranchRun,
    InjectPlanDelta,
    ModelParamsDelta,
    PromptDelta,
    Purpose,
    Role,
    RunRef,
    RunSpawned,
    SignalRun,
    ToolUnavailableDelta,
)
from assay.messages.branching import AnyDelta
from assay.store import FsBlobStore
from assay.store.ports import EventLog
from assay.workflow import WorkflowDef, validate
from services.execute.tests.branch_world import (
    SOLVE_PROMPT,
    TENANT,
    Tools,
    branch_of,
    command,
    key_of,
    run_to_end,
    spawned,
    stage_for,
)

PROMPT = "Compute {{ task.question }}."

CONTRADICTIONS: list[tuple[str, list[list[AnyDelta]], str]] = [
    (
        "plan",
        [[PromptDelta(kind="prompt", step=StepId("plan"), prompt=PROMPT)]],
        "child 1: prompt:plan: step 'plan' ran before the boundary (LSN ",
    ),
    (
        "plan",
        [[ModelParamsDelta(kind="model_params", step=StepId("plan"), max_tokens=8)]],
        "its output is already in the snapshot",
    ),
    (
        "plan",
        [[PromptDelta(kind="prompt", step=StepId("check"), prompt=PROMPT)]],
        "step 'check' is a tool step, not a model step",
    ),
    (
        "plan",
        [[PromptDelta(kind="prompt", step=StepId("nosuch"), prompt=PROMPT)]],
        "the workflow has no step 'nosuch'",
    ),
    (
        "plan",
        [[ToolUnavailableDelta(kind="tool_unavailable", tool="lookup")]],
        "the parent called it before the boundary (step 'fetch', LSN 1)",
    ),
    (
        "plan",
        [[ToolUnavailableDelta(kind="tool_unavailable", tool="nosuch")]],
        "no step of the workflow calls tool 'nosuch'",
    ),
    (
        "plan",
        [[PromptDelta(kind="prompt", step=StepId("solve"), prompt=SOLVE_PROMPT)]],
        "step 'solve' already has this prompt",
    ),
    (
        "plan",
        [[ModelParamsDelta(kind="model_params", step=StepId("solve"), max_tokens=256)]],
        "step 'solve' already has these parameters",
    ),
    (
        "solve",
        [[InjectPlanDelta(kind="inject_plan", plan="Check twice.")]],
        "every model step ran before the boundary: the plan would reach no prompt",
    ),
    (
        "plan",
        [
            [ToolUnavailableDelta(kind="tool_unavailable", tool="audit")],
            [
                PromptDelta(kind="prompt", step=StepId("solve"), prompt=PROMPT),
                PromptDelta(kind="prompt", step=StepId("solve"), prompt=PROMPT + " Now."),
            ],
        ],
        "child 2: prompt:solve is given twice",
    ),
    (
        "plan",
        [[PromptDelta(kind="prompt", step=StepId("solve"), prompt="{{ steps.nope.output }}")]],
        "child 1: its deltas make the workflow invalid",
    ),
    ("nosuch", [[]], "cannot branch after step 'nosuch': the workflow has no step 'nosuch'"),
    ("answer", [[]], "the run ended at that step on branch 0: nothing runs after it"),
]


@pytest.mark.parametrize(("at", "children", "needle"), CONTRADICTIONS)
async def test_a_contradicted_delta_or_boundary_is_refused_before_any_child(
    work_log: EventLog, tmp_path: Path, at: str, children: list[list[AnyDelta]], needle: str
) -> None:
    tools, blobs = Tools(), FsBlobStore(tmp_path / "blobs")
    msg = spawned(tools.registry())
    some = [c or [ToolUnavailableDelta(kind="tool_unavailable", tool="audit")] for c in children]
    async with stage_for(tools, work_log, tmp_path / "w", blobs) as stage:
        await run_to_end(stage, msg)
        await command(stage, branch_of(msg, at, *some))
        ((_, why),) = await stage.dead_letters()
    assert needle in why, why
    assert why.startswith(f"run {msg.run.run_id}: cannot branch after step '{at}': "), why
    assert [k.branch for k in await work_log.branches(msg.run.run_id, TENANT)] == [0]


@pytest.mark.parametrize(
    ("at", "needle"),
    [
        ("answer", "branch 0 never reached it"),
        ("check", "the run ended at that step on branch 0"),
    ],
)
async def test_a_boundary_the_parent_did_not_pass_is_refused(
    work_log: EventLog, tmp_path: Path, at: str, needle: str
) -> None:
    tools, blobs = Tools(), FsBlobStore(tmp_path / "blobs")
    msg = spawned(tools.registry(), mode="fail")  # the audit fails: the run ends at check
    outage = [ToolUnavailableDelta(kind="tool_unavailable", tool="audit")]
    async with stage_for(tools, work_log, tmp_path / "w", blobs) as stage:
        await run_to_end(stage, msg)
        await command(stage, branch_of(msg, at, outage))
        ((_, why),) = await stage.dead_letters()
    assert needle in why, why
    assert await work_log.read(key_of(msg, 1)) == []


@pytest.mark.parametrize(("branch", "needle"), [(None, "no run"), (7, "has no branch 7")])
async def test_an_unknown_run_or_branch_is_refused(
    work_log: EventLog, tmp_path: Path, branch: int | None, needle: str
) -> None:
    tools, blobs = Tools(), FsBlobStore(tmp_path / "blobs")
    msg = spawned(tools.registry())
    outage = [ToolUnavailableDelta(kind="tool_unavailable", tool="audit")]
    async with stage_for(tools, work_log, tmp_path / "w", blobs) as stage:
        if branch is not None:
            await run_to_end(stage, msg)
        await command(stage, branch_of(msg, "plan", outage, branch=branch))
        ((_, why),) = await stage.dead_letters()
    assert needle in why, why


async def test_an_await_step_after_the_boundary_is_refused(
    work_log: EventLog, tmp_path: Path
) -> None:
    wf = validate(
        WorkflowDef.model_validate(
            {
                "id": "asks",
                "steps": [
                    {"id": "solve", "kind": "model", "prompt": "{{ task.question }}"},
                    {"id": "ask", "kind": "await"},
                    {"id": "say", "kind": "model", "prompt": "{{ steps.ask.output }}"},
                ],
            }
        ),
        frozenset(BUILTIN_TOOLS),
    )
    task = {"question": "2 + 2"}
    ref = RunRef(
        tenant=TENANT,
        run_id=new_run_id(),
        task_id=TaskId(content_hash(task)),
        idempotency_key="asks-1",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    msg = RunSpawned(run=ref, definition=wf.model_dump(mode="json", by_alias=True), input=task)
    tools, blobs = Tools(), FsBlobStore(tmp_path / "blobs")
    branch = BranchRun(
        tenant=TENANT,
        run_id=RunId(ref.run_id),
        at_step=StepId("solve"),
        children=[BranchChild(deltas=[InjectPlanDelta(kind="inject_plan", plan="Be brief.")])],
    )
    async with stage_for(tools, work_log, tmp_path / "w", blobs) as stage:
        await stage.deliver(RUNS, msg, TENANT)
        approval = SignalRun(tenant=TENANT, run_id=ref.run_id, signal="approval", payload="4")
        await stage.deliver(RUN_COMMANDS, approval, TENANT)
        await command(stage, branch)
        ((_, why),) = await stage.dead_letters()
    assert "await step 'ask' may run after it" in why, why
