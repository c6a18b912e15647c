"""Rollout groups end to end, embedded: N siblings of one task, budgets, selection, restarts.

A verifiable task (the arithmetic workflow, with a sandboxed first step that
lists its workspace and leaves a file in it) is submitted as a rollout group.
The result must carry pass@N and best-of-N, the caps must hold, no sibling may
see another's files, and a runtime stopped mid-group must, once restarted,
reach exactly the result an uninterrupted runtime reaches.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from assay.bus import RESULTS, TASKS, USAGE, WORKFLOWS
from assay.engine import ChatCompletionsModel, Prices, RetryPolicy
from assay.kernel import TenantId, tenant_id
from assay.messages import (
    MESSAGES,
    CancelRollout,
    Episode,
    RolloutBudget,
    RolloutResult,
    RolloutSpec,
    TaskSubmitted,
    UsageRecorded,
    WorkflowRegistered,
    open_envelope,
)
from assay.record import StateKey
from assay.runtime import Embedded
from assay.workflow import WorkflowDef, from_document
from libs.assay.tests.chat_endpoint import ChatServer, completion, json_reply

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TENANT = tenant_id("0a5f8f0e-3c1d-4f7e-9b2a-5d6c7e8f9a01")
OTHER = tenant_id("0a5f8f0e-3c1d-4f7e-9b2a-5d6c7e8f9a02")
SUBMITTED = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)

WORKFLOW: WorkflowDef = from_document(
    {
        "id": "arith-rollout",
        "steps": [
            {"id": "look", "kind": "tool", "tool": "command", "args": {"argv": '["ls", "-A"]'}},
            {
                "id": "mark",
                "kind": "tool",
                "tool": "write_file",
                "args": {"path": "mine.txt", "content": "written by this sibling"},
            },
            {
                "id": "solve",
                "kind": "model",
                "prompt": "What is {{ task.question }}?",
                "max_tokens": 32,
            },
            {
                "id": "answer",
                "kind": "tool",
                "tool": "extract_number",
                "args": {"text": "{{ steps.solve.output }}"},
            },
        ],
        "verifiers": [
            {"id": "correct", "kind": "exact", "step": "answer", "expected": "{{ task.answer }}"}
        ],
        "rubric": [{"id": "concise", "layer": "contextual", "text": "Prefer shorter answers."}],
    }
)

SPEC = RolloutSpec(
    n=6,
    budget=RolloutBudget(max_concurrency=2, run_max_model_calls=2, group_max_model_calls=10),
)


def fixed_clock() -> datetime:
    return SUBMITTED


async def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def register(
    rt: Embedded, tenant: TenantId = TENANT, definition: WorkflowDef = WORKFLOW
) -> None:
    rt.start()
    document = definition.model_dump(mode="json", by_alias=True)
    await rt.publish(
        WORKFLOWS,
        WorkflowRegistered(tenant=tenant, definition=document),
        tenant,
        idem=definition.version,
    )

    async def current() -> bool:
        return (
            await rt.logs["ingest"].get(StateKey(tenant, "allocation", definition.id)) is not None
        )

    await wait_for(current, 30, "the workflow to be current")


async def submit(
    rt: Embedded, key: str, spec: RolloutSpec = SPEC, workflow: WorkflowDef = WORKFLOW
) -> None:
    task = TaskSubmitted(
        tenant=TENANT,
        workflow_id=workflow.id,
        idempotency_key=key,
        input={"question": "17 * 23", "answer": "391"},
        rollout=spec,
    )
    await rt.publish(TASKS, task, TENANT, idem=key)


async def rollout_result(rt: Embedded, key: str) -> RolloutResult | None:
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(RESULTS, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            if env.type != RolloutResult.type:
                continue
            msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
            assert isinstance(msg, RolloutResult)
            if msg.idempotency_key == key:
                return msg
    return None


async def episodes(rt: Embedded, key: str) -> list[Episode]:
    docs = await rt.logs["tournament"].scan(TENANT, "sibling")
    found = []
    for _, doc in docs:
        if doc["run"]["rollout"]["group"] != key:
            continue
        raw = await rt.blobs.get(TENANT, doc["episode"])
        assert raw is not None
        found.append(Episode.model_validate_json(raw))
    return found


def check_invariants(result: RolloutResult) -> None:
    """What every rollout result of SPEC must show."""
    assert result.requested == 6
    assert result.admitted == 5  # ten group calls at two a sibling
    assert [s.index for s in result.siblings] == list(range(5))
    assert len({s.run_id for s in result.siblings}) == 5
    assert result.peak_concurrency <= 2
    assert result.model_calls <= 10
    assert all(s.usage.model_calls <= 2 for s in result.siblings)
    c = sum(s.passed for s in result.siblings)
    assert result.passes == c
    assert len(result.pass_at_k) == 5
    assert result.pass_at_k[-1] == (1.0 if c else 0.0)  # pass@N: any sibling passed
    assert result.pass_at_k[0] == pytest.approx(c / 5)  # pass@1: the pass rate
    assert result.selection.policy == "verifier_then_judge"
    assert result.selection.policy_version == 1
    winner = next(s for s in result.siblings if s.run_id == result.winner)
    assert result.best_of_n_passed == winner.passed == (c > 0)
    if c > 1:
        assert result.selection.decided_by in ("judge", "index")
        assert "Bradley-Terry" in result.selection.evidence
        assert winner.rank is not None


async def test_a_rollout_group_selects_within_its_budget_and_isolates_its_siblings(
    tmp_path: Path,
) -> None:
    async with Embedded(tmp_path / "data", clock=fixed_clock) as rt:
        await register(rt)
        await submit(rt, "group-1")
        await submit(rt, "group-1")  # a resubmission spawns nothing more
        stranger = CancelRollout(tenant=OTHER, idempotency_key="group-1", reason="not yours")
        await rt.publish(TASKS, stranger, OTHER, idem="cancel-1")  # another tenant's: no effect
        result = await wait_for(lambda: rollout_result(rt, "group-1"), 120, "the rollout result")
        check_invariants(result)
        assert result.closed == "completed"
        found = await episodes(rt, "group-1")
        assert len(found) == 5
        for episode in found:
            (look,) = [a for a in episode.attempts if a.step == "look"]
            assert look.output == "", "a sibling saw another sibling's workspace"
        runs = await rt.logs["execute"].scan(TENANT, "run")
        assert len(runs) == 5  # one run per admitted sibling, however many attempts


async def test_a_restart_mid_group_changes_nothing_in_the_outcome(tmp_path: Path) -> None:
    async with Embedded(tmp_path / "straight", clock=fixed_clock) as rt:
        await register(rt)
        await submit(rt, "group-2")
        expected = await wait_for(lambda: rollout_result(rt, "group-2"), 120, "the result")
    data = tmp_path / "interrupted"
    async with Embedded(data, clock=fixed_clock) as rt:
        await register(rt)
        await submit(rt, "group-2")

        async def some_sibling_verified() -> bool:
            return bool(await rt.logs["tournament"].scan(TENANT, "sibling"))

        await wait_for(some_sibling_verified, 120, "a first sibling to be verified")
    assert await rollout_result_in(data, "group-2") is None, "the group finished too soon"
    async with Embedded(data, clock=fixed_clock) as rt:
        rt.start()
        again = await wait_for(lambda: rollout_result(rt, "group-2"), 120, "the result")
        assert len(await rt.logs["execute"].scan(TENANT, "run")) == 5  # no duplicated run
    check_invariants(again)
    assert again == expected


async def rollout_result_in(data: Path, key: str) -> RolloutResult | None:
    async with Embedded(data, clock=fixed_clock, stages=()) as rt:
        return await rollout_result(rt, key)


async def test_cancelling_a_group_converges_every_sibling(tmp_path: Path) -> None:
    slow = RolloutSpec(n=4, budget=RolloutBudget(max_concurrency=1))
    async with Embedded(tmp_path / "data", clock=fixed_clock) as rt:
        await register(rt)
        await submit(rt, "group-3", slow)
        await rt.publish(
            TASKS,
            CancelRollout(tenant=TENANT, idempotency_key="group-3", reason="operator"),
            TENANT,
            idem="cancel-3",
        )
        result = await wait_for(lambda: rollout_result(rt, "group-3"), 120, "the result")
        assert result.closed == "cancelled"
        assert result.detail == "operator"
        assert len(result.siblings) < 4  # nothing started after the cancel
        for sibling in result.siblings:
            assert sibling.ended in ("verified", "cancelled")


async def test_a_deadline_stops_the_group(tmp_path: Path) -> None:
    """A sibling that outlives the deadline is cancelled, and no other starts."""
    slow = from_document(
        {
            "id": WORKFLOW.id,
            "steps": [
                {
                    "id": "wait",
                    "kind": "tool",
                    "tool": "command",
                    "args": {"argv": '["sleep", "5"]'},
                },
                *[s.model_dump(mode="json", by_alias=True) for s in WORKFLOW.steps[2:]],
            ],
            "verifiers": [v.model_dump(mode="json") for v in WORKFLOW.verifiers],
        }
    )
    spec = RolloutSpec(n=3, budget=RolloutBudget(max_concurrency=1, deadline_s=0.5))
    async with Embedded(tmp_path / "data") as rt:
        await register(rt, definition=slow)
        await submit(rt, "group-4", spec, workflow=slow)
        result = await wait_for(lambda: rollout_result(rt, "group-4"), 120, "the result")
        assert result.closed == "deadline"
        assert result.detail == "the group's deadline passed"
        assert [s.ended for s in result.siblings] == ["cancelled"]  # the one that had started
        assert result.winner is None
        assert result.pass_at_k == []


async def test_a_token_budget_is_never_exceeded(tmp_path: Path) -> None:
    spec = RolloutSpec(
        n=6,
        budget=RolloutBudget(max_concurrency=2, run_max_tokens=64, group_max_tokens=200),
    )
    async with Embedded(tmp_path / "data", clock=fixed_clock) as rt:
        await register(rt)
        await submit(rt, "group-5", spec)
        result = await wait_for(lambda: rollout_result(rt, "group-5"), 120, "the result")
    assert result.admitted == 3  # 200 tokens at 64 a sibling
    assert len(result.siblings) == 3
    assert all(s.usage.prompt_tokens + s.usage.completion_tokens <= 64 for s in result.siblings)
    assert 0 < result.tokens <= 200


@pytest.fixture
def endpoint() -> Iterator[ChatServer]:
    with ChatServer() as chat:
        yield chat


async def usage_costs(rt: Embedded) -> dict[str, list[float]]:
    """Each run's recorded call prices, from every `UsageRecorded` on the usage topic."""
    costs: dict[str, list[float]] = {}
    for partition in range(rt.partitions):
        for m in await rt.bus.fetch(USAGE, partition, 0, 10_000, 0.0):
            env = open_envelope(m.value)
            msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
            if isinstance(msg, UsageRecorded) and msg.purpose.value == "work":
                costs.setdefault(str(msg.run_id), []).append(msg.cost_usd)
    return costs


