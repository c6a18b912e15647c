"""Verify: `assay.episodes` -> `assay.verified` (keyed by task: shuffle 1).

Verifiers read only the frozen episode. Fail-closed throughout: a missing or
unreadable episode, a verifier error or a timeout is a `Fail`, never a `Pass`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pydantic import Field, ValidationError

from assay.bus.topics import RUN_STATUS, VERIFIED
from assay.kernel import RunId, RunState
from assay.messages import (
    Episode,
    RunExecuted,
    RunStatusChanged,
    RunVerified,
    VerifierResult,
)
from assay.record import BranchKey, Event, EventRegistry, LogRecord, ReadModel, StateDelta
from assay.record.compaction import Compacted, with_compaction
from assay.runtime import StageDeps, StageSpec, UnitOfWork, routes
from assay.verification import Verifier, verifier_registry, verify_episode
from assay.workflow import WorkflowDef


class RunVerdictRecorded(Event):
    """The verifiers' outcome for one run."""

    type: ClassVar[str] = "RunVerdictRecorded"
    version: ClassVar[int] = 1
    run_id: RunId = Field(description="Run.")
    passed: bool = Field(description="Outcome class.")
    results: list[VerifierResult] = Field(description="Each verifier's result.")


VERIFY_EVENTS = EventRegistry([RunVerdictRecorded, Compacted])


class Verdict(ReadModel):
    """A run's verdict: its outcome class and each verifier's result."""

    kind: ClassVar[str] = "verdict"
    passed: bool
    results: list[VerifierResult]


def fold_verify(record: LogRecord) -> list[StateDelta]:
    """One verdict document per run."""
    match record.event:
        case RunVerdictRecorded() as e:
            return [Verdict(passed=e.passed, results=e.results).put(record.key.tenant, e.run_id)]
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
    """Verify the frozen episode (fail closed), record the verdict, hand it to grading."""
    results = await _verify(msg, uow)
    passed = msg.succeeded and all(r.passed for r in results)
    uow.record(
        BranchKey.main(uow.tenant, f"run:{msg.run.run_id}"),
        RunVerdictRecorded(run_id=msg.run.run_id, passed=passed, results=results),
    )
    uow.emit(
        VERIFIED,
        RunVerified(
            run=msg.run,
            episode=msg.episode,
            passed=passed,
            results=results,
            usage=msg.usage,
            cost_usd=msg.cost_usd,
            executed=msg.succeeded,
        ),
    )
    state = RunState.VERIFIED_PASS if passed else RunState.VERIFIED_FAIL
    uow.emit(RUN_STATUS, RunStatusChanged(run=msg.run, state=state))


async def _verify(msg: RunExecuted, uow: VerifyUnitOfWork) -> list[VerifierResult]:
    """Each verifier's result on the episode; a missing, foreign or undecodable one fails."""
    raw = await uow.blobs.get(uow.tenant, msg.episode)
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
        handlers=routes(on_run_executed),
        deps=Verifying(registry=verifier_registry(deps.sandbox, deps.verifiers)),
    )
