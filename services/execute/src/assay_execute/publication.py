"""After a rollout group's selection: publish the winner's staged effects, discard the rest.

A rollout sibling stages its unsafe external writes instead of making them
(`assay.engine.staging`). Execute publishes them, since it owns intents and
tools; the group's `RolloutResult` says when. Execute consumes that result
already, and the tournament stage commits it in the same transaction as the
selection, so once a selection is durable its result will reach execute — a
crash anywhere between the two redelivers it, and this runs again from what
it committed. The siblings settle before retention may reduce or tier any of
them (`on_rollout_result`).

Only a group that selects for real publishes (`best_of_n`, `evaluation`), only
when it was not cancelled, and only the winner's effects, when the winner
passed verification; every other staged effect is discarded. Publication
follows the intent protocol (§8.4) on the sibling's commands stream, under the
sibling's lease: `EffectPublishing` `Pending`, then `Dispatched`, then the call,
then `EffectPublished` with how it ended. The tool gets the effect's
idempotency key (derived from the run, step and iteration) and a request id of
its own. A crash after `Dispatched` and before the outcome's commit leaves the
outcome unknown: the effect is `Indeterminate`, raises the operator alert, and
is never dispatched again (the tool is `Unsafe`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from assay.bus.topics import RUN_STATUS
from assay.engine.events import AttemptStarted, RunStarted, commands_stream
from assay.engine.staging import (
    EffectDiscarded,
    EffectPublished,
    EffectPublishing,
    EffectStaged,
    Publication,
    args_hash,
)
from assay.engine.tools import Tool, ToolCall, ToolError
from assay.kernel import BranchId, IntentState, RunId, intent_transition
from assay.messages import AttemptIndeterminate, RolloutResult, RunRef, SiblingResult
from assay.record import BranchKey, LogRecord
from assay.runtime.leases import acquire, under_lease
from assay.workflow import WorkflowDef
from assay_execute.driving import ExecuteUnitOfWork

PUBLISHING_MODES = frozenset({"best_of_n", "evaluation"})
"""Modes whose winner's staged effects are published; every other mode discards them all
(`trajectory_collection` selects nobody, `shadow` is for comparison only)."""

_Progress = EffectPublishing | EffectPublished | EffectDiscarded


def discard_reason(result: RolloutResult, sibling: SiblingResult) -> str | None:
    """Why `sibling`'s staged effects are discarded; None: they are published."""
    if result.mode not in PUBLISHING_MODES:
        return f"a {result.mode} group publishes no staged effect"
    if result.closed == "cancelled":
        return f"the group was cancelled: {result.detail or 'no reason given'}"
    if result.winner is None:
        return "the group selected no sibling"
    if sibling.run_id != result.winner:
        won = next((s.index for s in result.siblings if s.run_id == result.winner), None)
        return f"sibling #{sibling.index} was not selected (#{won} was)"
    if not sibling.passed:
        return "the selected sibling failed verification"
    return None


async def settle_staged_effects(msg: RolloutResult, uow: ExecuteUnitOfWork) -> None:
    """Publish the winner's staged effects and discard every other sibling's, once each."""
    for sibling in msg.siblings:
        await _settle_sibling(uow, sibling.run_id, discard_reason(msg, sibling))


async def _settle_sibling(uow: ExecuteUnitOfWork, run: RunId, reason: str | None) -> None:
    """Settle one sibling's staged effects under its lease (one writer at a time)."""
    records = await uow.history(BranchKey.for_run(uow.tenant, run, BranchId(0)))
    staged = [r.event for r in records if isinstance(r.event, EffectStaged)]
    if not staged:
        return
    lease = await acquire(uow.log, uow.tenant, run, uow.deps.worker, uow.deps.ttl_s)
    fenced = uow.fenced(lease)
    commands = BranchKey.main(uow.tenant, commands_stream(run))
    progress = _progress(await fenced.history(commands))
    for effect in staged:
        last = progress.get(effect.effect_key)
        if isinstance(last, EffectPublished | EffectDiscarded):
            continue  # settled before a crash: the record stands
        settle = _settle(fenced, commands, records, effect, last, reason)
        await under_lease(uow.log, lease, uow.deps.ttl_s, settle)


def _progress(records: Sequence[LogRecord]) -> dict[str, _Progress]:
    """Each staged effect's last publication record on the commands stream."""
    last: dict[str, _Progress] = {}
    for r in records:
        if isinstance(r.event, EffectPublishing | EffectPublished | EffectDiscarded):
            last[r.event.effect_key] = r.event
    return last


