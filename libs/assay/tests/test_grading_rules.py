"""Grading rules (§11.3, §11.8): the sequential test, pairwise order and verifier precedence."""

from __future__ import annotations

import math
import random
import uuid

import pytest
from pydantic import ValidationError

from assay.grading import (
    SprtDecision,
    SprtPolicy,
    StubJudge,
    UsageCallback,
    challenger_position,
    compare_with_reference,
    evaluate,
    llr,
)
from assay.kernel import AttemptNo, AttemptState, RunId, StepId, TaskId, new_run_id
from assay.kernel.ids import TenantId, WorkflowId, WorkflowVersion
from assay.kernel.scores import CoreViolation, DecidedBy, Outcome, Verdict, WinRecord
from assay.messages import AttemptView, Episode, Purpose, Role, RunRef, Usage
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.workflow import RubricItem

# -- SPRT: boundaries and the likelihood ratio -----------------------------------------------


@pytest.mark.parametrize(("alpha", "beta"), [(0.05, 0.10), (0.01, 0.2), (0.1, 0.1), (0.2, 0.05)])
def test_boundaries_are_walds_unless_calibrated(alpha: float, beta: float) -> None:
    wald = SprtPolicy(alpha=alpha, beta=beta, calibrated=False)
    assert wald.upper == wald.wald_upper == pytest.approx(math.log((1 - beta) / alpha))
    assert wald.lower == wald.wald_lower == pytest.approx(math.log(beta / (1 - alpha)))
    calibrated = SprtPolicy(alpha=alpha, beta=beta)
    assert wald.lower <= calibrated.lower < 0 < calibrated.upper <= wald.upper


@pytest.mark.parametrize(("p0", "p1"), [(0.5, 0.5), (0.6, 0.5), (0.7, 0.3)])
def test_a_policy_whose_alternative_is_not_better_is_refused(p0: float, p1: float) -> None:
    with pytest.raises(ValidationError, match="p1 must exceed p0"):
        SprtPolicy(p0=p0, p1=p1)


def test_llr_is_the_binomial_log_likelihood_ratio() -> None:
    policy = SprtPolicy(p0=0.5, p1=0.7)
    for wins, losses in [(0, 0), (1, 0), (0, 1), (7, 3), (12, 15)]:
        expected = math.log((0.7**wins * 0.3**losses) / (0.5**wins * 0.5**losses))
        assert llr(wins, losses, policy) == pytest.approx(expected)


def test_decisions_at_the_boundaries() -> None:
    policy = SprtPolicy(p0=0.5, p1=0.7, alpha=0.05, beta=0.10)
    step_up = math.log(0.7 / 0.5)
    need = math.ceil(policy.upper / step_up)  # straight wins to accept
    assert evaluate(WinRecord(judge_wins=need - 1), policy).decision is SprtDecision.CONTINUE
    accepted = evaluate(WinRecord(judge_wins=need), policy)
    assert accepted.decision is SprtDecision.ACCEPT
    assert "accept boundary" in accepted.reason
    step_down = -math.log(0.3 / 0.5)
    need = math.ceil(-policy.lower / step_down)
    assert evaluate(WinRecord(judge_losses=need - 1), policy).decision is SprtDecision.CONTINUE
    rejected = evaluate(WinRecord(judge_losses=need), policy)
    assert rejected.decision is SprtDecision.REJECT
    assert "reject boundary" in rejected.reason
    assert evaluate(WinRecord(), policy).decision is SprtDecision.CONTINUE


def test_verifier_decided_pairs_count_like_judge_verdicts() -> None:
    policy = SprtPolicy()
    judged = evaluate(WinRecord(judge_wins=4, judge_losses=2), policy)
    mixed = evaluate(
        WinRecord(judge_wins=1, verifier_wins=3, judge_losses=1, verifier_losses=1), policy
    )
    assert mixed.llr == judged.llr
    assert mixed.decision is judged.decision


def test_draws_do_not_move_the_ratio() -> None:
    policy = SprtPolicy(min_for_draws=1000)
    base = evaluate(WinRecord(judge_wins=3, judge_losses=1), policy)
    for draws in (1, 5, 50, 500):
        with_draws = evaluate(WinRecord(judge_wins=3, judge_losses=1, draws=draws), policy)
        assert with_draws.llr == base.llr
        assert with_draws.decision is base.decision is SprtDecision.CONTINUE
    assert evaluate(WinRecord(draws=999), policy).llr == 0.0


