"""Replay tournaments, verifier context and winner-only effects in distributed mode: the
six stage processes on a real broker, Postgres and S3 — one deployment for the module,
each scenario in a tenant of its own, driven from outside as a user would (`assay
register`, `assay submit`, plain aiokafka clients) and checked on the topics a consumer
reads, with SQL on a stage's schema only to see state.

The embedded counterparts are `test_replay_matrix.py`, `test_model_context_embedded.py`
and `test_winner_effects.py`.

Measured (the module's wall time, on the two cores this suite shares): 34-54 s when the
other test runs were light, 70-88 s with other test runs busy on the same cores; starting
and stopping the deployment is 11-40 s of it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from assay.devstack import Service
from assay.devstack.deployment import ASSAY, Deployment, deploy
from assay.messages import (
    MESSAGES,
    Episode,
    Purpose,
    RolloutResult,
    RunResult,
    RunVerified,
    UsageRecorded,
    Versioned,
)
from assay.store import S3BlobStore
from assay.workflow import WorkflowDef, from_document
from tests import winner_effects
from tests.pipeline import produce, read_topic, register, task_records, wait_for
from tests.test_replay_matrix import (  # the embedded test's two versions, and its check
    CALLS,
    V1,
    V2,
    ranked_against_control,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.kafka,
    pytest.mark.postgres,
    pytest.mark.s3,
    pytest.mark.timeout(300),
]

REFUSED = "0c7f8f0e-3c1d-4f7e-9b2a-5d6c7e8f9a21"
"""The tenant whose replay ceiling holds two candidates, not three."""
ENV = {
    "ASSAY_REPLAY_CEILINGS": f"{REFUSED}={2 * CALLS}",
    "ASSAY_SANDBOX_NETWORK": "allow",  # http_request may reach the loopback ledger
}


MATRIX = [
    "--candidate",
    "v1:version=current",
    "--candidate",
    f"v2:version={V2.version[:16]}",
    "--candidate",
    "big:model=stub-arith-2",
]
REFUSED_MATRIX = [
    "--candidate",
    "v1:version=current",
    "--candidate",
    "careful:prompt=Step by step: {{ task.question }}",
    "--candidate",
    "big:model=stub-arith-2",
]
"""Three candidates of `CALLS` each: the third is one too many for `REFUSED`'s ceiling."""
EXPLAIN = from_document(
    {
        "id": "explain",
        "steps": [
            {"id": "answer", "kind": "model", "prompt": "Explain {{ task.question }} simply."}
        ],
        "verifiers": [
            {"id": "had_question", "kind": "context", "expect": {"packed": ["task.question"]}},
            {
                "id": "had_notes",
                "kind": "context",
                "step": "answer",
                "expect": {"packed": ["task.notes"], "tools_offered": ["search"]},
            },
        ],
    }
)


@pytest.fixture(scope="module")
def deployment(
    postgres: Service, s3: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    d = asyncio.run(deploy(tmp_path_factory.mktemp("depth"), postgres, s3, extra_env=ENV))
    try:
        yield d
    finally:
        d.stop()


def assay(d: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ASSAY, *args], env=d.env, capture_output=True, text=True, timeout=120, check=False
    )


async def state(d: Deployment, stage: str, tenant: str, kind: str, key: str | None = None) -> Any:
    """A stage's state documents of one kind for a tenant (one document, when `key`)."""
    sql = f"SELECT key, value FROM {stage}.state WHERE tenant = $1 AND kind = $2"
    rows = await d.query(sql, uuid.UUID(tenant), kind)
    docs = {r["key"]: json.loads(r["value"]) for r in rows}
    return docs if key is None else docs.get(key)


async def register_all(d: Deployment, tmp_path: Path, tenant: str, *wfs: WorkflowDef) -> None:
    """`assay register` each definition in turn; back once ingest stored them all."""
    for wf in wfs:
        path = tmp_path / f"{wf.id}-{wf.version[:8]}.json"
        path.write_text(json.dumps(wf.model_dump(mode="json", by_alias=True)))
        await asyncio.to_thread(register, d, tenant, path)

    async def stored() -> bool:
        if await state(d, "ingest", tenant, "allocation", wfs[0].id) is None:
            return False
        return all([await state(d, "ingest", tenant, "definition", wf.version) for wf in wfs])

    await wait_for("the versions to be stored", stored)


