"""Driving one branch of a run under its lease, and recording how it stopped.

What every execute handler shares rides on its unit of work as `Executing`
(`ExecuteUnitOfWork`): the driver, the runs this process drives now (so a cancel
reaches them at once), the lease settings, what a pinned workflow may use, and
retention's per-process memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from assay.bus.topics import EPISODES, RESULTS, RUN_STATUS, TASKS
from assay.engine import (
    CancelScope,
    Driver,
    Prices,
    RunFinished,
    RunSpec,
    RunSuspended,
    StepNotExecutable,
    check_executable,
)
from assay.engine.branching import forked_deltas, with_deltas
from assay.engine.events import Forked, RunCancelled, RunStarted
from assay.engine.run_state import CancelAsked
from assay.kernel import AttemptState, BranchId, Refused, RunId, RunState, TenantId, run_transition
from assay.messages import (
    Episode,
    RolloutProgress,
    RunBranch,
    RunExecuted,
    RunRef,
    RunResult,
    RunStatusChanged,
)
from assay.record import BranchKey, LogRecord
from assay.runtime import UnitOfWork
from assay.runtime.leases import under_lease
from assay.store import Lease
from assay.store.inline_blobs import DEFAULT_INLINE_MAX_BYTES, inline_copy
from assay.workflow import LATEST, WorkflowDef, WorkflowInvalid, from_document, validate
from assay_execute.retention import Retention


@dataclass
class Executing:
    """What execute's handlers share: one per stage, built by `create_stage`."""

    driver: Driver
    worker: str
    """This process's identity as a lease holder."""
    ttl_s: float
    """How long a run's lease lasts without a heartbeat."""
    known_tools: frozenset[str]
    known_verifiers: frozenset[str]
    retention: Retention
    prices: Prices
    """The agent model's prices: a run's cost is its tokens at them."""
    episode_inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES
    """An episode of at most this many bytes also travels inline in `RunExecuted`."""
    active: dict[tuple[TenantId, RunId], CancelScope] = field(default_factory=dict)
    """Runs this process is driving now, so that a cancel reaches them at once."""


ExecuteUnitOfWork = UnitOfWork[Executing]


def pinned(
    deps: Executing,
    ref: RunRef,
    definition: dict[str, Any],
    input_: dict[str, Any],
    children: dict[str, dict[str, Any]],
    branch: BranchId,
) -> RunSpec:
    """The run as spawned: its definition and sub-workflows checked against the pins.

    Raises:
        Refused: the definition or a sub-workflow is invalid here, or hashes to another
            version than the one pinned.
    """
    try:
        wf = _checked(deps, definition)
        calls = {key: _checked(deps, doc) for key, doc in children.items()}
        check_executable(wf, calls)
    except (WorkflowInvalid, StepNotExecutable) as exc:
        raise Refused(f"run {ref.run_id}: invalid pinned workflow: {exc}") from exc
    if wf.version != ref.workflow_version:
        raise Refused(
            f"run {ref.run_id}: definition hashes to {wf.version}, "
            f"not the pinned {ref.workflow_version}"
        )
    for key, child in calls.items():
        selector = key.rpartition("@")[2]
        if selector not in (LATEST, child.version):
            raise Refused(f"run {ref.run_id}: sub-workflow {key} hashes to {child.version}")
    return RunSpec(ref, wf, input_, branch, children=calls)


def _checked(deps: Executing, document: dict[str, Any]) -> WorkflowDef:
    return validate(from_document(document), deps.known_tools, deps.known_verifiers)


def pin(deps: Executing, started: RunStarted, branch: BranchId) -> RunSpec:
    """The run a branch's first record pinned, checked (no deltas applied).

    Raises:
        Refused: the run was recorded before runs kept their definition.
    """
    if started.definition is None or started.input is None:
        raise Refused(f"run {started.run.run_id} was recorded before runs kept their definition")
    return pinned(
        deps, started.run, started.definition, started.input, started.subworkflows, branch
    )


async def recorded(uow: ExecuteUnitOfWork, key: BranchKey) -> RunSpec:
    """A branch's effective run: pinned by its first record (`RunStarted` v2), with the
    deltas of every `Forked` record on it applied in order (a branch command's child,
    or a fork of one)."""
    records = await uow.history(key)
    started = records[0].event
    assert isinstance(started, RunStarted)
    return with_deltas(pin(uow.deps, started, key.branch), forked_deltas(records))


async def drive(
    spec: RunSpec, uow: ExecuteUnitOfWork, lease: Lease, *, fresh: bool = False
) -> tuple[Episode, CancelScope]:
    """Drive the run's branch under its lease, stoppable by a cancel from anywhere;
    `fresh`: the branch was read empty under this lease (see `Driver.drive`)."""
    deps, run = uow.deps, spec.ref.run_id
    scope = CancelScope()
    deps.active[(uow.tenant, run)] = scope

    async def watch() -> None:  # a cancel handled by another worker reaches this one
        requested = await uow.get(CancelAsked, run)
        if requested is not None:
            scope.cancel(requested.reason)

    try:
        await watch()
        driving = deps.driver.drive(spec, uow, scope, fresh=fresh)
        episode = await under_lease(uow.log, lease, deps.ttl_s, driving, watch=watch)
    finally:
        deps.active.pop((uow.tenant, run), None)
    return episode, scope


def graded(spec: RunSpec) -> bool:
    """Whether the branch goes on to verification and grading: every branch does — the
    run as spawned, a rewind's branch, a branch command's child — except a fork of a
    rollout group's sibling, whose group's selection is the task's one result (§13)."""
    return spec.branch == 0 or spec.ref.rollout is None


