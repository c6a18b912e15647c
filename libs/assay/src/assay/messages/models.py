"""The payloads that travel on Assay's topics (DESIGN §4). Versioned contracts."""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from assay.kernel.ids import (
    RunId,
    StepId,
    TaskId,
    TenantId,
    WorkflowId,
    WorkflowVersion,
)
from assay.kernel.lifecycle import RunState
from assay.kernel.schema import Versioned
from assay.kernel.scores import AttemptRank, Score, StepCredit, UnrankedAttempts
from assay.messages.rollout_spec import RolloutRef, RolloutSpec
from assay.workflow.ir import PinnedVersion


class Role(enum.Enum):
    """Which side of the current/challenger pair a run belongs to."""

    CURRENT = "current"
    CHALLENGER = "challenger"


class Purpose(enum.Enum):
    """Why a run (or a model call) happened; metering attributes spend by it."""

    WORK = "work"
    """Serves a submitted task; its result goes to `assay.results`."""
    SHADOW = "shadow"
    """Re-execution of a task under the challenger, for comparison only (§12.4)."""
    GRADING = "grading"
    REPLAY = "replay"
    """A candidate of a replay tournament (a rollout group's candidate matrix, §11.1):
    re-execution of a task under a variant, ranked within its group; its spend is replay's."""
    CALIBRATION = "calibration"
    """A judge call replaying a calibration pair, to measure the judge (§11): no run's."""
    PROPOSER = "proposer"
    """The slow loop's proposer drafting a workflow version (§12.1): no run's."""


class JudgePurpose(enum.Enum):
    """What a grading call asked the judge (§14.1): judge spend is counted by it."""

    COMPARE = "compare"
    """A challenger against the current version's reference (and its sampled order check)."""
    SCREEN = "screen"
    """One episode screened for `Core` violations (§11.7)."""
    TOURNAMENT = "tournament"
    """A comparison in a closed tournament group (§11.4)."""
    ATTEMPTS = "attempts"
    """A comparison between same-outcome attempts of a step (§11.5)."""
    ROLLOUT = "rollout"
    """A comparison in a rollout group's selection (§13)."""


class TaskSubmitted(Versioned):
    """A producer asks for a task to be run by a workflow.

    Version 2 adds `rollout`: run the task as a group of sibling runs and select one.
    Version 3 adds the rollout budget's cost caps (`run_max_cost_usd`,
    `group_max_cost_usd`); a version 2 task reads as it is (no cost cap).
    Version 4 adds the rollout spec's candidate matrix (`candidates`, `control`); a version
    3 task reads as it is (a homogeneous group, or none).
    Version 5 lets a candidate run several siblings (`Candidate.samples`); a version 4 task
    reads as it is (each candidate runs one).
    """

    type: ClassVar[str] = "TaskSubmitted"
    version: ClassVar[int] = 5
    tenant: TenantId = Field(description="Tenant submitting the task.")
    workflow_id: WorkflowId = Field(description="Workflow to run it with.")
    idempotency_key: str = Field(
        min_length=1, max_length=512, description="Producer's key; ingest dedupes on it."
    )
    input: dict[str, Any] = Field(description="Task input; hashed into the TaskId.")
    task_key: str | None = Field(
        None, max_length=512, description="Producer-supplied task identity instead of the hash."
    )
    rollout: RolloutSpec | None = Field(
        None, description="v2: run the task as a rollout group of sibling runs (DESIGN §13)."
    )


class WorkflowRegistered(Versioned):
    """An operator registers a workflow version (the definition, as data).

    Version 2 adds `parents`: the versions it derives from, its edges in the version
    DAG (§12.2).
    """

    type: ClassVar[str] = "WorkflowRegistered"
    version: ClassVar[int] = 2
    tenant: TenantId = Field(description="Tenant owning the workflow.")
    definition: dict[str, Any] = Field(description="The workflow IR document.")
    rewrite: bool = Field(False, description="Allow a version that retains no step id.")
    parents: list[PinnedVersion] | None = Field(
        None,
        max_length=16,
        description=(
            "v2: registered versions of the same workflow this one derives from (several for "
            "a merge); None: the version registered last, if any."
        ),
    )


