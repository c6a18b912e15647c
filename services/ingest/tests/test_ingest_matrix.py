"""A candidate matrix at ingest (§11.1 `ReplayTournament`): validated when decoded,
resolved into the variants its siblings run, admitted whole — budget, capacity, replay
ceiling — or refused whole, naming the candidate, with nothing recorded or held."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import assay_ingest
from assay.bus import DECISIONS, TASKS, WORKFLOWS
from assay.engine import BUILTIN_TOOLS, StubModel
from assay.engine.models import Prices
from assay.grading import StubJudge
from assay.grading.replay import ReplayPolicy
from assay.messages import (
    CancelRollout,
    CancelRun,
    Purpose,
    Role,
    RolloutClosed,
    RolloutProgress,
    RolloutSpec,
    RunSpawned,
    WorkflowRegistered,
)
from assay.record import StateKey
from assay.runtime import StageDeps
from assay.runtime.admission import Admission
from assay.runtime.capacity_plan import plan_capacity
from assay.runtime.settings import AssaySettings
from assay.store import FsBlobStore
from assay.workflow import ModelStep, WorkflowDef
from services.ingest.tests.test_ingest_capacity import CAPACITY, RESOURCES
from services.ingest.tests.test_ingest_consumer import (
    ARITH,
    OTHER,
    STAGE_DLQ,
    TENANT,
    Harness,
    allocation,
    arith,
    decoded,
    open_harness,
    task,
)


def matrix(*candidates: dict[str, Any], **fields: Any) -> RolloutSpec:
    return RolloutSpec.model_validate({"candidates": list(candidates), **fields})


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"candidates": [{"version": "a", "model": "m"}]}, "exactly one of version, model or"),
        ({"candidates": [{}]}, "(given: none)"),
        ({"candidates": [{"model": "m"}, {"model": "m"}]}, "unique in the matrix: model:m"),
        ({"n": 3, "candidates": [{"model": "a"}, {"model": "b"}]}, "n (3) is not the number"),
        ({"admit": 1, "candidates": [{"model": "a"}, {"model": "b"}]}, "candidate 'model:b'"),
        ({"control": "x", "candidates": [{"model": "a"}]}, "control 'x' names no candidate"),
        ({"n": 2, "control": "x"}, "there is no candidate matrix"),
        ({"mode": "trajectory_collection", "candidates": [{"model": "a"}]}, "ranks nothing"),
        ({"candidates": [{"prompt": {}}]}, "names no step"),
    ],
)
def test_a_matrix_that_cannot_be_admitted_whole_is_refused_when_decoded(
    doc: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValidationError) as err:
        RolloutSpec.model_validate(doc)
    assert says in str(err.value)


def test_a_matrix_defaults_n_and_a_homogeneous_spec_serialises_as_before() -> None:
    spec = matrix({"version": "current"}, {"model": "m", "name": "big"})
    assert spec.n == 2
    assert [c.label(i) for i, c in enumerate(spec.candidates or [])] == ["version:current", "big"]
    assert spec.model_dump(mode="json")["candidates"][0]["version"] == "current"
    assert "candidates" not in RolloutSpec(n=2).model_dump(mode="json")
    assert "control" not in RolloutSpec(n=2).model_dump(mode="json")


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    deps = StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        admission=Admission(plan_capacity(AssaySettings.from_env(CAPACITY))),
    )
    harness = await open_harness(tmp_path, assay_ingest.create_stage(deps))
    try:
        yield harness
    finally:
        await harness.log.close()
        await harness.bus.close()


async def two_versions(h: Harness, **changes: Any) -> tuple[WorkflowDef, WorkflowDef]:
    """v1 current; v2, a prompt change, stored after it."""
    v1 = await h.ready(arith(**changes))
    solve = {**ARITH["steps"][0], "prompt": "Compute {{ task.question }}."}
    v2 = await h.register(arith(steps=[solve, ARITH["steps"][1]], **changes))
    assert await h.take() == []
    return v1, v2


async def refusal(h: Harness) -> str:
    """The one thing the task led to: its dead letter, with the reason."""
    (entry,) = await h.take()
    assert entry.topic == STAGE_DLQ
    return dict(entry.headers)["assay-dlq-reason"].decode()


async def test_each_candidate_runs_its_variant_as_replay_beside_the_implicit_control(
    h: Harness,
) -> None:
    v1, v2 = await two_versions(h)
    spec = matrix(
        {"name": "v2", "version": v2.version[:10]},
        {"name": "big", "model": "m"},
        {"name": "careful", "prompt": "Step by step: {{ task.question }}"},
        budget={"run_max_model_calls": 4},
    )
    await h.send(TASKS, task("m-1", rollout=spec))
    spawned = [m for _, m in map(decoded, await h.take()) if isinstance(m, RunSpawned)]
    assert [m.run.rollout.index for m in spawned if m.run.rollout] == [0, 1, 2, 3]
    assert {m.run.purpose for m in spawned} == {Purpose.REPLAY}
    v2_run, big, careful, control = spawned
    assert v2_run.run.workflow_version == v2.version
    assert control.run.workflow_version == v1.version  # not listed: added as the control
    assert control.run.role is Role.CURRENT
    assert v2_run.run.role is Role.CHALLENGER
    assert v2_run.run.baseline_version == v1.version
    big_wf = WorkflowDef.model_validate(big.definition)
    assert big.run.workflow_version == big_wf.version not in (v1.version, v2.version)
    assert [s.model for s in big_wf.steps if isinstance(s, ModelStep)] == ["m"]
    assert big_wf.resources is not None
    assert big_wf.resources.model == "m"
    careful_wf = WorkflowDef.model_validate(careful.definition)
    (solve,) = [s for s in careful_wf.steps if isinstance(s, ModelStep)]
    assert solve.prompt == "Step by step: {{ task.question }}"
    assert all(m.run.rollout and m.run.rollout.max_model_calls == 4 for m in spawned)
    doc = await h.log.get(StateKey(TENANT, "rollout", "m-1"))
    assert doc is not None
    assert [c["name"] for c in doc["candidates"]] == ["v2", "big", "careful", "current"]
    assert [c["control"] for c in doc["candidates"]] == [False, False, False, True]
    assert doc["estimate"]["model_calls"] == doc["estimate"]["replay_calls"] == 16
    meter = await h.log.get(StateKey(TENANT, "meter", "replay"))
    assert meter is not None
    assert (meter["calls_today"], meter["runs_today"]) == (16, 4)


async def test_the_candidate_capacity_cannot_hold_refuses_the_group_whole_and_holds_nothing(
    h: Harness,
) -> None:
    await two_versions(h, resources=RESOURCES)  # three runs fit the declared capacity
    spec = matrix(*({"name": f"c{i}", "prompt": f"#{i} {{{{ task.question }}}}"} for i in range(4)))
    await h.send(TASKS, task("m-2", rollout=spec))
    reason = await refusal(h)
    assert "candidate 'c3' cannot be admitted: capacity" in reason
    assert await h.log.get(StateKey(TENANT, "rollout", "m-2")) is None
    assert await h.log.get(StateKey(TENANT, "rollout-matrix", "m-2")) is None
    assert await h.log.get(StateKey(TENANT, "meter", "replay")) is None
    three = matrix(
        *({"name": f"c{i}", "prompt": f"#{i} {{{{ task.question }}}}"} for i in range(2))
    )
    await h.send(TASKS, task("m-3", rollout=three))  # nothing of the refused group is held
    spawned = [m for _, m in map(decoded, await h.take()) if isinstance(m, RunSpawned)]
    assert len(spawned) == 3  # two candidates and the implicit control


@pytest.mark.parametrize(
    ("candidates", "budget", "says"),
    [
        (
            [{"name": "a", "model": "x"}, {"name": "b", "model": "y"}],
            {"run_max_model_calls": 2, "group_max_model_calls": 5},
            "candidate 'current' cannot be admitted: the group's group_max_model_calls covers 2",
        ),
        ([{"name": "gone", "version": "0123abcd"}], {}, "candidate 'gone' cannot run: version"),
        ([{"name": "x", "model": "m-2"}], {}, "candidate 'x' cannot be admitted: capacity"),
        ([{"name": "p", "prompt": {"nope": "x"}}], {}, "candidate 'p' cannot run: no model step"),
        ([{"name": "t", "prompt": "{{ steps.later.output }}"}], {}, "candidate 't' cannot run"),
    ],
)
async def test_a_candidate_that_cannot_be_admitted_is_named_and_nothing_is_recorded(
    h: Harness, candidates: list[dict[str, Any]], budget: dict[str, Any], says: str
) -> None:
    await two_versions(h)
    await h.send(TASKS, task("m-4", rollout=matrix(*candidates, budget=budget)))
    assert says in await refusal(h)
    assert await h.log.get(StateKey(TENANT, "rollout", "m-4")) is None
    assert await h.log.get(StateKey(TENANT, "task", "m-4")) is None
    assert await h.log.get(StateKey(TENANT, "meter", "replay")) is None


async def test_another_tenants_version_is_no_candidate(h: Harness) -> None:
    _, v2 = await two_versions(h)  # TENANT's
    mine = WorkflowDef.model_validate(arith())
    registered = WorkflowRegistered(tenant=OTHER, definition=arith())
    await h.send(WORKFLOWS, registered, tenant=OTHER)
    await h.send(DECISIONS, allocation(mine).model_copy(update={"tenant": OTHER}), tenant=OTHER)
    assert await h.take() == []
    spec = matrix({"name": "theirs", "version": v2.version})
    await h.send(TASKS, task("m-5", tenant=OTHER, rollout=spec), tenant=OTHER)
    reason = await refusal(h)
    assert "candidate 'theirs' cannot run: version" in reason
    assert "names no stored version" in reason
    assert await h.log.get(StateKey(OTHER, "rollout", "m-5")) is None


async def test_a_cancelled_matrix_lets_go_of_the_capacity_its_unstarted_candidates_held(
    h: Harness,
) -> None:
    await two_versions(h, resources=RESOURCES)  # three runs fit the declared capacity
    prompts = [{"name": f"c{i}", "prompt": f"#{i} {{{{ task.question }}}}"} for i in range(2)]
    one_at_a_time = matrix(*prompts, budget={"max_concurrency": 1})
    await h.send(TASKS, task("m-6", rollout=one_at_a_time))  # all three held, one started
    (first,) = [m for _, m in map(decoded, await h.take()) if isinstance(m, RunSpawned)]
    await h.send(TASKS, CancelRollout(tenant=TENANT, idempotency_key="m-6", reason="enough"))
    assert [type(m) for _, m in map(decoded, await h.take())] == [CancelRun]
    ended = RolloutProgress(
        tenant=TENANT,
        idempotency_key="m-6",
        run_id=first.run.run_id,
        index=0,
        ended="cancelled",
        model_calls=0,
    )
    await h.send(TASKS, ended)
    (closed,) = [m for _, m in map(decoded, await h.take()) if isinstance(m, RolloutClosed)]
    assert closed.candidates is not None
    assert [c.name for c in closed.candidates] == ["c0", "c1", "current"]
    assert closed.reason == "cancelled"
    await h.send(TASKS, task("m-7", rollout=matrix(*prompts)))  # the three fit again
    spawned = [m for _, m in map(decoded, await h.take()) if isinstance(m, RunSpawned)]
    assert len(spawned) == 3


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"candidates": [{"model": "a", "samples": 0}]}, "greater than or equal to 1"),
        ({"candidates": [{"model": "a", "samples": -2}]}, "greater than or equal to 1"),
        ({"candidates": [{"model": "a", "samples": 65}]}, "65 siblings, more than a group's 64"),
        (
            {"candidates": [{"model": "a", "samples": 40}, {"model": "b", "samples": 30}]},
            "70 siblings, more than a group's 64",
        ),
        (
            {"n": 2, "candidates": [{"model": "a", "samples": 2}, {"model": "b"}]},
            "n (2) is not the number of siblings the candidates run (3",
        ),
        (
            {"admit": 2, "candidates": [{"model": "a", "samples": 2}, {"model": "b"}]},
            "a sibling of candidate 'model:b'",
        ),
    ],
    ids=["zero", "negative", "above-the-group", "sum-above-the-group", "n", "admit"],
)
def test_a_candidates_samples_outside_one_to_the_groups_most_is_refused_when_decoded(
    doc: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValidationError) as err:
        RolloutSpec.model_validate(doc)
    assert says in str(err.value)


def test_samples_default_to_one_and_n_to_the_siblings_added_up() -> None:
    spec = matrix({"version": "current", "samples": 3}, {"model": "m"})
    assert spec.n == 4
    assert [c.samples for c in spec.candidates or []] == [3, 1]
    dumped = spec.model_dump(mode="json")["candidates"]
    assert dumped[0]["samples"] == 3
    assert "samples" not in dumped[1]  # a one-sibling candidate serialises as it always did


async def test_each_candidate_runs_its_samples_as_consecutive_siblings(h: Harness) -> None:
    v1, v2 = await two_versions(h)
    spec = matrix(
        {"name": "v2", "version": v2.version[:10], "samples": 2},
        {"name": "big", "model": "m", "samples": 3},
        budget={"run_max_model_calls": 4},
    )
    assert spec.n == 5
    await h.send(TASKS, task("s-1", rollout=spec))
    spawned = [m for _, m in map(decoded, await h.take()) if isinstance(m, RunSpawned)]
    assert [m.run.rollout.index for m in spawned if m.run.rollout] == list(range(8))
    assert {m.run.rollout.size for m in spawned if m.run.rollout} == {8}
    versions = [m.run.workflow_version for m in spawned]
    big = versions[2]
    # the implicit control runs as many siblings as the most any candidate runs
    assert versions == [v2.version] * 2 + [big] * 3 + [v1.version] * 3
    assert [m.run.role for m in spawned] == [Role.CHALLENGER] * 5 + [Role.CURRENT] * 3
    doc = await h.log.get(StateKey(TENANT, "rollout", "s-1"))
    assert doc is not None
    assert doc["admitted"] == 8
    placed = [(c["name"], c["index"], c.get("samples", 1)) for c in doc["candidates"]]
    assert placed == [("v2", 0, 2), ("big", 2, 3), ("current", 5, 3)]
    assert doc["estimate"]["model_calls"] == doc["estimate"]["replay_calls"] == 8 * 4
    meter = await h.log.get(StateKey(TENANT, "meter", "replay"))
    assert meter is not None
    assert (meter["calls_today"], meter["runs_today"]) == (32, 8)  # every sibling reserved


async def test_the_replay_ceiling_counts_every_sibling_and_names_the_candidate(
    tmp_path: Path,
) -> None:
    """Two calls a sibling: `a` (2 siblings) reserves 4 and `b` (3) 6 of the ceiling of
    12; the implicit control's 3 siblings need 6 more — it is named, nothing reserved."""
    deps = StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        replay=ReplayPolicy(calls_per_day=12),
    )
    h = await open_harness(tmp_path, assay_ingest.create_stage(deps))
    try:
        await two_versions(h)
        spec = matrix(
            {"name": "a", "model": "x", "samples": 2},
            {"name": "b", "model": "y", "samples": 3},
            budget={"run_max_model_calls": 2},
        )
        await h.send(TASKS, task("s-2", rollout=spec))
        assert await refusal(h) == (
            "candidate 'current' cannot be admitted: its 3 siblings' worst case (6 calls, "
            "49152 tokens, $0.000000) does not fit under the tenant's replay ceiling of 12 "
            "calls a day (10 calls, 81920 tokens, $0.000000 reserved today)"
        )
        assert await h.log.get(StateKey(TENANT, "meter", "replay")) is None
        assert await h.log.get(StateKey(TENANT, "rollout", "s-2")) is None
        fits = matrix(
            {"name": "a", "model": "x", "samples": 2},
            {"name": "cur", "version": "current", "samples": 4},
            budget={"run_max_model_calls": 2},
        )
        await h.send(TASKS, task("s-3", rollout=fits))  # 6 siblings, 12 calls: exactly
        spawned = [m for _, m in map(decoded, await h.take()) if isinstance(m, RunSpawned)]
        assert len(spawned) == 6
    finally:
        await h.log.close()
        await h.bus.close()


