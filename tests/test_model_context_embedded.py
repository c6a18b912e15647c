"""Verifier context in embedded mode, end to end (§10.1): a run's episode records, per
model call, what was packed into its context, what was available and not packed, what
was dropped and which tools were offered; a `context` verifier checks its declared
expectations against it, and its result reaches the consumer on `assay.results`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from assay.bus import RESULTS, TASKS, VERIFIED, WORKFLOWS
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
from assay.workflow import from_document

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


async def test_the_episode_records_each_calls_context_and_the_verifier_reads_it(
    tmp_path: Path,
) -> None:
    async with Embedded(tmp_path / "data", partitions=4) as rt:
        rt.start()
        definition = WORKFLOW.model_dump(mode="json", by_alias=True)
        registered = WorkflowRegistered(tenant=TENANT, definition=definition)
        await rt.publish(WORKFLOWS, registered, TENANT)

        async def routed() -> bool:
            key = StateKey(TENANT, "allocation", WORKFLOW.id)
            return await rt.logs["ingest"].get(key) is not None

        await until(routed, "the workflow to be routed")
        task = TaskSubmitted(
            tenant=TENANT,
            workflow_id=WORKFLOW.id,
            idempotency_key="tides",
            input={"question": "the tides", "notes": "the moon pulls the sea"},
        )
        await rt.publish(TASKS, task, TENANT, idem="tides")

        async def result() -> list[RunResult]:
            return [m for m in await on_bus(rt, RESULTS) if isinstance(m, RunResult)]

        (done,) = await until(result, "the run's result")
        verdicts = {v.verifier: v for v in done.verification}
        assert verdicts["had_question"].passed, verdicts["had_question"].evidence
        assert not verdicts["had_notes"].passed
        assert verdicts["had_notes"].evidence == (
            "task.notes was available and not packed; tool search not offered"
        )

        (verified,) = [m for m in await on_bus(rt, VERIFIED) if isinstance(m, RunVerified)]
        stored = await rt.blobs.get(TENANT, verified.episode)
        assert stored is not None
        episode = Episode.model_validate_json(stored)
        (call,) = [a.context for a in episode.attempts if a.context is not None]
        assert [(r.ref, r.chars) for r in call.packed] == [("task.question", 9)]
        assert [(r.ref, r.chars) for r in call.available] == [("task.notes", 22)]
        assert (call.dropped, call.tools_offered) == ([], [])
