"""Decide: `assay.workflows`, `assay.aggregates` -> `assay.decisions` (§12).

One current version and at most one challenger per `(tenant, workflow)`. The
first registered version becomes current; the next one that meets shadow's
entry criteria becomes the challenger and climbs the promotion ladder
(`assay.grading.ladder`) on its selection evidence: shadow -> trial -> current,
or shadow -> canary -> ramp -> current for a tournament-graded workflow. Any
`Capped` episode or a pass-rate regression rolls it back; the sequential test
may reject it. Each move publishes the allocation ingest routes by. A drifted task
mix, or a judge the calibration distrusts, holds the promotion (`task_mix.py`,
`judge_health.py`).

Single writer per workflow: the partition key makes one consumer the writer,
and a commit appends to the workflow's stream only if the stream still ends
where the handler read it — a compare-and-swap that covers the generation it
read, so a replica that raced it (two topics' partitions can sit on two
replicas) runs again on what is there now.
"""

from __future__ import annotations

from assay.bus.topics import DECISIONS
from assay.engine import StepNotExecutable, check_executable
from assay.grading.ladder import Move, MoveKind, Standing, ladder_for, step
from assay.grading.strategies import StrategyUnknown, strategy_named
from assay.kernel import Refused
from assay.kernel.scores import WinRecord
from assay.messages import (
    ChallengerRejected,
    Promoted,
    RolledBack,
    Rung,
    VariantAggregate,
    WorkflowRegistered,
)
from assay.runtime import StageDeps, StageSpec, routes
from assay.workflow import WorkflowDef, WorkflowInvalid, from_document, validate
from assay_decide.deciding import DecideUnitOfWork, Deciding
from assay_decide.entry import shadow_refusal
from assay_decide.events import (
    DECIDE_EVENTS,
    AllocationSet,
    ChallengerDecided,
    EvidenceAccepted,
    PromotionHeld,
)
from assay_decide.judge_health import calibration_hold, on_judge_calibrated
from assay_decide.proposals import on_review_proposal, propose
from assay_decide.state import Allocation, Known, fold_decide
from assay_decide.task_mix import on_task_mix_drifted, on_task_mix_rebased, task_mix_hold
from assay_decide.workflow import Workflow

__all__ = [
    "DECIDE_EVENTS",
    "AllocationSet",
    "ChallengerDecided",
    "EvidenceAccepted",
    "PromotionHeld",
    "create_stage",
    "fold_decide",
    "on_judge_calibrated",
    "on_review_proposal",
    "on_variant_aggregate",
    "on_workflow_registered",
]


async def on_workflow_registered(msg: WorkflowRegistered, uow: DecideUnitOfWork) -> None:
    """The first version of a workflow becomes current; a later one becomes its challenger,
    in shadow, if it meets shadow's entry criteria (else it is turned away).

    Raises:
        Refused: the workflow already has a challenger.
    """
    deps = uow.deps
    wf = _valid(msg, deps)
    if wf is None:
        return  # ingest dead-letters invalid definitions with the reason
    w = await Workflow.open(uow, wf.id)
    alloc = await w.allocation()
    definition = wf.model_dump(mode="json", by_alias=True)
    if alloc is None:
        w.allocate(
            None,
            "first version registered",
            current=wf.version,
            definitions={wf.version: definition},
        )
        return
    if await uow.get(Known, wf.version) is not None:
        return  # a re-registration of a version decide holds, held or turned away
    _refuse_second_challenger(wf, alloc)
    refusal = shadow_refusal(wf, deps)
    if refusal is not None:  # §12.3: shadow's entry criteria, checked before any replay
        _turn_away(w, wf, refusal)
        return
    w.allocate(
        alloc,
        "challenger registered (shadow)",
        Standing(ladder=ladder_for(definition, deps.strategies), rung=Rung.SHADOW, share=0.0),
        current=alloc.current,
        challenger=wf.version,
        shadow_rate=deps.shadow_rate,
        definitions={**alloc.definitions, wf.version: definition},
    )


def _refuse_second_challenger(wf: WorkflowDef, alloc: Allocation) -> None:
    """One challenger at a time.

    Raises:
        Refused: the workflow already has a challenger.
    """
    if alloc.challenger:
        raise Refused(
            f"workflow {wf.id!r} already has challenger {alloc.challenger}; "
            "at most one challenger at a time"
        )


