"""Tournament: `assay.verified` -> `assay.graded`, `assay.results` (§11.3).

Keyed by `(tenant, task)`, so every episode of a task lands here on one
partition. The first episode of each version on a task is that version's
reference on it. A challenger episode is compared with the current version's
reference on the same task: pass-vs-fail by the verifier, otherwise by the
judge with the challenger's position alternating. A challenger whose paired
reference run is still on its way waits (Grading is a resting state).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, TypeAdapter, ValidationError

from assay.bus.topics import GRADED, RESULTS, RUN_STATUS, USAGE, VERIFIED
from assay.grading import compare_with_reference
from assay.kernel import RunId, RunState, TaskId, WorkflowVersion
from assay.kernel.scores import Capped, Score, Ungraded, UngradedReason
from assay.messages import (
    Episode,
    Purpose,
    Role,
    RunGraded,
    RunResult,
    RunStatusChanged,
    RunVerified,
    UsageRecorded,
)
from assay.record import (
    BranchKey,
    Delete,
    Event,
    EventRegistry,
    LogRecord,
    Put,
    StateDelta,
    StateKey,
)
from assay.runtime import StageDeps, StageSpec, UnitOfWork
from assay.workflow import WorkflowDef

_SCORE: TypeAdapter[Score] = TypeAdapter(Score)


class ReferenceSet(Event):
    """The first episode of a version on a task became its reference there."""

    type: ClassVar[str] = "ReferenceSet"
    version: ClassVar[int] = 1
    task_id: TaskId = Field(description="Task.")
    workflow_version: WorkflowVersion = Field(description="Version.")
    run_id: RunId = Field(description="Reference run.")
    episode: str = Field(description="BlobRef of its episode.")
    passed: bool = Field(description="Its verifier outcome.")


class ChallengerParked(Event):
    """A challenger waits for the reference run spawned alongside it."""

    type: ClassVar[str] = "ChallengerParked"
    version: ClassVar[int] = 1
    verified: dict[str, Any] = Field(description="The RunVerified payload to grade later.")


class RunScored(Event):
    """Grading of a run ended, with its score."""

    type: ClassVar[str] = "RunScored"
    version: ClassVar[int] = 1
    run_id: RunId = Field(description="Run.")
    task_id: TaskId = Field(description="Task.")
    workflow_version: WorkflowVersion = Field(description="Version.")
    score: Score = Field(description="The score.")
    judge_calls: int = Field(ge=0, description="Judge calls spent.")
    order_index: int | None = Field(None, description="Comparison index of the challenger.")
    was_parked: bool = Field(False, description="It had been waiting for its reference.")


TOURNAMENT_EVENTS = EventRegistry([ReferenceSet, ChallengerParked, RunScored])


def fold_tournament(record: LogRecord) -> list[StateDelta]:
    """References per (task, version), parked challengers, scores, comparison counters."""
    t = record.key.tenant
    match record.event:
        case ReferenceSet() as e:
            return [
                Put(
                    StateKey(t, "reference", f"{e.task_id}/{e.workflow_version}"),
                    {"run_id": e.run_id, "episode": e.episode, "passed": e.passed},
                )
            ]
        case ChallengerParked(verified=v):
            return [Put(StateKey(t, "parked", f"{v['run']['task_id']}/{v['run']['run_id']}"), v)]
        case RunScored() as e:
            out: list[StateDelta] = [
                Put(
                    StateKey(t, "scored", e.run_id),
                    {"score": e.score.model_dump(mode="json"), "judge_calls": e.judge_calls},
                )
            ]
            if e.order_index is not None:
                out.append(
                    Put(StateKey(t, "comparisons", e.workflow_version), {"next": e.order_index + 1})
                )
            if e.was_parked:
                out.append(Delete(StateKey(t, "parked", f"{e.task_id}/{e.run_id}")))
            return out
    return []


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the tournament stage."""
    judge = deps.judge

    async def load(uow: UnitOfWork, ref: str) -> Episode | None:
        raw = await uow.blobs.get(uow.tenant, ref)
        if raw is None:
            return None
        try:
            return Episode.model_validate_json(raw)
        except ValidationError:
            return None

    def finish(
        uow: UnitOfWork,
        msg: RunVerified,
        episode: Episode | None,
        score: Score,
        calls: int,
        order_index: int | None = None,
        was_parked: bool = False,
    ) -> None:
        r = msg.run
        uow.record(
            BranchKey.main(uow.tenant, f"task:{r.task_id}"),
            RunScored(
                run_id=r.run_id,
                task_id=r.task_id,
                workflow_version=r.workflow_version,
                score=score,
                judge_calls=calls,
                order_index=order_index,
                was_parked=was_parked,
            ),
        )
        uow.emit(GRADED, RunGraded(run=r, passed=msg.passed, score=score, judge_calls=calls))
        graded = not isinstance(score, Ungraded)
        uow.emit(
            RUN_STATUS,
            RunStatusChanged(
                run=r,
                state=RunState.GRADED if graded else RunState.UNGRADED,
                detail=score.reason.value if isinstance(score, Ungraded) else score.kind,
            ),
        )
        for _ in range(calls):
            uow.emit(
                USAGE,
                UsageRecorded(
                    tenant=r.tenant,
                    run_id=r.run_id,
                    purpose=Purpose.GRADING,
                    model=judge.name,
                    prompt_tokens=0,
                    completion_tokens=0,
                    cost_usd=0.0,
                ),
            )
        if r.purpose is Purpose.WORK:
            uow.emit(
                RESULTS,
                RunResult(
                    tenant=r.tenant,
                    run_id=r.run_id,
                    task_id=r.task_id,
                    idempotency_key=r.idempotency_key,
                    workflow_id=r.workflow_id,
                    workflow_version=r.workflow_version,
                    status="graded" if graded else "ungraded",
                    passed=msg.passed,
                    verification=msg.results,
                    score=score,
                    usage=msg.usage,
                    termination="succeeded" if msg.executed else "failed",
                    output=episode.output if episode else None,
                ),
            )

    async def next_index(uow: UnitOfWork, version: WorkflowVersion) -> int:
        counter = await uow.get("comparisons", version)
        return int(counter["next"]) if counter else 0

    async def compare(
        uow: UnitOfWork,
        msg: RunVerified,
        episode: Episode,
        reference: dict[str, Any],
        index: int,
        was_parked: bool,
    ) -> int:
        """Score one challenger episode; return the next comparison index."""
        ref_episode = await load(uow, reference["episode"])
        if ref_episode is None:
            finish(
                uow,
                msg,
                episode,
                Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE),
                0,
                was_parked=was_parked,
            )
            return index
        rubric = list(WorkflowDef.model_validate(episode.definition).rubric)
        score, calls = await compare_with_reference(
            challenger=episode,
            challenger_passed=msg.passed,
            reference=ref_episode,
            reference_passed=reference["passed"],
            reference_run=RunId(reference["run_id"]),
            order_index=index,
            judge=judge,
            rubric=rubric,
        )
        finish(uow, msg, episode, score, calls, order_index=index, was_parked=was_parked)
        return index + 1

    async def release_parked(uow: UnitOfWork, msg: RunVerified) -> None:
        """Grade the challengers parked on this task that waited for this current run."""
        r = msg.run
        index: int | None = None
        for _, parked in await uow.scan("parked", f"{r.task_id}/"):
            waiting = RunVerified.model_validate(parked)
            if waiting.run.baseline_version != r.workflow_version:
                continue
            waiting_episode = await load(uow, waiting.episode)
            fresh: dict[str, Any] = {
                "run_id": r.run_id,
                "episode": msg.episode,
                "passed": msg.passed,
            }
            if waiting_episode is None:
                finish(
                    uow,
                    waiting,
                    None,
                    Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE),
                    0,
                    was_parked=True,
                )
                continue
            if index is None:
                index = await next_index(uow, waiting.run.workflow_version)
            index = await compare(uow, waiting, waiting_episode, fresh, index, was_parked=True)

    async def on_verified(msg: RunVerified, uow: UnitOfWork) -> None:
        r = msg.run
        if await uow.get("scored", r.run_id) is not None:
            return
        task_stream = BranchKey.main(uow.tenant, f"task:{r.task_id}")
        episode = await load(uow, msg.episode)
        if episode is None:
            finish(uow, msg, None, Ungraded(reason=UngradedReason.EPISODE_UNAVAILABLE), 0)
            if r.role is Role.CURRENT:
                await release_parked(uow, msg)  # they waited for this run; do not strand them
            return
        own_ref = await uow.get("reference", f"{r.task_id}/{r.workflow_version}")
        rubric = list(WorkflowDef.model_validate(episode.definition).rubric)
        violations = await judge.screen(episode, rubric) if r.role is Role.CHALLENGER else []
        if own_ref is None and not violations:
            uow.record(
                task_stream,
                ReferenceSet(
                    task_id=r.task_id,
                    workflow_version=r.workflow_version,
                    run_id=r.run_id,
                    episode=msg.episode,
                    passed=msg.passed,
                ),
            )
        if r.role is Role.CURRENT:
            reason = UngradedReason.NO_REFERENCE if own_ref is None else UngradedReason.BASELINE
            finish(uow, msg, episode, Ungraded(reason=reason), 0)
            await release_parked(uow, msg)
            return
        if violations:
            finish(uow, msg, episode, Capped(violations=violations), 0)
            return
        baseline = r.baseline_version
        reference = (
            await uow.get("reference", f"{r.task_id}/{baseline}") if baseline is not None else None
        )
        if reference is not None:
            await compare(
                uow,
                msg,
                episode,
                reference,
                await next_index(uow, r.workflow_version),
                was_parked=False,
            )
        elif r.reference_expected:
            uow.record(task_stream, ChallengerParked(verified=msg.model_dump(mode="json")))
            uow.emit(
                RUN_STATUS,
                RunStatusChanged(
                    run=r, state=RunState.GRADING, detail="waiting for the reference run"
                ),
            )
        else:
            finish(uow, msg, episode, Ungraded(reason=UngradedReason.NO_REFERENCE), 0)

    return StageSpec(
        name="tournament",
        events=TOURNAMENT_EVENTS,
        fold=fold_tournament,
        handlers={VERIFIED: {RunVerified.type: on_verified}},
    )
