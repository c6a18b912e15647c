"""End to end in distributed mode: six stage processes on a real broker, Postgres and S3.

Producers and consumers here are plain aiokafka clients writing and reading JSON,
as a user's would be — not Assay's code.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from assay.bus import TASKS as TASKS_TOPIC
from assay.bus import WORKFLOWS
from assay.cli.demo import contest
from assay.devstack import Service
from assay.devstack.deployment import ASSAY, Deployment, deploy
from assay.kernel import WorkflowId, tenant_id
from assay.messages import TaskSubmitted, WorkflowRegistered, message_id, seal
from assay.record import StateKey
from assay.runtime import Embedded
from assay.runtime.embedded import STAGES
from assay.store import OutboxEntry, S3BlobStore
from assay.workflow import load_workflow
from assay_console.stages import Health, HttpStages, StageView
from tests.pipeline import (
    ROOT,
    TASKS,
    V1,
    V2,
    allocation,
    await_results,
    produce,
    read_topic,
    register,
    results_by_task,
    set_up_tenant,
    task_records,
    wait_for,
)
from tests.signal_names import EVERY_STAGE, STAGE_SIGNALS
from tests.tenant_stores import bucket_objects, pg_leftovers, pg_rows_of

pytestmark = [
    pytest.mark.slow,
    pytest.mark.kafka,
    pytest.mark.postgres,
    pytest.mark.s3,
    pytest.mark.timeout(420),
]

V3 = ROOT / "examples" / "workflows" / "arith-v3.yaml"
RANKED_V1 = ROOT / "examples" / "workflows" / "arith-ranked-v1.yaml"
RANKED_V2 = ROOT / "examples" / "workflows" / "arith-ranked-v2.yaml"
LADDER = {"ASSAY_LADDER_TRIAL_SHARE": "0.15", "ASSAY_LADDER_MIN_TRIAL_RUNS": "3"}
"""A ladder sized for tests of tens of tasks (the defaults want about a hundred on trial)."""


@pytest.fixture(scope="module")
def deployment(
    postgres: Service, s3: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    d = asyncio.run(deploy(tmp_path_factory.mktemp("e2e"), postgres, s3, extra_env=LADDER))
    try:
        yield d
    finally:
        d.stop()


async def test_two_tenants_each_get_one_result_per_task_and_v2_leaves_shadow(
    deployment: Deployment,
) -> None:
    d = deployment
    tenants = [await set_up_tenant(d, challenger=True) for _ in range(2)]
    tasks = TASKS[:40]
    await produce(d.bootstrap, [r for t in tenants for r in task_records(t, tasks)])
    expected = {(t, task["idempotency_key"]) for t in tenants for task in tasks}
    records = await await_results(d, expected)
    by_task = results_by_task(records, set(tenants))
    assert all(len(ids) == 1 for ids in by_task.values()), "a task got two different results"
    for r in records:
        payload = json.loads(r.value)["payload"]
        if payload["tenant"] in tenants:
            assert payload["verification"], "a result without its verification"
            assert payload["score"]["kind"] in ("relative", "ungraded", "capped", "ranked")
            assert payload["task_id"]
            assert payload["run_id"]
    for tenant in tenants:

        async def on_trial(tenant: str = tenant) -> bool:
            a = await allocation(d, tenant)
            return a is not None and a.get("rung") == "trial"

        await wait_for(f"v2 on trial for {tenant}", on_trial, 60)


async def test_a_tournament_mode_workflow_is_graded_end_to_end(deployment: Deployment) -> None:
    """Each task's current run and the challenger's shadow run form a group (quorum 2) when
    they share an outcome class; the group is judged in both orderings and fitted with
    control pinned to zero; the challenger's anchored deltas reach the aggregate."""
    d = deployment
    tenant = await set_up_tenant(d, challenger=True, versions=(RANKED_V1, RANKED_V2))
    tasks = TASKS[:16]
    await produce(d.bootstrap, task_records(tenant, tasks, "arith-ranked"))
    expected = {(tenant, task["idempotency_key"]) for task in tasks}
    records = await await_results(d, expected)
    payloads = [json.loads(r.value)["payload"] for r in records]
    scores = [p["score"] for p in payloads if p["tenant"] == tenant]
    assert {s["kind"] for s in scores} <= {"ranked", "ungraded"}, scores
    ranked = [s for s in scores if s["kind"] == "ranked"]
    assert ranked, "no group closed with both versions in it"
    # A task served by the current version: its run is control, pinned to zero.
    current = str(load_workflow(RANKED_V1).version)
    control = [
        p["score"]
        for p in payloads
        if p["tenant"] == tenant
        and p["score"]["kind"] == "ranked"
        and p["workflow_version"] == current
    ]
    assert control
    assert all(s["anchored"] and s["strength"] == 0.0 and s["group_size"] == 2 for s in control)
    assert all(s["reason"] == "insufficient_group" for s in scores if s["kind"] == "ungraded")
    challenger = str(load_workflow(RANKED_V2).version)

    async def aggregated() -> bool:
        rows = await d.query(
            "SELECT value FROM aggregate.state WHERE tenant = $1 AND kind = 'version' AND key = $2",
            uuid.UUID(tenant),
            challenger,
        )
        doc = json.loads(rows[0]["value"]) if rows else {}
        held = (doc.get("held_out") or {}).get("ranked") or {"n": 0}
        anchored = int((doc.get("ranked") or {"n": 0})["n"]) + int(held["n"])  # both sides
        return anchored >= len(control)

    await wait_for("the challenger's strengths in the aggregate", aggregated, 60)
    closed = await d.query(
        "SELECT value FROM tournament.state WHERE tenant = $1 AND kind = 'group'",
        uuid.UUID(tenant),
    )
    assert sum(json.loads(row["value"])["epoch"] for row in closed) >= len(ranked)


