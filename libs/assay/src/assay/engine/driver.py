"""Durable execution of one run (§5, §8.3): one commit per event, resumable.

The driver replays the branch's history and continues where it ends: a step
whose attempt already finished is not run again; an attempt that was running
when the worker died is recovered (`attempts`). Retry makes attempt N+1;
attempt N is never touched. Control steps: a conditional's choice is recorded
and replayed, never re-evaluated; a parallel step runs its branches at once and
joins them (all, any, quorum), cancelling the branches it no longer needs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from assay.engine.attempts import MAX_INTERRUPTED, AttemptRunner
from assay.engine.context import (
    CancelScope,
    CheckpointingJournal,
    Journal,
    Replay,
    RunContext,
    RunSpec,
)
from assay.engine.events import Routed, RunStarted, Signalled, Suspended
from assay.engine.model_context import with_contexts
from assay.engine.models import Model
from assay.engine.suspension import Suspension
from assay.engine.tools import Tool
from assay.kernel.canonical import canonical_bytes
from assay.kernel.errors import AssayError
from assay.kernel.ids import Lsn, StepId
from assay.messages.episode import AttemptView, Episode
from assay.sandbox.port import SandboxProvider
from assay.workflow.expr import ExprError, holds, parse
from assay.workflow.ir import (
    AnyStep,
    AwaitStep,
    ConditionalStep,
    ModelStep,
    ParallelStep,
    SubworkflowStep,
    ToolStep,
    Transition,
    WorkflowDef,
)
from assay.workflow.subworkflows import MAX_SUBWORKFLOW_DEPTH
from assay.workflow.templates import TemplateError, render

__all__ = [
    "MAX_INTERRUPTED",
    "Driver",
    "Journal",
    "RunSpec",
    "RunSuspended",
    "StepNotExecutable",
    "check_executable",
]


class StepNotExecutable(AssayError):
    """The workflow has a step kind this executor does not run (refused before it starts)."""


class RunSuspended(Exception):
    """The run waits at an await step; drive it again once `Signalled` is recorded."""

    def __init__(self, suspended: Suspended) -> None:
        super().__init__(f"waiting at {suspended.step!r} for {suspended.signal!r}")
        self.suspended = suspended


def child_key(step: SubworkflowStep) -> str:
    """How a run's resolved sub-workflows are keyed: `<workflow>@<version or latest>`."""
    return f"{step.workflow}@{step.version}"


def check_executable(wf: WorkflowDef, children: Mapping[str, WorkflowDef] | None = None) -> None:
    """Refuse what this executor cannot run: an await step inside a sub-workflow (a
    signal names the run, not a stream inside it).

    Raises:
        StepNotExecutable: naming the first such step.
    """
    for child in (children or {}).values():
        for step in child.steps:
            if isinstance(step, AwaitStep):
                raise StepNotExecutable(
                    f"workflow {wf.id!r} calls {child.id!r}, whose step {step.id!r} is an "
                    "await step: awaits inside sub-workflows cannot execute yet"
                )


