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

import math
from typing import Any, ClassVar

from pydantic import Field

from assay.bus.topics import AGGREGATES, GRADED
from assay.kernel import RunId, WorkflowId, WorkflowVersion
from assay.kernel.scores import (
    Capped,
    DecidedBy,
    Outcome,
    Ranked,
    Relative,
    Score,
    Ungraded,
    UngradedReason,
    WinRecord,
)
from assay.messages import (
    HeldOutTally,
    Purpose,
    Role,
    RunGraded,
    StrengthSummary,
    VariantAggregate,
)
from assay.messages.proposals import FAILURES_KEPT, FailureEvidence, as_evidence
from assay.record import BranchKey, Event, EventRegistry, LogRecord, Put, StateDelta, StateKey
from assay.runtime import Gauge, StageDeps, StageSpec, UnitOfWork
from assay.store import EventLog

SCREENED_CLEAN = frozenset(
    {
        UngradedReason.NO_REFERENCE,
        UngradedReason.BASELINE,
        UngradedReason.INSUFFICIENT_GROUP,
        UngradedReason.NO_METRIC,
    }
)
"""`Ungraded` reasons that come after the `Core` screen passed (or had nothing to screen);
a judge failure, a spent budget or a missing episode may not have been screened at all."""


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


AGGREGATE_EVENTS = EventRegistry([VersionTallied, FailuresKept])


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


def summarise(ranked: dict[str, float]) -> StrengthSummary:
    """The mean anchored delta with a 95% t interval (a point below two episodes)."""
    n, total, sumsq = int(ranked["n"]), ranked["sum"], ranked["sumsq"]
    mean = total / n if n else 0.0
    if n < 2:
        interval = (mean, mean)
    else:
        var = max(sumsq - n * mean * mean, 0.0) / (n - 1)
        # Imported here: scipy.special costs a stage ~30 MB resident, and only tournament or
        # deterministic grading (Ranked deltas) ever needs the t quantile.
        from scipy.special import stdtrit

        half = float(stdtrit(n - 1, 0.975)) * math.sqrt(var / n)
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
                        "screened": e.screened,
                        "served": e.served,
                        "order_checked": e.order_checked,
                        "order_inconsistent": e.order_inconsistent,
                        "held_out": e.held_out,
                    },
                )
            ]
        case FailuresKept() as e:
            return [
                Put(
                    StateKey(record.key.tenant, "failures", e.workflow_version),
                    {"failures": [f.model_dump(mode="json") for f in e.failures]},
                )
            ]
    return []


def selection_runs(doc: dict[str, Any]) -> tuple[int, int]:
    """(runs, passes) of a tally document on selection tasks."""
    held = doc.get("held_out") or {}
    return (
        int(doc.get("runs", 0)) - int(held.get("runs", 0)),
        int(doc.get("passes", 0)) - int(held.get("passes", 0)),
    )


class _Evidence:
    """A challenger's record and anchored deltas on one side of the split, as one run
    changes them."""

    def __init__(self, record: dict[str, Any] | None, ranked: dict[str, float] | None) -> None:
        self.record = WinRecord.model_validate(record) if record else None
        self.ranked = ranked

    def add(self, score: Score) -> None:
        """Fold one score (an `Ungraded` is not a comparison: nothing changes)."""
        record = self.record or WinRecord()
        match score:
            case Relative(outcome=outcome, decided_by=by):
                record = record.add(outcome, by)
            case Capped():
                record = record.model_copy(update={"capped": record.capped + 1})
            case Ranked(strength=delta, anchored=anchored):
                ranked = dict(self.ranked or {"n": 0, "sum": 0.0, "sumsq": 0.0, "unanchored": 0})
                if anchored:
                    ranked["n"] += 1
                    ranked["sum"] += delta
                    ranked["sumsq"] += delta * delta
                    sign = Outcome.WIN if delta > 0 else Outcome.LOSS if delta < 0 else Outcome.DRAW
                    record = record.add(sign, DecidedBy.JUDGE)
                else:
                    ranked["unanchored"] += 1
                self.ranked = ranked
            case Ungraded():
                return
        self.record = record


def _screened(score: Score) -> bool:
    """The episode passed the Core screen (or had nothing to screen) and was graded."""
    if isinstance(score, Ungraded):
        return score.reason in SCREENED_CLEAN
    return not isinstance(score, Capped)