async def _settle(
    uow: ExecuteUnitOfWork,
    commands: BranchKey,
    records: Sequence[LogRecord],
    effect: EffectStaged,
    last: EffectPublishing | None,
    reason: str | None,
) -> None:
    """Discard or publish one staged effect, resuming from its last committed intent."""
    if isinstance(last, EffectPublishing) and last.state is IntentState.DISPATCHED:
        why = "its publication was dispatched and never resolved"
        await _published(uow, commands, records, effect, Publication.INDETERMINATE, error=why)
        return
    tool = uow.deps.driver.tools.get(effect.tool)
    args = _arguments(records, effect)
    if reason is None and tool is None:
        reason = f"tool {effect.tool!r} is no longer registered"
    if reason is None and args is None:
        reason = "its arguments are no longer on record as staged"
    if reason is not None or tool is None or args is None:
        uow.record(commands, _discarded(effect, reason or "not published"))
        await uow.commit()
        return
    pending = last or EffectPublishing(
        branch=0,
        effect_key=effect.effect_key,
        state=intent_transition(None, IntentState.PENDING),
        tool=tool.name,
        request_id=_request_id(records, effect),
    )
    if last is None:
        await uow.record_and_commit(commands, pending)
    dispatched = pending.model_copy(
        update={"state": intent_transition(pending.state, IntentState.DISPATCHED)}
    )
    await uow.record_and_commit(commands, dispatched)
    call = _call(uow, records, effect, args, pending.request_id)
    state, output, error = await _invoke(tool, call, _timeout_s(records, effect))
    await _published(uow, commands, records, effect, state, output=output, error=error)


def _discarded(effect: EffectStaged, reason: str) -> EffectDiscarded:
    return EffectDiscarded(branch=0, effect_key=effect.effect_key, tool=effect.tool, reason=reason)


async def _published(
    uow: ExecuteUnitOfWork,
    commands: BranchKey,
    records: Sequence[LogRecord],
    effect: EffectStaged,
    state: Publication,
    *,
    output: str | None = None,
    error: str | None = None,
) -> None:
    """Commit how a dispatched publication ended; an unknown outcome alerts operators."""
    published = EffectPublished(
        branch=0,
        effect_key=effect.effect_key,
        tool=effect.tool,
        state=state,
        output=output,
        error=error,
    )
    uow.record(commands, published)
    if state is Publication.INDETERMINATE:
        alert = AttemptIndeterminate(
            run=_run(records),
            step=effect.step,
            attempt=effect.attempt,
            tool=effect.tool,
            request_id=_request_id(records, effect),
            reason=f"staged effect {effect.effect_key}: outcome unknown: {error}",
        )
        uow.emit(RUN_STATUS, alert)
    await uow.commit()


def _request_id(records: Sequence[LogRecord], effect: EffectStaged) -> str:
    """Names the publication's call, as the tool sees it."""
    run = _run(records)
    return f"{run.tenant}/{run.run_id}/publish/{effect.effect_key}"


def _run(records: Sequence[LogRecord]) -> RunRef:
    started = records[0].event
    assert isinstance(started, RunStarted)
    return started.run


def _arguments(records: Sequence[LogRecord], effect: EffectStaged) -> dict[str, str] | None:
    """The staged call's arguments (its attempt's `AttemptStarted`), if their hash holds."""
    for r in records:
        ev = r.event
        if not isinstance(ev, AttemptStarted) or (ev.step, ev.attempt) != (
            effect.step,
            effect.attempt,
        ):
            continue
        if ev.args is not None and args_hash(ev.args) == effect.args_hash:
            return ev.args
    return None


def _timeout_s(records: Sequence[LogRecord], effect: EffectStaged) -> float:
    """The staging step's per-attempt limit, from the definition the run pinned."""
    started = records[0].event
    assert isinstance(started, RunStarted)
    assert started.definition is not None  # a sibling's run keeps its definition (v2)
    return WorkflowDef.model_validate(started.definition).step(effect.step).timeout_s


def _call(
    uow: ExecuteUnitOfWork,
    records: Sequence[LogRecord],
    effect: EffectStaged,
    args: dict[str, str],
    request_id: str,
) -> ToolCall:
    run = _run(records)
    return ToolCall(
        tenant=uow.tenant,
        run_id=run.run_id,
        branch=BranchId(0),
        step=effect.step,
        attempt=effect.attempt,
        args=args,
        request_id=request_id,
        idempotency_key=effect.effect_key,
    )


async def _invoke(
    tool: Tool, call: ToolCall, timeout_s: float
) -> tuple[Publication, str | None, str | None]:
    """Make the call: published, failed (the tool answered no), or indeterminate (no answer:
    a timeout, or the tool broke — whether it acted is unknown)."""
    try:
        async with asyncio.timeout(timeout_s):
            output = await tool.fn(call)
    except TimeoutError:
        return Publication.INDETERMINATE, None, f"timed out after {timeout_s}s"
    except ToolError as exc:
        return Publication.FAILED, None, str(exc)
    except Exception as exc:  # the tool itself broke
        return Publication.INDETERMINATE, None, f"the tool raised {type(exc).__name__}: {exc}"
    return Publication.PUBLISHED, output, None
