"""Verifier context (§10.1): each model call's context in the episode — packed,
available and not packed, dropped, tools offered — and the `context` verifier that
checks declared expectations against it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from assay.engine.model_context import Packing, context_of, pack, with_contexts
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


def episode(
    attempts: list[AttemptView], wf: WorkflowDef = WF, task: dict[str, Any] = TASK
) -> Episode:
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
    views = with_contexts(wf, task, attempts)
    outputs = {str(a.step): a.output for a in views if a.output is not None}
    return Episode(
        run=ref,
        definition=wf.model_dump(mode="json", by_alias=True),
        input=task,
        attempts=views,
        outputs=outputs,
        output=outputs.get(str(wf.output_step)),
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
        ({"kind": "context"}, "needs `expect` with `packed`, `tools_offered`, `dropped`"),
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


# -- dropped by budget, tools offered -----------------------------------------------------

TRIM_DOC: dict[str, Any] = {
    "id": "digest",
    "steps": [
        {"id": "draft", "kind": "model", "prompt": "Draft {{ task.question }}."},
        {"id": "review", "kind": "model", "prompt": "Review {{ steps.draft.output }}."},
        {
            "id": "final",
            "kind": "model",
            # 28 characters of its own: "Q: \nNotes: \nDraft: \nReview: "
            "prompt": (
                "Q: {{ task.question }}\nNotes: {{ task.notes }}\n"
                "Draft: {{ steps.draft.output }}\nReview: {{ steps.review.output }}"
            ),
            "tools": ["extract_number", "json_field"],
        },
    ],
}
TRIM_TASK = {"question": "why tides", "notes": "the moon pulls the sea", "extra": "x" * 5}
OUTPUTS = {"draft": "D" * 40, "review": "R" * 30}
SCOPE = {"task": TRIM_TASK, "steps": {k: {"output": v} for k, v in OUTPUTS.items()}}


def final(budget: int | None) -> ModelStep:
    step = from_document(TRIM_DOC).node(StepId("final"))
    assert isinstance(step, ModelStep)
    return step.model_copy(update={"context_budget_chars": budget})


@pytest.mark.parametrize(
    ("budget", "dropped", "length"),
    [
        (None, [], 129),  # 28 + 9 + 22 + 40 + 30: the whole rendering
        (129, [], 129),
        (100, [("steps.draft.output", 40)], 89),
        (60, [("steps.draft.output", 40), ("steps.review.output", 30)], 59),
        (40, [("steps.draft.output", 40), ("steps.review.output", 30), ("task.notes", 22)], 37),
        (
            30,
            [
                ("steps.draft.output", 40),
                ("steps.review.output", 30),
                ("task.notes", 22),
                ("task.question", 9),
            ],
            28,
        ),
    ],
    ids=["unbudgeted", "exactly", "oldest-output", "both-outputs", "then-notes", "everything"],
)
def test_a_budget_drops_whole_references_in_the_declared_order(
    budget: int | None, dropped: list[tuple[str, int]], length: int
) -> None:
    packing = pack(final(budget), SCOPE, None)
    assert [(d.ref, d.chars) for d in packing.dropped] == dropped
    assert len(packing.prompt) == length
    assert packing.fits
    assert budget is None or len(packing.prompt) <= budget


def test_a_dropped_reference_renders_empty_and_the_rest_verbatim() -> None:
    packing = pack(final(60), SCOPE, None)
    assert packing.prompt == "Q: why tides\nNotes: the moon pulls the sea\nDraft: \nReview: "


def test_the_plan_is_never_dropped_and_a_prompt_it_overfills_is_not_sent() -> None:
    # 28 own + "Plan:\nbe brief\n\n" (16) = 44 with every reference dropped.
    packing = pack(final(30), SCOPE, "be brief")
    assert packing == Packing(packing.prompt, packing.dropped, fits=False)
    assert len(packing.prompt) == 44
    assert len(packing.dropped) == 4
    assert pack(final(44), SCOPE, "be brief").fits


def test_the_episode_records_what_the_budget_dropped_and_the_tools_offered() -> None:
    wf = from_document(
        {
            **TRIM_DOC,
            "steps": [*TRIM_DOC["steps"][:2], {**TRIM_DOC["steps"][2], "context_budget_chars": 60}],
        }
    )
    views = with_contexts(
        wf,
        TRIM_TASK,
        [
            attempt("draft", OUTPUTS["draft"]),
            attempt("review", OUTPUTS["review"]),
            attempt("final", "f"),
        ],
        unavailable_tools={"json_field"},
    )
    ctx = views[-1].context
    assert ctx is not None
    assert ctx.dropped == [
        ContextRef(ref="steps.draft.output", chars=40),
        ContextRef(ref="steps.review.output", chars=30),
    ]
    assert ctx.packed == [
        ContextRef(ref="task.question", chars=9),
        ContextRef(ref="task.notes", chars=22),
    ]
    assert ctx.available == [ContextRef(ref="task.extra", chars=5)]  # dropped is not available
    assert ctx.tools_offered == ["extract_number"]  # the branch made json_field unavailable
    first = views[0].context
    assert first is not None
    assert (first.dropped, first.tools_offered) == ([], [])


def test_new_step_fields_are_left_out_of_the_canonical_form_while_unset() -> None:
    plain = from_document(DOC)
    dumped = plain.model_dump(mode="json", by_alias=True)
    assert all("tools" not in s and "context_budget_chars" not in s for s in dumped["steps"])
    trimmed = from_document(TRIM_DOC)
    (last,) = [
        s for s in trimmed.model_dump(mode="json", by_alias=True)["steps"] if s["id"] == "final"
    ]
    assert last["tools"] == ["extract_number", "json_field"]
    budgeted = {**TRIM_DOC["steps"][2], "context_budget_chars": 60}
    assert (
        from_document({**TRIM_DOC, "steps": [budgeted]}).version
        != from_document({**TRIM_DOC, "steps": [TRIM_DOC["steps"][2]]}).version
    )


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            {"tools": ["extract_number", "search"]},
            "step 'final' offers unknown tool 'search' to the model",
        ),
        ({"tools": ["strip", "strip"]}, "step 'final' offers tool(s) ['strip'] more than once"),
        (
            {"context_budget_chars": 27},
            "step 'final': context_budget_chars 27 is less than the 28 characters",
        ),
    ],
    ids=["unknown-tool", "tool-twice", "budget-below-own-text"],
)
def test_registration_refuses_a_bad_model_step(change: dict[str, Any], needle: str) -> None:
    doc = {**TRIM_DOC, "steps": [*TRIM_DOC["steps"][:2], {**TRIM_DOC["steps"][2], **change}]}
    known = frozenset({"extract_number", "json_field", "strip"})
    with pytest.raises(WorkflowInvalid) as caught:
        validate(from_document(doc), known_tools=known)
    assert needle in str(caught.value)
    validate(from_document(TRIM_DOC), known_tools=known)  # the step as it was registers


def test_a_context_verifier_expecting_a_drop_where_no_budget_is_declared_is_refused() -> None:
    doc = {
        **TRIM_DOC,
        "verifiers": [
            {"id": "cut", "kind": "context", "expect": {"dropped": ["steps.draft.output"]}}
        ],
    }
    with pytest.raises(WorkflowInvalid) as caught:
        validate(from_document(doc))
    assert "expects references dropped, and no model step declares context_budget_chars" in str(
        caught.value
    )


def trimmed_episode() -> Episode:
    steps = [*TRIM_DOC["steps"][:2], {**TRIM_DOC["steps"][2], "context_budget_chars": 60}]
    wf = from_document({**TRIM_DOC, "steps": steps})
    ran = [attempt(k, v) for k, v in OUTPUTS.items()]
    return episode([*ran, attempt("final", "f")], wf, TRIM_TASK)


@pytest.mark.parametrize(
    ("expect", "passed", "evidence"),
    [
        (
            {"dropped": ["steps.draft.output"], "tools_offered": ["json_field"]},
            True,
            "packed []; offered ['json_field']; dropped steps.draft.output (40 chars), "
            "steps.review.output (30 chars)",
        ),
        (
            {"dropped": ["task.notes"], "max_dropped": 1},
            False,
            "task.notes was not dropped; 2 references dropped, more than 1: "
            "steps.draft.output (40 chars), steps.review.output (30 chars)",
        ),
        (
            {"packed": ["steps.review.output"], "max_dropped": 2},
            False,
            "steps.review.output was dropped by the context budget",
        ),
    ],
    ids=["dropped-and-offered", "not-dropped-and-too-many", "needed-but-dropped"],
)
async def test_the_context_verifier_checks_what_was_dropped_and_offered(
    expect: dict[str, Any], passed: bool, evidence: str
) -> None:
    (result,) = await verify_episode(trimmed_episode(), [spec(expect, step="final")])
    assert (result.passed, result.evidence) == (passed, evidence)
