"""Lease takeover with real processes (§9.4): SIGSTOP the worker driving a run for twice
the lease TTL and the consumer group's rebalance, let the other worker take the run
over, SIGCONT the first, and check that none of its writes under the stale fence landed.

Two `assay serve execute` processes share one consumer group, one Postgres schema and
one broker. The run's slow step calls an `Idempotent` tool, installed as a plugin (an
`assay.tools` entry point on PYTHONPATH), that waits while a gate file exists and then
applies its effect at a file-backed "provider" which deduplicates by idempotency key,
logging every call to a sink. The holder is stopped mid-call; the other worker claims
the lapsed lease once the group has given it the run's partition, retries the call under
the same key (§8.4), finishes the run and hands it on, all while the first is stopped.
Continued, the first is mid-call under a lease it lost: its heartbeat's renewal or its
next commit, whichever reaches the database first, is refused, and it gives the message up.

Who wrote what is observed from outside the processes: a trigger on the stage's log
table records, for every record inserted, which process's connection inserted it (a
custom setting in each process's DSN) and the lease of the run as it stood at that
moment. Those are the facts the assertions are about; the processes' own words (their
`/metrics`, their log) are checked as well, not relied upon.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import signal
import textwrap
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from prometheus_client.parser import text_string_to_metric_families

from assay.bus import EPISODES, RUNS, KafkaTransport
from assay.bus.topics import producer_entry
from assay.devstack import Service
from assay.devstack.deployment import Deployment, deploy
from assay.engine import BUILTIN_TOOLS
from assay.kernel import BranchId, TaskId, TenantId, content_hash, new_run_id
from assay.messages import Purpose, Role, RunRef, RunSpawned
from assay.workflow import WorkflowDef, validate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.kafka,
    pytest.mark.postgres,
    pytest.mark.s3,
    pytest.mark.timeout(120),
]

TTL_S = 2.0
"""`ASSAY_LEASE_TTL_S` of both workers: the heartbeat renews every third of it."""
MEMBER_TIMEOUT_MS = 3_000
"""`ASSAY_KAFKA_MEMBER_TIMEOUT_MS`: short, so the group gives a stopped member's
partitions away while it is stopped (the default, 10 s, would only slow the test)."""
REBALANCE_S = MEMBER_TIMEOUT_MS / 1000 + min(3.0, MEMBER_TIMEOUT_MS / 3000)
"""A silent member is dropped after the member timeout; the others hear of it at their
next heartbeat and join again."""
STOPPED_S = 2 * TTL_S + REBALANCE_S
"""How long the holder stays stopped, at least."""
RESUME_WITHIN_S = TTL_S + REBALANCE_S + 2.0
"""The run must be driven again this soon after the holder was stopped."""
WORKERS = ("execute-a", "execute-b")
GATE_POLL_S = 0.05
TOOL = "hold_then_apply"

TOOL_MODULE = f'''
"""An idempotent call to a file-backed provider, held while a gate file exists."""

import asyncio
import json
import os
from pathlib import Path

from assay.engine import Idempotent, Tool


async def _hold_then_apply(call):
    sink = Path(call.args["sink"])

    def note(event):
        line = {{
            "pid": os.getpid(),
            "event": event,
            "key": call.idempotency_key,
            "request_id": call.request_id,
        }}
        with sink.open("a") as out:
            out.write(json.dumps(line) + "\\n")

    note("called")
    while Path(call.args["gate"]).exists():
        await asyncio.sleep({GATE_POLL_S})
    try:  # the provider: one effect per idempotency key, a repeat is acknowledged
        with open(Path(call.args["effects"]) / call.require_key(), "x") as effect:
            effect.write(str(os.getpid()))
        note("applied")
    except FileExistsError:
        note("deduplicated")
    return f"applied for {{os.getpid()}}"


hold_then_apply = Tool(
    "{TOOL}",
    _hold_then_apply,
    Idempotent(key=("item",)),
    "Applies `item` once at a file-backed provider, after `gate` is gone.",
)
'''


def install_tool(root: Path) -> Path:
    """A distribution registering the tool under `assay.tools`; returns its PYTHONPATH."""
    module = "lease_takeover_tools"
    root.mkdir()
    (root / f"{module}.py").write_text(textwrap.dedent(TOOL_MODULE))
    dist = root / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[assay.tools]\n{TOOL} = {module}:hold_then_apply\n")
    return root


AUDIT = """
CREATE SCHEMA lease_audit;
CREATE TABLE lease_audit.writes (
    seq bigint NOT NULL, tenant uuid NOT NULL, stream text NOT NULL, branch integer NOT NULL,
    lsn bigint NOT NULL, type text NOT NULL,
    writer text,   -- the process whose connection inserted the record
    holder text,   -- the run's lease at that moment
    fence bigint
);
CREATE FUNCTION lease_audit.record() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $fn$
BEGIN
    INSERT INTO lease_audit.writes
    SELECT NEW.seq, NEW.tenant, NEW.stream, NEW.branch, NEW.lsn, NEW.type,
           current_setting('lease_audit.writer', true), l.holder, l.fence
    FROM (SELECT 1) AS one
    LEFT JOIN execute.leases l ON l.tenant = NEW.tenant AND l.stream = NEW.stream;
    RETURN NULL;
