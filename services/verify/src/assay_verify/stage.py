"""Verify: `assay.episodes` -> `assay.verified` (keyed by task: shuffle 1).

Verifiers read only the frozen episode. Fail-closed throughout: a missing or
unreadable episode, a verifier error or a timeout is a `Fail`, never a `Pass`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, ValidationError

from assay.bus.topics import RUN_STATUS, VERIFIED
from assay.kernel import RunId, RunState
from assay.messages import (
    CancelGrading,
    Episode,
    GradingCancelled,
    RunExecuted,
    RunStatusChanged,
    RunVerified,
    VerifierResult,
)
from assay.record import BranchKey, Event, EventRegistry, LogRecord, ReadModel, StateDelta
from assay.record.compaction import Compacted, with_compaction
from assay.record.erasure import TenantErased
from assay.runtime import StageDeps, StageSpec, UnitOfWork, routes
from assay.store.inline_blobs import claimed_blob
from assay.verification import Verifier, verifier_registry, verify_episode
from assay.workflow import WorkflowDef


class RunVerdictRecorded(Event):
    """The verifiers' outcome for one branch of a run.

    Version 2 adds `branch`: a rewind's branch and a branch command's child are verified
    like any run; a version 1 verdict is branch 0's.
    """

    type: ClassVar[str] = "RunVerdictRecorded"
    version: ClassVar[int] = 2
    run_id: RunId = Field(description="Run.")
    passed: bool = Field(description="Outcome class.")
    results: list[VerifierResult] = Field(description="Each verifier's result.")
    branch: int = Field(0, ge=0, description="v2: the branch verified (0: the run as spawned).")


class VerificationStopped(Event):
    """A branch's grading was cancelled (`CancelGrading`): it is not verified from here on."""

    type: ClassVar[str] = "VerificationStopped"
    version: ClassVar[int] = 1
    run_id: RunId = Field(description="Run.")
    branch: int = Field(ge=0, description="The branch stopped (0: the run as spawned).")
    reason: str = Field(description="Why, for people.")


VERIFY_EVENTS = EventRegistry([TenantErased, RunVerdictRecorded, VerificationStopped, Compacted])


@VERIFY_EVENTS.upcaster("RunVerdictRecorded", 1)
def _verdict_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 verified branch 0 only."""
    return {**payload, "branch": 0}


class Verdict(ReadModel):
    """A branch's verdict: its outcome class and each verifier's result. Keyed by run id
    (branch 0) or `<run>@<branch>` (a fork)."""

    kind: ClassVar[str] = "verdict"
    passed: bool
    results: list[VerifierResult]


class Stopped(ReadModel):
    """A branch whose grading was cancelled. Keyed like its verdict."""

    kind: ClassVar[str] = "stopped"
    reason: str


def fold_verify(record: LogRecord) -> list[StateDelta]:
    """One verdict document per branch; a stop document per cancelled branch."""
    match record.event:
        case RunVerdictRecorded() as e:
            key = e.run_id if e.branch == 0 else f"{e.run_id}@{e.branch}"
            return [Verdict(passed=e.passed, results=e.results).put(record.key.tenant, key)]
        case VerificationStopped() as e:
            key = e.run_id if e.branch == 0 else f"{e.run_id}@{e.branch}"
            return [Stopped(reason=e.reason).put(record.key.tenant, key)]
    return []


@dataclass(frozen=True)
class Verifying:
    """What verify's handler uses: every verifier kind installed here, by kind."""

    registry: dict[str, Verifier]


VerifyUnitOfWork = UnitOfWork[Verifying]


def _closed(reason: str) -> list[VerifierResult]:
    return [
        VerifierResult(
            verifier="episode", kind="snapshot", verifier_version="1", passed=False, evidence=reason
        )
    ]


async def on_run_executed(msg: RunExecuted, uow: VerifyUnitOfWork) -> None:
    """Verify the frozen episode (fail closed), record the verdict, hand it to grading;
    unless the branch's grading was cancelled first: then no verifier runs at all.

    Raises:
        InlineCopyMismatch: the message's inline episode is not the blob it names (the
            message is refused to the dead-letter topic, with that reason).
    """
    if await uow.get(Stopped, msg.run.graded_as) is not None:
        return  # its `GradingCancelled` went to tournament with the stop
    results = await _verify(msg, uow)
    passed = msg.succeeded and all(r.passed for r in results)
    uow.record(
        BranchKey.main(uow.tenant, f"run:{msg.run.run_id}"),
        RunVerdictRecorded(
            run_id=msg.run.run_id, passed=passed, results=results, branch=msg.run.branch_id
        ),
    )
    uow.emit(
        VERIFIED,
        RunVerified(
            run=msg.run,
            episode=msg.episode,
            episode_inline=msg.episode_inline,
            passed=passed,
            results=results,
            usage=msg.usage,
            cost_usd=msg.cost_usd,
            executed=msg.succeeded,
        ),
    )
    state = RunState.VERIFIED_PASS if passed else RunState.VERIFIED_FAIL
    uow.emit(RUN_STATUS, RunStatusChanged(run=msg.run, state=state))


async def on_cancel_grading(msg: CancelGrading, uow: VerifyUnitOfWork) -> None:
    """Cancel means stop (§5.2): a branch cancelled after it executed is not verified from
    here on (read apart from the episodes, so a queued one is never verified), and
    tournament is told, keyed like its verdict, to end its grading as cancelled."""
    r = msg.run
    verdict = await uow.get(Verdict, r.graded_as)
    if await uow.get(Stopped, r.graded_as) is None:
        stopped = VerificationStopped(run_id=r.run_id, branch=r.branch_id, reason=msg.reason)
        uow.record(BranchKey.main(uow.tenant, f"stop:{r.run_id}"), stopped)
    cancelled = GradingCancelled(
        run=r,
        reason=msg.reason,
        succeeded=msg.succeeded,
        usage=msg.usage,
        verified=verdict is not None,
    )
    uow.emit(VERIFIED, cancelled)


async def _verify(msg: RunExecuted, uow: VerifyUnitOfWork) -> list[VerifierResult]:
    """Each verifier's result on the episode (its inline copy when it came with one, else
    its blob); a missing, foreign or undecodable one fails.

    Raises:
        InlineCopyMismatch: the inline copy is not the blob `msg.episode` names.
    """
    raw = await claimed_blob(uow.blobs, uow.tenant, msg.episode, msg.episode_inline)
    if raw is None:
        return _closed(f"episode blob {msg.episode} is missing")
    try:
        episode = Episode.model_validate_json(raw)
        wf = WorkflowDef.model_validate(episode.definition)
    except ValidationError as exc:
        return _closed(f"episode does not decode: {exc.error_count()} error(s)")
    if episode.run.tenant != uow.tenant:
        return _closed(f"episode {msg.episode} names another tenant")
    return await verify_episode(episode, list(wf.verifiers), registry=uow.deps.registry)


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the verify stage: built-in verifiers, `command` in `deps.sandbox`, installed kinds."""
    return StageSpec(
        name="verify",
        events=VERIFY_EVENTS,
        fold=with_compaction(fold_verify),
        handlers=routes(on_run_executed, on_cancel_grading),
        deps=Verifying(registry=verifier_registry(deps.sandbox, deps.verifiers)),
        sandbox=deps.sandbox,
    )
