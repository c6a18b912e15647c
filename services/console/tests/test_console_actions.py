"""The console's actions through its API, over a real embedded pipeline: approving,
signalling and cancelling waiting runs takes effect; a refused command answers with
the stage's reason; another tenant's run, rollout or proposal answers 404 like a
missing one; bad input and cross-site requests change nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from assay.bus.topics import RUN_COMMANDS, TASKS, WORKFLOWS
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading import StubJudge
from assay.kernel import RunState
from assay.kernel.ids import TenantId
from assay.messages import RolloutSpec, TaskSubmitted, WorkflowRegistered
from assay.runtime.embedded import STAGES, Embedded
from assay.workflow import WorkflowDef, validate
from assay_console.access import Access
from assay_console.app import create_app
from assay_console.outbox import EmbeddedOutbox
from assay_console.reads import ConsoleReads, RunFilters, SqliteRunsTable
from assay_ingest.routing import Allocation
from services.console.tests.console_seed import HOSTILE, TENANT_A, TENANT_B

TOKENS = f"{TENANT_A}=token-a,{TENANT_B}=token-b"
A = {"authorization": "Bearer token-a"}
B = {"authorization": "Bearer token-b"}
ADMIN = {"authorization": "Bearer token-admin"}
KEYS_A = ("approve-me", "signal-me", "cancel-me", "wrong-signal", f"{HOSTILE}-wait")
KEYS_B = ("b-waits",)
GROUP = "a-group"
"""Tenant A's rollout group of two siblings, each waiting at its await step."""
pytestmark = pytest.mark.asyncio(loop_scope="module")


def waits_for(workflow: str, signal: str) -> dict[str, Any]:
    """A workflow that waits at its first step for `signal`, then uses its payload."""
    return {
        "id": workflow,
        "steps": [
            {"id": "ask", "kind": "await", "signal": signal, "timeout_s": 3600},
            {
                "id": "use",
                "kind": "tool",
                "tool": "strip",
                "args": {"text": "{{ steps.ask.output }}"},
            },
        ],
        "transitions": [{"from": "ask", "to": "use"}],
    }


AWAIT, SIGNALLED = waits_for("gate", "approval"), waits_for("poke", "poke")


@dataclass
class Console:
    client: httpx.AsyncClient
    reads: ConsoleReads
    rt: Embedded

    async def run_id(self, tenant: TenantId, key: str) -> str:
        page = await self.reads.runs(tenant, RunFilters(key=key), None, 1)
        return page.runs[0].run_id

    async def commands(self) -> int:
        return sum((await self.rt.bus.end_offsets(RUN_COMMANDS)).values())