async def on_variant_aggregate(msg: VariantAggregate, uow: DecideUnitOfWork) -> None:
    """Take the live challenger's evidence one step on its ladder: stay, climb a rung, or
    end its time — promoted, rejected or rolled back (then the proposer is asked)."""
    w = await Workflow.open(uow, msg.workflow_id)
    alloc = await w.allocation()
    if alloc is None or alloc.challenger != msg.workflow_version:
        return  # not the live challenger (already decided, or never one)
    if msg.baseline_version != alloc.current:
        return
    standing = await w.standing(alloc)
    hold = await task_mix_hold(uow, w.id) or await calibration_hold(uow)
    move = step(standing, msg, uow.deps.ladder, uow.deps.sprt, judge_hold=hold)
    if move.accepted_now:
        standing = _latch_accepted(w, msg, move, standing)
    match move.kind:
        case MoveKind.STAY:
            if move.held != standing.held:
                w.record(
                    PromotionHeld(
                        workflow_id=w.id, workflow_version=msg.workflow_version, reason=move.held
                    )
                )
        case MoveKind.ADVANCE:
            _climb(w, alloc, standing, msg, move)
        case MoveKind.PROMOTE:
            _end(w, alloc, standing, msg, move)
        case MoveKind.REJECT | MoveKind.ROLL_BACK:  # ended without a replacement
            _end(w, alloc, standing, msg, move)
            await propose(
                w,
                alloc.definition(alloc.current),
                alloc.definition(msg.workflow_version),
                "rejected" if move.kind is MoveKind.REJECT else "rolled_back",
                move.reason,
                msg.failures,
            )


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the decide stage."""
    return StageSpec(
        name="decide",
        events=DECIDE_EVENTS,
        fold=fold_decide,
        handlers=routes(
            on_workflow_registered,
            on_review_proposal,
            on_variant_aggregate,
            on_judge_calibrated,
            on_task_mix_drifted,
            on_task_mix_rebased,
        ),
        deps=Deciding.of(deps),
    )


def _valid(msg: WorkflowRegistered, deps: Deciding) -> WorkflowDef | None:
    """The registered definition, validated as ingest validates it (None: invalid, or its
    grading strategy is not registered here — ingest refuses both, so nothing of it may
    be allocated)."""
    try:
        wf = validate(from_document(msg.definition), frozenset(deps.tools), deps.verifier_kinds)
        check_executable(wf)
        strategy_named(wf.grading.strategy, deps.strategies)
    except (WorkflowInvalid, StepNotExecutable, StrategyUnknown):
        return None
    return wf


def _turn_away(w: Workflow, wf: WorkflowDef, refusal: str) -> None:
    """A version that fails shadow's entry criteria is rejected at registration."""
    w.record(
        ChallengerDecided(
            workflow_id=wf.id,
            workflow_version=wf.version,
            accepted=False,
            record=WinRecord(),
            llr=0.0,
            reason=refusal,
            outcome="rejected",
            ladder=ladder_for(wf.model_dump(mode="json", by_alias=True), w.uow.deps.strategies),
            rung=None,
            trigger=None,
        )
    )
    w.uow.emit(
        DECISIONS,
        ChallengerRejected(
            tenant=w.uow.tenant,
            workflow_id=wf.id,
            workflow_version=wf.version,
            reason=refusal,
            record=WinRecord(),
            llr=0.0,
        ),
    )


def _latch_accepted(w: Workflow, msg: VariantAggregate, move: Move, standing: Standing) -> Standing:
    """The sequential test crossed its accept boundary: latch it."""
    w.record(
        EvidenceAccepted(
            workflow_id=w.id,
            workflow_version=msg.workflow_version,
            record=msg.record,
            llr=move.llr,
            reason=move.test,
        )
    )
    return standing.model_copy(update={"accepted": True})


def _climb(
    w: Workflow, alloc: Allocation, standing: Standing, msg: VariantAggregate, move: Move
) -> None:
    """The challenger takes the next rung, with what it had when it got there."""
    assert move.rung is not None
    w.allocate(
        alloc,
        f"{move.rung.value}: {move.reason}",
        Standing(
            ladder=standing.ladder,
            rung=move.rung,
            share=move.share,
            entered_served=msg.served,
            entered_episodes=msg.strength.episodes if msg.strength else 0,
            accepted=standing.accepted,
        ),
        current=alloc.current,
        challenger=msg.workflow_version,
        shadow_rate=w.uow.deps.shadow_rate,
        definitions=alloc.definitions,
    )


def _end(
    w: Workflow, alloc: Allocation, standing: Standing, msg: VariantAggregate, move: Move
) -> None:
    """The challenger's time ends: it becomes current, or the current version keeps all
    traffic. Nothing is deleted: a version decide turned away stays in the DAG."""
    uow, challenger = w.uow, msg.workflow_version
    previous = alloc.current
    outcome = {
        MoveKind.PROMOTE: "promoted",
        MoveKind.REJECT: "rejected",
        MoveKind.ROLL_BACK: "rolled_back",
    }[move.kind]
    w.record(
        ChallengerDecided(
            workflow_id=w.id,
            workflow_version=challenger,
            accepted=move.kind is MoveKind.PROMOTE,
            record=msg.record,
            llr=move.llr,
            reason=move.reason,
            outcome=outcome,
            ladder=standing.ladder,
            rung=standing.rung,
            trigger=move.trigger,
        )
    )
    common = {"tenant": uow.tenant, "workflow_id": w.id, "record": msg.record}
    if move.kind is MoveKind.PROMOTE:
        uow.emit(
            DECISIONS,
            Promoted(**common, workflow_version=challenger, previous=previous, llr=move.llr),
        )
        keep = challenger
    elif move.kind is MoveKind.REJECT:
        uow.emit(
            DECISIONS,
            ChallengerRejected(
                **common, workflow_version=challenger, reason=move.reason, llr=move.llr
            ),
        )
        keep = previous
    else:
        assert move.trigger is not None
        uow.emit(
            DECISIONS,
            RolledBack(
                **common,
                workflow_version=challenger,
                current=previous,
                rung=standing.rung,
                trigger=move.trigger,
                reason=move.reason,
                runs=msg.runs,
                passes=msg.passes,
                baseline_runs=msg.baseline_runs,
                baseline_passes=msg.baseline_passes,
            ),
        )
        keep = previous
    w.allocate(
        alloc,
        f"{outcome.replace('_', ' ')}: {move.reason}",
        current=keep,
        definitions={keep: alloc.definitions[keep]},
    )
