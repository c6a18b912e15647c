"""The grading ceiling in calls, tokens and dollars (§14.1): every judge call is reserved
at its worst case in the tournament's spend ledger before it is made, so handlers on
several partitions at once never pass the tenant's dollars for the day; a tournament
group that does not fit whole plays fewer rounds before it is not played at all."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

from assay.bus import GRADED, USAGE
from assay.devstack import Service
from assay.devstack.postgres import scratch_database
from assay.engine import Prices
from assay.grading.strategies import GradingPolicy
from assay.kernel.ids import tenant_id
from assay.kernel.scores import Ranked, Relative, Ungraded, UngradedReason, Verdict
from assay.kernel.spend import MICRO, Spend, SpendLimit
from assay.messages import RunGraded, UsageRecorded, open_envelope
from assay.record import BranchKey
from assay_tournament.events import GroupClosed
from assay_tournament.purse import GRADING, worst_call
from services.tournament.tests.test_judge_spend import PAIRWISE, TWO_FAILED_ATTEMPTS
from services.tournament.tests.tournament_harness import (
    OTHER,
    T1,
    T2,
    TENANT,
    ScriptedJudge,
    Stage,
    challenger,
    closed,
    current,
    deliver,
    open_stage,
    pinned,
    sibling,
    task_id,
)

# -- the policy -------------------------------------------------------------------------------


def test_the_grading_policy_reads_token_and_dollar_ceilings_with_per_tenant_overrides() -> None:
    policy = GradingPolicy.model_validate(
        {
            "calls_per_day": 50,
            "usd_per_day": 2.5,
            "tokens_per_day": 90_000,
            "usd_ceilings": f"{OTHER}=0.75",
            "token_ceilings": f"{OTHER}=1000",
        }
    )
    assert policy.limit_for(str(TENANT)) == SpendLimit(50, 90_000, 2_500_000)
    assert policy.limit_for(str(OTHER)) == SpendLimit(50, 1000, 750_000)
    assert GradingPolicy().limit_for(str(TENANT)) == SpendLimit(calls=100_000)


@pytest.mark.parametrize(
    ("field", "value", "names"),
    [
        ("usd_ceilings", f"{TENANT}=lots", "not a dollar amount"),
        ("usd_ceilings", f"{TENANT}=-1", "not a dollar amount >= 0"),
        ("usd_ceilings", "acme=1", "not a tenant UUID"),
        ("usd_per_day", -1, "greater than or equal to 0"),
        ("token_ceilings", f"{TENANT}=0", "whole number >= 1"),
    ],
)
def test_a_bad_ceiling_is_refused_naming_the_field(field: str, value: object, names: str) -> None:
    with pytest.raises(ValidationError, match=names) as caught:
        GradingPolicy.model_validate({field: value})
    assert field in str(caught.value)


def test_a_calls_worst_case_is_the_judges_context_at_its_dearer_price() -> None:
    judge = ScriptedJudge(prices=Prices(prompt_per_mtok=3.0, completion_per_mtok=15.0))
    assert worst_call(judge) == Spend(1, 8192, 122_880)  # 8192 tokens at $15 per million
    assert worst_call(ScriptedJudge()) == Spend(1, 8192, 0)  # no prices: free


# -- concurrency ------------------------------------------------------------------------------

DOLLARS = GradingPolicy(order_check=0.0, usd_per_day=1.0)
"""$1 a day; each call reserves $0.2048 (8192 tokens at $25 per million), costs $0.15."""


@pytest.fixture(scope="module")
def ceiling_database(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_ceiling") as dsn:
        yield dsn


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_handlers_on_four_partitions_never_pass_the_dollar_ceiling(
    tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    dsn = str(request.getfixturevalue("ceiling_database")) if store == "postgres" else None
    async with open_stage(tmp_path, DOLLARS, postgres=dsn) as stage:
        stage.judge.prices = Prices(prompt_per_mtok=25.0, completion_per_mtok=25.0)
        stage.judge.cost_usd = 0.15
        tasks = [task_id(100 + n) for n in range(12)]
        for t in tasks:
            await stage.verified(current(t))
        stage.judge.pause_s = 0.02  # calls in flight while the other partitions reserve
        outs = await asyncio.gather(
            *(stage.verified(challenger(t), partition=n % 4) for n, t in enumerate(tasks))
        )
        # concurrent drains mix (and on Postgres may repeat) rows: each message once, by id
        once = {open_envelope(e.value).id: e for out in outs for e in out.entries}
        decoded = [(e.topic, open_envelope(e.value)) for e in once.values()]
        scores = [
            RunGraded.model_validate(env.payload).score for topic, env in decoded if topic == GRADED
        ]
        assert len(scores) == 12
        billed = sum(
            UsageRecorded.model_validate(env.payload).cost_usd
            for topic, env in decoded
            if topic == USAGE
        )
        ledger = await stage.log.spend_of(TENANT, GRADING, _today(stage))
    assert billed <= 1.0
    assert ledger.held == Spend()
    assert ledger.spent.micro_usd == round(billed * MICRO)
    judged = [s for s in scores if isinstance(s, Relative)]
    refused = [s for s in scores if s == Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED)]
    # at most six: after six calls ($0.90) a seventh's worst case ($0.2048) passes $1
    assert 1 <= len(judged) <= 6
    assert len(judged) + len(refused) == 12
    # (a ceiling that only counted billed calls let four partitions' calls in at once,
    # and the next four, and so on: twelve calls, $1.80)


def _today(stage: Stage) -> str:
    """The UTC day the handlers reserved for (their messages occurred now)."""
    return datetime.now(UTC).date().isoformat()


# -- downsampling ----------------------------------------------------------------------------


async def _group_of_four(stage: Stage, n: int) -> tuple[list[object], GroupClosed]:
    t = task_id(n)
    runs = [pinned(current(t), T1)] + [pinned(challenger(t, f"c{i}"), T2) for i in range(3)]
    stage.judge.verdicts = [Verdict.A] * 8
    out = None
    for run, text in zip(runs, ["xx", "x", "xxxx", "xxx"], strict=True):
        out = await deliver(stage, run, T1 if run.role.value == "current" else T2, text)
    assert out is not None
    records = await stage.log.read(BranchKey.main(TENANT, f"task:{t}"))
    (closed,) = [r.event for r in records if isinstance(r.event, GroupClosed)]
    return [g.score for g in out.graded()], closed


async def test_a_group_the_ceiling_cannot_hold_whole_plays_fewer_rounds(tmp_path: Path) -> None:
    """Four members: 2 Swiss rounds of 2 pairs in both orders (8 calls); 5 fit: 1 round."""
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0, calls_per_day=5)) as stage:
        scores, closed = await _group_of_four(stage, 200)
        assert len(stage.judge.compared) == 4
    assert (closed.rounds_planned, closed.rounds_played) == (2, 1)
    assert closed.judge_calls == 4
    assert len(scores) == 4
    assert all(isinstance(s, Ranked) for s in scores)


async def test_a_group_not_one_round_fits_is_ungraded_and_says_so(tmp_path: Path) -> None:
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0, calls_per_day=3)) as stage:
        scores, closed = await _group_of_four(stage, 201)
        assert stage.judge.compared == []
        ledger = await stage.log.spend_of(TENANT, GRADING, _today(stage))
    assert (closed.rounds_planned, closed.rounds_played) == (2, 0)
    assert scores == [Ungraded(reason=UngradedReason.BUDGET_EXHAUSTED)] * 4
    assert ledger.committed == Spend()  # the screens held and released; nothing spent


async def test_every_tenant_reserves_from_its_own_row(tmp_path: Path) -> None:
    """One tenant's spent ceiling does not refuse another tenant's call."""
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0, calls_per_day=1)) as stage:
        t = task_id(300)
        await stage.verified(current(t))
        stage.judge.verdicts = [Verdict.A]
        assert isinstance((await stage.verified(challenger(t))).graded()[0].score, Relative)
        row = await stage.log.spend_of(TENANT, GRADING, _today(stage))
        other = await stage.log.spend_of(OTHER, GRADING, _today(stage))
        stranger = await stage.log.spend_of(tenant_id(uuid.uuid4()), GRADING, _today(stage))
    assert row.spent.calls == 1
    assert other.committed == stranger.committed == Spend()


# -- what grading a run cost -------------------------------------------------------------------


async def test_a_grade_says_what_its_judge_calls_cost_even_across_parking(
    tmp_path: Path,
) -> None:
    """The screen billed while the challenger waited for its reference, and the comparison
    after: its `RunGraded` reports both, as `assay.usage` did."""
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0)) as stage:
        stage.judge.screen_usage = True
        stage.judge.cost_usd = 0.01
        t = task_id(400)
        chal = challenger(t, reference_expected=True)
        early = await stage.verified(chal)  # screened ($0.0001), then parked
        stage.judge.verdicts = [Verdict.A]
        late = await stage.verified(current(t))  # compared ($0.01)
        parked = await stage.log.scan(TENANT, "parked")
    graded = next(g for g in late.graded() if g.run.run_id == chal.run_id)
    billed = [u.cost_usd for out in (early, late) for u in out.usage() if u.run_id == chal.run_id]
    assert sorted(billed) == [0.0001, 0.01]
    assert graded.judge_cost_usd == pytest.approx(0.0101)
    assert parked == []


async def test_attempts_the_ceiling_cannot_rank_whole_are_not_ranked_nor_failed(
    tmp_path: Path,
) -> None:
    """Two failed attempts of a step take one round judged both ways: two calls; one fits."""
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0, calls_per_day=1)) as stage:
        run = current(task_id(500)).model_copy(update={"workflow_version": PAIRWISE.version})
        out = await deliver(stage, run, PAIRWISE, "5", attempts=TWO_FAILED_ATTEMPTS)
        row = await stage.log.spend_of(TENANT, GRADING, _today(stage))
    (graded,) = out.graded()
    assert stage.judge.compared == []
    assert (graded.attempt_ranks, graded.unranked_attempts) == ([], [])
    assert graded.judge_failures == 0  # a spent budget is not the judge's failure
    assert row.committed == Spend()


@pytest.mark.parametrize(("calls", "rounds"), [(5, 1), (3, 0)])
async def test_a_rollout_selection_is_downsampled_before_it_falls_back_to_the_index(
    tmp_path: Path, calls: int, rounds: int
) -> None:
    """Four siblings: 2 rounds of 2 pairs both ways (8 calls); 5 calls hold one round
    (its two winners tie: the lower index breaks it), 3 hold none."""
    async with open_stage(tmp_path, GradingPolicy(order_check=0.0, calls_per_day=calls)) as stage:
        t = task_id(600 + calls)
        runs = [sibling(t, i) for i in range(4)]
        for i, run in enumerate(runs):
            await stage.verified(run, output="x" * (i + 1))
        stage.judge.prefer_longer = True
        out = await stage.deliver(closed(t, runs))
        (result,) = out.rollout_results()
    assert len(stage.judge.compared) == 4 * rounds
    assert (result.selection.judge_calls, result.selection.judge_failures) == (4 * rounds, 0)
    assert result.selection.decided_by == "index"
    if rounds == 0:
        assert "grading ceiling holds not one round" in result.selection.evidence
        assert result.winner == runs[0].run_id
    else:
        assert "Bradley-Terry strengths" in result.selection.evidence