def test_the_draw_ceiling_rejects_only_after_min_for_draws() -> None:
    policy = SprtPolicy(draw_ceiling=0.5, min_for_draws=20)
    # All draws, but too few comparisons for the ceiling to apply.
    early = evaluate(WinRecord(draws=19), policy)
    assert early.decision is SprtDecision.CONTINUE
    late = evaluate(WinRecord(draws=20), policy)
    assert late.decision is SprtDecision.REJECT
    assert late.reason == "draw rate 20/20 exceeds the ceiling 0.5"
    # Decisive comparisons count toward the minimum too.
    mixed = evaluate(WinRecord(judge_wins=2, judge_losses=2, draws=16), policy)
    assert mixed.decision is SprtDecision.REJECT
    assert mixed.llr == llr(2, 2, policy)
    # At the ceiling is not above it.
    at = evaluate(WinRecord(judge_wins=5, judge_losses=5, draws=10), policy)
    assert at.decision is SprtDecision.CONTINUE


# -- SPRT: operating characteristics by simulation -------------------------------------------

REPLICATIONS = 4000
HORIZON = 2000


def simulate(policy: SprtPolicy, win_rate: float, seed: int) -> tuple[float, float, float]:
    """Accept rate, reject rate and mean comparisons over many sequential tests.

    Each test draws verdicts one at a time and stops at the first decision (or
    at the horizon). `evaluate` is asked once per distinct (wins, losses) state.
    """
    rng = random.Random(seed)
    decided: dict[tuple[int, int], SprtDecision] = {}
    accepts = rejects = comparisons = 0
    for _ in range(REPLICATIONS):
        wins = losses = 0
        decision = SprtDecision.CONTINUE
        for _ in range(HORIZON):
            if rng.random() < win_rate:
                wins += 1
            else:
                losses += 1
            comparisons += 1
            state = (wins, losses)
            if state not in decided:
                decided[state] = evaluate(
                    WinRecord(judge_wins=wins, judge_losses=losses), policy
                ).decision
            decision = decided[state]
            if decision is not SprtDecision.CONTINUE:
                break
        accepts += decision is SprtDecision.ACCEPT
        rejects += decision is SprtDecision.REJECT
    return accepts / REPLICATIONS, rejects / REPLICATIONS, comparisons / REPLICATIONS


POLICIES = [
    pytest.param(SprtPolicy(), id="p0=.5,p1=.7,a=b=.05"),
    pytest.param(SprtPolicy(beta=0.10, calibrated=False), id="wald,p0=.5,p1=.7,a=.05,b=.10"),
    pytest.param(SprtPolicy(p0=0.5, p1=0.6, alpha=0.05, beta=0.05), id="p0=.5,p1=.6,a=b=.05"),
]


@pytest.mark.parametrize("policy", POLICIES)
def test_false_accept_rate_under_h0(policy: SprtPolicy) -> None:
    accept, reject, mean_n = simulate(policy, policy.p0, seed=20_240_501)
    assert accept <= policy.alpha + 0.01
    assert accept + reject == 1.0  # every test decided well inside the horizon
    assert mean_n < HORIZON / 10


@pytest.mark.parametrize("policy", POLICIES)
def test_false_reject_rate_under_h1(policy: SprtPolicy) -> None:
    accept, reject, mean_n = simulate(policy, policy.p1, seed=20_240_502)
    assert reject <= policy.beta + 0.01
    assert accept + reject == 1.0
    assert mean_n < HORIZON / 10


def test_a_clearly_better_challenger_is_accepted_quickly() -> None:
    policy = SprtPolicy()
    accept, _, mean_n = simulate(policy, 0.9, seed=7)
    assert accept >= 0.99
    assert mean_n < 15  # about upper / E[step] = 2.81 / 0.25 ≈ 11.1, plus overshoot


# -- episodes for the pairwise tests ----------------------------------------------------------


