"""A drifted task mix holds promotion (§12.5, §12.3 "drift check clean") until ingest
takes a new reference — on an operator's acknowledgement — and holds nothing else. On
SQLite and Postgres."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from assay.bus import WORKFLOWS
from assay.devstack.base import Service
from assay.devstack.postgres import scratch_database
from assay.kernel import TenantId, WorkflowId
from assay.kernel.scores import WinRecord
from assay.messages import AllocationChanged, Promoted, TaskMixDrifted, TaskMixRebased
from assay.store import EventLog
from assay.store.postgres import PostgresEventLog
from assay_decide.events import DECIDE_EVENTS
from assay_decide.state import fold_decide
from services.decide.tests.decide_harness import LADDER, TENANT, Stage, evidence, ir, open_stage

OTHER = TenantId(uuid.UUID("00000000-0000-4000-8000-0000000000d2"))
WINS = WinRecord(judge_wins=6, verifier_wins=3)
SOME = WinRecord(judge_wins=3, judge_losses=1)


def drifted(tenant: TenantId = TENANT) -> TaskMixDrifted:
    return TaskMixDrifted(
        tenant=tenant,
        workflow_id=WorkflowId("arith"),
        current=ir(1).version,
        psi={"input.language": 0.412, "task_id.class": 0.0},
        threshold=0.2,
        window=500,
        sampled=1000,
        reference_tasks=500,
    )


def rebased(cause: Any = "acknowledged") -> TaskMixRebased:
    return TaskMixRebased(
        tenant=TENANT,
        workflow_id=WorkflowId("arith"),
        current=ir(1).version,
        cause=cause,
        reference_tasks=500,
        sampled=1000,
        reason="the new market",
    )


@pytest.fixture(scope="module")
def decide_database(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_decide_mix") as dsn:
        yield dsn


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def stage(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stage]:
    log: EventLog | None = None
    if request.param == "postgres":
        dsn = str(request.getfixturevalue("decide_database"))
        log = PostgresEventLog(dsn, f"decide_{uuid.uuid4().hex[:10]}", DECIDE_EVENTS, fold_decide)
        await log.open()
    try:
        async with open_stage(tmp_path, log) as s:
            await s.register(1)
            await s.register(2)
            await s.evidence(evidence(2, record=SOME, screened=LADDER.min_shadow_runs))  # trial
            yield s
    finally:
        if log is not None:
            await log.close()


async def test_a_drift_holds_promotion_until_it_is_acknowledged(stage: Stage) -> None:
    await stage.send(WORKFLOWS, drifted())
    served = LADDER.min_trial_runs
    assert await stage.evidence(evidence(2, record=WINS, served=served)) == []
    standing = await stage.state("ladder", f"arith/{ir(2).version}")
    assert standing is not None
    assert standing["held"] == (
        "task mix drifted: PSI 0.412 on input.language above 0.2 over the last 500 tasks "
        "(acknowledge it with `assay ladder ack-drift arith`)"
    )
    assert (await stage.allocation())["rung"] == "trial"
    hold = await stage.state("task_mix_hold", "arith")
    assert hold is not None
    assert hold["psi"]["input.language"] == 0.412

    # The acknowledgement releases the hold, and the challenger is promoted at once on
    # the evidence it was held on: no new evidence is needed.
    await stage.send(WORKFLOWS, rebased())
    assert await stage.state("task_mix_hold", "arith") is None
    out = await stage.take()
    assert [type(m) for m in out] == [Promoted, AllocationChanged]
    assert out[0].workflow_version == ir(2).version
    assert out[0].record == WINS
    assert await stage.state("held_evidence", f"arith/{ir(2).version}") is None
    assert await stage.evidence(evidence(2, record=WINS, served=served + 1)) == []


async def test_a_release_redelivered_promotes_once(stage: Stage) -> None:
    await stage.send(WORKFLOWS, drifted())
    assert await stage.evidence(evidence(2, record=WINS, served=LADDER.min_trial_runs)) == []
    await stage.send(WORKFLOWS, rebased(), mid="ack")
    assert [type(m) for m in await stage.take()] == [Promoted, AllocationChanged]
    await stage.send(WORKFLOWS, rebased(), mid="ack-again")  # a second ack: nothing held
    assert await stage.take() == []


async def test_a_drift_never_holds_a_rollback(stage: Stage) -> None:
    await stage.send(WORKFLOWS, drifted())
    capped = WinRecord(judge_wins=3, capped=1)
    out = await stage.evidence(evidence(2, record=capped))
    assert [type(m).__name__ for m in out] == ["RolledBack", "AllocationChanged"]


async def test_a_first_window_releases_nothing_it_did_not_hold(stage: Stage) -> None:
    await stage.send(WORKFLOWS, rebased("first_window"))
    assert await stage.state("task_mix_hold", "arith") is None
    out = await stage.evidence(evidence(2, record=WINS, served=LADDER.min_trial_runs))
    assert [type(m) for m in out] == [Promoted, AllocationChanged]


async def test_another_tenants_drift_holds_nothing_here(stage: Stage) -> None:
    await stage.send(WORKFLOWS, drifted(OTHER), tenant=OTHER)
    assert await stage.state("task_mix_hold", "arith") is None
    out = await stage.evidence(evidence(2, record=WINS, served=LADDER.min_trial_runs))
    assert [type(m) for m in out] == [Promoted, AllocationChanged]
