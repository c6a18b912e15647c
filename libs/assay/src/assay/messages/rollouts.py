"""The messages of a rollout group's life (DESIGN §13).

Ingest owns the group: it admits, spawns siblings within the budget, learns
each sibling's end from a `RolloutProgress` (on `assay.tasks`, keyed like the
task, so one ingest consumer is the group's single writer), and closes the
group with a `RolloutClosed` (on `assay.verified`, keyed by task, so it reaches
the tournament partition holding the siblings' episodes). The tournament stage
selects and publishes one `RolloutResult` on `assay.results`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from assay.kernel.ids import RunId, TaskId, TenantId, WorkflowId, WorkflowVersion
from assay.kernel.schema import Versioned
from assay.kernel.scores import Ranked
from assay.messages.candidates import CandidateResult, MatrixEstimate, PlannedCandidate
from assay.messages.models import Usage, VerifierResult
from assay.messages.rollout_spec import RolloutMode, RolloutSpec


class RolloutProgress(Versioned):
    """A sibling of a rollout group ended: graded (its episode verified) or cancelled.

    Version 2 adds `cost_usd` (0.0 in a version 1).
    """

    type: ClassVar[str] = "RolloutProgress"
    version: ClassVar[int] = 2
    tenant: TenantId = Field(description="Tenant.")
    idempotency_key: str = Field(description="The group's task key (the group id).")
    run_id: RunId = Field(description="The sibling.")
    index: int = Field(ge=0, description="Its index in the group.")
    ended: Literal["verified", "cancelled"] = Field(description="How it ended.")
    model_calls: int = Field(ge=0, description="Model calls it made.")
    tokens: int = Field(0, ge=0, description="Prompt and completion tokens it used.")
    cost_usd: float = Field(
        0.0,
        ge=0.0,
        allow_inf_nan=False,
        description="v2: what its model calls cost in US dollars (its tokens at the prices).",
    )


class CancelRollout(Versioned):
    """Stop a rollout group: no sibling starts, running ones are cancelled (`assay cancel
    --rollout`, or the group's deadline)."""

    type: ClassVar[str] = "CancelRollout"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant.")
    idempotency_key: str = Field(description="The group's task key.")
    reason: str = Field("", max_length=2000, description="Why, for people.")


class RolloutClosed(Versioned):
    """No sibling of the group will run any more: select among those that did.

    Version 2: the spec's budget may carry cost caps, and `cost_usd` (0.0 in a version 1).
    Version 3 carries a candidate matrix as admitted (`candidates`, `estimate`; None in a
    version 2: a homogeneous group). Version 4: a candidate may run several siblings
    (`PlannedCandidate.samples`; each ran one in a version 3).
    """

    type: ClassVar[str] = "RolloutClosed"
    version: ClassVar[int] = 4
    tenant: TenantId = Field(description="Tenant.")
    task_id: TaskId = Field(description="The task (the tournament partition's key).")
    idempotency_key: str = Field(description="The group's task key.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="The version every sibling ran.")
    spec: RolloutSpec = Field(description="What was asked.")
    admitted: int = Field(ge=0, description="Siblings admitted.")
    runs: list[RunId] = Field(description="Siblings that started, by index.")
    cancelled: list[RunId] = Field(description="Of which cancelled before verification.")
    reason: Literal["completed", "cancelled", "deadline"] = Field(description="Why it closed.")
    detail: str = Field("", description="For people: who cancelled, or the budget that stopped it.")
    model_calls: int = Field(ge=0, description="Model calls the siblings made.")
    tokens: int = Field(0, ge=0, description="Tokens the siblings used.")
    cost_usd: float = Field(
        0.0,
        ge=0.0,
        allow_inf_nan=False,
        description="v2: what the siblings' model calls cost in US dollars.",
    )
    peak_concurrency: int = Field(ge=0, description="Most siblings that ran at once.")
    candidates: list[PlannedCandidate] | None = Field(
        None, description="v3: the candidate matrix as admitted, by index (None: homogeneous)."
    )
    estimate: MatrixEstimate | None = Field(
        None, description="v3: the matrix's cost, declared at submission."
    )


class SiblingResult(Versioned):
    """One sibling in a rollout result."""

    type: ClassVar[str] = "SiblingResult"
    version: ClassVar[int] = 1
    run_id: RunId = Field(description="The sibling.")
    index: int = Field(ge=0, description="Its index.")
    ended: Literal["verified", "cancelled"] = Field(description="How it ended.")
    passed: bool = Field(description="Every verifier passed (False when cancelled).")
    capped: bool = Field(False, description="A `Core` rubric violation: never the winner.")
    verification: list[VerifierResult] = Field(description="Each verifier's result.")
    usage: Usage = Field(description="Model usage.")
    rank: Ranked | None = Field(
        None, description="Strength within its outcome class (relative to the class's mean)."
    )


class SelectionRecord(Versioned):
    """How the winner was chosen, with the evidence."""

    type: ClassVar[str] = "SelectionRecord"
    version: ClassVar[int] = 1
    policy: str = Field(description="Selection policy name.")
    policy_version: int = Field(ge=1, description="Its version.")
    decided_by: Literal["verifier", "judge", "index", "none"] = Field(
        description=(
            "verifier: one sibling alone had the best outcome; judge: a tournament among "
            "the best outcome class; index: a tie broken by the lowest index; none: no winner."
        )
    )
    evidence: str = Field(description="What decided it, for people.")
    judge_calls: int = Field(
        ge=0, description="Judge calls the selection spent that answered (v3: only those)."
    )
    judge_failures: int = Field(
        0, ge=0, description="v3: judge calls of the selection that gave no usable answer."
    )


class RolloutResult(Versioned):
    """What a consumer reads for a task submitted with a rollout spec: one per task.

    Version 2 adds `cost_usd` (0.0 in a version 1). Version 3 counts the selection's
    judge calls apart (`judge_calls` answered, `judge_failures` not) and carries the
    answered comparisons a sibling's `Ranked` rests on; a version 2 result reads as it is.
    Version 4 reports a candidate matrix (a replay tournament): each candidate's strength
    against the control with its interval, its rank and its pass rate (`candidates`), the
    control, and the cost declared at submission (`estimate`); None in a version 3.
    Version 5: a candidate may have run several siblings (`CandidateResult.samples`), its
    counts and strength pooling them; in a version 4 each ran one.
    """

    type: ClassVar[str] = "RolloutResult"
    version: ClassVar[int] = 5
    tenant: TenantId = Field(description="Tenant.")
    idempotency_key: str = Field(description="The submitting task's key.")
    task_id: TaskId = Field(description="The task's comparison key.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="Version every sibling ran.")
    mode: RolloutMode = Field(description="The group's mode.")
    requested: int = Field(ge=1, description="Siblings requested (n).")
    admitted: int = Field(ge=0, description="Siblings admitted.")
    siblings: list[SiblingResult] = Field(description="Every sibling that started, by index.")
    passes: int = Field(ge=0, description="Siblings every verifier passed.")
    pass_at_k: list[float] = Field(
        description=(
            "Unbiased pass@k for k = 1..(siblings verified): 1 - C(n-c, k) / C(n, k), "
            "n siblings verified, c passes; pass@N is the last."
        )
    )
    best_of_n_passed: bool = Field(description="The best sibling passed verification.")
    winner: RunId | None = Field(description="The selected sibling (None: no selection).")
    output: str | None = Field(None, description="The winner's output, when small.")
    selection: SelectionRecord = Field(description="How the winner was chosen.")
    closed: Literal["completed", "cancelled", "deadline"] = Field(
        description="How the group ended."
    )
    detail: str = Field("", description="For people.")
    model_calls: int = Field(ge=0, description="Model calls of every sibling.")
    tokens: int = Field(0, ge=0, description="Tokens of every sibling.")
    cost_usd: float = Field(
        0.0,
        ge=0.0,
        allow_inf_nan=False,
        description="v2: what every sibling's model calls cost in US dollars.",
    )
    peak_concurrency: int = Field(ge=0, description="Most siblings that ran at once.")
    candidates: list[CandidateResult] | None = Field(
        None,
        description=(
            "v4: a candidate matrix's ranking, by index: strength against the control with its "
            "interval, rank and pass rate (None: a homogeneous group)."
        ),
    )
    control: str | None = Field(None, description="v4: the candidate pinned as control.")
    estimate: MatrixEstimate | None = Field(
        None, description="v4: the matrix's cost, declared at submission."
    )


def rollout_cost_unknown(payload: dict[str, Any]) -> dict[str, Any]:
    """RolloutProgress / RolloutClosed / RolloutResult v1 -> v2: reported before costs were
    carried, read as costing 0.0 (as `UsageRecorded` v1 does)."""
    return {**payload, "cost_usd": 0.0}


def rollout_result_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    """RolloutResult v2 -> v3: a v2 selection counted no failed judge call apart, which v3
    reads as none."""
    return dict(payload)


def rollout_homogeneous(payload: dict[str, Any]) -> dict[str, Any]:
    """RolloutClosed v2 -> v3, RolloutResult v3 -> v4: every earlier group was
    homogeneous (no candidate matrix); it reads as it is."""
    return dict(payload)


def rollout_one_sample(payload: dict[str, Any]) -> dict[str, Any]:
    """RolloutClosed v3 -> v4, RolloutResult v4 -> v5: every earlier candidate ran one
    sibling (`samples` 1); it reads as it is."""
    return dict(payload)
