"""The execute stage's log records (`WorkEvent`s) and their fold (§8.2)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from assay.engine.run_state import (
    AttemptView,
    BranchingDone,
    BranchVerdict,
    CancelAsked,
    ForkPoint,
    GradingStatus,
    IntentView,
    RunView,
    TieringDue,
    Waiting,
)
from assay.engine.staged_events import STAGING_EVENTS, fold_staging
from assay.kernel.attempts import AttemptState
from assay.kernel.ids import AttemptNo, RunId, StepId
from assay.kernel.intents import IntentState
from assay.kernel.schema import Versioned
from assay.messages.branching import BranchDelta, BranchTree
from assay.messages.models import RunRef, Usage
from assay.record.compaction import Compacted, fold_compacted
from assay.record.erasure import TenantErased
from assay.record.events import Event, EventRegistry, LogRecord
from assay.record.state import Delete, Patch, Put, StateDelta, StateKey


class RunStarted(Event):
    """A run began executing on this branch.

    Version 2 carries the pinned definition and the input, so that a run can be
    driven again — rewound onto a new branch — from its log alone.
    """

    type: ClassVar[str] = "RunStarted"
    version: ClassVar[int] = 2
    run: RunRef = Field(description="The run.")
    definition: dict[str, Any] | None = Field(
        None, description="The pinned workflow IR (v2; None in records written by v1)."
    )
    input: dict[str, Any] | None = Field(None, description="The task input (v2).")
    subworkflows: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="The sub-workflows the run calls, pinned at spawn: `<id>@<selector>` -> IR.",
    )


class Forked(Event):
    """This branch is a fork of `from_branch` at `at` (§8.5): its records below
    `at` are copies of the parent's, this record sits at LSN `at`, and new work
    follows. The parent branch is kept and stays readable.

    A rewind forks one branch; a branch command (`BranchRun`) forks one per child.
    Version 2 adds what a branch command's child carries: its `deltas` (applied to
    everything that runs after this record, and by every fork of this branch that
    copies it), its position `child`, its `label`, and the step it departed after
    (`after_step` — a field named `step` would file it with that step's records on
    replay).
    """

    type: ClassVar[str] = "Forked"
    version: ClassVar[int] = 2
    from_branch: int = Field(ge=0, description="The branch rewound.")
    at: int = Field(ge=0, description="The LSN of the parent at which this branch departs.")
    reason: str = Field("", description="Why, for people.")
    command: str = Field("", description="Id of the command that asked for it (idempotency).")
    discarded_effects: list[str] = Field(
        default_factory=list,
        description=(
            "Request ids of calls with an effect (not idempotent) that the parent committed "
            "at or after `at`: the log cannot un-happen them (a compensation problem)."
        ),
    )
    deltas: list[BranchDelta] = Field(
        default_factory=list, description="v2: the child's deltas (none for a rewind)."
    )
    child: int | None = Field(
        None, ge=1, description="v2: its position in its branch command; None for a rewind."
    )
    after_step: StepId | None = Field(
        None, description="v2: the step it departed after (a branch command's boundary)."
    )
    label: str = Field("", description="v2: the child's label, as given.")


class AttemptStarted(Event):
    """Attempt N of a step is `Running` (§5.1). Committed before the work starts."""

    type: ClassVar[str] = "AttemptStarted"
    version: ClassVar[int] = 1
    step: StepId = Field(description="Step.")
    attempt: AttemptNo = Field(description="Attempt number, 1-based.")
    iteration: int = Field(ge=0, description="Times the step had run before.")
    prompt: str | None = Field(None, description="Rendered prompt (model steps).")
    args: dict[str, str] | None = Field(None, description="Rendered arguments (tool steps).")


class AttemptFinished(Event):
    """Attempt N reached a terminal state. Attempt N is never written again.

    Version 2 adds `workspace`: the snapshot of the run's sandbox workspace as
    the attempt left it, which a resumed or forked run restores.
    """

    type: ClassVar[str] = "AttemptFinished"
    version: ClassVar[int] = 2
    step: StepId = Field(description="Step.")
    attempt: AttemptNo = Field(description="Attempt number.")
    state: AttemptState = Field(description="Terminal state.")
    output: str | None = Field(None, description="Output when it succeeded.")
    error: str | None = Field(None, description="Why it did not succeed.")
    usage: Usage = Field(description="Model usage of the attempt.")
    duration_ms: int = Field(ge=0, description="Wall-clock duration.")
    interrupted: bool = Field(
        False, description="Closed on recovery: the worker stopped mid-attempt."
    )
    workspace: str | None = Field(
        None, description="Blob ref of the workspace snapshot after the attempt (v2)."
    )


class Intent(Event):
    """A tool call's write-ahead intent reached `state` (§8.4). Committed before going on.

    `Pending` is written before the call is issued, `Dispatched` just before
    it is, `Committed` with its outcome. The request id and idempotency key are
    the ones the tool saw, so a recovery can ask or retry under them.
    """

    type: ClassVar[str] = "Intent"
    version: ClassVar[int] = 1
    step: StepId = Field(description="Step of the attempt making the call.")
    attempt: AttemptNo = Field(description="Attempt making the call.")
    state: IntentState = Field(description="Intent state entered.")
    tool: str = Field(description="Tool called.")
    effect: str = Field(description="Its declared effect class (idempotent, queryable, unsafe).")
    request_id: str = Field(description="Names this call; queryable tools tag the request with it.")
    idempotency_key: str | None = Field(None, description="Kernel-derived key (idempotent).")
    output: str | None = Field(None, description="Committed: the call's output.")
    error: str | None = Field(None, description="Committed: the call's reported failure.")
    resolved_by: str | None = Field(
        None, description="Committed on recovery: how (retried with key, lookup, re-dispatch)."
    )


class Routed(Event):
    """A conditional step chose where the run goes (recorded, never re-evaluated)."""

    type: ClassVar[str] = "Routed"
    version: ClassVar[int] = 1
    step: StepId = Field(description="The conditional step.")
    iteration: int = Field(ge=0, description="Times the step had run before.")
    to: StepId | None = Field(None, description="Step entered; None: the forward transition.")
    branch: int | None = Field(None, description="Index of the branch taken; None: otherwise.")
    error: str | None = Field(None, description="Why no route could be chosen (the run fails).")


class RunCancelled(Event):
    """The run was cancelled; nothing more runs on this branch."""

    type: ClassVar[str] = "RunCancelled"
    version: ClassVar[int] = 1
    reason: str = Field(description="Who cancelled it, and why.")
    indeterminate: bool = Field(
        description="An intent was dispatched and unresolved when it stopped."
    )
    usage: Usage = Field(description="Model usage of the run until then.")


class Suspended(Event):
    """The run waits at an await step for a signal (§5.2): it releases its lease and
    holds no worker until `Signalled` — a signal, an approval, or the deadline."""

    type: ClassVar[str] = "Suspended"
    version: ClassVar[int] = 1
    step: StepId = Field(description="The await step.")
    iteration: int = Field(ge=0, description="Times the step had run before.")
    signal: str = Field(description="What it waits for (`approval` or a signal name).")
    deadline_ms: int = Field(ge=0, description="When the wait times out (epoch ms).")


class Signalled(Event):
    """The await step's wait ended: the signal came (its payload is the step's output),
    or the deadline passed (`timed_out`)."""

    type: ClassVar[str] = "Signalled"
    version: ClassVar[int] = 1
    step: StepId = Field(description="The await step.")
    iteration: int = Field(ge=0, description="Times the step had run before.")
    signal: str = Field(description="The signal.")
    payload: str = Field("", description="What the signal carried (the step's output).")
    timed_out: bool = Field(False, description="The deadline passed before any signal.")


class CancelRequested(Event):
    """Someone asked to stop the run. Recorded on the run's commands stream
    (`<run>/commands`), beside the branch its worker writes under its lease."""

    type: ClassVar[str] = "CancelRequested"
    version: ClassVar[int] = 1
    reason: str = Field(description="Who asked, and why.")


class BranchTreeRecorded(Event):
    """A branch command's children all ended: its lineage (`tree`, also the blob
    `tree_ref` in the tenant's blobs). Recorded on the run's commands stream, once
    per command."""

    type: ClassVar[str] = "BranchTreeRecorded"
    version: ClassVar[int] = 1
    tree_ref: str = Field(description="BlobRef of the tree (a `BranchTree` JSON document).")
    tree: BranchTree = Field(description="The tree itself.")


class SandboxStarted(Event):
    """A generation of the run's resident sandbox is up, its workspace restored and both
    verified; only after this record does a step that needs the sandbox run (§16)."""

    type: ClassVar[str] = "SandboxStarted"
    version: ClassVar[int] = 1
    generation: int = Field(ge=1, description="The generation (1, 2, …; a new one each start).")
    identity: str = Field(description="What the resident process answered it is.")
    restored_from: str | None = Field(
        None, description="BlobRef of the workspace snapshot restored; None: an empty one."
    )
    start_ms: int = Field(ge=0, description="Restore, start and verification, in milliseconds.")


class SandboxCheckpointed(Event):
    """The resident sandbox's workspace, archived before anything of it is released."""

    type: ClassVar[str] = "SandboxCheckpointed"
    version: ClassVar[int] = 1
    generation: int = Field(ge=1, description="The generation checkpointed.")
    workspace: str = Field(description="BlobRef of the workspace snapshot.")


