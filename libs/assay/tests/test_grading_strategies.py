"""Strategy profiles, the deterministic grader, attempt credit and one group's tournament."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from assay.grading.attempts import grade_attempts, step_credit
from assay.grading.deterministic import deterministic_rank, metric_value
from assay.grading.judges import JudgeFailed, JudgeUsage, StubJudge, UsageCallback
from assay.grading.strategies import (
    GradingCapacity,
    StrategyRefused,
    check_fits,
    profile,
    tournament_calls_per_episode,
)
from assay.grading.tournament import Bout, Entrant, run_tournament
from assay.kernel import AttemptNo, AttemptState, StepId, TaskId, new_run_id
from assay.kernel.ids import TenantId, WorkflowId, WorkflowVersion
from assay.kernel.scores import CoreViolation, Ranked, Ungraded, UngradedReason, Verdict
from assay.messages import AttemptView, Episode, Purpose, Role, RunRef, Usage
from assay.workflow import GradingSpec, RubricItem, from_document

TENANT = TenantId(uuid.UUID("a3d5e6f7-1111-4222-8333-944455556677"))


def attempt(
    n: int,
    state: AttemptState,
    *,
    output: str | None = None,
    prompt: str = "p",
    step: str = "solve",
    duration_ms: int = 10,
) -> AttemptView:
    return AttemptView(
        step=StepId(step),
        attempt=AttemptNo(n),
        iteration=0,
        state=state,
        prompt=prompt,
        output=output,
        error=None if state is AttemptState.SUCCEEDED else "wrong answer",
        usage=Usage(model_calls=1, prompt_tokens=7, completion_tokens=3),
        duration_ms=duration_ms,
    )


def episode(
    attempts: list[AttemptView], output: str | None, *, role: Role = Role.CHALLENGER
) -> Episode:
    run_id = new_run_id()
    return Episode(
        run=RunRef(
            tenant=TENANT,
            run_id=run_id,
            task_id=TaskId("task"),
            idempotency_key=run_id,
            workflow_id=WorkflowId("wf"),
            workflow_version=WorkflowVersion("v" * 64),
            role=role,
            purpose=Purpose.WORK,
        ),
        definition={"id": "wf", "steps": [{"id": "solve", "kind": "model", "prompt": "p"}]},
        input={},
        attempts=attempts,
        outputs={} if output is None else {"solve": output},
        output=output,
        succeeded=output is not None,
        usage=Usage(model_calls=len(attempts), prompt_tokens=70, completion_tokens=30),
    )


@dataclass
class RankingJudge:
    """Prefers the episode whose output is the longer string of 'x'; fails on 'boom'."""

    name: str = "ranking-judge"
    max_context_tokens: int = 4096
    calls: list[tuple[str | None, str | None]] = field(default_factory=list)

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        self.calls.append((a.output, b.output))
        unusable = "boom" in (a.output, b.output)
        if on_usage is not None:  # billed either way; an unusable answer is marked failed
            on_usage(JudgeUsage(self.name, 100, 5, 0.001, failed=unusable))
        if unusable:
            raise JudgeFailed("unparseable answer: 'I think A, maybe'")
        la, lb = len(a.output or ""), len(b.output or "")
        return Verdict.DRAW if la == lb else (Verdict.A if la > lb else Verdict.B)

    async def screen(
        self, episode: Episode, rubric: list[RubricItem], *, on_usage: UsageCallback | None = None
    ) -> list[CoreViolation]:
        return []


# -- profiles: refused at load, with the limit named -----------------------------------------


def test_profiles_of_the_three_strategies() -> None:
    judge = RankingJudge()
    pairwise = profile(GradingSpec(), judge, order_check=0.1)
    assert pairwise.models == ("ranking-judge",)
    assert pairwise.calls_per_episode == pytest.approx(2.1)  # compare + order check + screen
    tournament = profile(GradingSpec(strategy="tournament", quorum=8), judge, [])
    assert tournament.calls_per_episode == pytest.approx(3.0)  # 3 rounds x 4 pairs x 2 / 8
    deterministic = profile(GradingSpec(strategy="deterministic", metric="duration_ms"), judge)
    assert deterministic.models == ()
    assert deterministic.calls_per_episode == 0


@pytest.mark.parametrize(("g", "calls"), [(1, 0.0), (2, 1.0), (3, 2 * 2 * 1 / 3), (8, 3.0)])
def test_tournament_calls_per_episode(g: int, calls: float) -> None:
    assert tournament_calls_per_episode(g) == pytest.approx(calls)


def test_a_strategy_that_does_not_fit_is_refused_naming_the_limit() -> None:
    judge = RankingJudge()
    big = profile(GradingSpec(strategy="tournament", quorum=64), judge)
    with pytest.raises(StrategyRefused, match="ASSAY_GRADING_MAX_CALLS_PER_EPISODE is 4"):
        check_fits(big, GradingCapacity(max_calls_per_episode=4))
    with pytest.raises(StrategyRefused, match="ASSAY_GRADING_MAX_CONTEXT_TOKENS is 1024"):
        check_fits(profile(GradingSpec(), judge), GradingCapacity(max_context_tokens=1024))
    with pytest.raises(StrategyRefused, match="ASSAY_GRADING_MAX_MODELS is 0"):
        check_fits(profile(GradingSpec(), judge), GradingCapacity(max_models=0))
    check_fits(
        profile(GradingSpec(strategy="deterministic", metric="attempts"), judge),
        GradingCapacity(max_models=0),
    )


def test_grading_spec_parameters_belong_to_their_strategy() -> None:
    with pytest.raises(ValidationError, match="grouped strategy only"):
        GradingSpec(quorum=4)
    with pytest.raises(ValidationError, match="deterministic strategy only"):
        GradingSpec(strategy="tournament", metric="attempts")
    with pytest.raises(ValidationError, match=r"needs grading\.metric"):
        GradingSpec(strategy="deterministic")
    with pytest.raises(ValidationError, match="metric"):
        GradingSpec(strategy="deterministic", metric="usage.secrets")


def test_unset_grading_parameters_leave_the_version_unchanged() -> None:
    doc = {"id": "x", "steps": [{"id": "s", "kind": "model", "prompt": "p"}]}
    plain = from_document(doc)
    explicit = from_document({**doc, "grading": {"strategy": "pairwise_sequential"}})
    assert plain.version == explicit.version
    assert "quorum" not in plain.model_dump(mode="json", by_alias=True)["grading"]
    tuned = from_document({**doc, "grading": {"strategy": "tournament", "quorum": 4}})
    assert tuned.version != plain.version
    assert tuned.grading.group_quorum == 4


# -- deterministic grader ----------------------------------------------------------------------


def test_metric_values_come_from_the_episode() -> None:
    ep = episode(
        [attempt(1, AttemptState.FAILED, duration_ms=5), attempt(2, AttemptState.SUCCEEDED)],
        json.dumps({"score": 0.75, "nested": {"n": 3}, "flag": True}),
    )
    assert metric_value(ep, "duration_ms") == 15
    assert metric_value(ep, "attempts") == 2
    assert metric_value(ep, "usage.prompt_tokens") == 70
    assert metric_value(ep, "output.score") == 0.75
    assert metric_value(ep, "output.nested.n") == 3
    assert metric_value(ep, "output.flag") is None  # a boolean is not a number
    assert metric_value(ep, "output.missing") is None
    assert metric_value(ep, "output") is None  # an object is not a number
    assert metric_value(episode([], "42"), "output") == 42
    assert metric_value(episode([], "not json"), "output") is None
    assert metric_value(episode([], None), "output") is None


def test_deterministic_rank_is_signed_so_better_is_positive() -> None:
    assert deterministic_rank(3.0, 1.0, higher_is_better=True).strength == 2.0
    faster = deterministic_rank(80.0, 100.0, higher_is_better=False)
    assert faster.strength == 20.0
    assert faster.interval == (20.0, 20.0)
    assert faster.anchored


# -- attempts: credit for fail-then-pass, rankings within an outcome class --------------------


def test_a_fail_then_pass_retry_is_credit_never_a_comparison() -> None:
    ep = episode(
        [
            attempt(1, AttemptState.FAILED, prompt="short"),
            attempt(2, AttemptState.TIMED_OUT, prompt="short"),
            attempt(3, AttemptState.SUCCEEDED, output="ok", prompt="a longer prompt"),
        ],
        "ok",
    )
    credit = step_credit(ep)
    assert [(c.failed_attempt, c.passed_attempt) for c in credit] == [(1, 3), (2, 3)]
    assert credit[0].changed == ["prompt (5 -> 15 characters)"]
    assert credit[0].failure == "wrong answer"


async def test_attempt_tournaments_rank_only_same_outcome_attempts() -> None:
    judge = RankingJudge()
    ep = episode(
        [
            attempt(1, AttemptState.FAILED, output="x"),
            attempt(2, AttemptState.FAILED, output="xxx"),
            attempt(3, AttemptState.SUCCEEDED, output="xx"),
        ],
        "xx",
    )
    seen: list[JudgeUsage] = []
    grades = await grade_attempts(ep, judge, [], prior_precision=1.0, on_usage=seen.append)
    # One same-outcome group (the two failures), both orderings: the pass is never shown.
    assert sorted(judge.calls) == [("x", "xxx"), ("xxx", "x")]
    assert (grades.asked, grades.answered, grades.unranked) == (2, 2, ())
    assert len(seen) == 2
    ranks = {r.attempt: r for r in grades.ranks}
    assert set(ranks) == {1, 2}
    assert not ranks[1].succeeded
    assert ranks[1].rank.strength == 0.0  # the step's first try is the anchor
    assert ranks[2].rank.strength > 0  # the failure that got further
    assert [(c.failed_attempt, c.passed_attempt) for c in grades.credit] == [(1, 3), (2, 3)]


async def test_no_retries_no_judge_calls() -> None:
    judge = StubJudge()
    grades = await grade_attempts(
        episode([attempt(1, AttemptState.SUCCEEDED, output="a")], "a"),
        judge,
        [],
        prior_precision=1.0,
    )
    assert grades.ranks == ()
    assert grades.credit == ()
    assert (grades.asked, grades.answered) == (0, 0)


# -- one group's tournament --------------------------------------------------------------------


def entrants(outputs: list[str], control: int | None = 0) -> list[Entrant]:
    return [
        Entrant(name=f"e{i}", episode=episode([], out), control=i == control)
        for i, out in enumerate(outputs)
    ]


async def test_a_group_of_eight_plays_three_swiss_rounds_in_both_orderings() -> None:
    judge = RankingJudge()
    outputs = ["x" * n for n in (4, 1, 7, 3, 8, 2, 6, 5)]
    billed: list[str] = []
    outcome = await run_tournament(
        entrants(outputs),
        judge,
        [],
        seed="group-1",
        prior_precision=1.0,
        on_usage=lambda shown, usage: billed.append(shown),
    )
    assert len(outcome.bouts) == 12
    assert outcome.asked == outcome.answered == 24 == len(billed)
    assert len({frozenset((b.a, b.b)) for b in outcome.bouts}) == 12  # no rematch
    assert all(b.consistent for b in outcome.bouts)
    assert outcome.anchored
    ranked = outcome.ranked
    assert set(ranked) == set(outcome.scores)
    assert ranked["e0"].strength == 0.0
    by_strength = sorted(ranked, key=lambda n: ranked[n].strength)
    assert by_strength[0] == "e1"
    assert by_strength[-1] == "e4"
    assert all(
        s.group_size == 8 and s.interval[0] <= s.strength <= s.interval[1] for s in ranked.values()
    )
    # three rounds, both orderings, no failure: six answered comparisons each
    assert {(s.comparisons, s.comparisons_failed) for s in ranked.values()} == {(6, 0)}
    again = await run_tournament(
        entrants(outputs), RankingJudge(), [], seed="group-1", prior_precision=1.0
    )
    assert [(b.a, b.b) for b in again.bouts] == [(b.a, b.b) for b in outcome.bouts]


async def test_a_group_without_control_is_fitted_but_not_anchored() -> None:
    outcome = await run_tournament(
        entrants(["x", "xx", "xxx"], control=None),
        RankingJudge(),
        [],
        seed="s",
        prior_precision=1.0,
    )
    assert not outcome.anchored
    assert all(not s.anchored for s in outcome.ranked.values())


async def test_a_failing_judge_loses_the_comparison_not_the_tournament() -> None:
    outcome = await run_tournament(
        entrants(["x", "boom", "xxx", "xx"]), RankingJudge(), [], seed="s", prior_precision=1.0
    )
    assert outcome.failures
    assert all("unparseable" in f.reason for f in outcome.failures)
    assert outcome.asked == outcome.answered + len(outcome.failures) == 2 * len(outcome.bouts)
    failed = [b for b in outcome.bouts if "e1" in (b.a, b.b)]
    assert failed
    assert all(b.first is None and b.consistent is None for b in failed)
    # e1 was in every failed comparison: no strength from the prior alone
    assert outcome.scores["e1"] == Ungraded(reason=UngradedReason.JUDGE_FAILED)
    assert set(outcome.ranked) == {"e0", "e2", "e3"}
    for name, score in outcome.ranked.items():
        mine = [b for b in outcome.bouts if name in (b.a, b.b)]
        answered = sum(v is not None for b in mine for v in (b.first, b.second))
        assert (score.comparisons, score.comparisons_failed) == (answered, 2 * len(mine) - answered)
        assert score.group_size == 4


async def test_a_group_the_judge_answered_nothing_about_is_ungraded_judge_failed() -> None:
    usage: list[str] = []
    outcome = await run_tournament(
        entrants(["boom", "boom", "boom"]),
        RankingJudge(),
        [],
        seed="s",
        prior_precision=1.0,
        on_usage=lambda shown, _: usage.append(shown),
    )
    assert outcome.ranked == {}
    assert set(outcome.scores.values()) == {Ungraded(reason=UngradedReason.JUDGE_FAILED)}
    assert (outcome.asked, outcome.answered) == (2 * len(outcome.bouts), 0)
    assert len(outcome.failures) == outcome.asked > 0
    assert {f.billed_to for f in outcome.failures} <= {"e0", "e1", "e2"}
    assert not outcome.anchored
    assert outcome.tie is None


async def test_control_that_no_answer_reached_anchors_nothing() -> None:
    outcome = await run_tournament(
        entrants(["boom", "x", "xx", "xxx"]), RankingJudge(), [], seed="s", prior_precision=1.0
    )
    assert outcome.scores["e0"] == Ungraded(reason=UngradedReason.JUDGE_FAILED)
    assert outcome.ranked
    assert not outcome.anchored
    assert all(not s.anchored for s in outcome.ranked.values())


async def test_an_interval_resting_on_fewer_answered_comparisons_is_wider() -> None:
    @dataclass
    class Flaky(RankingJudge):
        """Fails every call that shows e3's episode as A."""

        async def compare(
            self,
            a: Episode,
            b: Episode,
            rubric: list[RubricItem],
            *,
            on_usage: UsageCallback | None = None,
        ) -> Verdict:
            if a.output == "xxxx":
                raise JudgeFailed("the endpoint stopped")
            return await super().compare(a, b, rubric, on_usage=on_usage)

    outputs = ["x", "xx", "xxx", "xxxx"]
    whole = await run_tournament(
        entrants(outputs), RankingJudge(), [], seed="s", prior_precision=1.0
    )
    partial = await run_tournament(entrants(outputs), Flaky(), [], seed="s", prior_precision=1.0)
    full, half = whole.ranked["e3"], partial.ranked["e3"]
    assert (full.comparisons, full.comparisons_failed) == (4, 0)
    assert half.comparisons is not None
    assert half.comparisons_failed is not None
    assert half.comparisons + half.comparisons_failed == 4
    assert half.comparisons_failed > 0
    assert half.interval[1] - half.interval[0] > full.interval[1] - full.interval[0]


