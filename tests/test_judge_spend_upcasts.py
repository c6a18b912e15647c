"""Messages from before judge calls were counted apart still decode, as they said it.

RunGraded v6, RunResult v5, RolloutResult v3 and UsageRecorded v3 count answered and
failed judge calls apart and say how many answered comparisons a `Ranked` rests on;
their stored predecessors read without a failure or a breakdown they never recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from assay.kernel.scores import Ranked, Ungraded, UngradedReason
from assay.messages import (
    MESSAGES,
    JudgePurpose,
    RolloutResult,
    RunGraded,
    RunResult,
    UsageRecorded,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "messages"


def fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return loaded


def test_a_usage_recorded_v2_reads_as_an_answered_call_of_no_stated_judge_purpose() -> None:
    decoded = MESSAGES.decode("UsageRecorded", 2, fixture("UsageRecorded.v2"))
    assert isinstance(decoded, UsageRecorded)
    assert (decoded.judge_purpose, decoded.failed) == (None, False)


def test_a_run_graded_v5_reads_with_no_failure_and_no_breakdown() -> None:
    v5 = fixture("RunGraded.v5")
    decoded = MESSAGES.decode("RunGraded", 5, v5)
    assert isinstance(decoded, RunGraded)
    assert decoded.judge_calls == v5["judge_calls"]
    assert decoded.judge_failures == 0
    assert decoded.judge_calls_by_purpose == decoded.judge_failures_by_purpose == {}
    assert decoded.unranked_attempts == []


def test_a_run_graded_v6_says_what_answered_and_what_failed_by_purpose() -> None:
    decoded = MESSAGES.decode("RunGraded", 6, fixture("RunGraded.v6"))
    assert isinstance(decoded, RunGraded)
    assert decoded.judge_calls_by_purpose == {JudgePurpose.TOURNAMENT: 3}
    assert decoded.judge_failures_by_purpose == {
        JudgePurpose.TOURNAMENT: 1,
        JudgePurpose.ATTEMPTS: 2,
    }
    assert isinstance(decoded.score, Ranked)
    assert (decoded.score.comparisons, decoded.score.comparisons_failed) == (3, 1)
    (unranked,) = decoded.unranked_attempts
    assert unranked.reason is UngradedReason.JUDGE_FAILED


@pytest.mark.parametrize(("type_", "version"), [("RunResult", 4), ("RolloutResult", 2)])
def test_results_of_before_read_as_they_are(type_: str, version: int) -> None:
    stored = fixture(f"{type_}.v{version}")
    decoded = MESSAGES.decode(type_, version, stored)
    assert isinstance(decoded, RunResult | RolloutResult)
    if isinstance(decoded, RunResult):
        assert decoded.model_dump(mode="json")["score"] == stored["score"]
    else:
        assert decoded.selection.judge_failures == 0
        ranks = [s.rank for s in decoded.siblings if s.rank is not None]
        assert ranks
        assert all(r.comparisons is None for r in ranks)


def test_a_ranked_without_comparisons_is_written_as_it_was_before() -> None:
    """Deterministic scores, and scores stored before the counts, re-encode byte for
    byte: a rebuilt state and a redelivered message's id do not change."""
    before = {
        "kind": "ranked",
        "strength": 0.5,
        "interval": [0.5, 0.5],
        "group_size": 2,
        "anchored": True,
    }
    assert Ranked.model_validate(before).model_dump(mode="json") == before
    counted = Ranked.model_validate({**before, "comparisons": 2, "comparisons_failed": 2})
    assert counted.model_dump(mode="json") == {
        **before,
        "comparisons": 2,
        "comparisons_failed": 2,
    }


def test_no_ranked_rests_on_no_answered_comparison() -> None:
    with pytest.raises(ValidationError, match="comparisons"):
        Ranked(strength=0.0, interval=(-1.0, 1.0), group_size=2, comparisons=0)


def test_a_breakdown_that_does_not_add_up_is_refused() -> None:
    run = MESSAGES.decode("RunGraded", 6, fixture("RunGraded.v6"))
    assert isinstance(run, RunGraded)
    with pytest.raises(ValidationError, match="does not add up"):
        RunGraded(
            run=run.run,
            passed=False,
            score=Ungraded(reason=UngradedReason.JUDGE_FAILED),
            judge_calls=1,
            judge_calls_by_purpose={JudgePurpose.COMPARE: 2},
        )
