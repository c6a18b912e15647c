"""A run's full log on the console, embedded: the console asks the data directory's
execute log (the same function execute answers with on its status port) and the run
page draws its attempts, its intents with every state they reached, and its branch
tree; another tenant's run answers 404 at the console and nothing at execute."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

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
from services.console.tests.branch_seed import seed_branched_run
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
    branched: str
    """Tenant A's run with an intent and two branched children."""
    group: str
    """Tenant A's rollout group (its task key)."""

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


async def until_closed(
    reads: ConsoleReads, tenant: TenantId, group: str, timeout_s: float = 60
) -> None:
    deadline = time.monotonic() + timeout_s
    while await reads.rollout_result(tenant, group) is None:
        assert time.monotonic() < deadline, "the rollout group's result never came"
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
        group = f"rollout-{HOSTILE}"
        task = TaskSubmitted.model_validate(
            {
                "tenant": TENANT_A,
                "workflow_id": "strip-it",
                "idempotency_key": group,
                "input": {"k": "x"},
                "rollout": {"n": 2},
            }
        )
        await rt.publish(TASKS, task, TENANT_A, idem=group)
        branched = await seed_branched_run(rt, reads, TENANT_A, f"branched-{HOSTILE}", HOSTILE)
        await until_closed(reads, TENANT_A, group)
        yield Served(data, reads, runs, branched, group)
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


async def test_a_runs_intents_and_branch_tree_come_from_executes_log(served: Served) -> None:
    async with served.client() as c:
        answer = await c.get(f"/api/runs/{served.branched}/tree", headers=A)
    assert answer.status_code == 200, answer.text
    tree = answer.json()
    assert (tree["run_id"], tree["live_branch"]) == (served.branched, 2)
    # The write on the root branch: its intent reached every state, in order.
    (write,) = [i for i in tree["intents"] if i["branch"] == 0]
    assert (write["step"], write["tool"], write["state"]) == ("write", "write_file", "committed")
    assert [s["state"] for s in write["states"]] == ["pending", "dispatched", "committed"]
    assert write["idempotency_key"]
    # The children forked after `write` do not write again.
    assert {i["branch"] for i in tree["intents"]} == {0}
    nodes = {b["branch"]: b for b in tree["branches"]}
    assert nodes[0]["children"] == [1, 2]
    assert [(nodes[b]["parent"], nodes[b]["fork"]) for b in (1, 2)] == [(0, "Forked")] * 2
    assert nodes[1]["fork_lsn"] == nodes[2]["fork_lsn"]
    assert (nodes[1]["status"], nodes[1]["failed_step"]) == ("failed", "tidy")
    assert (nodes[2]["live"], nodes[2]["status"]) == (True, "succeeded")
    (branching,) = tree["branchings"]
    assert (branching["after_step"], branching["from_branch"]) == ("write", 0)
    assert branching["at_lsn"] == nodes[1]["fork_lsn"]
    first, second = branching["children"]
    assert first["label"] == f"no-strip {HOSTILE}"
    assert first["deltas"] == ["tool_unavailable:strip"]
    assert (first["status"], first["diverged_at"]) == ("failed", "tidy")
    assert first["why"] == "it failed here and succeeded in the parent"
    assert second["deltas"] == ["model_params:solve(max_tokens=8)"]
    assert second["status"] == "succeeded"
    # Each child's verifier outcome shows once its result came back.
    deadline = time.monotonic() + 60
    while None in (verified := [c["verification"] for c in branching["children"]]):
        assert time.monotonic() < deadline, f"the children were never verified: {verified}"
        await asyncio.sleep(0.05)  # execute records it when the child's result comes back
        async with served.client() as c:
            tree = (await c.get(f"/api/runs/{served.branched}/tree", headers=A)).json()
        (branching,) = tree["branchings"]
    first, second = branching["children"]
    assert (first["verification"], first["failed_checks"]) == ("fail", ["tidied"])
    assert (second["verification"], second["failed_checks"]) == ("pass", [])


async def test_the_run_page_draws_intents_and_the_tree_page_the_branches(
    served: Served,
) -> None:
    run = served.branched
    async with served.client() as c:
        page = await c.get(f"/runs/{run}", headers=A)
        tree = await c.get(f"/runs/{run}/tree", headers=A)
    assert page.status_code == tree.status_code == 200
    assert '<table id="intents">' in page.text
    for state in ("pending", "dispatched", "committed"):
        assert f'<li class="intent-state" data-state="{state}">' in page.text
    assert f'href="/runs/{run}/tree?tenant={TENANT_A}"' in page.text
    for b, status in ((0, "succeeded"), (1, "failed"), (2, "succeeded")):
        assert f'id="branch-{b}" data-branch="{b}" data-status="{status}"' in tree.text
    assert "forked from branch 0 at LSN" in tree.text
    assert "<strong>tidy</strong>: it failed here and succeeded in the parent" in tree.text
    # The hostile task key and child labels are text, never markup.
    for text in (page.text, tree.text):
        assert HOSTILE not in text
    assert tree.text.count("no-strip &lt;script&gt;") == 1


async def test_another_tenants_tree_is_not_reachable(served: Served) -> None:
    run = served.branched
    async with served.client() as c:
        api = await c.get(f"/api/runs/{run}/tree", headers=B)
        named = await c.get(f"/api/runs/{run}/tree", headers=B, params={"tenant": str(TENANT_A)})
        page = await c.get(f"/runs/{run}/tree", headers=B)
        unknown = await c.get(f"/api/runs/{run}/tree", headers=A, params={"depth": "2"})
    assert (api.status_code, api.json()) == (404, {"detail": "no such run"})
    assert named.status_code == 404
    assert page.status_code == 404
    assert HOSTILE not in page.text
    assert (unknown.status_code, unknown.json()) == (400, {"detail": "unknown parameter: depth"})


async def test_a_rollout_group_shows_its_siblings_selection_and_winner(served: Served) -> None:
    group = quote(served.group, safe="")
    async with served.client() as c:
        api = await c.get(f"/api/rollouts/{group}", headers=A)
        page = await c.get(f"/rollouts/{group}", headers=A)
        theirs = await c.get(f"/api/rollouts/{group}", headers=B)
        their_page = await c.get(f"/rollouts/{group}", headers=B)
        missing = await c.get("/api/rollouts/no-such-group", headers=A)
    assert api.status_code == 200, api.text
    view = api.json()
    result = view["result"]
    assert (view["group"], result["idempotency_key"]) == (served.group, served.group)
    siblings = {s["run_id"] for s in result["siblings"]}
    assert len(siblings) == 2
    assert {r["run_id"] for r in view["runs"]} == siblings
    assert result["winner"] in siblings
    assert result["selection"]["decided_by"] in ("verifier", "judge", "index")
    assert page.status_code == 200
    assert f'<tr class="sibling winner" data-run="{result["winner"]}"' in page.text
    assert result["selection"]["policy"] in page.text
    assert HOSTILE not in page.text
    # Another tenant's group answers as a missing one does.
    assert (theirs.status_code, theirs.json()) == (404, {"detail": "no such rollout group"})
    assert their_page.status_code == 404
    assert missing.status_code == 404
    # A sibling's page links to its group.
    async with served.client() as c:
        sibling = await c.get(f"/runs/{result['winner']}", headers=A)
    assert f'id="rollout-link" href="/rollouts/{group}?tenant={TENANT_A}"' in sibling.text
