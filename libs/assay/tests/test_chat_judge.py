"""The chat judge (§11.1) against a real loopback chat-completions endpoint, and the
settings that choose the runtime's judge.

The endpoint is `chat_endpoint.ChatServer`: scripted replies, every request
recorded. Nothing in httpx is replaced.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from assay.engine import ChatCompletionsModel, Prices, RetryPolicy
from assay.grading import (
    ChatJudge,
    JudgeFailed,
    JudgePrompts,
    JudgeUsage,
    StubJudge,
    compare_with_reference,
)
from assay.grading.chat_judge import CHARS_PER_TOKEN, TEMPLATE_TOKENS
from assay.grading.judges import TracedJudge
from assay.kernel.scores import CoreViolation, DecidedBy, Verdict
from assay.runtime import Embedded
from assay.runtime.settings import AssaySettings, SettingsInvalid
from libs.assay.tests.chat_endpoint import ChatServer, Reply, completion, json_reply
from libs.assay.tests.judge_episodes import RUBRIC, make_episode


@pytest.fixture
def server() -> Iterator[ChatServer]:
    with ChatServer() as chat:
        yield chat


FAST = RetryPolicy(max_retries=2, backoff_base_s=0.01, backoff_cap_s=0.02)

MakeJudge = Callable[..., ChatJudge]


@pytest.fixture
async def make_judge() -> AsyncIterator[MakeJudge]:
    """Build chat judges on a fast-retrying model and close them after the test (a 30 s
    timeout per call: a loopback answer is immediate, but not on two saturated cores)."""
    made: list[ChatJudge] = []

    def make(base_url: str, *, prices: Prices | None = None, **options: Any) -> ChatJudge:
        model = ChatCompletionsModel(
            base_url, "judge-model", retry=FAST, timeout_s=30.0, prices=prices
        )
        judge = ChatJudge(model, **options)
        made.append(judge)
        return judge

    yield make
    for judge in made:
        await judge.aclose()


def answer(text: str, *, prompt_tokens: int = 900, completion_tokens: int = 12) -> Reply:
    return json_reply(
        completion(
            text,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            model="judge-model-q4",
        )
    )


# -- compare and screen over HTTP ----------------------------------------------------------


async def test_compare_sends_the_rubric_first_then_the_episodes_at_temperature_0(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    server.answer(answer('{"verdict": "B", "reason": "B needed one attempt."}'))
    judge = make_judge(server.base_url)
    a, b = make_episode([None, "5"]), make_episode(["5"])
    assert await judge.compare(a, b, RUBRIC) is Verdict.B
    expected = JudgePrompts().compare(a, b, RUBRIC)
    (seen,) = server.seen
    assert seen.path == "/v1/chat/completions"
    assert seen.body["model"] == "judge-model"
    assert seen.body["temperature"] == 0
    assert seen.body["max_tokens"] == 512
    assert seen.body["messages"] == [
        {"role": "system", "content": expected.system},
        {"role": "user", "content": expected.user},
    ]


async def test_the_same_question_is_asked_with_the_same_seed(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    server.answer(answer('{"verdict": "draw"}'))
    judge = make_judge(server.base_url)
    a, b = make_episode(["5"]), make_episode(["6"])
    for x, y in ((a, b), (a, b), (b, a)):
        assert await judge.compare(x, y, RUBRIC) is Verdict.DRAW
    first, again, swapped = (s.body for s in server.seen)
    assert first == again
    assert swapped["seed"] != first["seed"]


async def test_each_call_reports_its_tokens_and_cost(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    server.answer(
        answer('{"verdict": "A"}', prompt_tokens=900, completion_tokens=12),
        answer('{"violations": []}', prompt_tokens=400, completion_tokens=8),
    )
    judge = make_judge(server.base_url, prices=Prices(1.0, 2.0))
    usage: list[JudgeUsage] = []
    await judge.compare(make_episode(["5"]), make_episode(["6"]), RUBRIC, on_usage=usage.append)
    await judge.screen(make_episode(["5"]), RUBRIC, on_usage=usage.append)
    assert [(u.model, u.prompt_tokens, u.completion_tokens) for u in usage] == [
        ("judge-model-q4", 900, 12),
        ("judge-model-q4", 400, 8),
    ]
    assert [u.cost_usd for u in usage] == pytest.approx([(900 + 24) / 1e6, (400 + 16) / 1e6])


async def test_screen_asks_about_the_core_criteria_and_returns_the_violations(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    server.answer(
        answer('{"violations": [{"criterion": "safe", "evidence": "the output runs rm -rf"}]}')
    )
    judge = make_judge(server.base_url)
    episode = make_episode(["rm -rf /"])
    found = await judge.screen(episode, RUBRIC)
    assert found == [CoreViolation(criterion="safe", evidence="the output runs rm -rf")]
    expected = JudgePrompts().screen(episode, RUBRIC)
    assert server.seen[0].body["messages"][0] == {"role": "system", "content": expected.system}


async def test_screen_without_core_criteria_makes_no_call(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    judge = make_judge(server.base_url)
    usage: list[JudgeUsage] = []
    no_core = [item for item in RUBRIC if item.layer != "core"]
    assert await judge.screen(make_episode(["5"]), no_core, on_usage=usage.append) == []
    assert await judge.screen(make_episode(["5"]), [], on_usage=usage.append) == []
    assert server.seen == []
    assert usage == []


async def test_the_reference_episode_is_rendered_once_across_comparisons(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    server.answer(answer('{"verdict": "A"}'))
    judge = make_judge(server.base_url)
    reference = make_episode(["5"])
    for n, challenger in enumerate(make_episode([str(k)]) for k in range(4)):
        pair = (challenger, reference) if n % 2 == 0 else (reference, challenger)
        await judge.compare(*pair, RUBRIC)
    assert (judge.prompts.hits, judge.prompts.misses) == (3, 5)


# -- failures ------------------------------------------------------------------------------


async def test_an_unparseable_answer_fails_and_its_tokens_are_reported_as_failed(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    server.answer(answer("Episode B is clearly better because it is shorter."))
    judge = make_judge(server.base_url)
    usage: list[JudgeUsage] = []
    with pytest.raises(JudgeFailed, match="not one JSON object") as failed:
        await judge.compare(make_episode(["5"]), make_episode(["6"]), RUBRIC, on_usage=usage.append)
    assert failed.value.excerpt.startswith("Episode B is clearly better")
    assert len(server.seen) == 1  # a wrong answer is not retried
    # spent, but never an answer
    assert [(u.prompt_tokens, u.completion_tokens, u.failed) for u in usage] == [(900, 12, True)]


async def test_an_unusable_screen_is_reported_as_failed_and_a_usable_one_as_answered(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    server.answer(answer('{"violations": [{"criterion": "nope", "evidence": "x"}]}'))
    judge = make_judge(server.base_url)
    usage: list[JudgeUsage] = []
    with pytest.raises(JudgeFailed, match="not a core criterion"):
        await judge.screen(make_episode(["5"]), RUBRIC, on_usage=usage.append)
    server.answer(answer('{"violations": []}'))
    assert await judge.screen(make_episode(["5"]), RUBRIC, on_usage=usage.append) == []
    assert [u.failed for u in usage] == [True, False]


async def test_a_models_refusal_fails_and_what_the_endpoint_billed_is_reported_as_failed(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    body = completion("", prompt_tokens=700, completion_tokens=9, model="judge-model-q4")
    body["choices"][0]["message"] = {
        "role": "assistant",
        "content": None,
        "refusal": "I can't help with comparing these.",
    }
    server.answer(json_reply(body))
    judge = make_judge(server.base_url, prices=Prices(prompt_per_mtok=1.0))
    usage: list[JudgeUsage] = []
    with pytest.raises(JudgeFailed, match="the model refused: I can't help"):
        await judge.compare(make_episode(["5"]), make_episode(["6"]), RUBRIC, on_usage=usage.append)
    assert len(server.seen) == 1
    (billed,) = usage
    assert (billed.model, billed.prompt_tokens, billed.completion_tokens) == (
        "judge-model-q4",
        700,
        9,
    )
    assert billed.failed
    assert billed.cost_usd == pytest.approx(700 / 1e6)


async def test_429_and_5xx_are_retried_by_the_chat_models_policy(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    busy = json_reply({"error": "rate limited"}, 429, ("Retry-After", "0"))
    server.answer(busy, json_reply({"error": "overloaded"}, 503), answer('{"verdict": "A"}'))
    judge = make_judge(server.base_url)
    usage: list[JudgeUsage] = []
    verdict = await judge.compare(
        make_episode(["5"]), make_episode(["6"]), RUBRIC, on_usage=usage.append
    )
    assert verdict is Verdict.A
    assert len(server.seen) == 3
    assert len(usage) == 1  # one call answered


async def test_an_endpoint_that_stays_unavailable_fails_without_a_guess(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    server.answer(json_reply({"error": "overloaded"}, 503))
    judge = make_judge(server.base_url)
    usage: list[JudgeUsage] = []
    with pytest.raises(JudgeFailed, match=r"ModelUnavailable: .*gave up after 3 attempt"):
        await judge.compare(make_episode(["5"]), make_episode(["6"]), RUBRIC, on_usage=usage.append)
    assert len(server.seen) == 3
    assert usage == []


@pytest.mark.parametrize(
    ("reply", "named"),
    [
        (json_reply({"error": "context length exceeded"}, 400), "ModelRequestRefused: .*HTTP 400"),
        (Reply(200, b"{not json", (("Content-Type", "application/json"),)), "ModelResponseInv"),
    ],
)
async def test_a_refused_request_or_a_body_that_is_no_completion_fails_at_once(
    server: ChatServer, make_judge: MakeJudge, reply: Reply, named: str
) -> None:
    server.answer(reply)
    judge = make_judge(server.base_url)
    with pytest.raises(JudgeFailed, match=named):
        await judge.screen(make_episode(["5"]), RUBRIC)
    assert len(server.seen) == 1


async def test_a_rubric_over_its_budget_fails_before_any_call(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    judge = make_judge(server.base_url, rubric_chars=20)
    with pytest.raises(JudgeFailed, match="rubric budget"):
        await judge.compare(make_episode(["5"]), make_episode(["6"]), RUBRIC)
    assert server.seen == []


# -- what a resource profile reads -----------------------------------------------------------


async def test_the_model_id_and_context_ceiling_follow_from_the_budgets(
    server: ChatServer, make_judge: MakeJudge
) -> None:
    small = make_judge(server.base_url, episode_chars=3_000)
    large = make_judge(server.base_url, episode_chars=6_000, max_answer_tokens=256)
    assert (small.model_id, small.name) == ("judge-model", "judge-model")
    prompt_chars = small.prompts.max_prompt_chars
    assert small.max_context_tokens == (
        math.ceil(prompt_chars / CHARS_PER_TOKEN) + TEMPLATE_TOKENS + 512
    )
    # A comparison reads two episodes: 3,000 more characters each is 2,000 more tokens.
    assert large.max_context_tokens - small.max_context_tokens == 2_000 - 256


# -- the stub judge and the pairwise step ------------------------------------------------------


async def test_the_stub_reports_one_zero_token_call_per_comparison_and_none_per_screen() -> None:
    usage: list[JudgeUsage] = []
    stub = StubJudge()
    await stub.compare(make_episode(["5"]), make_episode(["6"]), RUBRIC, on_usage=usage.append)
    await stub.screen(make_episode(["rm -rf /"]), RUBRIC, on_usage=usage.append)
    assert usage == [JudgeUsage("stub-judge-1", 0, 0, 0.0)]


async def test_a_pairwise_comparison_passes_usage_through_and_a_verifier_pair_reports_none() -> (
    None
):
    usage: list[JudgeUsage] = []
    common: dict[str, Any] = {
        "reference": make_episode(["6"]),
        "reference_run": make_episode(["6"]).run.run_id,
        "order_index": 0,
        "judge": StubJudge(),
        "rubric": RUBRIC,
        "on_usage": usage.append,
    }
    score, calls = await compare_with_reference(
        challenger=make_episode(["5"]), challenger_passed=True, reference_passed=True, **common
    )
    assert (score.decided_by, calls, len(usage)) == (DecidedBy.JUDGE, 1, 1)
    score, calls = await compare_with_reference(
        challenger=make_episode(["5"]), challenger_passed=True, reference_passed=False, **common
    )
    assert (score.decided_by, calls, len(usage)) == (DecidedBy.VERIFIER, 0, 1)


# -- settings ----------------------------------------------------------------------------------


def test_without_any_url_the_stub_judge_is_used() -> None:
    assert isinstance(AssaySettings.from_env({}).judge.build(), StubJudge)
    only_checked = {"ASSAY_JUDGE_NAME": "big-judge", "ASSAY_JUDGE_EPISODE_CHARS": "2000"}
    assert isinstance(AssaySettings.from_env(only_checked).judge.build(), StubJudge)


async def test_without_a_judge_url_the_judge_runs_on_the_agents_model(server: ChatServer) -> None:
    env = {
        "ASSAY_MODEL_URL": server.base_url,
        "ASSAY_MODEL_NAME": "agent-model",
        "ASSAY_MODEL_API_KEY": "sk-agent-1",
        "ASSAY_MODEL_PRICE_PROMPT_PER_MTOK": "1.0",
        "ASSAY_JUDGE_EPISODE_CHARS": "4000",
    }
    settings = AssaySettings.from_env(env).judge
    assert "sk-agent-1" not in repr(settings)
    judge = settings.build()
    assert isinstance(judge, ChatJudge)
    server.answer(answer('{"verdict": "A"}', prompt_tokens=1_000_000, completion_tokens=0))
    usage: list[JudgeUsage] = []
    async with judge:
        assert (judge.model_id, judge.prompts.episode_chars) == ("agent-model", 4000)
        await judge.compare(make_episode(["5"]), make_episode(["6"]), [], on_usage=usage.append)
    (seen,) = server.seen
    assert seen.body["model"] == "agent-model"
    assert seen.headers["authorization"] == "Bearer sk-agent-1"
    assert usage[0].cost_usd == pytest.approx(1.0)  # the agent's prices


async def test_a_judge_name_alone_picks_another_model_on_the_agents_endpoint(
    server: ChatServer,
) -> None:
    env = {
        "ASSAY_MODEL_URL": server.base_url,
        "ASSAY_MODEL_NAME": "agent-model",
        "ASSAY_JUDGE_NAME": "judge-model",
    }
    judge = AssaySettings.from_env(env).judge.build()
    assert isinstance(judge, ChatJudge)
    server.answer(answer('{"verdict": "draw"}'))
    async with judge:
        await judge.compare(make_episode(["5"]), make_episode(["6"]), [])
    assert server.seen[0].body["model"] == "judge-model"


async def test_a_judge_url_of_its_own_never_gets_the_agents_key(server: ChatServer) -> None:
    env = {
        "ASSAY_MODEL_URL": "http://127.0.0.1:9/v1",
        "ASSAY_MODEL_NAME": "agent-model",
        "ASSAY_MODEL_API_KEY": "sk-agent-1",
        "ASSAY_MODEL_TIMEOUT_S": "0.001",
        "ASSAY_JUDGE_URL": server.base_url,
        "ASSAY_JUDGE_NAME": "judge-model",
    }
    judge = AssaySettings.from_env(env).judge.build()
    assert isinstance(judge, ChatJudge)
    server.answer(answer('{"verdict": "B"}'))
    async with judge:
        assert await judge.compare(make_episode(["5"]), make_episode(["6"]), []) is Verdict.B
    (seen,) = server.seen
    assert seen.body["model"] == "judge-model"
    assert "authorization" not in seen.headers


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("ASSAY_JUDGE_URL", "ftp://127.0.0.1/v1"),
        ("ASSAY_JUDGE_TIMEOUT_S", "0"),
        ("ASSAY_JUDGE_TIMEOUT_S", "soon"),
        ("ASSAY_JUDGE_MAX_RETRIES", "-1"),
        ("ASSAY_JUDGE_PRICE_PROMPT_PER_MTOK", "-0.5"),
        ("ASSAY_JUDGE_PRICE_COMPLETION_PER_MTOK", "free"),
        ("ASSAY_JUDGE_EPISODE_CHARS", "100"),
        ("ASSAY_JUDGE_RUBRIC_CHARS", "many"),
    ],
)
def test_an_invalid_value_is_settings_invalid_naming_the_variable(
    variable: str, value: str
) -> None:
    env = {"ASSAY_JUDGE_URL": "http://127.0.0.1:8000/v1", "ASSAY_JUDGE_NAME": "j", variable: value}
    with pytest.raises(SettingsInvalid, match=f"invalid setting {variable}="):
        AssaySettings.from_env(env)


def test_an_invalid_value_inherited_from_the_agent_names_the_agents_variable() -> None:
    env = {
        "ASSAY_MODEL_URL": "http://127.0.0.1:8000/v1",
        "ASSAY_MODEL_NAME": "m",
        "ASSAY_MODEL_MAX_RETRIES": "many",
    }
    with pytest.raises(SettingsInvalid, match="invalid setting ASSAY_MODEL_MAX_RETRIES='many'"):
        AssaySettings.from_env(env)


def test_a_url_without_a_model_name_is_settings_invalid() -> None:
    with pytest.raises(
        SettingsInvalid, match=r"ASSAY_JUDGE_NAME \(required when ASSAY_JUDGE_URL is set\)"
    ):
        AssaySettings.from_env({"ASSAY_JUDGE_URL": "http://127.0.0.1:8000/v1"})
    with pytest.raises(
        SettingsInvalid,
        match=r"ASSAY_JUDGE_NAME or ASSAY_MODEL_NAME \(required when ASSAY_MODEL_URL is set\)",
    ):
        AssaySettings.from_env({"ASSAY_MODEL_URL": "http://127.0.0.1:8000/v1"})


# -- the embedded runtime ------------------------------------------------------------------------


async def test_the_embedded_runtime_closes_the_judge_it_built_and_not_one_passed_in(
    tmp_path: Path, server: ChatServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASSAY_MODEL_URL", server.base_url)
    monkeypatch.setenv("ASSAY_MODEL_NAME", "agent-model")
    async with Embedded(tmp_path / "built", stages=()) as runtime:
        traced = runtime.deps.judge
        assert isinstance(traced, TracedJudge)  # every call a span
        built = traced.judge
        assert isinstance(built, ChatJudge)
        assert built.model_id == "agent-model"
    with pytest.raises(RuntimeError, match="closed"):
        await built.compare(make_episode(["5"]), make_episode(["6"]), [])

    server.answer(answer('{"verdict": "A"}'))
    mine = ChatJudge(ChatCompletionsModel(server.base_url, "judge-model", retry=FAST))
    async with mine:
        async with Embedded(tmp_path / "passed", judge=mine, stages=()) as runtime:
            traced = runtime.deps.judge
            assert isinstance(traced, TracedJudge)
            assert traced.judge is mine
        assert await mine.compare(make_episode(["5"]), make_episode(["6"]), []) is Verdict.A
