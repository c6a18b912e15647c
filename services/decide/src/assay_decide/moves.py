"""A live challenger's evidence, one step on its ladder (§12.3), and a hold's release.

`on_variant_aggregate` takes a challenger's evidence one step: stay, climb a rung, or
end its time — promoted (ending every other challenger's), rejected or rolled back.
A promotion the drift check, the judge's calibration or a stronger held challenger
holds is recorded with the evidence it was held on (`PromotionHeld`). When what held
it lets go — a calibration that finds the judge recovered, a new reference task mix —
`step_held_again` steps the strongest held challenger of each workflow once more on
that evidence, so the promotion does not wait for evidence that may be long in coming.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Literal

from assay.bus.topics import DECISIONS
from assay.grading.ladder import Move, MoveKind, Standing, step, stronger
from assay.kernel import WorkflowId, WorkflowVersion
from assay.kernel.scores import WinRecord
from assay.messages import (
    ChallengerRejected,
    Promoted,
    RolledBack,
    VariantAggregate,
)
from assay_decide.deciding import DecideUnitOfWork
from assay_decide.events import ChallengerDecided, EvidenceAccepted, PromotionHeld
from assay_decide.holds import calibration_hold, task_mix_hold
from assay_decide.proposals import propose
from assay_decide.state import Allocation, Climb, HeldEvidence, climb_key
from assay_decide.workflow import Workflow


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
            await _note_hold(w, msg, move, standing)
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


async def _note_hold(w: Workflow, msg: VariantAggregate, move: Move, standing: Standing) -> None:
    """Record why the swap waits (with the strength it qualified at and the evidence it
    was held on), or that it no longer does, when that changed."""
    strength = msg.strength.mean if move.held and msg.strength else None
    changed = (move.held, strength) != (standing.held, standing.held_strength)
    if move.held and not changed:  # still held: keep the newest evidence it is held on
        stored = await w.uow.get(HeldEvidence, climb_key(w.id, msg.workflow_version))
        changed = stored is None or _payload(stored) != _payload(msg)
    if changed:
        w.record(
            PromotionHeld(
                workflow_id=w.id,
                workflow_version=msg.workflow_version,
                reason=move.held,
                strength=strength,
                evidence=msg if move.held else None,
            )
        )


def _payload(agg: VariantAggregate) -> dict[str, object]:
    """The evidence's fields (a stored document compares equal to the message it was)."""
    return VariantAggregate.model_validate(agg.model_dump()).model_dump(mode="json")


async def step_held_again(uow: DecideUnitOfWork, workflows: Iterable[WorkflowId]) -> None:
    """What held a promotion let go: step the strongest held challenger of each of
    `workflows` again on the evidence it was held on, each workflow in its own commit.

    Nothing moves while the challenger is still held (by the other hold, or by a
    stronger held challenger), and a hold recorded without its evidence (before
    `PromotionHeld` v3) waits for the next evidence, as before.
    """
    for workflow in workflows:
        alloc = await uow.get(Allocation, workflow)
        if alloc is None:
            continue
        held: list[tuple[tuple[float, int], HeldEvidence]] = []
        for order, version in enumerate(alloc.live):
            where = climb_key(workflow, version)
            climb, evidence = await uow.get(Climb, where), await uow.get(HeldEvidence, where)
            if climb is None or climb.held is None or evidence is None:
                continue
            held.append(((climb.held_strength or 0.0, order), evidence))
        if not held:
            continue
        first = held[0]
        for candidate in held[1:]:
            if stronger(candidate[0], first[0]):
                first = candidate
        async with uow.step():
            await on_variant_aggregate(VariantAggregate.model_validate(first[1].model_dump()), uow)


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