def submit(
    d: Deployment,
    tmp_path: Path,
    tenant: str,
    key: str,
    *flags: str,
    workflow: str = V1.id,
    task_input: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`assay submit` of one task (by default, an arithmetic one)."""
    tasks = tmp_path / f"{key}.jsonl"
    task = {"idempotency_key": key, "input": task_input or {"question": "17 * 23", "answer": "391"}}
    tasks.write_text(json.dumps(task) + "\n")
    return assay(d, "submit", str(tasks), "--tenant", tenant, "--workflow", workflow, *flags)


async def messages_of(
    d: Deployment, topic: str, tenant: str, kind: type[Versioned], until: Any, timeout_s: float
) -> list[Any]:
    """The `kind` messages of a tenant on a topic, read from the beginning until `until`."""

    def decoded(records: list[Any]) -> list[Any]:
        out = []
        for r in records:
            body = json.loads(r.value)
            if body["type"] == kind.type and body["tenant"] == tenant:
                out.append(MESSAGES.decode(body["type"], body["schema_version"], body["payload"]))
        return out

    records = await read_topic(d.bootstrap, topic, lambda rs: until(decoded(rs)), timeout_s)
    return decoded(records)


async def test_a_matrix_is_ranked_against_the_pinned_control_and_metered_as_replay(
    deployment: Deployment, tmp_path: Path
) -> None:
    d, tenant = deployment, str(uuid.uuid4())
    await register_all(d, tmp_path, tenant, V1, V2)
    done = await asyncio.to_thread(submit, d, tmp_path, tenant, "matrix-1", *MATRIX)
    assert done.returncode == 0, done.stderr
    assert "task 'matrix-1' admitted" in done.stdout
    (result,) = await messages_of(d, "assay.results", tenant, RolloutResult, any, 120)
    # A resubmission admits and reserves nothing more: ingest's inbox drops it, so (every
    # sibling spawned long ago) no verdict comes, and the command says so.
    again = await asyncio.to_thread(
        submit, d, tmp_path, tenant, "matrix-1", *MATRIX, "--wait-s", "2"
    )
    assert again.returncode == 3, again.stdout + again.stderr
    assert "task 'matrix-1': no verdict from ingest within 2 s" in again.stderr

    lines = ranked_against_control(result, {"v1": 1, "v2": 1, "big": 1})
    assert [len(c.runs) for c in lines.values()] == [1, 1, 1]
    runs = {run for c in lines.values() for run in c.runs}

    def own_calls(usage: list[UsageRecorded]) -> list[UsageRecorded]:
        return [u for u in usage if u.run_id in runs and u.judge_purpose is None]

    usage = await messages_of(
        d,
        "assay.usage",
        tenant,
        UsageRecorded,
        lambda us: {u.run_id for u in own_calls(us)} == runs,
        30,
    )
    calls = own_calls(usage)
    assert {u.purpose for u in calls} == {Purpose.REPLAY}  # the candidates' own calls
    judged = [u for u in usage if u.run_id in runs and u.judge_purpose is not None]
    assert {u.purpose for u in judged} <= {Purpose.GRADING}  # the selection's are grading's
    big = set(lines["big"].runs)
    assert {u.model for u in calls if u.run_id in big} == {"stub-arith-2"}
    assert {u.model for u in calls if u.run_id not in big} == {"stub-arith-1"}
    meter = await state(d, "ingest", tenant, "meter", "replay")
    assert meter is not None
    assert (meter["calls_today"], meter["runs_today"]) == (3 * CALLS, 3)  # once, at admission
    assert await state(d, "aggregate", tenant, "version") == {}, "a candidate was tallied"


async def test_a_matrix_that_cannot_be_admitted_whole_is_refused_at_submission(
    deployment: Deployment, tmp_path: Path
) -> None:
    """`assay submit` waits for ingest's verdict: the refusal, naming the candidate, is its
    error and exit status; nothing is recorded, reserved or spawned, so the same key with
    a matrix that fits is admitted."""
    d, tenant = deployment, REFUSED
    await register_all(d, tmp_path, tenant, V1)
    done = await asyncio.to_thread(submit, d, tmp_path, tenant, "too-big", *REFUSED_MATRIX)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "task 'too-big' refused: candidate 'big'" in done.stderr
    assert "replay ceiling of 6" in done.stderr
    key = f"{tenant}:too-big".encode()  # the operator's copy: the task, with the same reason
    dead = await read_topic(
        d.bootstrap, "assay.dlq.ingest", lambda rs: any(r.key == key for r in rs), 30
    )
    (reason,) = [dict(r.headers)["assay-dlq-reason"].decode() for r in dead if r.key == key]
    assert reason in done.stderr
    assert await state(d, "ingest", tenant, "rollout", "too-big") is None, "a group was left"
    assert await state(d, "ingest", tenant, "meter", "replay") is None, "replay was reserved"
    assert await state(d, "execute", tenant, "run") == {}

    fits = await asyncio.to_thread(submit, d, tmp_path, tenant, "too-big", *REFUSED_MATRIX[:4])
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert "task 'too-big' admitted" in fits.stdout
    meter = await state(d, "ingest", tenant, "meter", "replay")
    assert meter is not None
    assert meter["calls_today"] == 2 * CALLS


async def test_a_context_verifier_reads_the_episodes_context_and_its_result_reaches_results(
    deployment: Deployment, tmp_path: Path
) -> None:
    d, tenant = deployment, str(uuid.uuid4())
    await register_all(d, tmp_path, tenant, EXPLAIN)
    task = {"question": "the tides", "notes": "the moon pulls the sea"}
    sent = await asyncio.to_thread(
        submit, d, tmp_path, tenant, "tides", "--wait", workflow=EXPLAIN.id, task_input=task
    )
    assert sent.returncode == 0, sent.stdout + sent.stderr
    assert "task 'tides' admitted" in sent.stdout  # --wait: a plain task's verdict too
    (done,) = await messages_of(d, "assay.results", tenant, RunResult, any, 90)
    verdicts = {v.verifier: v for v in done.verification}
    assert verdicts["had_question"].passed, verdicts["had_question"].evidence
    assert not verdicts["had_notes"].passed
    assert verdicts["had_notes"].evidence == (
        "task.notes was available and not packed; tool search not offered"
    )

    (verified,) = await messages_of(d, "assay.verified", tenant, RunVerified, any, 30)
    blobs = S3BlobStore(
        d.env["ASSAY_S3_ENDPOINT"],
        d.env["ASSAY_S3_BUCKET"],
        access_key_id=d.env["ASSAY_S3_ACCESS_KEY_ID"],
        secret_access_key=d.env["ASSAY_S3_SECRET_ACCESS_KEY"],
    )
    await blobs.open()
    try:
        stored = await blobs.get(verified.run.tenant, verified.episode)
    finally:
        await blobs.close()
    assert stored is not None
    episode = Episode.model_validate_json(stored)
    (call,) = [a.context for a in episode.attempts if a.context is not None]
    assert [(r.ref, r.chars) for r in call.packed] == [("task.question", 9)]
    assert [(r.ref, r.chars) for r in call.available] == [("task.notes", 22)]
    assert (call.dropped, call.tools_offered) == ([], [])


async def test_of_two_siblings_calling_an_unsafe_tool_only_the_winners_request_arrives(
    deployment: Deployment, tmp_path: Path
) -> None:
    d, tenant = deployment, str(uuid.uuid4())
    await register_all(d, tmp_path, tenant, winner_effects.WORKFLOW)
    with winner_effects.Ledger() as ledger:
        task = {
            "idempotency_key": winner_effects.GROUP,
            "input": {"question": "17 * 23", "url": ledger.url},
            "rollout": {"n": 2, "budget": {"max_concurrency": 2}},
        }
        await produce(d.bootstrap, task_records(tenant, [task], winner_effects.WORKFLOW.id))
        (result,) = await messages_of(d, "assay.results", tenant, RolloutResult, any, 120)

        async def settled() -> bool:
            effects = await state(d, "execute", tenant, "staged-effect")
            return len(effects) == 2 and all(
                e["state"] in winner_effects.SETTLED for e in effects.values()
            )

        await wait_for("both staged effects to settle", settled, 60)
        effects = await state(d, "execute", tenant, "staged-effect")
        (entry,) = ledger.entries  # exactly one request reached the outside world
    assert [s.ended for s in result.siblings] == ["verified", "verified"]
    assert all(s.passed for s in result.siblings)  # each verified its staged marker
    assert result.winner is not None
    (loser,) = [s.run_id for s in result.siblings if s.run_id != result.winner]
    by_run = {key.split("/")[0]: doc for key, doc in effects.items()}
    assert by_run[str(result.winner)]["state"] == "published"
    assert by_run[str(loser)]["state"] == "discarded"
    index = {s.run_id: s.index for s in result.siblings}
    assert by_run[str(loser)]["detail"] == (
        f"sibling #{index[loser]} was not selected (#{index[result.winner]} was)"
    )
    assert entry.body.strip()  # what the winner's agent decided to send
