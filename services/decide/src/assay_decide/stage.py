"""Decide: `assay.workflows`, `assay.aggregates` -> `assay.decisions` (§12).

One current version and at most `grading.challengers` live challengers (the current
version's; one by default, more only under tournament grading) per
`(tenant, workflow)`. The first registered version becomes current; a later one
that meets shadow's entry criteria becomes a challenger while a place is free, and
each challenger climbs the promotion ladder (`assay.grading.ladder`) on its own
selection evidence: shadow -> trial -> current, or shadow -> canary -> ramp ->
current for a tournament-graded workflow. Any `Capped` episode or a pass-rate
regression rolls one back; the sequential test may reject it. Each move publishes
the allocation ingest routes by, the challengers' rung shares splitting live
traffic with the current version.

Several challengers (§12.1, §12.3): one promotion at a time. A challenger whose
evidence says promote waits while another one that qualified with a higher strength
is held (by the drift check or the judge's calibration): the strongest goes first,
ties to the one admitted first. A promotion ends every other challenger's time:
their strengths were deltas from the previous current version, their evidence
compares them with it, and neither says anything against the new one — they are
rejected as superseded (and may be proposed or registered again as new versions).
A drifted task mix, or a judge the calibration distrusts, holds a promotion
(`task_mix.py`, `judge_health.py`).

Single writer per workflow: the partition key makes one consumer the writer,
and a commit appends to the workflow's stream only if the stream still ends
where the handler read it — a compare-and-swap that covers the generation it
read, so a replica that raced it (two topics' partitions can sit on two
replicas) runs again on what is there now.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from assay.bus.topics import DECISIONS
from assay.engine import StepNotExecutable, check_executable
from assay.grading.ladder import (
    ChallengersRefused,
    Move,
    MoveKind,
    Standing,
    check_challengers,
    ladder_for,
    step,
    stronger,
)
from assay.grading.strategies import StrategyRefused, check_strategy
from assay.kernel import Refused, WorkflowVersion
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
    """The first version of a workflow becomes current; a later one becomes a challenger,
    in shadow, if it meets shadow's entry criteria (else it is turned away).

    Raises:
        Refused: the workflow already has as many challengers as it allows.
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
    _refuse_extra_challenger(wf, alloc)
    refusal = shadow_refusal(wf, deps)
    if refusal is not None:  # §12.3: shadow's entry criteria, checked before any replay
        _turn_away(w, wf, refusal)
        return
    entering = Standing(ladder=ladder_for(definition, deps.strategies), rung=Rung.SHADOW, share=0.0)
    w.allocate(
        alloc,
        "challenger registered (shadow)",
        current=alloc.current,
        definitions={**alloc.definitions, wf.version: definition},
        live={**await w.standings(alloc), wf.version: entering},
        moved=wf.version,
    )


def _refuse_extra_challenger(wf: WorkflowDef, alloc: Allocation) -> None:
    """No more live challengers than the current version's `grading.challengers`.

    Raises:
        Refused: the workflow already has that many.
    """
    if len(alloc.live) >= alloc.allowed:
        raise Refused(
            f"workflow {wf.id!r} already has challenger {', '.join(alloc.live)}; at most "
            f"{alloc.allowed} at a time (grading.challengers of its current version)"
        )


async def on_variant_aggregate(msg: VariantAggregate, uow: DecideUnitOfWork) -> None:
    """Take a live challenger's evidence one step on its ladder: stay, climb a rung, or
    end its time — promoted (ending the others'), rejected or rolled back (then the
    proposer is asked)."""
    w = await Workflow.open(uow, msg.workflow_id)
    alloc = await w.allocation()
    if alloc is None or msg.workflow_version not in alloc.live:
        return  # not a live challenger (already decided, or never one)
    if msg.baseline_version != alloc.current:
        return
    standings = await w.standings(alloc)
    standing = standings[msg.workflow_version]
    hold = await task_mix_hold(uow, w.id) or await calibration_hold(uow)
    move = _outranked(
        step(standing, msg, uow.deps.ladder, uow.deps.sprt, judge_hold=hold), msg, alloc, standings
    )
    if move.accepted_now:
        standing = _latch_accepted(w, msg, move, standing)
        standings[msg.workflow_version] = standing
    match move.kind:
        case MoveKind.STAY:
            _note_hold(w, msg, move, standing)
        case MoveKind.ADVANCE:
            _climb(w, alloc, standings, msg, move)
        case MoveKind.PROMOTE:
            _end(w, alloc, standings, msg, move)
        case MoveKind.REJECT | MoveKind.ROLL_BACK:  # ended without a replacement
            _end(w, alloc, standings, msg, move)
            await propose(
                w,
                alloc.definition(alloc.current),
                alloc.definition(msg.workflow_version),
                "rejected" if move.kind is MoveKind.REJECT else "rolled_back",
                move.reason,
                msg.failures,
            )


def _note_hold(w: Workflow, msg: VariantAggregate, move: Move, standing: Standing) -> None:
    """Record why the swap waits (with the strength it qualified at), or that it no
    longer does, when that changed."""
    strength = msg.strength.mean if move.held and msg.strength else None
    if (move.held, strength) != (standing.held, standing.held_strength):
        w.record(
            PromotionHeld(
                workflow_id=w.id,
                workflow_version=msg.workflow_version,
                reason=move.held,
                strength=strength,
            )
        )


