"""Deleting a tenant through the console's API, over a real embedded pipeline: the admin
token alone may; the tenant's waiting run leaves the console and every stage deletes its
part; another tenant's runs stay; a tenant's token, a cross-site request, an unknown
tenant or bad input send nothing; deleting again is a no-op."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import pytest_asyncio

from assay.bus.topics import TASKS, TENANTS, WORKFLOWS
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import StubJudge
from assay.kernel.ids import TenantId, tenant_id
from assay.messages import WorkflowRegistered
from assay.record import StateKey
from assay.record.erasure import tombstone_at
from assay.runtime.embedded import STAGES, Embedded
from assay.workflow import WorkflowDef, validate
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.outbox import EmbeddedOutbox
from assay_console.reads import ConsoleReads, RunFilters, SqliteRunsTable
from services.console.tests.test_console_actions import AWAIT, task, until_read, until_waiting
from tests.test_branch_grading import wait_for

GONE = tenant_id(str(uuid.uuid5(uuid.NAMESPACE_URL, "assay:console-delete:gone")))
KEPT = tenant_id(str(uuid.uuid5(uuid.NAMESPACE_URL, "assay:console-delete:kept")))
ADMIN = {"authorization": "Bearer token-admin"}
OWN = {"authorization": "Bearer token-gone"}
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]


@dataclass
class Console:
    client: httpx.AsyncClient
    reads: ConsoleReads
    rt: Embedded

    async def sent(self) -> int:
        return sum((await self.rt.bus.end_offsets(TENANTS)).values())

    async def runs(self, tenant: TenantId) -> int:
        return len((await self.reads.runs(tenant, RunFilters(), None, 10)).runs)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def console(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Console]:
    data = tmp_path_factory.mktemp("delete")
    stages = (*STAGES, "console")
    async with Embedded(
        data, stages=stages, partitions=2, model=StubModel(), judge=StubJudge()
    ) as rt:
        rt.start()
        wf = validate(WorkflowDef.model_validate(AWAIT), frozenset(BUILTIN_TOOLS))
        for tenant in (GONE, KEPT):
            msg = WorkflowRegistered(
                tenant=tenant, definition=wf.model_dump(mode="json", by_alias=True)
            )
            await rt.publish(WORKFLOWS, msg, tenant, idem=f"{tenant}:{wf.version}")
        await until_read(rt, "ingest", WORKFLOWS, 60)
        for tenant in (GONE, KEPT):  # a task before its workflow's allocation is refused

            async def current(tenant: TenantId = tenant) -> bool:
                return (
                    await rt.logs["ingest"].get(StateKey(tenant, "allocation", wf.id)) is not None
                )

            await wait_for(current, "the workflow to be current")
        await rt.publish_many([(TASKS, task(t, "waits", "gate"), t, "waits") for t in (GONE, KEPT)])
        reads = ConsoleReads(rt.logs["console"], SqliteRunsTable(data / "console.sqlite"))
        await until_waiting(reads, {GONE: 1, KEPT: 1}, 60)
        access = Access.parse(f"{GONE}=token-gone", "token-admin", "127.0.0.1")
        app = create_app(reads, access, EmbeddedOutbox(rt.bus))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://console") as c:
            yield Console(c, reads, rt)
        await reads.close()


UNKNOWN = "5c0c3a52-9b7e-4d2a-8f11-0e6f4a3b2c91"
"""A tenant nobody has: fixed, so every pytest worker collects the same test ids."""


@pytest.mark.parametrize(
    ("path", "headers", "body", "status", "names"),
    [
        (f"/api/tenants/{GONE}/delete", OWN, {}, 403, "only the admin"),
        (f"/api/tenants/{GONE}/delete", {}, {}, 401, "bearer token"),
        ("/api/tenants/not-a-tenant/delete", ADMIN, {}, 400, "not a UUID"),
        (f"/api/tenants/{UNKNOWN}/delete", ADMIN, {}, 404, "no such tenant"),
        (f"/api/tenants/{GONE}/delete", ADMIN, {"reason": "x" * 2001}, 400, "reason"),
        (f"/api/tenants/{GONE}/delete", ADMIN, {"extra": 1}, 400, "extra"),
        (f"/api/tenants/{GONE}/delete?tenant={GONE}", ADMIN, {}, 400, "unknown parameter"),
        (f"/api/tenants/{GONE}/delete", {**ADMIN, "origin": "http://evil"}, {}, 403, "origin"),
    ],
)
async def test_anything_but_the_admins_same_site_request_for_a_known_tenant_sends_nothing(
    console: Console, path: str, headers: dict[str, str], body: object, status: int, names: str
) -> None:
    before = await console.sent()
    answer = await console.client.post(path, json=body, headers=headers)
    assert answer.status_code == status
    assert names in answer.json()["detail"]
    assert await console.sent() == before
    assert await console.runs(GONE) == 1


async def test_a_form_post_is_refused(console: Console) -> None:
    answer = await console.client.post(
        f"/api/tenants/{GONE}/delete", content=b"reason=x", headers=ADMIN
    )
    assert answer.status_code == 415


async def test_the_admin_deletes_a_tenant_and_again_is_a_no_op(console: Console) -> None:
    path = f"/api/tenants/{GONE}/delete"
    done = await console.client.post(path, json={"reason": "closed"}, headers=ADMIN)
    assert done.status_code == 200, done.text
    assert done.json()["outcome"] == "applied"
    assert await console.runs(GONE) == 0
    assert await console.runs(KEPT) == 1
    state = await console.client.get(f"/api/tenants/{GONE}/deletion", headers=ADMIN)
    assert state.json()["deleted"] is True
    assert state.json()["reason"] == "closed"
    assert state.json()["command"] == done.json()["command"]
    own = await console.client.get(f"/api/tenants/{GONE}/deletion", headers=OWN)
    assert own.status_code == 403

    sent = await console.sent()
    again = await console.client.post(path, json={}, headers=ADMIN, params={"wait": "0"})
    assert again.status_code == 200
    assert again.json()["command"] == done.json()["command"]
    assert await console.sent() == sent

    # Every stage deletes its own part, the waiting run's execute records with it.
    for stage, log in console.rt.logs.items():
        for _ in range(200):
            if await log.get(tombstone_at(GONE)) is not None:
                break
            await until_read(console.rt, stage, TENANTS, 30)
        assert await log.get(tombstone_at(GONE)) is not None, stage
    assert await console.rt.logs["execute"].branches("tenant", GONE)
    assert await console.rt.logs["execute"].scan(GONE, "run") == []
    assert await console.rt.logs["execute"].scan(KEPT, "run")
