"""The OpenAI-compatible chat-completions model (§9) against a real local HTTP server.

The server (`chat_endpoint.ChatServer`) is the standard library's threading
HTTP server on a free loopback port; each test scripts its replies (status,
headers, body, delay) and reads back every request it received. Nothing in
httpx is replaced.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from assay.engine import (
    BUILTIN_TOOLS,
    WORK_EVENTS,
    ChatCompletionsModel,
    Driver,
    LogJournal,
    ModelRequestRefused,
    ModelResponseInvalid,
    ModelUnavailable,
    Priced,
    Prices,
    RetryPolicy,
    RunSpec,
    StubModel,
    fold_work,
    prices_of,
    request_seed,
)
from assay.engine.tools import JsonFieldArgs, offered
from assay.kernel import (
    AttemptState,
    BranchId,
    TaskId,
    WorkflowVersion,
    content_hash,
    new_run_id,
    tenant_id,
)
from assay.messages import Purpose, Role, RolloutRef, RunRef, UsageRecorded
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.store import SqliteEventLog
from assay.workflow import WorkflowDef, validate
from libs.assay.tests.chat_endpoint import OK, ChatServer, Reply, completion, json_reply

# -- the endpoint ---------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[ChatServer]:
    with ChatServer() as chat:
        yield chat


FAST = RetryPolicy(max_retries=2, backoff_base_s=0.01, backoff_cap_s=0.02)

MakeModel = Callable[..., ChatCompletionsModel]


@pytest.fixture
async def make_model() -> AsyncIterator[MakeModel]:
    """Build models (fast retries, short timeouts unless told) and close them after the test."""
    made: list[ChatCompletionsModel] = []

    def make(base_url: str, **options: Any) -> ChatCompletionsModel:
        options.setdefault("retry", FAST)
        options.setdefault("timeout_s", 5.0)
        model = ChatCompletionsModel(base_url, "local-model", **options)
        made.append(model)
        return model

    yield make
    for model in made:
        await model.aclose()


# -- the wire format -----------------------------------------------------------------------


async def test_a_completion_carries_the_text_tokens_model_and_cost(
    server: ChatServer, make_model: MakeModel
) -> None:
    server.answer(json_reply(completion(model="local-model-q4")))
    model = make_model(server.base_url, prices=Prices(1.0, 2.0))
    done = await model.complete("What is 2 + 2?", max_tokens=64, seed="s")
    assert done.text == "The answer is 153."
    assert (done.prompt_tokens, done.completion_tokens) == (12, 5)
    assert done.model == "local-model-q4"  # what actually served the call
    assert done.cost_usd == pytest.approx((12 * 1.0 + 5 * 2.0) / 1_000_000)
    assert [s.path for s in server.seen] == ["/v1/chat/completions"]


async def test_offered_tools_ride_the_request_and_a_tool_call_answer_is_refused(
    server: ChatServer, make_model: MakeModel
) -> None:
    tools = [offered(BUILTIN_TOOLS["json_field"])]
    model = make_model(server.base_url)
    done = await model.complete_with_tools("hi", max_tokens=8, seed="s", tools=tools)
    assert done.text == "The answer is 153."
    (sent,) = (s.body for s in server.seen)
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "json_field",
                "description": "Field `field` of the JSON object in `text`.",
                "parameters": JsonFieldArgs.model_json_schema(),
            },
        }
    ]
    assert set(sent["tools"][0]["function"]["parameters"]["required"]) == {"text", "field"}
    await model.complete("hi", max_tokens=8, seed="s")
    assert "tools" not in server.seen[1].body  # a plain call offers none

    calls = completion(text="")
    calls["choices"][0]["message"] = {
        "role": "assistant",  # some servers leave `content` out of a tool-call answer
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "json_field"}}],
    }
    server.answer(json_reply(calls))
    with pytest.raises(ModelResponseInvalid) as caught:
        await model.complete_with_tools("hi", max_tokens=8, seed="s", tools=tools)
    assert "answered with a call of json_field" in str(caught.value)
    assert caught.value.billed is not None
    assert (caught.value.billed.text, caught.value.billed.prompt_tokens) == ("", 12)


async def test_without_prices_a_completion_costs_nothing(
    server: ChatServer, make_model: MakeModel
) -> None:
    done = await make_model(server.base_url).complete("hi", max_tokens=8, seed="s")
    assert done.cost_usd == 0.0


async def test_the_request_body_is_the_chat_completions_wire_format(
    server: ChatServer, make_model: MakeModel
) -> None:
    model = make_model(server.base_url + "/")  # a trailing slash is not doubled
    for seed in ("run:solve:1", "run:solve:1", "run:solve:2"):
        await model.complete("What is 2 + 2?", max_tokens=64, seed=seed)
    first, again, other = (s.body for s in server.seen)
    assert [s.path for s in server.seen] == ["/v1/chat/completions"] * 3
    assert first["model"] == "local-model"
    assert first["messages"] == [{"role": "user", "content": "What is 2 + 2?"}]
    assert first["max_tokens"] == 64
    assert first["temperature"] == 0
    assert isinstance(first["seed"], int)
    assert 0 <= first["seed"] < 2**31
    assert first["seed"] == again["seed"] == request_seed("run:solve:1")
    assert other["seed"] != first["seed"]
    assert server.seen[0].headers["content-type"] == "application/json"


async def test_a_system_message_goes_before_the_prompt(
    server: ChatServer, make_model: MakeModel
) -> None:
    model = make_model(server.base_url)
    await model.complete("Episode A: ...", max_tokens=8, seed="s", system="You compare.")
    assert server.seen[0].body["messages"] == [
        {"role": "system", "content": "You compare."},
        {"role": "user", "content": "Episode A: ..."},
    ]


def test_the_seed_is_the_same_on_every_machine_and_release() -> None:
    # Pinned: a changed derivation would change what a seeded server answers on a retry.
    assert [request_seed(s) for s in ("a", "b", "run:solve:1")] == [
        393621469,
        283496253,
        1750722502,
    ]


async def test_the_api_key_is_sent_as_a_bearer_token(
    server: ChatServer, make_model: MakeModel
) -> None:
    await make_model(server.base_url, api_key="sk-local-1").complete("hi", max_tokens=8, seed="s")
    await make_model(server.base_url).complete("hi", max_tokens=8, seed="s")
    with_key, without = server.seen
    assert with_key.headers["authorization"] == "Bearer sk-local-1"
    assert "authorization" not in without.headers


# -- retries -------------------------------------------------------------------------------


async def test_429_twice_then_an_answer_is_three_requests_and_one_completion(
    server: ChatServer, make_model: MakeModel
) -> None:
    busy = json_reply({"error": "rate limited"}, 429, ("Retry-After", "0"))
    server.answer(busy, busy, OK)
    done = await make_model(server.base_url).complete("hi", max_tokens=8, seed="s")
    assert done.text == "The answer is 153."
    assert len(server.seen) == 3


async def test_a_long_retry_after_is_capped(server: ChatServer, make_model: MakeModel) -> None:
    server.answer(json_reply({"error": "later"}, 429, ("Retry-After", "3600")), OK)
    retry = RetryPolicy(max_retries=1, retry_after_cap_s=0.05)
    t0 = time.monotonic()
    await make_model(server.base_url, retry=retry).complete("hi", max_tokens=8, seed="s")
    assert time.monotonic() - t0 < 2.0
    assert len(server.seen) == 2


async def test_a_numeric_retry_after_is_waited(server: ChatServer, make_model: MakeModel) -> None:
    server.answer(json_reply({"error": "later"}, 503, ("Retry-After", "0.3")), OK)
    t0 = time.monotonic()
    await make_model(server.base_url).complete("hi", max_tokens=8, seed="s")
    assert time.monotonic() - t0 >= 0.3  # FAST's own backoff is at most 0.02s
    assert len(server.seen) == 2


async def test_503_until_the_retries_run_out_is_model_unavailable(
    server: ChatServer, make_model: MakeModel
) -> None:
    server.answer(json_reply({"error": "overloaded, try later"}, 503))
    with pytest.raises(
        ModelUnavailable, match=r"gave up after 3 attempt\(s\).*HTTP 503.*overloaded"
    ):
        await make_model(server.base_url).complete("hi", max_tokens=8, seed="s")
    assert len(server.seen) == 3  # the first request and FAST's two retries


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_a_4xx_other_than_429_fails_at_once(
    server: ChatServer, make_model: MakeModel, status: int
) -> None:
    server.answer(json_reply({"error": {"message": "max_tokens is too large"}}, status))
    with pytest.raises(ModelRequestRefused, match=rf"HTTP {status}: .*max_tokens is too large"):
        await make_model(server.base_url).complete("hi", max_tokens=8, seed="s")
    assert len(server.seen) == 1


async def test_a_slow_answer_times_out_and_is_retried(
    server: ChatServer, make_model: MakeModel
) -> None:
    server.answer(Reply(200, OK.body, OK.headers, delay_s=1.0), OK)
    done = await make_model(server.base_url, timeout_s=0.2).complete("hi", max_tokens=8, seed="s")
    assert done.text == "The answer is 153."
    assert len(server.seen) == 2


async def test_an_answer_that_is_always_too_slow_is_model_unavailable(
    server: ChatServer, make_model: MakeModel
) -> None:
    server.answer(Reply(200, OK.body, OK.headers, delay_s=1.0))
    model = make_model(server.base_url, timeout_s=0.2, retry=RetryPolicy(1, 0.01, 0.02))
    with pytest.raises(
        ModelUnavailable, match=r"gave up after 2 attempt\(s\).*no answer within 0\.2s"
    ):
        await model.complete("hi", max_tokens=8, seed="s")
    assert len(server.seen) == 2


async def test_a_refused_connection_is_retried_then_model_unavailable(
    make_model: MakeModel,
) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago, with no listener
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ModelUnavailable, match=r"gave up after 3 attempt\(s\).*ConnectError"):
        await make_model(f"http://127.0.0.1:{port}/v1").complete("hi", max_tokens=8, seed="s")


def test_backoff_grows_is_capped_jitters_and_yields_to_retry_after() -> None:
    policy = RetryPolicy(max_retries=9, backoff_base_s=0.5, backoff_cap_s=4.0, retry_after_cap_s=9)
    for retry, ceiling in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (8, 4.0)]:
        for _ in range(20):
            assert ceiling / 2 <= policy.delay(retry, None) <= ceiling
    assert policy.delay(0, 2.5) == 2.5
    assert policy.delay(0, 60.0) == 9


def test_retry_policies_and_prices_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError, match="price"):
        Prices(-1.0, 0.0)
    with pytest.raises(ValueError, match="timeout_s"):
        ChatCompletionsModel("http://127.0.0.1:1/v1", "m", timeout_s=0)
    with pytest.raises(ValueError, match="model name"):
        ChatCompletionsModel("http://127.0.0.1:1/v1", "")


# -- strict parsing ------------------------------------------------------------------------


def _without(path: Sequence[str | int]) -> dict[str, Any]:
    doc = completion()
    here: Any = doc
    for part in path[:-1]:
        here = here[part]
    del here[path[-1]]
    return doc


def _with(path: Sequence[str | int], value: Any) -> dict[str, Any]:
    doc = completion()
    here: Any = doc
    for part in path[:-1]:
        here = here[part]
    here[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b"{not json", "not JSON"),
        (b"", "not JSON"),
        (json.dumps([1, 2]).encode(), "no choices"),
        (json.dumps(_with(["choices"], [])).encode(), r"no choices\[0\]"),
        (json.dumps(_without(["choices", 0, "message"])).encode(), r"choices\[0\]\.message"),
        (
            json.dumps(_without(["choices", 0, "message", "content"])).encode(),
            r"no choices\[0\]\.message\.content",
        ),
        (
            json.dumps(_with(["choices", 0, "message", "content"], None)).encode(),
            r"choices\[0\]\.message\.content is null",
        ),
        (json.dumps(_without(["usage"])).encode(), "no usage"),
        (json.dumps(_without(["usage", "prompt_tokens"])).encode(), "no usage.prompt_tokens"),
        (
            json.dumps(_without(["usage", "completion_tokens"])).encode(),
            "no usage.completion_tokens",
        ),
        (json.dumps(_with(["usage", "prompt_tokens"], "12")).encode(), "usage.prompt_tokens is"),
        (json.dumps(_with(["usage", "completion_tokens"], -1)).encode(), "usage.completion_tok"),
        (json.dumps(_with(["usage", "prompt_tokens"], True)).encode(), "usage.prompt_tokens is"),
    ],
)
async def test_a_body_that_is_not_a_chat_completion_with_usage_is_refused_by_name(
    server: ChatServer, make_model: MakeModel, body: bytes, named: str
) -> None:
    server.answer(Reply(200, body, (("Content-Type", "application/json"),)))
    with pytest.raises(ModelResponseInvalid, match=named):
        await make_model(server.base_url).complete("hi", max_tokens=8, seed="s")
    assert len(server.seen) == 1  # a wrong answer is not a transient failure


# -- configuration from the environment ----------------------------------------------------


def test_without_a_url_the_stub_model_is_used() -> None:
    assert isinstance(AssaySettings.from_env({}).model.build(), StubModel)
    assert isinstance(AssaySettings.from_env({"ASSAY_MODEL_URL": ""}).model.build(), StubModel)


async def test_the_environment_configures_the_chat_model() -> None:
    settings = AssaySettings.from_env(
        {
            "ASSAY_MODEL_URL": "http://127.0.0.1:11434/v1",
            "ASSAY_MODEL_NAME": "qwen2.5:7b",
            "ASSAY_MODEL_API_KEY": "sk-secret-1",
            "ASSAY_MODEL_TIMEOUT_S": "12.5",
            "ASSAY_MODEL_MAX_RETRIES": "2",
            "ASSAY_MODEL_PRICE_PROMPT_PER_MTOK": "0.5",
            "ASSAY_MODEL_PRICE_COMPLETION_PER_MTOK": "1.5",
        }
    ).model
    assert "sk-secret-1" not in repr(settings)
    model = settings.build()
    assert isinstance(model, ChatCompletionsModel)
    try:
        assert model.name == "qwen2.5:7b"
        assert model.url == "http://127.0.0.1:11434/v1/chat/completions"
        assert model.timeout_s == 12.5
        assert model.retry.max_retries == 2
        assert model.prices == Prices(0.5, 1.5)
    finally:
        await model.aclose()


def test_the_defaults_are_sixty_seconds_and_four_retries() -> None:
    settings = AssaySettings.from_env(
        {"ASSAY_MODEL_URL": "http://h/v1", "ASSAY_MODEL_NAME": "m"}
    ).model
    assert (settings.timeout_s, settings.max_retries) == (60.0, 4)
    assert (settings.price_prompt_per_mtok, settings.price_completion_per_mtok) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("ASSAY_MODEL_URL", "ftp://127.0.0.1/v1"),
        ("ASSAY_MODEL_URL", "not a url"),
        ("ASSAY_MODEL_TIMEOUT_S", "soon"),
        ("ASSAY_MODEL_TIMEOUT_S", "0"),
        ("ASSAY_MODEL_TIMEOUT_S", "inf"),
        ("ASSAY_MODEL_MAX_RETRIES", "many"),
        ("ASSAY_MODEL_MAX_RETRIES", "-1"),
        ("ASSAY_MODEL_PRICE_PROMPT_PER_MTOK", "-0.5"),
        ("ASSAY_MODEL_PRICE_COMPLETION_PER_MTOK", "free"),
    ],
)
def test_an_invalid_value_is_settings_invalid_naming_the_variable(
    variable: str, value: str
) -> None:
    env = {"ASSAY_MODEL_URL": "http://127.0.0.1:8000/v1", "ASSAY_MODEL_NAME": "m", variable: value}
    with pytest.raises(SettingsInvalid, match=f"invalid setting {variable}="):
        AssaySettings.from_env(env)


def test_a_url_without_a_model_name_is_settings_invalid() -> None:
    with pytest.raises(SettingsInvalid, match="ASSAY_MODEL_NAME"):
        AssaySettings.from_env({"ASSAY_MODEL_URL": "http://127.0.0.1:8000/v1"})


# -- a workflow run through the driver -----------------------------------------------------


@pytest.fixture
async def journal(tmp_path: Path) -> AsyncIterator[LogJournal]:
    log = await SqliteEventLog(tmp_path / "execute.sqlite", WORK_EVENTS, fold_work).open()
    try:
        yield LogJournal(log)
    finally:
        await log.close()


TENANT = tenant_id(uuid.UUID("0b7e4c1a-5d2f-4e8b-9c3a-7f1e2d4b6a80"))
TASK = {"question": "(5 + 12) * 9", "answer": "153"}


def shadow_run(max_attempts: int = 1, **solve: Any) -> RunSpec:
    wf = validate(
        WorkflowDef.model_validate(
            {
                "id": "wf",
                "steps": [
                    {
                        "id": "solve",
                        "kind": "model",
                        "prompt": "What is {{ task.question }}?",
                        "retry": {"max_attempts": max_attempts},
                        "timeout_s": 10,
                        **solve,
                    },
                    {
                        "id": "answer",
                        "kind": "tool",
                        "tool": "extract_number",
                        "args": {"text": "{{ steps.solve.output }}"},
                    },
                ],
            }
        ),
        frozenset(BUILTIN_TOOLS),
    )
    run_id = new_run_id()
    ref = RunRef(
        tenant=TENANT,
        run_id=run_id,
        task_id=TaskId(content_hash(TASK)),
        idempotency_key=f"key-{run_id}",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CHALLENGER,
        purpose=Purpose.SHADOW,
        baseline_version=WorkflowVersion("0" * 64),
    )
    return RunSpec(ref=ref, definition=wf, input=TASK, branch=BranchId(0))


async def test_a_run_through_the_driver_meters_tokens_cost_and_purpose(
    server: ChatServer, make_model: MakeModel, journal: LogJournal
) -> None:
    server.answer(
        json_reply(
            completion("Let me see. The answer is 153.", prompt_tokens=31, completion_tokens=7)
        )
    )
    model = make_model(server.base_url, prices=Prices(0.5, 1.5))
    spec = shadow_run()
    episode = await Driver(model, BUILTIN_TOOLS).drive(spec, journal)

    assert episode.succeeded
    assert episode.output == "153"
    assert (episode.usage.model_calls, episode.usage.prompt_tokens) == (1, 31)
    (request,) = server.seen
    assert request.body["messages"] == [{"role": "user", "content": "What is (5 + 12) * 9?"}]
    assert request.body["seed"] == request_seed(f"{spec.ref.run_id}:solve:1")
    assert len(journal.emitted) == 1
    topic, usage = journal.emitted[0]
    assert topic == "assay.usage"
    assert isinstance(usage, UsageRecorded)
    assert (usage.tenant, usage.run_id, usage.purpose) == (TENANT, spec.ref.run_id, Purpose.SHADOW)
    assert (usage.model, usage.prompt_tokens, usage.completion_tokens) == ("local-model", 31, 7)
    assert usage.cost_usd == pytest.approx((31 * 0.5 + 7 * 1.5) / 1_000_000)


async def test_a_refused_model_call_fails_the_attempt_and_meters_nothing(
    server: ChatServer, make_model: MakeModel, journal: LogJournal
) -> None:
    server.answer(json_reply({"error": "unknown model"}, 404))
    episode = await Driver(make_model(server.base_url), BUILTIN_TOOLS).drive(
        shadow_run(max_attempts=2), journal
    )
    assert not episode.succeeded
    assert episode.failed_step == "solve"
    assert [a.state for a in episode.attempts] == [AttemptState.FAILED, AttemptState.FAILED]
    assert all("HTTP 404" in (a.error or "") for a in episode.attempts)
    assert len(server.seen) == 2  # one request per attempt: the adapter did not retry a 404
    assert journal.emitted == []


def capped_sibling(cap_usd: float, steps: int) -> RunSpec:
    """A rollout sibling with a cost cap, whose workflow asks the model `steps` times."""
    wf = validate(
        WorkflowDef.model_validate(
            {
                "id": "wf-cost",
                "steps": [
                    {
                        "id": f"ask{i}",
                        "kind": "model",
                        "prompt": "What is {{ task.question }}?",
                        "max_tokens": 64,
                        "timeout_s": 10,
                    }
                    for i in range(steps)
                ],
            }
        ),
        frozenset(BUILTIN_TOOLS),
    )
    run_id = new_run_id()
    ref = RunRef(
        tenant=TENANT,
        run_id=run_id,
        task_id=TaskId(content_hash(TASK)),
        idempotency_key="group-1",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
        rollout=RolloutRef(
            group="group-1", index=0, size=2, mode="best_of_n", max_cost_usd=cap_usd
        ),
    )
    return RunSpec(ref=ref, definition=wf, input=TASK, branch=BranchId(0))


def test_a_priced_model_declares_its_prices_and_the_stub_costs_nothing(
    make_model: MakeModel,
) -> None:
    model = make_model("http://127.0.0.1:9/v1", prices=Prices(1.0, 3.0))
    assert isinstance(model, Priced)
    assert prices_of(model) == Prices(1.0, 3.0)
    assert prices_of(StubModel()).cost(10**6, 10**6) == 0.0


async def test_a_siblings_cost_cap_refuses_a_call_whose_worst_case_it_cannot_cover(
    server: ChatServer, make_model: MakeModel, journal: LogJournal
) -> None:
    """$1000 / $2000 per million tokens: a call's worst case is its 21 prompt bytes and 64
    completion tokens, $0.149; each call really costs 10 + 5 tokens, $0.02. Under a $0.18 cap
    the third call's worst case ($0.04 spent + $0.149) does not fit: it is never sent."""
    server.answer(json_reply(completion("153", prompt_tokens=10, completion_tokens=5)))
    model = make_model(server.base_url, prices=Prices(1000.0, 2000.0))
    spec = capped_sibling(0.18, steps=3)
    episode = await Driver(model, BUILTIN_TOOLS).drive(spec, journal)

    assert [a.state for a in episode.attempts] == [
        AttemptState.SUCCEEDED,
        AttemptState.SUCCEEDED,
        AttemptState.FAILED,
    ]
    refusal = episode.attempts[2].error or ""
    assert "cost budget ($0.180000) cannot cover this call" in refusal
    assert "$0.040000 spent, up to $0.149000" in refusal
    assert len(server.seen) == 2  # the refused call never reached the endpoint
    costs = [u.cost_usd for _, u in journal.emitted if isinstance(u, UsageRecorded)]
    assert costs == [pytest.approx(0.02), pytest.approx(0.02)]
    assert sum(costs) <= 0.18


