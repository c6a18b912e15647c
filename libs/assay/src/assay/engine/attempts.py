"""Attempts of model and tool steps (§5.1, §8.4): run live, or recover from the log.

An attempt's start is committed before the call (write-ahead), except for a
`Pure` tool's: a Pure call can simply run again after a crash, so its start
and end ride together with the journal's next commit, whatever makes it — the
next write-ahead record, the run's end — so consecutive Pure steps share one
commit (§8.4). Not in a drive that resumed a
stopped run, until one of its live attempts has ended: a worker that died in a
Pure call left nothing on record, so the call runs again written ahead, and a
call that kills every worker is closed as interrupted like any other
(`MAX_INTERRUPTED`, after at most one unrecorded death). A tool call with an effect is
wrapped in a write-ahead intent — Pending, Dispatched, Committed, each durable
before the next — and recovered after a crash by the last committed state and
the tool's effect class. A cancelled attempt is `Cancelled` unless an intent
was dispatched and never resolved: then it is `Indeterminate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from assay.bus.topics import RUN_STATUS, USAGE
from assay.engine.context import Cancelled, RunContext
from assay.engine.events import AttemptFinished, AttemptStarted, Intent
from assay.engine.model_context import pack
from assay.engine.models import Completion, Model, ModelError, OffersTools, model_for, prices_of
from assay.engine.staging import EffectStaged, args_hash, effect_key, stageable, staged_output
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
    offered,
)
from assay.kernel.attempts import AttemptState, attempt_transition
from assay.kernel.ids import AttemptNo, StepId
from assay.kernel.intents import IntentState, intent_transition
from assay.kernel.schema import Versioned
from assay.messages.episode import AttemptView
from assay.messages.models import AttemptIndeterminate, Usage, UsageRecorded
from assay.sandbox.port import SandboxProvider
from assay.workflow.ir import ModelStep, ToolStep
from assay.workflow.templates import TemplateError, render

_tracer = trace.get_tracer("assay.engine")


def _span(
    name: str,
    attributes: Callable[[], dict[str, str | int]] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> AbstractContextManager[object]:
    """A span around `name` with `attributes()`, when a tracer provider is installed.
    Without one a span is a no-op that only carries its parent's context on, so none is
    made: the current span, and every traceparent taken from it, stays the same."""
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return contextlib.nullcontext()
    return _tracer.start_as_current_span(
        name, kind=kind, attributes=attributes() if attributes is not None else None
    )


MAX_INTERRUPTED = 3
"""A step whose attempts kept dying with the worker stops being retried after this many."""

_Outcome = tuple[bool, AttemptState, str | None, str | None]
"""(known, state, output, error): `known` is False when the call gave no answer."""


class AttemptRunner:
    """Runs a model or tool step's attempts until one succeeds or they run out."""

    def __init__(
        self, model: Model, tools: Mapping[str, Tool], sandbox: SandboxProvider | None = None
    ) -> None:
        self.model = model
        self.tools = tools
        self.sandbox = sandbox
        self.resident: Callable[[RunContext], Awaitable[None]] | None = None
        """Opens a run's workspace with a verified resident sandbox (`suspension`)."""

    async def run_step(self, run: RunContext, step: ModelStep | ToolStep, iteration: int) -> bool:
        """Attempt `step` (its `iteration`-th execution); True when an attempt succeeded."""
        counted = interrupted = 0
        attempt = sum(1 for a in run.totals.attempts if a.step == step.id)
        while True:
            attempt += 1
            n = AttemptNo(attempt)
            started = run.replay.take(AttemptStarted, step.id, attempt=n)
            if started is not None:
                finished = await self._recover(run, step, started)
            elif run.cancel.cancelled:
                return False  # Pending -> Cancelled: the attempt never started
            else:
                with _span(
                    f"attempt {step.id}", functools.partial(_span_attributes, run, step.id, n)
                ):
                    started, finished = await self._attempt(run, step, n, iteration)
                run.resumed = False  # a live attempt ended: this worker got past the step
            if finished.workspace is not None:
                run.workspace_ref = finished.workspace
            run.totals.attempts.append(_view(started, finished, iteration))
            run.totals.add(finished.usage)
            if finished.state is AttemptState.SUCCEEDED and finished.output is not None:
                run.outputs[step.id] = finished.output
                return True
            if finished.state in (AttemptState.INDETERMINATE, AttemptState.CANCELLED):
                return False  # never retried automatically (§8.4), or stopped by decision
            if finished.interrupted:
                interrupted += 1  # the worker's fault, not the step's: a separate bound
            else:
                counted += 1
            if (
                counted >= step.retry.max_attempts
                or interrupted >= MAX_INTERRUPTED
                or run.totals.model_calls >= run.spec.max_model_calls
            ):
                return False
            if step.retry.backoff_s:
                try:
                    await run.cancel.race(asyncio.sleep(step.retry.backoff_s))
                except Cancelled:
                    return False

    # -- recovery -----------------------------------------------------------------

    async def _recover(
        self, run: RunContext, step: ModelStep | ToolStep, started: AttemptStarted
    ) -> AttemptFinished:
        """Attempt N's outcome: recorded, or recovered as §8.4's tables say."""
        n = started.attempt
        intents: list[Intent] = []
        while (ev := run.replay.take(Intent, step.id, attempt=n)) is not None:
            intents.append(ev)
        run.replay.take(EffectStaged, step.id, attempt=n)  # committed with the attempt's end
        finished = run.replay.take(AttemptFinished, step.id, attempt=n)
        if finished is not None:
            return finished
        t0 = time.monotonic()
        last = intents[-1] if intents else None
        if last is None or last.state is IntentState.PENDING:
            # Window A, or no effect at all: nothing was issued.
            if run.cancel.cancelled:
                return await self._finish(
                    run, step.id, n, AttemptState.CANCELLED, t0, error=_why(run)
                )
            return await self._finish(
                run,
                step.id,
                n,
                AttemptState.FAILED,
                t0,
                error="interrupted: the worker stopped before the attempt finished",
                interrupted=True,
            )
        if last.state is IntentState.COMMITTED:  # outcome recorded, attempt not closed
            state, output, error = _closing(last)
            return await self._finish(
                run, step.id, n, state, t0, output=output, error=error, workspace=run.workspace_ref
            )
        # Window B: the call may have landed.
        assert isinstance(step, ToolStep)
        assert started.args is not None
        tool = self.tools.get(step.tool)
        if tool is None or isinstance(tool.effects, Unsafe | Pure) or run.cancel.cancelled:
            why = (
                f"tool {step.tool!r} is no longer registered"
                if tool is None
                else f"the run was cancelled: {run.cancel.reason}"
                if run.cancel.cancelled
                else f"{last.effect} tool {step.tool!r} was dispatched and never resolved"
            )
            return await self._indeterminate(run, step.id, n, last, why, t0)
        call = await self._call(
            run, tool, step.id, n, started.args, last.request_id, last.idempotency_key
        )
        if isinstance(tool.effects, Queryable):
            try:
                landed = await asyncio.wait_for(tool.effects.lookup(call), step.timeout_s)
            except (TimeoutError, ToolError) as exc:
                why = f"lookup of request {last.request_id} failed: {exc or 'timed out'}"
                return await self._indeterminate(run, step.id, n, last, why, t0)
            if landed is not None:
                return await self._commit_outcome(
                    run, tool, step, n, last, t0, output=landed, resolved_by="lookup"
                )
            resolved_by = "lookup: not landed, dispatched again"
        else:
            resolved_by = "retried under the same idempotency key"
        return await self._dispatched(run, tool, step, n, call, last, t0, resolved_by)

    # -- live attempts ------------------------------------------------------------

    async def _attempt(
        self, run: RunContext, step: ModelStep | ToolStep, n: AttemptNo, iteration: int
    ) -> tuple[AttemptStarted, AttemptFinished]:
        context = run.template_context()
        prompt: str | None = None
        args: dict[str, str] | None = None
        error: str | None = None
        try:
            if isinstance(step, ModelStep):
                packing = pack(step, context, run.spec.plan)
                prompt = packing.prompt
                if not packing.fits:
                    error = (
                        f"the prompt is {len(prompt)} characters with every reference dropped, "
                        f"over the step's context_budget_chars ({step.context_budget_chars})"
                    )
            else:
                args = {k: render(v, context) for k, v in step.args.items()}
        except TemplateError as exc:
            error = str(exc)
        started = AttemptStarted(
            step=step.id, attempt=n, iteration=iteration, prompt=prompt, args=args
        )
        if self._pure(step) and not run.resumed:  # a re-run is the recovery: one commit
            run.unwritten[step.id] = started
        else:
            await run.record_and_commit(started)
        t0 = time.monotonic()
        if error is not None:
            return started, await self._finish(
                run, step.id, n, AttemptState.FAILED, t0, error=error
            )
        if isinstance(step, ModelStep):
            assert prompt is not None
            return started, await self._model_attempt(run, step, n, prompt, t0)
        assert args is not None
        return started, await self._tool_attempt(run, step, n, iteration, args, t0)

    async def _tool_attempt(
        self,
        run: RunContext,
        step: ToolStep,
        n: AttemptNo,
        iteration: int,
        args: dict[str, str],
        t0: float,
    ) -> AttemptFinished:
        tool = self.tools.get(step.tool)
        if tool is None or step.tool in run.spec.unavailable_tools:
            why = (
                f"tool {step.tool!r} is unavailable on this branch (a branch delta)"
                if tool is not None
                else f"no tool {step.tool!r} is registered"
            )
            return await self._finish(run, step.id, n, AttemptState.FAILED, t0, error=why)
        confined = tool.needs_sandbox and not tool.needs_network  # touches its workspace only
        if isinstance(tool.effects, Unsafe) and run.spec.speculative and not confined:
            if stageable(run.spec, tool):  # a sibling's: published only if it is selected
                return await self._stage(run, tool, step, n, iteration, args, t0)
            return await self._finish(
                run,
                step.id,
                n,
                AttemptState.FAILED,
                t0,
                error=(
                    f"tool {step.tool!r} has unsafe effects outside the sandbox, which a "
                    "shadow run never publishes and a rollout sibling stages only without a "
                    "workspace: they would repeat effects the task already had (DESIGN §12, §13)"
                ),
            )
        ref = run.spec.ref
        try:
            key = idempotency_key(tool, ref.tenant, ref.run_id, step.id, iteration, args)
        except ToolRefused as exc:
            return await self._finish(run, step.id, n, AttemptState.FAILED, t0, error=str(exc))
        request_id = _request_id(run, step.id, n)
        if not tool.has_effect:  # no intent to write
            call = await self._call(run, tool, step.id, n, args, request_id, key)
            try:
                _, state, output, error = await run.cancel.race(_invoke(tool, call, step.timeout_s))
            except Cancelled:
                state, output, error = AttemptState.CANCELLED, None, _why(run)
            return await self._finish(
                run, step.id, n, state, t0, output=output, error=error, tool=tool
            )
        intent = Intent(
            step=step.id,
            attempt=n,
            state=intent_transition(None, IntentState.PENDING),
            tool=tool.name,
            effect=effect_name(tool.effects),
            request_id=request_id,
            idempotency_key=key,
        )
        call = await self._call(run, tool, step.id, n, args, request_id, key)
        await run.record_and_commit(intent)
        if run.cancel.cancelled:  # between Pending and Dispatched: nothing was issued
            return await self._finish(run, step.id, n, AttemptState.CANCELLED, t0, error=_why(run))
        dispatched = intent.model_copy(
            update={"state": intent_transition(intent.state, IntentState.DISPATCHED)}
        )
        await run.record_and_commit(dispatched)
        return await self._dispatched(run, tool, step, n, call, dispatched, t0)

    async def _dispatched(
        self,
        run: RunContext,
        tool: Tool,
        step: ToolStep,
        n: AttemptNo,
        call: ToolCall,
        intent: Intent,
        t0: float,
        resolved_by: str | None = None,
    ) -> AttemptFinished:
        """Perform a dispatched call and resolve its intent by its effect class."""
        try:
            known, state, output, error = await run.cancel.race(_invoke(tool, call, step.timeout_s))
        except Cancelled:  # stopped mid-call: did it land? Only a lookup can say
            known, state, output, error = False, AttemptState.CANCELLED, None, _why(run)
        if known:  # the tool answered: the outcome is recorded
            return await self._commit_outcome(
                run, tool, step, n, intent, t0, output=output, error=error, resolved_by=resolved_by
            )
        if isinstance(tool.effects, Queryable):
            try:
                landed = await asyncio.wait_for(tool.effects.lookup(call), step.timeout_s)
            except (TimeoutError, ToolError):
                landed = None
            if landed is not None:
                return await self._commit_outcome(
                    run, tool, step, n, intent, t0, output=landed, resolved_by="lookup"
                )
        if isinstance(tool.effects, Unsafe) or state is AttemptState.CANCELLED:
            return await self._indeterminate(run, step.id, n, intent, error or "", t0)
        # Idempotent (a retry reuses the key) or a queryable call that did not land.
        return await self._finish(run, step.id, n, state, t0, error=error, tool=tool)

    async def _stage(
        self,
        run: RunContext,
        tool: Tool,
        step: ToolStep,
        n: AttemptNo,
        iteration: int,
        args: dict[str, str],
        t0: float,
    ) -> AttemptFinished:
        """Stage the call instead of making it: `EffectStaged` and the attempt's end, with the
        staged marker as its output, in one durable commit (`assay.engine.staging`)."""
        key = effect_key(run.spec, step.id, iteration, tool.name)
        staged = EffectStaged(
            step=step.id,
            attempt=n,
            iteration=iteration,
            tool=tool.name,
            effect_key=key,
            args_hash=args_hash(args),
        )
        output = staged_output(tool.name, key)
        return await self._finish(
            run, step.id, n, AttemptState.SUCCEEDED, t0, output=output, before=(staged,)
        )

    async def _commit_outcome(
        self,
        run: RunContext,
        tool: Tool,
        step: ToolStep,
        n: AttemptNo,
        intent: Intent,
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
        state, out, err = _closing(committed)
        return await self._finish(
            run, step.id, n, state, t0, output=out, error=err, tool=tool, before=(committed,)
        )

    async def _indeterminate(
        self,
        run: RunContext,
        step: StepId,
        n: AttemptNo,
        intent: Intent,
        why: str,
        t0: float,
    ) -> AttemptFinished:
        """A dispatched call nobody can resolve: a recorded unknown and an operator alert."""
        reason = f"outcome unknown: {why}" if why else "outcome unknown"
        alert = AttemptIndeterminate(
            run=run.spec.ref,
            step=step,
            attempt=n,
            tool=intent.tool,
            request_id=intent.request_id,
            reason=reason,
        )
        return await self._finish(
            run,
            step,
            n,
            AttemptState.INDETERMINATE,
            t0,
            error=reason,
            emits=[(RUN_STATUS, alert)],
            workspace=run.workspace_ref,
        )

    async def _model_attempt(
        self, run: RunContext, step: ModelStep, n: AttemptNo, prompt: str, t0: float
    ) -> AttemptFinished:
        if run.totals.model_calls >= run.spec.max_model_calls:
            return await self._finish(
                run,
                step.id,
                n,
                AttemptState.FAILED,
                t0,
                error="the run's model-call budget is spent",
            )
        try:
            model = model_for(self.model, step.model)
        except ModelError as exc:
            return await self._finish(run, step.id, n, AttemptState.FAILED, t0, error=str(exc))
        cap = run.spec.max_tokens
        used = run.totals.prompt_tokens + run.totals.completion_tokens
        # A bound, not an estimate: a byte-level tokenizer gives at most one prompt token
        # per UTF-8 byte, and the endpoint gives at most max_tokens of completion.
        if cap is not None and used + len(prompt.encode()) + step.max_tokens > cap:
            return await self._finish(
                run,
                step.id,
                n,
                AttemptState.FAILED,
                t0,
                error=(
                    f"the run's token budget ({cap}) cannot cover this call: {used} used, up to "
                    f"{len(prompt.encode())} prompt and {step.max_tokens} completion tokens"
                ),
            )
        refusal = self._over_cost_cap(run, step, prompt, model)
        if refusal is not None:
            return await self._finish(run, step.id, n, AttemptState.FAILED, t0, error=refusal)
        seed = f"{run.spec.ref.run_id}:{step.id}:{n}"
        names = [t for t in step.tools or () if t not in run.spec.unavailable_tools]
        missing = [t for t in names if t not in self.tools]
        if missing:
            why = f"tool(s) {missing} offered to the model are not registered"
            return await self._finish(run, step.id, n, AttemptState.FAILED, t0, error=why)
        call: Awaitable[Completion]
        if names and isinstance(model, OffersTools):
            tools = [offered(self.tools[t]) for t in names]
            call = model.complete_with_tools(
                prompt, max_tokens=step.max_tokens, seed=seed, tools=tools
            )
        else:  # a model port that cannot carry tools gets the prompt alone
            call = model.complete(prompt, max_tokens=step.max_tokens, seed=seed)
        try:
            with _span(
                f"model {step.id}",
                lambda: {**_span_attributes(run, step.id, n), "gen_ai.operation.name": "chat"},
                SpanKind.CLIENT,
            ):
                done = await run.cancel.race(asyncio.wait_for(call, step.timeout_s))
        except Cancelled:
            return await self._finish(run, step.id, n, AttemptState.CANCELLED, t0, error=_why(run))
        except TimeoutError:
            return await self._finish(
                run,
                step.id,
                n,
                AttemptState.TIMED_OUT,
                t0,
                error=f"timed out after {step.timeout_s}s",
            )
        except ModelError as exc:
            return await self._finish(run, step.id, n, AttemptState.FAILED, t0, error=str(exc))
        usage = Usage(
            model_calls=1,
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
        )
        recorded = UsageRecorded(
            tenant=run.spec.ref.tenant,
            run_id=run.spec.ref.run_id,
            purpose=run.spec.ref.purpose,
            model=done.model,
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
            cost_usd=done.cost_usd,
        )
        return await self._finish(
            run,
            step.id,
            n,
            AttemptState.SUCCEEDED,
            t0,
            output=done.text,
            usage=usage,
            emits=[(USAGE, recorded)],
        )

    def _over_cost_cap(
        self, run: RunContext, step: ModelStep, prompt: str, model: Model
    ) -> str | None:
        """Why the run's cost cap refuses this call, or None when its worst case fits.

        The run's cost so far is its tokens at the model's prices (what each call's
        `UsageRecorded` recorded: a price is linear in tokens). The call's worst case is
        the same bound as the token cap's — at most one prompt token per UTF-8 byte and
        `max_tokens` of completion — at those prices.
        """
        cap = run.spec.max_cost_usd
        if cap is None:
            return None
        prices = prices_of(model)
        spent = prices.cost(run.totals.prompt_tokens, run.totals.completion_tokens)
        worst = prices.cost(len(prompt.encode()), step.max_tokens)
        if spent + worst <= cap:
            return None
        return (
            f"the run's cost budget (${cap:.6f}) cannot cover this call: ${spent:.6f} spent, "
            f"up to ${worst:.6f} for {len(prompt.encode())} prompt and {step.max_tokens} "
            "completion tokens"
        )

    async def _finish(
        self,
        run: RunContext,
        step: StepId,
        n: AttemptNo,
        state: AttemptState,
        t0: float,
        *,
        output: str | None = None,
        error: str | None = None,
        usage: Usage | None = None,
        emits: Sequence[tuple[str, Versioned]] = (),
        interrupted: bool = False,
        tool: Tool | None = None,
        workspace: str | None = None,
        before: Sequence[Intent | EffectStaged] = (),
    ) -> AttemptFinished:
        """Close attempt N (after its unwritten start and `before`, in the same commit)."""
        attempt_transition(
            AttemptState.RUNNING, state, intent_dispatched=state is AttemptState.INDETERMINATE
        )
        if tool is not None and tool.needs_sandbox and run.workspace is not None:
            assert self.sandbox is not None
            workspace = await self.sandbox.snapshot(run.workspace)  # what the next step sees
        finished = AttemptFinished(
            step=step,
            attempt=n,
            state=state,
            output=output if state is AttemptState.SUCCEEDED else None,
            error=error,
            usage=usage or Usage(),
            duration_ms=int((time.monotonic() - t0) * 1000),
            interrupted=interrupted,
            workspace=workspace,
        )
        start = run.unwritten.pop(step, None)
        if start is None:
            await run.record_and_commit(*before, finished, emits=emits)
        else:  # a Pure attempt, start and end: recovery runs it again, so it may wait
            await run.record_later(start, *before, finished, emits=emits)
        return finished

    def _pure(self, step: ModelStep | ToolStep) -> bool:
        """Whether `step` calls a registered `Pure` tool (a model call is not one: it is
        metered and bounded by the run's budget, so its start is written ahead)."""
        if not isinstance(step, ToolStep):
            return False
        tool = self.tools.get(step.tool)
        return tool is not None and not tool.has_effect

    def needs_sandbox(self, step: object) -> bool:
        """Whether `step` calls a tool that runs in the sandbox."""
        if not isinstance(step, ToolStep):
            return False
        tool = self.tools.get(step.tool)
        return tool is not None and tool.needs_sandbox

    async def ensure_workspace(self, run: RunContext) -> None:
        """Open the run's workspace (restored from its last snapshot) if none is open."""
        if self.sandbox is None or run.workspace is not None:
            return
        if self.resident is not None:
            await self.resident(run)
            return
        ref = run.spec.ref
        if run.workspace_ref is not None:  # resume from the last recorded snapshot
            run.workspace = await self.sandbox.restore(
                ref.tenant, ref.run_id, run.spec.branch, run.workspace_ref
            )
        else:
            run.workspace = await self.sandbox.open(ref.tenant, ref.run_id, run.spec.branch)

    async def _call(
        self,
        run: RunContext,
        tool: Tool,
        step: StepId,
        n: AttemptNo,
        args: Mapping[str, str],
        request_id: str,
        key: str | None,
    ) -> ToolCall:
        workspace = None
        if tool.needs_sandbox:
            await self.ensure_workspace(run)
            workspace = run.workspace
        return ToolCall(
            tenant=run.spec.ref.tenant,
            run_id=run.spec.ref.run_id,
            branch=run.spec.branch,
            step=step,
            attempt=n,
            args=args,
            request_id=request_id,
            idempotency_key=key,
            workspace=workspace,
        )


def _why(run: RunContext) -> str:
    return f"cancelled: {run.cancel.reason}" if run.cancel.reason else "cancelled"


def _request_id(run: RunContext, step: StepId, n: AttemptNo) -> str:
    ref = run.spec.ref
    return f"{ref.tenant}/{ref.run_id}/{run.spec.branch}/{step}/{n}"


async def _invoke(tool: Tool, call: ToolCall, timeout_s: float) -> _Outcome:
    """Call the tool; `known` is False when it gave no answer (a timeout, or it broke):
    whether it acted is then unknown."""
    with _span(f"tool {tool.name}", kind=SpanKind.CLIENT):
        return await _call_tool(tool, call, timeout_s)


async def _call_tool(tool: Tool, call: ToolCall, timeout_s: float) -> _Outcome:
    try:
        async with asyncio.timeout(timeout_s):  # no task of its own, unlike wait_for
            output = await tool.fn(call)
    except TimeoutError:
        return False, AttemptState.TIMED_OUT, None, f"timed out after {timeout_s}s"
    except ToolError as exc:  # the tool answered: it failed (ToolRefused: before any effect)
        return True, AttemptState.FAILED, None, str(exc)
    except Exception as exc:  # the tool itself broke: whether it acted is unknown
        return False, AttemptState.FAILED, None, f"the tool raised {type(exc).__name__}: {exc}"
    return True, AttemptState.SUCCEEDED, output, None


def _closing(committed: Intent) -> tuple[AttemptState, str | None, str | None]:
    """(state, output, error) of the attempt a committed intent implies."""
    if committed.error is None:
        return AttemptState.SUCCEEDED, committed.output, None
    return AttemptState.FAILED, None, committed.error


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


def _span_attributes(run: RunContext, step: str, n: AttemptNo) -> dict[str, str | int]:
    ref = run.spec.ref
    return {
        "assay.tenant": str(ref.tenant),
        "assay.workflow": str(ref.workflow_id),
        "assay.run": str(ref.run_id),
        "assay.branch": int(run.spec.branch),
        "assay.step": step,
        "assay.attempt": int(n),
    }
