"""Task intake, workflow registration, `/metrics` and health on the embedded process's one
port, in process: what is submitted runs to a result; another tenant, bad input and a
cross-site form are refused with nothing produced."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from assay.bus.topics import TASKS
from assay.engine import StubModel
from assay.grading import StubJudge
from assay.runtime.embedded import STAGES, Embedded
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.embedded_server import process_routes
from assay_console.outbox import EmbeddedOutbox
from assay_console.reads import ConsoleReads, SqliteRunsTable
from services.console.tests.console_seed import HOSTILE, TENANT_A, TENANT_B

ROOT = Path(__file__).resolve().parents[3]
TOKENS = f"{TENANT_A}=token-a,{TENANT_B}=token-b"
A = {"authorization": "Bearer token-a"}
B = {"authorization": "Bearer token-b"}
pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Port:
    client: httpx.AsyncClient
    rt: Embedded

    async def tasks(self) -> int:
        return sum((await self.rt.bus.end_offsets(TASKS)).values())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def port(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Port]:
    data = tmp_path_factory.mktemp("intake")
    stages = (*STAGES, "console")
    async with Embedded(
        data, stages=stages, partitions=2, model=StubModel(), judge=StubJudge()
    ) as rt:
        rt.start()
        reads = ConsoleReads(rt.logs["console"], SqliteRunsTable(data / "console.sqlite"))
        access = Access.parse(TOKENS, None, "127.0.0.1")
        app = create_app(reads, access, EmbeddedOutbox(rt.bus))
        app.router.routes[:0] = [*process_routes(rt, access)]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://port") as c:
            yield Port(c, rt)
        await reads.close()


def arith() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples/workflows/arith-v1.yaml").read_text())
    return doc


def total(text: str, name: str) -> float:
    families = text_string_to_metric_families(text)
    return sum(s.value for f in families for s in f.samples if s.name == name)


async def test_submitted_tasks_run_to_results_and_metrics_move(port: Port) -> None:
    before = (await port.client.get("/metrics")).text
    registered = await port.client.post("/api/workflows", json={"definition": arith()}, headers=A)
    assert registered.status_code == 200, registered.text
    assert registered.json()["read"] is True
    tasks = [
        {"workflow_id": "arith", "idempotency_key": f"k{n}", "input": {"question": f"{n} + 1"}}
        for n in range(3)
    ]
    answer = await port.client.post("/api/tasks", json=tasks, headers=A)
    assert answer.status_code == 202, answer.text
    assert answer.json() == {"submitted": 3, "idempotency_keys": ["k0", "k1", "k2"]}
    deadline = time.monotonic() + 60
    while True:
        runs = (await port.client.get("/api/runs", headers=A)).json()["runs"]
        if len([r for r in runs if r["status"] is not None]) == 3:
            break
        assert time.monotonic() < deadline, runs
        await asyncio.sleep(0.05)  # the read model folds from the topics: look again
    after = (await port.client.get("/metrics")).text
    assert total(after, "assay_run_transitions_total") > total(
        before, "assay_run_transitions_total"
    )
    assert (await port.client.get("/api/runs", headers=B)).json()["runs"] == []
    assert (await port.client.get("/healthz")).json()["ok"] is True
    assert (await port.client.get("/readyz")).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "names"),
    [
        ("/api/tasks", {"idempotency_key": "x", "input": {}}, A, 400, "workflow_id"),
        ("/api/tasks", [], A, 400, "between 1 and 1000"),
        ("/api/tasks", [7], A, 400, "task 0: expected an object"),
        (
            "/api/tasks",
            {"tenant": str(TENANT_A), "workflow_id": "arith", "idempotency_key": HOSTILE},
            B,
            404,
            "no such tenant",
        ),
        ("/api/tasks", {"workflow_id": "arith"}, {}, 401, "bearer token"),
        ("/api/workflows", {"definition": {"id": "w", "steps": "no"}}, A, 400, "steps"),
        ("/api/workflows", {"definition": {}, "colour": 1}, A, 400, "colour"),
        (
            "/api/workflows",
            {"definition": {"id": "w", "steps": [{"id": "s", "kind": "tool", "tool": "nope"}]}},
            A,
            400,
            "nope",
        ),
    ],
)
async def test_bad_intake_names_the_problem_and_produces_nothing(
    port: Port, path: str, body: Any, headers: dict[str, str], status: int, names: str
) -> None:
    before = await port.tasks()
    answer = await port.client.post(path, json=body, headers=headers)
    assert answer.status_code == status, answer.text
    assert names in answer.json()["detail"]
    assert await port.tasks() == before


async def test_a_cross_site_form_cannot_submit(port: Port) -> None:
    before = await port.tasks()
    form = await port.client.post("/api/tasks", data={"workflow_id": "arith"}, headers=A)
    assert form.status_code == 415
    foreign = await port.client.post(
        "/api/tasks", json={}, headers={**A, "origin": "https://evil.example"}
    )
    assert foreign.status_code == 403
    assert await port.tasks() == before
