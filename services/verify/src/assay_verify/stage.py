"""Verify: `assay.episodes` -> `assay.verified` (keyed by task: shuffle 1).

Verifiers read only the frozen episode. Fail-closed throughout: a missing or
unreadable episode, a verifier error or a timeout is a `Fail`, never a `Pass`.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, ValidationError

from assay.bus.topics import EPISODES, RUN_STATUS, VERIFIED
from assay.kernel import RunId, RunState
from assay.messages import (
    Episode,
    RunExecuted,
    RunStatusChanged,
    RunVerified,
    VerifierResult,
)
from assay.record import BranchKey, Event, EventRegistry, LogRecord, Put, StateDelta, StateKey
from assay.runtime import StageDeps, StageSpec, UnitOfWork
from assay.verification import verifier_registry, verify_episode
from assay.workflow import WorkflowDef


class RunVerdictRecorded(Event):
    """The verifiers' outcome for one run."""

    type: ClassVar[str] = "RunVerdictRecorded"
    version: ClassVar[int] = 1
    run_id: RunId = Field(description="Run.")
    passed: bool = Field(description="Outcome class.")
    results: list[VerifierResult] = Field(description="Each verifier's result.")


VERIFY_EVENTS = EventRegistry([RunVerdictRecorded])


def fold_verify(record: LogRecord) -> list[StateDelta]:
    """One verdict document per run."""
    match record.event:
        case RunVerdictRecorded() as e:
            return [
                Put(
                    StateKey(record.key.tenant, "verdict", e.run_id),
                    {"passed": e.passed, "results": [r.model_dump(mode="json") for r in e.results]},
                )
            ]
    return []


def _closed(reason: str) -> list[VerifierResult]:
    return [
        VerifierResult(
            verifier="episode", kind="snapshot", verifier_version="1", passed=False, evidence=reason
        )
    ]


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the verify stage: built-in verifiers, `command` in `deps.sandbox`, installed kinds."""
    registry = verifier_registry(deps.sandbox, deps.verifiers)

    async def on_run_executed(msg: RunExecuted, uow: UnitOfWork) -> None:
        raw = await uow.blobs.get(uow.tenant, msg.episode)
        if raw is None:
            results = _closed(f"episode blob {msg.episode} is missing")
        else:
            try:
                episode = Episode.model_validate_json(raw)
                wf = WorkflowDef.model_validate(episode.definition)
                if episode.run.tenant != uow.tenant:
                    results = _closed(f"episode {msg.episode} names another tenant")
                else:
                    results = await verify_episode(episode, list(wf.verifiers), registry=registry)
            except ValidationError as exc:
                results = _closed(f"episode does not decode: {exc.error_count()} error(s)")
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
        uow.emit(
            RUN_STATUS,
            RunStatusChanged(
                run=msg.run, state=RunState.VERIFIED_PASS if passed else RunState.VERIFIED_FAIL
            ),
        )

    return StageSpec(
        name="verify",
        events=VERIFY_EVENTS,
        fold=fold_verify,
        handlers={EPISODES: {RunExecuted.type: on_run_executed}},
    )
