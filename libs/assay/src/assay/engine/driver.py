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

from assay.engine.events import AttemptFinished, AttemptStarted, RunStarted
from assay.engine.models import Model, ModelError
from assay.engine.tools import Tool, ToolCall, ToolError
from assay.kernel.attempts import AttemptState, attempt_transition
from assay.kernel.ids import AttemptNo, BranchId, StepId
from assay.kernel.schema import Versioned
from assay.messages.episode import AttemptView, Episode
from assay.messages.models import RunRef, Usage, UsageRecorded
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
        self, key: BranchKey, event: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        """Commit `event` (and messages to emit with it) durably before returning."""
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
                finished = replay.take(AttemptFinished, step=step.id, attempt=n)
                if finished is None:  # the worker stopped mid-attempt
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
            else:
                started, finished = await self._attempt(
                    spec, journal, step, n, iteration, outputs, totals
                )
            totals.attempts.append(_view(started, finished, iteration))
            totals.add(finished.usage)
            if finished.state is AttemptState.SUCCEEDED and finished.output is not None:
                outputs[step.id] = finished.output
                return True
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
        usage = Usage()
        output: str | None = None
        emits: list[tuple[str, Versioned]] = []
        state = AttemptState.FAILED
        if error is None:
            try:
                if isinstance(step, ModelStep):
                    assert prompt is not None
                    if totals.model_calls >= spec.definition.budget.max_model_calls:
                        raise ModelError("the run's model-call budget is spent")
                    seed = f"{spec.ref.run_id}:{step.id}:{n}"
                    done = await asyncio.wait_for(
                        self.model.complete(prompt, max_tokens=step.max_tokens, seed=seed),
                        step.timeout_s,
                    )
                    usage = Usage(
                        model_calls=1,
                        prompt_tokens=done.prompt_tokens,
                        completion_tokens=done.completion_tokens,
                    )
                    emits.append(
                        (
                            "assay.usage",
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
                    output = done.text
                else:
                    tool = self.tools.get(step.tool)
                    if tool is None:
                        raise ToolError(f"no tool {step.tool!r} is registered")
                    call = ToolCall(
                        tenant=spec.ref.tenant,
                        run_id=spec.ref.run_id,
                        branch=spec.branch,
                        step=step.id,
                        attempt=n,
                        args=args or {},
                        request_id=f"{spec.ref.run_id}/{spec.branch}/{step.id}/{n}",
                    )
                    output = await asyncio.wait_for(tool.fn(call), step.timeout_s)
                state = AttemptState.SUCCEEDED
            except TimeoutError:
                state, error = AttemptState.TIMED_OUT, f"timed out after {step.timeout_s}s"
            except (ModelError, ToolError) as exc:
                error = str(exc)
        attempt_transition(AttemptState.RUNNING, state)
        finished = AttemptFinished(
            step=step.id,
            attempt=n,
            state=state,
            output=output,
            error=error,
            usage=usage,
            duration_ms=int((time.monotonic() - t0) * 1000),
        )
        await journal.append(spec.key, finished, emits)
        return started, finished


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