@pytest.mark.parametrize(
    ("candidates", "budget", "says"),
    [
        (
            [{"name": "a", "model": "x", "samples": 2}, {"name": "b", "model": "y"}],
            {"run_max_model_calls": 2, "group_max_model_calls": 5},
            "candidate 'b' cannot be admitted: the group's group_max_model_calls covers 2 of "
            "the 5 siblings at the per-run maximum",
        ),
        (
            [
                {"name": "a", "model": "x", "samples": 40},
                {"name": "b", "model": "y", "samples": 20},
            ],
            {},
            "candidate 'current' cannot be admitted: its 40 sibling(s) take the group to 100 "
            "siblings, more than a group's 64",
        ),
    ],
    ids=["group-budget", "implicit-control-past-the-group"],
)
async def test_a_matrix_whose_siblings_cannot_all_be_admitted_names_the_candidate(
    h: Harness, candidates: list[dict[str, Any]], budget: dict[str, Any], says: str
) -> None:
    await two_versions(h)
    await h.send(TASKS, task("s-4", rollout=matrix(*candidates, budget=budget)))
    assert await refusal(h) == says
    assert await h.log.get(StateKey(TENANT, "rollout", "s-4")) is None
    assert await h.log.get(StateKey(TENANT, "meter", "replay")) is None


