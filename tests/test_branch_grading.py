"""Every branch is verified and graded, embedded: a rewind's branch and a branch command's
children reach results with their grades, and the task's result follows the live branch.

One run of a tournament-graded workflow (groups of two, so a fork and its parent are
judged against each other) is rewound, then branched into three children — two that
pass and one whose answer tool is unavailable. Each branch's `RunGraded` and
`RunResult` name its branch and parent; every result a higher branch replaced goes out
again saying which; the run's view shows each child's verifier outcome beside how it
executed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from assay.bus import GRADED, RESULTS, RUN_COMMANDS, TASKS, WORKFLOWS
from assay.cli.runs import find_run, render_text
from assay.kernel import RunId, StepId, tenant_id
from assay.messages import (
    MESSAGES,
    BranchChild,
    BranchRun,
    ModelParamsDelta,
    RewindRun,
    RunBranch,
    RunGraded,
    RunResult,
    TaskSubmitted,
    ToolUnavailableDelta,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.workflow import WorkflowDef, from_document

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TENANT = tenant_id(str(uuid.uuid5(uuid.NAMESPACE_URL, "assay:branch-grading")))
WORKFLOW: WorkflowDef = from_document(
    {
        "id": "think-solve",
        "steps": [
            {"id": "think", "kind": "model", "prompt": "Think about {{ task.question }}."},
            {
                "id": "solve",
                "kind": "model",
                "prompt": "Reply with only the number. What is {{ task.question }}?",
            },
            {
                "id": "answer",
                "kind": "tool",
                "tool": "extract_number",
                "args": {"text": "{{ steps.solve.output }}"},
            },
        ],
        "verifiers": [
            {"id": "correct", "kind": "exact", "step": "answer", "expected": "{{ task.answer }}"}
        ],
        "grading": {"strategy": "tournament", "quorum": 2, "group_timeout_s": 6},
    }
)


async def wait_for(check: Callable[[], Any], what: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := await check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return found


async def read(rt: Embedded, topic: str, of: type[Any]) -> list[Any]:
    """Every message of type `of` on `topic`, in order per partition."""
    out = []
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(topic, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            if env.type == of.type:
                out.append(MESSAGES.decode(env.type, env.schema_version, env.payload))
    return out


async def results(rt: Embedded, run: RunId) -> list[RunResult]:
    return [r for r in await read(rt, RESULTS, RunResult) if r.run_id == run]


async def graded(rt: Embedded, run: RunId) -> dict[int, RunGraded]:
    return {g.run.branch_id: g for g in await read(rt, GRADED, RunGraded) if g.run.run_id == run}


async def test_rewound_and_branched_runs_are_graded_and_the_result_follows_the_live_branch(
    tmp_path: Path,
) -> None:
    async with Embedded(tmp_path / "data") as rt:
        rt.start()
        document = WORKFLOW.model_dump(mode="json", by_alias=True)
        registered = WorkflowRegistered(tenant=TENANT, definition=document)
        await rt.publish(WORKFLOWS, registered, TENANT, idem=WORKFLOW.version)
        ingest, execute = rt.logs["ingest"], rt.logs["execute"]

        async def current() -> bool:
            return await ingest.get(StateKey(TENANT, "allocation", WORKFLOW.id)) is not None

        await wait_for(current, "the workflow to be current")
        task = TaskSubmitted(
            tenant=TENANT,
            workflow_id=WORKFLOW.id,
            idempotency_key="branch-grading-1",
            input={"question": "(5 + 12) * 9", "answer": "153"},
        )
        await rt.publish(TASKS, task, TENANT, idem=task.idempotency_key)

        async def finished() -> str | None:
            runs = [run for run, doc in await execute.scan(TENANT, "run") if "episode" in doc]
            return runs[0] if runs else None

        run = RunId(await wait_for(finished, "the run to finish"))
        # Branch 0 rests in Grading (its group waits for a second episode): rewind it.
        await rt.publish(RUN_COMMANDS, RewindRun(tenant=TENANT, run_id=run, at=1), TENANT)

        async def two_graded() -> bool:
            return len(await graded(rt, run)) == 2

        await wait_for(two_graded, "branch 0 and its rewind to be graded")
        grades = await graded(rt, run)
        assert grades[0].run.branch is None
        assert grades[1].run.branch == RunBranch(branch=1, parent=0)
        assert {g.score.kind for g in grades.values()} == {"ranked"}  # judged, each other
        said = [(r.branch, r.superseded_by) for r in await results(rt, run)]
        assert said == [(0, None), (0, 1), (1, None)]  # branch 0's, replaced by branch 1's

        children = [
            BranchChild(
                deltas=[ModelParamsDelta(kind="model_params", step="solve", max_tokens=64)]
            ),
            BranchChild(
                deltas=[
                    ModelParamsDelta(
                        kind="model_params", step="solve", max_tokens=128, timeout_s=20
                    )
                ]
            ),
            BranchChild(
                deltas=[ToolUnavailableDelta(kind="tool_unavailable", tool="extract_number")]
            ),
        ]
        branch = BranchRun(
            tenant=TENANT, run_id=run, at_step=StepId("think"), children=children, reason="x"
        )
        await rt.publish(RUN_COMMANDS, branch, TENANT)

        async def all_graded() -> bool:  # the failing child's group closes on its timeout
            return len(await graded(rt, run)) == 5

        await wait_for(all_graded, "every child to be graded")
        grades = await graded(rt, run)
        assert [grades[b].run.branch for b in (2, 3, 4)] == [  # forked from the rewind
            RunBranch(branch=2, parent=1, child=1),
            RunBranch(branch=3, parent=1, child=2),
            RunBranch(branch=4, parent=1, child=3),
        ]
        # The stub model's answer is a draw seeded by the run: the parent's outcome, whichever
        # it is, is the two unchanged children's; the third fails at its answer step.
        same = grades[0].passed
        assert [grades[b].passed for b in (1, 2, 3, 4)] == [same, same, same, False]
        assert [grades[b].score.kind for b in (2, 3)] == ["ranked", "ranked"]

        async def settled() -> list[RunResult] | None:
            out = await results(rt, run)
            return out if out and out[-1].branch == 4 else None

        out = await wait_for(settled, "the live branch's result")
        live = [r for r in out if r.superseded_by is None]
        assert live[-1].branch == 4  # the task's result: the highest-numbered branch
        assert (live[-1].parent_branch, live[-1].passed) == (1, False)
        for b in (0, 1, 2, 3):  # every other branch's result was replaced, and says by which
            assert [r.superseded_by for r in out if r.branch == b][-1] is not None
        assert all(r.run_id == run and r.idempotency_key == task.idempotency_key for r in out)

        async def verdicts_noted() -> bool:
            return len(await execute.scan(TENANT, "branch-verdict", f"{run}/")) >= 3

        await wait_for(verdicts_noted, "execute to note each child's verification")
        view = await find_run(execute, run, TENANT)
        assert view is not None
        (branching,) = view.branchings
        unchanged = ("succeeded", "pass", ()) if same else ("succeeded", "fail", ("correct",))
        assert [(c.status, c.verification, c.failed_checks) for c in branching.children] == [
            unchanged,
            unchanged,
            ("failed", "fail", ("correct",)),
        ]
        shown = render_text(view)
        assert f"succeeded  verified {'pass' if same else 'fail (correct)'}  " in shown
        assert "failed at step answer  verified fail (correct)  " in shown
        # Grading of the run ended with its live branch's result, not before.
        doc = await execute.get(StateKey(TENANT, "run", run))
        assert doc is not None
        assert (doc["branch"], doc.get("grading")) == (4, "ungraded")


def test_a_result_or_grade_from_before_forks_were_graded_reads_as_branch_zeros() -> None:
    old = MESSAGES.decode(
        "RunResult",
        5,
        {
            "tenant": str(TENANT),
            "run_id": "01M8K8SHFQESAS0AKDX0WWGBW9",
            "task_id": "ab" * 32,
            "idempotency_key": "k",
            "workflow_id": "think-solve",
            "workflow_version": "cd" * 32,
            "status": "cancelled",
            "passed": False,
            "verification": [],
            "score": None,
            "usage": {},
            "termination": "cancelled",
            "held_out": False,
        },
    )
    assert isinstance(old, RunResult)
    assert (old.branch, old.parent_branch, old.superseded_by) == (0, None, None)
    ref = {
        "tenant": str(TENANT),
        "run_id": "01M8K8SHFQESAS0AKDX0WWGBW9",
        "task_id": "ab" * 32,
        "idempotency_key": "k",
        "workflow_id": "think-solve",
        "workflow_version": "cd" * 32,
        "role": "current",
        "purpose": "work",
    }
    graded = MESSAGES.decode(
        "RunGraded",
        6,
        {"run": ref, "passed": True, "score": {"kind": "ungraded", "reason": "baseline"}},
    )
    assert isinstance(graded, RunGraded)
    assert (graded.run.branch, graded.run.branch_id, graded.run.graded_as) == (
        None,
        0,
        ref["run_id"],
    )
    # Branch 0 serialises as it always did: no `branch` key, so its episode bytes stand.
    assert "branch" not in graded.run.model_dump(mode="json")