async def until_waiting(reads: ConsoleReads, want: dict[TenantId, int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        counts = {t: (await reads.overview(t)).by_state.get("suspended", 0) for t in want}
        if counts == want:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"runs waiting: {counts}, wanted {want}")
        await asyncio.sleep(0.05)  # the read model folds from the topics: look again


async def until_read(rt: Embedded, stage: str, topic: str, timeout_s: float) -> None:
    """Wait until `stage` has read everything on `topic`."""
    deadline = time.monotonic() + timeout_s
    ends = await rt.bus.end_offsets(topic)
    while True:
        read = await rt.logs[stage].positions()
        if all(read.get((topic, p), 0) >= end for p, end in ends.items()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{stage} did not read {topic}")
        await asyncio.sleep(0.02)  # the bus offers no wake-up for "a consumer caught up"


async def until_routed(
    rt: Embedded, workflows: list[tuple[TenantId, str]], timeout_s: float
) -> None:
    """Wait until ingest holds every workflow's allocation: decide publishes it after
    ingest stored the definition, and a task before it is refused as unknown."""
    deadline = time.monotonic() + timeout_s
    for tenant, workflow in workflows:
        while await rt.logs["ingest"].get(Allocation.at(tenant, workflow)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ingest never got {workflow}'s allocation for {tenant}")
            await asyncio.sleep(0.02)  # the bus offers no wake-up for "a stage folded this"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def console(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Console]:
    data = tmp_path_factory.mktemp("acts")
    stages = (*STAGES, "console")
    async with Embedded(
        data, stages=stages, partitions=2, model=StubModel(), judge=StubJudge()
    ) as rt:
        rt.start()
        for tenant in (TENANT_A, TENANT_B):
            for doc in (AWAIT, SIGNALLED):
                wf = validate(WorkflowDef.model_validate(doc), frozenset(BUILTIN_TOOLS))
                definition = wf.model_dump(mode="json", by_alias=True)
                msg = WorkflowRegistered(tenant=tenant, definition=definition)
                await rt.publish(WORKFLOWS, msg, tenant, idem=f"{tenant}:{wf.version}")
        await until_routed(rt, [(t, w) for t in (TENANT_A, TENANT_B) for w in ("gate", "poke")], 60)
        tasks = [
            (TASKS, task(TENANT_A, k, "poke" if k == "signal-me" else "gate"), TENANT_A, k)
            for k in KEYS_A
        ] + [(TASKS, task(TENANT_B, k, "gate"), TENANT_B, k) for k in KEYS_B]
        await rt.publish_many(tasks)
        group = task(TENANT_A, GROUP, "gate").model_copy(update={"rollout": RolloutSpec(n=2)})
        await rt.publish(TASKS, group, TENANT_A, idem=GROUP)  # two siblings, both waiting
        store = data / "console.sqlite"
        reads = ConsoleReads(rt.logs["console"], SqliteRunsTable(store))
        await until_waiting(reads, {TENANT_A: len(KEYS_A) + 2, TENANT_B: len(KEYS_B)}, 60)
        access = Access.parse(TOKENS, "token-admin", "127.0.0.1")
        app = create_app(reads, access, EmbeddedOutbox(rt.bus))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://console") as c:
            yield Console(c, reads, rt)
        await reads.close()


def task(tenant: TenantId, key: str, workflow: str) -> TaskSubmitted:
    return TaskSubmitted.model_validate(
        {"tenant": tenant, "workflow_id": workflow, "idempotency_key": key, "input": {"k": key}}
    )


async def post(c: Console, path: str, body: Any, headers: dict[str, str], **params: str) -> Any:
    return await c.client.post(path, json=body, headers=headers, params=params)


async def test_approving_a_waiting_run_resumes_it(console: Console) -> None:
    run = await console.run_id(TENANT_A, "approve-me")
    answer = await post(console, f"/api/runs/{run}/approve", {}, A)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["outcome"] == "applied"
    assert got["run"]["state"] != "suspended"
    assert got["poll"] == f"/api/runs/{run}"
    again = await post(console, f"/api/runs/{run}/approve", {}, A)
    assert again.status_code == 409
    assert "is not waiting" in again.json()["detail"]
    deadline = time.monotonic() + 60
    while (ended := await console.reads.run(TENANT_A, run)) is None or ended.output is None:
        assert time.monotonic() < deadline, "no result after the approval"
        await asyncio.sleep(0.05)  # the read model folds from the topics: look again
    assert ended.output == "approved"  # the await step's output, the approval's payload


async def test_a_named_signal_resumes_the_run_waiting_for_it(console: Console) -> None:
    run = await console.run_id(TENANT_A, "signal-me")
    body = {"signal": "poke", "payload": "go"}
    answer = await post(console, f"/api/runs/{run}/signal", body, A)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outcome"] == "applied"


async def test_the_wrong_signal_is_refused_with_the_stages_reason(console: Console) -> None:
    run = await console.run_id(TENANT_A, "wrong-signal")
    answer = await post(console, f"/api/runs/{run}/signal", {"signal": "other"}, A)
    assert answer.status_code == 409
    assert "waits for 'approval', not 'other'" in answer.json()["detail"]
    view = (await console.client.get(f"/api/runs/{run}", headers=A)).json()
    assert view["run"]["state"] == "suspended"


async def test_cancelling_a_waiting_run_cancels_it(console: Console) -> None:
    run = await console.run_id(TENANT_A, "cancel-me")
    answer = await post(console, f"/api/runs/{run}/cancel", {"reason": "no longer needed"}, A)
    assert answer.status_code == 200, answer.text
    assert answer.json()["run"]["state"] == "cancelled"
    ended = await post(console, f"/api/runs/{run}/cancel", {}, A)
    assert ended.status_code == 409
    assert "has ended" in ended.json()["detail"]


@pytest.mark.parametrize(
    ("verb", "body"),
    [
        ("approve", {}),
        ("signal", {"signal": "approval"}),
        ("cancel", {}),
        ("rewind", {"at": 0}),
    ],
)
async def test_another_tenants_run_answers_404_and_nothing_is_sent(
    console: Console, verb: str, body: dict[str, Any]
) -> None:
    run = await console.run_id(TENANT_B, "b-waits")
    before = await console.commands()
    by_a = await post(console, f"/api/runs/{run}/{verb}", body, A, wait="0")
    assert by_a.status_code == 404
    assert by_a.json() == {"detail": "no such run"}
    # B's own run under the admin token, naming tenant A: the same answer.
    as_a = await post(console, f"/api/runs/{run}/{verb}", body, ADMIN, tenant=str(TENANT_A))
    assert as_a.status_code == 404
    # and A's token naming B's tenant is refused outright
    named = await post(console, f"/api/runs/{run}/{verb}", body, A, tenant=str(TENANT_B))
    assert named.status_code == 404
    assert await console.commands() == before
    assert (await console.client.get(f"/api/runs/{run}", headers=B)).json()["run"][
        "state"
    ] == "suspended"


async def test_an_admin_acts_on_the_named_tenant(console: Console) -> None:
    run = await console.run_id(TENANT_B, "b-waits")
    wrong = await post(console, f"/api/runs/{run}/signal", {"signal": "nope"}, ADMIN)
    assert wrong.status_code == 400
    assert "tenant: required" in wrong.json()["detail"]


@pytest.mark.parametrize(
    ("path", "body", "status", "names"),
    [
        ("/api/runs/not-a-run/approve", {}, 400, "is not a ULID"),
        ("/api/runs/{run}/approve", {"payload": 7}, 400, "payload"),
        ("/api/runs/{run}/approve", {"extra": 1}, 400, "extra"),
        ("/api/runs/{run}/signal", {"signal": HOSTILE}, 400, "signal"),
        ("/api/runs/{run}/signal", {}, 400, "signal"),
        ("/api/runs/{run}/rewind", {"at": -1}, 400, "at"),
        ("/api/runs/{run}/rewind", {"at": "x"}, 400, "at"),
        ("/api/runs/{run}/cancel", {"reason": "x" * 2001}, 400, "reason"),
        ("/api/runs/{run}/launch", {}, 404, "no action 'launch'"),
        ("/api/proposals/{run}/approve", {"workflow_id": "gate"}, 400, "proposal_id"),
        ("/api/proposals/0123456789abcdef/merge", {"workflow_id": "gate"}, 404, "merge"),
        ("/api/proposals/0123456789abcdef/approve", {}, 400, "workflow_id"),
    ],
)
async def test_bad_input_names_the_problem_and_sends_nothing(
    console: Console, path: str, body: Any, status: int, names: str
) -> None:
    run = await console.run_id(TENANT_B, "b-waits")
    before = await console.commands()
    answer = await post(console, path.format(run=run), body, B, wait="0")
    assert answer.status_code == status, answer.text
    assert names in answer.json()["detail"]
    assert await console.commands() == before


async def test_a_body_that_does_not_parse_or_is_not_json_is_refused(console: Console) -> None:
    run = await console.run_id(TENANT_B, "b-waits")
    url = f"/api/runs/{run}/approve"
    broken = await console.client.post(
        url, content=b"{not json", headers={**B, "content-type": "application/json"}
    )
    assert broken.status_code == 400
    assert "body is not JSON" in broken.json()["detail"]
    form = await console.client.post(url, data={"payload": "x"}, headers=B)
    assert form.status_code == 415
    for param, value in (("wait", "soon"), ("wait", "99"), ("colour", "red")):
        bad = await console.client.post(url, json={}, headers=B, params={param: value})
        assert bad.status_code == 400
        assert param in bad.json()["detail"]


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "https://evil.example"},
        {"sec-fetch-site": "cross-site"},
        {"origin": "null"},
    ],
)
async def test_a_cross_site_request_is_refused(console: Console, headers: dict[str, str]) -> None:
    run = await console.run_id(TENANT_B, "b-waits")
    before = await console.commands()
    answer = await post(console, f"/api/runs/{run}/approve", {}, {**B, **headers})
    assert answer.status_code == 403
    assert await console.commands() == before