async def test_capacity_is_held_for_every_sibling_or_for_none(h: Harness) -> None:
    await two_versions(h, resources=RESOURCES)  # three runs fit the declared capacity
    prompts = [
        {"name": f"c{i}", "prompt": f"#{i} {{{{ task.question }}}}", "samples": 2} for i in range(2)
    ]
    await h.send(TASKS, task("s-5", rollout=matrix(*prompts, control="c0")))
    assert "candidate 'c1' cannot be admitted: capacity" in await refusal(h)  # its 2nd sibling
    fits = matrix(prompts[0], {"name": "cur", "version": "current"}, control="cur")
    await h.send(TASKS, task("s-6", rollout=fits))  # nothing of the refused group is held
    spawned = [m for _, m in map(decoded, await h.take()) if isinstance(m, RunSpawned)]
    assert len(spawned) == 3


async def test_a_matrix_whose_worst_case_passes_the_dollar_ceiling_is_refused_whole(
    tmp_path: Path,
) -> None:
    model = StubModel()
    model.prices = Prices(prompt_per_mtok=1.0, completion_per_mtok=3.0)
    deps = StageDeps(
        blobs=FsBlobStore(tmp_path / "blobs"),
        model=model,
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
        replay=ReplayPolicy(usd_per_day=0.025),
    )
    h = await open_harness(tmp_path, assay_ingest.create_stage(deps))
    try:
        await two_versions(h)
        # each run: 2 calls of the default 8,192-token context at $3/Mtok is $0.049152,
        # capped by the group's per-run $0.01 — three runs ($0.03) pass the $0.025 a day
        capped = {"run_max_model_calls": 2, "run_max_cost_usd": 0.01}
        spec = matrix({"name": "a", "model": "x"}, {"name": "b", "model": "y"}, budget=capped)
        await h.send(TASKS, task("m-usd", rollout=spec))
        assert await refusal(h) == (
            "candidate 'current' cannot be admitted: its worst case (2 calls, 16384 tokens, "
            "$0.010000) does not fit under the tenant's replay ceiling of $0.025000 a day "
            "(4 calls, 32768 tokens, $0.020000 reserved today)"
        )
        assert await h.log.get(StateKey(TENANT, "meter", "replay")) is None  # nothing held
        one = matrix({"name": "a", "model": "x"}, budget=capped)
        await h.send(TASKS, task("m-two", rollout=one))
        spawned = [m for _, m in map(decoded, await h.take()) if isinstance(m, RunSpawned)]
        assert len(spawned) == 2  # one candidate and the control: $0.02 fits
        meter = await h.log.get(StateKey(TENANT, "meter", "replay"))
        assert meter is not None
        assert (meter["runs_today"], meter["micro_usd_today"]) == (2, 20_000)
    finally:
        await h.log.close()
        await h.bus.close()
