"""A model step naming its model (`ModelStep.model`): the model port calls that model at
the same endpoint — the chat-completions client asks for it by name, the stub answers as
it — and a port that cannot route says so."""

from __future__ import annotations

import pytest

from assay.engine import ChatCompletionsModel, Completion, ModelError, StubModel
from assay.engine.models import model_for
from assay.workflow import ModelStep, from_document
from libs.assay.tests.chat_endpoint import ChatServer


class Fixed:
    """A model port with one model and no routing."""

    name = "fixed"

    async def complete(self, prompt: str, *, max_tokens: int, seed: str) -> Completion:
        return Completion("1", self.name, 1, 1)


async def test_a_routed_chat_model_asks_the_same_endpoint_for_another_model() -> None:
    with ChatServer() as server:
        base = ChatCompletionsModel(server.base_url, "small", timeout_s=5.0)
        try:
            big = model_for(base, "big")
            assert isinstance(big, ChatCompletionsModel)
            await big.complete("What is 2 + 2?", max_tokens=8, seed="s")
            await base.complete("What is 2 + 2?", max_tokens=8, seed="s")
        finally:
            await base.aclose()
    assert [s.body["model"] for s in server.seen] == ["big", "small"]
    assert (base.name, big.name, big.prices) == ("small", "big", base.prices)


async def test_the_stub_answers_as_the_named_model_with_its_own_draws() -> None:
    stub = StubModel()
    assert model_for(stub, None) is stub
    assert model_for(stub, stub.name) is stub
    other = model_for(stub, "stub-arith-2")
    prompts = [f"What is {i} * 7?" for i in range(40)]
    mine = [(await stub.complete(p, max_tokens=16, seed="s")).text for p in prompts]
    theirs = [(await other.complete(p, max_tokens=16, seed="s")).text for p in prompts]
    again = [(await other.complete(p, max_tokens=16, seed="s")).text for p in prompts]
    assert theirs == again  # deterministic
    assert theirs != mine  # its own draws
    assert (await other.complete("1 + 1", max_tokens=4, seed="s")).model == "stub-arith-2"


def test_a_port_that_cannot_route_refuses_another_model() -> None:
    fixed = Fixed()
    assert model_for(fixed, None) is fixed
    assert model_for(fixed, "fixed") is fixed
    with pytest.raises(ModelError, match="cannot call another model"):
        model_for(fixed, "big")


def test_a_model_step_names_its_model_only_when_set() -> None:
    doc = {"id": "w", "steps": [{"id": "s", "kind": "model", "prompt": "hi"}]}
    plain = from_document(doc)
    named = from_document({**doc, "steps": [{**doc["steps"][0], "model": "big"}]})  # type: ignore[dict-item]
    assert "model" not in plain.model_dump(mode="json")["steps"][0]  # the hash is unchanged
    assert isinstance(named.steps[0], ModelStep)
    assert named.steps[0].model == "big"
    assert named.version != plain.version
