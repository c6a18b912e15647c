"""Replay's ceiling in tokens and dollars (§12.4, §14.1): a shadow run reserves its worst
case — its model-call budget, each call its largest context, every token at the agent
model's higher price — and one whose worst case does not fit under a token or dollar
ceiling is cut, as under a call ceiling. Two ingest replicas on one store, each with
tasks on several partitions, never reserve past the ceiling together. On SQLite and
Postgres.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import assay_ingest
from assay.bus import DECISIONS, WORKFLOWS
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.engine.models import Prices
from assay.grading import StubJudge
from assay.grading.replay import ReplayPolicy
from assay.kernel import TenantId
from assay.kernel.spend import micro_usd
from assay.messages import AllocationChanged, Purpose, Rung, WorkflowRegistered
from assay.runtime import StageDeps, StageHarness
from assay.runtime.metrics import StageCollector, stage_registry
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.store import FsBlobStore
from assay.workflow import WorkflowDef, from_document
from services.ingest.tests.test_ingest_replay import (
    DAY,
    Ingest,
    Stores,
    replay_database,
    stores,
)

__all__ = ["replay_database", "stores"]  # the fixtures, shared with the call ceiling's tests

TENANT = TenantId(uuid.UUID(int=71))
OTHER = TenantId(uuid.UUID(int=72))
CALLS, CONTEXT = 10, 1_000  # each run: at most 10 calls of at most 1,000 tokens
PRICES = Prices(prompt_per_mtok=1.0, completion_per_mtok=3.0)
WORST_TOKENS = CALLS * CONTEXT  # 10,000 tokens a shadow run may spend
WORST_USD = WORST_TOKENS * 3.0 / 1_000_000  # $0.03: every token at the higher price
USD_CEILING = 0.07  # two shadow runs ($0.06) fit; a third ($0.09) does not


def workflow(prompt: str) -> dict[str, Any]:
    return {
        "id": "arith",
        "budget": {"max_model_calls": CALLS},
        "resources": {"max_context_tokens": CONTEXT},
        "steps": [
            {"id": "solve", "kind": "model", "prompt": prompt},
            {"id": "answer", "kind": "tool", "tool": "extract_number", "args": {"text": "x"}},
        ],
        "verifiers": [
            {"id": "correct", "kind": "exact", "step": "answer", "expected": "{{ task.answer }}"}
        ],
    }


V1_DOC = workflow("What is {{ task.question }}?")
V2_DOC = workflow("Step by step: {{ task.question }}?")


def priced_stub() -> StubModel:
    """The stub model, priced as a paid model would be (its answers are the same)."""
    model = StubModel()
    model.prices = PRICES
    return model


async def replica(tmp_path: Path, stores: Stores, policy: ReplayPolicy) -> StageHarness:
    """One ingest replica, its own process state, on the shared store."""
    deps = StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=priced_stub(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        replay=policy,
    )
    here = tmp_path / f"replica-{len(stores.opened)}"
    here.mkdir()
    spec = assay_ingest.create_stage(deps)
    return await StageHarness(spec, FsBlobStore(here), here, await stores.open()).__aenter__()


async def contest(stage: Ingest, tenant: TenantId) -> tuple[WorkflowDef, WorkflowDef]:
    """Two versions, the second a shadow challenger replaying every task."""
    v1, v2 = from_document(V1_DOC), from_document(V2_DOC)
    for n, doc in enumerate((V1_DOC, V2_DOC)):
        registered = WorkflowRegistered(tenant=tenant, definition=doc)
        await stage.send(WORKFLOWS, registered, tenant, idem=f"wf-{n}")
    alloc = AllocationChanged(
        tenant=tenant,
        workflow_id=v1.id,
        generation=2,
        current=v1.version,
        challenger=v2.version,
        challenger_share=0.0,
        shadow_rate=1.0,
        rung=Rung.SHADOW,
        definitions={v.version: v.model_dump(mode="json", by_alias=True) for v in (v1, v2)},
    )
    await stage.send(DECISIONS, alloc, tenant, idem=f"alloc-{tenant}")
    return v1, v2


@pytest.fixture
async def dollars(stores: Stores, tmp_path: Path) -> AsyncIterator[Ingest]:
    """One replica whose tenant has a dollar ceiling and no call ceiling."""
    policy = ReplayPolicy(usd_ceilings={str(TENANT): USD_CEILING})
    harness = await replica(tmp_path, stores, policy)
    yield Ingest(harness)
    await harness.__aexit__(None, None, None)


async def test_a_dollar_ceiling_cuts_the_shadow_run_whose_worst_case_does_not_fit(
    dollars: Ingest,
) -> None:
    await contest(dollars, TENANT)
    for i in range(4):
        await dollars.task(TENANT, i)
    runs = await dollars.spawned(TENANT)
    assert sum(m.run.purpose is Purpose.WORK for m in runs) == 4  # work is never cut
    assert sum(m.run.purpose is Purpose.SHADOW for m in runs) == 2  # $0.06 of $0.07
    meter = await dollars.meter(TENANT)
    assert (meter["runs_today"], meter["cut_today"]) == (2, 2)
    assert (meter["calls_today"], meter["tokens_today"]) == (2 * CALLS, 2 * WORST_TOKENS)
    assert meter["micro_usd_today"] == 2 * micro_usd(WORST_USD) <= micro_usd(USD_CEILING)
    cut = (await dollars.h.state(TENANT, "task", "t-2") or {})["cut"]
    assert [c["reason"] for c in cut] == ["replay_budget_exhausted"]
    assert cut[0]["detail"] == (
        "its worst case (10 calls, 10000 tokens, $0.030000) does not fit under the tenant's "
        "replay ceiling of $0.070000 a day (20 calls, 20000 tokens, $0.060000 reserved today)"
    )
    statuses = await dollars.cut_statuses(TENANT)
    said = f"replay_budget_exhausted: not run; {cut[0]['detail']}"
    assert [s.detail for s in statuses] == [said, said]  # the fourth finds the same room


async def test_a_token_ceiling_cuts_like_a_dollar_one(stores: Stores, tmp_path: Path) -> None:
    policy = ReplayPolicy(tokens_per_day=WORST_TOKENS * 3 - 1)  # two fit, a third does not
    harness = await replica(tmp_path, stores, policy)
    stage = Ingest(harness)
    try:
        await contest(stage, TENANT)
        for i in range(4):
            await stage.task(TENANT, i)
        meter = await stage.meter(TENANT)
        assert (meter["runs_today"], meter["cut_today"]) == (2, 2)
        assert meter["tokens_today"] == 2 * WORST_TOKENS
    finally:
        await harness.__aexit__(None, None, None)


async def test_two_replicas_on_several_partitions_never_reserve_past_the_dollar_ceiling(
    stores: Stores, tmp_path: Path
) -> None:
    policy = ReplayPolicy(usd_ceilings={str(TENANT): USD_CEILING})
    first = await replica(tmp_path, stores, policy)
    second = await replica(tmp_path, stores, policy)
    one, two = Ingest(first), Ingest(second)
    try:
        await contest(one, TENANT)
        # each replica has its own per-process locks: only the meter's compare-and-swap in
        # the shared store stands between their reservations
        await asyncio.gather(
            *((one if i % 2 else two).task(TENANT, i, partition=i, at=DAY) for i in range(1, 9))
        )
        meter = await one.meter(TENANT)
        assert (meter["runs_today"], meter["cut_today"]) == (2, 6)  # each task metered once
        assert meter["micro_usd_today"] <= micro_usd(USD_CEILING)
        # the replicas share the store, its outbox included: either shows every spawn
        shadow = [m for m in await one.spawned(TENANT) if m.run.purpose is Purpose.SHADOW]
        assert len(shadow) == 2
        assert len(shadow) * micro_usd(WORST_USD) <= micro_usd(USD_CEILING)
    finally:
        await second.__aexit__(None, None, None)
        await first.__aexit__(None, None, None)


async def test_metrics_show_tokens_and_dollars_reserved_beside_their_ceilings(
    dollars: Ingest,
) -> None:
    for tenant in (TENANT, OTHER):
        await contest(dollars, tenant)
        for i in range(3):
            await dollars.task(tenant, i, at=datetime.now(UTC))
    assert dollars.h.runner is not None
    collector = StageCollector(dollars.h.runner)
    registry = stage_registry(dollars.h.runner, collector)
    await collector.refresh()

    def value(name: str, tenant: TenantId) -> float | None:
        return registry.get_sample_value(name, {"tenant": str(tenant)})

    assert value("assay_replay_tokens_reserved", TENANT) == 2 * WORST_TOKENS
    assert value("assay_replay_usd_reserved", TENANT) == pytest.approx(2 * WORST_USD)
    assert value("assay_replay_usd_ceiling", TENANT) == USD_CEILING
    assert value("assay_replay_tokens_ceiling", TENANT) is None  # no token ceiling
    assert value("assay_replay_calls_ceiling", TENANT) is None
    assert value("assay_replay_usd_reserved", OTHER) == pytest.approx(3 * WORST_USD)
    assert value("assay_replay_usd_ceiling", OTHER) is None  # another tenant: no ceiling


def test_replay_token_and_dollar_settings_mirror_grading_s() -> None:
    env = {
        "ASSAY_REPLAY_TOKENS_PER_DAY": "50000",
        "ASSAY_REPLAY_USD_PER_DAY": "2.5",
        "ASSAY_REPLAY_USD_CEILINGS": f"{TENANT}=0.07",
        "ASSAY_REPLAY_TOKEN_CEILINGS": f"{TENANT}=20000",
    }
    policy = AssaySettings.from_env(env).replay
    mine, other = policy.limit_for(str(TENANT)), policy.limit_for(str(OTHER))
    assert (mine.calls, mine.tokens, mine.micro_usd) == (None, 20_000, 70_000)
    assert (other.calls, other.tokens, other.micro_usd) == (None, 50_000, 2_500_000)
    unset = AssaySettings.from_env({}).replay.limit_for(str(TENANT))
    assert not unset.bounded  # no ceiling in any unit by default
    with pytest.raises(SettingsInvalid, match="ASSAY_REPLAY_USD_PER_DAY='-1'"):
        AssaySettings.from_env({"ASSAY_REPLAY_USD_PER_DAY": "-1"})
    with pytest.raises(SettingsInvalid, match="ASSAY_REPLAY_USD_CEILINGS='acme=5'"):
        AssaySettings.from_env({"ASSAY_REPLAY_USD_CEILINGS": "acme=5"})
