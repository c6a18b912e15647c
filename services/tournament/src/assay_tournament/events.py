"""The tournament stage's log: what it decided (its state and fold: `state.py`)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from assay.kernel import RunId, TaskId, WorkflowId, WorkflowVersion
from assay.kernel.scores import Score
from assay.record import Event, EventRegistry
from assay.record.compaction import Compacted
from assay.record.erasure import TenantErased


def outcome_class(passed: bool) -> str:
    """The verifier outcome class as a key part: groups never cross it (§11.8)."""
    return "pass" if passed else "fail"


class ReferenceSet(Event):
    """The first episode of a version on a task became its reference there."""

    type: ClassVar[str] = "ReferenceSet"
    version: ClassVar[int] = 1
    task_id: TaskId = Field(description="Task.")
    workflow_version: WorkflowVersion = Field(description="Version.")
    run_id: RunId = Field(description="Reference run.")
    episode: str = Field(description="BlobRef of its episode.")
    passed: bool = Field(description="Its verifier outcome.")


class EpisodeSummarised(Event):
    """Execute reduced a run's episode (`EpisodeReduced`): its summary stands for it."""

    type: ClassVar[str] = "EpisodeSummarised"
    version: ClassVar[int] = 1
    original: str = Field(description="BlobRef of the episode, deleted by execute.")
    summary: str = Field(description="BlobRef of its summary (a `ReducedEpisode`).")


class ChallengerParked(Event):
    """A challenger waits for the reference run spawned alongside it."""

    type: ClassVar[str] = "ChallengerParked"
    version: ClassVar[int] = 1
    verified: dict[str, Any] = Field(description="The RunVerified payload to grade later.")


def graded_key(run: dict[str, Any]) -> str:
    """What a stored `RunRef` payload is graded as (`RunRef.graded_as`): its run id, with
    `@<branch>` after it for a fork of the run."""
    fork = run.get("branch")
    return str(run["run_id"]) if not fork else f"{run['run_id']}@{fork['branch']}"


class RunScored(Event):
    """Grading of a branch of a run ended, with its score.

    Version 2 adds `branch`: a rewind's branch and a branch command's child are graded
    like any run; a version 1 score is branch 0's.
    """

    type: ClassVar[str] = "RunScored"
    version: ClassVar[int] = 2
    run_id: RunId = Field(description="Run.")
    task_id: TaskId = Field(description="Task.")
    workflow_version: WorkflowVersion = Field(description="Version.")
    score: Score = Field(description="The score.")
    judge_calls: int = Field(ge=0, description="Judge calls spent that answered.")
    order_index: int | None = Field(None, description="Comparison index of the challenger.")
    was_parked: bool = Field(False, description="It had been waiting for its reference.")
    branch: int = Field(0, ge=0, description="v2: the branch graded (0: the run as spawned).")

    @property
    def graded_as(self) -> str:
        """Its key: the run id, with `@<branch>` after it for a fork."""
        return self.run_id if self.branch == 0 else f"{self.run_id}@{self.branch}"


class GradingStopped(Event):
    """A branch's grading was cancelled before it ended (§5.2): it leaves its group or the
    reference it waited for, and no judge call is made for it."""

    type: ClassVar[str] = "GradingStopped"
    version: ClassVar[int] = 1
    run_id: RunId = Field(description="Run.")
    branch: int = Field(ge=0, description="The branch stopped (0: the run as spawned).")
    task_id: TaskId = Field(description="Task.")
    reason: str = Field(description="Why, for people.")

    @property
    def graded_as(self) -> str:
        """Its key: the run id, with `@<branch>` after it for a fork."""
        return self.run_id if self.branch == 0 else f"{self.run_id}@{self.branch}"


class ResultIssued(Event):
    """A branch's result went out as the task's result (§8.5: the result follows the live
    branch, the highest-numbered one graded), so a higher branch's can say it replaced it."""

    type: ClassVar[str] = "ResultIssued"
    version: ClassVar[int] = 1
    run_id: RunId = Field(description="Run.")
    branch: int = Field(ge=0, description="The branch whose result it is.")
    result: dict[str, Any] = Field(description="The `RunResult` payload, as emitted.")


class GroupJoined(Event):
    """An episode joined the open tournament group of its task and outcome class."""

    type: ClassVar[str] = "GroupJoined"
    version: ClassVar[int] = 1
    task_id: TaskId = Field(description="Task.")
    passed: bool = Field(description="Outcome class.")
    epoch: int = Field(ge=0, description="The group's generation.")
    opened_ms: int = Field(ge=0, description="When the group's first episode arrived.")
    quorum: int = Field(ge=2, description="Members that close the group.")
    timeout_s: float = Field(gt=0, description="The group closes this long after opening.")
    members: int = Field(ge=1, description="Members after this one joined.")
    member: dict[str, Any] = Field(
        description="The RunVerified payload, plus its attempt grades, to grade at closure."
    )