async def test_a_cost_budget_is_never_exceeded(tmp_path: Path, endpoint: ChatServer) -> None:
    """A priced model ($1000 / $2000 per million prompt / completion tokens) behind a loopback
    chat-completions endpoint. A call's worst case is its 16 prompt bytes and 32 completion
    tokens, $0.08, which a sibling's $0.10 covers once; each call really costs $0.022."""
    endpoint.answer(json_reply(completion("391", prompt_tokens=12, completion_tokens=5)))
    spec = RolloutSpec(
        n=6,
        budget=RolloutBudget(max_concurrency=2, run_max_cost_usd=0.1, group_max_cost_usd=0.25),
    )
    async with (
        ChatCompletionsModel(
            endpoint.base_url,
            "local-model",
            prices=Prices(1000.0, 2000.0),
            retry=RetryPolicy(max_retries=0),
            timeout_s=10.0,
        ) as model,
        Embedded(tmp_path / "data", clock=fixed_clock, model=model) as rt,
    ):
        await register(rt)
        await submit(rt, "group-6", spec)
        result = await wait_for(lambda: rollout_result(rt, "group-6"), 120, "the result")
        recorded = await usage_costs(rt)
    assert result.admitted == 2  # $0.25 at $0.10 a sibling
    assert len(result.siblings) == 2
    assert result.passes == 2
    assert result.best_of_n_passed
    per_run = {str(s.run_id): sum(recorded.get(str(s.run_id), [])) for s in result.siblings}
    assert all(0 < cost <= 0.1 for cost in per_run.values())
    assert result.cost_usd == pytest.approx(sum(per_run.values())) == pytest.approx(0.044)
    assert result.cost_usd <= 0.25


