"""Aggregate: `assay.graded` (keyed by version: shuffle 2) -> `assay.aggregates`.

Folds each challenger's comparisons into its `WinRecord` against the current
version, and every version's verifier pass rate. Judge verdicts and
verifier-decided pairs stay apart; `Capped` is counted, never averaged.

`Ranked` scores (tournament, deterministic) are folded as running sums of their
deltas from control, so a variant's strength is the mean of like-for-like deltas
with a t interval over them (§11.2). A `Ranked` from a group without control is
counted as unanchored and never averaged in.
"""

from __future__ import annotations

import math
from typing import ClassVar

from pydantic import Field
from scipy.stats import t as student_t

from assay.bus.topics import AGGREGATES, GRADED
from assay.kernel import RunId, WorkflowId, WorkflowVersion
from assay.kernel.scores import Capped, Ranked, Relative, WinRecord
from assay.messages import Role, RunGraded, StrengthSummary, VariantAggregate
from assay.record import BranchKey, Event, EventRegistry, LogRecord, Put, StateDelta, StateKey
from assay.runtime import StageDeps, StageSpec, UnitOfWork


class VersionTallied(Event):
    """A graded run was folded into its version's tallies (totals after it)."""

    type: ClassVar[str] = "VersionTallied"
    version: ClassVar[int] = 1
    run_id: RunId = Field(description="The graded run.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="Version.")
    runs: int = Field(ge=0, description="Graded runs of the version so far.")
    passes: int = Field(ge=0, description="Of which passed verification.")
    baseline_version: WorkflowVersion | None = Field(None, description="For a challenger.")
    record: WinRecord | None = Field(None, description="Challenger's record so far.")
    ranked: dict[str, float] | None = Field(
        None,
        description="Anchored Ranked deltas so far: `n`, `sum`, `sumsq`, and `unanchored`.",
    )


AGGREGATE_EVENTS = EventRegistry([VersionTallied])


def summarise(ranked: dict[str, float]) -> StrengthSummary:
    """The mean anchored delta with a 95% t interval (a point below two episodes)."""
    n, total, sumsq = int(ranked["n"]), ranked["sum"], ranked["sumsq"]
    mean = total / n if n else 0.0
    if n < 2:
        interval = (mean, mean)
    else:
        var = max(sumsq - n * mean * mean, 0.0) / (n - 1)
        half = float(student_t.ppf(0.975, n - 1)) * math.sqrt(var / n)
        interval = (mean - half, mean + half)
    return StrengthSummary(
        episodes=n, mean=mean, interval=interval, unanchored=int(ranked["unanchored"])
    )


def fold_aggregate(record: LogRecord) -> list[StateDelta]:
    """One tally document per version."""
    match record.event:
        case VersionTallied() as e:
            return [
                Put(
                    StateKey(record.key.tenant, "version", e.workflow_version),
                    {
                        "workflow_id": e.workflow_id,
                        "runs": e.runs,
                        "passes": e.passes,
                        "baseline": e.baseline_version,
                        "record": e.record.model_dump(mode="json") if e.record else None,
                        "ranked": e.ranked,
                    },
                )
            ]
    return []


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the aggregate stage."""

    async def on_graded(msg: RunGraded, uow: UnitOfWork) -> None:
        r = msg.run
        doc = await uow.get("version", r.workflow_version) or {}
        runs, passes = doc.get("runs", 0) + 1, doc.get("passes", 0) + int(msg.passed)
        record = WinRecord.model_validate(doc["record"]) if doc.get("record") else None
        baseline = doc.get("baseline")
        ranked: dict[str, float] | None = doc.get("ranked")
        comparable = r.role is Role.CHALLENGER and r.baseline_version is not None
        if comparable and (baseline is None or baseline == r.baseline_version):
            baseline = r.baseline_version
            record = record or WinRecord()
            match msg.score:
                case Relative(outcome=outcome, decided_by=by):
                    record = record.add(outcome, by)
                case Capped():
                    record = record.model_copy(update={"capped": record.capped + 1})
                case Ranked(strength=delta, anchored=anchored):
                    ranked = dict(ranked or {"n": 0, "sum": 0.0, "sumsq": 0.0, "unanchored": 0})
                    if anchored:
                        ranked["n"] += 1
                        ranked["sum"] += delta
                        ranked["sumsq"] += delta * delta
                    else:
                        ranked["unanchored"] += 1
                case _:
                    comparable = False
        else:
            comparable = False
        uow.record(
            BranchKey.main(uow.tenant, f"version:{r.workflow_version}"),
            VersionTallied(
                run_id=r.run_id,
                workflow_id=r.workflow_id,
                workflow_version=r.workflow_version,
                runs=runs,
                passes=passes,
                baseline_version=baseline,
                record=record,
                ranked=ranked,
            ),
        )
        if comparable and record is not None and baseline is not None:
            uow.emit(
                AGGREGATES,
                VariantAggregate(
                    tenant=r.tenant,
                    workflow_id=r.workflow_id,
                    workflow_version=r.workflow_version,
                    baseline_version=baseline,
                    record=record,
                    runs=runs,
                    passes=passes,
                    strength=summarise(ranked) if ranked else None,
                ),
            )

    return StageSpec(
        name="aggregate",
        events=AGGREGATE_EVENTS,
        fold=fold_aggregate,
        handlers={GRADED: {RunGraded.type: on_graded}},
    )
