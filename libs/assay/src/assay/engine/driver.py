"""Durable execution of one run (§5, §8.3): one commit per event, resumable.

The driver replays the branch's history and continues where it ends: a step
whose attempt already finished is not run again; an attempt that was running
when the worker died is closed as interrupted (a model call or pure tool has
no external effect to be unsure about) and the next attempt runs. Retry makes
attempt N+1; attempt N is never touched.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from assay.bus.topics import RUN_STATUS, USAGE
from assay.engine.events import AttemptFinished, AttemptStarted, Intent, RunStarted
from assay.engine.models import Model, ModelError
from assay.engine.tools import (
    Pure,
    Queryable,
    Tool,
    ToolCall,
    ToolError,
    ToolRefused,
    Unsafe,
    effect_name,
    idempotency_key,
)
from assay.kernel.attempts import AttemptState, attempt_transition
from assay.kernel.ids import AttemptNo, BranchId, StepId
from assay.kernel.intents import IntentState, intent_transition
from assay.kernel.schema import Versioned
from assay.messages.episode import AttemptView, Episode
from assay.messages.models import AttemptIndeterminate, RunRef, Usage, UsageRecorded
from assay.record.events import BranchKey, Event, LogRecord
from assay.workflow.ir import ModelStep, ToolStep, WorkflowDef
from assay.workflow.templates import TemplateError, render

MAX_INTERRUPTED = 3
"""A step whose attempts kept dying with the worker stops being retried after this many."""


class Journal(Protocol):
    """Where the driver reads history and durably appends (one commit per call)."""

    async def history(self, key: BranchKey) -> list[LogRecord]:
        """Every record of the branch, in LSN order."""
        ...

    async def append(
        self, key: BranchKey, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        """Commit `events` (and messages to emit with them) in one durable commit."""
        ...


@dataclass
class _Replay:
    records: list[Event]
    pos: int = 0

    def take(self, kind: type[Event], **match: Any) -> Any:
        if self.pos < len(self.records):
            ev = self.records[self.pos]
            if isinstance(ev, kind) and all(getattr(ev, k) == v for k, v in match.items()):
                self.pos += 1
                return ev
        return None


@dataclass
class _Totals:
    model_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attempts: list[AttemptView] = field(default_factory=list)

    def add(self, u: Usage) -> None:
        self.model_calls += u.model_calls
        self.prompt_tokens += u.prompt_tokens
        self.completion_tokens += u.completion_tokens

    def usage(self) -> Usage:
        return Usage(
            model_calls=self.model_calls,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
        )


@dataclass(frozen=True)
class RunSpec:
    """What to run: the run, its pinned definition, its input, its branch."""

    ref: RunRef
    definition: WorkflowDef
    input: Mapping[str, Any]
    branch: BranchId

    @property
    def key(self) -> BranchKey:
        """The log key of this run's branch."""
        return BranchKey.for_run(self.ref.tenant, self.ref.run_id, self.branch)


