"""Admission by capacity end to end, embedded (§14.2): while one run holds most of the
declared VRAM, a task whose run cannot fit beside it is refused at admission — recorded,
announced, and given its result at once — never queued; once the first run ends, the
same workload is admitted again. A workflow naming a second model that cannot be
resident beside the pinned one is refused at registration."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from assay.bus import RESULTS, RUN_STATUS, TASKS, WORKFLOWS
from assay.engine.models import Completion, StubModel
from assay.kernel import RunState, tenant_id
from assay.messages import (
    MESSAGES,
    RunResult,
    RunStatusChanged,
    TaskSubmitted,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import StateKey
from assay.runtime import AssaySettings, Embedded
from assay.workflow import from_document

pytestmark = [pytest.mark.timeout(120)]

TENANT = tenant_id("6a1c2d3e-4f50-4a6b-8c7d-9e0f1a2b3c4d")
MODEL = "llama-8b"
CAPACITY = f"""
vram_bytes_per_device: 80GB
devices: 1
max_resident_models: 1
pinned: [{MODEL}]
models:
  - id: {MODEL}
    weights_bytes: 16060000000
    kv_bytes_per_token: 131072
  - id: qwen-7b
    weights_bytes: 15230000000
    kv_bytes_per_token: 57344
"""


def workflow(model: str = MODEL) -> dict[str, Any]:
    # 300k tokens x 131,072 B = 39.3 GB of KV: one run fits beside 16.06 GB of weights,
    # two (94.7 GB) do not fit 80 GB.
    return {
        "id": "long-context",
        "resources": {"model": model, "max_context_tokens": 300_000},
        "steps": [{"id": "solve", "kind": "model", "prompt": "{{ task.question }}"}],
    }


class GatedModel(StubModel):
    """The stub model, holding every call until `gate` opens: its run stays running."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.called = asyncio.Event()

    async def complete(self, prompt: str, *, max_tokens: int, seed: str) -> Completion:
        self.called.set()
        await self.gate.wait()
        return await super().complete(prompt, max_tokens=max_tokens, seed=seed)


async def messages(rt: Embedded, topic: str) -> list[Any]:
    out = []
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(topic, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            out.append(MESSAGES.decode(env.type, env.schema_version, env.payload))
    return out


async def until(check: Any, what: str) -> Any:
    deadline = time.monotonic() + 60
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_run_that_cannot_fit_is_refused_at_admission_never_queued(
    tmp_path: Path,
) -> None:
    (tmp_path / "capacity.yaml").write_text(CAPACITY)
    settings = AssaySettings.from_env({"ASSAY_CAPACITY_FILE": str(tmp_path / "capacity.yaml")})
    model = GatedModel()
    async with Embedded(tmp_path / "data", model=model, settings=settings) as rt:
        rt.start()
        wf = from_document(workflow())
        await rt.publish(
            WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=workflow()), TENANT, idem="wf"
        )
        await until(lambda: rt.logs["ingest"].get(StateKey(TENANT, "allocation", wf.id)), "routing")

        async def submit(key: str) -> None:
            task = TaskSubmitted(
                tenant=TENANT, idempotency_key=key, workflow_id=wf.id, input={"question": "1+1"}
            )
            await rt.publish(TASKS, task, TENANT, idem=key)

        async def accepted(key: str) -> dict[str, Any] | None:
            return await rt.logs["ingest"].get(StateKey(TENANT, "task", key))

        await submit("first")
        await asyncio.wait_for(model.called.wait(), 60)  # its run is running, holding KV
        await submit("second")
        second = await until(lambda: accepted("second"), "the second task's admission")
        assert second["runs"] == []
        [cut] = second["cut"]
        assert cut["reason"] == "capacity"
        assert cut["purpose"] == "work"
        assert "vram_bytes_per_device" in cut["detail"]
        assert "94.70 GB" in cut["detail"]

        async def refused_result() -> list[RunResult]:
            return [
                r
                for r in await messages(rt, RESULTS)
                if isinstance(r, RunResult) and r.idempotency_key == "second"
            ]

        [result] = await until(refused_result, "the refused task's result")
        assert (result.status, result.termination, result.score) == ("cancelled", "cancelled", None)
        statuses = [
            s
            for s in await messages(rt, RUN_STATUS)
            if isinstance(s, RunStatusChanged) and s.run.run_id == result.run_id
        ]
        assert [s.state for s in statuses] == [RunState.CANCELLED]
        assert statuses[0].detail.startswith("capacity: a run of 'long-context' needs 1 call(s)")
        assert rt.deps.admission.refused == {"capacity_vram_bytes_per_device": 1}

        model.gate.set()  # the first run finishes and lets its KV go
        await until(lambda: _has_result(rt, "first"), "the first task's result")
        await until(lambda: _released(rt), "the first run's KV to be released")
        await submit("third")
        third = await until(lambda: accepted("third"), "the third task's admission")
        assert len(third["runs"]) == 1
        assert third["cut"] == []


async def _has_result(rt: Embedded, key: str) -> bool:
    return any(
        isinstance(r, RunResult) and r.idempotency_key == key for r in await messages(rt, RESULTS)
    )


async def _released(rt: Embedded) -> bool:
    ledger = rt.deps.admission.ledger
    return ledger is not None and ledger.held == 0


async def test_a_second_model_that_cannot_be_resident_is_refused_at_registration(
    tmp_path: Path,
) -> None:
    (tmp_path / "capacity.yaml").write_text(CAPACITY)
    settings = AssaySettings.from_env({"ASSAY_CAPACITY_FILE": str(tmp_path / "capacity.yaml")})
    async with Embedded(tmp_path / "data", settings=settings, stages=("ingest",)) as rt:
        rt.start()
        for doc, idem in ((workflow("qwen-7b"), "qwen"), (workflow("unknown-1"), "unknown")):
            await rt.publish(
                WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=doc), TENANT, idem=idem
            )

        async def dead() -> list[str]:
            found = []
            for partition in range(rt.partitions):
                for m in await rt.bus.fetch("assay.dlq.ingest", partition, 0, 100, 0.0):
                    found.append(dict(m.headers).get("assay-dlq-reason", b"").decode())
            return found if len(found) == 2 else []

        reasons = sorted(await until(dead, "both registrations to be refused"))
        assert "max_resident_models=1" in reasons[0]
        assert "qwen-7b" in reasons[0]
        assert "model 'unknown-1' has no capacity profile" in reasons[1]
