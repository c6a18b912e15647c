"""Branching a run with deltas (DESIGN §13): the command, its deltas, its lineage.

`BranchRun` asks the execute stage to fork K children of a finished run from
the checkpoint at one stage boundary — the point of the parent branch's log
right after a step's last attempt finished — each child with declared deltas
applied to what runs after the boundary. The set of deltas is closed:

- `prompt` — a different prompt template for one model step;
- `model_params` — per-step model parameters the model port supports
  (`max_tokens`), and the step's `timeout_s` and `max_attempts`;
- `tool_unavailable` — a tool the child may not call: calling it fails the
  attempt with an error saying so;
- `inject_plan` — text prepended (after a `Plan:` line) to every model prompt
  the child renders after the boundary.

A delta the parent's snapshot already contradicts is refused before anything
runs (the review finding of `seeds/rollout-branching-rfc-pr.md`: a child whose
label would misstate what it really contains is refused, never run).

Lineage: each child's result (`BranchChildResult`, provenance kind
`assay-branch`) and the tree of one command (`BranchTree`) are JSON blobs in the
tenant's blob store; the tree is also recorded in the execute log.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from assay.kernel.canonical import canonical_bytes
from assay.kernel.ids import RunId, StepId, TenantId, WorkflowId, WorkflowVersion
from assay.kernel.schema import Versioned
from assay.messages.models import Usage

MAX_CHILDREN = 16
"""Children one `BranchRun` may fork."""
MAX_DELTAS = 8
"""Deltas one child may declare."""
PROVENANCE_KIND: Literal["assay-branch"] = "assay-branch"
"""The provenance kind every branch artifact carries."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PromptDelta(_Frozen):
    """A different prompt template for one model step (rendered like the original)."""

    kind: Literal["prompt"] = Field(description="Delta kind.")
    step: StepId = Field(description="The model step whose prompt is replaced.")
    prompt: str = Field(min_length=1, max_length=100_000, description="The template used instead.")

    def describe(self) -> str:
        """A short label for people: `prompt:<step>`."""
        return f"prompt:{self.step}"


class ModelParamsDelta(_Frozen):
    """Different model parameters for one model step (at least one is set)."""

    kind: Literal["model_params"] = Field(description="Delta kind.")
    step: StepId = Field(description="The model step whose parameters change.")
    max_tokens: int | None = Field(
        None, ge=1, le=1_000_000, description="Completion token cap (the model port's one knob)."
    )
    timeout_s: float | None = Field(None, gt=0, le=3600, description="Per-attempt time limit.")
    max_attempts: int | None = Field(None, ge=1, le=20, description="Attempts in total.")

    @model_validator(mode="after")
    def _something(self) -> ModelParamsDelta:
        if self.max_tokens is None and self.timeout_s is None and self.max_attempts is None:
            raise ValueError("model_params sets none of max_tokens, timeout_s, max_attempts")
        return self

    def params(self) -> dict[str, int | float]:
        """The parameters this delta sets."""
        given = {
            "max_tokens": self.max_tokens,
            "timeout_s": self.timeout_s,
            "max_attempts": self.max_attempts,
        }
        return {k: v for k, v in given.items() if v is not None}

    def describe(self) -> str:
        """A short label for people: `model_params:<step>(k=v,...)`."""
        inner = ",".join(f"{k}={v}" for k, v in self.params().items())
        return f"model_params:{self.step}({inner})"


class ToolUnavailableDelta(_Frozen):
    """A tool the child may not call: an attempt calling it fails, saying why."""

    kind: Literal["tool_unavailable"] = Field(description="Delta kind.")
    tool: str = Field(min_length=1, max_length=200, description="The tool made unavailable.")

    def describe(self) -> str:
        """A short label for people: `tool_unavailable:<tool>`."""
        return f"tool_unavailable:{self.tool}"


class InjectPlanDelta(_Frozen):
    """A plan prepended to every model prompt the child renders after the boundary."""

    kind: Literal["inject_plan"] = Field(description="Delta kind.")
    plan: str = Field(min_length=1, max_length=20_000, description="The plan's text.")

    def describe(self) -> str:
        """A short label for people: `inject_plan(<n> chars)`."""
        return f"inject_plan({len(self.plan)} chars)"


AnyDelta = PromptDelta | ModelParamsDelta | ToolUnavailableDelta | InjectPlanDelta
BranchDelta = Annotated[AnyDelta, Field(discriminator="kind")]
"""One declared difference between a child and its parent (a closed set)."""


class BranchChild(_Frozen):
    """One child of a branch command: its deltas, and a label for people."""

    deltas: list[BranchDelta] = Field(
        min_length=1, max_length=MAX_DELTAS, description="What differs from the parent."
    )
    label: str = Field("", max_length=200, description="A name for people (`no-plan`, ...).")

    def describe(self) -> str:
        """The label, or the deltas' short labels."""
        return self.label or " + ".join(d.describe() for d in self.deltas)