async def test_two_challengers_share_traffic_and_every_group_ranks_them_all(
    deployment: Deployment, tmp_path: Path
) -> None:
    """Several challengers on Kafka and Postgres (§12.1): a tournament-graded workflow
    allowing two admits both; a task the current version serves is replayed under each,
    its group closes with all three and ranks both against control; each challenger's
    anchored deltas reach the aggregate."""
    d = deployment
    versions = contest(2, 4, ROOT / "examples")
    paths = []
    for n, wf in enumerate(versions):
        path = tmp_path / f"contest-{n}.json"
        path.write_text(json.dumps(wf.model_dump(mode="json", by_alias=True)))
        paths.append(path)
    tenant = str(uuid.uuid4())
    workflow = str(versions[0].id)
    register(d, tenant, paths[0])
    await wait_for("the current version", lambda: _exists(allocation(d, tenant, workflow)), 60)
    for path in paths[1:]:
        register(d, tenant, path)

    async def both_live() -> bool:
        a = await allocation(d, tenant, workflow)
        return a is not None and len(a.get("challengers") or []) == 2

    await wait_for("two live challengers", both_live, 60)
    alloc = await allocation(d, tenant, workflow)
    assert alloc is not None
    assert alloc["shares"] == {
        str(wf.version): 1.0 if n == 0 else 0.0 for n, wf in enumerate(versions)
    }
    tasks = TASKS[:12]
    await produce(d.bootstrap, task_records(tenant, tasks, workflow))
    records = await await_results(d, {(tenant, t["idempotency_key"]) for t in tasks})
    scores = [
        p["score"]
        for p in (json.loads(r.value)["payload"] for r in records)
        if p["tenant"] == tenant
    ]
    assert any(s["kind"] == "ranked" and s["group_size"] == 3 for s in scores), scores
    served = await d.query(
        "SELECT value FROM ingest.state WHERE tenant = $1 AND kind = 'task'", uuid.UUID(tenant)
    )
    runs = [json.loads(row["value"])["runs"] for row in served]
    assert all(len({r["run_id"] for r in rs}) == len(rs) == 3 for rs in runs)  # shadow rate 1

    async def both_ranked() -> bool:
        for wf in versions[1:]:
            rows = await d.query(
                "SELECT value FROM aggregate.state WHERE tenant = $1 AND kind = 'version' "
                "AND key = $2",
                uuid.UUID(tenant),
                str(wf.version),
            )
            doc = json.loads(rows[0]["value"]) if rows else {}
            held = (doc.get("held_out") or {}).get("ranked") or {"n": 0}
            if int((doc.get("ranked") or {"n": 0})["n"]) + int(held["n"]) == 0:
                return False
        return True

    await wait_for("both challengers' strengths in the aggregate", both_ranked, 60)


async def decide_state(d: Deployment, tenant: str, kind: str, key: str) -> dict[str, Any] | None:
    rows = await d.query(
        "SELECT value FROM decide.state WHERE tenant = $1 AND kind = $2 AND key = $3",
        uuid.UUID(tenant),
        kind,
        key,
    )
    return json.loads(rows[0]["value"]) if rows and rows[0]["value"] is not None else None


async def test_a_challenger_climbs_the_ladder_on_evidence_and_a_core_violator_rolls_back(
    deployment: Deployment,
) -> None:
    """v2 goes shadow -> trial -> current on its evidence, with tasks produced in waves
    (routing follows each new allocation); then v3, whose episodes break a Core rubric
    criterion, is rolled back automatically: a traffic change that deletes nothing."""
    d = deployment
    tenant = await set_up_tenant(d, challenger=True)
    v2, v3 = str(load_workflow(V2).version), str(load_workflow(V3).version)
    waves = iter(TASKS[i : i + 10] for i in range(0, len(TASKS), 10))

    async def wave() -> None:
        tasks = next(waves)
        await produce(d.bootstrap, task_records(tenant, tasks))
        await await_results(d, {(tenant, t["idempotency_key"]) for t in tasks})

    async def rung() -> str | None:
        a = await allocation(d, tenant)
        return None if a is None else a.get("rung")

    await wave()  # shadow: v2 replays every task beside v1
    await wave()
    await wait_for("v2 to reach trial", lambda: _is(rung, "trial"), 60)
    for _ in range(12):  # trial: v2 serves a share of live tasks, until it is promoted
        if await decide_state(d, tenant, "decision", v2) is not None:
            break
        await wave()
    await wait_for("v2's decision", lambda: _exists(decide_state(d, tenant, "decision", v2)), 60)
    promoted = await decide_state(d, tenant, "decision", v2)
    assert promoted is not None
    assert (promoted["outcome"], promoted["rung"]) == ("promoted", "trial"), promoted
    await wait_for("ingest to route to v2 alone", lambda: _routes_to(d, tenant, v2), 60)
    served = await d.query(
        "SELECT value FROM ingest.state WHERE tenant = $1 AND kind = 'task'", uuid.UUID(tenant)
    )
    docs = [json.loads(row["value"]) for row in served]
    assert any(doc["arm"] == "challenger" and doc["rung"] == "trial" for doc in docs)
    assert 0 < sum(doc["held_out"] for doc in docs) < len(docs)  # the split is recorded

    register(d, tenant, V3)

    async def v3_challenges() -> bool:
        a = await allocation(d, tenant)
        return a is not None and a.get("challenger") == v3

    await wait_for("v3 to become the challenger", v3_challenges)
    for _ in range(3):
        await wave()
        if await decide_state(d, tenant, "decision", v3) is not None:
            break
    await wait_for("v3's rollback", lambda: _exists(decide_state(d, tenant, "decision", v3)), 60)
    rolled = await decide_state(d, tenant, "decision", v3)
    assert rolled is not None
    assert (rolled["outcome"], rolled["trigger"], rolled["rung"]) == (
        "rolled_back",
        "capped",
        "shadow",
    )
    await wait_for("ingest to route to v2 alone", lambda: _routes_to(d, tenant, v2), 60)

    def rolled_back(records: list[Any]) -> bool:
        return any(_rollback_of(r, tenant, v3) for r in records)

    decisions = await read_topic(d.bootstrap, "assay.decisions", rolled_back, 30)
    (message,) = [json.loads(r.value)["payload"] for r in decisions if _rollback_of(r, tenant, v3)]
    assert (message["current"], message["trigger"]) == (v2, "capped")
    stored = await d.query(
        "SELECT value FROM ingest.state WHERE tenant = $1 AND kind = 'definition' AND key = $2",
        uuid.UUID(tenant),
        v3,
    )
    assert json.loads(stored[0]["value"])["parents"] == [v2]  # still in the DAG


