"""Deleting a tenant, embedded: `assay tenant delete` on a data directory where two
tenants ran tasks through every stage (the console's read model included).

Afterwards nothing of the deleted tenant is left in any table of any stage's SQLite file
(tables with a tenant column, the outbox by key) but its tombstone, nor in the embedded
bus's `bus.sqlite` but the deletion's own records on `assay.tenants`, nor under its blob
prefix or workspace root; the other tenant's rows, bus records, blobs and workspaces are
byte for byte what they were. Deleting again, or an unknown tenant, publishes nothing; a
task of the deleted tenant is refused at ingest with the reason; a deletion killed
half-way is finished by the next start of the pipeline, with no command sent again (the
bus's part too).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from assay.bus import TASKS, WORKFLOWS, commands
from assay.bus.topics import TENANTS
from assay.cli.tasks import read_tasks
from assay.devstack.deployment import ASSAY
from assay.kernel import BranchId, RunId, TenantId, WorkflowId, tenant_id
from assay.kernel.errors import Refused
from assay.messages import RunResult, TaskSubmitted, WorkflowRegistered, open_envelope
from assay.record import StateKey
from assay.record.erasure import tombstone_at
from assay.runtime import Embedded
from assay.runtime.sections import STAGE_ROLES
from assay.runtime.tenant_deletion import erasing_point
from assay.sandbox.local import LocalSandbox
from assay.workflow import load_workflow
from tests.pipeline import ROOT, V1
from tests.tenant_stores import bus_rows_of, holdings, leftovers
from tests.test_branch_grading import read, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TASKS_FILE = ROOT / "examples" / "tasks" / "arith.jsonl"
PER_TENANT = 3


async def _settled(rt: Embedded) -> bool:
    """Every stage has handled everything on the bus and shipped its outbox."""
    for runner in rt.runners.values():
        if any((await runner.lag()).values()) or await runner.log.drain_outbox(1):
            return False
    return True


async def populate(data_dir: Path) -> tuple[TenantId, TenantId]:
    """Two tenants, each with `PER_TENANT` tasks run to their results and a workspace
    left behind; returns once the pipeline is quiet."""
    tenants = (tenant_id(str(uuid.uuid4())), tenant_id(str(uuid.uuid4())))
    wf = load_workflow(V1)
    async with Embedded(data_dir, stages=STAGE_ROLES) as rt:
        rt.start()
        for t in tenants:
            doc = wf.model_dump(mode="json", by_alias=True)
            await rt.publish(WORKFLOWS, WorkflowRegistered(tenant=t, definition=doc), t)

            async def current(t: TenantId = t) -> bool:
                return await rt.logs["ingest"].get(StateKey(t, "allocation", wf.id)) is not None

            await wait_for(current, "the workflow to be current")
            for task in read_tasks(TASKS_FILE, t, WorkflowId(wf.id))[:PER_TENANT]:
                await rt.publish(TASKS, task, t, idem=task.idempotency_key)
            sandbox = LocalSandbox(data_dir / "sandbox", rt.blobs)
            ws = await sandbox.open(t, RunId("01JLEFTOVERWORKSPACE000000"), BranchId(0))
            await ws.write_file("notes.txt", f"{t}'s work".encode())

        async def all_results() -> bool:
            done = await read(rt, "assay.results", RunResult)
            return len({(r.tenant, r.run_id) for r in done}) >= 2 * PER_TENANT

        await wait_for(all_results, "every task's result", timeout_s=120)
        await wait_for(lambda: _settled(rt), "the pipeline to settle", timeout_s=60)
    return tenants


def cli(
    data_dir: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ASSAY, "--data-dir", str(data_dir), "tenant", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=240,
    )


async def tenant_records(data_dir: Path) -> list[Any]:
    """What `assay.tenants` carries."""
    async with Embedded(data_dir, stages=()) as rt:
        out = []
        for p in range(rt.partitions):
            out += [open_envelope(m.value) for m in await rt.bus.fetch(TENANTS, p, 0, 1000, 0.0)]
        return out


@pytest.fixture
async def two_tenants(tmp_path: Path) -> tuple[Path, TenantId, TenantId]:
    data_dir = tmp_path / "data"
    gone, kept = await populate(data_dir)
    return data_dir, gone, kept


async def test_deleting_a_tenant_leaves_its_tombstone_only_and_the_other_byte_for_byte(
    two_tenants: tuple[Path, TenantId, TenantId],
) -> None:
    data_dir, gone, kept = two_tenants
    before = holdings(data_dir, str(kept))
    mine = holdings(data_dir, str(gone))
    assert mine["blobs"]
    assert mine["workspaces"]
    assert mine["rows"]["console.sqlite/console_runs"]
    holding = {where.split("/")[0] for where, rows in mine["rows"].items() if rows}
    assert holding == {f"{stage}.sqlite" for stage in STAGE_ROLES}  # every stage had some
    assert before["blobs"]
    assert before["workspaces"]
    assert {"bus.sqlite/assay.tasks", "bus.sqlite/assay.results"} <= mine["bus"].keys()
    assert before["bus"]["bus.sqlite/assay.results"]

    done = cli(data_dir, "delete", str(gone), "--reason", "contract ended", "--json")
    assert done.returncode == 0, done.stderr
    progress = json.loads(done.stdout)
    assert progress["deleted"] is True
    assert sorted(progress["stages"]) == sorted(STAGE_ROLES)
    (command,) = {s["command"] for s in progress["stages"].values()}

    assert holdings(data_dir, str(kept)) == before
    assert leftovers(data_dir, str(gone), command) == {}
    after = holdings(data_dir, str(gone))
    assert (after["blobs"], after["workspaces"]) == ({}, {})
    assert list(after["bus"]) == ["bus.sqlite/assay.tenants"]  # the command and the answers
    assert not (data_dir / "blobs" / str(gone)).exists()
    assert not (data_dir / "sandbox" / str(gone)).exists()
    answers = [e for e in await tenant_records(data_dir) if e.type == "TenantStageDeleted"]
    assert sorted(e.payload["stage"] for e in answers) == sorted(STAGE_ROLES)

    # Again: a no-op that publishes nothing, and the status says every stage is done.
    sent = len(await tenant_records(data_dir))
    again = cli(data_dir, "delete", str(gone))
    assert again.returncode == 0, again.stderr
    assert f"deleted in {len(STAGE_ROLES)} of {len(STAGE_ROLES)} stages" in again.stdout
    assert len(await tenant_records(data_dir)) == sent
    status = cli(data_dir, "status", str(gone), "--json")
    assert json.loads(status.stdout)["deleted"] is True
    assert holdings(data_dir, str(kept)) == before

    # A task of the deleted tenant is refused at ingest, and says why.
    task = TaskSubmitted(
        tenant=gone, workflow_id=WorkflowId("arith"), idempotency_key="late", input={}
    )
    async with Embedded(data_dir, stages=STAGE_ROLES) as rt:

        async def never() -> None:
            return None

        with pytest.raises(Refused, match=f"tenant {gone} was deleted"):
            await rt.command("ingest", commands.submit_task(task).entry, never, 60)
    # It and its dead letter stay a while (`LATE_GRACE_S`): the sender read why.
    left = leftovers(data_dir, str(gone), command)
    assert sorted(left) == ["bus.sqlite/assay.dlq.ingest", "bus.sqlite/assay.tasks"]
    for records in left.values():
        assert [open_envelope(r[3]).payload["idempotency_key"] for r in records] == ["late"]


async def test_deleting_an_unknown_tenant_is_an_error_and_publishes_nothing(
    two_tenants: tuple[Path, TenantId, TenantId],
) -> None:
    data_dir, _, kept = two_tenants
    before = holdings(data_dir, str(kept))
    stranger = str(uuid.uuid4())
    done = cli(data_dir, "delete", stranger)
    assert done.returncode == 2
    assert f"no tenant {stranger}" in done.stderr
    assert "nothing was published" in done.stderr
    assert await tenant_records(data_dir) == []
    bad = cli(data_dir, "delete", "not-a-tenant")
    assert bad.returncode == 2
    assert "UUID" in bad.stderr
    assert holdings(data_dir, str(kept)) == before


async def test_a_deletion_killed_half_way_is_finished_by_the_next_start(
    two_tenants: tuple[Path, TenantId, TenantId],
) -> None:
    data_dir, gone, kept = two_tenants
    before = holdings(data_dir, str(kept))
    point = erasing_point("verify")  # blobs and workspaces gone, verify's rows not yet
    killed = cli(data_dir, "delete", str(gone), env={"ASSAY_CRASH_AT": point})
    assert killed.returncode == -9, killed.stderr

    status = cli(data_dir, "status", str(gone), "--json")
    assert status.returncode == 0, status.stderr
    stages = json.loads(status.stdout)["stages"]
    assert stages["verify"] is None, "verify finished although it was killed first"
    sent = len(await tenant_records(data_dir))
    assert sent >= 1

    # The next start of the pipeline finishes it from the bus: nothing is sent again.
    async with Embedded(data_dir, stages=STAGE_ROLES) as rt:
        rt.start()

        async def finished() -> bool:
            for log in rt.logs.values():
                if await log.get(tombstone_at(gone)) is None:
                    return False
            return True

        await wait_for(finished, "every stage to finish the deletion", timeout_s=60)
        await wait_for(lambda: _settled(rt), "the pipeline to settle", timeout_s=60)

        async def off_the_bus() -> bool:
            return list(bus_rows_of(data_dir, str(gone))) == ["bus.sqlite/assay.tenants"]

        await wait_for(off_the_bus, "the tenant's records to leave the bus", timeout_s=30)
    assert len([e for e in await tenant_records(data_dir) if e.type == "TenantDeleted"]) == 1
    command = json.loads(cli(data_dir, "status", str(gone), "--json").stdout)["stages"]["ingest"]
    assert leftovers(data_dir, str(gone), command["command"]) == {}
    assert holdings(data_dir, str(kept)) == before