async def test_attempts_the_judge_answered_nothing_about_are_unranked_with_the_reason() -> None:
    ep = episode(
        [
            attempt(1, AttemptState.FAILED, output="boom"),
            attempt(2, AttemptState.FAILED, output="xxx"),
            attempt(3, AttemptState.SUCCEEDED, output="xx"),
        ],
        "xx",
    )
    seen: list[JudgeUsage] = []
    grades = await grade_attempts(ep, RankingJudge(), [], prior_precision=1.0, on_usage=seen.append)
    assert grades.ranks == ()
    assert [u.model_dump() for u in grades.unranked] == [
        {
            "step": "solve",
            "iteration": 0,
            "succeeded": False,
            "attempts": [1, 2],
            "reason": UngradedReason.JUDGE_FAILED,
        }
    ]
    assert (grades.asked, grades.answered, len(grades.failures)) == (2, 0, 2)
    assert len(seen) == 2  # the judge reported its calls; none of them answered
    assert [(c.failed_attempt, c.passed_attempt) for c in grades.credit] == [(1, 3), (2, 3)]


@dataclass
class ScriptedFailures:
    """Answers by output length, or fails the call when the script says so (then draws)."""

    fails: list[bool]
    name: str = "scripted"
    max_context_tokens: int = 4096

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        if self.fails.pop(0) if self.fails else False:
            raise JudgeFailed("no answer")
        if on_usage is not None:
            on_usage(JudgeUsage(self.name, 1, 1, 0.0))
        la, lb = len(a.output or ""), len(b.output or "")
        return Verdict.DRAW if la == lb else (Verdict.A if la > lb else Verdict.B)

    async def screen(
        self, episode: Episode, rubric: list[RubricItem], *, on_usage: UsageCallback | None = None
    ) -> list[CoreViolation]:
        return []


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=2, max_size=7),
    fails=st.lists(st.booleans(), max_size=40),
    control=st.one_of(st.none(), st.integers(0, 6)),
)
async def test_no_strength_without_an_answered_comparison_behind_it(
    lengths: list[int], fails: list[bool], control: int | None
) -> None:
    billed: list[str] = []
    outcome = await run_tournament(
        entrants(["x" * n for n in lengths], control=control),
        ScriptedFailures(list(fails)),
        [],
        seed="p",
        prior_precision=1.0,
        on_usage=lambda shown, _: billed.append(shown),
    )
    assert outcome.asked == 2 * len(outcome.bouts) == outcome.answered + len(outcome.failures)
    assert outcome.answered == len(billed)
    for name, score in outcome.scores.items():
        mine = [b for b in outcome.bouts if name in (b.a, b.b)]
        answered = sum(v is not None for b in mine for v in (b.first, b.second))
        if answered == 0:
            assert score == Ungraded(reason=UngradedReason.JUDGE_FAILED)
        else:
            assert isinstance(score, Ranked)
            assert (score.comparisons, score.comparisons_failed) == (
                answered,
                2 * len(mine) - answered,
            )
            assert score.anchored is outcome.anchored
    in_fit = {n for n, s in outcome.scores.items() if isinstance(s, Ranked)}
    assert outcome.anchored == (control is not None and f"e{control}" in in_fit)


def test_bout_consistency_is_the_mirror_verdict() -> None:
    assert Bout("a", "b", Verdict.A, Verdict.B).consistent is True
    assert Bout("a", "b", Verdict.DRAW, Verdict.DRAW).consistent is True
    assert Bout("a", "b", Verdict.A, Verdict.A).consistent is False  # position bias
    assert Bout("a", "b", Verdict.A, None).consistent is None
    count = Bout("a", "b", Verdict.A, Verdict.A).count()
    assert (count.a_wins, count.b_wins, count.draws) == (1, 1, 0)


async def test_fewer_than_two_entrants_is_refused() -> None:
    with pytest.raises(ValueError, match="at least two"):
        await run_tournament(entrants(["x"]), RankingJudge(), [], seed="s", prior_precision=1.0)
