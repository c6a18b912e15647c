"""Aggregate: `assay.graded` (keyed by version: shuffle 2) -> `assay.aggregates`.

Folds each challenger's comparisons into its `WinRecord` against the current
version, and every version's verifier pass rate. Judge verdicts and
verifier-decided pairs stay apart; `Capped` is counted, never averaged.

`Ranked` scores (tournament, deterministic) are folded as running sums of their
deltas from control, so a variant's strength is the mean of like-for-like deltas
with a t interval over them (§11.2); each anchored delta also counts in the win
record by its sign, so the sequential test runs on every strategy. A `Ranked`
from a group without control is counted as unanchored and never averaged in.

Every measure is kept twice (§12.5): on selection tasks — the evidence decide's
gates read — and on held-out tasks, which only the report of the gap between
the two reads. Each challenger run publishes its evidence (`VariantAggregate`),
with the baseline's pass rate beside it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from assay.bus.topics import AGGREGATES
from assay.kernel import RunId, WorkflowId, WorkflowVersion
from assay.kernel.scores import Capped, WinRecord
from assay.messages import Purpose, RunGraded, VariantAggregate
from assay.messages.proposals import FAILURES_KEPT, FailureEvidence, as_evidence
from assay.record import BranchKey, Event, EventRegistry, LogRecord, StateDelta
from assay.record.compaction import Compacted, with_compaction
from assay.record.erasure import TenantErased
from assay.runtime import Gauge, StageDeps, StageSpec, UnitOfWork, routes
from assay.store import EventLog
from assay_aggregate.tallies import Failures, HeldOutTallies, RankedSums, Tally

AggregateUnitOfWork = UnitOfWork[None]
"""Aggregate's handler shares nothing but its state."""


