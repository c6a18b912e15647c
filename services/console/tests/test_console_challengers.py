"""The console's workflows data under several live challengers: the list and the
ladder show every challenger with its rung and share, and each is `challenger` in the
version DAG — for its tenant only."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from itertools import count
from typing import Any

import httpx
import pytest
import pytest_asyncio

from assay.bus.topics import DECISIONS, WORKFLOWS
from assay.kernel.ids import WorkflowId
from assay.messages import AllocationChanged, Ladder, LiveChallenger, Rung, WorkflowRegistered
from assay.runtime.embedded import Embedded
from assay.store.sqlite import SqliteEventLog
from assay.workflow import from_document
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.reads import ConsoleReads, SqliteRunsTable
from assay_console.stage import CONSOLE_EVENTS, RUNS_TABLE, fold_console
from services.console.tests.console_seed import TENANT_A, until_folded

A = {"authorization": "Bearer token-a"}
B = {"authorization": "Bearer token-b"}
WORKFLOW = "contest"
pytestmark = pytest.mark.asyncio(loop_scope="module")


def definition(note: str) -> dict[str, Any]:
    return {
        "id": WORKFLOW,
        "description": note,
        "steps": [{"id": "solve", "kind": "model", "prompt": "What is {{ task.question }}?"}],
        "grading": {"strategy": "tournament", "challengers": 2},
    }


DEFS = [definition(n) for n in ("control", "concise", "careful")]
V = [from_document(d).version for d in DEFS]


def allocation() -> AllocationChanged:
    return AllocationChanged(
        tenant=TENANT_A,
        workflow_id=WorkflowId(WORKFLOW),
        generation=4,
        current=V[0],
        challengers=[
            LiveChallenger(version=V[1], rung=Rung.RAMP, ladder=Ladder.RESOURCED),
            LiveChallenger(version=V[2], rung=Rung.CANARY, ladder=Ladder.RESOURCED),
        ],
        shares={V[0]: 0.75, V[1]: 0.2, V[2]: 0.05},
        shadow_rate=1.0,
        definitions=dict(zip(V, DEFS, strict=True)),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    data = tmp_path_factory.mktemp("challengers")
    ticks = count()
    t0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
    async with Embedded(
        data, stages=("console",), partitions=4, clock=lambda: t0 + timedelta(minutes=next(ticks))
    ) as rt:
        msgs = [(WORKFLOWS, WorkflowRegistered(tenant=TENANT_A, definition=d)) for d in DEFS]
        for n, (topic, msg) in enumerate([*msgs, (DECISIONS, allocation())]):
            await rt.publish_many([(topic, msg, TENANT_A, f"contest:{n}")])
        rt.start()
        await until_folded(rt)
    store = data / "console.sqlite"
    log = await SqliteEventLog(store, CONSOLE_EVENTS, fold_console, tables=(RUNS_TABLE,)).open()
    reads = ConsoleReads(log, SqliteRunsTable(store))
    tokens = "{}=token-a,{}=token-b".format(TENANT_A, "00000000-0000-4000-8000-0000000000bb")
    app = create_app(reads, Access.parse(tokens, None, "127.0.0.1"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console") as c:
        yield c
    await reads.close()
    await log.close()


async def test_the_list_shows_every_live_challenger_and_its_share(
    client: httpx.AsyncClient,
) -> None:
    (row,) = (await client.get("/api/workflows", headers=A)).json()["workflows"]
    assert (row["current"], row["challenger"], row["rung"], row["share"]) == (
        V[0],
        V[1],
        "ramp",
        0.2,
    )
    assert row["challengers"] == [
        {"version": V[1], "rung": "ramp", "share": 0.2},
        {"version": V[2], "rung": "canary", "share": 0.05},
    ]


async def test_the_ladder_names_both_challengers_and_the_split(
    client: httpx.AsyncClient,
) -> None:
    detail = (await client.get(f"/api/workflows/{WORKFLOW}", headers=A)).json()
    status = {v["version"]: v["status"] for v in detail["versions"]}
    assert status == {V[0]: "current", V[1]: "challenger", V[2]: "challenger"}
    (rung,) = detail["rungs"]
    assert rung["shares"] == {V[0]: 0.75, V[1]: 0.2, V[2]: 0.05}


async def test_another_tenant_sees_none_of_it(client: httpx.AsyncClient) -> None:
    assert (await client.get("/api/workflows", headers=B)).json()["workflows"] == []
    assert (await client.get(f"/api/workflows/{WORKFLOW}", headers=B)).status_code == 404


async def test_the_workflow_page_lists_the_live_challengers(client: httpx.AsyncClient) -> None:
    page = await client.get(f"/workflows/{WORKFLOW}", params={"tenant": str(TENANT_A)}, headers=A)
    assert page.status_code == 200
    html = page.text
    assert 'id="live-challengers"' in html
    assert html.count('class="live-challenger"') == 2
    assert html.index(V[1]) < html.index(V[2])  # in the order admitted
