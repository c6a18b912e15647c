"""What the ladder's new versions make of stored history: each golden fixture of the
version before reads as the new version says it should (§8.7)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from assay.messages import MESSAGES, AllocationChanged, Ladder, Rung, VariantAggregate
from assay_decide import DECIDE_EVENTS
from assay_decide.stage import AllocationSet, ChallengerDecided
from assay_ingest import INGEST_EVENTS
from assay_ingest.state import TaskAccepted, WorkflowStored

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture(path: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURES / path).read_text())
    return doc


def test_a_v1_allocation_reads_its_rung_from_its_share() -> None:
    v1 = fixture("messages/AllocationChanged.v1.json")
    alloc = MESSAGES.decode("AllocationChanged", 1, v1)
    assert isinstance(alloc, AllocationChanged)
    assert (alloc.rung, alloc.ladder) == (None, Ladder.DEFAULT)  # no challenger
    other = "f" * 64  # a challenger: any version but the current one
    shadow = MESSAGES.decode("AllocationChanged", 1, {**v1, "challenger": other})
    trial = MESSAGES.decode(
        "AllocationChanged", 1, {**v1, "challenger": other, "challenger_share": 0.05}
    )
    assert isinstance(shadow, AllocationChanged)
    assert isinstance(trial, AllocationChanged)
    assert (shadow.rung, trial.rung) == (Rung.SHADOW, Rung.TRIAL)
    # v3: the one challenger is the list of them, and the shares split the traffic
    assert [(c.version, c.rung) for c in trial.challengers] == [(other, Rung.TRIAL)]
    assert trial.shares == {alloc.current: 0.95, other: 0.05}
    assert alloc.challengers == []
    assert alloc.shares == {alloc.current: 1.0}


def test_a_v2_allocation_set_names_its_standing_challenger_as_moved() -> None:
    v2 = fixture("events/decide/AllocationSet.v2.json")
    event = DECIDE_EVENTS.decode("AllocationSet", 2, v2)
    assert isinstance(event, AllocationSet)
    assert event.moved is None  # no challenger, no standing
    v3 = DECIDE_EVENTS.decode("AllocationSet", 3, fixture("events/decide/AllocationSet.v3.json"))
    assert isinstance(v3, AllocationSet)
    assert v3.moved == v3.allocation.challengers[0].version
    assert v3.standing is not None
    assert v3.standing.rung is v3.allocation.challengers[0].rung


def test_a_v2_aggregate_moves_no_rung() -> None:
    agg = MESSAGES.decode("VariantAggregate", 2, fixture("messages/VariantAggregate.v2.json"))
    assert isinstance(agg, VariantAggregate)
    assert (agg.screened, agg.served, agg.baseline_runs, agg.held_out) == (0, 0, 0, None)


def test_a_v1_allocation_set_holds_a_v2_allocation_and_no_standing() -> None:
    event = DECIDE_EVENTS.decode("AllocationSet", 1, fixture("events/decide/AllocationSet.v1.json"))
    assert isinstance(event, AllocationSet)
    assert event.allocation.ladder is Ladder.DEFAULT
    assert event.standing is None


def test_a_v1_decision_was_the_sequential_tests() -> None:
    v1 = fixture("events/decide/ChallengerDecided.v1.json")
    event = DECIDE_EVENTS.decode("ChallengerDecided", 1, v1)
    assert isinstance(event, ChallengerDecided)
    assert event.outcome == ("promoted" if v1["accepted"] else "rejected")
    assert (event.rung, event.trigger, event.ladder) == (None, None, Ladder.DEFAULT)


def test_a_v1_stored_version_names_its_one_parent() -> None:
    v1 = fixture("events/ingest/WorkflowStored.v1.json")
    event = INGEST_EVENTS.decode("WorkflowStored", 1, v1)
    assert isinstance(event, WorkflowStored)
    assert event.parents == ([v1["parent"]] if v1["parent"] else [])
    child = INGEST_EVENTS.decode("WorkflowStored", 1, {**v1, "parent": "ab" * 32})
    assert isinstance(child, WorkflowStored)
    assert child.parents == ["ab" * 32]


def test_a_v1_task_was_a_selection_task_served_by_its_work_run() -> None:
    v1 = fixture("events/ingest/TaskAccepted.v1.json")
    event = INGEST_EVENTS.decode("TaskAccepted", 1, v1)
    assert isinstance(event, TaskAccepted)
    work = next(r for r in event.runs if r.purpose.value == "work")
    assert event.arm is work.role
    assert (event.held_out, event.held_out_draw, event.rung) == (False, None, None)


def test_a_v2_task_had_nothing_cut_and_reserved_nothing_for_replay() -> None:
    v2 = fixture("events/ingest/TaskAccepted.v2.json")
    event = INGEST_EVENTS.decode("TaskAccepted", 2, v2)
    assert isinstance(event, TaskAccepted)
    assert (event.cut, event.replay_calls) == ([], 0)
    assert [r.purpose.value for r in event.runs] == ["work", "shadow"]  # spawned as recorded
