"""Branching with deltas (DESIGN §13): where a stage boundary is, what a delta changes,
which deltas a parent's snapshot contradicts, and where a child first differs.

Pure functions over one branch's log records; the execute stage forks and drives
the children (`assay_execute.branching`).

**The boundary.** "After step S" is the point of the parent branch's log right
after the last record of S's last execution (its last attempt's end; a
conditional's routing; for a parallel step, the last record of any of its
branches). The children fork there like a rewind does (§8.5): the parent's
records below that LSN are copied, then `Forked` with the child's deltas. A step
the parent never reached, a parallel step's branch (name the parallel step), a
sub-workflow step (its records live on a stream of its own), and a step at
which the parent's run ended (nothing runs after it) are refused.

**Effective run.** A branch runs its pinned definition with the deltas of every
`Forked` record on it applied in LSN order — so a fork of a child (a rewind, or a
branch of a branch departing after the child's own fork point) keeps the
child's deltas. `prompt` and `model_params` change the step in the definition;
`tool_unavailable` and `inject_plan` are carried by the `RunSpec`, the plan
prepended to each model prompt after rendering (`model_context.with_plan`), verbatim.

**Fail closed.** A delta is refused, with the reason, before anything is forked
when the snapshot at the boundary already contradicts it or it could change
nothing there: a `prompt` or `model_params` delta for a step that ran before the
boundary, that is not a model step, or that sets what the step already has; a
`tool_unavailable` for a tool the parent called before the boundary (its effects
are in the snapshot), that no step calls, or that is already unavailable; an
`inject_plan` when every model step ran before the boundary; the same delta twice
in one child; deltas that make the workflow invalid. Also refused: an await step
after the boundary (a child is driven to its end in one go) and a run whose
sub-workflow steps ran on the parent (a fork does not copy their streams).

What a command leaves behind — outcomes and per-stage attribution — is
`assay.engine.lineage`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import assert_never

from assay.engine.context import RunSpec
from assay.engine.events import (
    AttemptStarted,
    Forked,
    RunCancelled,
    RunFinished,
)
from assay.kernel.errors import Refused
from assay.kernel.ids import StepId
from assay.messages.branching import (
    AnyDelta,
    BranchBoundary,
    BranchChild,
    InjectPlanDelta,
    ModelParamsDelta,
    PromptDelta,
    ToolUnavailableDelta,
)
from assay.record.events import LogRecord
from assay.workflow.ir import (
    AnyStep,
    AwaitStep,
    ModelStep,
    ParallelStep,
    SubworkflowStep,
    ToolStep,
    WorkflowDef,
)
from assay.workflow.validate import WorkflowInvalid, validate

__all__ = [
    "BranchPlan",
    "contradiction",
    "find_boundary",
    "forked_deltas",
    "plan_branch",
    "with_deltas",
]


def forked_deltas(records: Iterable[LogRecord]) -> list[AnyDelta]:
    """The deltas of every `Forked` record among `records`, in LSN order."""
    return [d for r in records if isinstance(r.event, Forked) for d in r.event.deltas]


def with_deltas(spec: RunSpec, deltas: Sequence[AnyDelta]) -> RunSpec:
    """`spec` with `deltas` applied in order (nothing checked: see `plan_branch`)."""
    steps: list[AnyStep] = list(spec.definition.steps)
    unavailable = set(spec.unavailable_tools)
    plan = spec.plan
    for delta in deltas:
        if isinstance(delta, PromptDelta | ModelParamsDelta):
            steps = [_changed(s, delta) if s.id == delta.step else s for s in steps]
        elif isinstance(delta, ToolUnavailableDelta):
            unavailable.add(delta.tool)
        else:
            plan = delta.plan if plan is None else f"{plan}\n\n{delta.plan}"
    definition = spec.definition.model_copy(update={"steps": steps}) if deltas else spec.definition
    return dataclasses.replace(
        spec, definition=definition, unavailable_tools=frozenset(unavailable), plan=plan
    )


def _changed(step: AnyStep, delta: PromptDelta | ModelParamsDelta) -> AnyStep:
    if not isinstance(step, ModelStep):
        return step  # refused by `plan_branch`; never changed here
    if isinstance(delta, PromptDelta):
        return step.model_copy(update={"prompt": delta.prompt})
    update: dict[str, object] = {}
    if delta.max_tokens is not None:
        update["max_tokens"] = delta.max_tokens
    if delta.timeout_s is not None:
        update["timeout_s"] = delta.timeout_s
    if delta.max_attempts is not None:
        update["retry"] = step.retry.model_copy(update={"max_attempts": delta.max_attempts})
    return step.model_copy(update=update)


@dataclass(frozen=True)
class BranchPlan:
    """A branch command checked against its parent: where the children depart, and
    each child's effective run."""

    boundary: BranchBoundary
    prefix: list[LogRecord]
    """The parent's records below the boundary: what every child starts from."""
    children: list[RunSpec]
    """Each child's run (its branch id still the parent's: the stage sets it)."""


