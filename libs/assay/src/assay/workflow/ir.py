"""The workflow IR (§4.1): what every format parses into, and what gets hashed."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from assay.kernel.canonical import canonical_bytes, digest
from assay.kernel.ids import StepId, WorkflowId, WorkflowVersion


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class RetryPolicy(_Frozen):
    """How many attempts a step gets. Attempt N+1 never mutates attempt N."""

    max_attempts: int = Field(1, ge=1, le=20, description="Attempts in total, the first included.")
    backoff_s: float = Field(0.0, ge=0, le=60, description="Pause before each retry, in seconds.")


class ModelStep(_Frozen):
    """Call the run's model with a rendered prompt."""

    id: StepId = Field(description="Author-assigned, stable across versions (§4.3).")
    kind: Literal["model"] = Field(description="Step kind.")
    prompt: str = Field(description="Template over `task.*` and `steps.<id>.output`.")
    max_tokens: int = Field(256, ge=1, le=1_000_000, description="Completion token cap.")
    retry: RetryPolicy = Field(default_factory=RetryPolicy, description="Retry policy.")
    timeout_s: float = Field(30.0, gt=0, le=3600, description="Per-attempt wall-clock limit.")


class ToolStep(_Frozen):
    """Call a registered tool with rendered arguments."""

    id: StepId = Field(description="Author-assigned, stable across versions (§4.3).")
    kind: Literal["tool"] = Field(description="Step kind.")
    tool: str = Field(description="Name of a registered tool.")
    args: dict[str, str] = Field(default_factory=dict, description="Argument templates.")
    retry: RetryPolicy = Field(default_factory=RetryPolicy, description="Retry policy.")
    timeout_s: float = Field(30.0, gt=0, le=3600, description="Per-attempt wall-clock limit.")


Step = Annotated[ModelStep | ToolStep, Field(discriminator="kind")]


class Transition(_Frozen):
    """An edge between steps. A back edge must declare its loop bound."""

    source: StepId = Field(alias="from", description="Step the edge leaves.")
    target: StepId = Field(alias="to", description="Step the edge enters.")
    max_iterations: int | None = Field(
        None, ge=1, le=1000, description="Loop bound: how many times this edge may be taken."
    )


BUILTIN_VERIFIER_KINDS = frozenset({"exact", "regex", "json_schema", "command"})
"""Verifier kinds Assay ships; others come from the `assay.verifiers` entry-point group."""

_OMITTED_WHEN_UNSET = ("argv", "timeout_s", "params")


class VerifierSpec(_Frozen):
    """A fail-closed check on the frozen episode (§10).

    The fields added after the first release (`argv`, `timeout_s`, `params`)
    are left out of the serialised form while unset, so the canonical bytes —
    and so the version — of every workflow that does not use them are what
    they always were.
    """

    id: str = Field(description="Verifier id, unique within the workflow.")
    kind: str = Field(
        pattern=r"^[a-z][a-z0-9_.-]{0,63}$",
        description=(
            "Verifier kind: a built-in one (exact, regex, json_schema, command) or one "
            "registered under the `assay.verifiers` entry-point group."
        ),
    )
    step: StepId | None = Field(None, description="Whose output is checked; default the run's.")
    expected: str | None = Field(None, description="exact: template of the expected output.")
    pattern: str | None = Field(None, description="regex: a full-match pattern.")
    json_schema: dict[str, Any] | None = Field(None, description="json_schema: the schema.")
    strip: bool = Field(True, description="Strip surrounding whitespace before checking.")
    argv: list[str] | None = Field(
        None,
        description=(
            "command: the command to run in a sandbox workspace, each item a template; "
            "exit code 0 passes."
        ),
    )
    timeout_s: float | None = Field(
        None, gt=0, le=3600, description="command: wall-clock limit in seconds (default 60)."
    )
    params: dict[str, Any] | None = Field(
        None, description="Parameters of a verifier kind registered by an installed package."
    )

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in _OMITTED_WHEN_UNSET:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class RubricItem(_Frozen):
    """One rubric line (§11.7). A `core` violation caps the episode."""

    id: str = Field(description="Criterion id.")
    layer: Literal["core", "prescriptive", "contextual"] = Field(description="Rubric layer.")
    text: str = Field(description="What the judge looks for.")


class GradingSpec(_Frozen):
    """Which grading strategy applies (§11.1)."""

    strategy: Literal["pairwise_sequential"] = Field(
        "pairwise_sequential", description="Grading strategy."
    )


class BudgetSpec(_Frozen):
    """Per-run ceilings."""

    max_model_calls: int = Field(50, ge=1, description="Model calls per run.")
    max_step_executions: int = Field(100, ge=1, description="Step executions per run (loops).")


class WorkflowDef(_Frozen):
    """A workflow, as data. Its version is the blake3 of its canonical form."""

    id: WorkflowId = Field(description="Logical workflow id, stable across versions.")
    schema_version: Literal[1] = Field(1, alias="schema", description="IR schema version.")
    description: str = Field("", description="Free text for people.")
    steps: list[Step] = Field(min_length=1, description="Steps; the first is the entry.")
    transitions: list[Transition] = Field(
        default_factory=list, description="Edges; when empty, steps run in list order."
    )
    output: StepId | None = Field(None, description="Step whose output is the run's output.")
    verifiers: list[VerifierSpec] = Field(default_factory=list, description="Verifiers.")
    rubric: list[RubricItem] = Field(default_factory=list, description="Rubric for judges.")
    grading: GradingSpec = Field(default_factory=GradingSpec, description="Grading strategy.")
    budget: BudgetSpec = Field(default_factory=BudgetSpec, description="Per-run ceilings.")

    def canonical(self) -> bytes:
        """Canonical bytes of the IR, defaults filled in, key order irrelevant."""
        return canonical_bytes(self.model_dump(mode="json", by_alias=True))

    @property
    def version(self) -> WorkflowVersion:
        """blake3 of the canonical IR."""
        return WorkflowVersion(digest(self.canonical()))

    def step(self, step_id: StepId) -> ModelStep | ToolStep:
        """The step with this id; raises `KeyError`."""
        for s in self.steps:
            if s.id == step_id:
                return s
        raise KeyError(step_id)

    def edges(self) -> list[Transition]:
        """Explicit transitions, or list order when none are declared."""
        if self.transitions:
            return list(self.transitions)
        return [
            Transition.model_validate({"from": a.id, "to": b.id})
            for a, b in zip(self.steps, self.steps[1:], strict=False)
        ]

    @property
    def output_step(self) -> StepId:
        """The step whose output is the run's output (the declared one or the last)."""
        return self.output if self.output is not None else self.steps[-1].id
