"""Cancel means stop, embedded: a run cancelled while it rests in `Grading` makes no judge
call from then on, and its result is `cancelled` — never a grade.

The workflow is graded in tournament groups of two, so one run alone waits in its group
for a second episode of its task; it is cancelled there. Nothing that arrives later —
another run of the task, the group's timeout — is judged against it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from assay.bus import GRADED, RESULTS, RUN_COMMANDS, RUN_STATUS, TASKS, USAGE, WORKFLOWS
from assay.kernel import RunId, RunState, tenant_id
from assay.messages import (
    CancelRun,
    Purpose,
    RunGraded,
    RunResult,
    RunStatusChanged,
    TaskSubmitted,
    UsageRecorded,
    WorkflowRegistered,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.workflow import WorkflowDef, from_document
from tests.test_branch_grading import read, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TENANT = tenant_id(str(uuid.uuid5(uuid.NAMESPACE_URL, "assay:cancel-grading")))
WORKFLOW: WorkflowDef = from_document(
    {
        "id": "solve-grouped",
        "steps": [
            {
                "id": "solve",
                "kind": "model",
                "prompt": "Reply with only the number. What is {{ task.question }}?",
            },
        ],
        "verifiers": [{"id": "integer", "kind": "regex", "step": "solve", "pattern": "[0-9]+"}],
        "grading": {"strategy": "tournament", "quorum": 2, "group_timeout_s": 4},
    }
)


async def test_a_run_cancelled_while_it_is_graded_gets_a_cancelled_result_and_no_judge(
    tmp_path: Path,
) -> None:
    async with Embedded(tmp_path / "data") as rt:
        rt.start()
        document = WORKFLOW.model_dump(mode="json", by_alias=True)
        registered = WorkflowRegistered(tenant=TENANT, definition=document)
        await rt.publish(WORKFLOWS, registered, TENANT, idem=WORKFLOW.version)

        async def current() -> bool:
            key = StateKey(TENANT, "allocation", WORKFLOW.id)
            return await rt.logs["ingest"].get(key) is not None

        await wait_for(current, "the workflow to be current")
        task = TaskSubmitted(
            tenant=TENANT,
            workflow_id=WORKFLOW.id,
            idempotency_key="cancel-grading-1",
            input={"question": "2 + 3"},
        )
        await rt.publish(TASKS, task, TENANT, idem=task.idempotency_key)

        async def grading() -> RunId | None:  # it rests in its group, waiting for a second
            said = await read(rt, RUN_STATUS, RunStatusChanged)
            waiting = [s.run.run_id for s in said if s.state is RunState.GRADING]
            return waiting[0] if waiting else None

        run = await wait_for(grading, "the run to rest in Grading")
        await rt.publish(RUN_COMMANDS, CancelRun(tenant=TENANT, run_id=run, reason="no"), TENANT)

        async def result() -> RunResult | None:
            out = [r for r in await read(rt, RESULTS, RunResult) if r.run_id == run]
            return out[-1] if out else None

        done = await wait_for(result, "the cancelled run's result")
        assert (done.status, done.score, done.termination) == ("cancelled", None, "succeeded")
        states = [
            s.state for s in await read(rt, RUN_STATUS, RunStatusChanged) if s.run.run_id == run
        ]
        assert states[-1] is RunState.CANCELLED
        assert RunState.GRADED not in states
        assert RunState.UNGRADED not in states

        # A second run of the task and the group's timeout come and go: neither is judged
        # against the cancelled run.
        again = task.model_copy(update={"idempotency_key": "cancel-grading-2"})
        await rt.publish(TASKS, again, TENANT, idem=again.idempotency_key)

        async def second_graded() -> list[RunGraded]:
            return [g for g in await read(rt, GRADED, RunGraded) if g.run.run_id != run]

        (other,) = await wait_for(second_graded, "the second run to be graded", timeout_s=60)
        assert other.score.kind == "ungraded"  # alone in its group: the cancelled run left it
        assert [g for g in await read(rt, GRADED, RunGraded) if g.run.run_id == run] == []
        judged = [
            u
            for u in await read(rt, USAGE, UsageRecorded)
            if u.purpose is Purpose.GRADING and u.run_id == run
        ]
        assert judged == []
        # Execute heard the result: grading of the run ended, cancelled.
        doc = await rt.logs["execute"].get(StateKey(TENANT, "run", run))
        assert doc is not None
        assert doc.get("grading") == "cancelled"