class Driver:
    """Runs workflows with a model and a tool registry."""

    def __init__(self, model: Model, tools: Mapping[str, Tool]) -> None:
        self.model = model
        self.tools = tools

    async def drive(self, spec: RunSpec, journal: Journal) -> Episode:
        """Execute (or resume) a run to the point where every step is terminal."""
        wf = spec.definition
        replay = _Replay([r.event for r in await journal.history(spec.key)])
        if replay.take(RunStarted) is None:
            await journal.append(spec.key, RunStarted(run=spec.ref))
        totals = _Totals()
        outputs: dict[str, str] = {}
        runs_of: dict[StepId, int] = {}
        edges_taken: dict[tuple[StepId, StepId], int] = {}
        executions = 0
        failed_step: StepId | None = None
        step_id: StepId | None = wf.steps[0].id
        while step_id is not None:
            step = wf.step(step_id)
            iteration = runs_of.get(step_id, 0)
            runs_of[step_id] = iteration + 1
            executions += 1
            if executions > wf.budget.max_step_executions:
                failed_step = step_id
                break
            ok = await self._run_step(spec, journal, replay, step, iteration, outputs, totals)
            if not ok:
                failed_step = step_id
                break
            step_id = _route(wf, step_id, edges_taken)
        out_step = wf.output_step
        return Episode(
            run=spec.ref,
            definition=wf.model_dump(mode="json", by_alias=True),
            input=dict(spec.input),
            attempts=totals.attempts,
            outputs=outputs,
            output=outputs.get(out_step) if failed_step is None else None,
            succeeded=failed_step is None,
            failed_step=failed_step,
            usage=totals.usage(),
        )

    async def _run_step(
        self,
        spec: RunSpec,
        journal: Journal,
        replay: _Replay,
        step: ModelStep | ToolStep,
        iteration: int,
        outputs: dict[str, str],
        totals: _Totals,
    ) -> bool:
        counted = interrupted = 0
        attempt = sum(1 for a in totals.attempts if a.step == step.id)
        while True:
            attempt += 1
            n = AttemptNo(attempt)
            started = replay.take(AttemptStarted, step=step.id, attempt=n)
            if started is not None:
                finished = await self._recover(spec, journal, replay, step, started, iteration)
            else:
                started, finished = await self._attempt(
                    spec, journal, step, n, iteration, outputs, totals
                )
            totals.attempts.append(_view(started, finished, iteration))
            totals.add(finished.usage)
            if finished.state is AttemptState.SUCCEEDED and finished.output is not None:
                outputs[step.id] = finished.output
                return True
            if finished.state is AttemptState.INDETERMINATE:
                return False  # never retried automatically (§8.4)
            if finished.interrupted:
                interrupted += 1  # the worker's fault, not the step's: a separate bound
            else:
                counted += 1
            if (
                counted >= step.retry.max_attempts
                or interrupted >= MAX_INTERRUPTED
                or (totals.model_calls >= spec.definition.budget.max_model_calls)
            ):
                return False
            if step.retry.backoff_s:
                await asyncio.sleep(step.retry.backoff_s)

    async def _recover(
        self,
        spec: RunSpec,
        journal: Journal,
        replay: _Replay,
        step: ModelStep | ToolStep,
        started: AttemptStarted,
        iteration: int,
    ) -> AttemptFinished:
        """Attempt N's outcome: recorded, or recovered as §8.4's tables say."""
        n = started.attempt
        intents: list[Intent] = []
        while (ev := replay.take(Intent, step=step.id, attempt=n)) is not None:
            intents.append(ev)
        finished: AttemptFinished | None = replay.take(AttemptFinished, step=step.id, attempt=n)
        if finished is not None:
            return finished
        last = intents[-1] if intents else None
        if last is None or last.state is IntentState.PENDING:
            # Window A, or no effect at all: nothing was issued, retry freely.
            attempt_transition(AttemptState.RUNNING, AttemptState.FAILED)
            finished = AttemptFinished(
                step=step.id,
                attempt=n,
                state=AttemptState.FAILED,
                error="interrupted: the worker stopped before the attempt finished",
                usage=Usage(),
                duration_ms=0,
                interrupted=True,
            )
            await journal.append(spec.key, finished)
            return finished
        if last.state is IntentState.COMMITTED:  # outcome recorded, attempt not closed
            finished = _closing(step.id, n, last, time.monotonic())
            await journal.append(spec.key, finished)
            return finished
        # Window B: the call may have landed.
        assert isinstance(step, ToolStep)
        assert started.args is not None
        tool = self.tools.get(step.tool)
        call = _call(spec, step.id, n, started.args, last.request_id, last.idempotency_key)
        t0 = time.monotonic()
        if tool is None or isinstance(tool.effects, Unsafe | Pure):
            why = (
                f"tool {step.tool!r} is no longer registered"
                if tool is None
                else f"{last.effect} tool {step.tool!r} was dispatched and never resolved"
            )
            return await self._indeterminate(spec, journal, step, n, last, why, t0)
        if isinstance(tool.effects, Queryable):
            try:
                landed = await asyncio.wait_for(tool.effects.lookup(call), step.timeout_s)
            except (TimeoutError, ToolError) as exc:
                why = f"lookup of request {last.request_id} failed: {exc or 'timed out'}"
                return await self._indeterminate(spec, journal, step, n, last, why, t0)
            if landed is not None:
                return await self._commit_outcome(
                    spec, journal, last, step, n, t0, output=landed, resolved_by="lookup"
                )
            resolved_by = "lookup: not landed, dispatched again"
        else:
            resolved_by = "retried under the same idempotency key"
        return await self._dispatched(
            spec, journal, tool, step, n, call, last, t0, resolved_by=resolved_by
        )

    async def _attempt(
        self,
        spec: RunSpec,
        journal: Journal,
        step: ModelStep | ToolStep,
        n: AttemptNo,
        iteration: int,
        outputs: dict[str, str],
        totals: _Totals,
    ) -> tuple[AttemptStarted, AttemptFinished]:
        context = {
            "task": dict(spec.input),
            "steps": {k: {"output": v} for k, v in outputs.items()},
        }
        prompt: str | None = None
        args: dict[str, str] | None = None
        error: str | None = None
        try:
            if isinstance(step, ModelStep):
                prompt = render(step.prompt, context)
            else:
                args = {k: render(v, context) for k, v in step.args.items()}
        except TemplateError as exc:
            error = str(exc)
        started = AttemptStarted(
            step=step.id, attempt=n, iteration=iteration, prompt=prompt, args=args
        )
        await journal.append(spec.key, started)
        t0 = time.monotonic()
        if error is not None:
            return started, await self._finish(
                spec, journal, step.id, n, AttemptState.FAILED, t0, error=error
            )
        if isinstance(step, ModelStep):
            assert prompt is not None
            return started, await self._model_attempt(spec, journal, step, n, prompt, totals, t0)
        assert args is not None
        tool = self.tools.get(step.tool)
        if tool is None:
            return started, await self._finish(
                spec,
                journal,
                step.id,
                n,
                AttemptState.FAILED,
                t0,
                error=f"no tool {step.tool!r} is registered",
            )
        try:
            key = idempotency_key(tool, spec.ref.tenant, spec.ref.run_id, step.id, iteration, args)
        except ToolRefused as exc:
            return started, await self._finish(
                spec, journal, step.id, n, AttemptState.FAILED, t0, error=str(exc)
            )
        call = _call(spec, step.id, n, args, _request_id(spec, step.id, n), key)
        if not tool.has_effect:
            _, state, output, error = await _invoke(tool, call, step.timeout_s)
            return started, await self._finish(
                spec, journal, step.id, n, state, t0, output=output, error=error
            )
        pending = Intent(
            step=step.id,
            attempt=n,
            state=intent_transition(None, IntentState.PENDING),
            tool=tool.name,
            effect=effect_name(tool.effects),
            request_id=call.request_id,
            idempotency_key=key,
        )
        await journal.append(spec.key, pending)
        dispatched = pending.model_copy(
            update={"state": intent_transition(pending.state, IntentState.DISPATCHED)}
        )
        await journal.append(spec.key, dispatched)
        return started, await self._dispatched(spec, journal, tool, step, n, call, dispatched, t0)

    async def _dispatched(
        self,
        spec: RunSpec,
        journal: Journal,
        tool: Tool,
        step: ToolStep,
        n: AttemptNo,
        call: ToolCall,
        intent: Intent,
        t0: float,
        resolved_by: str | None = None,
    ) -> AttemptFinished:
        """Perform a dispatched call and resolve its intent by its effect class."""
        known, state, output, error = await _invoke(tool, call, step.timeout_s)
        if known:  # the tool answered: the outcome is recorded
            return await self._commit_outcome(
                spec,
                journal,
                intent,
                step,
                n,
                t0,
                output=output,
                error=error,
                resolved_by=resolved_by,
            )
        # No answer (a timeout or an unexpected crash of the tool): did it land?
        if isinstance(tool.effects, Queryable):
            try:
                landed = await asyncio.wait_for(tool.effects.lookup(call), step.timeout_s)
            except (TimeoutError, ToolError):
                landed = None
            if landed is not None:
                return await self._commit_outcome(
                    spec, journal, intent, step, n, t0, output=landed, resolved_by="lookup"
                )
        if isinstance(tool.effects, Unsafe):
            return await self._indeterminate(spec, journal, step, n, intent, error or "", t0)
        # Idempotent (a retry reuses the key) or a queryable call that did not land.
        return await self._finish(spec, journal, step.id, n, state, t0, error=error)

    async def _commit_outcome(
        self,
        spec: RunSpec,
        journal: Journal,
        intent: Intent,
        step: ToolStep,
        n: AttemptNo,
        t0: float,
        *,
        output: str | None = None,
        error: str | None = None,
        resolved_by: str | None = None,
    ) -> AttemptFinished:
        """`Committed` and the attempt's end, in one durable commit."""
        committed = intent.model_copy(
            update={
                "state": intent_transition(intent.state, IntentState.COMMITTED),
                "output": output if error is None else None,
                "error": error,
                "resolved_by": resolved_by,
            }
        )
        finished = _closing(step.id, n, committed, t0)
        await journal.append(spec.key, committed, finished)
        return finished

    async def _indeterminate(
        self,
        spec: RunSpec,
        journal: Journal,
        step: ModelStep | ToolStep,
        n: AttemptNo,
        intent: Intent,
        why: str,
        t0: float,
    ) -> AttemptFinished:
        """A dispatched call nobody can resolve: a recorded unknown and an operator alert."""
        reason = f"outcome unknown: {why}" if why else "outcome unknown"
        state = attempt_transition(
            AttemptState.RUNNING, AttemptState.INDETERMINATE, intent_dispatched=True
        )
        alert = AttemptIndeterminate(
            run=spec.ref,
            step=step.id,
            attempt=n,
            tool=intent.tool,
            request_id=intent.request_id,
            reason=reason,
        )
        return await self._finish(
            spec, journal, step.id, n, state, t0, error=reason, emits=[(RUN_STATUS, alert)]
        )

    async def _model_attempt(
        self,
        spec: RunSpec,
        journal: Journal,
        step: ModelStep,
        n: AttemptNo,
        prompt: str,
        totals: _Totals,
        t0: float,
    ) -> AttemptFinished:
        usage = Usage()
        emits: list[tuple[str, Versioned]] = []
        try:
            if totals.model_calls >= spec.definition.budget.max_model_calls:
                raise ModelError("the run's model-call budget is spent")
            seed = f"{spec.ref.run_id}:{step.id}:{n}"
            done = await asyncio.wait_for(
                self.model.complete(prompt, max_tokens=step.max_tokens, seed=seed),
                step.timeout_s,
            )
        except TimeoutError:
            return await self._finish(
                spec,
                journal,
                step.id,
                n,
                AttemptState.TIMED_OUT,
                t0,
                error=f"timed out after {step.timeout_s}s",
            )
        except ModelError as exc:
            return await self._finish(
                spec, journal, step.id, n, AttemptState.FAILED, t0, error=str(exc)
            )
        usage = Usage(
            model_calls=1,
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
        )
        emits.append(
            (
                USAGE,
                UsageRecorded(
                    tenant=spec.ref.tenant,
                    run_id=spec.ref.run_id,
                    purpose=spec.ref.purpose,
                    model=done.model,
                    prompt_tokens=done.prompt_tokens,
                    completion_tokens=done.completion_tokens,
                    cost_usd=done.cost_usd,
                ),
            )
        )
        return await self._finish(
            spec,
            journal,
            step.id,
            n,
            AttemptState.SUCCEEDED,
            t0,
            output=done.text,
            usage=usage,
            emits=emits,
        )

    async def _finish(
        self,
        spec: RunSpec,
        journal: Journal,
        step: StepId,
        n: AttemptNo,
        state: AttemptState,
        t0: float,
        *,
        output: str | None = None,
        error: str | None = None,
        usage: Usage | None = None,
        emits: Sequence[tuple[str, Versioned]] = (),
    ) -> AttemptFinished:
        attempt_transition(
            AttemptState.RUNNING,
            state,
            intent_dispatched=state is AttemptState.INDETERMINATE,
        )
        finished = AttemptFinished(
            step=step,
            attempt=n,
            state=state,
            output=output if state is AttemptState.SUCCEEDED else None,
            error=error,
            usage=usage or Usage(),
            duration_ms=int((time.monotonic() - t0) * 1000),
        )
        await journal.append(spec.key, finished, emits=emits)
        return finished