class SandboxReleased(Event):
    """The resident sandbox's processes are confirmed gone and its workspace removed:
    the run's wait is idle from here on, holding nothing."""

    type: ClassVar[str] = "SandboxReleased"
    version: ClassVar[int] = 1
    generation: int = Field(ge=1, description="The generation released.")
    wait: str = Field(
        description=(
            "The kind of wait it was released for (`model`, `human`, `subworkflow`, `parallel`)."
        )
    )


class BranchVerified(Event):
    """The result of one branch of a forked run came back (§8.5, DESIGN §13): its verifier
    outcome, recorded on the run's commands stream beside its execution status, so a
    branch command's children read as stages (executed, verified, graded), not as one
    undifferentiated outcome. Recorded once per branch, for runs that have forks."""

    type: ClassVar[str] = "BranchVerified"
    version: ClassVar[int] = 1
    branch: int = Field(ge=0, description="The branch whose result came back.")
    status: GradingStatus = Field(description="How its grading ended.")
    passed: bool = Field(description="Its verification outcome (False when cancelled).")
    failed_checks: list[str] = Field(
        default_factory=list, description="The verifiers it failed, by id."
    )


def commands_stream(run: str) -> str:
    """The stream that holds a run's operator commands."""
    return f"{run}/commands"


class RunFinished(Event):
    """Every step is terminal; the frozen episode is stored."""

    type: ClassVar[str] = "RunFinished"
    version: ClassVar[int] = 1
    succeeded: bool = Field(description="Every step ended with a succeeded attempt.")
    failed_step: StepId | None = Field(None, description="Step whose attempts ran out.")
    episode: str = Field(description="BlobRef of the episode.")
    usage: Usage = Field(description="Model usage of the run.")


