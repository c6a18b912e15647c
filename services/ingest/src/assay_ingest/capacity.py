"""Admission by capacity at ingest (§14.2; `assay.runtime.admission`).

Each planned run's demand is held against the declared capacity before it is spawned.
A work run that does not fit refuses its whole task: none of its runs is spawned, each
is recorded in `TaskAccepted.cut` with reason `capacity` and why, announced as
`Cancelled` on `assay.run-status`, and the task gets its one `RunResult`, cancelled —
refused, never queued. A shadow run that does not fit is cut alone.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from assay.bus.topics import RESULTS, RUN_STATUS
from assay.kernel import RunId, RunState, TaskId
from assay.messages import Purpose, Role, RunRef, RunResult, RunStatusChanged, TaskSubmitted
from assay.messages.models import Usage
from assay.runtime import UnitOfWork
from assay.runtime.admission import Admission
from assay.workflow import WorkflowDef
from assay_ingest.replay import CutReason, CutRun
from assay_ingest.routing import PlannedRun, Route


def admit_by_capacity(
    uow: UnitOfWork[Any],
    admission: Admission,
    plan: Route,
    definitions: dict[str, Any],
    run_id_of: Callable[[PlannedRun], RunId],
) -> tuple[Route, tuple[CutRun, ...]]:
    """The runs of `plan` that fit (held until they stop executing, or until `uow` is
    discarded without spawning them), and those refused."""
    route, cut = _admit(uow, admission, plan, definitions, run_id_of)
    for planned in route.runs:
        uow.on_discard(functools.partial(admission.release, str(run_id_of(planned))))
    return route, cut


def _admit(
    uow: UnitOfWork[Any],
    admission: Admission,
    plan: Route,
    definitions: dict[str, Any],
    run_id_of: Callable[[PlannedRun], RunId],
) -> tuple[Route, tuple[CutRun, ...]]:
    kept: list[PlannedRun] = []
    cut: list[CutRun] = []
    for planned in plan.runs:
        run_id = run_id_of(planned)
        definition = WorkflowDef.model_validate(definitions[planned.version])
        why = admission.admit(str(run_id), definition, uow)
        if why is None:
            kept.append(planned)
            continue
        cut.append(_cut(planned, run_id, why, definition))
        if planned.purpose is Purpose.WORK:  # the task is refused whole
            for other in kept:
                admission.release(str(run_id_of(other)))
            cut = [_cut(p, run_id_of(p), why, None, definitions) for p in plan.runs]
            return dataclasses.replace(plan, runs=()), tuple(cut)
    return dataclasses.replace(plan, runs=tuple(kept)), tuple(cut)


def _cut(
    planned: PlannedRun,
    run_id: RunId,
    why: str,
    definition: WorkflowDef | None,
    definitions: dict[str, Any] | None = None,
) -> CutRun:
    if definition is None:
        assert definitions is not None
        definition = WorkflowDef.model_validate(definitions[planned.version])
    return CutRun(
        run_id=run_id,
        workflow_version=planned.version,
        role=planned.role,
        purpose=planned.purpose,
        reason=CutReason.CAPACITY,
        calls=definition.budget.max_model_calls,
        detail=why,
    )


def announce_refused(
    uow: UnitOfWork[Any],
    msg: TaskSubmitted,
    task_id: TaskId,
    held_out: bool,
    baseline: str | None,
    gone: CutRun,
) -> None:
    """Tell observers a run was refused at admission; a refused work run gives the task
    its one result, cancelled."""
    ref = RunRef(
        tenant=msg.tenant,
        run_id=gone.run_id,
        task_id=task_id,
        idempotency_key=msg.idempotency_key,
        workflow_id=msg.workflow_id,
        workflow_version=gone.workflow_version,
        role=gone.role,
        purpose=gone.purpose,
        baseline_version=baseline if gone.role is Role.CHALLENGER else None,
        reference_expected=False,
        held_out=held_out,
    )
    uow.emit(RUN_STATUS, RunStatusChanged(run=ref, state=RunState.CANCELLED, detail=gone.detail))
    if gone.purpose is not Purpose.WORK:
        return
    uow.emit(
        RESULTS,
        RunResult(
            tenant=msg.tenant,
            run_id=gone.run_id,
            task_id=task_id,
            idempotency_key=msg.idempotency_key,
            workflow_id=msg.workflow_id,
            workflow_version=gone.workflow_version,
            status="cancelled",
            passed=False,
            verification=[],
            score=None,
            usage=Usage(),
            termination="cancelled",
            held_out=held_out,
        ),
    )
