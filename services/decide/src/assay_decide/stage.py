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

import functools

from assay.bus.topics import DECISIONS
from assay.engine import StepNotExecutable, check_executable
from assay.grading.ladder import (
    ChallengersRefused,
    Standing,
    check_challengers,
    ladder_for,
)
from assay.grading.strategies import StrategyRefused, check_strategy
from assay.kernel import Refused
from assay.kernel.scores import WinRecord
from assay.messages import (
    ChallengerRejected,
    Rung,
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
from assay_decide.judge_health import on_judge_calibrated
from assay_decide.moves import on_variant_aggregate
from assay_decide.proposals import on_review_proposal
from assay_decide.state import Allocation, Known, fold_decide
from assay_decide.task_mix import on_task_mix_drifted, on_task_mix_rebased
from assay_decide.thresholds import threshold_gauges
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
        gauges=functools.partial(threshold_gauges, ladder=deps.ladder),
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
