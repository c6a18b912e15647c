"""A run's intents and branch tree (`/api/runs/{id}/tree`), and a rollout group
(`/api/rollouts/{group}`), as the console's pages show them.

Both come from execute's log of the run (`runlog.py`: the view `assay runs show --json`
prints), regrouped for people: every write-ahead intent of every attempt on every
branch with each state it reached (the kernel's `IntentState`: pending, dispatched,
committed) and when; and the run's branches as a tree — each branch's parent and the
LSN it forked at, what the fork discarded, how far it got — with each branch command's
children, their deltas, the first step where they diverged from the parent, and their
verifier outcome.

A rollout group comes from the console's own read model: the runs that share the
group's task key, and the group's `RolloutResult` once it closed (siblings, how the
winner was selected and on what evidence, pass@k).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from assay.engine.episode_view import BranchStatus, RunView
from assay.engine.lineage import BranchingView
from assay.kernel.intents import IntentState
from assay.messages import RolloutResult
from assay_console.reads import RunSummary


class _Tree(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class IntentStep(_Tree):
    """One state an intent reached."""

    state: IntentState = Field(description="The state entered.")
    lsn: int = Field(description="The record on its branch that committed it.")
    at: datetime = Field(description="When it was committed.")


class IntentRow(_Tree):
    """One tool call's write-ahead intent, where it stands and how it got there."""

    branch: int = Field(description="The branch of its attempt.")
    step: str = Field(description="The step of its attempt.")
    iteration: int = Field(description="Times the step had run before.")
    attempt: int = Field(description="Its attempt's number.")
    request_id: str = Field(description="The request id the tool saw.")
    tool: str = Field(description="Tool called.")
    effect: str = Field(description="Declared effect class.")
    idempotency_key: str | None = Field(description="Kernel-derived key (idempotent tools).")
    state: IntentState = Field(description="The last state committed.")
    states: list[IntentStep] = Field(description="Every state it reached, in order.")
    resolved_by: str | None = Field(description="How a recovery resolved it, if one did.")
    error: str | None = Field(description="The call's reported failure, once committed.")


class BranchNode(_Tree):
    """One branch of the run, placed in the tree."""

    branch: int = Field(description="Branch id (0: the run's root).")
    parent: int | None = Field(description="The branch it forked from; None for the root.")
    fork_lsn: int | None = Field(description="The parent's LSN it forked at.")
    fork: str | None = Field(description="The record that forked it (`Forked`, ...).")
    reason: str | None = Field(description="Why it was forked, as the fork record says.")
    discarded_effects: list[str] = Field(
        description="Request ids of the parent's effects (not idempotent) the fork left behind."
    )
    live: bool = Field(description="The run's live branch (the highest-numbered).")
    status: BranchStatus = Field(description="How far its execution got.")
    failed_step: str | None = Field(description="The step whose attempts ran out.")
    indeterminate: bool = Field(description="An attempt on it ended Indeterminate.")
    children: list[int] = Field(description="Branches forked from it.")


class RunTree(_Tree):
    """A run's intents and branch tree, from execute's log."""

    run_id: str = Field(description="The run.")
    live_branch: int = Field(description="The live branch.")
    intents: list[IntentRow] = Field(
        description=(
            "Every intent, by branch then log order; a forked branch's own only (those it"
            " inherited up to its fork are shown on the branch that wrote them)."
        )
    )
    branches: list[BranchNode] = Field(description="Every branch, ascending.")
    branchings: list[BranchingView] = Field(
        description=(
            "The run's branch commands: where the children departed, their deltas, the first"
            " step each diverged at and why, how each ended and what its verifiers said."
        )
    )


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def run_tree(view: RunView) -> RunTree:
    """The intents and branch tree of the run `view` shows."""
    intents = [
        IntentRow(
            branch=b.branch,
            step=s.step,
            iteration=s.iteration,
            attempt=a.attempt,
            request_id=i.request_id,
            tool=i.tool,
            effect=i.effect,
            idempotency_key=i.idempotency_key,
            state=i.state,
            states=[IntentStep(state=t.state, lsn=t.lsn, at=_at(t.at_ms)) for t in i.transitions],
            resolved_by=i.resolved_by,
            error=i.error,
        )
        for b in view.branches
        for s in b.steps
        for a in s.attempts
        for i in a.intents
        # A fork copies its parent's records up to the fork: those intents are the parent's.
        if b.fork is None or not i.transitions or i.transitions[0].lsn > b.fork.lsn
    ]
    parents = {b.branch: b.fork.from_branch if b.fork else None for b in view.branches}
    branches = []
    for b in view.branches:
        fields: dict[str, Any] = b.fork.fields if b.fork else {}
        lost = fields.get("discarded_effects")
        reason = fields.get("reason")
        branches.append(
            BranchNode(
                branch=b.branch,
                parent=parents[b.branch],
                fork_lsn=b.fork.at_lsn if b.fork else None,
                fork=b.fork.type if b.fork else None,
                reason=str(reason) if reason else None,
                discarded_effects=[str(x) for x in lost] if isinstance(lost, list) else [],
                live=b.live,
                status=b.status,
                failed_step=b.failed_step,
                indeterminate=b.indeterminate,
                children=sorted(c for c, p in parents.items() if p == b.branch),
            )
        )
    return RunTree(
        run_id=view.run_id,
        live_branch=view.live_branch,
        intents=intents,
        branches=branches,
        branchings=list(view.branchings),
    )


class RolloutGroupView(_Tree):
    """One rollout group: its siblings as the console knows them, and its result."""

    group: str = Field(description="The group: its task's idempotency key.")
    runs: list[RunSummary] = Field(description="The runs sharing the key, newest first.")
    result: RolloutResult | None = Field(
        description=(
            "The group's result once it closed: every sibling's outcome, the selection "
            "(policy, who decided, evidence), the winner, pass@k; None: not closed yet. "
            "Effects a sibling staged and the selection discarded are not recorded in it."
        )
    )
