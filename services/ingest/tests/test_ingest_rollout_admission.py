"""Ingest's rollout admission (DESIGN §13): how many siblings a budget admits, and when the
next one may start — so that no group total, cost included, is ever exceeded."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from assay.kernel import TenantId
from assay.messages import RolloutBudget, RolloutProgress, RolloutSpec
from assay_ingest.rollouts import RolloutGroup, RolloutSibling, admitted_within, may_spawn


def spec(n: int = 8, **budget: Any) -> RolloutSpec:
    return RolloutSpec(n=n, budget=RolloutBudget(**budget))


def sibling(index: int, state: str = "running") -> dict[str, Any]:
    return {"run_id": f"run-{index}", "index": index, "state": state}


def group_doc(
    *,
    admitted: int = 8,
    running: int = 0,
    ended: int = 0,
    spent_cost_usd: float = 0.0,
    per_run_cost_usd: float | None = 0.1,
    group_max_cost_usd: float | None = 0.3,
) -> dict[str, Any]:
    """A group document as admission writes it, with siblings running and ended."""
    runs = [sibling(i, "verified") for i in range(ended)]
    runs += [sibling(ended + i) for i in range(running)]
    return {
        "task_id": "t" * 64,
        "workflow_id": "w",
        "workflow_version": "v" * 64,
        "spec": spec().model_dump(mode="json"),
        "cancelled": False,
        "closed": False,
        "admitted": admitted,
        "runs": runs,
        "concurrency": admitted,
        "per_run": 4,
        "group_max_model_calls": None,
        "per_run_tokens": None,
        "group_max_tokens": None,
        "spent": 0,
        "spent_tokens": 0,
        "per_run_cost_usd": per_run_cost_usd,
        "group_max_cost_usd": group_max_cost_usd,
        "spent_cost_usd": spent_cost_usd,
        "deadline_ms": None,
        "at_ms": 0,
        "origin": "m",
        "peak": 0,
        "reason": "completed",
        "detail": "",
    }


def group(**fields: Any) -> RolloutGroup:
    return RolloutGroup.model_validate(group_doc(**fields))


def test_a_cost_budget_admits_what_it_covers_at_the_per_run_cap() -> None:
    assert admitted_within(spec(run_max_cost_usd=0.1, group_max_cost_usd=0.25), 4) == 2
    assert admitted_within(spec(run_max_cost_usd=0.1, group_max_cost_usd=0.3), 4) == 3  # exact
    assert admitted_within(spec(run_max_cost_usd=0.5, group_max_cost_usd=0.5), 4) == 1


def test_the_tightest_budget_admits() -> None:
    both = spec(
        run_max_tokens=100,
        group_max_tokens=500,
        run_max_cost_usd=0.1,
        group_max_cost_usd=0.35,
        group_max_model_calls=20,
    )
    assert admitted_within(both, 4) == 3  # tokens admit 5, calls 5, cost 3
    budget = RolloutBudget(run_max_cost_usd=0.1, group_max_cost_usd=1.0)
    assert admitted_within(RolloutSpec(n=8, admit=2, budget=budget), 4) == 2


def test_a_budget_without_a_cost_cap_admits_as_before() -> None:
    assert admitted_within(spec(n=6), 4) == 6
    assert admitted_within(spec(n=6, run_max_cost_usd=0.1), 4) == 6  # a per-run cap alone


def test_a_sibling_starts_only_while_the_spent_cost_and_the_running_maxima_fit() -> None:
    assert may_spawn(group(running=2))  # 3 x $0.10 fit $0.30
    assert not may_spawn(group(running=3))
    assert may_spawn(group(running=1, ended=1, spent_cost_usd=0.08))  # 0.08 + 2 x 0.10
    assert not may_spawn(group(running=1, ended=1, spent_cost_usd=0.11))
    assert may_spawn(group(per_run_cost_usd=None, group_max_cost_usd=None, running=7))


def test_a_group_admitted_before_cost_caps_still_spawns() -> None:
    doc = group_doc(per_run_cost_usd=None, group_max_cost_usd=None)
    for key in ("per_run_cost_usd", "group_max_cost_usd", "spent_cost_usd"):
        del doc[key]
    assert may_spawn(RolloutGroup.model_validate(doc))


@given(
    run_cents=st.integers(1, 500),
    group_cents=st.integers(1, 5000),
    spend=st.lists(st.floats(0.0, 1.0), max_size=64),
)
@example(run_cents=1, group_cents=21, spend=[])  # twenty $0.01 sum to 0.20000000000000004
def test_spawning_to_the_limit_never_exceeds_the_group_cost_cap(
    run_cents: int, group_cents: int, spend: list[float]
) -> None:
    """Start siblings while `may_spawn` allows, each spending any fraction of its cap, in any
    order of ends: the group's spend never exceeds its cap."""
    if run_cents > group_cents:
        return  # refused by the budget
    run_cap, group_cap = run_cents / 100, group_cents / 100
    admitted = admitted_within(
        spec(n=64, run_max_cost_usd=run_cap, group_max_cost_usd=group_cap), 4
    )
    doc = group(admitted=admitted, per_run_cost_usd=run_cap, group_max_cost_usd=group_cap)
    doc = doc.model_copy(update={"concurrency": 3})
    costs = iter(spend)
    while True:
        while may_spawn(doc):
            new = RolloutSibling.model_validate(sibling(len(doc.runs)))
            doc = doc.model_copy(update={"runs": [*doc.runs, new]})
        if not doc.running:
            break
        first = doc.running[0]
        ended = RolloutProgress(
            tenant=TenantId(uuid.UUID(int=1)),
            idempotency_key="g",
            run_id=first.run_id,
            index=first.index,
            ended="verified",
            model_calls=0,
            tokens=0,
            cost_usd=next(costs, 1.0) * run_cap,
        )
        after = doc.sibling_ended(ended)
        assert after is not None
        doc = after
    assert len(doc.runs) == admitted
    assert doc.spent_cost_usd <= group_cap + 1e-9


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ({"group_max_cost_usd": 1.0}, "group_max_cost_usd needs run_max_cost_usd"),
        ({"run_max_cost_usd": 2.0, "group_max_cost_usd": 1.0}, "exceeds group_max_cost_usd"),
        ({"run_max_cost_usd": -1.0}, "run_max_cost_usd"),
        ({"run_max_cost_usd": float("nan")}, "run_max_cost_usd"),
        ({"run_max_cost_usd": 0.1, "group_max_cost_usd": float("inf")}, "group_max_cost_usd"),
    ],
)
def test_a_cost_budget_that_cannot_hold_is_refused(budget: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutBudget.model_validate(budget)