class GradingEnded(Event):
    """Grading of the run terminated (§10.3): its `RunResult` said how. Recorded once,
    on the run's live branch; from here on the run may be reduced and tiered (§8.6)."""

    type: ClassVar[str] = "GradingEnded"
    version: ClassVar[int] = 1
    status: GradingStatus = Field(
        description="How grading ended; `cancelled`: the run was stopped and never graded."
    )


class Reduced(Event):
    """The episode's body was reduced at the tenant's token ceiling (§8.6).

    A later fact about an earlier record: `summary` (a new blob, a `ReducedEpisode`)
    stands for `original` (the `RunFinished` episode), whose body is deleted only
    after this record is committed. No blob is edited and no record is rewritten.
    """

    type: ClassVar[str] = "Reduced"
    version: ClassVar[int] = 1
    original: str = Field(description="BlobRef of the episode reduced (deleted after this).")
    summary: str = Field(description="BlobRef of the summary that stands for it.")
    tokens_before: int = Field(ge=0, description="The episode's tokens (retention's measure).")
    tokens_after: int = Field(ge=0, description="The summary's tokens, by the same measure.")
    ceiling: int = Field(ge=1, description="The tenant's ceiling the episode was over.")


class TieringQueued(Event):
    """A run under its tenant's token ceiling joins the tiering queue (§8.6): it is
    tiered `tier_after_s` after this record, without being reduced. Recorded with
    `GradingEnded` (a run over the ceiling joins the queue by its `Reduced` instead)."""

    type: ClassVar[str] = "TieringQueued"
    version: ClassVar[int] = 1


