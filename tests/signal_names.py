"""The metric families that carry DESIGN §15's signals, and the stage processes that
export each (docs/operations/metrics.md lists them; the embedded, distributed and docs
tests check against this one list)."""

from __future__ import annotations

EVERY_STAGE = (
    "assay_run_transitions_total",
    "assay_stage_lag",
    "assay_indeterminate_attempts_total",
    "assay_runs_graded_total",
    "assay_runs_ungraded_total",
    "assay_judge_order_checks_total",
    "assay_handler_seconds",
    "assay_task_to_result_seconds",
    "assay_spend_usd_total",
    "assay_model_tokens_total",
)
"""Counted by whichever stage commits the fact: every stage process exports the family."""

STAGE_SIGNALS: dict[str, tuple[str, ...]] = {
    "ingest": ("assay_admission_refusals",),
    "execute": ("assay_retention_tiering_due",),
    "verify": (),
    "tournament": (
        "assay_tournament_groups_open",
        "assay_tournament_runs_waiting",
        "assay_tournament_runs_parked",
        "assay_judge_verifier_agreement",
        "assay_judge_calibration_order_inconsistency",
        "assay_judge_calibration_orderings",
        "assay_judge_calibration_min_agreement",
        "assay_judge_calibration_min_judged",
    ),
    "aggregate": ("assay_held_out_gap", "assay_graded_runs"),
    "decide": ("assay_ladder_max_order_inconsistency",),
}
"""Derived from one stage's state or settings: only that stage's process exports them."""

SECTION_15 = EVERY_STAGE + tuple(name for names in STAGE_SIGNALS.values() for name in names)
"""Every family that carries a §15 signal; one embedded process exports them all."""