class BranchRun(Versioned):
    """An operator command: fork K children of a finished run at a stage boundary, each
    with its deltas, drive each to its end, and record the lineage (`assay branch`).

    The boundary is "after step `at_step` ended" on the parent branch: right after
    the last record of that step's last execution. Nothing is deleted (§8.5).
    """

    type: ClassVar[str] = "BranchRun"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant of the run.")
    run_id: RunId = Field(description="The run to branch.")
    at_step: StepId = Field(description="The children depart right after this step ended.")
    branch: int | None = Field(
        None,
        ge=0,
        description=(
            "Parent branch; None: the run's main line — the newest branch that is not a "
            "branch command's child (branch 0, or its newest rewind)."
        ),
    )
    children: list[BranchChild] = Field(
        min_length=1, max_length=MAX_CHILDREN, description="The children, in order (1-based)."
    )
    reason: str = Field("", max_length=2000, description="Why, for people.")


# -- lineage -----------------------------------------------------------------------------


class BranchBoundary(_Frozen):
    """Where the children depart: after `step` on parent branch `branch`, at LSN `at`."""

    step: StepId = Field(description="The step after which the children depart.")
    branch: int = Field(ge=0, description="The parent branch.")
    at: int = Field(ge=1, description="The parent's LSN at which each child departs.")


class BranchOutcome(_Frozen):
    """How one branch ended."""

    status: Literal["succeeded", "failed", "cancelled"] = Field(description="How it ended.")
    failed_step: StepId | None = Field(None, description="The step whose attempts ran out.")
    output: str | None = Field(None, description="The run's output (at most 4000 characters).")
    usage: Usage = Field(
        description="Model usage of the whole branch (the attempts it copied included)."
    )
    usage_after_boundary: Usage = Field(
        description="Model usage of the attempts that ran after the boundary."
    )
    episode: str | None = Field(None, description="BlobRef of its frozen episode, if any.")


class Divergence(_Frozen):
    """The first step at which a child's outcome differs from its parent's."""

    step: StepId = Field(description="The step (the stage the difference is attributed to).")
    iteration: int = Field(ge=0, description="Which execution of the step.")
    why: str = Field(description="How it differs, for people.")


class BranchProvenance(_Frozen):
    """Where a branched child came from: enough to find and re-derive it."""

    kind: Literal["assay-branch"] = Field(description="Always `assay-branch`.")
    tenant: TenantId = Field(description="Tenant.")
    run_id: RunId = Field(description="The run branched.")
    command: str = Field(description="Id of the `BranchRun` message that forked it.")
    boundary: BranchBoundary = Field(description="Where it departed.")
    child: int = Field(ge=1, description="Its position in the command, 1-based.")
    branch: int = Field(ge=1, description="Its branch of the run.")
    label: str = Field("", description="Its label, as given.")
    deltas: list[BranchDelta] = Field(description="Its deltas.")
    workflow_id: WorkflowId = Field(description="The run's workflow.")
    workflow_version: WorkflowVersion = Field(description="The version the run pinned.")
    effective_version: WorkflowVersion = Field(
        description="Hash of the definition the child ran: the pinned one with its deltas."
    )


class BranchChildResult(Versioned):
    """One child's result, with its provenance (a JSON blob per child)."""

    type: ClassVar[str] = "BranchChildResult"
    version: ClassVar[int] = 1
    provenance: BranchProvenance = Field(description="Where the child came from.")
    outcome: BranchOutcome = Field(description="How the child ended.")
    diverged_at: Divergence | None = Field(
        description="First step whose outcome differs from the parent's; None: none did."
    )

    def encode(self) -> bytes:
        """Canonical bytes (what is stored and hashed)."""
        return canonical_bytes(self.model_dump(mode="json"))


class BranchTreeChild(_Frozen):
    """One child in the tree."""

    child: int = Field(ge=1, description="Its position in the command, 1-based.")
    branch: int = Field(ge=1, description="Its branch of the run.")
    label: str = Field("", description="Its label, as given.")
    deltas: list[BranchDelta] = Field(description="Its deltas.")
    outcome: BranchOutcome = Field(description="How it ended.")
    diverged_at: Divergence | None = Field(
        description="First step whose outcome differs from the parent's; None: none did."
    )
    result: str = Field(description="BlobRef of its `BranchChildResult`.")


class StageAttribution(_Frozen):
    """The children whose first difference from the parent is at one step."""

    step: StepId | None = Field(description="The step; None: the children that differ nowhere.")
    children: list[int] = Field(description="The children, by position.")


class BranchTree(Versioned):
    """The lineage of one branch command (a JSON blob, `tree.json`-style)."""

    type: ClassVar[str] = "BranchTree"
    version: ClassVar[int] = 1
    kind: Literal["assay-branch"] = Field(description="Always `assay-branch`.")
    tenant: TenantId = Field(description="Tenant.")
    run_id: RunId = Field(description="The run branched.")
    command: str = Field(description="Id of the `BranchRun` message.")
    reason: str = Field("", description="Why, as given.")
    workflow_id: WorkflowId = Field(description="The run's workflow.")
    workflow_version: WorkflowVersion = Field(description="The version the run pinned.")
    boundary: BranchBoundary = Field(description="Where the children departed.")
    parent: BranchOutcome = Field(description="How the parent branch ended.")
    children: list[BranchTreeChild] = Field(description="The children, in order.")
    attribution: list[StageAttribution] = Field(
        description="Per stage: the children whose first difference is there (None: nowhere)."
    )

    def encode(self) -> bytes:
        """Canonical bytes (what is stored and hashed)."""
        return canonical_bytes(self.model_dump(mode="json"))
