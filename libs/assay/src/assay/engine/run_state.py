"""The execute stage's derived documents, typed (what `fold_work` stores, §8.2).

Each model's fields are the keys its document is stored with. Documents the fold
builds with `Patch`es (a run's, an attempt's) give every patched-in field a
default, since a document holds only what its records have patched in so far.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from assay.engine.staged_events import StagedEffectView
from assay.kernel.attempts import AttemptState
from assay.kernel.ids import StepId, TaskId, WorkflowId, WorkflowVersion
from assay.kernel.intents import IntentState
from assay.messages.models import Purpose, Role
from assay.record.state import ReadModel

GradingStatus = Literal["graded", "ungraded", "cancelled"]
"""How grading of a run ended: `cancelled`, the run was stopped and never graded."""


class ForkPoint(BaseModel):
    """Where a forked branch departs from its parent."""

    model_config = ConfigDict(frozen=True)
    branch: int
    at: int


class RunView(ReadModel):
    """A run as execute sees it: its live branch, how far it got, how it ended, and
    what retention did to it. Keyed by run id."""

    kind: ClassVar[str] = "run"
    status: Literal["running", "suspended", "cancelled", "verifying"]
    branch: int
    workflow_id: WorkflowId
    workflow_version: WorkflowVersion
    role: Role
    purpose: Purpose
    task_id: TaskId
    attempts: int
    started_ms: int
    current_step: StepId | None = None
    last_lsn: int | None = None
    forked_from: ForkPoint | None = None
    discarded_effects: list[str] | None = None
    indeterminate: bool | None = None
    cancel_reason: str | None = None
    finished_ms: int | None = None
    succeeded: bool | None = None
    episode: str | None = None
    """BlobRef of the frozen episode, once the branch finished."""
    model_calls: int | None = None
    grading: GradingStatus | None = None
    """Set once grading of the run ended (`GradingEnded`)."""
    reduced: bool = False
    summary: str | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None
    tiered: bool = False
    archive: str | None = None
    archived_records: int | None = None


class AttemptView(ReadModel):
    """One attempt of one step on one branch. Keyed `<run>/<branch>/<step>/<attempt>`."""

    kind: ClassVar[str] = "attempt"
    state: AttemptState
    iteration: int
    error: str | None = None


class IntentView(ReadModel):
    """The newest state of an attempt's tool call. Keyed like its attempt."""

    kind: ClassVar[str] = "intent"
    state: IntentState
    tool: str
    effect: str


class Waiting(ReadModel):
    """A run suspended at an await step (§9.4). Keyed by run id; gone once it moves on."""

    kind: ClassVar[str] = "await"
    branch: int
    step: StepId
    iteration: int
    signal: str
    deadline_ms: int


class CancelAsked(ReadModel):
    """A cancel asked for a run, which whoever drives it stops at. Keyed by run id."""

    kind: ClassVar[str] = "cancel"
    reason: str
    at_ms: int


class BranchingDone(ReadModel):
    """A branch command's recorded tree (§13). Keyed `<run>/<command id>`."""

    kind: ClassVar[str] = "branching"
    model_config = ConfigDict(frozen=True, serialize_by_alias=True, validate_by_name=True)
    tree: str
    """BlobRef of the `BranchTree`."""
    step: StepId
    from_branch: int
    at_lsn: int = Field(alias="at")
    """The LSN of the parent the children depart at (stored as `at`)."""
    branches: list[int]


class BranchVerdict(ReadModel):
    """A forked run's branch, once its result came back (`BranchVerified`). Keyed
    `<run>/<branch>`."""

    kind: ClassVar[str] = "branch-verdict"
    status: GradingStatus
    passed: bool
    failed_checks: list[str]


class TieringDue(ReadModel):
    """A run whose grading ended and that is not tiered yet: the queue tiering sweeps
    (§8.6). Keyed by run id."""

    kind: ClassVar[str] = "tiering"
    reduced_ms: int
    """Since when the run is due (ms since the epoch): its reduction (`Reduced`), or for
    a run under the ceiling the end of its grading (`TieringQueued`); the stored name
    predates runs tiered unreduced."""


WORK_STATE: tuple[type[ReadModel], ...] = (
    RunView,
    AttemptView,
    IntentView,
    Waiting,
    CancelAsked,
    BranchingDone,
    BranchVerdict,
    TieringDue,
    StagedEffectView,
)
"""Every kind of document `fold_work` stores, as its read model."""

__all__ = [
    "WORK_STATE",
    "AttemptView",
    "BranchVerdict",
    "BranchingDone",
    "CancelAsked",
    "ForkPoint",
    "GradingStatus",
    "IntentView",
    "RunView",
    "StagedEffectView",
    "TieringDue",
    "Waiting",
]