def plan_branch(
    base: RunSpec,
    records: Sequence[LogRecord],
    step: StepId,
    children: Sequence[BranchChild],
    *,
    known_tools: frozenset[str],
    known_verifiers: frozenset[str] | None = None,
    ran_subworkflows: Iterable[StepId] = (),
) -> BranchPlan:
    """Check a branch command against the parent branch's `records` (all of them).

    `base` is the parent's run as pinned (no deltas); `ran_subworkflows` names the
    sub-workflow steps whose streams exist on the parent branch.

    Raises:
        Refused: the boundary or a delta is refused; the reason names which and why.
    """
    run, source = base.ref.run_id, base.branch
    head = f"run {run}: cannot branch after step {step!r}"
    boundary = find_boundary(base.definition, records, step, branch=source, head=head)
    prefix = [r for r in records if r.lsn < boundary.at]
    parent = with_deltas(base, forked_deltas(prefix))
    wf = parent.definition
    ran = _ran(prefix)
    for s in wf.steps:
        if isinstance(s, AwaitStep) and s.id not in ran:
            raise Refused(
                f"{head}: await step {s.id!r} may run after it, and a child is driven to "
                "its end in one go: it cannot wait for a signal"
            )
    called = next(iter(ran_subworkflows), None)
    if called is not None:
        raise Refused(
            f"{head}: sub-workflow step {called!r} ran on branch {source}; its records live "
            "on a stream of its own, which a fork does not copy"
        )
    specs = []
    for n, child in enumerate(children, start=1):
        where = f"{head}: child {n}"
        seen: set[tuple[str, str]] = set()
        for delta in child.deltas:
            target = (
                delta.step
                if isinstance(delta, PromptDelta | ModelParamsDelta)
                else delta.tool
                if isinstance(delta, ToolUnavailableDelta)
                else ""
            )
            if (delta.kind, target) in seen:
                raise Refused(f"{where}: {delta.describe()} is given twice")
            seen.add((delta.kind, target))
            why = contradiction(parent, prefix, delta)
            if why is not None:
                raise Refused(f"{where}: {delta.describe()}: {why}")
        spec = with_deltas(parent, child.deltas)
        try:
            validate(spec.definition, known_tools, known_verifiers)
        except WorkflowInvalid as exc:
            raise Refused(f"{where}: its deltas make the workflow invalid: {exc}") from exc
        specs.append(spec)
    return BranchPlan(boundary, prefix, specs)


