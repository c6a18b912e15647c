"""Verifier context (§10.1): each model call's context in the episode — packed,
available and not packed, dropped, tools offered — and the `context` verifier that
checks declared expectations against it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from assay.engine.model_context import context_of, with_contexts
from assay.grading.judge_prompts import render_episode
from assay.kernel import (
    AttemptNo,
    AttemptState,
    RunId,
    StepId,
    TaskId,
    TenantId,
    WorkflowId,
    WorkflowVersion,
)
from assay.messages import AttemptView, Episode, Purpose, Role, RunRef, Usage
from assay.messages.episode import ContextRef, ModelContext
from assay.verification import verify_episode
from assay.workflow import (
    ModelStep,
    VerifierSpec,
    WorkflowDef,
    WorkflowInvalid,
    from_document,
    validate,
)

DOC: dict[str, Any] = {
    "id": "essay",
    "steps": [
        {"id": "outline", "kind": "model", "prompt": "Outline {{ task.topic }}."},
        {
            "id": "write",
            "kind": "model",
            "prompt": "Write on {{ task.topic }} from {{ steps.outline.output }}.",
        },
    ],
}
WF = from_document(DOC)
TASK = {"topic": "tides", "sources": ["a", "b"], "audience": "children"}


def attempt(step: str, output: str | None, n: int = 1) -> AttemptView:
    return AttemptView(
        step=StepId(step),
        attempt=AttemptNo(n),
        iteration=0,
        state=AttemptState.SUCCEEDED if output is not None else AttemptState.FAILED,
        output=output,
        error=None if output is not None else "boom",
        usage=Usage(),
        duration_ms=1,
    )


def episode(attempts: list[AttemptView], wf: WorkflowDef = WF) -> Episode:
    ref = RunRef(
        tenant=TenantId(uuid.UUID(int=1)),
        run_id=RunId("01J00000000000000000000000"),
        task_id=TaskId("t" * 64),
        idempotency_key="k",
        workflow_id=WorkflowId(wf.id),
        workflow_version=WorkflowVersion(wf.version),
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    views = with_contexts(wf, TASK, attempts)
    outputs = {str(a.step): a.output for a in views if a.output is not None}
    return Episode(
        run=ref,
        definition=wf.model_dump(mode="json", by_alias=True),
        input=TASK,
        attempts=views,
        outputs=outputs,
        output=outputs.get("write"),
        succeeded=True,
        usage=Usage(),
    )


def test_a_call_packs_what_its_template_names_and_sees_the_rest_as_available() -> None:
    step = WF.node(StepId("write"))
    assert isinstance(step, ModelStep)
    ctx = context_of(step, TASK, {"outline": "1. moon 2. sea"}, plan="be brief")
    assert ctx.packed == [
        ContextRef(ref="task.topic", chars=5),
        ContextRef(ref="steps.outline.output", chars=14),
        ContextRef(ref="plan", chars=8),
    ]
    assert ctx.available == [
        ContextRef(ref="task.audience", chars=8),
        ContextRef(ref="task.sources", chars=10),
    ]
    assert (ctx.dropped, ctx.tools_offered) == ([], [])


def test_each_call_sees_only_the_outputs_of_what_ran_before_it() -> None:
    views = with_contexts(WF, TASK, [attempt("outline", None), attempt("outline", "o", 2)])
    first, second = (v.context for v in views)
    assert first is not None
    assert second is not None
    assert [r.ref for r in first.available] == ["task.audience", "task.sources"]
    assert second.available == first.available  # its own failed attempt left no output
    written = with_contexts(WF, TASK, [attempt("outline", "o"), attempt("write", "w")])[1]
    assert written.context is not None
    assert written.context.holds("steps.outline.output")


def spec(expect: dict[str, Any], step: str | None = "write") -> VerifierSpec:
    return VerifierSpec.model_validate(
        {"id": "had", "kind": "context", "expect": expect, **({"step": step} if step else {})}
    )


async def test_the_context_verifier_passes_when_the_call_had_what_it_needed() -> None:
    e = episode([attempt("outline", "o"), attempt("write", "w")])
    (result,) = await verify_episode(e, [spec({"packed": ["task.topic", "steps.outline.output"]})])
    assert result.passed, result.evidence
    assert (result.kind, result.verifier_version) == ("context", "1")


async def test_the_evidence_says_where_a_missing_reference_was() -> None:
    e = episode([attempt("outline", "o"), attempt("write", "w")])
    expect = {"packed": ["task.sources", "task.style"], "tools_offered": ["search"]}
    (result,) = await verify_episode(e, [spec(expect)])
    assert not result.passed
    assert result.evidence == (
        "task.sources was available and not packed; task.style was not available; "
        "tool search not offered"
    )


async def test_a_dropped_reference_is_named_as_dropped() -> None:
    e = episode([attempt("outline", "o"), attempt("write", "w")])
    trimmed = ModelContext(
        packed=[], available=[], dropped=[ContextRef(ref="task.topic", chars=5)], tools_offered=[]
    )
    last = e.attempts[-1].model_copy(update={"context": trimmed})
    e = e.model_copy(update={"attempts": [*e.attempts[:-1], last]})
    (result,) = await verify_episode(e, [spec({"packed": ["task.topic"]})])
    assert result.evidence == "task.topic was dropped by the context budget"


async def test_without_a_step_any_model_call_of_the_run_counts() -> None:
    e = episode([attempt("outline", "o"), attempt("write", "w")])
    (result,) = await verify_episode(e, [spec({"packed": ["steps.outline.output"]}, step=None)])
    assert result.passed


async def test_an_episode_without_recorded_context_fails_closed() -> None:
    e = episode([attempt("outline", "o"), attempt("write", "w")])
    bare = e.model_copy(
        update={"attempts": [a.model_copy(update={"context": None}) for a in e.attempts]}
    )
    (result,) = await verify_episode(bare, [spec({"packed": ["task.topic"]})])
    assert (result.passed, result.evidence) == (False, "no model call recorded its context")


@pytest.mark.parametrize(
    ("verifier", "needle"),
    [
        ({"kind": "context"}, "needs `expect` with `packed` or `tools_offered`"),
        ({"kind": "context", "expect": {}}, "needs `expect`"),
        (
            {"kind": "context", "expect": {"packed": ["input.x"]}},
            "refers to 'input.x'",
        ),
        (
            {"kind": "context", "step": "cite", "expect": {"packed": ["task.topic"]}},
            "(context) checks a model step",
        ),
    ],
)
def test_a_context_verifier_that_expects_nothing_checkable_is_refused(
    verifier: dict[str, Any], needle: str
) -> None:
    doc = {
        **DOC,
        "steps": [
            *DOC["steps"],
            {"id": "cite", "kind": "tool", "tool": "extract_number", "args": {"text": "1"}},
        ],
        "verifiers": [{"id": "had", **verifier}],
    }
    with pytest.raises(WorkflowInvalid) as caught:
        validate(from_document(doc))
    assert needle in str(caught.value)


def test_the_judge_reads_what_each_call_had() -> None:
    e = episode([attempt("outline", "o"), attempt("write", "w")])
    shown = render_episode(e, 10_000)
    assert (
        "context: packed task.topic (5 chars), steps.outline.output (1 chars); available, "
        "not packed task.audience (8 chars), task.sources (10 chars); dropped by budget "
        "none; tools offered none"
    ) in shown
    assert "tides" not in shown.split("Attempts, in order:")[1]  # sizes, never copies