class RunBranch(Versioned):
    """Which fork of its run a message is about (§8.5, DESIGN §13): a rewind's new branch,
    or a branch command's child. Branch 0, the run as spawned, carries none."""

    type: ClassVar[str] = "RunBranch"
    version: ClassVar[int] = 1
    branch: int = Field(ge=1, description="The branch (1 and up: branch 0 is the run itself).")
    parent: int = Field(ge=0, description="The branch it was forked from.")
    child: int | None = Field(
        None,
        ge=1,
        description="For a branch command's child: its number in the command (1-based); "
        "None for a rewind.",
    )


class RunRef(Versioned):
    """Identity of one run and what it is for, carried by every run message.

    Version 2 adds `held_out`, with a default, so a version 1 reference (in a stored
    record or message) reads as a selection task — which every task then was.
    Version 3 adds `RolloutRef.max_cost_usd`, left out unless set. Version 4 adds
    `branch`, left out unless set: a message about a fork of the run (a rewind, a branch
    command's child) says which, and every earlier reference is about branch 0.
    """

    type: ClassVar[str] = "RunRef"
    version: ClassVar[int] = 4
    tenant: TenantId = Field(description="Tenant.")
    run_id: RunId = Field(description="The run (ULID).")
    task_id: TaskId = Field(description="Comparison group key of the task.")
    idempotency_key: str = Field(description="The submitting task's idempotency key.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="Pinned version.")
    role: Role = Field(description="Current or challenger.")
    purpose: Purpose = Field(description="Work, shadow or replay (a candidate of a matrix).")
    baseline_version: WorkflowVersion | None = Field(
        None, description="For a challenger: the current version it is measured against."
    )
    reference_expected: bool = Field(
        False, description="A run of the baseline on this task was spawned alongside."
    )
    held_out: bool = Field(
        False,
        description=(
            "v2: the task is in the held-out set (§12.5): reported, never read by a promotion "
            "gate. False (a selection task) for every reference written before the split."
        ),
    )
    rollout: RolloutRef | None = Field(
        None, description="For a sibling of a rollout group: its group and index."
    )
    branch: RunBranch | None = Field(
        None,
        description="v4: the fork of the run this is about, and its parent; None: branch 0.",
    )

    @property
    def branch_id(self) -> int:
        """The branch this is about: 0 for the run as spawned."""
        return 0 if self.branch is None else self.branch.branch

    @property
    def graded_as(self) -> str:
        """What grading keys this branch by: the run id, `@<branch>` after it for a fork."""
        return self.run_id if self.branch is None else f"{self.run_id}@{self.branch.branch}"

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out unless set: a selection-set run outside any rollout group serialises as
        # it always did, so its episode's bytes (and content address) are unchanged.
        data: dict[str, Any] = handler(self)
        if data.get("rollout") is None:
            data.pop("rollout", None)
        if data.get("branch") is None:
            data.pop("branch", None)
        if data.get("held_out") is False:
            data.pop("held_out", None)
        return data


class Usage(Versioned):
    """Model usage totals."""

    type: ClassVar[str] = "Usage"
    version: ClassVar[int] = 1
    model_calls: int = Field(0, ge=0, description="Model calls.")
    prompt_tokens: int = Field(0, ge=0, description="Prompt tokens.")
    completion_tokens: int = Field(0, ge=0, description="Completion tokens.")


class RunSpawned(Versioned):
    """Ingest spawned a run: pinned version, role, purpose, and the task snapshot."""

    type: ClassVar[str] = "RunSpawned"
    version: ClassVar[int] = 5
    run: RunRef = Field(description="The run.")
    definition: dict[str, Any] = Field(description="The pinned workflow IR.")
    input: dict[str, Any] = Field(description="The immutable task input.")
    subworkflows: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description=(
            "v2: every sub-workflow the run can call, resolved once at spawn — "
            "`<workflow>@<version or latest>` -> that version's IR."
        ),
    )