async def test_a_sibling_whose_cost_cap_cannot_cover_a_call_makes_none(
    tmp_path: Path, endpoint: ChatServer
) -> None:
    """$0.07 per sibling is below the call's $0.08 worst case: no call is sent, none is paid."""
    endpoint.answer(json_reply(completion("391", prompt_tokens=12, completion_tokens=5)))
    spec = RolloutSpec(n=2, budget=RolloutBudget(run_max_cost_usd=0.07, group_max_cost_usd=0.2))
    async with (
        ChatCompletionsModel(
            endpoint.base_url, "local-model", prices=Prices(1000.0, 2000.0)
        ) as model,
        Embedded(tmp_path / "data", clock=fixed_clock, model=model) as rt,
    ):
        await register(rt)
        await submit(rt, "group-7", spec)
        result = await wait_for(lambda: rollout_result(rt, "group-7"), 120, "the result")
    assert endpoint.seen == []
    assert result.admitted == 2
    assert result.passes == 0
    assert result.winner is not None
    assert not result.best_of_n_passed
    assert result.cost_usd == 0.0
    assert result.model_calls == 0


def test_a_group_token_cap_needs_a_per_run_cap() -> None:
    with pytest.raises(ValueError, match="needs run_max_tokens"):
        RolloutBudget(group_max_tokens=100)


def test_a_spec_admitting_more_than_it_requests_is_refused() -> None:
    with pytest.raises(ValueError, match="admit"):
        RolloutSpec(n=2, admit=3)


def test_a_group_cost_cap_needs_a_per_run_cap() -> None:
    with pytest.raises(ValueError, match="needs run_max_cost_usd"):
        RolloutBudget(group_max_cost_usd=1.0)


def test_a_per_run_cost_cap_above_the_groups_is_refused() -> None:
    with pytest.raises(ValueError, match=r"run_max_cost_usd \(2.0\) exceeds group_max_cost_usd"):
        RolloutBudget(run_max_cost_usd=2.0, group_max_cost_usd=1.0)


@pytest.mark.parametrize("cap", [0.0, -0.5, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", ["run_max_cost_usd", "group_max_cost_usd"])
def test_a_cost_cap_is_a_finite_positive_amount(field: str, cap: float) -> None:
    with pytest.raises(ValueError, match=field):
        RolloutBudget.model_validate({field: cap})
