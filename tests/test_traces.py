"""Traces continue the producer's: a task produced with a W3C `traceparent` is one trace
from ingest to its result, with a span per handled message, step attempt, model call,
tool call and judge call (DESIGN §14); a task produced without one starts a new trace
at ingest."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from assay.bus import RESULTS, TASKS, WORKFLOWS
from assay.grading.ladder import LadderPolicy
from assay.kernel import tenant_id
from assay.messages import (
    MESSAGES,
    Envelope,
    RunResult,
    TaskSubmitted,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.workflow import WorkflowDef, from_document

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TENANT = tenant_id("7a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PRODUCER = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def version(prompt: str) -> WorkflowDef:
    return from_document(
        {
            "id": "traced",
            "steps": [
                {"id": "solve", "kind": "model", "prompt": prompt},
                {
                    "id": "answer",
                    "kind": "tool",
                    "tool": "extract_number",
                    "args": {"text": "{{ steps.solve.output }}"},
                },
            ],
            # Always passes: every challenger run meets its reference in one outcome class,
            # so the judge (not the verifier) decides each comparison.
            "verifiers": [{"id": "ran", "kind": "regex", "step": "answer", "pattern": ".*"}],
        }
    )


V1, V2 = version("What is {{ task.question }}?"), version("Compute {{ task.question }}.")


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # once per process: this module's tests share it
    yield exporter
    exporter.clear()


async def until(check: Callable[[], Awaitable[object]], what: str) -> None:
    deadline = time.monotonic() + 90
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def results(rt: Embedded) -> list[tuple[Envelope, RunResult]]:
    out = []
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(RESULTS, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
            if isinstance(msg, RunResult):
                out.append((env, msg))
    return out


def trace_of(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.trace_id:032x}"


async def test_a_producers_trace_runs_through_every_stage_to_the_result(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    ladder = LadderPolicy(min_shadow_runs=100)  # V2 stays on shadow: every task is compared
    async with Embedded(tmp_path / "data", partitions=4, shadow_rate=1.0, ladder=ladder) as rt:
        rt.start()
        for wf in (V1, V2):
            definition = wf.model_dump(mode="json", by_alias=True)
            await rt.publish(
                WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=definition), TENANT
            )

            async def routed(wf: WorkflowDef = wf) -> bool:
                alloc = await rt.logs["ingest"].get(StateKey(TENANT, "allocation", wf.id))
                return alloc is not None and wf.version in (
                    alloc["current"],
                    alloc.get("challenger"),
                )

            await until(routed, f"{wf.version[:8]} to be routed")
        spans.clear()
        for n in range(2):
            task = TaskSubmitted(
                tenant=TENANT,
                workflow_id=V1.id,
                idempotency_key=f"t{n}",
                input={"question": f"{n} + 2", "answer": str(n + 2)},
            )
            await rt.publish(TASKS, task, TENANT, idem=f"t{n}", traceparent=PRODUCER)
        untraced = TaskSubmitted(
            tenant=TENANT,
            workflow_id=V1.id,
            idempotency_key="untraced",
            input={"question": "7 + 2", "answer": "9"},
        )
        await rt.publish(TASKS, untraced, TENANT, idem="untraced")  # no traceparent

        async def every() -> bool:
            return len(await results(rt)) == 3

        await until(every, "every result")

        async def judged() -> bool:
            return any(s.name == "judge compare" for s in spans.get_finished_spans())

        await until(judged, "the shadow runs to be judged")
        found = await results(rt)

    produced = [(env, r) for env, r in found if r.idempotency_key != "untraced"]
    assert len(produced) == 2
    for env, _ in produced:
        assert env.traceparent.split("-")[1] == TRACE_ID, "the result carries the producer's trace"
        assert (b"traceparent", env.traceparent.encode()) in [
            (k.encode(), v) for k, v in env.headers()
        ]
    traced = [s for s in spans.get_finished_spans() if trace_of(s) == TRACE_ID]
    names = {s.name for s in traced}
    for stage, kind in [
        ("ingest", "TaskSubmitted"),
        ("execute", "RunSpawned"),
        ("verify", "RunExecuted"),
        ("tournament", "RunVerified"),
    ]:
        assert f"{stage} {kind}" in names, f"{stage} handled its message in the producer's trace"
    assert {"attempt solve", "model solve", "tool extract_number", "judge compare"} <= names
    ingest = next(s for s in traced if s.name == "ingest TaskSubmitted")
    assert ingest.parent is not None
    assert f"{ingest.parent.span_id:016x}" == "00f067aa0ba902b7", "a child of the producer's span"
    # The task produced without a trace: its ingest span is the root of a new one, which
    # every later stage continues and the result carries.
    (root,) = [
        s
        for s in spans.get_finished_spans()
        if s.name == "ingest TaskSubmitted" and trace_of(s) != TRACE_ID
    ]
    assert root.parent is None, "a new trace starts at ingest"
    new_trace = trace_of(root)
    (env,) = [env for env, r in found if r.idempotency_key == "untraced"]
    assert env.traceparent.split("-")[1] == new_trace
    assert (b"traceparent", env.traceparent.encode()) in [(k.encode(), v) for k, v in env.headers()]
    continued = {s.name for s in spans.get_finished_spans() if trace_of(s) == new_trace}
    assert {"execute RunSpawned", "verify RunExecuted", "attempt solve"} <= continued
    assert {trace_of(s) for s in spans.get_finished_spans() if "solve" in s.name} == {
        TRACE_ID,
        new_trace,
    }, "every attempt belongs to its task's trace"
