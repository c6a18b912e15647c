"""A run's episode as the execute log records it (§8.2–§8.5), from the records alone.

`build_run_view` turns the `LogRecord`s of each branch of one run into a
`RunView`: branches, the step executions on each, their attempts, and the
write-ahead intents of each attempt with every state they reached. Nothing is
read from derived state or from blobs (the episode is named by its ref only), so
the view says exactly what the log says — including attempts that never
finished and intents that never resolved.

The live branch (§8.5: queries default to it) is the highest-numbered branch
that exists: a rewind forks a new, higher `BranchId` and leaves the branch it
left behind as evidence. `live_branch` is the one place that rule lives.

A record of a type this module does not know is kept as an `OtherRecord`; the
first such record whose type names a fork (`"fork"` in its type, any case) is
the branch's `ForkPoint`, its parent branch and LSN read from its one integer
field naming a branch and its one naming an LSN, when it has them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from assay.engine.events import (
    AttemptFinished,
    AttemptStarted,
    BranchTreeRecorded,
    BranchVerified,
    Forked,
    Intent,
    RunFinished,
    RunStarted,
)
from assay.engine.lineage import BranchingView, branching_view
from assay.kernel.attempts import AttemptState
from assay.kernel.ids import TenantId
from assay.kernel.intents import IntentState
from assay.messages.models import RunRef, Usage
from assay.record.events import LogRecord

VIEW_VERSION: Final = 1
"""Version of the view's JSON form; a key is never renamed or removed within one."""


class BranchStatus(enum.Enum):
    """How far a branch's execution got, as its records say."""

    RUNNING = "running"
    """No `RunFinished` yet: being driven, or waiting for a worker to resume it."""
    SUCCEEDED = "succeeded"
    """Every step ended with a succeeded attempt."""
    FAILED = "failed"
    """A step's attempts ran out, or one of them is Indeterminate."""