END
$fn$;
CREATE TRIGGER lease_audit AFTER INSERT ON execute.log
    FOR EACH ROW EXECUTE FUNCTION lease_audit.record();
"""
"""Why a trigger: the fenced commit locks the lease row in the statement that inserts the
records, so a record that commits was inserted while the lease it sees here was current."""


@dataclass
class Scene:
    """A deployment with two execute workers, a tenant, and the tool's files."""

    d: Deployment
    tenant: TenantId
    gate: Path
    sink: Path
    effects: Path

    def pid(self, worker: str) -> int:
        return self.d.procs[worker].pid

    def calls(self) -> list[dict[str, Any]]:
        if not self.sink.exists():
            return []
        return [json.loads(line) for line in self.sink.read_text().splitlines()]


@pytest.fixture
async def scene(postgres: Service, s3: Service, tmp_path: Path) -> AsyncIterator[Scene]:
    d = await deploy(tmp_path / "deployment", postgres, s3, stages=())
    try:
        plugins = install_tool(tmp_path / "plugins")
        for worker in WORKERS:
            # A custom setting rides on each process's connections (asyncpg sends the DSN's
            # query parameters as server settings): the trigger reads who is writing.
            d.start(
                "execute",
                name=worker,
                env={
                    "ASSAY_DATABASE_URL": f"{d.dsns['execute']}?lease_audit.writer={worker}",
                    "ASSAY_LEASE_TTL_S": str(TTL_S),
                    "ASSAY_KAFKA_MEMBER_TIMEOUT_MS": str(MEMBER_TIMEOUT_MS),
                    "PYTHONPATH": str(plugins),
                },
            )
        await asyncio.to_thread(d.wait_healthy)  # the stage's tables exist from here on
        pids = [d.procs[w].pid for w in WORKERS]
        await until("both workers in a stable group", lambda: _grouped(d.bootstrap, pids), 30)
        conn = await asyncpg.connect(d.admin_dsn)
        try:
            await conn.execute(AUDIT)
        finally:
            await conn.close()
        scene = Scene(
            d,
            TenantId(uuid.uuid4()),
            tmp_path / "gate",
            tmp_path / "sink.jsonl",
            tmp_path / "effects",
        )
        scene.effects.mkdir()
        yield scene
    finally:
        d.stop()  # continues a stopped process before terminating it