def create_stage(deps: StageDeps) -> StageSpec:
    """Wire the aggregate stage."""

    async def on_graded(msg: RunGraded, uow: UnitOfWork[Any]) -> None:
        r = msg.run
        doc = await uow.get_document("version", r.workflow_version) or {}
        runs, passes = doc.get("runs", 0) + 1, doc.get("passes", 0) + int(msg.passed)
        held: dict[str, Any] | None = doc.get("held_out")
        if r.held_out:
            held = dict(held or {"runs": 0, "passes": 0, "record": None, "ranked": None})
            held["runs"] += 1
            held["passes"] += int(msg.passed)
        selection = _Evidence(doc.get("record"), doc.get("ranked"))
        counts = {
            k: int(doc.get(k, 0))
            for k in ("screened", "served", "order_checked", "order_inconsistent")
        }
        baseline = doc.get("baseline")
        challenger = r.role is Role.CHALLENGER and r.baseline_version is not None
        if challenger and (baseline is None or baseline == r.baseline_version):
            baseline = r.baseline_version
            if r.held_out:
                assert held is not None
                side = _Evidence(held["record"], held["ranked"])
                side.add(msg.score)
                held["record"] = (side.record or WinRecord()).model_dump(mode="json")
                held["ranked"] = side.ranked
            else:
                selection.add(msg.score)
                selection.record = selection.record or WinRecord()
                if _screened(msg.score):
                    counts["screened"] += 1
                    counts["served"] += int(r.purpose is Purpose.WORK)
                if isinstance(msg.score, Relative) and msg.score.order_consistent is not None:
                    counts["order_checked"] += 1
                    counts["order_inconsistent"] += int(not msg.score.order_consistent)
        else:
            challenger = False
        uow.record(
            BranchKey.main(uow.tenant, f"version:{r.workflow_version}"),
            VersionTallied(
                run_id=r.run_id,
                workflow_id=r.workflow_id,
                workflow_version=r.workflow_version,
                runs=runs,
                passes=passes,
                baseline_version=baseline,
                record=selection.record,
                ranked=selection.ranked,
                held_out=held,
                **counts,
            ),
        )
        failures = await _failures(uow, r.workflow_version)
        if (not msg.passed or isinstance(msg.score, Capped)) and not r.held_out:
            failures = _keep_failure(uow, msg, failures)
        if not challenger or baseline is None:
            return
        base = await uow.get_document("version", baseline) or {}
        base_runs, base_passes = selection_runs(base)
        mine = {"runs": runs, "passes": passes, "held_out": held}
        sel_runs, sel_passes = selection_runs(mine)
        uow.emit(
            AGGREGATES,
            VariantAggregate(
                tenant=r.tenant,
                workflow_id=r.workflow_id,
                workflow_version=r.workflow_version,
                baseline_version=baseline,
                record=selection.record or WinRecord(),
                runs=sel_runs,
                passes=sel_passes,
                strength=summarise(selection.ranked) if selection.ranked else None,
                baseline_runs=base_runs,
                baseline_passes=base_passes,
                held_out=_held_out(held, base.get("held_out")),
                failures=[*await _failures(uow, baseline), *failures],
                **counts,
            ),
        )

    return StageSpec(
        name="aggregate",
        events=AGGREGATE_EVENTS,
        fold=fold_aggregate,
        handlers={GRADED: {RunGraded.type: on_graded}},
        gauges=held_out_gauges,
    )


async def held_out_gauges(log: EventLog) -> list[Gauge]:
    """§12.5's overfitting alarm, per (tenant, workflow, version): the verifier pass rate
    on selection tasks minus that on held-out tasks (once both have a graded run), and
    the graded runs on each side it is measured over."""
    gaps: list[tuple[tuple[str, ...], float]] = []
    runs: list[tuple[tuple[str, ...], float]] = []
    for tenant, version, doc in sorted(await log.scan_kind("version"), key=lambda r: r[:2]):
        labels = (str(tenant), str(doc["workflow_id"]), version)
        sel_runs, sel_passes = selection_runs(doc)
        held = doc.get("held_out") or {}
        held_runs, held_passes = int(held.get("runs", 0)), int(held.get("passes", 0))
        runs += [((*labels, "selection"), sel_runs), ((*labels, "held_out"), held_runs)]
        if sel_runs and held_runs:
            gaps.append((labels, sel_passes / sel_runs - held_passes / held_runs))
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


async def _failures(uow: UnitOfWork[Any], version: WorkflowVersion) -> list[FailureEvidence]:
    """The version's latest selection-set failures, oldest first."""
    doc = await uow.get_document("failures", version) or {"failures": []}
    return [FailureEvidence.model_validate(f) for f in doc["failures"]]


def _keep_failure(
    uow: UnitOfWork[Any], msg: RunGraded, kept: list[FailureEvidence]
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
        BranchKey.main(uow.tenant, f"version:{r.workflow_version}"),
        FailuresKept(workflow_version=r.workflow_version, failures=kept),
    )
    return kept


def _held_out(mine: dict[str, Any] | None, base: dict[str, Any] | None) -> HeldOutTally | None:
    """The challenger's held-out measures beside the baseline's, once it has any."""
    if mine is None:
        return None
    return HeldOutTally(
        runs=mine["runs"],
        passes=mine["passes"],
        record=WinRecord.model_validate(mine["record"]) if mine["record"] else WinRecord(),
        strength=summarise(mine["ranked"]) if mine["ranked"] else None,
        baseline_runs=int((base or {}).get("runs", 0)),
        baseline_passes=int((base or {}).get("passes", 0)),
    )
