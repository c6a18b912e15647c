"""RunGraded v9 carries the judge's order checks of the tournament bouts a run was in;
a stored v8 grade, which did not say, reads with none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from assay.kernel.schema import UnknownSchema
from assay.messages import MESSAGES, RunGraded

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "messages"


def fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return loaded


def test_a_run_graded_v8_reads_with_no_order_checks() -> None:
    v8 = fixture("RunGraded.v8")
    decoded = MESSAGES.decode("RunGraded", 8, v8)
    assert isinstance(decoded, RunGraded)
    assert (decoded.order_checked, decoded.order_inconsistent) == (0, 0)
    assert decoded.judge_cost_usd == v8["judge_cost_usd"]  # the rest reads as it was


def test_a_run_graded_v9_says_its_bouts_order_checks() -> None:
    decoded = MESSAGES.decode("RunGraded", 9, fixture("RunGraded.v9"))
    assert isinstance(decoded, RunGraded)
    assert (decoded.order_checked, decoded.order_inconsistent) == (2, 1)


def test_more_inconsistent_checks_than_checks_is_refused() -> None:
    v9 = {**fixture("RunGraded.v9"), "order_checked": 1, "order_inconsistent": 2}
    with pytest.raises(UnknownSchema) as refused:
        MESSAGES.decode("RunGraded", 9, v9)
    assert "2 inconsistent of 1 order checks" in str(refused.value.__cause__)
