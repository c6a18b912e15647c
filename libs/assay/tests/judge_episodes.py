"""Episodes and a rubric for the judge tests: one step's attempts, a task input, a pinned
workflow definition whose rubric has a criterion of each layer."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from assay.kernel import (
    AttemptNo,
    AttemptState,
    RunId,
    StepId,
    TaskId,
    TenantId,
    WorkflowId,
    WorkflowVersion,
    new_run_id,
)
from assay.messages import AttemptView, Episode, Purpose, Role, RunRef, Usage
from assay.workflow import RubricItem, from_document

TENANT = TenantId(uuid.UUID("00000000-0000-4000-8000-0000000000c1"))

RUBRIC = [
    RubricItem(id="safe", layer="core", text="The output must not contain 'rm -rf'."),
    RubricItem(id="honest", layer="prescriptive", text="Never claim a check that was not run."),
    RubricItem(id="concise", layer="contextual", text="Prefer short answers."),
]

DEFINITION: dict[str, Any] = from_document(
    {
        "id": "arith",
        "steps": [{"id": "solve", "kind": "model", "prompt": "SECRET-PROMPT {{ task.question }}"}],
        "rubric": [item.model_dump() for item in RUBRIC],
    }
).model_dump(mode="json", by_alias=True)


def make_episode(
    outputs: Sequence[str | None],
    *,
    task_input: dict[str, Any] | None = None,
    run_id: RunId | None = None,
    definition: dict[str, Any] | None = None,
) -> Episode:
    """An episode of step `solve` whose attempts produced `outputs` (None: the attempt
    failed with an error). It succeeded when the last attempt did."""
    run = run_id or new_run_id()
    attempts = [
        AttemptView(
            step=StepId("solve"),
            attempt=AttemptNo(n),
            iteration=0,
            state=AttemptState.FAILED if out is None else AttemptState.SUCCEEDED,
            prompt="SECRET-PROMPT 2 + 3",
            output=out,
            error=f"attempt {n} gave a wrong answer" if out is None else None,
            usage=Usage(model_calls=1, prompt_tokens=777, completion_tokens=3),
            duration_ms=4321,
        )
        for n, out in enumerate(outputs, 1)
    ]
    last = outputs[-1] if outputs else None
    return Episode(
        run=RunRef(
            tenant=TENANT,
            run_id=run,
            task_id=TaskId("task-7f3a"),
            idempotency_key=f"idem-{run}",
            workflow_id=WorkflowId("arith"),
            workflow_version=WorkflowVersion("ab" * 32),
            role=Role.CHALLENGER,
            purpose=Purpose.WORK,
        ),
        definition=DEFINITION if definition is None else definition,
        input={"question": "2 + 3"} if task_input is None else task_input,
        attempts=attempts,
        outputs={} if last is None else {"solve": last},
        output=last,
        succeeded=last is not None,
        failed_step=None if last is not None else StepId("solve"),
        usage=Usage(model_calls=len(outputs), prompt_tokens=777, completion_tokens=3),
    )