class RunStatusChanged(Versioned):
    """A lifecycle transition of a run (§5.2), reported by the stage that drove it.

    Version 4 carries `RunRef.branch`: the transition of a fork of the run says which.
    """

    type: ClassVar[str] = "RunStatusChanged"
    version: ClassVar[int] = 4
    run: RunRef = Field(description="The run.")
    state: RunState = Field(description="The state entered.")
    detail: str = Field("", description="Why, for people.")


class AttemptIndeterminate(Versioned):
    """Operator alert: a dispatched call of an `Unsafe` tool has an unknown outcome (§8.4).

    The attempt is `Indeterminate` and is never retried automatically; someone
    has to look at what the tool may have done.
    """

    type: ClassVar[str] = "AttemptIndeterminate"
    version: ClassVar[int] = 4
    run: RunRef = Field(description="The run.")
    step: StepId = Field(description="Step of the attempt.")
    attempt: int = Field(ge=1, description="Attempt number.")
    tool: str = Field(description="Tool whose call may or may not have landed.")
    request_id: str = Field(description="The intent's request id, as the tool saw it.")
    reason: str = Field(description="Why the outcome is unknown.")


EPISODE_INLINE = (
    "v5: the episode itself, when its blob is small (at most `ASSAY_EPISODE_INLINE_MAX_BYTES`):"
    " the JSON document whose canonical bytes are the blob `episode` names, so a reader "
    "checks it against that blake3 digest and need not read the blob. None: read the blob "
    "(the blob is written either way and stays the durable copy)."
)


