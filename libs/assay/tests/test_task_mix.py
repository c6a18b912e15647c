"""The task-mix statistic (§12.5): features as declared, bins, and the population
stability index — and a feature that is not in the task refused at load."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from assay.grading.task_mix import (
    MISSING,
    OTHER,
    features_of,
    psi,
    reference_of,
    window_psi,
)
from assay.workflow import TASK_ID_CLASS, DriftSpec, WorkflowInvalid, from_document

SPEC = DriftSpec(features=["input.language", "input.meta.difficulty"], window=20, bins=4)


def rows(languages: list[str], difficulties: list[float] | None = None) -> list[dict[str, Any]]:
    ds = difficulties if difficulties is not None else [1.0] * len(languages)
    return [
        features_of(SPEC, {"language": lang, "meta": {"difficulty": d}}, keyed=False)
        for lang, d in zip(languages, ds, strict=True)
    ]


def test_features_read_nested_fields_and_name_what_is_missing() -> None:
    row = features_of(SPEC, {"language": "en", "meta": {"difficulty": 3}}, keyed=True)
    assert row == {"input.language": "en", "input.meta.difficulty": 3.0, TASK_ID_CLASS: "task_key"}
    bare = features_of(SPEC, {"meta": "flat"}, keyed=False)
    assert bare == {
        "input.language": MISSING,
        "input.meta.difficulty": MISSING,
        TASK_ID_CLASS: "content",
    }
    odd = features_of(SPEC, {"language": True, "meta": {"difficulty": [1, 2]}}, keyed=False)
    assert (odd["input.language"], odd["input.meta.difficulty"]) == ("true", "[1, 2]")


def test_the_same_mix_has_no_drift_and_a_moved_one_has_the_textbook_value() -> None:
    reference = reference_of(rows(["en"] * 10 + ["fr"] * 10), SPEC)
    assert window_psi(reference, rows(["fr"] * 10 + ["en"] * 10))["input.language"] == 0.0
    moved = window_psi(reference, rows(["en"] * 15 + ["fr"] * 5))["input.language"]
    # (0.75 - 0.5) ln(0.75 / 0.5) + (0.25 - 0.5) ln(0.25 / 0.5)
    assert moved == pytest.approx(0.25 * math.log(1.5) + 0.25 * math.log(2), abs=1e-6)


def test_a_numeric_feature_is_binned_by_the_references_quantiles() -> None:
    reference = reference_of(rows(["en"] * 20, [float(i) for i in range(20)]), SPEC)
    feature = reference.features["input.meta.difficulty"]
    assert feature.numeric
    assert len(feature.edges) == 3  # four bins of about equal reference mass
    assert all(share == pytest.approx(0.25) for share in feature.shares.values())
    shifted = window_psi(reference, rows(["en"] * 20, [float(i) + 10 for i in range(20)]))
    assert shifted["input.meta.difficulty"] > 0.25
    assert shifted["input.language"] == 0.0


def test_rare_categories_share_one_bin() -> None:
    spec = DriftSpec(features=["input.language"], window=20)
    many = [features_of(spec, {"language": f"l{i}"}, False) for i in range(60)]
    feature = reference_of(many, spec).features["input.language"]
    assert len(feature.shares) == 51
    assert feature.shares[OTHER] == pytest.approx(10 / 60)
    assert feature.bin("never-seen") == OTHER


@given(
    st.lists(st.sampled_from(["a", "b", "c", "<missing>"]), min_size=1, max_size=40),
    st.lists(st.sampled_from(["a", "b", "d"]), min_size=1, max_size=40),
)
def test_psi_is_never_negative_and_zero_on_the_reference_itself(
    ref_values: list[str], window: list[str]
) -> None:
    spec = DriftSpec(features=["input.x"], window=20)
    reference = reference_of([{"input.x": v} for v in ref_values], spec).features["input.x"]
    assert psi(reference, list(window)) >= 0.0
    assert psi(reference, list(ref_values)) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    ("drift", "needle"),
    [
        ({"features": ["output.answer"]}, "drift feature 'output.answer' is not in the task input"),
        ({"features": ["input"]}, "drift feature 'input' is not in the task input"),
        ({"features": ["input.a", "input.a"]}, "drift features are named twice"),
        (
            {
                "features": ["input.meta.level"],
                "input_schema": {"properties": {"meta": {"properties": {"tier": {}}}}},
            },
            "its declared input_schema has no property 'level' there",
        ),
        ({"features": ["input.a"], "window": 5}, "drift.window"),
    ],
)
def test_a_feature_not_in_the_task_is_refused_at_load(drift: dict[str, Any], needle: str) -> None:
    doc = {"id": "w", "steps": [{"id": "s", "kind": "model", "prompt": "p"}], "drift": drift}
    with pytest.raises(WorkflowInvalid, match="drift") as caught:
        from_document(doc)
    assert needle in str(caught.value)


def test_a_declared_schema_admits_its_properties_and_unset_drift_keeps_the_hash() -> None:
    schema = {"properties": {"meta": {"properties": {"level": {"type": "integer"}}}}}
    doc: dict[str, Any] = {"id": "w", "steps": [{"id": "s", "kind": "model", "prompt": "p"}]}
    plain = from_document(doc)
    assert "drift" not in plain.model_dump(mode="json", by_alias=True)
    watched = from_document(
        {**doc, "drift": {"features": ["input.meta.level"], "input_schema": schema}}
    )
    assert watched.drift is not None
    assert watched.version != plain.version