async def test_a_siblings_cost_cap_never_stops_a_model_that_costs_nothing(
    journal: LogJournal,
) -> None:
    spec = capped_sibling(1e-9, steps=3)
    episode = await Driver(StubModel(), BUILTIN_TOOLS).drive(spec, journal)
    assert [a.state for a in episode.attempts] == [AttemptState.SUCCEEDED] * 3


async def test_a_step_offering_tools_sends_them_and_a_tool_call_answer_fails_the_attempt(
    server: ChatServer, make_model: MakeModel, journal: LogJournal
) -> None:
    calls = completion(text="")
    calls["choices"][0]["message"] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "extract_number"}}],
    }
    server.answer(json_reply(calls))
    spec = shadow_run(tools=["extract_number"])
    episode = await Driver(make_model(server.base_url), BUILTIN_TOOLS).drive(spec, journal)

    (request,) = server.seen
    assert request.body["tools"] == [offered(BUILTIN_TOOLS["extract_number"])]
    assert not episode.succeeded
    (attempt,) = episode.attempts
    assert attempt.state is AttemptState.FAILED
    assert "answered with a call of extract_number" in (attempt.error or "")
    assert attempt.context is not None
    assert attempt.context.tools_offered == ["extract_number"]


async def test_a_prompt_its_plan_keeps_over_budget_is_never_sent(
    server: ChatServer, make_model: MakeModel, journal: LogJournal
) -> None:
    # "What is ?" is 9 characters of its own; the plan adds "Plan:\nthink\n\n" (13).
    spec = dataclasses.replace(shadow_run(context_budget_chars=20), plan="think")
    episode = await Driver(make_model(server.base_url), BUILTIN_TOOLS).drive(spec, journal)

    assert server.seen == []  # the model was never called
    (attempt,) = episode.attempts
    assert attempt.state is AttemptState.FAILED
    assert attempt.error == (
        "the prompt is 22 characters with every reference dropped, over the step's "
        "context_budget_chars (20)"
    )
    assert attempt.prompt == "Plan:\nthink\n\nWhat is ?"
    assert attempt.context is not None
    assert [(d.ref, d.chars) for d in attempt.context.dropped] == [("task.question", 12)]


async def test_the_stub_model_ignores_offered_tools(journal: LogJournal) -> None:
    spec = shadow_run(tools=["extract_number"])
    episode = await Driver(StubModel(), BUILTIN_TOOLS).drive(spec, journal)
    assert episode.succeeded
    solve = episode.attempts[0]
    assert solve.context is not None
    assert solve.context.tools_offered == ["extract_number"]  # offered; the stub reads none
