"""What a branch command leaves behind (DESIGN §13): each branch's outcome, the stage a
child's difference from its parent is attributed to, and the run view of both.

**Attribution.** A child's step executions after the boundary are compared with
its parent's, in order: the first whose success or output differs, or that only
one of them ran, is the stage the child diverged at; None when none differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from assay.engine.events import (
    AttemptFinished,
    AttemptStarted,
    BranchTreeRecorded,
    BranchVerified,
    Routed,
    RunCancelled,
    RunFinished,
    Signalled,
)
from assay.kernel.attempts import AttemptState
from assay.kernel.ids import StepId
from assay.messages.branching import BranchOutcome, Divergence
from assay.messages.models import Usage
from assay.record.events import LogRecord

__all__ = [
    "MAX_OUTPUT_CHARS",
    "BranchingChildView",
    "BranchingView",
    "StepOutcome",
    "branch_outcome",
    "branching_view",
    "first_divergence",
    "step_outcomes",
]

MAX_OUTPUT_CHARS = 4000
"""How much of a branch's output its `BranchOutcome` keeps (the episode keeps all)."""


@dataclass(frozen=True)
class StepOutcome:
    """How one execution of a step ended, as its records say."""

    step: StepId
    iteration: int
    succeeded: bool
    output: str | None


def step_outcomes(records: Iterable[LogRecord]) -> list[StepOutcome]:
    """Every step execution among `records`, in order of its first record."""
    iteration_of: dict[tuple[str, int], int] = {}
    found: dict[tuple[str, int], StepOutcome] = {}
    for r in records:
        ev = r.event
        if isinstance(ev, AttemptStarted):
            iteration_of[(ev.step, ev.attempt)] = ev.iteration
            key = (ev.step, ev.iteration)
            found.setdefault(key, StepOutcome(ev.step, ev.iteration, False, None))
        elif isinstance(ev, AttemptFinished):
            it = iteration_of.get((ev.step, ev.attempt), 0)
            ok = ev.state is AttemptState.SUCCEEDED
            found[(ev.step, it)] = StepOutcome(ev.step, it, ok, ev.output)
        elif isinstance(ev, Routed):
            route = f"route {ev.to or 'forward'}"
            found[(ev.step, ev.iteration)] = StepOutcome(
                ev.step, ev.iteration, ev.error is None, route
            )
        elif isinstance(ev, Signalled):
            found[(ev.step, ev.iteration)] = StepOutcome(
                ev.step, ev.iteration, not ev.timed_out, ev.payload
            )
    return list(found.values())


def first_divergence(
    parent: Sequence[LogRecord], child: Sequence[LogRecord], at: int
) -> Divergence | None:
    """The first step execution after the boundary at LSN `at` whose outcome differs
    between the parent branch and the child (both given whole); None if none does."""
    theirs = step_outcomes(r for r in parent if r.lsn >= at)
    ours = step_outcomes(r for r in child if r.lsn > at)  # the child's own Forked sits at `at`
    by_key = {(o.step, o.iteration): o for o in theirs}
    for o in ours:
        p = by_key.get((o.step, o.iteration))
        if p is None:
            why = "the parent never ran it"
        elif p.succeeded != o.succeeded:
            why = (
                "it failed here and succeeded in the parent"
                if p.succeeded
                else "it succeeded here and failed in the parent"
            )
        elif p.output != o.output:
            why = "its output differs from the parent's"
        else:
            continue
        return Divergence(step=o.step, iteration=o.iteration, why=why)
    done = {(o.step, o.iteration) for o in ours}
    for p in theirs:
        if (p.step, p.iteration) not in done:
            return Divergence(
                step=p.step, iteration=p.iteration, why="the parent ran it and this child did not"
            )
    return None


