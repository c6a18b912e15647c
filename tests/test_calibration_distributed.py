"""Scheduled calibration in distributed mode: stage processes on a real broker, Postgres
and S3. A task's pass and fail make the tenant's calibration pair; the tournament
process's timer fires the round; its calls reach `assay.usage` as purpose
`calibration` with no run, its agreement is on the tournament's `/metrics`, decide
records it in its schema, and `assay grade health` shows it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from assay.devstack import Service
from assay.devstack.deployment import ASSAY, Deployment, deploy
from tests.pipeline import produce, read_topic, register, task_records, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.kafka,
    pytest.mark.postgres,
    pytest.mark.s3,
    pytest.mark.timeout(300),
]

CALIBRATION = {"ASSAY_CALIBRATION_INTERVAL_S": "3600", "ASSAY_CALIBRATION_MIN_JUDGED": "2"}
WORKFLOW = {
    "id": "calibrated",
    "steps": [
        {
            "id": "answer",
            "kind": "tool",
            "tool": "extract_number",
            "args": {"text": "the number is {{ task.number }}"},
        }
    ],
    "verifiers": [
        {"id": "correct", "kind": "exact", "step": "answer", "expected": "{{ task.answer }}"}
    ],
}


@pytest.fixture(scope="module")
def deployment(
    postgres: Service, s3: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    d = asyncio.run(
        deploy(tmp_path_factory.mktemp("calibration"), postgres, s3, extra_env=CALIBRATION)
    )
    try:
        yield d
    finally:
        d.stop()


async def judge_health(d: Deployment, tenant: str) -> dict[str, Any] | None:
    rows = await d.query(
        "SELECT value FROM decide.state WHERE tenant = $1 AND kind = 'judge_health' AND key = $2",
        uuid.UUID(tenant),
        "latest",
    )
    return json.loads(rows[0]["value"]) if rows else None


async def test_a_round_fires_in_the_tournament_process_and_reaches_decide(
    deployment: Deployment, tmp_path: Path
) -> None:
    d = deployment
    tenant = str(uuid.uuid4())
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(WORKFLOW))
    register(d, tenant, path)

    async def routed() -> bool:
        rows = await d.query(
            "SELECT 1 FROM ingest.state WHERE tenant = $1 AND kind = 'allocation' AND key = $2",
            uuid.UUID(tenant),
            "calibrated",
        )
        return bool(rows)

    await wait_for("the workflow to be routed", routed)
    tasks = [
        {"idempotency_key": f"t{n}", "input": {"number": "5", "answer": a}, "task_key": "five"}
        for n, a in enumerate(("5", "6"))
    ]
    await produce(d.bootstrap, task_records(tenant, tasks, workflow="calibrated"))

    async def noted() -> bool:
        return await judge_health(d, tenant) is not None

    await wait_for("decide to record the tenant's first calibration", noted, 120)
    health = await judge_health(d, tenant)
    assert health is not None
    assert (health["pairs"], health["judged"], health["agreed"]) == (1, 2, 0)

    def calibration_calls(records: list[Any]) -> list[dict[str, Any]]:
        payloads = [json.loads(r.value)["payload"] for r in records]
        return [p for p in payloads if p["tenant"] == tenant and p["purpose"] == "calibration"]

    usage = await read_topic(
        d.bootstrap, "assay.usage", lambda rs: len(calibration_calls(rs)) >= 2, 30
    )
    calls = calibration_calls(usage)
    assert len(calls) == 2
    assert {c["run_id"] for c in calls} == {None}

    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"http://127.0.0.1:{d.ports['tournament']}/metrics")).text
    agreement = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "assay_judge_verifier_agreement" and s.labels.get("tenant") == tenant
    ]
    assert agreement == [0.0]

    env = {**d.env, **CALIBRATION, "ASSAY_DATABASE_URL": d.admin_dsn}
    done = await asyncio.to_thread(
        subprocess.run,
        [ASSAY, "grade", "health", "--tenant", tenant],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    (shown,) = json.loads(done.stdout)
    assert shown["calibration"]["calls_today"] == 2
    assert "agreement 0%" in shown["calibration"]["promotion_held"]