async def test_an_action_needs_a_token(console: Console) -> None:
    run = await console.run_id(TENANT_B, "b-waits")
    answer = await post(console, f"/api/runs/{run}/approve", {}, {})
    assert answer.status_code == 401
    forged = await post(console, f"/api/runs/{run}/approve", {}, {"authorization": "Bearer x"})
    assert forged.status_code == 401


async def test_a_rollout_group_is_cancelled_only_for_its_tenant(console: Console) -> None:
    own = await post(console, "/api/rollouts/b-waits/cancel", {"reason": "stop"}, B, wait="0")
    assert own.status_code == 202, own.text
    assert own.json()["outcome"] == "pending"
    tasks = await console.rt.bus.end_offsets(TASKS)
    for headers, group in ((A, "b-waits"), (B, "nothing-by-that-key"), (B, "b-wait")):
        answer = await post(console, f"/api/rollouts/{group}/cancel", {}, headers, wait="0")
        assert answer.status_code == 404
        assert answer.json() == {"detail": "no such rollout group"}
    assert await console.rt.bus.end_offsets(TASKS) == tasks


async def test_cancelling_a_rollout_group_answers_once_every_sibling_stopped(
    console: Console,
) -> None:
    answer = await post(console, f"/api/rollouts/{GROUP}/cancel", {"reason": "enough"}, A)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outcome"] == "applied"
    page = await console.reads.runs(TENANT_A, RunFilters(key=GROUP), None, 50)
    siblings = [r for r in page.runs if r.idempotency_key == GROUP]
    assert len(siblings) == 2
    assert {r.state for r in siblings} == {RunState.CANCELLED.value}