def branch_outcome(records: Sequence[LogRecord], at: int, output: str | None) -> BranchOutcome:
    """How a finished branch ended, from its records (`output` from its episode), with
    the usage of its attempts at or after LSN `at`.

    Raises:
        ValueError: the branch has not ended.
    """
    after = Usage()
    for r in records:
        ev = r.event
        if r.lsn >= at and isinstance(ev, AttemptFinished):
            after = Usage(
                model_calls=after.model_calls + ev.usage.model_calls,
                prompt_tokens=after.prompt_tokens + ev.usage.prompt_tokens,
                completion_tokens=after.completion_tokens + ev.usage.completion_tokens,
            )
        if isinstance(ev, RunFinished):
            return BranchOutcome(
                status="succeeded" if ev.succeeded else "failed",
                failed_step=ev.failed_step,
                output=None if output is None else output[:MAX_OUTPUT_CHARS],
                usage=ev.usage,
                usage_after_boundary=after,
                episode=ev.episode,
            )
        if isinstance(ev, RunCancelled):
            return BranchOutcome(status="cancelled", usage=ev.usage, usage_after_boundary=after)
    raise ValueError("the branch has not ended")


# -- the run view's part ------------------------------------------------------------------


class _LineageView(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BranchingChildView(_LineageView):
    """One child of a branch command, as its tree records it."""

    child: int = Field(description="Its position in the command, 1-based.")
    branch: int = Field(description="Its branch.")
    label: str = Field(description="Its label, as given.")
    deltas: tuple[str, ...] = Field(description="Its deltas, as short labels.")
    status: str = Field(description="How it ended: succeeded, failed or cancelled.")
    verification: str | None = Field(
        None,
        description=(
            "Its verifier outcome, once its result came back: `pass`, `fail` (then "
            "`failed_checks` names the verifiers), or `cancelled` (grading was stopped); "
            "None: not yet."
        ),
    )
    failed_checks: tuple[str, ...] = Field((), description="The verifiers it failed.")
    failed_step: str | None = Field(description="The step whose attempts ran out.")
    diverged_at: str | None = Field(
        description="First step whose outcome differs from the parent's; None: none did."
    )
    why: str | None = Field(description="How it differs there.")
    result: str = Field(description="BlobRef of its result (with its provenance).")


class BranchingView(_LineageView):
    """One branch command of the run (§13): where its children departed, how they ended."""

    command: str = Field(description="Id of the `BranchRun` message.")
    lsn: int = Field(description="Its `BranchTreeRecorded` on the run's commands stream.")
    at_ms: int = Field(description="When the tree was recorded.")
    after_step: str = Field(description="The step after which the children departed.")
    from_branch: int = Field(description="The parent branch.")
    at_lsn: int = Field(description="The parent's LSN at which the children departed.")
    tree: str = Field(description="BlobRef of the tree.")
    parent_status: str = Field(description="How the parent branch ended.")
    children: tuple[BranchingChildView, ...] = Field(description="The children, in order.")


def branching_view(
    record: LogRecord,
    recorded: BranchTreeRecorded,
    verdicts: Mapping[int, BranchVerified] | None = None,
) -> BranchingView:
    """The view of one recorded tree (`record` holds `recorded`), with each child's
    verifier outcome from `verdicts` (by branch) where its result came back."""
    tree, verdicts = recorded.tree, verdicts or {}
    return BranchingView(
        command=tree.command,
        lsn=record.lsn,
        at_ms=record.at_ms,
        after_step=tree.boundary.step,
        from_branch=tree.boundary.branch,
        at_lsn=tree.boundary.at,
        tree=recorded.tree_ref,
        parent_status=tree.parent.status,
        children=tuple(
            BranchingChildView(
                child=c.child,
                branch=c.branch,
                label=c.label,
                deltas=tuple(d.describe() for d in c.deltas),
                status=c.outcome.status,
                verification=_verification(verdicts.get(c.branch)),
                failed_checks=tuple(v.failed_checks) if (v := verdicts.get(c.branch)) else (),
                failed_step=c.outcome.failed_step,
                diverged_at=c.diverged_at.step if c.diverged_at else None,
                why=c.diverged_at.why if c.diverged_at else None,
                result=c.result,
            )
            for c in tree.children
        ),
    )


def _verification(verdict: BranchVerified | None) -> str | None:
    if verdict is None:
        return None
    if verdict.status == "cancelled":
        return "cancelled"
    return "pass" if verdict.passed else "fail"