class Driver:
    """Runs workflows with a model, a tool registry and, optionally, a sandbox."""

    def __init__(
        self,
        model: Model,
        tools: Mapping[str, Tool],
        sandbox: SandboxProvider | None = None,
        clock: Callable[[], float] = time.time,
        checkpoint_every: int | None = None,
        suspension: Suspension | None = None,
    ) -> None:
        self.checkpoint_every = checkpoint_every
        """Store the drive's state every this many records (at a step boundary); None:
        never. Checkpoints only shorten a resumption: deleting them changes nothing else."""
        self.clock = clock
        """Wall clock (seconds since the epoch) that await deadlines are set by."""
        self.model = model
        self.tools = tools
        self.sandbox = sandbox
        self._attempts = AttemptRunner(model, tools, sandbox)
        self.suspension = suspension
        if suspension is not None:
            self._attempts.resident = suspension.ready
        """Resident sandboxes, released while a run waits (DESIGN §16); None: none kept."""

    async def drive(
        self,
        spec: RunSpec,
        journal: Journal,
        cancel: CancelScope | None = None,
        *,
        fresh: bool = False,
    ) -> Episode:
        """Execute (or resume) a run until every step is terminal or it is cancelled.

        `fresh` says the caller has just read the run's branch and found it empty
        (under the run's lease, so nobody wrote to it since): the drive starts from
        nothing without reading a checkpoint or the branch again.
        """
        if self.suspension is None:
            episode, run = await self._drive(spec, journal, cancel, parent=None, fresh=fresh)
        else:
            drives: list[RunContext] = []
            try:
                episode, run = await self._drive(
                    spec, journal, cancel, parent=None, fresh=fresh, drives=drives
                )
            finally:  # ended, suspended at an await, or stopped: its resident sandbox too
                for driven in drives:
                    await self.suspension.close(driven)
        if run.workspace is not None and self.sandbox is not None:
            await self.sandbox.discard(run.workspace)  # its last snapshot stays
        return episode

    async def _drive(
        self,
        spec: RunSpec,
        journal: Journal,
        cancel: CancelScope | None,
        parent: RunContext | None,
        depth: int = 0,
        *,
        fresh: bool = False,
        drives: list[RunContext] | None = None,
    ) -> tuple[Episode, RunContext]:
        """Drive one stream: a run, or (with `parent`) a sub-workflow inside it."""
        wf = spec.definition
        loop = _Loop(step_id=wf.steps[0].id)
        restored = None if fresh else await self._restore(spec, journal)
        if restored is not None:  # the checkpoint's state, then only the records after it
            loop, run, base = restored
            run.cancel = cancel or CancelScope()
        else:
            history = [] if fresh else await journal.history(spec.key)
            base = len(history)
            run = RunContext(
                spec, journal, Replay([r.event for r in history]), cancel or CancelScope()
            )
            run.resumed = run.recovered = bool(history)
            if run.replay.take(RunStarted) is None:
                definition = wf.model_dump(mode="json", by_alias=True)
                children = {
                    k: v.model_dump(mode="json", by_alias=True) for k, v in spec.children.items()
                }
                await run.record_and_commit(
                    RunStarted(
                        run=spec.ref,
                        definition=definition,
                        input=dict(spec.input),
                        subworkflows=children,
                    )
                )
        if drives is not None:
            drives.append(run)
        if parent is not None:  # a sub-workflow works in its run's workspace
            run.workspace, run.workspace_ref = parent.workspace, parent.workspace_ref
            run.root = parent.root or parent
        given = run.workspace, run.workspace_ref
        run.depth = depth
        saved = base + run.appended.n
        runs_of, edges_taken = loop.runs_of, loop.edges_taken
        failed_step: StepId | None = None
        step_id: StepId | None = loop.step_id
        executions = loop.executions
        edges = wf.edges()  # once per drive, not per step
        try:
            while step_id is not None:  # a cancelled run still replays what it recorded
                written = base + run.appended.n
                due = self.checkpoint_every and written - saved >= self.checkpoint_every
                if due and not run.appended.deferred:  # only what is committed
                    await self._checkpoint(
                        run, _Loop(step_id, runs_of, edges_taken, executions), Lsn(written - 1)
                    )
                    saved = written
                step = wf.node(step_id)
                iteration = runs_of.get(step_id, 0)
                runs_of[step_id] = iteration + 1
                executions += 1
                if executions > wf.budget.max_step_executions:
                    failed_step = step_id
                    break
                routed = await self._run(run, step, iteration)
                run.succeeded[step_id] = routed is not False and step_id not in run.timed_out
                if routed is False:
                    failed_step = step_id
                    break
                step_id = routed if isinstance(routed, str) else _route(edges, step_id, edges_taken)
        finally:  # what the child changed (the run may have released it meanwhile)
            if parent is not None and (
                run.workspace is not given[0] or run.workspace_ref != given[1]
            ):
                parent.workspace, parent.workspace_ref = run.workspace, run.workspace_ref
        cancelled = run.cancel.cancelled
        if cancelled:
            failed_step = None  # the run did not fail: it was stopped (the caller records why)
        episode = Episode(
            run=spec.ref,
            definition=wf.model_dump(mode="json", by_alias=True),
            input=dict(spec.input),
            attempts=with_contexts(
                wf, spec.input, run.totals.attempts, spec.plan, spec.unavailable_tools
            ),
            outputs=run.outputs,
            output=(
                run.outputs.get(wf.output_step) if failed_step is None and not cancelled else None
            ),
            succeeded=failed_step is None and not cancelled,
            failed_step=failed_step,
            usage=run.totals.usage(),
            workspace=run.workspace_ref,
        )
        return episode, run

    async def _checkpoint(self, run: RunContext, loop: _Loop, upto: Lsn) -> None:
        """Store the drive's state at a step boundary, valid up to `upto`."""
        journal = run.journal
        if not isinstance(journal, CheckpointingJournal):
            return
        state = {
            "v": 1,
            "workflow_version": run.spec.definition.version,
            "step_id": loop.step_id,
            "runs_of": loop.runs_of,
            "edges_taken": [[a, b, n] for (a, b), n in sorted(loop.edges_taken.items())],
            "executions": loop.executions,
            "outputs": run.outputs,
            "succeeded": run.succeeded,
            "timed_out": sorted(run.timed_out),
            "attempts": [a.model_dump(mode="json") for a in run.totals.attempts],
            "workspace_ref": run.workspace_ref,
        }
        await journal.put_checkpoint(run.spec.key, upto, canonical_bytes(state))

    async def _restore(
        self, spec: RunSpec, journal: Journal
    ) -> tuple[_Loop, RunContext, int] | None:
        """The drive's state from the branch's newest checkpoint, with a replay of the
        records after it; None without a usable checkpoint (fold from LSN 0)."""
        if not self.checkpoint_every or not isinstance(journal, CheckpointingJournal):
            return None
        cp = await journal.latest_checkpoint(spec.key)
        if cp is None:
            return None
        state = json.loads(cp.state)
        if state.get("v") != 1 or state.get("workflow_version") != spec.definition.version:
            return None
        after = await journal.history_after(spec.key, cp.upto)
        run = RunContext(spec, journal, Replay([r.event for r in after]), CancelScope())
        run.resumed = run.recovered = True
        run.outputs.update(state["outputs"])
        run.succeeded.update(state["succeeded"])
        run.timed_out.update(state["timed_out"])
        run.workspace_ref = state["workspace_ref"]
        for view in state["attempts"]:
            attempt = AttemptView.model_validate(view)
            run.totals.attempts.append(attempt)
            run.totals.add(attempt.usage)
        loop = _Loop(
            StepId(state["step_id"]),
            {StepId(k): v for k, v in state["runs_of"].items()},
            {(StepId(a), StepId(b)): n for a, b, n in state["edges_taken"]},
            state["executions"],
        )
        return loop, run, cp.upto + 1 + len(after)

    async def _run(self, run: RunContext, step: AnyStep, iteration: int) -> bool | StepId:
        """Run one step: False if it failed, a step id if it chose where to go, else True."""
        if self.suspension is not None:  # the run's wait boundaries, in any stream of it
            if isinstance(step, ModelStep):
                work = self._attempts.run_step(run, step, iteration)
                return await self.suspension.waiting(run, "model", work)
            if isinstance(step, SubworkflowStep) and not self._uses_sandbox(run, step):
                child = self._subworkflow(run, step, iteration)  # none of it needs the sandbox
                return await self.suspension.waiting(run, "subworkflow", child)
            if isinstance(step, ParallelStep) and not self._parallel_uses_sandbox(run, step):
                group = self._parallel(run, step, iteration)  # no branch needs the sandbox
                return await self.suspension.waiting(run, "parallel", group)
        if isinstance(step, ModelStep | ToolStep):
            return await self._attempts.run_step(run, step, iteration)
        if isinstance(step, ConditionalStep):
            return await self._conditional(run, step, iteration)
        if isinstance(step, ParallelStep):
            return await self._parallel(run, step, iteration)
        if isinstance(step, AwaitStep):
            return await self._await(run, step, iteration)
        if isinstance(step, SubworkflowStep):
            return await self._subworkflow(run, step, iteration)
        raise StepNotExecutable(
            f"step {step.id!r}: {step.kind} steps cannot be executed by this version of Assay"
        )

    def _uses_sandbox(self, run: RunContext, step: SubworkflowStep, depth: int = 0) -> bool:
        """Whether a step of the sub-workflow `step` calls (or of one it calls, at any
        depth) needs the run's sandbox."""
        child = run.spec.children.get(child_key(step))
        if child is None or depth > MAX_SUBWORKFLOW_DEPTH:
            return child is not None
        return any(
            self._attempts.needs_sandbox(s)
            or (isinstance(s, SubworkflowStep) and self._uses_sandbox(run, s, depth + 1))
            for s in child.steps
        )

    def _parallel_uses_sandbox(self, run: RunContext, step: ParallelStep) -> bool:
        """Whether a branch of the parallel step `step` needs the run's sandbox."""
        wf = run.spec.definition
        return any(self._attempts.needs_sandbox(wf.node(b)) for b in step.branches)

    async def _subworkflow(self, run: RunContext, step: SubworkflowStep, iteration: int) -> bool:
        """Drive the child workflow, pinned when the run was spawned, on a stream of its
        own inside the run; its output is the step's output."""
        if run.depth >= MAX_SUBWORKFLOW_DEPTH:
            raise StepNotExecutable(f"step {step.id!r}: sub-workflows nest too deep")
        child = run.spec.children.get(child_key(step))
        if child is None:
            raise StepNotExecutable(
                f"step {step.id!r}: {child_key(step)} was not resolved when the run was spawned"
            )
        try:
            task = {k: render(v, run.template_context()) for k, v in step.input.items()}
        except TemplateError:
            return False
        spec = dataclasses.replace(
            run.spec,
            definition=child,
            input=task,
            stream=f"{run.spec.key.stream}/sub/{step.id}/{iteration}",
        )
        episode, _ = await self._drive(
            spec, run.journal, run.cancel.child(), parent=run, depth=run.depth + 1
        )
        run.totals.add(episode.usage)
        if not episode.succeeded or episode.output is None:
            return False
        run.outputs[step.id] = episode.output
        return True

    async def _await(self, run: RunContext, step: AwaitStep, iteration: int) -> bool:
        """Suspend until a signal or the deadline is recorded; the signal's payload is
        the step's output. A timeout fails the run, or (`continue`) goes on with the
        step not succeeded."""
        suspended = run.replay.take(Suspended, step.id, iteration=iteration)
        signalled = run.replay.take(Signalled, step.id, iteration=iteration)
        if signalled is None:
            if run.cancel.cancelled:
                return False  # stopped while it waited
            if suspended is None:
                if self.suspension is not None:  # released before it waits
                    await self.suspension.release(run, "human")
                deadline = int((self.clock() + step.timeout_s) * 1000)
                suspended = Suspended(
                    step=step.id, iteration=iteration, signal=step.signal, deadline_ms=deadline
                )
                await run.record_and_commit(suspended)
            raise RunSuspended(suspended)
        if signalled.timed_out:
            if step.on_timeout == "fail":
                return False
            run.timed_out.add(step.id)
            return True
        run.outputs[step.id] = signalled.payload
        return True

    async def _conditional(
        self, run: RunContext, step: ConditionalStep, iteration: int
    ) -> bool | StepId:
        routed = run.replay.take(Routed, step.id, iteration=iteration)
        if routed is None:
            if run.cancel.cancelled:
                return False
            routed = _choose(step, iteration, run.template_context())
            await run.record_and_commit(routed)
        if routed.error is not None:
            return False
        return routed.to if routed.to is not None else True

    async def _parallel(self, run: RunContext, step: ParallelStep, iteration: int) -> bool:
        wf = run.spec.definition
        need = {"all": len(step.branches), "any": 1}.get(step.join, step.quorum or 1)
        branches = [wf.node(b) for b in step.branches]
        if any(self._attempts.needs_sandbox(b) for b in branches):
            await self._attempts.ensure_workspace(run)  # one workspace, shared by the branches
        scope = run.cancel.child()
        contexts = {b.id: self._branch_context(run, scope) for b in branches}
        tasks = {
            asyncio.create_task(self._branch(contexts[b.id], b, iteration)): b.id for b in branches
        }
        results: dict[StepId, bool] = {}
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    results[tasks[t]] = t.result()
                ok = sum(results.values())
                if ok >= need or len(results) - ok > len(branches) - need:
                    scope.cancel(f"parallel step {step.id!r} joined ({step.join})")
                    for t in pending:
                        results[tasks[t]] = await t
                    pending = set()
        finally:
            for t in pending:
                t.cancel()
        for b in branches:
            run.succeeded[b.id] = results.get(b.id, False)
            ref = contexts[b.id].workspace_ref
            if ref is not None:
                run.workspace_ref = ref
        if sum(results.values()) < need:
            return False
        joined = {b: run.outputs[b] for b in step.branches if run.succeeded[b]}
        run.outputs[step.id] = json.dumps(joined, sort_keys=True)
        return True

    @staticmethod
    def _branch_context(run: RunContext, scope: CancelScope) -> RunContext:
        """A branch shares the run's record and outputs, with a cancel scope of its own."""
        return dataclasses.replace(run, cancel=scope)

    async def _branch(self, run: RunContext, step: AnyStep, iteration: int) -> bool:
        if not isinstance(step, ModelStep | ToolStep):  # validation allows subworkflows only
            raise StepNotExecutable(f"parallel branch {step.id!r} is a {step.kind} step")
        return await self._attempts.run_step(run, step, iteration)


