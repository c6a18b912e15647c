"""Open proposals through the console: the list is the tenant's own proposals that wait
for review; reviewing one answers 200 once the console has folded the review; an
unknown or another tenant's proposal answers 404 from the console's own record, and
nothing is sent; a proposal's rationale renders escaped."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from assay.bus.topics import DECISIONS, WORKFLOWS
from assay.kernel.ids import TenantId, WorkflowId, WorkflowVersion
from assay.messages import ProposalRequested, Usage
from assay.runtime.embedded import Embedded
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.outbox import EmbeddedOutbox
from assay_console.reads import ConsoleReads, SqliteRunsTable
from services.console.tests.console_seed import HOSTILE, TENANT_A, TENANT_B, until_folded

A = {"authorization": "Bearer token-a"}
B = {"authorization": "Bearer token-b"}
ADMIN = {"authorization": "Bearer token-admin"}
TOKENS = f"{TENANT_A}=token-a,{TENANT_B}=token-b"
TO_APPROVE, TO_REJECT, UNGATED, HOSTILE_P, THEIRS = (f"{n:016x}" for n in range(1, 6))
pytestmark = pytest.mark.asyncio(loop_scope="module")


def proposal(
    tenant: TenantId, pid: str, workflow: str, *, gated: bool = True, why: str = ""
) -> Any:
    version = WorkflowVersion(f"{int(pid, 16):064x}")
    return ProposalRequested(
        tenant=tenant,
        workflow_id=WorkflowId(workflow),
        proposal_id=pid,
        workflow_version=version,
        parent=WorkflowVersion("a" * 64),
        after=WorkflowVersion("b" * 64),
        definition={"id": workflow},
        rationale=why or f"shorter answers ({pid})",
        proposer="catalog",
        evidence=[],
        usage=Usage(),
        gated=gated,
    )


@dataclass
class Console:
    client: httpx.AsyncClient
    rt: Embedded

    async def reviews(self) -> int:
        return sum((await self.rt.bus.end_offsets(WORKFLOWS)).values())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def console(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Console]:
    data = tmp_path_factory.mktemp("proposals")
    async with Embedded(data, stages=("console",), partitions=2) as rt:
        seeded = [
            proposal(TENANT_A, TO_APPROVE, "arith"),
            proposal(TENANT_A, TO_REJECT, "arith"),
            proposal(TENANT_A, UNGATED, "arith", gated=False),
            proposal(TENANT_A, HOSTILE_P, HOSTILE, why=HOSTILE),
            proposal(TENANT_B, THEIRS, "secret"),
        ]
        await rt.publish_many(
            [(DECISIONS, p, p.tenant, f"proposal:{p.proposal_id}") for p in seeded]
        )
        rt.start()
        await until_folded(rt)
        store = data / "console.sqlite"
        reads = ConsoleReads(rt.logs["console"], SqliteRunsTable(store))
        access = Access.parse(TOKENS, "token-admin", "127.0.0.1")
        app = create_app(reads, access, EmbeddedOutbox(rt.bus))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://console") as c:
            yield Console(c, rt)
        await reads.close()


async def listed(c: Console, headers: dict[str, str], **params: str) -> list[str]:
    answer = await c.client.get("/api/proposals", headers=headers, params=params)
    assert answer.status_code == 200, answer.text
    return [p["proposal_id"] for p in answer.json()["proposals"]]


async def test_the_list_holds_the_tenants_open_proposals_only(console: Console) -> None:
    mine = await listed(console, A)
    assert set(mine) >= {HOSTILE_P}
    assert UNGATED not in mine
    assert THEIRS not in mine
    assert await listed(console, B) == [THEIRS]
    assert await listed(console, ADMIN, tenant=str(TENANT_B)) == [THEIRS]
    foreign = await console.client.get(
        "/api/proposals", headers=A, params={"tenant": str(TENANT_B)}
    )
    assert foreign.status_code == 404
    odd = await console.client.get("/api/proposals", headers=A, params={"status": "all"})
    assert odd.status_code == 400
    assert "status" in odd.json()["detail"]


async def test_one_proposal_reads_back_for_its_tenant_only(console: Console) -> None:
    own = await console.client.get(f"/api/proposals/{THEIRS}", headers=B)
    assert own.status_code == 200
    assert (own.json()["workflow_id"], own.json()["status"]) == ("secret", "pending")
    for headers, pid in ((A, THEIRS), (B, "f" * 16)):
        answer = await console.client.get(f"/api/proposals/{pid}", headers=headers)
        assert answer.status_code == 404
        assert answer.json() == {"detail": "no such proposal"}
    bad = await console.client.get("/api/proposals/not-hex", headers=A)
    assert bad.status_code == 400
    assert "16 hex digits" in bad.json()["detail"]


@pytest.mark.parametrize(
    ("pid", "verb", "status"),
    [(TO_APPROVE, "approve", "approved"), (TO_REJECT, "reject", "rejected")],
)
async def test_a_review_answers_200_once_the_console_folded_it(
    console: Console, pid: str, verb: str, status: str
) -> None:
    body = {"workflow_id": "arith", "reason": HOSTILE}
    answer = await console.client.post(f"/api/proposals/{pid}/{verb}", json=body, headers=A)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["outcome"] == "applied"
    assert (got["proposal"]["status"], got["proposal"]["review"]) == (status, HOSTILE)
    assert pid not in await listed(console, A)
    again = await console.client.post(f"/api/proposals/{pid}/{verb}", json=body, headers=A)
    assert again.status_code == 409
    assert status in again.json()["detail"]


@pytest.mark.parametrize(
    ("headers", "pid", "workflow"),
    [
        (A, THEIRS, "secret"),  # another tenant's
        (A, "f" * 16, "arith"),  # unknown
        (A, HOSTILE_P, "arith"),  # of another workflow
        (B, TO_REJECT, "arith"),
    ],
)
@pytest.mark.parametrize("verb", ["approve", "reject"])
async def test_an_unknown_or_foreign_proposal_answers_404_and_sends_nothing(
    console: Console, headers: dict[str, str], pid: str, workflow: str, verb: str
) -> None:
    before = await console.reviews()
    body = {"workflow_id": workflow, "reason": HOSTILE}
    answer = await console.client.post(f"/api/proposals/{pid}/{verb}", json=body, headers=headers)
    assert answer.status_code == 404, answer.text
    assert answer.json() == {"detail": "no such proposal"}
    assert await console.reviews() == before


async def test_an_ungated_proposal_is_not_reviewed(console: Console) -> None:
    before = await console.reviews()
    body = {"workflow_id": "arith"}
    answer = await console.client.post(f"/api/proposals/{UNGATED}/reject", json=body, headers=A)
    assert answer.status_code == 409
    assert "approved" in answer.json()["detail"]
    assert await console.reviews() == before


async def test_the_page_is_one_click_from_the_overview_and_escapes(console: Console) -> None:
    overview = await console.client.get("/", headers=B)
    assert f'href="/proposals?tenant={TENANT_B}">open proposals: 1</a>' in overview.text
    assert (await console.client.get("/api/overview", headers=B)).json()["open_proposals"] == 1
    page = await console.client.get("/proposals", headers=A)
    assert page.status_code == 200
    assert f'data-proposal="{HOSTILE_P}"' in page.text
    assert 'data-verb="approve"' in page.text
    assert 'data-verb="reject"' in page.text
    assert "<script>window" not in page.text
    assert "&lt;script&gt;" in page.text
    assert THEIRS not in page.text
    script = await console.client.get("/static/proposals.js")
    assert script.status_code == 200
    assert "window.confirm" in script.text


async def test_the_openapi_document_names_the_list() -> None:
    from assay_console.openapi import document

    paths = document()["paths"]
    assert "get" in paths["/api/proposals"]
    assert "get" in paths["/api/proposals/{proposal}"]