def _request_id(spec: RunSpec, step: StepId, n: AttemptNo) -> str:
    return f"{spec.ref.tenant}/{spec.ref.run_id}/{spec.branch}/{step}/{n}"


def _call(
    spec: RunSpec,
    step: StepId,
    n: AttemptNo,
    args: Mapping[str, str],
    request_id: str,
    key: str | None,
) -> ToolCall:
    return ToolCall(
        tenant=spec.ref.tenant,
        run_id=spec.ref.run_id,
        branch=spec.branch,
        step=step,
        attempt=n,
        args=args,
        request_id=request_id,
        idempotency_key=key,
    )


async def _invoke(
    tool: Tool, call: ToolCall, timeout_s: float
) -> tuple[bool, AttemptState, str | None, str | None]:
    """(known, state, output, error). `known` is False when the tool gave no answer
    (a timeout, or it broke): whether it acted is then unknown."""
    try:
        output = await asyncio.wait_for(tool.fn(call), timeout_s)
    except TimeoutError:
        return False, AttemptState.TIMED_OUT, None, f"timed out after {timeout_s}s"
    except ToolError as exc:  # the tool answered: it failed (ToolRefused: before any effect)
        return True, AttemptState.FAILED, None, str(exc)
    except Exception as exc:  # the tool itself broke: whether it acted is unknown
        return False, AttemptState.FAILED, None, f"the tool raised {type(exc).__name__}: {exc}"
    return True, AttemptState.SUCCEEDED, output, None