def make_episode(outputs: list[str | None]) -> Episode:
    """An episode of one step whose attempts produced these outputs (None: failed)."""
    run_id = new_run_id()
    attempts = [
        AttemptView(
            step=StepId("solve"),
            attempt=AttemptNo(i + 1),
            iteration=0,
            state=AttemptState.FAILED if out is None else AttemptState.SUCCEEDED,
            output=out,
            error="wrong" if out is None else None,
            usage=Usage(model_calls=1),
            duration_ms=1,
        )
        for i, out in enumerate(outputs)
    ]
    last = outputs[-1] if outputs else None
    return Episode(
        run=RunRef(
            tenant=TenantId(uuid.UUID("a3d5e6f7-1111-4222-8333-944455556666")),
            run_id=run_id,
            task_id=TaskId("task"),
            idempotency_key=run_id,
            workflow_id=WorkflowId("wf"),
            workflow_version=WorkflowVersion("v" * 64),
            role=Role.CHALLENGER,
            purpose=Purpose.WORK,
        ),
        definition={"id": "wf", "steps": [{"id": "solve", "kind": "model", "prompt": "p"}]},
        input={},
        attempts=attempts,
        outputs={} if last is None else {"solve": last},
        output=last,
        succeeded=last is not None,
        usage=Usage(model_calls=len(outputs)),
    )


