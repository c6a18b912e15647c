"""The slow loop's proposers (§12.1): the deterministic catalog, and the chat proposer
against a real loopback chat-completions endpoint (`chat_endpoint.ChatServer`), and the
settings that choose the runtime's proposer."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from assay.engine import ChatCompletionsModel, RetryPolicy
from assay.grading.chat_proposer import SYSTEM, ChatProposer
from assay.grading.proposers import CatalogProposer, ProposalInput, ProposerFailed
from assay.kernel import RunId, TaskId, TenantId, WorkflowId
from assay.kernel.canonical import content_hash
from assay.kernel.scores import StepCredit
from assay.messages import FailureEvidence, VerifierResult
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.workflow import ModelStep, WorkflowDef, from_document
from libs.assay.tests.chat_endpoint import ChatServer, Reply, completion, json_reply

TENANT = TenantId(uuid.UUID(int=41))
BASE = {
    "id": "arith",
    "steps": [
        {
            "id": "solve",
            "kind": "model",
            "prompt": "What is {{ task.question }}?",
            "retry": {"max_attempts": 2},
            "timeout_s": 10,
        }
    ],
    "verifiers": [{"id": "correct", "kind": "exact", "expected": "{{ task.answer }}"}],
}
FAST = RetryPolicy(max_retries=1, backoff_base_s=0.01, backoff_cap_s=0.02)


def wrong(n: int) -> FailureEvidence:
    check = VerifierResult(
        verifier="correct", kind="exact", verifier_version="1", passed=False, evidence=f"{n} != 7"
    )
    return FailureEvidence(
        run_id=RunId(f"01HZX3V8Q6M9T2K4R7W1Y5N0{n:02d}"),
        task_id=TaskId(content_hash({"n": n})),
        workflow_version=from_document(BASE).version,
        failed_checks=[check],
    )


def rescued(failure: str) -> FailureEvidence:
    credit = StepCredit(
        step="solve", iteration=0, failed_attempt=1, passed_attempt=2, failure=failure, changed=[]
    )
    return wrong(9).model_copy(update={"failed_checks": [], "step_credit": [credit]})


def request(
    failures: list[FailureEvidence], tried: frozenset[Any] = frozenset(), **extra: Any
) -> ProposalInput:
    return ProposalInput(
        tenant=TENANT,
        workflow_id=WorkflowId("arith"),
        current=from_document(BASE),
        ended=None,
        outcome="rejected",
        reason="reject boundary",
        failures=failures,
        tried=tried,
        **extra,
    )


def prompt_of(wf: WorkflowDef) -> str:
    step = wf.steps[0]
    assert isinstance(step, ModelStep)
    return step.prompt


# -- the catalog ------------------------------------------------------------------------------


async def test_the_catalog_walks_its_edits_in_order_and_never_repeats_one() -> None:
    catalog = CatalogProposer()
    tried: set[Any] = set()
    rationales = []
    while (p := await catalog.propose(request([wrong(1), wrong(2)], frozenset(tried)))) is not None:
        assert p.definition.version not in tried
        tried.add(p.definition.version)
        rationales.append(p.rationale.split(":")[0])
    assert rationales == ["reason_step_by_step", "answer_only"]  # wrong answers: prompt edits


async def test_the_catalog_is_deterministic_and_derives_from_the_current_version() -> None:
    first = await CatalogProposer().propose(request([wrong(1)]))
    again = await CatalogProposer().propose(request([wrong(1)]))
    assert first is not None
    assert again is not None
    assert first.definition == again.definition
    assert prompt_of(first.definition) == "What is {{ task.question }}? Think step by step."
    assert first.definition.id == "arith"
    assert [s.id for s in first.definition.steps] == ["solve"]


async def test_rescued_attempts_get_more_attempts_and_timeouts_a_longer_limit() -> None:
    more = await CatalogProposer().propose(request([rescued("wrong answer")]))
    assert more is not None
    assert more.rationale.startswith("more_attempts:")
    assert more.definition.steps[0].retry.max_attempts == 3  # type: ignore[union-attr]
    slow = rescued("attempt timed out after 10s")
    longer = await CatalogProposer().propose(request([slow], frozenset({more.definition.version})))
    assert longer is not None
    assert longer.definition.steps[0].timeout_s == 20  # type: ignore[union-attr]


async def test_without_failures_nothing_is_proposed() -> None:
    assert await CatalogProposer().propose(request([])) is None


# -- the chat proposer over HTTP -------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[ChatServer]:
    with ChatServer() as chat:
        yield chat


@pytest.fixture
async def proposer(server: ChatServer) -> AsyncIterator[ChatProposer]:
    model = ChatCompletionsModel(server.base_url, "proposer-model", retry=FAST, timeout_s=5.0)
    chat = ChatProposer(model)
    yield chat
    await chat.aclose()


def answer(text: str) -> Reply:
    return json_reply(completion(text, prompt_tokens=1200, completion_tokens=300))


def drafted(prompt: str) -> str:
    doc = json.loads(json.dumps(BASE))
    doc["steps"][0]["prompt"] = prompt
    return json.dumps({"rationale": "slips are arithmetic: ask for care", "definition": doc})


async def test_the_chat_proposer_shows_the_facts_and_reads_a_draft(
    server: ChatServer, proposer: ChatProposer
) -> None:
    server.answer(answer(drafted("Carefully: what is {{ task.question }}?")))
    feedback = ["keep prompts short"]
    p = await proposer.propose(request([wrong(1), wrong(2)], feedback=feedback))
    assert p is not None
    assert prompt_of(p.definition) == "Carefully: what is {{ task.question }}?"
    assert p.rationale == "slips are arithmetic: ask for care"
    assert (p.usage.model_calls, p.usage.prompt_tokens, p.usage.completion_tokens) == (1, 1200, 300)
    (seen,) = server.seen
    assert seen.body["temperature"] == 0
    system, user = seen.body["messages"]
    assert system == {"role": "system", "content": SYSTEM}
    assert '"id": "arith"' in user["content"]
    assert "1 != 7" in user["content"]
    assert "2 != 7" in user["content"]
    assert "- keep prompts short" in user["content"]
    assert "01HZX3V8Q6M9T2K4R7W1Y5N001" not in user["content"]  # ids are not evidence


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("I would add a retry.", "unusable answer"),
        (json.dumps({"rationale": "r"}), "unusable answer"),
        (json.dumps({"rationale": "r", "definition": {"id": "other", "steps": []}}), "valid"),
        (drafted("What is {{ task.question }}?"), "unchanged"),
    ],
)
async def test_an_unusable_draft_fails_with_the_reason(
    server: ChatServer, proposer: ChatProposer, text: str, why: str
) -> None:
    server.answer(answer(text))
    with pytest.raises(ProposerFailed) as failed:
        await proposer.propose(request([wrong(1)]))
    assert why in failed.value.reason
    assert failed.value.usage.model_calls == 1  # the call is counted even when unusable


async def test_a_draft_already_tried_fails(server: ChatServer, proposer: ChatProposer) -> None:
    prompt = "Carefully: what is {{ task.question }}?"
    doc = json.loads(drafted(prompt))["definition"]
    server.answer(answer(drafted(prompt)))
    with pytest.raises(ProposerFailed, match="already tried"):
        await proposer.propose(request([wrong(1)], frozenset({from_document(doc).version})))


async def test_an_endpoint_that_stays_down_fails_the_draft(proposer: ChatProposer) -> None:
    dead = ChatProposer(
        ChatCompletionsModel("http://127.0.0.1:9/v1", "m", retry=FAST, timeout_s=1.0)
    )
    try:
        with pytest.raises(ProposerFailed, match="the model call failed"):
            await dead.propose(request([wrong(1)]))
    finally:
        await dead.aclose()


# -- settings ---------------------------------------------------------------------------------


async def test_settings_choose_the_catalog_without_a_url_and_the_agent_model_with_one() -> None:
    plain = AssaySettings.from_env({}).proposer
    catalog = plain.build()
    assert isinstance(catalog, CatalogProposer)
    assert plain.gated(TENANT)
    agent = AssaySettings.from_env(
        {"ASSAY_MODEL_URL": "http://127.0.0.1:9/v1", "ASSAY_MODEL_NAME": "agent-model"}
    ).proposer
    chat = agent.build()
    assert isinstance(chat, ChatProposer)
    assert chat.name == "chat:agent-model"
    await chat.aclose()
    ungated = AssaySettings.from_env({"ASSAY_PROPOSER_UNGATED": f" {TENANT} ,"}).proposer
    assert not ungated.gated(TENANT)


def test_a_bad_ungated_list_or_a_url_without_a_name_names_the_variable() -> None:
    with pytest.raises(SettingsInvalid, match="ASSAY_PROPOSER_UNGATED='acme'"):
        AssaySettings.from_env({"ASSAY_PROPOSER_UNGATED": "acme"})
    with pytest.raises(SettingsInvalid, match="ASSAY_PROPOSER_NAME"):
        AssaySettings.from_env({"ASSAY_PROPOSER_URL": "http://127.0.0.1:9/v1"})