class GroupClosed(Event):
    """A group closed (quorum or timeout) and was graded; it never reopens (§11.6)."""

    type: ClassVar[str] = "GroupClosed"
    version: ClassVar[int] = 1
    task_id: TaskId = Field(description="Task.")
    passed: bool = Field(description="Outcome class.")
    epoch: int = Field(ge=0, description="The generation that closed; late arrivals get +1.")
    runs: list[RunId] = Field(description="Its members.")
    on_timeout: bool = Field(description="Closed by its timeout rather than its quorum.")
    judge_calls: int = Field(
        ge=0,
        description="Judge calls of the tournament that answered (before: the calls asked).",
    )
    judge_failures: int = Field(
        0, ge=0, description="Judge calls of the tournament that gave no usable answer."
    )
    inconsistent: int = Field(ge=0, description="Pairs whose two orderings disagreed.")
    anchored: bool = Field(description="The group held a control episode.")
    rounds_planned: int = Field(
        0, ge=0, description="Swiss rounds its size calls for (0: before this was recorded)."
    )
    rounds_played: int = Field(
        0,
        ge=0,
        description=(
            "Rounds it played: fewer than planned when the tenant's grading ceiling held "
            "only those (downsampled); 0 when none fitted and its members were not judged."
        ),
    )


class GradingMetered(Event):
    """The tenant's grading meter after a grading that spent or measured something."""

    type: ClassVar[str] = "GradingMetered"
    version: ClassVar[int] = 1
    meter: dict[str, Any] = Field(description="Judge calls today and by purpose; judge health.")


class SiblingWaiting(Event):
    """A rollout sibling's episode was verified; it waits for its group to close."""

    type: ClassVar[str] = "SiblingWaiting"
    version: ClassVar[int] = 1
    group: str = Field(description="The group (its task's idempotency key).")
    verified: dict[str, Any] = Field(description="The sibling's RunVerified payload.")


class RolloutSelected(Event):
    """A group's selection, once: the result it published."""

    type: ClassVar[str] = "RolloutSelected"
    version: ClassVar[int] = 1
    group: str = Field(description="The group.")
    result: dict[str, Any] = Field(description="The RolloutResult payload.")


class ReplaySpent(Event):
    """A shadow run's grading ended: what its execution spent is replay spend (§12.4)."""

    type: ClassVar[str] = "ReplaySpent"
    version: ClassVar[int] = 1
    run_id: RunId = Field(description="The shadow run.")
    day: str = Field(description="UTC day its grading ended (YYYY-MM-DD).")
    model_calls: int = Field(ge=0, description="Model calls it made.")
    tokens: int = Field(ge=0, description="Prompt and completion tokens it used.")


class JudgeAnswered(Event):
    """One judge answer given during a rollout selection, kept so a redelivered selection
    asks it again of no one: a verdict (`compare`) or violations (`screen`)."""

    type: ClassVar[str] = "JudgeAnswered"
    version: ClassVar[int] = 1
    key: str = Field(description="`group/a/b` for a comparison, `group/run` for a screen.")
    verdict: str | None = Field(None, description="The verdict as given (a, b or draw).")
    violations: list[dict[str, Any]] | None = Field(None, description="The screen's answer.")


class CalibrationEpisodeKept(Event):
    """A verified episode became one side of its task's calibration pair (§11): the first
    pass and the first fail of a workflow on a task are kept, nothing after them."""

    type: ClassVar[str] = "CalibrationEpisodeKept"
    version: ClassVar[int] = 1
    workflow_id: WorkflowId = Field(description="Workflow of the run.")
    task_id: TaskId = Field(description="Task.")
    passed: bool = Field(description="Its verifier outcome: the side of the pair it fills.")
    run_id: RunId = Field(description="The run.")
    episode: str = Field(description="BlobRef of its episode.")
    completes: bool = Field(description="The other side was already kept: the pair is whole.")


class CalibrationRan(Event):
    """A tenant's calibration round ran (or was skipped, saying why), and when the next
    one falls due."""

    type: ClassVar[str] = "CalibrationRan"
    version: ClassVar[int] = 1
    found: dict[str, Any] = Field(description="What it found: the JudgeCalibrated payload.")
    day: str = Field(description="UTC day of the round (YYYY-MM-DD).")
    calls_today: int = Field(ge=0, description="The tenant's calibration calls that day, after it.")
    next_due_ms: int = Field(ge=0, description="When the next round falls due (ms since epoch).")


TOURNAMENT_EVENTS = EventRegistry(
    [
        TenantErased,  # every stage log can hold a tenant's tombstone
        ReferenceSet,
        ChallengerParked,
        EpisodeSummarised,
        RunScored,
        GroupJoined,
        GroupClosed,
        GradingMetered,
        SiblingWaiting,
        RolloutSelected,
        JudgeAnswered,
        ReplaySpent,
        CalibrationEpisodeKept,
        CalibrationRan,
        ResultIssued,
        GradingStopped,
        Compacted,
    ]
)


@TOURNAMENT_EVENTS.upcaster("RunScored", 1)
def _run_scored_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 graded branch 0 only."""
    return {**payload, "branch": 0}


METER_STREAM = "grading-meter"
"""A tenant's grading meter is kept per partition of `assay.verified` (stream
`grading-meter@<partition>`, document `meter/grading@<partition>`): the partition's one
consumer is its one writer, so concurrent handlers never overwrite each other's calls.
Readers sum the documents."""

CALIBRATION_STREAM = "calibration"
"""A tenant's calibration rounds (handled on one partition: `CalibrationDue`'s key)."""
