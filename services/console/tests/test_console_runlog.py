"""A run's full log on the console, embedded: the console asks the data directory's
execute log (the same function execute answers with on its status port) and the run
page draws its attempts; another tenant's run answers 404 at the console and nothing
at execute."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from assay.bus.topics import TASKS, WORKFLOWS
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import StubJudge
from assay.kernel.ids import TenantId
from assay.messages import TaskSubmitted, WorkflowRegistered
from assay.runtime.embedded import STAGES, Embedded
from assay.workflow import WorkflowDef, validate
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.reads import ConsoleReads, RunFilters, SqliteRunsTable
from assay_console.runlog import DataDirRunLog
from assay_ingest.routing import Allocation
from services.console.tests.console_seed import HOSTILE, TENANT_A, TENANT_B

TOKENS = f"{TENANT_A}=token-a,{TENANT_B}=token-b"
A = {"authorization": "Bearer token-a"}
B = {"authorization": "Bearer token-b"}
STRIP = {
    "id": "strip-it",
    "steps": [{"id": "tidy", "kind": "tool", "tool": "strip", "args": {"text": "{{ task.k }}"}}],
    "transitions": [],
}
pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Served:
    data: Path
    reads: ConsoleReads
    runs: dict[TenantId, str]

    def client(self, with_log: bool = True) -> httpx.AsyncClient:
        run_log = DataDirRunLog(self.data) if with_log else None
        access = Access.parse(TOKENS, None, "127.0.0.1")
        app = create_app(self.reads, access, None, None, run_log)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c")


async def until_done(reads: ConsoleReads, tenant: TenantId, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        page = await reads.runs(tenant, RunFilters(), None, 1)
        detail = await reads.run(tenant, page.runs[0].run_id) if page.runs else None
        if detail is not None and detail.output is not None:
            return detail.run.run_id
        assert time.monotonic() < deadline, f"the run did not finish: {detail}"
        await asyncio.sleep(0.05)  # the read model folds from the topics: look again


async def until_allocated(rt: Embedded, tenant: TenantId, timeout_s: float = 60) -> None:
    """Wait until ingest holds the workflow's allocation (decide publishes it)."""
    deadline = time.monotonic() + timeout_s
    while await rt.logs["ingest"].get(Allocation.at(tenant, "strip-it")) is None:
        assert time.monotonic() < deadline, "ingest never got the workflow's allocation"
        await asyncio.sleep(0.05)  # the bus offers no wake-up for "a stage folded this"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    data = tmp_path_factory.mktemp("runlog")
    stages = (*STAGES, "console")
    async with Embedded(
        data, stages=stages, partitions=2, model=StubModel(), judge=StubJudge()
    ) as rt:
        rt.start()
        wf = validate(WorkflowDef.model_validate(STRIP), frozenset(BUILTIN_TOOLS))
        definition = wf.model_dump(mode="json", by_alias=True)
        for tenant in (TENANT_A, TENANT_B):
            msg = WorkflowRegistered(tenant=tenant, definition=definition)
            await rt.publish(WORKFLOWS, msg, tenant, idem=f"{tenant}:{wf.version}")
        # Ingest routes a task by the allocation decide publishes for the workflow.
        for tenant in (TENANT_A, TENANT_B):
            await until_allocated(rt, tenant)
        reads = ConsoleReads(rt.logs["console"], SqliteRunsTable(data / "console.sqlite"))
        runs = {}
        for tenant in (TENANT_A, TENANT_B):
            task = TaskSubmitted.model_validate(
                {
                    "tenant": tenant,
                    "workflow_id": "strip-it",
                    "idempotency_key": f"{tenant}-1",
                    "input": {"k": f"  {HOSTILE}  "},
                }
            )
            await rt.publish(TASKS, task, tenant, idem=f"{tenant}-1")
            runs[tenant] = await until_done(reads, tenant)
        yield Served(data, reads, runs)
        await reads.close()


async def test_a_runs_full_log_comes_from_executes_log(served: Served) -> None:
    run = served.runs[TENANT_A]
    async with served.client() as c:
        answer = await c.get(f"/api/runs/{run}/log", headers=A)
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert (view["run_id"], view["tenant"], view["status"]) == (run, str(TENANT_A), "succeeded")
    (step,) = view["branches"][0]["steps"]
    (attempt,) = step["attempts"]
    assert (step["step"], attempt["state"], attempt["output"]) == ("tidy", "succeeded", HOSTILE)


async def test_the_run_page_draws_its_attempts_and_escapes_their_output(served: Served) -> None:
    run = served.runs[TENANT_A]
    async with served.client() as c:
        page = await c.get(f"/runs/{run}", headers=A)
    assert page.status_code == 200
    assert '<svg id="attempts"' in page.text
    assert 'data-step="tidy" data-attempt="1" data-branch="0" data-state="succeeded"' in page.text
    assert HOSTILE not in page.text


async def test_another_tenants_run_log_is_not_reachable(served: Served) -> None:
    theirs = served.runs[TENANT_B]
    async with served.client() as c:
        by_a = await c.get(f"/api/runs/{theirs}/log", headers=A)
        named = await c.get(f"/api/runs/{theirs}/log", headers=A, params={"tenant": str(TENANT_B)})
        own = await c.get(f"/api/runs/{theirs}/log", headers=B)
    assert (by_a.status_code, by_a.json()) == (404, {"detail": "no such run"})
    assert named.status_code == 404
    assert own.status_code == 200
    # Execute's own answer is scoped too: the function it answers with sees no such run.
    assert await DataDirRunLog(served.data).view(TENANT_A, theirs) is None


async def test_without_a_way_to_execute_the_page_says_so(served: Served) -> None:
    run = served.runs[TENANT_A]
    async with served.client(with_log=False) as c:
        api = await c.get(f"/api/runs/{run}/log", headers=A)
        page = await c.get(f"/runs/{run}", headers=A)
        malformed = await c.get("/api/runs/nope/log", headers=A)
    assert api.status_code == 503
    assert page.status_code == 200
    assert 'id="attempts-missing"' in page.text
    assert malformed.status_code == 400