async def reported(uow: ExecuteUnitOfWork, spec: RunSpec) -> RunRef:
    """The run as its messages name it: for a fork, with its branch and parent."""
    if spec.branch == 0:
        return spec.ref
    return branch_ref(spec.ref, spec.branch, await uow.history(spec.key))


def branch_ref(ref: RunRef, branch: int, records: Sequence[LogRecord]) -> RunRef:
    """`ref` naming `branch`, whose records are `records`: for a fork, its branch and parent
    from the branch's own `Forked` (its last).

    Raises:
        Refused: a branch past 0 that records no fork.
    """
    if branch == 0:
        return ref
    forked = next((r.event for r in reversed(records) if isinstance(r.event, Forked)), None)
    if forked is None:
        raise Refused(f"run {ref.run_id}: branch {branch} records no fork")
    fork = RunBranch(branch=branch, parent=forked.from_branch, child=forked.child)
    return ref.model_copy(update={"branch": fork})


async def conclude(
    spec: RunSpec, uow: ExecuteUnitOfWork, lease: Lease, *, fresh: bool = False
) -> None:
    """Drive the branch, then record how it stopped: suspended at an await (the lease is
    given up), cancelled, or ended — handed to verification (`graded`), marked with its
    branch and parent when it is a fork (`reported`)."""
    ref = await reported(uow, spec)
    try:
        episode, scope = await drive(spec, uow, lease, fresh=fresh)
    except RunSuspended as waiting:
        uow = uow.released()  # what remains to commit is the message's own bookkeeping
        await uow.log.release(lease)  # a suspended run holds no lease (§9.4)
        at = waiting.suspended
        if graded(spec):
            detail = f"waiting at {at.step!r} for {at.signal!r}"
            status = RunStatusChanged(run=ref, state=RunState.SUSPENDED, detail=detail)
            uow.emit(RUN_STATUS, status)
        return
    cost = uow.deps.prices.cost(episode.usage.prompt_tokens, episode.usage.completion_tokens)
    if scope.cancelled and graded(spec):
        _cancelled(uow, spec, ref, episode, scope.reason, cost)
    elif scope.cancelled:
        uow.record(spec.key, _stopped(episode, scope.reason))
    else:
        frozen = episode.encode()
        blob = await _finished(uow, spec, episode, frozen)
        if graded(spec):
            inline = inline_copy(frozen, uow.deps.episode_inline_max_bytes)
            _to_verification(uow, ref, episode, blob, inline, cost)


def _to_verification(
    uow: ExecuteUnitOfWork,
    ref: RunRef,
    episode: Episode,
    blob: str,
    inline: dict[str, Any] | None,
    cost_usd: float,
) -> None:
    """Hand the run to verify: the episode's blob, and the episode itself when it is small
    (a claim check: verify and the tournament then need not read the blob)."""
    executed = RunExecuted(
        run=ref,
        episode=blob,
        episode_inline=inline,
        succeeded=episode.succeeded,
        failed_step=episode.failed_step,
        usage=episode.usage,
        cost_usd=cost_usd,
    )
    uow.emit(EPISODES, executed)
    uow.emit(RUN_STATUS, RunStatusChanged(run=ref, state=RunState.VERIFYING))


async def _finished(uow: ExecuteUnitOfWork, spec: RunSpec, episode: Episode, frozen: bytes) -> str:
    """Freeze the episode, `frozen` its encoding (the snapshot barrier of §10.2), and
    record the branch's end."""
    ref = await uow.blobs.put(uow.tenant, frozen)
    uow.deps.retention.froze(uow.tenant, ref, episode)
    uow.record(
        spec.key,
        RunFinished(
            succeeded=episode.succeeded,
            failed_step=episode.failed_step,
            episode=ref,
            usage=episode.usage,
        ),
    )
    return ref


def _unknown(episode: Episode) -> bool:
    return any(a.state is AttemptState.INDETERMINATE for a in episode.attempts)


def _stopped(episode: Episode, reason: str) -> RunCancelled:
    return RunCancelled(reason=reason, indeterminate=_unknown(episode), usage=episode.usage)


def _cancelled(
    uow: ExecuteUnitOfWork,
    spec: RunSpec,
    run: RunRef,
    episode: Episode,
    reason: str,
    cost_usd: float,
) -> None:
    """Record a stopped branch and give it its result (§5.1, §5.2); `cost_usd` is what its
    model calls cost."""
    unknown = _unknown(episode)
    run_transition(RunState.RUNNING, RunState.CANCELLED)
    uow.record(spec.key, _stopped(episode, reason))
    detail = f"{reason}; an intent was dispatched and is unresolved" if unknown else reason
    uow.emit(RUN_STATUS, RunStatusChanged(run=run, state=RunState.CANCELLED, detail=detail))
    if run.rollout is not None:  # a sibling's end is its group's to report (§13)
        uow.emit(
            TASKS,
            RolloutProgress(
                tenant=run.tenant,
                idempotency_key=run.rollout.group,
                run_id=run.run_id,
                index=run.rollout.index,
                ended="cancelled",
                model_calls=episode.usage.model_calls,
                tokens=episode.usage.prompt_tokens + episode.usage.completion_tokens,
                cost_usd=cost_usd,
            ),
        )
        return
    uow.emit(
        RESULTS,
        RunResult(
            tenant=run.tenant,
            run_id=run.run_id,
            task_id=run.task_id,
            idempotency_key=run.idempotency_key,
            workflow_id=run.workflow_id,
            workflow_version=run.workflow_version,
            status="cancelled",
            passed=False,
            verification=[],
            score=None,
            usage=episode.usage,
            termination="cancelled",
            held_out=run.held_out,
            branch=run.branch_id,
            parent_branch=None if run.branch is None else run.branch.parent,
        ),
    )