@pytest.mark.parametrize("verb", ["approve", "reject"])
async def test_an_unknown_proposal_answers_404(console: Console, verb: str) -> None:
    # the console's own record answers: nothing reaches decide
    body = {"workflow_id": "gate", "reason": HOSTILE}
    before = await console.rt.bus.end_offsets(WORKFLOWS)
    answer = await post(console, f"/api/proposals/0123456789abcdef/{verb}", body, A)
    assert answer.status_code == 404, answer.text
    assert answer.json() == {"detail": "no such proposal"}
    assert await console.rt.bus.end_offsets(WORKFLOWS) == before


async def test_a_waiting_runs_page_offers_its_actions_escaped(console: Console) -> None:
    run = await console.run_id(TENANT_A, f"{HOSTILE}-wait")
    page = await console.client.get(f"/runs/{run}", headers=A)
    assert page.status_code == 200
    assert 'id="approve"' in page.text
    assert "<script>window" not in page.text
    assert "&lt;script&gt;" in page.text
    overview = await console.client.get("/", headers=A)
    assert "runs waiting for approval" in overview.text
    assert f"/runs?tenant={TENANT_A}&amp;state=suspended" in overview.text


async def test_a_read_only_console_says_it_cannot_act(console: Console) -> None:
    app = create_app(console.reads, Access.parse(TOKENS, None, "127.0.0.1"))
    transport = httpx.ASGITransport(app=app)
    run = await console.run_id(TENANT_B, "b-waits")
    async with httpx.AsyncClient(transport=transport, base_url="http://console") as c:
        answer = await c.post(f"/api/runs/{run}/cancel", json={}, headers=B)
    assert answer.status_code == 503
    assert "cannot publish" in answer.json()["detail"]


async def test_the_openapi_document_names_every_action() -> None:
    from assay_console.openapi import document

    paths = document()["paths"]
    for verb in ("approve", "signal", "cancel", "rewind"):
        assert "post" in paths[f"/api/runs/{{run_id}}/{verb}"]
    assert {"/api/rollouts/{group}/cancel", "/api/proposals/{proposal}/reject"} <= set(paths)


async def test_a_rewind_is_produced_as_the_cli_produces_it(console: Console) -> None:
    from assay.bus.commands import rewind_run
    from assay.messages import open_envelope

    run = await console.run_id(TENANT_A, f"{HOSTILE}-wait")
    before = await console.commands()
    body = {"at": 0, "reason": HOSTILE}
    answer = await post(console, f"/api/runs/{run}/rewind", body, A, wait="0")
    assert answer.status_code == 202, answer.text
    assert answer.json()["outcome"] == "pending"
    expected = open_envelope(rewind_run(TENANT_A, run, 0, None, HOSTILE).entry.value).id
    assert answer.json()["command"] == expected
    assert await console.commands() == before + 1