class VersionTallied(Event):
    """A graded run was folded into its version's tallies (totals after it).

    Version 2 keeps the held-out tasks apart (`held_out`; the other measures count
    selection tasks only) and adds what the ladder reads: screened and served
    episodes and the judge's order checks.
    """

    type: ClassVar[str] = "VersionTallied"
    version: ClassVar[int] = 2
    run_id: RunId = Field(description="The graded run.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    workflow_version: WorkflowVersion = Field(description="Version.")
    runs: int = Field(ge=0, description="Graded runs of the version so far, every task.")
    passes: int = Field(ge=0, description="Of which passed verification.")
    baseline_version: WorkflowVersion | None = Field(None, description="For a challenger.")
    record: WinRecord | None = Field(None, description="Challenger's record so far (selection).")
    ranked: dict[str, float] | None = Field(
        None,
        description=(
            "Anchored Ranked deltas so far (selection): `n`, `sum`, `sumsq`, and `unanchored`."
        ),
    )
    screened: int = Field(
        0, ge=0, description="v2: challenger selection episodes past the Core screen."
    )
    served: int = Field(0, ge=0, description="v2: of which served a live task.")
    order_checked: int = Field(0, ge=0, description="v2: its selection comparisons order-checked.")
    order_inconsistent: int = Field(0, ge=0, description="v2: of which the judge was inconsistent.")
    held_out: dict[str, Any] | None = Field(
        None,
        description=(
            "v2: the version's tallies on held-out tasks: `runs`, `passes`, and for a "
            "challenger `record` and `ranked`."
        ),
    )
    judge_calls: int | None = Field(
        None, ge=0, description="Judge calls billed grading its runs (None: not yet counted)."
    )
    judge_micro_usd: int | None = Field(
        None, ge=0, description="What they cost, in micro-dollars (None: not yet counted)."
    )


class FailuresKept(Event):
    """A selection-set run of the version failed (verification, or a Core violation):
    the version's most recent failures, this one last. Held-out runs never get here
    (§12.5: the proposer, which reads these, must not see the held-out set)."""

    type: ClassVar[str] = "FailuresKept"
    version: ClassVar[int] = 1
    workflow_version: WorkflowVersion = Field(description="Version.")
    failures: list[FailureEvidence] = Field(
        max_length=FAILURES_KEPT, description="Its latest selection-set failures, oldest first."
    )


AGGREGATE_EVENTS = EventRegistry([TenantErased, VersionTallied, FailuresKept, Compacted])


@AGGREGATE_EVENTS.upcaster("VersionTallied", 1)
def _version_tallied_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 knew no held-out set and counted nothing for the ladder."""
    return {
        **payload,
        "screened": 0,
        "served": 0,
        "order_checked": 0,
        "order_inconsistent": 0,
        "held_out": None,
    }


def fold_aggregate(record: LogRecord) -> list[StateDelta]:
    """One tally document per version, and its latest failures."""
    t = record.key.tenant
    match record.event:
        case VersionTallied() as e:
            held = e.held_out
            tally = Tally(
                workflow_id=e.workflow_id,
                runs=e.runs,
                passes=e.passes,
                baseline=e.baseline_version,
                record=e.record,
                ranked=RankedSums.model_validate(e.ranked) if e.ranked is not None else None,
                screened=e.screened,
                served=e.served,
                order_checked=e.order_checked,
                order_inconsistent=e.order_inconsistent,
                held_out=HeldOutTallies.model_validate(held) if held is not None else None,
                judge_calls=e.judge_calls,
                judge_micro_usd=e.judge_micro_usd,
            )
            return [tally.put(t, e.workflow_version)]
        case FailuresKept() as e:
            return [Failures(failures=e.failures).put(t, e.workflow_version)]
    return []


async def on_run_graded(msg: RunGraded, uow: AggregateUnitOfWork) -> None:
    """Fold the graded run into its version's tallies; a challenger's run publishes its
    evidence against the baseline, with both versions' latest failures.

    A fork of a run (a rewind's branch, a branch command's child: `RunRef.branch`) is
    graded, but never tallied: its task is already counted once by branch 0, and a
    child's deltas make it another workflow than the version it names — counting it
    would sample a task twice and bias the sequential test (§12). Nor is a replay
    tournament's candidate (purpose `replay`): it is ranked within its group, and its
    variant may be no registered version at all.
    """
    r = msg.run
    if r.branch is not None or r.purpose is Purpose.REPLAY:
        return
    before = await uow.get(Tally, r.workflow_version) or Tally.empty(r.workflow_id)
    tally, challenger = before.with_run(msg)
    uow.record(_stream(uow, r.workflow_version), _tallied(msg, tally))
    failures = await _failures(uow, r.workflow_version)
    if (not msg.passed or isinstance(msg.score, Capped)) and not r.held_out:
        failures = _keep_failure(uow, msg, failures)
    if not challenger or tally.baseline is None:
        return
    base = await uow.get(Tally, tally.baseline)
    baseline_failures = await _failures(uow, tally.baseline)
    evidence = _evidence(msg, tally, tally.baseline, base, [*baseline_failures, *failures])
    uow.emit(AGGREGATES, evidence)


def _evidence(
    msg: RunGraded,
    tally: Tally,
    baseline: WorkflowVersion,
    base: Tally | None,
    failures: list[FailureEvidence],
) -> VariantAggregate:
    """The challenger's evidence against its `baseline` (tallied as `base`), after
    `msg` was tallied; `failures` are the baseline's latest, then the challenger's."""
    r = msg.run
    runs, passes = tally.selection()
    base_runs, base_passes = base.selection() if base else (0, 0)
    return VariantAggregate(
        tenant=r.tenant,
        workflow_id=r.workflow_id,
        workflow_version=r.workflow_version,
        baseline_version=baseline,
        record=tally.record or WinRecord(),
        runs=runs,
        passes=passes,
        strength=tally.ranked.summary() if tally.ranked else None,
        baseline_runs=base_runs,
        baseline_passes=base_passes,
        held_out=tally.held_out_beside(base),
        failures=failures,
        screened=tally.screened,
        served=tally.served,
        order_checked=tally.order_checked,
        order_inconsistent=tally.order_inconsistent,
    )


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the aggregate stage."""
    return StageSpec(
        name="aggregate",
        events=AGGREGATE_EVENTS,
        fold=with_compaction(fold_aggregate),
        handlers=routes(on_run_graded),
        gauges=held_out_gauges,
    )


async def held_out_gauges(log: EventLog) -> list[Gauge]:
    """§12.5's overfitting alarm, per (tenant, workflow, version): the verifier pass rate
    on selection tasks minus that on held-out tasks (once both have a graded run), and
    the graded runs on each side it is measured over."""
    gaps: list[tuple[tuple[str, ...], float]] = []
    runs: list[tuple[tuple[str, ...], float]] = []
    for tenant, version, doc in sorted(await log.scan_kind(Tally.kind), key=lambda r: r[:2]):
        tally = Tally.model_validate(doc)
        labels = (str(tenant), str(tally.workflow_id), version)
        sel_runs, sel_passes = tally.selection()
        held = tally.held_out or HeldOutTallies()
        runs += [((*labels, "selection"), sel_runs), ((*labels, "held_out"), held.runs)]
        if sel_runs and held.runs:
            gaps.append((labels, sel_passes / sel_runs - held.passes / held.runs))
    return [
        Gauge(
            "assay_held_out_gap",
            "Verifier pass rate on selection tasks minus on held-out tasks, per version "
            "(positive: held-out tasks do worse; a widening gap is the overfitting alarm).",
            ("tenant", "workflow", "version"),
            tuple(gaps),
        ),
        Gauge(
            "assay_graded_runs",
            "Graded runs of a version, on selection and on held-out tasks.",
            ("tenant", "workflow", "version", "split"),
            tuple(runs),
        ),
    ]


def _stream(uow: AggregateUnitOfWork, version: WorkflowVersion) -> BranchKey:
    return BranchKey.main(uow.tenant, f"version:{version}")


def _tallied(msg: RunGraded, tally: Tally) -> VersionTallied:
    r = msg.run
    return VersionTallied(
        run_id=r.run_id,
        workflow_id=r.workflow_id,
        workflow_version=r.workflow_version,
        runs=tally.runs,
        passes=tally.passes,
        baseline_version=tally.baseline,
        record=tally.record,
        ranked=tally.ranked.model_dump() if tally.ranked else None,
        screened=tally.screened,
        served=tally.served,
        order_checked=tally.order_checked,
        order_inconsistent=tally.order_inconsistent,
        held_out=tally.held_out.model_dump(mode="json") if tally.held_out else None,
        judge_calls=tally.judge_calls,
        judge_micro_usd=tally.judge_micro_usd,
    )


async def _failures(uow: AggregateUnitOfWork, version: WorkflowVersion) -> list[FailureEvidence]:
    """The version's latest selection-set failures, oldest first."""
    kept = await uow.get(Failures, version)
    return list(kept.failures) if kept else []


def _keep_failure(
    uow: AggregateUnitOfWork, msg: RunGraded, kept: list[FailureEvidence]
) -> list[FailureEvidence]:
    """Keep a failed selection-set run as evidence beside `kept`; only the newest
    `FAILURES_KEPT` stay. The failures after it."""
    r = msg.run
    if any(f.run_id == r.run_id for f in kept):
        return kept
    capped = msg.score.violations if isinstance(msg.score, Capped) else []
    evidence = as_evidence(
        r.run_id, r.task_id, r.workflow_version, msg.failed_checks, capped, msg.step_credit
    )
    kept = [*kept, evidence][-FAILURES_KEPT:]
    uow.record(
        _stream(uow, r.workflow_version),
        FailuresKept(workflow_version=r.workflow_version, failures=kept),
    )
    return kept
