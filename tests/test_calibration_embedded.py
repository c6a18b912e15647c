"""Scheduled calibration in embedded mode, end to end: two verified runs of one task —
a pass and a fail — make the tenant's calibration pair; the tournament's timer fires a
round on its own, the stub judge (which cannot tell the two apart: a draw both ways)
is metered as purpose `calibration`, its agreement is exported on `/metrics` and shown
by `assay grade health`; decide holds the challenger's promotion until a calibration
finds the judge recovered — at once, with no new evidence — and `assay ladder` shows
both; every record re-folds
identically."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from assay.bus import AGGREGATES, DECISIONS, TASKS, USAGE, WORKFLOWS
from assay.cli.health import health_command
from assay.cli.ladder import read_reports
from assay.cli.rebuild import rebuild
from assay.kernel import tenant_id
from assay.kernel.scores import WinRecord
from assay.messages import (
    MESSAGES,
    JudgeCalibrated,
    Promoted,
    Purpose,
    TaskSubmitted,
    UsageRecorded,
    VariantAggregate,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.runtime.settings import AssaySettings
from assay.workflow import WorkflowDef, from_document

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TENANT = tenant_id("6a1b2c3d-4e5f-4a60-8b7c-9d0e1f2a3b4c")
CALIBRATION = {"ASSAY_CALIBRATION_INTERVAL_S": "3600", "ASSAY_CALIBRATION_MIN_JUDGED": "2"}


def workflow(note: str) -> WorkflowDef:
    """A workflow whose verdict the task decides: its one step reads the task's number,
    and the verifier compares it with the task's answer (no model: the two episodes of
    the task are alike, so the stub judge can only call them a draw)."""
    return from_document(
        {
            "id": "calibrated",
            "steps": [
                {
                    "id": "answer",
                    "kind": "tool",
                    "tool": "extract_number",
                    "args": {"text": note + " {{ task.number }}"},
                }
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


V1 = workflow("the number is")
V2 = workflow("the number, once more, is")


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def on_bus(rt: Embedded, topic: str) -> list[Any]:
    found = []
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(topic, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            found.append(MESSAGES.decode(env.type, env.schema_version, env.payload))
    return found


async def gauge(port: int, name: str) -> float | None:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels.get("tenant") == str(TENANT):
                return float(s.value)
    return None


async def register(rt: Embedded, wf: WorkflowDef) -> None:
    definition = wf.model_dump(mode="json", by_alias=True)
    registered = WorkflowRegistered(tenant=TENANT, definition=definition)
    await rt.publish(WORKFLOWS, registered, TENANT, idem=wf.version)


def evidence(served: int, screened: int = 5) -> VariantAggregate:
    return VariantAggregate(
        tenant=TENANT,
        workflow_id=V2.id,
        workflow_version=V2.version,
        baseline_version=V1.version,
        record=WinRecord(judge_wins=6, verifier_wins=3),  # the sequential test accepts
        runs=9,
        passes=9,
        screened=screened,
        served=served,
    )


def recovered(stub: JudgeCalibrated) -> JudgeCalibrated:
    return stub.model_copy(update={"due_ms": stub.due_ms + 1, "agreed": 2, "agreement": 1.0})


async def test_a_scheduled_round_is_metered_exported_and_holds_promotion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    settings = AssaySettings.from_env(CALIBRATION)
    async with Embedded(data, partitions=4, settings=settings) as rt:
        status = await rt.serve_status(0)
        try:
            rt.start()
            await register(rt, V1)

            async def routed() -> bool:
                key = StateKey(TENANT, "allocation", V1.id)
                return await rt.logs["ingest"].get(key) is not None

            await until(routed, "the workflow to be routed")
            for n, answer in enumerate(("5", "6")):  # one task: a pass, then a fail
                task = TaskSubmitted(
                    tenant=TENANT,
                    workflow_id=V1.id,
                    idempotency_key=f"task-{n}",
                    input={"number": "5", "answer": answer},
                    task_key="five",
                )
                await rt.publish(TASKS, task, TENANT, idem=f"task-{n}")

            async def noted() -> bool:
                key = StateKey(TENANT, "judge_health", "latest")
                return await rt.logs["decide"].get(key) is not None

            await until(noted, "decide to hear of the first calibration round")
            assert await gauge(status.port, "assay_judge_verifier_agreement") == 0.0
            assert await gauge(status.port, "assay_judge_calibration_orderings") == 2

            (found,) = [m for m in await on_bus(rt, AGGREGATES) if isinstance(m, JudgeCalibrated)]
            assert (found.pairs, found.judged, found.draws, found.agreed) == (1, 2, 2, 0)
            calibration = [
                u
                for u in await on_bus(rt, USAGE)
                if isinstance(u, UsageRecorded) and u.purpose is Purpose.CALIBRATION
            ]
            assert len(calibration) == found.model_calls == 2
            assert {u.run_id for u in calibration} == {None}

            # A challenger climbs to trial, then would be promoted: held, and says why.
            await register(rt, V2)

            async def challenged() -> bool:
                doc = await rt.logs["decide"].get(StateKey(TENANT, "allocation", V1.id))
                return doc is not None and doc.get("challenger") == V2.version

            await until(challenged, "the challenger to be registered")
            await rt.publish(AGGREGATES, evidence(served=0), TENANT, idem="to-trial")
            held_on = evidence(served=5)
            await rt.publish(AGGREGATES, held_on, TENANT, idem="promote?")

            async def held() -> bool:
                doc = await rt.logs["decide"].get(
                    StateKey(TENANT, "ladder", f"{V1.id}/{V2.version}")
                )
                return doc is not None and doc.get("held") is not None

            await until(held, "the promotion to be held")
            (report,) = await read_reports(data, TENANT)
            assert "agreement 0% over 2 calibration orderings" in report["standing"]["held"]
            assert report["judge_calibration"]["agreement"] == 0.0

            # A later round finds the judge recovered: the held challenger is promoted at
            # once, on the evidence it was held on — no new evidence is published.
            await rt.publish(AGGREGATES, recovered(found), TENANT, idem="recovered")

            async def promoted() -> list[Promoted]:
                return [m for m in await on_bus(rt, DECISIONS) if isinstance(m, Promoted)]

            async def any_promoted() -> bool:
                return bool(await promoted())

            await until(any_promoted, "the promotion, released by the recovery")
            (promotion,) = await promoted()
            assert (promotion.workflow_version, promotion.record) == (V2.version, held_on.record)
            doc = await rt.logs["decide"].get(StateKey(TENANT, "judge_health", "latest"))
            assert doc is not None
            assert doc["agreement"] == 1.0
        finally:
            await status.close()

    for name, value in CALIBRATION.items():
        monkeypatch.setenv(name, value)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert await health_command(data, TENANT) == 0
    (health,) = json.loads(out.getvalue())
    shown = health["calibration"]
    assert (shown["scheduled"], shown["calls_today"], shown["calls_budget"]) == (True, 2, 200)
    (judge,) = shown["judges"]
    assert (judge["agreement"], judge["judged"], judge["source"]) == (0.0, 2, "verified_runs")
    assert "agreement 0%" in shown["promotion_held"]
    with contextlib.redirect_stdout(io.StringIO()):  # what the rounds recorded re-folds
        assert await rebuild(data, check=True, stages=["tournament", "decide"]) == 0