def find_boundary(
    wf: WorkflowDef, records: Sequence[LogRecord], step: StepId, *, branch: int, head: str
) -> BranchBoundary:
    """The boundary "after `step`" on a finished branch (see the module docstring).

    Raises:
        Refused: no such step; a parallel branch or sub-workflow step; a step the
            branch never reached; a branch that has not ended; a step at which the
            branch's run ended.
    """
    try:
        node = wf.node(step)
    except KeyError:
        raise Refused(f"{head}: the workflow has no step {step!r}") from None
    owner = wf.parallel_branches().get(step)
    if owner is not None:
        raise Refused(f"{head}: it is a branch of parallel step {owner!r}; name {owner!r}")
    if isinstance(node, SubworkflowStep):
        raise Refused(f"{head}: a sub-workflow step's records live on a stream of its own")
    members = {step, *(node.branches if isinstance(node, ParallelStep) else ())}
    mine = [r.lsn for r in records if getattr(r.event, "step", None) in members]
    if not mine:
        raise Refused(f"{head}: branch {branch} never reached it")
    end = next((r for r in records if isinstance(r.event, RunFinished | RunCancelled)), None)
    if end is None:
        raise Refused(
            f"{head}: branch {branch} has not ended (a branch departs from a run that did)"
        )
    at = max(mine) + 1
    if end.lsn == at and isinstance(end.event, RunFinished):
        raise Refused(
            f"{head}: the run ended at that step on branch {branch}: nothing runs after it"
        )
    return BranchBoundary(step=step, branch=branch, at=at)


def contradiction(parent: RunSpec, prefix: Sequence[LogRecord], delta: AnyDelta) -> str | None:
    """Why the snapshot of `prefix` (the parent's records below the boundary, run as
    `parent`) contradicts `delta`, or would make it change nothing; None if it does not."""
    wf = parent.definition
    ran = _ran(prefix)
    if isinstance(delta, PromptDelta | ModelParamsDelta):
        try:
            node = wf.node(delta.step)
        except KeyError:
            return f"the workflow has no step {delta.step!r}"
        if not isinstance(node, ModelStep):
            return f"step {delta.step!r} is a {node.kind} step, not a model step"
        if delta.step in ran:
            return (
                f"step {delta.step!r} ran before the boundary (LSN {ran[delta.step]}): "
                "its output is already in the snapshot"
            )
        if isinstance(delta, PromptDelta) and delta.prompt == node.prompt:
            return f"step {delta.step!r} already has this prompt"
        if isinstance(delta, ModelParamsDelta):
            has = {
                "max_tokens": node.max_tokens,
                "timeout_s": node.timeout_s,
                "max_attempts": node.retry.max_attempts,
            }
            if all(has[k] == v for k, v in delta.params().items()):
                return f"step {delta.step!r} already has these parameters"
        return None
    if isinstance(delta, ToolUnavailableDelta):
        callers = [
            s for s in _all_steps(parent) if isinstance(s, ToolStep) and s.tool == delta.tool
        ]
        if not callers:
            return f"no step of the workflow calls tool {delta.tool!r}"
        if delta.tool in parent.unavailable_tools:
            return f"tool {delta.tool!r} is already unavailable on the parent branch"
        for r in prefix:
            ev = r.event
            if isinstance(ev, AttemptStarted) and any(s.id == ev.step for s in callers):
                return (
                    f"the parent called it before the boundary (step {ev.step!r}, LSN {r.lsn}): "
                    "its effects are already in the snapshot"
                )
        return None
    if isinstance(delta, InjectPlanDelta):
        if all(s.id in ran for s in wf.steps if isinstance(s, ModelStep)):
            return "every model step ran before the boundary: the plan would reach no prompt"
        return None
    assert_never(delta)


def _all_steps(spec: RunSpec) -> list[AnyStep]:
    """The run's steps and those of the sub-workflows it calls."""
    return [*spec.definition.steps, *(s for wf in spec.children.values() for s in wf.steps)]


def _ran(records: Iterable[LogRecord]) -> dict[str, int]:
    """Each step with a record among `records`, and its first LSN."""
    ran: dict[str, int] = {}
    for r in records:
        step = getattr(r.event, "step", None)
        if isinstance(step, str):
            ran.setdefault(step, r.lsn)
    return ran