def spawned(scene: Scene) -> RunSpawned:
    wf = validate(
        WorkflowDef.model_validate(
            {
                "id": "takeover",
                "steps": [
                    {
                        "id": "apply",
                        "kind": "tool",
                        "tool": TOOL,
                        "timeout_s": 120,
                        "args": {
                            "item": "{{ task.item }}",
                            "gate": str(scene.gate),
                            "sink": str(scene.sink),
                            "effects": str(scene.effects),
                        },
                    },
                    {"id": "tidy", "kind": "tool", "tool": "strip", "args": {"text": " ok "}},
                ],
            }
        ),
        frozenset([*BUILTIN_TOOLS, TOOL]),
    )
    task = {"item": "invoice-7"}
    ref = RunRef(
        tenant=scene.tenant,
        run_id=new_run_id(),
        task_id=TaskId(content_hash(task)),
        idempotency_key="takeover-1",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpawned(run=ref, definition=wf.model_dump(mode="json", by_alias=True), input=task)


async def until(what: str, check: Callable[[], Any], timeout_s: float) -> Any:
    """Poll `check` (plain or async) until it gives something truthy; return that."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if inspect.isawaitable(found):
            found = await found
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def counter(d: Deployment, worker: str, name: str) -> float:
    """A counter of one process's `/metrics` (its `_total` sample)."""
    url = f"http://127.0.0.1:{d.ports[worker]}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name == f"{name}_total")
    raise AssertionError(f"{worker} exposes no {name}")


async def lease(d: Deployment, tenant: TenantId, run: str) -> tuple[str, int] | None:
    rows = await d.query(
        "SELECT holder, fence FROM execute.leases WHERE tenant = $1 AND stream = $2", tenant, run
    )
    return (rows[0]["holder"], rows[0]["fence"]) if rows and rows[0]["holder"] else None


def holder_pid(holder: str) -> int:
    """The pid in a worker id (`host:pid:nonce`, `assay.runtime.leases.new_worker_id`)."""
    return int(holder.split(":")[-2])


async def test_a_stopped_lease_holder_is_taken_over_and_none_of_its_late_writes_land(
    scene: Scene,
) -> None:
    d, tenant = scene.d, scene.tenant
    msg = spawned(scene)
    run = msg.run.run_id
    scene.gate.touch()
    # RunSpawned goes straight onto `assay.runs`, as ingest would send it: ingest (and a
    # registered workflow, an allocation) would add nothing to what is tested here, only
    # moving parts, and the message is a versioned contract of its own.
    async with KafkaTransport(d.bootstrap, client_id="lease-takeover-test") as transport:
        await transport.publish([producer_entry(RUNS, msg, tenant, "takeover-1")])

    # -- the run is mid-call: find the worker whose lease it is under ---------------------
    await until("the tool to be called", scene.calls, 60)
    holder, fence = await until("the run's lease", lambda: lease(d, tenant, run), 10)
    pids = {scene.pid(w): w for w in WORKERS}
    stopped = pids[holder_pid(holder)]
    other = next(w for w in WORKERS if w != stopped)
    assert [c["pid"] for c in scene.calls()] == [scene.pid(stopped)]
    # The call is issued only once its Dispatched intent is committed (§8.4): this is all
    # the holder has written, and all it may ever write.
    before = await log_of(d, tenant, run)

    d.procs[stopped].send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        # -- the other worker claims the lapsed lease and drives the run on -----------------
        async def taken_over() -> tuple[str, int] | None:
            now = await lease(d, tenant, run)
            return now if now is not None and now[1] > fence else None

        new_holder, new_fence = await until("the fence to move on", taken_over, 30)
        assert holder_pid(new_holder) == scene.pid(other)

        async def retried() -> bool:
            return any(c["pid"] == scene.pid(other) for c in scene.calls())

        await until("the other worker to call the tool again", retried, 30)
        resumed_after = time.monotonic() - stopped_at
        assert resumed_after <= RESUME_WITHIN_S, (
            f"the run was driven again {resumed_after:.1f}s after the stop"
        )
        # -- it finishes the run and hands it on while the holder is still stopped ---------
        scene.gate.unlink()  # both calls may finish now: the late one's writes must not land
        finished = await until("the run to finish", lambda: _finished(d, tenant, run), 30)
        # Even when the stopped process led the stage's outbox relay: the other ends its
        # lock's connection once it has been silent for the TTL, and leads.
        handed_on = await _handed_on(d.bootstrap, run)
        assert handed_on, "the run was not handed on while its first holder was stopped"
        # -- the holder stays stopped for twice the TTL and the rebalance, then goes on ----
        await asyncio.sleep(max(0.0, STOPPED_S - (time.monotonic() - stopped_at)))
    finally:
        d.procs[stopped].send_signal(signal.SIGCONT)

    outcomes = ("assay_messages_abandoned", "assay_messages_handled", "assay_dead_letters")
    await until(
        f"{stopped} to be done with the message, one way or another",
        lambda: sum(counter(d, stopped, name) for name in outcomes) >= 1,
        30,
    )
    await asyncio.sleep(2 * TTL_S)  # anything the resumed worker still had in flight

    # -- the log: dense, in order, one end ----------------------------------------------
    records = await log_of(d, tenant, run)
    assert records[: len(before)] == before
    assert [r["lsn"] for r in records] == list(range(len(records))), "LSNs are not dense"
    assert [r["seq"] for r in records] == sorted(r["seq"] for r in records), "out of order"
    assert [r["type"] for r in records].count("RunFinished") == 1
    assert records[-1]["type"] == "RunFinished"
    assert finished == len(records)
    bodies = [(r["type"], json.loads(r["body"])) for r in records]
    started = [(b["step"], b["attempt"]) for t, b in bodies if t == "AttemptStarted"]
    assert sorted(set(started)) == sorted(started), "an attempt was started twice"
    ended = [(b["step"], b["attempt"]) for t, b in bodies if t == "AttemptFinished"]
    assert sorted(set(ended)) == sorted(ended), "an attempt was finished twice"
    assert sorted(ended) == sorted(started)

    # -- who wrote what, under which lease ----------------------------------------------
    writes = await d.query(
        "SELECT seq, lsn, type, writer, holder, fence FROM lease_audit.writes"
        " WHERE tenant = $1 AND stream = $2 ORDER BY seq",
        tenant,
        run,
    )
    assert [(w["seq"], w["lsn"]) for w in writes] == [(r["seq"], r["lsn"]) for r in records]
    by = {stopped: fence, other: new_fence}
    for w in writes:
        assert w["writer"] in by, f"record {w['lsn']} written by {w['writer']!r}"
        assert w["holder"] is not None, f"record {w['lsn']} written without a lease"
        # 0 writes with a stale fence accepted: each record was written by the process
        # holding the run's lease at that moment, under that lease's fence.
        assert holder_pid(w["holder"]) == scene.pid(w["writer"]), dict(w)
        assert w["fence"] == by[w["writer"]], dict(w)
    writers = [w["writer"] for w in writes]
    assert writers == [stopped] * len(before) + [other] * (len(writers) - len(before)), (
        f"the stopped worker wrote after the takeover: {writers}"
    )

    # -- the call: retried under one key; the provider applied it once (§8.4) -----------
    calls = scene.calls()
    (request,) = {(c["key"], c["request_id"]) for c in calls}
    assert request[0], "an idempotent call without its key"
    callers = [c["pid"] for c in calls if c["event"] == "called"]
    assert callers == [scene.pid(stopped), scene.pid(other)]
    assert [c["event"] for c in calls].count("applied") == 1
    assert len(list(scene.effects.iterdir())) == 1
    committed = [
        b for t, b in bodies if t == "Intent" and b["step"] == "apply" and b["state"] == "committed"
    ]
    (intent,) = committed
    assert intent["resolved_by"] == "retried under the same idempotency key"
    (apply_end,) = [b for t, b in bodies if t == "AttemptFinished" and b["step"] == "apply"]
    assert apply_end["output"] == f"applied for {scene.pid(other)}"

    # -- handed on to verification once, with the episode the log ends with -----------
    (executed,) = await _handed_on(d.bootstrap, run)
    assert executed == handed_on[0]
    assert executed["type"] == "RunExecuted"
    assert executed["payload"]["episode"] == json.loads(records[-1]["body"])["episode"]

    # -- what the processes say ---------------------------------------------------------
    assert counter(d, stopped, "assay_messages_abandoned") == 1
    assert counter(d, other, "assay_messages_abandoned") == 0
    assert counter(d, stopped, "assay_dead_letters") == 0
    assert counter(d, other, "assay_dead_letters") == 0
    assert re.search(
        r"abandoned assay\.runs/.*(lease \d+ was taken over|fence \d+ is stale)", d.log(stopped)
    )
    for worker in WORKERS:
        assert d.procs[worker].poll() is None, f"{worker} exited: {d.log(worker)[-2000:]}"


async def log_of(d: Deployment, tenant: TenantId, run: str) -> list[asyncpg.Record]:
    """The records of the run's main branch, by LSN."""
    return await d.query(
        "SELECT seq, lsn, type, convert_from(payload, 'UTF8')::jsonb AS body FROM execute.log"
        " WHERE tenant = $1 AND stream = $2 AND branch = $3 ORDER BY lsn",
        tenant,
        run,
        BranchId(0),
    )


async def _grouped(bootstrap: str, pids: list[int]) -> bool:
    """Whether `assay-execute` is stable with a member from each of these processes (a
    member id starts with its client id, which ends with the process id)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (response,) = await admin.describe_consumer_groups(["assay-execute"])
    finally:
        await admin.close()
    (group,) = response.groups
    _, _, state, *_, members = group
    ids = [member[0] for member in members]
    return state == "Stable" and all(any(f"-{pid}-" in m for m in ids) for pid in pids)


async def _handed_on(bootstrap: str, run: str) -> list[dict[str, Any]]:
    """The distinct messages of `assay.episodes` about `run` (a re-publish keeps its id)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    found: dict[str, dict[str, Any]] = {}
    try:
        await consumer.topics()
        parts = [TopicPartition(EPISODES, p) for p in consumer.partitions_for_topic(EPISODES) or ()]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        quiet_since = deadline = time.monotonic()
        deadline += 30
        while time.monotonic() < deadline and (not found or time.monotonic() - quiet_since < 1):
            for batch in (await consumer.getmany(timeout_ms=200)).values():
                for record in batch:
                    body = json.loads(record.value)
                    if body["payload"]["run"]["run_id"] == run:
                        found[body["id"]] = body
                        quiet_since = time.monotonic()
    finally:
        await consumer.stop()
    return list(found.values())


async def _finished(d: Deployment, tenant: TenantId, run: str) -> int:
    """The number of records of the run's log once it has a `RunFinished`, else 0."""
    rows = await d.query(
        "SELECT count(*) AS n, bool_or(type = 'RunFinished') AS done FROM execute.log"
        " WHERE tenant = $1 AND stream = $2",
        tenant,
        run,
    )
    return int(rows[0]["n"]) if rows[0]["done"] else 0