class ArchivedBranch(Versioned):
    """One branch of one stream whose records a `Tiered` archive holds."""

    type: ClassVar[str] = "ArchivedBranch"
    version: ClassVar[int] = 1
    stream: str = Field(description="The stream (the run, or its commands stream).")
    branch: int = Field(ge=0, description="The branch.")
    records: int = Field(ge=0, description="How many records it held (LSNs 0 .. n - 1).")


class SnapshotDocument(Versioned):
    """A derived document as it stood when the records that folded to it were tiered."""

    type: ClassVar[str] = "SnapshotDocument"
    version: ClassVar[int] = 1
    kind: str = Field(description="Document kind.")
    key: str = Field(description="Document key.")
    value: dict[str, Any] = Field(description="The document.")


class Tiered(Event):
    """A terminal run's records moved to cold storage once grading ended (§8.6).

    Recorded on the run's tombstone stream (`<run>/tiered`) in the commit that
    deleted the records from the log, after `archive` was durably written. The run's
    derived documents are restated in `documents`, so a re-fold of a log without the
    moved records still yields them byte for byte.
    """

    type: ClassVar[str] = "Tiered"
    version: ClassVar[int] = 1
    run: RunId = Field(description="The run whose records moved.")
    archive: str = Field(description="BlobRef of the archive (JSON lines, one per record).")
    records: int = Field(ge=0, description="Records moved (every branch of every stream).")
    streams: list[ArchivedBranch] = Field(description="The branches moved, with their sizes.")
    documents: list[SnapshotDocument] = Field(
        description="The derived documents the moved records had folded to, as they stood."
    )


WORK_EVENTS = EventRegistry(
    [
        TenantErased,  # every stage log can hold a tenant's tombstone
        RunStarted,
        Forked,
        AttemptStarted,
        Intent,
        AttemptFinished,
        Routed,
        Suspended,
        Signalled,
        CancelRequested,
        BranchTreeRecorded,
        BranchVerified,
        RunCancelled,
        RunFinished,
        GradingEnded,
        Reduced,
        TieringQueued,
        Tiered,
        SandboxStarted,
        SandboxCheckpointed,
        SandboxReleased,
        Compacted,
        *STAGING_EVENTS,
    ]
)


@WORK_EVENTS.upcaster("RunStarted", 1)
def _run_started_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 did not keep the definition and input: such a run cannot be rewound."""
    return {**payload, "definition": None, "input": None, "subworkflows": {}}


@WORK_EVENTS.upcaster("Forked", 1)
def _forked_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 forks were rewinds: no deltas, no child, no boundary step."""
    return {**payload, "deltas": [], "child": None, "after_step": None, "label": ""}