@dataclass
class _Loop:
    """Where the drive loop stands between two steps: what a checkpoint restores."""

    step_id: StepId
    runs_of: dict[StepId, int] = field(default_factory=dict)
    edges_taken: dict[tuple[StepId, StepId], int] = field(default_factory=dict)
    executions: int = 0


def _choose(step: ConditionalStep, iteration: int, context: dict[str, object]) -> Routed:
    """Evaluate the branches in order: the first true one wins."""
    try:
        for i, branch in enumerate(step.branches):
            if holds(parse(branch.when), context):
                return Routed(step=step.id, iteration=iteration, to=branch.to, branch=i)
    except ExprError as exc:
        return Routed(step=step.id, iteration=iteration, error=str(exc))
    return Routed(step=step.id, iteration=iteration, to=step.otherwise)


def _route(
    edges: list[Transition], at: StepId, taken: dict[tuple[StepId, StepId], int]
) -> StepId | None:
    """The next step after `at` succeeded: a bounded loop edge while under its bound, else
    the forward edge, else the end."""
    out = [e for e in edges if e.source == at]
    for e in out:
        if e.max_iterations is not None and taken.get((e.source, e.target), 0) < e.max_iterations:
            taken[(e.source, e.target)] = taken.get((e.source, e.target), 0) + 1
            return e.target
    for e in out:
        if e.max_iterations is None:
            return e.target
    return None
