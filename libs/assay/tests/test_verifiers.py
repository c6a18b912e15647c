"""Verification (§10): built-in checks, and the fail-closed contract around every verifier."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from assay.kernel import AttemptNo, AttemptState, StepId, TaskId, WorkflowVersion, new_run_id
from assay.kernel.ids import TenantId, WorkflowId
from assay.messages import AttemptView, Episode, Purpose, Role, RunRef, Usage, VerifierResult
from assay.verification import (
    BUILTIN_VERIFIERS,
    ExactVerifier,
    JsonSchemaVerifier,
    RegexVerifier,
    Verifier,
    verify_episode,
)
from assay.workflow import VerifierSpec, WorkflowDef

# -- a factory of frozen episodes ----------------------------------------------------------

DEFINITION = WorkflowDef.model_validate(
    {
        "id": "arith",
        "steps": [
            {"id": "solve", "kind": "model", "prompt": "What is {{ task.question }}?"},
            {
                "id": "answer",
                "kind": "tool",
                "tool": "extract_number",
                "args": {"text": "{{ steps.solve.output }}"},
            },
        ],
    }
)

TASK: dict[str, Any] = {"question": "(5 + 12) * 9", "answer": "153"}


def make_episode(
    outputs: dict[str, str],
    *,
    succeeded: bool = True,
    task: dict[str, Any] | None = None,
    definition: WorkflowDef = DEFINITION,
) -> Episode:
    """An episode whose listed steps succeeded with these outputs, in order.

    A failed episode gets a failed attempt for the first step without an output.
    """
    attempts = [
        AttemptView(
            step=StepId(step),
            attempt=AttemptNo(1),
            iteration=0,
            state=AttemptState.SUCCEEDED,
            output=text,
            usage=Usage(),
            duration_ms=1,
        )
        for step, text in outputs.items()
    ]
    failed_step: StepId | None = None
    if not succeeded:
        failed_step = next(StepId(s.id) for s in definition.steps if s.id not in outputs)
        attempts.append(
            AttemptView(
                step=failed_step,
                attempt=AttemptNo(1),
                iteration=0,
                state=AttemptState.FAILED,
                error="no number in the text",
                usage=Usage(),
                duration_ms=1,
            )
        )
    run_id = new_run_id()
    return Episode(
        run=RunRef(
            tenant=TenantId(uuid.UUID("0b8f3c3e-5a3b-4d0e-9b71-2f9f8c1d7e55")),
            run_id=run_id,
            task_id=TaskId("t" * 64),
            idempotency_key=f"key-{run_id}",
            workflow_id=WorkflowId(definition.id),
            workflow_version=WorkflowVersion(definition.version),
            role=Role.CURRENT,
            purpose=Purpose.WORK,
        ),
        definition=definition.model_dump(mode="json", by_alias=True),
        input=dict(TASK if task is None else task),
        attempts=attempts,
        outputs=outputs,
        output=outputs.get(definition.output_step) if succeeded else None,
        succeeded=succeeded,
        failed_step=failed_step,
        usage=Usage(model_calls=1, prompt_tokens=10, completion_tokens=5),
    )


def spec(kind: str, **fields: Any) -> VerifierSpec:
    return VerifierSpec.model_validate({"id": f"check-{kind}", "kind": kind, **fields})


async def one(
    episode: Episode,
    verifier: VerifierSpec,
    *,
    timeout_s: float = 10.0,
    registry: dict[str, Verifier] | None = None,
) -> VerifierResult:
    results = await verify_episode(episode, [verifier], timeout_s=timeout_s, registry=registry)
    assert len(results) == 1
    return results[0]


SOLVED = {"solve": "Let me see. The answer is 153.", "answer": "153"}

# -- exact ---------------------------------------------------------------------------------


async def test_exact_renders_expected_from_the_task() -> None:
    check = spec("exact", expected="{{ task.answer }}")
    passed = await one(make_episode(SOLVED), check)
    assert passed.passed
    assert passed.evidence == "expected '153', got '153'"

    wrong = await one(make_episode({**SOLVED, "answer": "154"}), check)
    assert not wrong.passed
    assert wrong.evidence == "expected '153', got '154'"

    other_task = make_episode(SOLVED, task={"question": "1 + 1", "answer": "2"})
    assert not (await one(other_task, check)).passed


async def test_exact_strips_surrounding_whitespace_unless_told_not_to() -> None:
    padded = make_episode({**SOLVED, "answer": "  153\n"})
    assert (await one(padded, spec("exact", expected="{{ task.answer }}"))).passed
    strict = spec("exact", expected="{{ task.answer }}", strip=False)
    assert not (await one(padded, strict)).passed


async def test_exact_on_a_named_step_and_a_step_template() -> None:
    episode = make_episode(SOLVED)
    check = spec(
        "exact", step="solve", expected="Let me see. The answer is {{ steps.answer.output }}."
    )
    assert (await one(episode, check)).passed


async def test_exact_whose_template_does_not_resolve_fails_closed() -> None:
    result = await one(make_episode(SOLVED), spec("exact", expected="{{ task.missing }}"))
    assert not result.passed
    assert "TemplateError" in result.evidence
    assert "task.missing" in result.evidence


# -- regex ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "passed"),
    [("153", True), ("-72", True), ("153 apples", False), ("x153", False), ("", False)],
)
async def test_regex_is_a_full_match(output: str, passed: bool) -> None:
    result = await one(
        make_episode({**SOLVED, "answer": output}), spec("regex", pattern="-?[0-9]+")
    )
    assert result.passed is passed
    assert ("does not match" in result.evidence) is not passed


# -- json_schema ---------------------------------------------------------------------------

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"value": {"type": "integer"}},
    "required": ["value"],
    "additionalProperties": False,
}


async def test_json_schema_valid() -> None:
    result = await one(
        make_episode({**SOLVED, "answer": '{"value": 153}'}),
        spec("json_schema", json_schema=SCHEMA),
    )
    assert result.passed
    assert result.evidence == "valid against the schema"


@pytest.mark.parametrize(
    "output", ['{"value": "153"}', "{}", '{"value": 1, "extra": true}', "[153]"]
)
async def test_json_schema_invalid(output: str) -> None:
    result = await one(
        make_episode({**SOLVED, "answer": output}), spec("json_schema", json_schema=SCHEMA)
    )
    assert not result.passed
    assert "schema error" in result.evidence


@pytest.mark.parametrize("output", ["153 is the answer", "{value: 153}", ""])
async def test_json_schema_not_json(output: str) -> None:
    result = await one(
        make_episode({**SOLVED, "answer": output}), spec("json_schema", json_schema=SCHEMA)
    )
    assert not result.passed
    assert result.evidence.startswith("not JSON")


# -- fail closed ---------------------------------------------------------------------------


class RaisingVerifier:
    kind = "exact"
    version = "raising-1"

    async def check(self, spec: VerifierSpec, episode: Episode, subject: str) -> tuple[bool, str]:
        raise RuntimeError("the checker broke")


class HangingVerifier:
    kind = "exact"
    version = "hanging-1"

    async def check(self, spec: VerifierSpec, episode: Episode, subject: str) -> tuple[bool, str]:
        await asyncio.sleep(60)
        return True, "unreachable"


class MalformedVerifier:
    """Returns something that is not a `(bool, str)` pair (an untyped plugin might)."""

    kind = "exact"
    version = "malformed-1"

    def __init__(self, result: Any) -> None:
        self.result = result

    async def check(self, spec: VerifierSpec, episode: Episode, subject: str) -> Any:
        return self.result


async def test_a_verifier_that_raises_fails() -> None:
    result = await one(
        make_episode(SOLVED),
        spec("exact", expected="{{ task.answer }}"),
        registry={"exact": RaisingVerifier()},
    )
    assert not result.passed
    assert result.evidence == "verifier raised RuntimeError: the checker broke"
    assert result.verifier_version == "raising-1"


async def test_a_verifier_that_hangs_fails_at_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    results = await verify_episode(
        make_episode(SOLVED),
        [
            VerifierSpec.model_validate({"id": f"v{i}", "kind": "exact", "expected": "153"})
            for i in range(3)
        ],
        timeout_s=0.2,
        registry={"exact": HangingVerifier()},
    )
    elapsed = loop.time() - t0
    assert [r.passed for r in results] == [False, False, False]
    assert all(r.evidence == "verifier timed out after 0.2s" for r in results)
    assert elapsed < 0.55  # they ran side by side, not one after another


@pytest.mark.parametrize(
    "returned",
    [None, ("yes", "looks fine"), (1, "looks fine"), (True, None), (True,), "pass"],
)
async def test_a_verifier_with_a_malformed_result_fails(returned: Any) -> None:
    result = await one(
        make_episode(SOLVED),
        spec("exact", expected="{{ task.answer }}"),
        registry={"exact": MalformedVerifier(returned)},
    )
    assert not result.passed
    assert result.evidence.startswith("verifier raised")


async def test_an_unregistered_kind_fails() -> None:
    episode = make_episode(SOLVED)
    only_exact: dict[str, Verifier] = {"exact": ExactVerifier()}
    result = await one(episode, spec("regex", pattern=".*"), registry=only_exact)
    assert not result.passed
    assert result.evidence == "no verifier of kind 'regex' is registered"
    assert result.verifier_version == "missing"

    # An explicitly empty registry holds no verifier at all; nothing falls back.
    empty = await one(episode, spec("regex", pattern=".*"), registry={})
    assert not empty.passed
    assert empty.evidence == "no verifier of kind 'regex' is registered"

    # A kind this build does not know (say, a stored definition from a newer one).
    stored: dict[str, Any] = {"id": "later", "kind": "later_kind", "step": None, "strip": True}
    future = VerifierSpec.model_construct(**stored)
    result = await one(episode, future)
    assert not result.passed
    assert result.kind == "later_kind"
    assert result.evidence == "no verifier of kind 'later_kind' is registered"


@pytest.mark.parametrize(
    "check",
    [
        spec("exact", expected="{{ task.answer }}"),
        spec("regex", pattern=".*"),
        spec("json_schema", json_schema={}),
        spec("regex", pattern=".*", step="answer"),
    ],
    ids=["exact", "regex-anything", "schema-anything", "named-step"],
)
async def test_a_failed_run_without_output_fails(check: VerifierSpec) -> None:
    episode = make_episode({"solve": SOLVED["solve"]}, succeeded=False)
    assert episode.output is None
    assert episode.failed_step == "answer"
    result = await one(episode, check)
    assert not result.passed
    assert result.evidence == "step 'answer' produced no output"


async def test_results_carry_identity_kind_and_version_in_order() -> None:
    checks = [
        VerifierSpec.model_validate({"id": "correct", "kind": "exact", "expected": "153"}),
        VerifierSpec.model_validate({"id": "integer", "kind": "regex", "pattern": "-?[0-9]+"}),
        VerifierSpec.model_validate({"id": "shape", "kind": "json_schema", "json_schema": SCHEMA}),
    ]
    results = await verify_episode(make_episode(SOLVED), checks)
    assert [(r.verifier, r.kind, r.verifier_version, r.passed) for r in results] == [
        ("correct", "exact", ExactVerifier.version, True),
        ("integer", "regex", RegexVerifier.version, True),
        ("shape", "json_schema", JsonSchemaVerifier.version, False),
    ]
    assert all(r.evidence for r in results)
    assert set(BUILTIN_VERIFIERS) == {"exact", "regex", "json_schema", "context"}
    assert await verify_episode(make_episode(SOLVED), []) == []


async def test_the_output_step_defaults_to_the_declared_one() -> None:
    declared = WorkflowDef.model_validate(
        {**DEFINITION.model_dump(mode="json", by_alias=True), "output": "solve"}
    )
    episode = make_episode(SOLVED, definition=declared)
    result = await one(episode, spec("regex", pattern="Let me see.*"))
    assert result.passed
