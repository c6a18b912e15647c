"""Replay's spend ceiling end to end, embedded (§12.4, §14.1).

Two tenants run the same contest — a challenger on the shadow rung, every task
replayed under it — one with a small replay ceiling, one without. Every work run
of both must end with its result; the small tenant's shadow runs must stay within
what its ceiling reserves, its cut ones never reach grading, and the other tenant
must not notice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from assay.bus import RESULTS, TASKS, WORKFLOWS
from assay.grading.ladder import LadderPolicy
from assay.kernel import TenantId, tenant_id
from assay.messages import (
    MESSAGES,
    RunResult,
    TaskSubmitted,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.workflow import WorkflowDef, from_document

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SMALL = tenant_id("0b6f8f0e-3c1d-4f7e-9b2a-5d6c7e8f9a01")
LARGE = tenant_id("0b6f8f0e-3c1d-4f7e-9b2a-5d6c7e8f9a02")
BUDGET = 10  # each run's model-call budget: what one shadow run reserves
CEILING = 25  # SMALL's replay ceiling: two shadow runs fit
TASKS_EACH = 5


def version(prompt: str) -> WorkflowDef:
    return from_document(
        {
            "id": "arith-replay",
            "budget": {"max_model_calls": BUDGET},
            "steps": [
                {"id": "solve", "kind": "model", "prompt": prompt, "max_tokens": 32},
                {
                    "id": "answer",
                    "kind": "tool",
                    "tool": "extract_number",
                    "args": {"text": "{{ steps.solve.output }}"},
                },
            ],
            "verifiers": [
                {
                    "id": "correct",
                    "kind": "exact",
                    "step": "answer",
                    "expected": "{{ task.answer }}",
                }
            ],
        }
    )


V1 = version("What is {{ task.question }}?")
V2 = version("Compute {{ task.question }}.")


async def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def contest(rt: Embedded, tenant: TenantId) -> None:
    """V1 current, V2 its challenger on shadow, and ingest routing by that."""
    for wf in (V1, V2):
        document = wf.model_dump(mode="json", by_alias=True)
        registered = WorkflowRegistered(tenant=tenant, definition=document)
        await rt.publish(WORKFLOWS, registered, tenant, idem=wf.version)

        async def routed(wf: WorkflowDef = wf) -> bool:
            alloc = await rt.logs["ingest"].get(StateKey(tenant, "allocation", wf.id))
            return alloc is not None and wf.version in (alloc["current"], alloc.get("challenger"))

        await wait_for(routed, 60, f"{wf.version[:12]} to be routed for {tenant}")


async def results(rt: Embedded) -> list[RunResult]:
    out = []
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(RESULTS, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
            if isinstance(msg, RunResult):
                out.append(msg)
    return out


async def meter(rt: Embedded, stage: str, tenant: TenantId, key: str) -> dict[str, Any]:
    doc = await rt.logs[stage].get(StateKey(tenant, "meter", key))
    return doc or {}


async def test_a_small_replay_ceiling_bounds_one_tenants_shadow_spend_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASSAY_REPLAY_CEILINGS", f"{SMALL}={CEILING}")
    ladder = LadderPolicy(min_shadow_runs=100)  # the challenger stays on shadow throughout
    async with Embedded(tmp_path / "data", shadow_rate=1.0, ladder=ladder) as rt:
        rt.start()
        for tenant in (SMALL, LARGE):
            await contest(rt, tenant)
        for tenant in (SMALL, LARGE):
            for i in range(TASKS_EACH):
                task = TaskSubmitted(
                    tenant=tenant,
                    workflow_id=V1.id,
                    idempotency_key=f"task-{i}",
                    input={"question": f"{i} + 1", "answer": str(i + 1)},
                )
                await rt.publish(TASKS, task, tenant, idem=f"task-{i}")

        async def all_served() -> bool:
            return len(await results(rt)) == 2 * TASKS_EACH

        await wait_for(all_served, 180, "every work run's result")

        async def replays_graded() -> bool:
            small = await rt.logs["tournament"].scan(SMALL, "replay")
            large = await rt.logs["tournament"].scan(LARGE, "replay")
            return (len(small), len(large)) == (2, TASKS_EACH)

        await wait_for(replays_graded, 120, "every admitted shadow run to be graded")
        served = await results(rt)
        for tenant in (SMALL, LARGE):  # every work run ran and was reported, ceiling or not
            mine = [r for r in served if r.tenant == tenant]
            assert sorted(r.idempotency_key for r in mine) == [f"task-{i}" for i in range(5)]
            assert all(r.workflow_version == V1.version for r in mine)
            assert all(r.termination == "succeeded" and r.held_out is not None for r in mine)
        admitted = await meter(rt, "ingest", SMALL, "replay")
        assert (admitted["runs_total"], admitted["cut_total"]) == (2, TASKS_EACH - 2)
        assert admitted["calls_total"] <= CEILING
        spent = [doc for _, doc in await rt.logs["tournament"].scan(SMALL, "replay")]
        assert 0 < sum(d["model_calls"] for d in spent) <= admitted["calls_total"]
        other = await meter(rt, "ingest", LARGE, "replay")
        assert (other["runs_total"], other["cut_total"]) == (TASKS_EACH, 0)
        tallies = await rt.logs["aggregate"].get(StateKey(SMALL, "version", V2.version))
        assert tallies is not None
        assert tallies["runs"] == 2  # a cut run is never graded, never evidence either way
