"""What `assay ladder` and `assay grade health` say grading cost: judge calls and dollars
over a workflow's versions, per promotion decided; and the day's ledger row beside the
tenant's ceilings."""

from __future__ import annotations

from assay.cli.health import spend_report
from assay.cli.ladder import grading_cost
from assay.kernel.spend import Spend, SpendDay, SpendLimit


def test_grading_cost_is_summed_over_versions_and_divided_by_promotions_decided() -> None:
    tallies = [
        {"runs": 4, "judge_calls": 10, "judge_micro_usd": 250_000},
        {"runs": 6, "judge_calls": 14, "judge_micro_usd": 500_000},
        {"runs": 2},  # tallied before grading cost was counted: none
    ]
    assert grading_cost(tallies, decided=3) == {
        "judge_calls": 24,
        "judge_usd": 0.75,
        "promotions_decided": 3,
        "judge_calls_per_decision": 8.0,
        "judge_usd_per_decision": 0.25,
    }


def test_with_no_promotion_decided_there_is_no_rate() -> None:
    cost = grading_cost([{"judge_calls": 3, "judge_micro_usd": 1}], decided=0)
    assert cost["judge_usd_per_decision"] is None
    assert cost["judge_calls_per_decision"] is None
    assert cost["judge_usd"] == 0.000001


def test_the_days_spend_shows_what_is_held_beside_the_ceilings() -> None:
    day = SpendDay(spent=Spend.of(7, 9000, 1.25), held=Spend.of(1, 8192, 0.2))
    assert spend_report(day, SpendLimit(calls=100, micro_usd=2_000_000), "2026-12-02") == {
        "day": "2026-12-02",
        "calls": 7,
        "tokens": 9000,
        "usd": 1.25,
        "held": {"calls": 1, "tokens": 8192, "usd": 0.2},
        "ceiling": {"calls": 100, "tokens": None, "usd": 2.0},
    }