class _View(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class IntentTransition(_View):
    """One committed intent state."""

    state: IntentState = Field(description="The state entered.")
    lsn: int = Field(description="The record that committed it.")
    at_ms: int = Field(description="When, in milliseconds since the epoch.")


class IntentView(_View):
    """One tool call's write-ahead intent (§8.4), named by its request id."""

    request_id: str = Field(description="The request id the tool saw.")
    tool: str = Field(description="Tool called.")
    effect: str = Field(description="Declared effect class.")
    idempotency_key: str | None = Field(description="Kernel-derived key (idempotent tools).")
    state: IntentState = Field(description="The last state committed.")
    transitions: tuple[IntentTransition, ...] = Field(description="Every state, in order.")
    output: str | None = Field(description="The call's output, once committed.")
    error: str | None = Field(description="The call's reported failure, once committed.")
    resolved_by: str | None = Field(description="How a recovery resolved it, if one did.")


class AttemptView(_View):
    """Attempt N of one step: its start, its outcome if recorded, its intents."""

    attempt: int = Field(description="Attempt number, 1-based.")
    iteration: int = Field(description="Times the step had run before.")
    state: AttemptState = Field(description="Terminal state; `running` if none is recorded.")
    started_lsn: int = Field(description="The AttemptStarted record.")
    started_at_ms: int = Field(description="When it started.")
    finished_lsn: int | None = Field(description="The AttemptFinished record, if any.")
    duration_ms: int | None = Field(description="Wall-clock duration, once finished.")
    interrupted: bool = Field(description="Closed on recovery: the worker stopped mid-attempt.")
    indeterminate: bool = Field(description="Ended Indeterminate: the outcome is unknown.")
    output: str | None = Field(description="Output when it succeeded.")
    error: str | None = Field(description="Why it did not succeed.")
    usage: Usage | None = Field(description="Model usage, once finished.")
    intents: tuple[IntentView, ...] = Field(description="Its tool calls' intents, in order.")


class StepView(_View):
    """One execution (iteration) of a step and its attempts, in log order."""

    step: str = Field(description="Step id.")
    iteration: int = Field(description="Times the step had run before this execution.")
    attempts: tuple[AttemptView, ...] = Field(description="Attempts, in order.")


class ForkPoint(_View):
    """The record that says where a branch forked from (§8.5)."""

    type: str = Field(description="The record's type.")
    lsn: int = Field(description="Where on this branch it is recorded.")
    from_branch: int | None = Field(description="The parent branch, when the record names it.")
    at_lsn: int | None = Field(description="The LSN forked at, when the record names it.")
    fields: dict[str, Any] = Field(description="The record's fields, as logged.")


class OtherRecord(_View):
    """A record of a type the view does not interpret, kept as logged."""

    type: str = Field(description="The record's type.")
    lsn: int = Field(description="Its LSN.")
    at_ms: int = Field(description="When it was committed.")
    fields: dict[str, Any] = Field(description="Its fields.")


class BranchView(_View):
    """One branch of a run: its own LSNs from zero, its own attempts."""

    branch: int = Field(description="Branch id.")
    live: bool = Field(description="Whether this is the run's live branch.")
    fork: ForkPoint | None = Field(description="Where it forked from; None for a root branch.")
    records: int = Field(description="Records on the branch.")
    last_lsn: int = Field(description="LSN of its last record.")
    status: BranchStatus = Field(description="How far its execution got.")
    failed_step: str | None = Field(description="The step whose attempts ran out.")
    indeterminate: bool = Field(description="An attempt on it ended Indeterminate.")
    started_at_ms: int | None = Field(description="When RunStarted was committed.")
    finished_at_ms: int | None = Field(description="When RunFinished was committed.")
    usage: Usage = Field(description="RunFinished's usage, else the finished attempts' sum.")
    episode: str | None = Field(description="BlobRef of the frozen episode, once finished.")
    steps: tuple[StepView, ...] = Field(description="Step executions, in order of start.")
    other: tuple[OtherRecord, ...] = Field(description="Records the view does not interpret.")


class RunView(_View):
    """One run: the live branch's outcome, and the branches selected for showing."""

    version: Literal[1] = Field(VIEW_VERSION, description="Version of this JSON form.")
    run_id: str = Field(description="The run.")
    tenant: TenantId = Field(description="Its tenant.")
    ref: RunRef | None = Field(description="The run's identity, from RunStarted.")
    live_branch: int = Field(description="The live branch: the highest-numbered one.")
    branch_ids: tuple[int, ...] = Field(description="Every branch the run has, ascending.")
    status: BranchStatus = Field(description="The live branch's status.")
    failed_step: str | None = Field(description="The live branch's failed step.")
    indeterminate: bool = Field(description="An attempt on any branch ended Indeterminate.")
    indeterminate_branches: tuple[int, ...] = Field(
        description="The branches with an Indeterminate attempt: a discarded branch's unknown"
        " effect is still unknown (§8.5)."
    )
    usage: Usage = Field(description="The live branch's usage.")
    episode: str | None = Field(description="The live branch's episode ref.")
    branches: tuple[BranchView, ...] = Field(description="The branches shown, ascending.")
    branchings: tuple[BranchingView, ...] = Field(
        (), description="The run's branch commands whose trees are recorded, in order."
    )

    def only(self, branches: Iterable[int]) -> RunView:
        """The same run with only `branches` shown (run-level fields unchanged)."""
        keep = set(branches)
        return self.model_copy(
            update={"branches": tuple(b for b in self.branches if b.branch in keep)}
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON form: every key always present (null when the log has no value)."""
        return self.model_dump(mode="json")


def live_branch(branches: Iterable[int]) -> int:
    """The live branch of a run with these branches: the highest-numbered (§8.5).

    A rewind forks a new, higher branch, so the newest fork is the live one. Should
    the log come to record the live branch explicitly (a rewind undone), this is
    where that record would take precedence.

    Raises:
        ValueError: no branch at all.
    """
    return max(branches)


def build_run_view(
    branches: Mapping[int, Sequence[LogRecord]], commands: Sequence[LogRecord] = ()
) -> RunView:
    """The view of one run from the records of each of its branches (in LSN order),
    and of its commands stream (where branch commands record their trees).

    Raises:
        ValueError: no records, or records of more than one run.
    """
    present = {b: rs for b, rs in branches.items() if rs}
    if not present:
        raise ValueError("a run view needs at least one record")
    keys = {(r.key.tenant, r.key.stream) for rs in present.values() for r in rs}
    if len(keys) != 1:
        raise ValueError(f"records of {len(keys)} runs given for one view")
    ((tenant, run_id),) = keys
    live = live_branch(present)
    verdicts: dict[int, BranchVerified] = {}
    for r in commands:
        if isinstance(r.event, BranchVerified):
            verdicts.setdefault(r.event.branch, r.event)
    views = tuple(_branch(b, present[b], live=b == live) for b in sorted(present))
    shown = next(v for v in views if v.live)
    refs = [
        r.event.run
        for b in (live, *sorted(present))
        for r in present[b]
        if isinstance(r.event, RunStarted)
    ]
    return RunView(
        run_id=run_id,
        tenant=tenant,
        ref=refs[0] if refs else None,
        live_branch=live,
        branch_ids=tuple(sorted(present)),
        status=shown.status,
        failed_step=shown.failed_step,
        indeterminate=any(v.indeterminate for v in views),
        indeterminate_branches=tuple(v.branch for v in views if v.indeterminate),
        usage=shown.usage,
        episode=shown.episode,
        branches=views,
        branchings=tuple(
            branching_view(r, r.event, verdicts)
            for r in commands
            if isinstance(r.event, BranchTreeRecorded)
        ),
    )


# -- building one branch ------------------------------------------------------------


@dataclass
class _Intent:
    first: Intent
    last: Intent
    transitions: list[IntentTransition] = field(default_factory=list)


@dataclass
class _Attempt:
    started: AttemptStarted
    lsn: int
    at_ms: int
    finished: AttemptFinished | None = None
    finished_lsn: int | None = None
    intents: dict[str, _Intent] = field(default_factory=dict)


def _branch(branch: int, records: Sequence[LogRecord], *, live: bool) -> BranchView:
    executions: dict[tuple[str, int], list[_Attempt]] = {}
    attempts: dict[tuple[str, int], _Attempt] = {}
    started: LogRecord | None = None
    finished: tuple[LogRecord, RunFinished] | None = None
    fork: ForkPoint | None = None
    other: list[OtherRecord] = []
    for record in records:
        match record.event:
            case RunStarted():
                started = started or record
            case AttemptStarted(step=step, attempt=n, iteration=i) as event:
                at = _Attempt(event, record.lsn, record.at_ms)
                attempts[(step, n)] = at
                executions.setdefault((step, i), []).append(at)
            case Intent(step=step, attempt=n, request_id=rid) as event:
                owner = attempts.get((step, n))
                if owner is None:  # no AttemptStarted for it: keep it, as logged
                    other.append(_other(record))
                    continue
                slot = owner.intents.setdefault(rid, _Intent(event, event))
                slot.last = event
                slot.transitions.append(
                    IntentTransition(state=event.state, lsn=record.lsn, at_ms=record.at_ms)
                )
            case AttemptFinished(step=step, attempt=n) as event:
                owner = attempts.get((step, n))
                if owner is None:
                    other.append(_other(record))
                    continue
                owner.finished, owner.finished_lsn = event, record.lsn
            case RunFinished() as event:
                finished = finished or (record, event)
            case Forked() as event:  # a fork of a fork copies its parent's: the last is its own
                fork = ForkPoint(
                    type=event.type,
                    lsn=record.lsn,
                    from_branch=event.from_branch,
                    at_lsn=event.at,
                    fields=_fields(record),
                )
            case _:
                if fork is None and "fork" in record.event.type.lower():
                    fork = _fork_point(record)
                else:
                    other.append(_other(record))
    steps = tuple(
        StepView(step=step, iteration=i, attempts=tuple(_attempt(a) for a in ats))
        for (step, i), ats in executions.items()
    )
    all_attempts = [a for s in steps for a in s.attempts]
    if finished is None:
        status, failed_step, episode, at_end = BranchStatus.RUNNING, None, None, None
        usage = _sum(a.usage for a in all_attempts)
    else:
        end, ran = finished
        status = BranchStatus.SUCCEEDED if ran.succeeded else BranchStatus.FAILED
        failed_step, episode, at_end, usage = ran.failed_step, ran.episode, end.at_ms, ran.usage
    return BranchView(
        branch=branch,
        live=live,
        fork=fork,
        records=len(records),
        last_lsn=records[-1].lsn,
        status=status,
        failed_step=failed_step,
        indeterminate=any(a.indeterminate for a in all_attempts),
        started_at_ms=started.at_ms if started is not None else None,
        finished_at_ms=at_end,
        usage=usage,
        episode=episode,
        steps=steps,
        other=tuple(other),
    )


def _attempt(a: _Attempt) -> AttemptView:
    done = a.finished
    state = AttemptState.RUNNING if done is None else done.state
    return AttemptView(
        attempt=a.started.attempt,
        iteration=a.started.iteration,
        state=state,
        started_lsn=a.lsn,
        started_at_ms=a.at_ms,
        finished_lsn=a.finished_lsn,
        duration_ms=None if done is None else done.duration_ms,
        interrupted=done is not None and done.interrupted,
        indeterminate=state is AttemptState.INDETERMINATE,
        output=None if done is None else done.output,
        error=None if done is None else done.error,
        usage=None if done is None else done.usage,
        intents=tuple(
            IntentView(
                request_id=rid,
                tool=i.first.tool,
                effect=i.first.effect,
                idempotency_key=i.first.idempotency_key,
                state=i.last.state,
                transitions=tuple(i.transitions),
                output=i.last.output,
                error=i.last.error,
                resolved_by=i.last.resolved_by,
            )
            for rid, i in a.intents.items()
        ),
    )


def _sum(usages: Iterable[Usage | None]) -> Usage:
    total = Usage()
    for u in usages:
        if u is not None:
            total = Usage(
                model_calls=total.model_calls + u.model_calls,
                prompt_tokens=total.prompt_tokens + u.prompt_tokens,
                completion_tokens=total.completion_tokens + u.completion_tokens,
            )
    return total


def _fields(record: LogRecord) -> dict[str, Any]:
    return record.event.model_dump(mode="json")


def _other(record: LogRecord) -> OtherRecord:
    return OtherRecord(
        type=record.event.type, lsn=record.lsn, at_ms=record.at_ms, fields=_fields(record)
    )


def _fork_point(record: LogRecord) -> ForkPoint:
    fields = _fields(record)

    def one_int(word: str) -> int | None:
        found = [
            v
            for k, v in fields.items()
            if word in k.lower() and isinstance(v, int) and not isinstance(v, bool)
        ]
        return found[0] if len(found) == 1 else None

    return ForkPoint(
        type=record.event.type,
        lsn=record.lsn,
        from_branch=one_int("branch"),
        at_lsn=one_int("lsn"),
        fields=fields,
    )