def _outranked(
    move: Move, msg: VariantAggregate, alloc: Allocation, standings: dict[WorkflowVersion, Standing]
) -> Move:
    """A promotion waits while another challenger qualified stronger and is held: the
    strongest goes first (ties: the one admitted first)."""
    if move.kind is not MoveKind.PROMOTE:
        return move
    me = msg.workflow_version
    mine = (msg.strength.mean if msg.strength else 0.0, alloc.live.index(me))
    for other, s in standings.items():
        if other == me or s.held is None or s.held_strength is None:
            continue
        if stronger((s.held_strength, alloc.live.index(other)), mine):
            why = (
                f"challenger {other} qualified stronger ({s.held_strength:+.3f} over "
                f"{mine[0]:+.3f}) and is held: it goes first"
            )
            return replace(move, kind=MoveKind.STAY, reason=why, held=why)
    return move


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
    grading strategy is not registered here or refuses its `params` — ingest refuses
    them all, so nothing of it may be allocated, and so does a `grading.challengers` it
    may not have)."""
    try:
        wf = validate(from_document(msg.definition), frozenset(deps.tools), deps.verifier_kinds)
        check_executable(wf)
        check_strategy(wf.grading, deps.strategies)
        check_challengers(wf.grading, deps.strategies, deps.ladder)
    except (WorkflowInvalid, StepNotExecutable, StrategyRefused, ChallengersRefused):
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
    w: Workflow,
    alloc: Allocation,
    standings: dict[WorkflowVersion, Standing],
    msg: VariantAggregate,
    move: Move,
) -> None:
    """The challenger takes the next rung, with what it had when it got there."""
    assert move.rung is not None
    me = msg.workflow_version
    climbed = Standing(
        ladder=standings[me].ladder,
        rung=move.rung,
        share=move.share,
        entered_served=msg.served,
        entered_episodes=msg.strength.episodes if msg.strength else 0,
        accepted=standings[me].accepted,
    )
    w.allocate(
        alloc,
        f"{move.rung.value}: {move.reason}",
        current=alloc.current,
        definitions=alloc.definitions,
        live={**standings, me: climbed},
        moved=me,
    )


def _end(
    w: Workflow,
    alloc: Allocation,
    standings: dict[WorkflowVersion, Standing],
    msg: VariantAggregate,
    move: Move,
) -> None:
    """The challenger's time ends: it becomes current (and every other challenger's time
    ends with it), or the current version keeps its traffic and the others climb on.
    Nothing is deleted: a version decide turned away stays in the DAG."""
    challenger, previous = msg.workflow_version, alloc.current
    standing = standings[challenger]
    outcome = _OUTCOMES[move.kind]
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
    _announce_end(w, msg, move, previous, standing)
    cause = f"{outcome.replace('_', ' ')}: {move.reason}"
    if move.kind is MoveKind.PROMOTE:
        _promote(w, alloc, standings, challenger, cause)
        return
    stay = {v: s for v, s in standings.items() if v != challenger}
    w.allocate(
        alloc,
        cause,
        current=previous,
        definitions={v: alloc.definitions[v] for v in (previous, *stay)},
        live=stay,
    )


def _promote(
    w: Workflow,
    alloc: Allocation,
    standings: dict[WorkflowVersion, Standing],
    challenger: WorkflowVersion,
    cause: str,
) -> None:
    """The challenger takes all traffic; every other challenger's time ends with it."""
    for other in (v for v in standings if v != challenger):
        _supersede(w, other, standings[other], challenger, alloc.current)
    w.allocate(
        alloc, cause, current=challenger, definitions={challenger: alloc.definitions[challenger]}
    )


_OUTCOMES: dict[MoveKind, Literal["promoted", "rejected", "rolled_back"]] = {
    MoveKind.PROMOTE: "promoted",
    MoveKind.REJECT: "rejected",
    MoveKind.ROLL_BACK: "rolled_back",
}


def _announce_end(
    w: Workflow, msg: VariantAggregate, move: Move, previous: WorkflowVersion, standing: Standing
) -> None:
    """Publish how the challenger's time ended."""
    uow, challenger = w.uow, msg.workflow_version
    common = {"tenant": uow.tenant, "workflow_id": w.id, "record": msg.record}
    if move.kind is MoveKind.PROMOTE:
        uow.emit(
            DECISIONS,
            Promoted(**common, workflow_version=challenger, previous=previous, llr=move.llr),
        )
    elif move.kind is MoveKind.REJECT:
        uow.emit(
            DECISIONS,
            ChallengerRejected(
                **common, workflow_version=challenger, reason=move.reason, llr=move.llr
            ),
        )
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


def _supersede(
    w: Workflow,
    version: WorkflowVersion,
    standing: Standing,
    promoted: WorkflowVersion,
    previous: WorkflowVersion,
) -> None:
    """Another challenger was promoted: this one's ladder is void (its evidence and its
    strength were against the previous current version), so its time ends, rejected."""
    reason = (
        f"superseded: {promoted} was promoted; its evidence was against {previous}, "
        "no longer current"
    )
    w.record(
        ChallengerDecided(
            workflow_id=w.id,
            workflow_version=version,
            accepted=False,
            record=WinRecord(),
            llr=0.0,
            reason=reason,
            outcome="rejected",
            ladder=standing.ladder,
            rung=standing.rung,
            trigger=None,
        )
    )
    w.uow.emit(
        DECISIONS,
        ChallengerRejected(
            tenant=w.uow.tenant,
            workflow_id=w.id,
            workflow_version=version,
            reason=reason,
            record=WinRecord(),
            llr=0.0,
        ),
    )