class RunExecuted(Versioned):
    """Execute finished a run; the frozen episode is a blob.

    Version 3 carries `RolloutRef.max_cost_usd` and adds `cost_usd`; a version 2
    run reads as costing 0.0, as a `UsageRecorded` v1 call does. Version 4 carries
    `RunRef.branch`: a rewind's new branch and a branch command's child are verified and
    graded like any run, and say which branch they are. Version 5 adds `episode_inline`: a
    small episode travels in the message as well as in its blob; a version 4 run carries
    none, and its readers read the blob.
    """

    type: ClassVar[str] = "RunExecuted"
    version: ClassVar[int] = 5
    run: RunRef = Field(description="The run.")
    episode: str = Field(description="BlobRef of the frozen episode.")
    episode_inline: dict[str, Any] | None = Field(None, description=EPISODE_INLINE)
    succeeded: bool = Field(description="Every step ended with a succeeded attempt.")
    failed_step: StepId | None = Field(None, description="The step whose attempts ran out.")
    usage: Usage = Field(description="Model usage of the run.")
    cost_usd: float = Field(
        0.0,
        ge=0.0,
        allow_inf_nan=False,
        description=(
            "v3: what the run's model calls cost in US dollars: its tokens at the model's "
            "configured per-token prices (the sum of its calls' `UsageRecorded.cost_usd`)."
        ),
    )

    @model_serializer(mode="wrap")
    def _omit_absent_inline(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_inline(handler(self))


class VerifierResult(Versioned):
    """One verifier's verdict with its identity, version and evidence (§10)."""

    type: ClassVar[str] = "VerifierResult"
    version: ClassVar[int] = 1
    verifier: str = Field(description="Verifier id from the workflow.")
    kind: str = Field(description="Verifier kind.")
    verifier_version: str = Field(description="Implementation version.")
    passed: bool = Field(description="Pass; any error is a fail.")
    evidence: str = Field(description="What was checked and what was found.")


class RunVerified(Versioned):
    """Verify's outcome for a run, keyed by task for the grading join.

    Version 3 carries `RolloutRef.max_cost_usd` and adds `cost_usd` (0.0 in a version 2).
    Version 4 carries `RunRef.branch`. Version 5 adds `episode_inline`, passed on from
    `RunExecuted` (none in a version 4).
    """

    type: ClassVar[str] = "RunVerified"
    version: ClassVar[int] = 5
    run: RunRef = Field(description="The run.")
    episode: str = Field(description="BlobRef of the frozen episode.")
    episode_inline: dict[str, Any] | None = Field(None, description=EPISODE_INLINE)
    passed: bool = Field(description="Outcome class: every verifier passed.")
    results: list[VerifierResult] = Field(description="Each verifier's result.")
    usage: Usage = Field(description="Model usage of the run.")
    cost_usd: float = Field(
        0.0,
        ge=0.0,
        allow_inf_nan=False,
        description="v3: what the run's model calls cost in US dollars (from RunExecuted).",
    )
    executed: bool = Field(description="Execution succeeded (all steps ended well).")

    @model_serializer(mode="wrap")
    def _omit_absent_inline(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_inline(handler(self))


class GroupDue(Versioned):
    """A tournament group's timeout passed: close it with whatever arrived (§11.6).

    The tournament stage sends it to itself on `assay.verified`, keyed like the
    episodes of the task, so it is ordered with them on their partition. A group
    that already closed (the epoch moved on) ignores it.
    """

    type: ClassVar[str] = "GroupDue"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant.")
    task_id: TaskId = Field(description="Task of the group.")
    passed: bool = Field(description="Outcome class of the group.")
    epoch: int = Field(ge=0, description="The generation whose timeout passed.")


class RunGraded(Versioned):
    """Tournament's score for a run.

    Version 2 adds the run's attempt tournaments (`attempt_ranks`, `step_credit`),
    the `Ranked` score's `anchored` flag, `Relative.order_consistent`, and the
    `judge_failed` and `no_metric` reasons; a version 1 payload reads as it is.
    Version 3 carries `RunRef.rollout` and `RunRef.held_out`. Version 4 adds
    `failed_checks`: the failure evidence the slow loop's proposer reads (through
    aggregate, for selection-set runs only). Version 5 carries `RolloutRef.max_cost_usd`.
    Version 6 counts judge calls apart: `judge_calls` those that answered, `judge_failures`
    those that did not, each by `JudgePurpose`; a `Ranked` score says how many answered
    comparisons it rests on; attempts the judge answered nothing about are
    `unranked_attempts`, with the reason. A version 5 payload reads with no failure and no
    breakdown (it did not say). Version 7 carries `RunRef.branch`: a fork's grade says
    which branch of the run it is, and its parent. Version 8 adds `judge_cost_usd`, what
    grading the run cost in dollars; a version 7 payload reads as costing 0.0 (unknown).
    Version 9 adds `order_checked` and `order_inconsistent`: the judge's order checks of the
    tournament group bouts the run was in (each bout is judged in both orders); a version
    8 payload reads with none.
    """

    type: ClassVar[str] = "RunGraded"
    version: ClassVar[int] = 9
    run: RunRef = Field(description="The run.")
    passed: bool = Field(description="Verifier outcome class.")
    score: Score = Field(description="The score (a sum type, never a number).")
    judge_calls: int = Field(
        0,
        ge=0,
        description=(
            "Judge calls spent on this run that answered (v6; before, the calls asked, "
            "answered or not)."
        ),
    )
    attempt_ranks: list[AttemptRank] = Field(
        default_factory=list, description="v2: same-outcome attempts of a step, ranked."
    )
    step_credit: list[StepCredit] = Field(
        default_factory=list, description="v2: fail-then-pass retries, attributed to their step."
    )
    failed_checks: list[VerifierResult] = Field(
        default_factory=list, description="v4: the verifiers the run failed, with their evidence."
    )
    judge_failures: int = Field(
        0,
        ge=0,
        description=(
            "v6: judge calls for this run that gave no usable answer (unreachable, timed out, "
            "refused, malformed): counted as failed, never as answers."
        ),
    )
    judge_calls_by_purpose: dict[JudgePurpose, int] = Field(
        default_factory=dict, description="v6: `judge_calls` by what the judge was asked."
    )
    judge_failures_by_purpose: dict[JudgePurpose, int] = Field(
        default_factory=dict, description="v6: `judge_failures` by what the judge was asked."
    )
    unranked_attempts: list[UnrankedAttempts] = Field(
        default_factory=list,
        description="v6: same-outcome attempts left without a rank, with the reason.",
    )
    judge_cost_usd: float = Field(
        0.0,
        ge=0.0,
        allow_inf_nan=False,
        description=(
            "v8: what every judge call billed for this run cost (answered or failed), in US "
            "dollars at the judge's configured prices; 0.0 before v8 or without prices."
        ),
    )
    order_checked: int = Field(
        0,
        ge=0,
        description=(
            "v9: the judge's order checks of the tournament group bouts this run was in (each "
            "bout judged in both orders, both answered); 0 for any other grading: a pairwise "
            "score says its one check in `Relative.order_consistent`."
        ),
    )
    order_inconsistent: int = Field(
        0,
        ge=0,
        description="v9: of `order_checked`, those whose second verdict did not mirror the first.",
    )

    @model_validator(mode="after")
    def _breakdowns_add_up(self) -> RunGraded:
        for total, by in (
            (self.judge_calls, self.judge_calls_by_purpose),
            (self.judge_failures, self.judge_failures_by_purpose),
        ):
            if by and sum(by.values()) != total:
                raise ValueError(f"a by-purpose breakdown {by} does not add up to {total}")
        if self.order_inconsistent > self.order_checked:
            raise ValueError(
                f"{self.order_inconsistent} inconsistent of {self.order_checked} order checks"
            )
        return self


class RunResult(Versioned):
    """What a consumer reads for a submitted task: one per task.

    Version 2 adds cancelled runs: `status` and `termination` may be
    `cancelled`, and such a run has no score (it was never graded). Version 3
    adds `step_credit` and the score changes of RunGraded v2. Version 4 adds
    `held_out`: whether the task was in the held-out set (§12.5). Version 5 carries the
    answered comparisons a `Ranked` score rests on (RunGraded v6); a version 4 score
    reads as it is. Version 6 says which branch of the run the result is of (`branch`,
    `parent_branch`) and, for a result the live branch replaced, which one
    (`superseded_by`); a version 5 result is branch 0's and was never superseded.
    """

    type: ClassVar[str] = "RunResult"
    version: ClassVar[int] = 6
    tenant: TenantId = Field(description="Tenant.")
    run_id: RunId = Field(description="The run that served the task.")
    task_id: TaskId = Field(description="The task's comparison key.")
    idempotency_key: str = Field(description="The submitting task's idempotency key.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="Version that ran.")
    status: Literal["graded", "ungraded", "cancelled"] = Field(
        description="How grading ended; `cancelled`: the run was stopped and never graded."
    )
    passed: bool = Field(description="Verification outcome.")
    verification: list[VerifierResult] = Field(description="Each verifier's result.")
    score: Score | None = Field(description="The score; None only for a cancelled run.")
    usage: Usage = Field(description="Model usage.")
    termination: Literal["succeeded", "failed", "cancelled"] = Field(
        description="How execution ended."
    )
    output: str | None = Field(None, description="The run's output, when small.")
    step_credit: list[StepCredit] = Field(
        default_factory=list,
        description="v3: each fail-then-pass retry, with what differed, attributed to its step.",
    )
    held_out: bool | None = Field(
        description=(
            "v4: the task is in the held-out set (§12.5): its result is reported apart and "
            "never read by a promotion gate; False: a selection task. None only for a result "
            "recorded before v4, which did not say."
        ),
    )
    branch: int = Field(
        0,
        ge=0,
        description=(
            "v6: the branch of the run this is the result of: 0, the run as spawned; a "
            "higher one for a rewind's branch or a branch command's child (§8.5)."
        ),
    )
    parent_branch: int | None = Field(
        None, ge=0, description="v6: the branch `branch` was forked from; None for branch 0."
    )
    superseded_by: int | None = Field(
        None,
        ge=1,
        description=(
            "v6: the task's result follows the live branch (the highest-numbered one graded); "
            "set on a result a higher branch's result replaced, naming that branch. None: "
            "this is the task's result."
        ),
    )


class CancelRun(Versioned):
    """An operator command: stop a run (`assay cancel`). Reachable from every
    non-terminal state; a run stopped mid-call with a dispatched intent ends with
    that attempt `Indeterminate`, else `Cancelled` (§5.1)."""

    type: ClassVar[str] = "CancelRun"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant of the run.")
    run_id: RunId = Field(description="The run to stop.")
    reason: str = Field("", max_length=2000, description="Why, for people.")


class CancelGrading(Versioned):
    """The execute stage, to verify: a branch that finished executing was cancelled before
    its grading ended (§5.2: cancel is legal from `Verifying` and `Grading`). No further
    verifier command or judge call is made for it; its result is `cancelled`.

    On `assay.run-commands`, beside the operator's `CancelRun` it answers, so that verify
    reads it apart from the episodes waiting to be verified."""

    type: ClassVar[str] = "CancelGrading"
    version: ClassVar[int] = 1
    run: RunRef = Field(description="The run, and the branch (`run.branch`) to stop.")
    reason: str = Field("", max_length=2000, description="Why, for people.")
    succeeded: bool = Field(description="How its execution ended: every step succeeded.")
    usage: Usage = Field(description="Model usage of its execution.")


class EpisodeReduced(Versioned):
    """Execute, to tournament: a run's episode was over its tenant's token ceiling once
    its grading ended, so retention replaced it by a summary and deleted the original
    (§10.3). Keyed by task like the run's `RunVerified`: a later challenger on the task
    compared with this run as its reference reads the summary instead (a reduced view,
    as the judge reads any episode over its prompt budget) rather than going ungraded."""

    type: ClassVar[str] = "EpisodeReduced"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant.")
    run_id: RunId = Field(description="The run whose episode was reduced.")
    task_id: TaskId = Field(description="The run's task: the comparison key.")
    original: str = Field(description="BlobRef of the episode, now deleted.")
    summary: str = Field(description="BlobRef of its summary (a `ReducedEpisode`).")


class GradingCancelled(Versioned):
    """Verify, to tournament: grading of a run's branch was cancelled (`CancelGrading`).
    Keyed by task like the branch's `RunVerified`, so tournament handles both in order;
    whichever comes first, the branch gets a `cancelled` result and no judge call."""

    type: ClassVar[str] = "GradingCancelled"
    version: ClassVar[int] = 1
    run: RunRef = Field(description="The run, and the branch (`run.branch`) stopped.")
    reason: str = Field("", max_length=2000, description="Why, for people.")
    succeeded: bool = Field(description="How its execution ended: every step succeeded.")
    usage: Usage = Field(description="Model usage of its execution.")
    verified: bool = Field(
        description="Verify had verified it before the cancel reached it (its verdict "
        "stands in the record; it is not graded)."
    )


class SignalRun(Versioned):
    """A signal for a run suspended at an await step: a human approval (`assay
    approve`), an external signal (`assay signal`), or its own deadline passing."""

    type: ClassVar[str] = "SignalRun"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant of the run.")
    run_id: RunId = Field(description="The suspended run.")
    signal: str = Field(
        pattern=r"^[A-Za-z0-9_.:-]{1,64}$", description="`approval` or the signal's name."
    )
    payload: str = Field("", max_length=100_000, description="Becomes the await step's output.")
    timed_out: bool = Field(False, description="Sent by Assay when the wait's deadline passed.")


class RewindRun(Versioned):
    """An operator command: fork a run at an LSN of one of its branches and drive the
    new branch from there (`assay rewind`). Nothing is deleted (§8.5)."""

    type: ClassVar[str] = "RewindRun"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant of the run.")
    run_id: RunId = Field(description="The run to rewind.")
    at: int = Field(ge=0, description="LSN of the branch at which the new branch departs.")
    branch: int | None = Field(None, ge=0, description="Branch to rewind; None: the live one.")
    reason: str = Field("", max_length=2000, description="Why, for people.")


class UsageRecorded(Versioned):
    """One model call, attributed to tenant, run and purpose, and what it cost (§14.1).

    Version 2 added `cost_usd`; a version 1 payload reads as costing 0.0. Version 3 adds
    `judge_purpose` and `failed`: a grading call says what the judge was asked, and a call
    the endpoint billed whose answer was unusable is recorded as failed — spend, never an
    answer. A version 2 payload reads as an answered call of no stated judge purpose.
    Version 4 lets a call serve no run (`run_id` None: a calibration call); a version 3
    payload reads as it is.
    """

    type: ClassVar[str] = "UsageRecorded"
    version: ClassVar[int] = 4
    tenant: TenantId = Field(description="Tenant.")
    run_id: RunId | None = Field(
        description=(
            "Run the call served; None for a call that served no run (calibration, proposer)."
        )
    )
    purpose: Purpose = Field(
        description="Work, shadow, replay, grading, calibration or proposer (a draft)."
    )
    model: str = Field(description="Model id.")
    prompt_tokens: int = Field(ge=0, description="Prompt tokens.")
    completion_tokens: int = Field(ge=0, description="Completion tokens.")
    cost_usd: float = Field(
        ge=0.0,
        allow_inf_nan=False,
        description=(
            "Price of the call in US dollars at the model's configured per-token prices; "
            "0.0 when none is configured."
        ),
    )
    judge_purpose: JudgePurpose | None = Field(
        None,
        description=(
            "v3: for a grading call, what the judge was asked; None for work and shadow "
            "calls, and for a grading call recorded before v3."
        ),
    )
    failed: bool = Field(
        False,
        description=(
            "v3: the endpoint answered and billed the call, but its answer was unusable (a "
            "refusal, output not in the judge's format): a judge failure, not an answer."
        ),
    )


def usage_recorded_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    """UsageRecorded v2 -> v3: a v2 call was recorded because it answered; it named no
    judge purpose."""
    return {**payload, "judge_purpose": None, "failed": False}


def run_graded_v5_to_v6(payload: dict[str, Any]) -> dict[str, Any]:
    """RunGraded v5 -> v6: v5 counted no failed call apart and broke nothing down by
    purpose; its `judge_calls` reads as it is."""
    return {
        **payload,
        "judge_failures": 0,
        "judge_calls_by_purpose": {},
        "judge_failures_by_purpose": {},
        "unranked_attempts": [],
    }


def run_result_v5_to_v6(payload: dict[str, Any]) -> dict[str, Any]:
    """RunResult v5 -> v6: before forks were graded every result was branch 0's, and
    none was superseded."""
    return {**payload, "branch": 0, "parent_branch": None, "superseded_by": None}


def run_ref_v3_unchanged(payload: dict[str, Any]) -> dict[str, Any]:
    """A message about a run, one version before `RunRef.branch`: it was about branch 0,
    which the new version reads as it is."""
    return dict(payload)


def run_result_v4_to_v5(payload: dict[str, Any]) -> dict[str, Any]:
    """RunResult v4 -> v5: a v4 score said nothing of its comparisons, which v5 reads as
    it is."""
    return dict(payload)


def run_graded_v7_to_v8(payload: dict[str, Any]) -> dict[str, Any]:
    """RunGraded v7 -> v8: a v7 grade did not say what its judge calls cost: 0.0."""
    return {**payload, "judge_cost_usd": 0.0}


def run_graded_v8_to_v9(payload: dict[str, Any]) -> dict[str, Any]:
    """RunGraded v8 -> v9: a v8 grade carried no tournament bout's order checks: none."""
    return {**payload, "order_checked": 0, "order_inconsistent": 0}


def usage_recorded_v3_to_v4(payload: dict[str, Any]) -> dict[str, Any]:
    """UsageRecorded v3 -> v4: every v3 call served a run; it reads as it is."""
    return dict(payload)


def usage_recorded_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """UsageRecorded v1 -> v2: a call recorded before prices were known cost 0.0."""
    return {**payload, "cost_usd": 0.0}


def run_result_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """RunResult v1 -> v2: v1 only knew graded and ungraded runs, which v2 reads as they are."""
    return dict(payload)


def run_result_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    """RunResult v2 -> v3: v2 results credited no steps."""
    return {**payload, "step_credit": []}


def run_result_v3_to_v4(payload: dict[str, Any]) -> dict[str, Any]:
    """RunResult v3 -> v4: a v3 result did not say whether its task was held out."""
    return {**payload, "held_out": None}


def run_graded_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """RunGraded v1 -> v2: v1 ran no attempt tournaments."""
    return {**payload, "attempt_ranks": [], "step_credit": []}


def run_ref_unchanged(payload: dict[str, Any]) -> dict[str, Any]:
    """A message about a run, one version before `RunRef.rollout` and `RunRef.held_out`: no
    rollout's sibling and a selection task, which the new version reads as it is."""
    return dict(payload)


def run_ref_v2_unchanged(payload: dict[str, Any]) -> dict[str, Any]:
    """A message about a run, one version before `RolloutRef.max_cost_usd`: no sibling had a
    cost cap, which the new version reads as it is."""
    return dict(payload)


def task_submitted_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    """TaskSubmitted v2 -> v3: a v2 rollout budget had no cost cap, which v3 reads as it is."""
    return dict(payload)


def _without_inline(data: dict[str, Any]) -> dict[str, Any]:
    # Left out unless carried: what keeps a run's `RunVerified` (the tournament's parked
    # runs, group members and siblings) stores it as it always did, never the copy.
    if data.get("episode_inline") is None:
        data.pop("episode_inline", None)
    return data


def episode_not_inline(payload: dict[str, Any]) -> dict[str, Any]:
    """RunExecuted / RunVerified v4 -> v5: a v4 run's episode is only in its blob, which
    v5 reads as it is (no inline copy: the reader reads the blob)."""
    return dict(payload)


def run_cost_unknown(payload: dict[str, Any]) -> dict[str, Any]:
    """RunExecuted / RunVerified v2 -> v3: a run reported before its cost was carried reads
    as costing 0.0 (as `UsageRecorded` v1 does); its `RunRef` reads as it is."""
    return {**payload, "cost_usd": 0.0}


def run_graded_v3_to_v4(payload: dict[str, Any]) -> dict[str, Any]:
    """RunGraded v3 -> v4: v3 carried no verifier results; a v3 failure reads as having
    no failed check to show (the proposer sees only its score and step credit)."""
    return {**payload, "failed_checks": []}


def task_submitted_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """TaskSubmitted v1 -> v2: v1 tasks asked for one run."""
    return {**payload, "rollout": None}


def run_spawned_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """RunSpawned v1 -> v2: v1 runs called no sub-workflows."""
    return {**payload, "subworkflows": {}}


def workflow_registered_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """WorkflowRegistered v1 -> v2: a v1 version derives from the one registered before it."""
    return {**payload, "parents": None}


def task_submitted_v3_to_v4(payload: dict[str, Any]) -> dict[str, Any]:
    """TaskSubmitted v3 -> v4: a version 3 rollout spec carries no candidate matrix."""
    return dict(payload)


def task_submitted_v4_to_v5(payload: dict[str, Any]) -> dict[str, Any]:
    """TaskSubmitted v4 -> v5: a version 4 candidate runs one sibling (`samples` 1)."""
    return dict(payload)
