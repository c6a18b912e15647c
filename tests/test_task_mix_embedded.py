"""Task-mix drift in embedded mode, end to end (§12.5): a workflow watching its tasks'
language takes its first window as the reference; a window that speaks another
language is announced, exported on `/metrics` as `assay_task_mix_psi`, shown by `assay
ladder`, and holds a challenger's promotion in decide; `assay ladder ack-drift` makes
the drifted mix the reference, which promotes the held challenger at once, on the
evidence it was held on (no new evidence is published). Every record re-folds
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

from assay.bus import AGGREGATES, DECISIONS, TASKS, WORKFLOWS
from assay.cli.drift import ack_drift_command
from assay.cli.ladder import read_reports
from assay.cli.rebuild import rebuild
from assay.kernel import tenant_id
from assay.kernel.errors import AssayError
from assay.kernel.scores import WinRecord
from assay.messages import (
    MESSAGES,
    Promoted,
    TaskSubmitted,
    VariantAggregate,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.workflow import WorkflowDef, from_document

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TENANT = tenant_id("7b2c3d4e-5f60-4a71-8c8d-9e0f1a2b3c4d")
WINDOW = 20


def workflow(note: str) -> WorkflowDef:
    """One tool step (no model), watching the task's language."""
    return from_document(
        {
            "id": "greeting",
            "steps": [
                {
                    "id": "answer",
                    "kind": "tool",
                    "tool": "extract_number",
                    "args": {"text": note + " {{ task.number }}"},
                }
            ],
            "drift": {"features": ["input.language"], "window": WINDOW, "threshold": 0.2},
        }
    )


V1 = workflow("the number is")
V2 = workflow("the number, once more, is")


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def decisions(rt: Embedded) -> list[Any]:
    found = []
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(DECISIONS, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            found.append(MESSAGES.decode(env.type, env.schema_version, env.payload))
    return found


async def psi_gauge(port: int) -> float | None:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "assay_task_mix_psi" and s.labels.get("tenant") == str(TENANT):
                assert s.labels["workflow"] == "greeting"
                return float(s.value)
    return None


async def register(rt: Embedded, wf: WorkflowDef) -> None:
    definition = wf.model_dump(mode="json", by_alias=True)
    await rt.publish(WORKFLOWS, WorkflowRegistered(tenant=TENANT, definition=definition), TENANT)


async def tasks(rt: Embedded, first: int, n: int, language: str) -> None:
    await rt.publish_many(
        [
            (
                TASKS,
                TaskSubmitted(
                    tenant=TENANT,
                    workflow_id=V1.id,
                    idempotency_key=f"task-{i}",
                    input={"number": str(i), "language": language},
                ),
                TENANT,
                f"task-{i}",
            )
            for i in range(first, first + n)
        ]
    )


def evidence(served: int) -> VariantAggregate:
    return VariantAggregate(
        tenant=TENANT,
        workflow_id=V2.id,
        workflow_version=V2.version,
        baseline_version=V1.version,
        record=WinRecord(judge_wins=6, verifier_wins=3),  # the sequential test accepts
        runs=9,
        passes=9,
        screened=5,
        served=served,
    )


async def test_a_drifted_mix_is_exported_shown_and_holds_promotion_until_acknowledged(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    async with Embedded(data, partitions=4) as rt:
        status = await rt.serve_status(0)
        try:
            rt.start()
            await register(rt, V1)

            async def doc(stage: str, kind: str) -> dict[str, Any] | None:
                return await rt.logs[stage].get(StateKey(TENANT, kind, V1.id))

            async def routed() -> bool:
                return await doc("ingest", "allocation") is not None

            await until(routed, "the workflow to be routed")
            await tasks(rt, 0, WINDOW, "en")
            await tasks(rt, WINDOW, WINDOW, "fr")

            async def held_by_decide() -> bool:
                return await doc("decide", "task_mix_hold") is not None

            await until(held_by_decide, "decide to hold on the drift")
            psi = await psi_gauge(status.port)
            assert psi is not None
            assert psi > 0.2

            # A challenger climbs to trial, then would be promoted: held by the drift.
            await register(rt, V2)

            async def challenged() -> bool:
                alloc = await doc("decide", "allocation")
                return alloc is not None and alloc.get("challenger") == V2.version

            await until(challenged, "the challenger to be registered")
            await rt.publish(AGGREGATES, evidence(served=0), TENANT, idem="to-trial")
            held_on = evidence(served=5)
            await rt.publish(AGGREGATES, held_on, TENANT, idem="promote?")

            async def held() -> bool:  # the challenger's standing: `<workflow>/<version>`
                key = StateKey(TENANT, "ladder", f"{V1.id}/{V2.version}")
                standing = await rt.logs["decide"].get(key)
                return standing is not None and standing.get("held") is not None

            await until(held, "the promotion to be held")
        finally:
            await status.close()

    (report,) = await read_reports(data, TENANT)
    assert report["standing"]["held"].startswith("task mix drifted: PSI ")
    shown = report["task_mix"]
    assert (shown["drifted"], shown["holds_promotion"], shown["sampled"]) == (True, True, 40)
    assert shown["reference_cause"] == "first_window"
    assert shown["psi"]["input.language"] == pytest.approx(psi)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert await ack_drift_command(data, "greeting", TENANT, "the French launch") == 0
    acknowledged = json.loads(out.getvalue())
    assert acknowledged["holds_promotion"] is False
    assert not acknowledged["drifted"]
    # the release promoted the held challenger at once, and a promotion retakes the
    # reference too: the watch shows whichever of the two it read last
    assert acknowledged["reference_cause"] in ("acknowledged", "promoted")
    with pytest.raises(AssayError, match="no task-mix drift to acknowledge"):
        await ack_drift_command(data, "greeting", TENANT, "again")

    # The acknowledgement's run above released the hold and promoted (or, stopped between
    # the two, this one does): its decisions are on the partitions it ran with, the
    # default's, so read them with that many.
    async with Embedded(data) as rt:
        rt.start()

        async def promoted() -> bool:
            return any(isinstance(m, Promoted) for m in await decisions(rt))

        await until(promoted, "the promotion, released by the acknowledgement")
        (promotion,) = [m for m in await decisions(rt) if isinstance(m, Promoted)]
        assert (promotion.workflow_version, promotion.record) == (V2.version, held_on.record)

    with contextlib.redirect_stdout(io.StringIO()):  # what the watch recorded re-folds
        assert await rebuild(data, check=True, stages=["ingest", "decide"]) == 0
