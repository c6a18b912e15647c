"""What `assay ladder` and `assay grade health` say grading cost: judge calls and dollars
over a workflow's versions, per promotion decided; and the day's ledger row beside the
tenant's ceilings."""

from __future__ import annotations

from assay.cli.health import replay_report, spend_report
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


def test_replay_shows_calls_tokens_and_dollars_reserved_today_beside_its_ceilings() -> None:
    meter = {
        "day": "2026-12-02",
        "calls_today": 20,
        "tokens_today": 20_000,
        "micro_usd_today": 60_000,
        "runs_today": 2,
        "cut_today": 1,
        "cut_total": 3,
    }
    spent = [{"day": "2026-12-02", "model_calls": 4, "tokens": 900}]
    limit = SpendLimit(tokens=50_000, micro_usd=70_000)
    shown = replay_report(meter, spent, limit, "2026-12-02")
    assert (shown["calls_ceiling"], shown["tokens_ceiling"], shown["usd_ceiling"]) == (
        None,
        50_000,
        0.07,
    )
    assert (
        shown["calls_reserved_today"],
        shown["tokens_reserved_today"],
        shown["usd_reserved_today"],
    ) == (20, 20_000, 0.06)
    assert (shown["runs_admitted_today"], shown["runs_cut_today"]) == (2, 1)
    assert (shown["model_calls_today"], shown["tokens_today"]) == (4, 900)
    tomorrow = replay_report(meter, spent, limit, "2026-12-03")  # a new day reserves afresh
    assert (tomorrow["tokens_reserved_today"], tomorrow["usd_reserved_today"]) == (0, 0.0)
    before = {k: v for k, v in meter.items() if "tokens" not in k and "usd" not in k}
    assert replay_report(before, [], limit, "2026-12-02")["usd_reserved_today"] == 0.0
    unseen = replay_report(None, [], limit, "2026-12-02")  # ingest's state is not here
    assert unseen["usd_reserved_today"] is None
