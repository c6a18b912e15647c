"""`assay submit --candidate/--candidates`: a candidate matrix from flags or a file,
checked before anything is produced and attached to every task."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from assay.cli.candidates import matrix_of, parse_candidate, with_matrix
from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId, WorkflowId
from assay.messages import RolloutBudget, RolloutSpec, TaskSubmitted

TENANT = TenantId(uuid.UUID("00000000-0000-4000-8000-0000000000c1"))


@pytest.mark.parametrize(
    ("flag", "doc"),
    [
        ("version=current", {"version": "current"}),
        ("v2:version=3f9a", {"name": "v2", "version": "3f9a"}),
        ("big:model=gpt-4o", {"name": "big", "model": "gpt-4o"}),
        ("prompt=Say {{ task.q }} = ?", {"prompt": "Say {{ task.q }} = ?"}),
        ("c:prompt.solve=Step by step", {"name": "c", "prompt": {"solve": "Step by step"}}),
        ("big*3:model=gpt-4o", {"name": "big", "samples": 3, "model": "gpt-4o"}),
        ("*5:version=current", {"samples": 5, "version": "current"}),
        ("v:1*2:version=3f9a", {"name": "v:1", "samples": 2, "version": "3f9a"}),
    ],
)
def test_a_candidate_flag_is_a_name_a_kind_and_a_value(flag: str, doc: dict[str, object]) -> None:
    assert parse_candidate(flag) == doc


@pytest.mark.parametrize(
    "flag", ["model", "model=", "speed=fast", "x:prompt.=y", "a*:model=m", "a*two:model=m"]
)
def test_a_malformed_candidate_flag_is_refused_naming_it(flag: str) -> None:
    with pytest.raises(AssayError, match="--candidate"):
        parse_candidate(flag)


def test_a_matrix_file_is_yaml_or_json_and_checked_whole(tmp_path: Path) -> None:
    listed = tmp_path / "m.yaml"
    listed.write_text("- {name: v1, version: current}\n- {name: big, model: m2}\n")
    assert matrix_of(None, listed, "v1") == {
        "candidates": [{"name": "v1", "version": "current"}, {"name": "big", "model": "m2"}],
        "control": "v1",
    }
    spec = tmp_path / "m.json"
    spec.write_text(json.dumps({"candidates": [{"model": "a"}], "mode": "evaluation"}))
    assert matrix_of(None, spec, None) == {"candidates": [{"model": "a"}], "mode": "evaluation"}
    twice = tmp_path / "twice.json"
    twice.write_text(json.dumps([{"model": "a"}, {"model": "a"}]))
    with pytest.raises(AssayError, match="unique in the matrix"):
        matrix_of(None, twice, None)
    with pytest.raises(AssayError, match="not both"):
        matrix_of(["model=a"], spec, None)
    with pytest.raises(AssayError, match="--control"):
        matrix_of(None, None, "v1")
    assert matrix_of(None, None, None) is None


def test_the_matrix_goes_on_every_task_over_its_own_budget() -> None:
    budget = RolloutBudget(max_concurrency=2)
    tasks = [
        TaskSubmitted(
            tenant=TENANT,
            workflow_id=WorkflowId("arith"),
            idempotency_key=f"t-{i}",
            input={"question": "1 + 1"},
            rollout=RolloutSpec(n=8, budget=budget) if i else None,
        )
        for i in range(2)
    ]
    matrix = matrix_of(["v1:version=current", "model=m2"], None, None)
    out = with_matrix(tasks, matrix)
    for task in out:
        assert task.rollout is not None
        assert task.rollout.n == 2
        assert [c.label(i) for i, c in enumerate(task.rollout.candidates or [])] == [
            "v1",
            "model:m2",
        ]
    assert out[0].rollout is not None
    assert out[0].rollout.budget.max_concurrency is None
    assert out[1].rollout is not None
    assert out[1].rollout.budget.max_concurrency == 2
    assert with_matrix(tasks, None) == tasks


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["a*0:model=m"], "candidates.0.samples: Input should be greater than or equal to 1"),
        (["a*65:model=m"], "the candidates run 65 siblings, more than a group's 64"),
        (["a*40:model=m", "b*30:model=n"], "the candidates run 70 siblings"),
    ],
    ids=["zero", "above-the-group", "sum-above-the-group"],
)
def test_a_candidates_siblings_out_of_range_are_refused_before_anything_is_produced(
    flags: list[str], says: str
) -> None:
    with pytest.raises(AssayError, match="candidate matrix") as err:
        matrix_of(flags, None, None)
    assert says in str(err.value)


def test_k_siblings_per_candidate_reach_every_task() -> None:
    task = TaskSubmitted(
        tenant=TENANT, workflow_id=WorkflowId("arith"), idempotency_key="t", input={}
    )
    (out,) = with_matrix([task], matrix_of(["v1*3:version=current", "big*2:model=m2"], None, None))
    assert out.rollout is not None
    assert out.rollout.n == 5
    assert [c.samples for c in out.rollout.candidates or []] == [3, 2]