class RecordingJudge:
    """Answers with a fixed verdict and records what it was shown."""

    name = "recording"
    max_context_tokens = 0

    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict
        self.shown: list[tuple[Episode, Episode]] = []

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        self.shown.append((a, b))
        return self.verdict

    async def screen(
        self,
        episode: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> list[CoreViolation]:
        return []


class ForbiddenJudge:
    """A judge that must never be consulted."""

    name = "forbidden"
    max_context_tokens = 0

    async def compare(
        self,
        a: Episode,
        b: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> Verdict:
        pytest.fail("a pass-versus-fail pair was shown to a judge")

    async def screen(
        self,
        episode: Episode,
        rubric: list[RubricItem],
        *,
        on_usage: UsageCallback | None = None,
    ) -> list[CoreViolation]:
        pytest.fail("screen was called")


REFERENCE_RUN = RunId(new_run_id())


# -- pairwise: order and verifier precedence ---------------------------------------------------


def test_challenger_position_alternates() -> None:
    assert [challenger_position(i) for i in range(6)] == ["a", "b", "a", "b", "a", "b"]
    assert challenger_position(10_000) == "a"
    assert challenger_position(10_001) == "b"


@pytest.mark.parametrize("order_index", range(4))
@pytest.mark.parametrize("challenger_passed", [True, False])
async def test_pass_against_fail_is_decided_by_the_verifier(
    order_index: int, challenger_passed: bool
) -> None:
    challenger, reference = make_episode(["1"]), make_episode(["2"])
    score, calls = await compare_with_reference(
        challenger=challenger,
        challenger_passed=challenger_passed,
        reference=reference,
        reference_passed=not challenger_passed,
        reference_run=REFERENCE_RUN,
        order_index=order_index,
        judge=ForbiddenJudge(),
        rubric=[],
    )
    assert calls == 0
    assert score.decided_by is DecidedBy.VERIFIER
    assert score.against == REFERENCE_RUN
    position = challenger_position(order_index)
    assert score.position == position
    mine = Verdict.A if position == "a" else Verdict.B
    if challenger_passed:
        assert score.outcome is Outcome.WIN
        assert score.verdict is mine
    else:
        assert score.outcome is Outcome.LOSS
        assert score.verdict is not mine
        assert score.verdict is not Verdict.DRAW
    record = WinRecord().add(score.outcome, score.decided_by)
    assert (record.verifier_wins, record.verifier_losses) == (
        (1, 0) if challenger_passed else (0, 1)
    )
    assert record.judge_wins == record.judge_losses == 0


@pytest.mark.parametrize("order_index", range(4))
@pytest.mark.parametrize("both_passed", [True, False])
async def test_the_same_outcome_class_goes_to_the_judge_in_alternating_order(
    order_index: int, both_passed: bool
) -> None:
    challenger, reference = make_episode(["1"]), make_episode(["2"])
    judge = RecordingJudge(Verdict.DRAW)
    score, calls = await compare_with_reference(
        challenger=challenger,
        challenger_passed=both_passed,
        reference=reference,
        reference_passed=both_passed,
        reference_run=REFERENCE_RUN,
        order_index=order_index,
        judge=judge,
        rubric=[],
    )
    assert calls == 1
    assert len(judge.shown) == 1
    shown_a, shown_b = judge.shown[0]
    if order_index % 2 == 0:
        assert (shown_a, shown_b) == (challenger, reference)
    else:
        assert (shown_a, shown_b) == (reference, challenger)
    assert score.decided_by is DecidedBy.JUDGE
    assert score.verdict is Verdict.DRAW
    assert score.outcome is Outcome.DRAW


@pytest.mark.parametrize(
    ("verdict", "even", "odd"),
    [
        (Verdict.A, Outcome.WIN, Outcome.LOSS),
        (Verdict.B, Outcome.LOSS, Outcome.WIN),
        (Verdict.DRAW, Outcome.DRAW, Outcome.DRAW),
    ],
)
async def test_the_verdict_is_read_from_the_challengers_position(
    verdict: Verdict, even: Outcome, odd: Outcome
) -> None:
    judge = RecordingJudge(verdict)
    record = WinRecord()
    for index in range(6):
        score, _ = await compare_with_reference(
            challenger=make_episode(["1"]),
            challenger_passed=True,
            reference=make_episode(["2"]),
            reference_passed=True,
            reference_run=REFERENCE_RUN,
            order_index=index,
            judge=judge,
            rubric=[],
        )
        assert score.verdict is verdict  # as given, positions as shown
        assert score.position == challenger_position(index)
        assert score.outcome is (even if index % 2 == 0 else odd)
        record = record.add(score.outcome, score.decided_by)
    # A judge with pure position bias cancels out across the sequence.
    if verdict is Verdict.DRAW:
        assert record.draws == 6
    else:
        assert (record.judge_wins, record.judge_losses) == (3, 3)
    assert record.verifier_wins == record.verifier_losses == 0


# -- the stub judge -----------------------------------------------------------------------------


async def test_stub_judge_prefers_fewer_attempts_first() -> None:
    judge = StubJudge()
    one_long = make_episode(["The answer, after a great deal of careful thought, is 153."])
    two_short = make_episode([None, "153"])
    assert await judge.compare(one_long, two_short, []) is Verdict.A
    assert await judge.compare(two_short, one_long, []) is Verdict.B


async def test_stub_judge_then_prefers_fewer_characters() -> None:
    judge = StubJudge()
    terse, wordy = make_episode(["153"]), make_episode(["The answer is 153."])
    assert await judge.compare(terse, wordy, []) is Verdict.A
    assert await judge.compare(wordy, terse, []) is Verdict.B


async def test_stub_judge_equal_episodes_draw() -> None:
    judge = StubJudge()
    assert await judge.compare(make_episode(["153"]), make_episode(["154"]), []) is Verdict.DRAW
    same = make_episode([None, "The answer is 1."])
    assert await judge.compare(same, same, []) is Verdict.DRAW


RUBRIC = [
    RubricItem(id="no-apology", layer="core", text="The output must not contain 'sorry'."),
    RubricItem(id="tone", layer="contextual", text="The output must not contain 'sorry'."),
    RubricItem(id="style", layer="prescriptive", text="Prefer short answers."),
]


async def test_stub_judge_screen_flags_core_items_only() -> None:
    judge = StubJudge()
    guilty = make_episode(["sorry, I think it is 152", "sorry again: 153"])
    violations = await judge.screen(guilty, RUBRIC)
    assert [v.criterion for v in violations] == ["no-apology"]  # once, however often
    assert "attempt 1" in violations[0].evidence
    assert "'sorry'" in violations[0].evidence

    assert await judge.screen(make_episode(["153"]), RUBRIC) == []
    contextual_only = [item for item in RUBRIC if item.layer != "core"]
    assert await judge.screen(guilty, contextual_only) == []
    assert await judge.screen(guilty, []) == []


def test_sprt_policy_reads_its_environment_overrides() -> None:
    policy = AssaySettings.from_env(
        {"ASSAY_SPRT_P1": "0.65", "ASSAY_SPRT_ALPHA": "0.01", "X": "1"}
    ).sprt
    assert (policy.p0, policy.p1, policy.alpha) == (0.5, 0.65, 0.01)
    with pytest.raises(SettingsInvalid, match="p1 must exceed p0"):
        AssaySettings.from_env({"ASSAY_SPRT_P1": "0.4"})