async def test_a_rolled_back_challenger_gets_a_proposal_that_an_operator_approves(
    deployment: Deployment,
) -> None:
    """The slow loop in distributed mode: v3 (a Core violator) is rolled back against v1;
    decide drafts the next version of v1 from selection-set failures and announces it on
    `assay.decisions`; `assay proposals approve` over Kafka registers it, parented on v1,
    and it becomes the challenger."""
    d = deployment
    tenant = await set_up_tenant(d, challenger=False)
    v1, v3 = str(load_workflow(V1).version), str(load_workflow(V3).version)
    first = TASKS[:20]  # v1 alone: its wrong answers become the evidence
    await produce(d.bootstrap, task_records(tenant, first))
    await await_results(d, {(tenant, t["idempotency_key"]) for t in first})
    register(d, tenant, V3)

    async def v3_challenges() -> bool:
        a = await allocation(d, tenant)
        return a is not None and a.get("challenger") == v3

    await wait_for("v3 to become the challenger", v3_challenges)
    for start in range(20, 60, 10):
        tasks = TASKS[start : start + 10]
        await produce(d.bootstrap, task_records(tenant, tasks))
        await await_results(d, {(tenant, t["idempotency_key"]) for t in tasks})
        if await decide_state(d, tenant, "decision", v3) is not None:
            break
    await wait_for("v3's rollback", lambda: _exists(decide_state(d, tenant, "decision", v3)), 60)

    async def asked() -> bool:
        return any(
            [
                await decide_state(d, tenant, "open_proposal", "arith"),
                await decide_state(d, tenant, "unproposed", "arith"),
            ]
        )

    await wait_for("the slow loop", asked, 60)
    waiting = await decide_state(d, tenant, "open_proposal", "arith")
    assert waiting is not None, await decide_state(d, tenant, "unproposed", "arith")
    proposal = await decide_state(d, tenant, "proposal", waiting["proposal_id"])
    assert proposal is not None
    assert (proposal["status"], proposal["gated"], proposal["parent"]) == ("pending", True, v1)
    assert proposal["rationale"].startswith("reason_step_by_step:")
    assert proposal["failures"]  # drafted from evidence

    def announced(records: list[Any]) -> bool:
        return any(json.loads(r.value)["type"] == "ProposalRequested" for r in records)

    decisions = await read_topic(d.bootstrap, "assay.decisions", announced, 30)
    assert any(
        json.loads(r.value)["payload"].get("proposal_id") == waiting["proposal_id"]
        for r in decisions
    )
    cli_env = {**d.env, "ASSAY_DATABASE_URL": d.dsns["decide"]}
    listed = await asyncio.to_thread(
        subprocess.run,
        [ASSAY, "proposals", "--tenant", tenant],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)["proposals"]
    assert row["proposal_id"] == waiting["proposal_id"]
    approved = await asyncio.to_thread(
        subprocess.run,
        [ASSAY, "proposals", "approve", waiting["proposal_id"], "--reason", "worth a shadow"],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert approved.returncode == 0, approved.stderr
    drafted = proposal["workflow_version"]

    async def challenges() -> bool:
        a = await allocation(d, tenant)
        return a is not None and a.get("challenger") == drafted

    await wait_for("the approved proposal to become the challenger", challenges, 60)
    stored = await d.query(
        "SELECT value FROM ingest.state WHERE tenant = $1 AND kind = 'definition' AND key = $2",
        uuid.UUID(tenant),
        drafted,
    )
    assert json.loads(stored[0]["value"])["parents"] == [v1]  # in the DAG, under its base
    reviewed = await decide_state(d, tenant, "proposal", waiting["proposal_id"])
    assert reviewed is not None
    assert reviewed["review"] == {"reason": "worth a shadow", "by": "operator"}


THINK_SOLVE = """\
id: think-solve
steps:
  - {id: think, kind: model, prompt: "Think about {{ task.question }}."}
  - {id: solve, kind: model, prompt: "Reply with only the number. What is {{ task.question }}?"}
  - {id: answer, kind: tool, tool: extract_number, args: {text: "{{ steps.solve.output }}"}}
verifiers:
  - {id: correct, kind: exact, step: answer, expected: "{{ task.answer }}"}
"""


async def test_a_run_is_branched_with_deltas_from_the_command_line(
    deployment: Deployment, tmp_path: Path
) -> None:
    """`assay branch` against the distributed pipeline: the command goes to
    `assay.run-commands`, the execute stage forks the children from the checkpoint after
    `think`, and the CLI reads the tree back from the execute schema."""
    d = deployment
    workflow = tmp_path / "think-solve.yaml"
    workflow.write_text(THINK_SOLVE)
    tenant = await set_up_tenant(d, challenger=False, versions=(workflow, workflow))
    task = {"idempotency_key": "branch-1", "input": {"question": "(5 + 12) * 9", "answer": "153"}}
    await produce(d.bootstrap, task_records(tenant, [task], workflow="think-solve"))
    records = await await_results(d, {(tenant, "branch-1")})
    (run,) = {
        json.loads(r.value)["payload"]["run_id"]
        for r in records
        if json.loads(r.value)["payload"]["tenant"] == tenant
    }
    done = await asyncio.to_thread(
        subprocess.run,
        [
            ASSAY,
            "branch",
            run,
            "--tenant",
            tenant,
            "--at",
            "think",
            "--json",
            "--delta",
            "prompt:solve=What is {{ task.question }}? Answer in a sentence.",
            "--delta",
            "tool_unavailable:extract_number",
            "--delta",
            "model_params:solve=max_tokens=128",
        ],
        env={**d.env, "ASSAY_DATABASE_URL": d.dsns["execute"]},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    tree = json.loads(done.stdout)["tree"]
    assert (tree["run_id"], tree["boundary"]["step"]) == (run, "think")
    children = tree["children"]
    assert [c["branch"] for c in children] == [1, 2, 3]
    assert [c["outcome"]["status"] for c in children] == ["succeeded", "failed", "succeeded"]
    assert children[1]["outcome"]["failed_step"] == "answer"
    attribution = {a["step"]: a["children"] for a in tree["attribution"]}
    assert attribution["answer"] == [2]  # the stage the failure is attributed to

    # Each child is verified and graded like any run; the task's result follows the live
    # branch (3), and every result it replaced goes out again saying so.
    def mine(records: list[Any]) -> list[dict[str, Any]]:
        payloads = [json.loads(r.value)["payload"] for r in records]
        return [p for p in payloads if p.get("tenant") == tenant and p.get("run_id") == run]

    def settled(records: list[Any]) -> bool:
        return any(p.get("branch") == 3 and p["superseded_by"] is None for p in mine(records))

    out = mine(await read_topic(d.bootstrap, "assay.results", settled, 180))
    assert [(p["branch"], p["superseded_by"]) for p in out if p["superseded_by"] is None][-1] == (
        3,
        None,
    )
    assert {p["branch"] for p in out} == {0, 1, 2, 3}
    assert all(p["parent_branch"] == 0 for p in out if p["branch"])
    for b in (0, 1, 2):
        assert [p["superseded_by"] for p in out if p["branch"] == b][-1] is not None
    failed = [p for p in out if p["branch"] == 2]
    assert all(not p["passed"] and p["termination"] == "failed" for p in failed)


async def _is(read: Any, value: str) -> bool:
    return bool(await read() == value)


async def _routes_to(d: Deployment, tenant: str, current: str) -> bool:
    """Whether ingest's allocation has `current` and no challenger: decide's decision
    reaches ingest over assay.decisions, a moment after decide recorded it."""
    a = await allocation(d, tenant)
    return a is not None and (a["current"], a["challenger"]) == (current, None)


async def _exists(doc: Any) -> bool:
    return await doc is not None


def _rollback_of(record: Any, tenant: str, version: str) -> bool:
    body = json.loads(record.value)
    payload = body["payload"]
    return bool(
        body["type"] == "RolledBack"
        and payload["tenant"] == tenant
        and payload["workflow_version"] == version
    )


async def test_a_rollout_group_is_run_and_selected_end_to_end(deployment: Deployment) -> None:
    """A task with a rollout spec, produced by a plain Kafka client: its siblings run on
    the six stage processes and one RolloutResult comes back."""
    d = deployment
    tenant = await set_up_tenant(d, challenger=False)
    task = dict(TASKS[0], idempotency_key="rollout-1")
    task["rollout"] = {
        "n": 4,
        "budget": {"max_concurrency": 2, "run_max_model_calls": 2, "group_max_model_calls": 6},
    }
    await produce(d.bootstrap, task_records(tenant, [task]))

    def done(records: list[Any]) -> bool:
        return any(
            json.loads(r.value)["payload"].get("idempotency_key") == "rollout-1"
            and json.loads(r.value)["payload"]["tenant"] == tenant
            for r in records
        )

    records = await read_topic(d.bootstrap, "assay.results", done, 180)
    results = [
        json.loads(r.value) for r in records if json.loads(r.value)["payload"]["tenant"] == tenant
    ]
    assert len({body["id"] for body in results}) == 1, "one result for the task"
    body = results[0]
    assert body["type"] == "RolloutResult"
    result = body["payload"]
    assert result["admitted"] == 3  # six group calls at two a sibling
    assert len(result["siblings"]) == 3
    assert result["peak_concurrency"] <= 2
    assert result["model_calls"] <= 6
    assert len(result["pass_at_k"]) == sum(s["ended"] == "verified" for s in result["siblings"])
    assert result["selection"]["policy"] == "verifier_then_judge"


async def test_poison_on_the_task_topic_is_dead_lettered_and_the_pipeline_goes_on(
    deployment: Deployment,
) -> None:
    d = deployment
    tenant = await set_up_tenant(d, challenger=False)
    invalid = json.dumps({"tenant": tenant, "workflow_id": "arith"}).encode()  # no key, no input
    await produce(
        d.bootstrap,
        [
            (f"{tenant}:poison-1", b"\x00not json at all"),
            (f"{tenant}:poison-2", invalid),
            *task_records(tenant, TASKS[:3]),
        ],
    )
    await await_results(d, {(tenant, t["idempotency_key"]) for t in TASKS[:3]})

    def both(records: list[Any]) -> bool:
        return {r.key for r in records} >= {
            f"{tenant}:poison-1".encode(),
            f"{tenant}:poison-2".encode(),
        }

    dead = await read_topic(d.bootstrap, "assay.dlq.ingest", both, 30)
    reasons = {
        r.key.decode(): dict(r.headers)["assay-dlq-reason"].decode()
        for r in dead
        if r.key.decode().startswith(tenant)
    }
    assert "not JSON" in reasons[f"{tenant}:poison-1"]
    assert "TaskSubmitted" in reasons[f"{tenant}:poison-2"]


async def test_a_stage_killed_mid_run_resumes_without_loss_or_duplicates(
    deployment: Deployment,
) -> None:
    d = deployment
    tenant = await set_up_tenant(d, challenger=False)
    tasks = TASKS[80:140]
    await produce(d.bootstrap, task_records(tenant, tasks))
    await asyncio.sleep(1.0)
    d.kill("execute")
    d.start("execute")
    await asyncio.to_thread(d.wait_healthy)
    expected = {(tenant, t["idempotency_key"]) for t in tasks}
    records = await await_results(d, expected, timeout_s=240)
    assert all(len(ids) == 1 for ids in results_by_task(records, {tenant}).values())
    rows = await d.query(
        "SELECT stream, branch, convert_from(payload, 'UTF8')::jsonb->>'step' AS step, "
        "convert_from(payload, 'UTF8')::jsonb->>'attempt' AS attempt, "
        "count(*) AS n FROM execute.log WHERE tenant = $1 AND type = 'AttemptStarted' "
        "GROUP BY 1, 2, 3, 4 HAVING count(*) > 1",
        uuid.UUID(tenant),
    )
    assert rows == [], "an attempt was recorded twice"


def _comparable(episode: dict[str, Any]) -> dict[str, Any]:
    """An episode without wall-clock durations, the one thing two executions may differ in."""
    return {
        **episode,
        "attempts": [
            {k: v for k, v in a.items() if k != "duration_ms"} for a in episode["attempts"]
        ],
    }


async def test_the_same_task_gives_the_same_episode_embedded_and_distributed(
    deployment: Deployment, tmp_path: Path
) -> None:
    d = deployment
    tenant = await set_up_tenant(d, challenger=False)
    task = TaskSubmitted(
        tenant=tenant_id(tenant),
        workflow_id=WorkflowId("arith"),
        idempotency_key="same-1",
        input={"question": "(17 + 25) * 3", "answer": "126"},
    )
    env = seal(
        task,
        tenant=task.tenant,
        key=f"{tenant}:same-1",
        id=message_id("test", tenant, "same-1"),
        causation=None,
        occurred_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    )
    await produce(d.bootstrap, [(env.key, env.encode())])
    records = await await_results(d, {(tenant, "same-1")})
    run_id = next(
        json.loads(r.value)["payload"]["run_id"]
        for r in records
        if json.loads(r.value)["payload"]["tenant"] == tenant
    )
    rows = await d.query(
        "SELECT value FROM execute.state WHERE tenant = $1 AND kind = 'run' AND key = $2",
        uuid.UUID(tenant),
        run_id,
    )
    blobs = S3BlobStore(
        d.env["ASSAY_S3_ENDPOINT"],
        d.env["ASSAY_S3_BUCKET"],
        access_key_id=d.env["ASSAY_S3_ACCESS_KEY_ID"],
        secret_access_key=d.env["ASSAY_S3_SECRET_ACCESS_KEY"],
    )
    await blobs.open()
    try:
        distributed = await blobs.get(task.tenant, json.loads(rows[0]["value"])["episode"])
    finally:
        await blobs.close()
    assert distributed is not None

    async with Embedded(tmp_path / "embedded") as rt:
        rt.start()
        wf = load_workflow(V1)
        await rt.publish(
            WORKFLOWS,
            WorkflowRegistered(
                tenant=task.tenant, definition=wf.model_dump(mode="json", by_alias=True)
            ),
            task.tenant,
        )

        async def ready() -> bool:
            return (
                await rt.logs["ingest"].get(StateKey(task.tenant, "allocation", "arith"))
                is not None
            )

        await wait_for("the embedded allocation", ready)
        await rt.bus.publish(
            [OutboxEntry(TASKS_TOPIC, env.key, env.encode(), tuple(env.headers()))]
        )

        async def executed() -> bool:
            doc = await rt.logs["execute"].get(StateKey(task.tenant, "run", run_id))
            return doc is not None and "episode" in doc

        await wait_for("the embedded run", executed)
        doc = await rt.logs["execute"].get(StateKey(task.tenant, "run", run_id))
        assert doc is not None
        embedded = await rt.blobs.get(task.tenant, doc["episode"])
    assert embedded is not None
    assert _comparable(json.loads(embedded)) == _comparable(json.loads(distributed))


# -- the §15 signals on every stage's /metrics ---------------------------------------------


async def _metrics(d: Deployment, stage: str) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(f"http://127.0.0.1:{d.ports[stage]}/metrics")
    response.raise_for_status()
    return response.text


async def _scrape(d: Deployment, stage: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(await _metrics(d, stage))
        for s in family.samples
    }


async def _families(d: Deployment, stage: str) -> set[str]:
    """The metric families a stage's /metrics declares, samples or not (a counter by
    its `_total` name)."""
    return {
        family.name + ("_total" if family.type == "counter" else "")
        for family in text_string_to_metric_families(await _metrics(d, stage))
    }


def _sum(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **want: str
) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(want.items()) <= ls)


async def test_every_stage_exports_lag_that_builds_and_drains_and_its_signals_move(
    deployment: Deployment,
) -> None:
    d = deployment
    tenant = await set_up_tenant(d, challenger=False)
    tasks = TASKS[140:180]
    before = await _scrape(d, "ingest")
    handled_before = _sum(before, "assay_messages_handled_total")
    # The console's reader of the stages' status ports (its Stages section, /api/stages).
    console = HttpStages({s: f"http://127.0.0.1:{d.ports[s]}" for s in STAGES}, timeout_s=1.0)
    d.procs["execute"].send_signal(signal.SIGSTOP)  # a backlog builds in front of execute
    try:
        await produce(d.bootstrap, task_records(tenant, tasks))

        async def ingested() -> bool:
            after = await _scrape(d, "ingest")
            return _sum(after, "assay_messages_handled_total") >= handled_before + len(tasks)

        await wait_for("ingest to spawn every run", ingested, 60)
        paused = {s.name: s for s in (await console.read()).stages}
    finally:
        d.procs["execute"].send_signal(signal.SIGCONT)
    assert paused["execute"].health is Health.UNREACHABLE, paused["execute"]
    assert paused["execute"].lag_total is None
    assert paused["ingest"].health is Health.READY, paused["ingest"]
    assert paused["ingest"].handled is not None
    assert paused["ingest"].handled >= handled_before + len(tasks)
    seen: list[float] = []
    shown: list[StageView] = []

    async def drained() -> bool:
        seen.append(_sum(await _scrape(d, "execute"), "assay_stage_lag", topic="assay.runs"))
        (execute,) = [s for s in (await console.read()).stages if s.name == "execute"]
        shown.append(execute)
        return seen[-1] == 0 and execute.health is Health.READY and execute.lag_total == 0

    await wait_for("execute's lag to drain", drained, 120)
    assert max(seen) > 0, f"the backlog showed as lag: {seen[:5]}"
    # The console saw the same backlog, per partition of assay.runs, and it drained.
    assert max(v.lag_total or 0 for v in shown) > 0, shown[:3]
    backlog = max(shown, key=lambda v: v.lag_total or 0)
    # Most of it on assay.runs; execute reads other topics too (assay.results, once the
    # first runs it let through are graded), which may lag for a moment beside it.
    runs_lag = sum(p.lag for p in backlog.lag if p.topic == "assay.runs")
    assert runs_lag > (backlog.lag_total or 0) / 2, backlog.lag
    assert shown[-1].handled is not None
    assert shown[-1].p95_s is not None
    await await_results(d, {(tenant, t["idempotency_key"]) for t in tasks})
    labels = {"tenant": tenant, "workflow": "arith"}
    for stage in ("ingest", "execute", "verify", "tournament", "aggregate", "decide"):
        samples = await _scrape(d, stage)
        assert _sum(samples, "assay_handler_seconds_count", stage=stage) > 0, stage
        assert not any(dict(ls).get("run_id") for _, ls in samples), "no run ids in labels"
        # Each of the §15 signals this stage carries is on its own /metrics.
        missing = {*EVERY_STAGE, *STAGE_SIGNALS[stage]} - await _families(d, stage)
        assert not missing, f"{stage} does not export {sorted(missing)}"
    execute = await _scrape(d, "execute")
    assert _sum(execute, "assay_run_transitions_total", state="running", **labels) == len(tasks)
    tournament = await _scrape(d, "tournament")
    # The tenant's only version has nothing to be compared with: Ungraded, and why.
    ungraded = _sum(tournament, "assay_runs_ungraded_total", reason="no_reference", **labels)
    assert ungraded == len(tasks)
    assert _sum(tournament, "assay_runs_ungraded_total", **labels) == len(tasks), "no other reason"
    e2e = _sum(tournament, "assay_task_to_result_seconds_count", tenant=tenant)
    assert e2e == len(tasks)


GROUP_WAIT_S = 30
"""How long the cancel test's tournament group waits for a second episode: the cancel
crosses three hops (execute, verify, tournament) and must arrive within it even when the
rest of the suite loads the machine (the example's 10 s was missed once that way)."""


async def test_a_run_cancelled_in_its_tournament_group_is_never_judged(
    deployment: Deployment, tmp_path: Path
) -> None:
    """Cancel means stop (§5.2), distributed: a run resting in `Grading` — alone in its
    tournament group, which waits `GROUP_WAIT_S` for a second episode — is cancelled
    with `assay cancel`; its result is `cancelled`, with no grade and no judge call."""
    d = deployment
    patient = tmp_path / "arith-ranked-patient.yaml"
    patient.write_text(
        RANKED_V1.read_text().replace("group_timeout_s: 10", f"group_timeout_s: {GROUP_WAIT_S}")
    )
    assert f"group_timeout_s: {GROUP_WAIT_S}" in patient.read_text()
    tenant = await set_up_tenant(d, challenger=False, versions=(patient, patient))
    await produce(d.bootstrap, task_records(tenant, TASKS[:1], "arith-ranked"))

    def grading(records: list[Any]) -> list[str]:
        return [
            p["run"]["run_id"]
            for p in (json.loads(r.value)["payload"] for r in records)
            if p.get("run", {}).get("tenant") == tenant and p.get("state") == "grading"
        ]

    statuses = await read_topic(d.bootstrap, "assay.run-status", grading, 60)
    (run,) = set(grading(statuses))
    done = await asyncio.to_thread(
        subprocess.run,
        [ASSAY, "cancel", run, "--tenant", tenant, "--reason", "not needed"],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr

    def of_run(records: list[Any]) -> list[dict[str, Any]]:
        payloads = [json.loads(r.value)["payload"] for r in records]
        return [p for p in payloads if p.get("run_id") == run]

    (result,) = of_run(await read_topic(d.bootstrap, "assay.results", of_run, 60))
    assert (result["status"], result["score"], result["termination"]) == (
        "cancelled",
        None,
        "succeeded",
    )
    # Read until the group's timeout has passed: still no grade comes.
    graded = await read_topic(d.bootstrap, "assay.graded", lambda _: False, GROUP_WAIT_S + 2)
    assert [g for g in graded if json.loads(g.value)["payload"]["run"]["run_id"] == run] == []
    usage = of_run(await read_topic(d.bootstrap, "assay.usage", lambda _: False, 5))
    assert [u for u in usage if u["purpose"] == "grading"] == []


async def test_execute_answers_a_runs_full_log_for_its_tenant_only(
    deployment: Deployment,
) -> None:
    """The console's run page asks execute's status port for what only execute holds: a
    run's full log (branches, steps, attempts, intents), for the asking tenant only."""
    from assay_console.runlog import HttpRunLog

    d = deployment
    tenant = await set_up_tenant(d, challenger=False)
    other = await set_up_tenant(d, challenger=False)
    task = TASKS[0]
    await produce(d.bootstrap, task_records(tenant, [task]))
    records = await await_results(d, {(tenant, task["idempotency_key"])})
    (run,) = {
        json.loads(r.value)["payload"]["run_id"]
        for r in records
        if json.loads(r.value)["payload"]["tenant"] == tenant
    }
    execute = f"http://127.0.0.1:{d.ports['execute']}"
    view = await HttpRunLog(execute).view(tenant_id(tenant), run)
    assert view is not None
    assert (view["run_id"], view["tenant"], view["status"]) == (run, tenant, "succeeded")
    attempts = [a for b in view["branches"] for s in b["steps"] for a in s["attempts"]]
    assert attempts
    assert all(a["state"] == "succeeded" and a["duration_ms"] is not None for a in attempts)
    # Another tenant asking for this run gets what a missing run gets.
    assert await HttpRunLog(execute).view(tenant_id(other), run) is None
    async with httpx.AsyncClient() as client:
        theirs = await client.get(f"{execute}/query/runs/{other}/{run}")
        malformed = await client.get(f"{execute}/query/runs/{tenant}/not-a-run")
    assert (theirs.status_code, theirs.json()) == (404, {"detail": "no such run"})
    assert malformed.status_code == 400
    assert "not a ULID" in malformed.json()["detail"]


async def _steady(d: Deployment, tenant: str) -> dict[str, Any]:
    """The tenant's rows and blobs once two reads a second apart agree (late grading and
    decisions of its tasks have landed)."""
    last: dict[str, Any] | None = None
    for _ in range(60):
        now = {
            "rows": await pg_rows_of(d.admin_dsn, tenant),
            "blobs": await bucket_objects(d.env, f"tenants/{tenant}/"),
        }
        if now == last:
            return now
        last = now
        await asyncio.sleep(1.0)  # nothing to wait on: a stage's late write has no event here
    raise AssertionError(f"tenant {tenant}'s state never settled")


async def test_a_tenant_is_deleted_from_every_schema_and_its_bucket_prefix(
    deployment: Deployment,
) -> None:
    d = deployment
    gone, kept = [await set_up_tenant(d, challenger=False) for _ in range(2)]
    tasks = TASKS[200:203]
    await produce(d.bootstrap, [r for t in (gone, kept) for r in task_records(t, tasks)])
    await await_results(d, {(t, task["idempotency_key"]) for t in (gone, kept) for task in tasks})
    before = await _steady(d, kept)
    mine = await _steady(d, gone)
    assert mine["blobs"]
    assert {w.split("/")[0] for w, rows in mine["rows"].items() if rows} == set(STAGES)

    env = {**d.env, "ASSAY_DATABASE_URL": d.admin_dsn}

    def tenant_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [ASSAY, "tenant", *args], env=env, capture_output=True, text=True, timeout=120
        )

    done = tenant_cli("delete", gone, "--reason", "contract ended", "--json")
    assert done.returncode == 0, done.stderr
    progress = json.loads(done.stdout)
    assert progress["deleted"] is True
    assert sorted(progress["stages"]) == sorted(STAGES)  # the console is not deployed here
    (command,) = {s["command"] for s in progress["stages"].values()}

    assert await pg_leftovers(d.admin_dsn, gone, command) == {}
    assert await bucket_objects(d.env, f"tenants/{gone}/") == {}
    assert {
        "rows": await pg_rows_of(d.admin_dsn, kept),
        "blobs": await bucket_objects(d.env, f"tenants/{kept}/"),
    } == before

    again = tenant_cli("delete", gone)
    assert again.returncode == 0, again.stderr
    assert f"deleted in {len(STAGES)} of {len(STAGES)} stages" in again.stdout
    unknown = tenant_cli("delete", str(uuid.uuid4()))
    assert unknown.returncode == 2
    assert "nothing was published" in unknown.stderr

    # A task of the deleted tenant is refused at ingest, and says why.
    await produce(d.bootstrap, task_records(gone, [{**TASKS[203], "idempotency_key": "late"}]))
    key = f"{gone}:late".encode()
    dead = await read_topic(
        d.bootstrap, "assay.dlq.ingest", lambda rs: any(r.key == key for r in rs), 60
    )
    (late,) = [r for r in dead if r.key == key]
    assert f"tenant {gone} was deleted" in dict(late.headers)["assay-dlq-reason"].decode()
    assert await pg_leftovers(d.admin_dsn, gone, command) == {}


GATE = """\
id: gate
steps:
  - {id: ask, kind: await, signal: approval, timeout_s: 3600}
  - {id: use, kind: tool, tool: strip, args: {text: "{{ steps.ask.output }}"}}
transitions:
  - {from: ask, to: use}
"""


async def test_the_consoles_actions_answer_with_their_outcome_over_kafka(
    deployment: Deployment, tmp_path: Path
) -> None:
    """`assay serve console` in the deployment (Postgres read model, commands over Kafka):
    a command execute refuses answers 409 with execute's reason as soon as it is
    dead-lettered, not 202 after the wait; approving a waiting run answers 200; acting
    on a run that ended answers 409 saying why, with nothing sent."""
    d = deployment
    workflow = tmp_path / "gate.yaml"
    workflow.write_text(GATE)
    tenant = await set_up_tenant(d, challenger=False, versions=(workflow, workflow))
    tasks = [{"idempotency_key": "gate-1", "input": {"n": 1}}]
    await produce(d.bootstrap, task_records(tenant, tasks, workflow="gate"))
    d.start("console")
    try:
        await asyncio.to_thread(d.wait_healthy)
        assert d.console_url is not None
        async with httpx.AsyncClient(base_url=d.console_url, timeout=60) as c:
            params = {"tenant": tenant}

            async def waiting() -> bool:
                got = await c.get("/api/runs", params={**params, "state": "suspended"})
                return got.status_code == 200 and len(got.json()["runs"]) == 1

            await wait_for("the run to wait in the console", waiting, 120)
            # `assay up`'s console reads every stage it was started after.
            shown: list[Any] = []

            async def every_stage_ready() -> bool:
                shown.append((await c.get("/api/stages")).json())
                return {s["health"] for s in shown[-1]["stages"]} == {"ready"}

            await wait_for("every stage ready in the console", every_stage_ready, 60)
            assert shown[-1]["mode"] == "distributed"
            assert [s["name"] for s in shown[-1]["stages"]] == list(STAGES)
            assert all(s["lag_total"] is not None for s in shown[-1]["stages"])
            assert 'data-stage="execute"' in (await c.get("/")).text
            (run,) = (await c.get("/api/runs", params=params)).json()["runs"]
            act = f"/api/runs/{run['run_id']}"
            wait = {**params, "wait": "30"}

            t0 = time.monotonic()
            refused = await c.post(f"{act}/signal", params=wait, json={"signal": "poke"})
            took = time.monotonic() - t0
            assert refused.status_code == 409, refused.text
            assert "waits for 'approval', not 'poke'" in refused.json()["detail"]
            assert took < 30, f"the refusal took the whole wait ({took:.1f} s)"

            approved = await c.post(f"{act}/approve", params=wait, json={"payload": "yes"})
            assert approved.status_code == 200, approved.text
            assert approved.json()["outcome"] == "applied"

            async def ended() -> bool:
                got = (await c.get(act, params=params)).json()
                return got["run"]["status"] is not None

            await wait_for("the approved run's result in the console", ended, 120)
            cancel = await c.post(f"{act}/cancel", params=wait, json={"reason": "late"})
            again = await c.post(f"{act}/approve", params=wait, json={})
        assert (cancel.status_code, again.status_code) == (409, 409)
        assert "has ended" in cancel.json()["detail"]
        assert "is not waiting" in again.json()["detail"]
    finally:
        # The module's other tests run without the console (tenant deletion counts stages).
        proc = d.procs.pop("console")
        d.ports.pop("console")
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)
