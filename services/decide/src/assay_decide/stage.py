"""Decide: `assay.workflows`, `assay.aggregates` -> `assay.decisions` (§12).

One current version and at most one challenger per `(tenant, workflow)`. The
first registered version becomes current; the next one that meets shadow's
entry criteria becomes the challenger and climbs the promotion ladder
(`assay.grading.ladder`) on its selection evidence: shadow -> trial -> current,
or shadow -> canary -> ramp -> current for a tournament-graded workflow. Any
`Capped` episode or a pass-rate regression rolls it back; the sequential test
may reject it. Each move publishes the allocation ingest routes by.

Single writer per workflow: the partition key makes one consumer the writer,
and a commit appends to the workflow's stream only if the stream still ends
where the handler read it — a compare-and-swap that covers the generation it
read, so a replica that raced it (two topics' partitions can sit on two
replicas) runs again on what is there now.
"""

from __future__ import annotations

from typing import Any

from assay.bus.topics import AGGREGATES, DECISIONS, WORKFLOWS
from assay.engine import StepNotExecutable, check_executable
from assay.grading.ladder import Move, MoveKind, Standing, ladder_for, step
from assay.kernel import Refused, WorkflowVersion
from assay.kernel.scores import WinRecord
from assay.messages import (
    ChallengerRejected,
    Promoted,
    ReviewProposal,
    RolledBack,
    Rung,
    VariantAggregate,
    WorkflowRegistered,
)
from assay.runtime import StageDeps, StageSpec, UnitOfWork
from assay.workflow import WorkflowDef, WorkflowInvalid, from_document, validate
from assay_decide.entry import shadow_refusal
from assay_decide.events import (
    DECIDE_EVENTS,
    AllocationSet,
    ChallengerDecided,
    EvidenceAccepted,
    PromotionHeld,
    fold_decide,
)
from assay_decide.proposals import SlowLoop
from assay_decide.workflow import Workflow

__all__ = [
    "DECIDE_EVENTS",
    "AllocationSet",
    "ChallengerDecided",
    "EvidenceAccepted",
    "PromotionHeld",
    "create_stage",
    "fold_decide",
]


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the decide stage."""
    known_tools = frozenset(deps.tools)
    loop = SlowLoop(deps)

    async def on_workflow(msg: WorkflowRegistered, uow: UnitOfWork[Any]) -> None:
        try:
            wf = validate(from_document(msg.definition), known_tools, deps.verifier_kinds)
            check_executable(wf)
        except (WorkflowInvalid, StepNotExecutable):
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
        if await uow.get_document("known", wf.version) is not None:
            return  # a re-registration of a version decide holds, held or turned away
        if alloc.get("challenger"):
            raise Refused(
                f"workflow {wf.id!r} already has challenger {alloc['challenger']}; "
                "at most one challenger at a time"
            )
        refusal = shadow_refusal(wf, deps)
        if refusal is not None:  # §12.3: shadow's entry criteria, checked before any replay
            w.record(
                ChallengerDecided(
                    workflow_id=wf.id,
                    workflow_version=wf.version,
                    accepted=False,
                    record=WinRecord(),
                    llr=0.0,
                    reason=refusal,
                    outcome="rejected",
                    ladder=ladder_for(definition),
                    rung=None,
                    trigger=None,
                )
            )
            uow.emit(
                DECISIONS,
                ChallengerRejected(
                    tenant=uow.tenant,
                    workflow_id=wf.id,
                    workflow_version=wf.version,
                    reason=refusal,
                    record=WinRecord(),
                    llr=0.0,
                ),
            )
            return
        w.allocate(
            alloc,
            "challenger registered (shadow)",
            Standing(ladder=ladder_for(definition), rung=Rung.SHADOW, share=0.0),
            current=alloc["current"],
            challenger=wf.version,
            shadow_rate=deps.shadow_rate,
            definitions={**alloc["definitions"], wf.version: definition},
        )

    async def on_aggregate(msg: VariantAggregate, uow: UnitOfWork[Any]) -> None:
        w = await Workflow.open(uow, msg.workflow_id)
        alloc = await w.allocation()
        if alloc is None or alloc.get("challenger") != msg.workflow_version:
            return  # not the live challenger (already decided, or never one)
        if msg.baseline_version != alloc["current"]:
            return
        standing = await w.standing(alloc)
        move = step(standing, msg, deps.ladder, deps.sprt)
        if move.accepted_now:
            w.record(
                EvidenceAccepted(
                    workflow_id=w.id,
                    workflow_version=msg.workflow_version,
                    record=msg.record,
                    llr=move.llr,
                    reason=move.test,
                )
            )
            standing = standing.model_copy(update={"accepted": True})
        match move.kind:
            case MoveKind.STAY:
                if move.held != standing.held:
                    w.record(
                        PromotionHeld(
                            workflow_id=w.id,
                            workflow_version=msg.workflow_version,
                            reason=move.held,
                        )
                    )
            case MoveKind.ADVANCE:
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
                    current=alloc["current"],
                    challenger=msg.workflow_version,
                    shadow_rate=deps.shadow_rate,
                    definitions=alloc["definitions"],
                )
            case MoveKind.PROMOTE | MoveKind.REJECT | MoveKind.ROLL_BACK:
                _end(w, alloc, standing, msg, move)
                if move.kind is not MoveKind.PROMOTE:  # ended without a replacement
                    definitions = alloc["definitions"]
                    await loop.propose(
                        w,
                        WorkflowDef.model_validate(definitions[alloc["current"]]),
                        WorkflowDef.model_validate(definitions[msg.workflow_version]),
                        "rejected" if move.kind is MoveKind.REJECT else "rolled_back",
                        move.reason,
                        msg.failures,
                    )

    return StageSpec(
        name="decide",
        events=DECIDE_EVENTS,
        fold=fold_decide,
        handlers={
            WORKFLOWS: {
                WorkflowRegistered.type: on_workflow,
                ReviewProposal.type: loop.review,
            },
            AGGREGATES: {VariantAggregate.type: on_aggregate},
        },
    )


def _end(
    w: Workflow, alloc: dict[str, Any], standing: Standing, msg: VariantAggregate, move: Move
) -> None:
    """The challenger's time ends: it becomes current, or the current version keeps all
    traffic. Nothing is deleted: a version decide turned away stays in the DAG."""
    uow, challenger = w.uow, msg.workflow_version
    previous = WorkflowVersion(alloc["current"])
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
        definitions={keep: alloc["definitions"][keep]},
    )
