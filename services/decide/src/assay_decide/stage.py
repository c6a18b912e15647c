"""Decide: `assay.workflows`, `assay.aggregates` -> `assay.decisions` (§12).

Single writer per `(tenant, workflow)` (the partition key), and every change
of allocation checks the generation it read (compare-and-swap). The first
registered version becomes current; the next becomes the challenger, run in
shadow on a share of tasks; the sequential test on its win record promotes or
rejects it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from assay.bus.topics import AGGREGATES, DECISIONS, WORKFLOWS
from assay.engine import StepNotExecutable, check_executable
from assay.grading import SprtDecision, evaluate
from assay.kernel import AssayError, Refused, WorkflowId, WorkflowVersion
from assay.kernel.scores import WinRecord
from assay.messages import (
    AllocationChanged,
    ChallengerRejected,
    Promoted,
    VariantAggregate,
    WorkflowRegistered,
)
from assay.record import BranchKey, Event, EventRegistry, LogRecord, Put, StateDelta, StateKey
from assay.runtime import StageDeps, StageSpec, UnitOfWork
from assay.workflow import WorkflowInvalid, from_document, validate


class GenerationConflict(AssayError):
    """The allocation changed between read and write (retried by the consumer)."""


class AllocationSet(Event):
    """The allocation of a workflow moved to a new generation."""

    type: ClassVar[str] = "AllocationSet"
    version: ClassVar[int] = 1
    allocation: AllocationChanged = Field(description="The new allocation.")
    expected_generation: int = Field(ge=0, description="Generation it replaced (CAS).")
    cause: str = Field(description="Why it changed.")


class ChallengerDecided(Event):
    """The sequential test ended for a challenger."""

    type: ClassVar[str] = "ChallengerDecided"
    version: ClassVar[int] = 1
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="The challenger.")
    accepted: bool = Field(description="Promoted (true) or rejected.")
    record: WinRecord = Field(description="Record at the decision.")
    llr: float = Field(description="Log-likelihood ratio at the decision.")
    reason: str = Field(description="The boundary crossed.")


DECIDE_EVENTS = EventRegistry([AllocationSet, ChallengerDecided])


def fold_decide(record: LogRecord) -> list[StateDelta]:
    """The allocation per workflow and the decision per challenger."""
    t = record.key.tenant
    match record.event:
        case AllocationSet(allocation=a):
            return [
                Put(StateKey(t, "allocation", a.workflow_id), a.model_dump(mode="json")),
                *(
                    Put(StateKey(t, "known", v), {"workflow_id": a.workflow_id})
                    for v in sorted(a.definitions)
                ),
            ]
        case ChallengerDecided() as e:
            return [Put(StateKey(t, "decision", e.workflow_version), e.model_dump(mode="json"))]
    return []


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the decide stage."""
    policy = deps.sprt
    known_tools = frozenset(deps.tools)

    async def change(
        uow: UnitOfWork, wf_id: WorkflowId, read: dict[str, Any] | None, cause: str, **fields: Any
    ) -> None:
        now = await uow.get("allocation", wf_id)
        if (now or {}).get("generation") != (read or {}).get("generation"):
            raise GenerationConflict(f"allocation of {wf_id!r} changed under decide")
        gen = (read or {}).get("generation", 0)
        alloc = AllocationChanged(
            tenant=uow.tenant, workflow_id=wf_id, generation=gen + 1, **fields
        )
        uow.record(
            BranchKey.main(uow.tenant, f"workflow:{wf_id}"),
            AllocationSet(allocation=alloc, expected_generation=gen, cause=cause),
        )
        uow.emit(DECISIONS, alloc)

    async def on_workflow(msg: WorkflowRegistered, uow: UnitOfWork) -> None:
        try:
            wf = validate(from_document(msg.definition), known_tools, deps.verifier_kinds)
            check_executable(wf)
        except (WorkflowInvalid, StepNotExecutable):
            return  # ingest dead-letters invalid definitions with the reason
        alloc = await uow.get("allocation", wf.id)
        definition = wf.model_dump(mode="json", by_alias=True)
        if alloc is None:
            await change(
                uow,
                wf.id,
                None,
                "first version registered",
                current=wf.version,
                definitions={wf.version: definition},
            )
            return
        if await uow.get("known", wf.version) is not None:
            return  # a re-registration of a version decide already holds or held
        if alloc.get("challenger"):
            raise Refused(
                f"workflow {wf.id!r} already has challenger {alloc['challenger']}; "
                "at most one challenger at a time"
            )
        await change(
            uow,
            wf.id,
            alloc,
            "challenger registered (shadow)",
            current=alloc["current"],
            challenger=wf.version,
            shadow_rate=deps.shadow_rate,
            challenger_share=0.0,
            definitions={**alloc["definitions"], wf.version: definition},
        )

    async def on_aggregate(msg: VariantAggregate, uow: UnitOfWork) -> None:
        alloc = await uow.get("allocation", msg.workflow_id)
        if alloc is None or alloc.get("challenger") != msg.workflow_version:
            return  # not the live challenger (already decided, or never one)
        if msg.baseline_version != alloc["current"]:
            return
        state = evaluate(msg.record, policy)
        if state.decision is SprtDecision.CONTINUE:
            return
        accepted = state.decision is SprtDecision.ACCEPT
        uow.record(
            BranchKey.main(uow.tenant, f"workflow:{msg.workflow_id}"),
            ChallengerDecided(
                workflow_id=msg.workflow_id,
                workflow_version=msg.workflow_version,
                accepted=accepted,
                record=msg.record,
                llr=state.llr,
                reason=state.reason,
            ),
        )
        challenger_def = alloc["definitions"][msg.workflow_version]
        current_def = alloc["definitions"][alloc["current"]]
        if accepted:
            uow.emit(
                DECISIONS,
                Promoted(
                    tenant=uow.tenant,
                    workflow_id=msg.workflow_id,
                    workflow_version=msg.workflow_version,
                    previous=alloc["current"],
                    record=msg.record,
                    llr=state.llr,
                ),
            )
            await change(
                uow,
                msg.workflow_id,
                alloc,
                f"promoted: {state.reason}",
                current=msg.workflow_version,
                definitions={msg.workflow_version: challenger_def},
            )
        else:
            uow.emit(
                DECISIONS,
                ChallengerRejected(
                    tenant=uow.tenant,
                    workflow_id=msg.workflow_id,
                    workflow_version=msg.workflow_version,
                    reason=state.reason,
                    record=msg.record,
                    llr=state.llr,
                ),
            )
            await change(
                uow,
                msg.workflow_id,
                alloc,
                f"rejected: {state.reason}",
                current=alloc["current"],
                definitions={alloc["current"]: current_def},
            )

    return StageSpec(
        name="decide",
        events=DECIDE_EVENTS,
        fold=fold_decide,
        handlers={
            WORKFLOWS: {WorkflowRegistered.type: on_workflow},
            AGGREGATES: {VariantAggregate.type: on_aggregate},
        },
    )