@WORK_EVENTS.upcaster("AttemptFinished", 1)
def _attempt_finished_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 knew no workspaces: the attempt left no snapshot."""
    return {**payload, "workspace": None}


def fold_work(record: LogRecord) -> list[StateDelta]:
    """Derived run and attempt documents (`assay.engine.run_state`), from one record alone."""
    t, run, branch = record.key.tenant, record.key.stream, record.key.branch
    run_doc = RunView.at(t, run)
    match record.event:
        case Compacted():  # retention's checkpoint (`assay.runtime.retention`)
            return fold_compacted(record)
        case event if isinstance(event, STAGING_EVENTS):  # a rollout sibling's staged effects
            return fold_staging(record)
        case RunStarted(run=ref):
            started = {
                "status": "running",
                "branch": branch,
                "workflow_id": ref.workflow_id,
                "workflow_version": ref.workflow_version,
                "role": ref.role.value,
                "purpose": ref.purpose.value,
                "task_id": ref.task_id,
                "attempts": 0,
                "started_ms": record.at_ms,
            }
            return [Put(run_doc, started)]  # not the model's dump: later patches fill it in
        case AttemptStarted(step=step, attempt=n, iteration=i):
            attempt = AttemptView.at(t, f"{run}/{branch}/{step}/{n}")
            return [
                Patch(run_doc, {"current_step": step, "last_lsn": record.lsn}),
                Put(attempt, {"state": AttemptState.RUNNING.value, "iteration": i}),
            ]
        case Intent(step=step, attempt=n, state=state, tool=tool, effect=effect):
            return [
                Patch(run_doc, {"last_lsn": record.lsn}),
                IntentView(state=state, tool=tool, effect=effect).put(
                    t, f"{run}/{branch}/{step}/{n}"
                ),
            ]
        case AttemptFinished(step=step, attempt=n, state=state, error=error):
            extra = {"indeterminate": True} if state is AttemptState.INDETERMINATE else {}
            return [
                Patch(run_doc, {"last_lsn": record.lsn, **extra}),
                Patch(
                    AttemptView.at(t, f"{run}/{branch}/{step}/{n}"),
                    {"state": state.value, "error": error},
                ),
            ]
        case Forked(from_branch=parent, at=at, discarded_effects=lost):
            return [
                Patch(
                    run_doc,
                    {
                        "status": "running",
                        "branch": branch,
                        "forked_from": ForkPoint(branch=parent, at=at).model_dump(),
                        "discarded_effects": lost,
                    },
                ),
                # A cancel asked for before the rewind stopped what ran then, not the fork.
                Delete(CancelAsked.at(t, run)),
            ]
        case Suspended(step=step, iteration=i, signal=signal, deadline_ms=deadline):
            waiting = Waiting(
                branch=branch, step=step, iteration=i, signal=signal, deadline_ms=deadline
            )
            return [
                Patch(run_doc, {"status": "suspended", "last_lsn": record.lsn}),
                waiting.put(t, run),
            ]
        case Signalled():
            return [
                Patch(run_doc, {"status": "running", "last_lsn": record.lsn}),
                Delete(Waiting.at(t, run)),
            ]
        case BranchTreeRecorded(tree_ref=ref, tree=tree):
            done = BranchingDone(
                tree=ref,
                step=tree.boundary.step,
                from_branch=tree.boundary.branch,
                at_lsn=tree.boundary.at,
                branches=[c.branch for c in tree.children],
            )
            return [done.put(t, f"{run.removesuffix('/commands')}/{tree.command}")]
        case BranchVerified(branch=b, status=status, passed=passed, failed_checks=failed):
            verdict = BranchVerdict(status=status, passed=passed, failed_checks=failed)
            return [verdict.put(t, f"{run.removesuffix('/commands')}/{b}")]
        case CancelRequested(reason=reason):
            asked = CancelAsked(reason=reason, at_ms=record.at_ms)
            return [asked.put(t, run.removesuffix("/commands"))]
        case Routed():
            return [Patch(run_doc, {"last_lsn": record.lsn})]
        case RunCancelled(reason=reason, indeterminate=unknown):
            return [
                Patch(
                    run_doc,
                    {
                        "status": "cancelled",
                        "cancel_reason": reason,
                        "indeterminate": unknown,
                        "finished_ms": record.at_ms,
                    },
                ),
                Delete(Waiting.at(t, run)),  # a cancelled run waits for nothing
            ]
        case RunFinished(succeeded=ok, episode=episode, usage=usage):
            return [
                Patch(
                    run_doc,
                    {
                        "status": "verifying",
                        "succeeded": ok,
                        "episode": episode,
                        "model_calls": usage.model_calls,
                        "finished_ms": record.at_ms,
                    },
                )
            ]
        case GradingEnded(status=status):
            return [Patch(run_doc, {"grading": status})]
        case TieringQueued():
            return [TieringDue(reduced_ms=record.at_ms).put(t, run)]
        case Reduced(summary=summary, tokens_before=before, tokens_after=after):
            return [
                Patch(
                    run_doc,
                    {
                        "reduced": True,
                        "summary": summary,
                        "tokens_before": before,
                        "tokens_after": after,
                    },
                ),
                # Reduced and not yet tiered: the queue tiering sweeps (§8.6).
                TieringDue(reduced_ms=record.at_ms).put(t, run),
            ]
        case Tiered(run=moved, archive=archive, records=n, documents=documents):
            return [
                *(Put(StateKey(t, d.kind, d.key), d.value) for d in documents),
                Delete(TieringDue.at(t, moved)),
                Patch(
                    RunView.at(t, moved),
                    {"tiered": True, "archive": archive, "archived_records": n},
                ),
            ]
    return []
