"""Verifier context in embedded mode, end to end (§10.1): a run's episode records, per
model call, what was packed into its context, what was available and not packed, what
was dropped and which tools were offered; a `context` verifier checks its declared
expectations against it, and its result reaches the consumer on `assay.results`. The
model is a chat-completions endpoint on loopback, so the test also reads what each
request really carried: the offered tools, and the prompt trimmed to its budget."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from assay.bus import RESULTS, TASKS, VERIFIED, WORKFLOWS
from assay.engine import BUILTIN_TOOLS, ChatCompletionsModel
from assay.engine.tools import offered
from assay.kernel import tenant_id
from assay.messages import (
    MESSAGES,
    Episode,
    RunResult,
    RunVerified,
    TaskSubmitted,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.workflow import WorkflowDef, from_document
from libs.assay.tests.chat_endpoint import ChatServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TENANT = tenant_id("8c3d4e5f-6071-4b82-9d9e-0f1a2b3c4d5e")
WORKFLOW = from_document(
    {
        "id": "explain",
        "steps": [
            {"id": "answer", "kind": "model", "prompt": "Explain {{ task.question }} simply."}
        ],
        "verifiers": [
            {"id": "had_question", "kind": "context", "expect": {"packed": ["task.question"]}},
            {
                "id": "had_notes",
                "kind": "context",
                "step": "answer",
                "expect": {"packed": ["task.notes"], "tools_offered": ["search"]},
            },
        ],
    }
)

# 24 characters of its own: "Q: \nNotes: \nBackground: "; the whole rendering is
# 24 + 9 ("the tides") + 18 (the endpoint's "The answer is 153.") + 50 = 101.
DIGEST = from_document(
    {
        "id": "digest",
        "steps": [
            {"id": "notes", "kind": "model", "prompt": "Notes on {{ task.question }}."},
            {
                "id": "answer",
                "kind": "model",
                "prompt": (
                    "Q: {{ task.question }}\nNotes: {{ steps.notes.output }}\n"
                    "Background: {{ task.background }}"
                ),
                "tools": ["extract_number"],
                "context_budget_chars": 85,
            },
        ],
        "verifiers": [
            {
                "id": "trimmed",
                "kind": "context",
                "step": "answer",
                "expect": {
                    "packed": ["task.question", "task.background"],
                    "dropped": ["steps.notes.output"],
                    "tools_offered": ["extract_number"],
                },
            }
        ],
    }
)


async def until(check: Callable[[], Awaitable[Any]], what: str, timeout_s: float = 90) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := await check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return found


async def on_bus(rt: Embedded, topic: str) -> list[Any]:
    found = []
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(topic, partition, 0, 100, 0.0):
            env = open_envelope(m.value)
            found.append(MESSAGES.decode(env.type, env.schema_version, env.payload))
    return found


async def run_one(rt: Embedded, wf: WorkflowDef, key: str, task: dict[str, Any]) -> RunResult:
    """Register `wf`, submit `task`, and wait for its result."""
    definition = wf.model_dump(mode="json", by_alias=True)
    await rt.publish(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=definition), TENANT)

    async def routed() -> bool:
        return await rt.logs["ingest"].get(StateKey(TENANT, "allocation", wf.id)) is not None

    await until(routed, f"{wf.id} to be routed")
    submitted = TaskSubmitted(tenant=TENANT, workflow_id=wf.id, idempotency_key=key, input=task)
    await rt.publish(TASKS, submitted, TENANT, idem=key)

    async def result() -> list[RunResult]:
        found = [m for m in await on_bus(rt, RESULTS) if isinstance(m, RunResult)]
        return [m for m in found if m.workflow_id == wf.id]

    done: list[RunResult] = await until(result, f"the result of {wf.id}")
    return done[0]


async def episode_of(rt: Embedded, wf: WorkflowDef) -> Episode:
    verified = [m for m in await on_bus(rt, VERIFIED) if isinstance(m, RunVerified)]
    (ref,) = [v.episode for v in verified if v.run.workflow_id == wf.id]
    stored = await rt.blobs.get(TENANT, ref)
    assert stored is not None
    return Episode.model_validate_json(stored)


async def test_the_episode_records_each_calls_context_and_the_verifier_reads_it(
    tmp_path: Path,
) -> None:
    with ChatServer() as server:
        model = ChatCompletionsModel(server.base_url, "local-model")
        try:
            async with Embedded(tmp_path / "data", partitions=4, model=model) as rt:
                rt.start()
                task = {"question": "the tides", "notes": "the moon pulls the sea"}
                explained = await run_one(rt, WORKFLOW, "tides", task)
                task = {"question": "the tides", "background": "B" * 50}
                digested = await run_one(rt, DIGEST, "digest", task)
                explain, digest = await episode_of(rt, WORKFLOW), await episode_of(rt, DIGEST)
        finally:
            await model.aclose()

    verdicts = {v.verifier: v for v in explained.verification}
    assert verdicts["had_question"].passed, verdicts["had_question"].evidence
    assert not verdicts["had_notes"].passed
    assert verdicts["had_notes"].evidence == (
        "task.notes was available and not packed; tool search not offered"
    )
    (call,) = [a.context for a in explain.attempts if a.context is not None]
    assert [(r.ref, r.chars) for r in call.packed] == [("task.question", 9)]
    assert [(r.ref, r.chars) for r in call.available] == [("task.notes", 22)]
    assert (call.dropped, call.tools_offered) == ([], [])

    (trimmed,) = digested.verification
    assert trimmed.passed, trimmed.evidence
    assert trimmed.evidence.endswith("dropped steps.notes.output (18 chars)")
    answer = digest.attempts[-1]
    assert answer.context is not None
    assert [(r.ref, r.chars) for r in answer.context.dropped] == [("steps.notes.output", 18)]
    assert answer.context.tools_offered == ["extract_number"]
    sent = "Q: the tides\nNotes: \nBackground: " + "B" * 50  # 83 characters: within 85
    assert answer.prompt == sent
    (request,) = [s.body for s in server.seen if s.body["messages"][-1]["content"] == sent]
    assert request["tools"] == [offered(BUILTIN_TOOLS["extract_number"])]
    plain = [s.body for s in server.seen if s.body["messages"][-1]["content"] != sent]
    assert plain
    assert all("tools" not in body for body in plain)  # steps offering none send none