def _closing(step: StepId, n: AttemptNo, committed: Intent, t0: float) -> AttemptFinished:
    """The attempt's end that a committed intent implies."""
    ok = committed.error is None
    state = AttemptState.SUCCEEDED if ok else AttemptState.FAILED
    attempt_transition(AttemptState.RUNNING, state)
    return AttemptFinished(
        step=step,
        attempt=n,
        state=state,
        output=committed.output if ok else None,
        error=committed.error,
        usage=Usage(),
        duration_ms=int((time.monotonic() - t0) * 1000),
    )


def _route(wf: WorkflowDef, at: StepId, taken: dict[tuple[StepId, StepId], int]) -> StepId | None:
    """The next step after `at` succeeded: a bounded loop edge while under its bound, else
    the forward edge, else the end."""
    out = [e for e in wf.edges() if e.source == at]
    for e in out:
        if e.max_iterations is not None and taken.get((e.source, e.target), 0) < e.max_iterations:
            taken[(e.source, e.target)] = taken.get((e.source, e.target), 0) + 1
            return e.target
    for e in out:
        if e.max_iterations is None:
            return e.target
    return None


def _view(started: AttemptStarted, finished: AttemptFinished, iteration: int) -> AttemptView:
    return AttemptView(
        step=started.step,
        attempt=started.attempt,
        iteration=iteration,
        state=finished.state,
        prompt=started.prompt,
        output=finished.output,
        error=finished.error,
        usage=finished.usage,
        duration_ms=finished.duration_ms,
    )
