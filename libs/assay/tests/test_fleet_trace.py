"""The fleet trace format: what it accepts, and every rule it refuses by file, line and rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from assay.fleet import TraceInvalid, WaitKind, parse_trace
from libs.assay.tests.fleet_traces import header, text

SCHEMAS = Path(__file__).resolve().parents[3] / "schemas"
STARTED = {"type": "run_started", "t_ms": 0}
FINISHED = {"type": "run_finished", "t_ms": 100, "outcome": "succeeded"}


def wait(t: int, kind: str = "model", edge: str = "started") -> dict[str, Any]:
    return {"type": f"wait_{edge}", "t_ms": t, "kind": kind}


def test_a_well_formed_trace_reads_back_byte_for_byte() -> None:
    source = text(
        STARTED,
        wait(10),
        wait(40, edge="finished"),
        {"type": "busy_started", "t_ms": 40},
        {"type": "busy_finished", "t_ms": 60},
        wait(60, "human"),
        wait(90, "human", "finished"),
        FINISHED,
    )
    trace = parse_trace(source, "t.jsonl")
    assert [(w.kind, w.duration_ms) for w in trace.waits()] == [
        (WaitKind.MODEL, 30),
        (WaitKind.HUMAN, 30),
    ]
    assert trace.duration_ms == 100
    assert trace.header.workload_class == "coder@v1"
    again = trace.to_jsonl()
    assert parse_trace(again, "again.jsonl").to_jsonl() == again


def test_every_line_validates_against_the_published_schemas() -> None:
    head = json.loads((SCHEMAS / "FleetTraceHeader.v1.schema.json").read_text())
    event = json.loads((SCHEMAS / "FleetTraceEvent.v1.schema.json").read_text())
    lines = text(STARTED, wait(1, "tool"), wait(2, "tool", "finished"), FINISHED).splitlines()
    jsonschema.Draft202012Validator(head).validate(json.loads(lines[0]))
    for line in lines[1:]:
        jsonschema.Draft202012Validator(event).validate(json.loads(line))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(event).validate({**STARTED, "prompt": "hello"})


def issues(source: str) -> list[tuple[int, str]]:
    with pytest.raises(TraceInvalid) as caught:
        parse_trace(source, "bad.jsonl")
    for issue in caught.value.issues:
        assert str(issue).startswith(f"bad.jsonl:{issue.line}: {issue.rule}: ")
    return [(i.line, i.rule) for i in caught.value.issues]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("", [(1, "empty")]),
        ("not json\n", [(1, "json"), (2, "unfinished")]),
        (text(STARTED, FINISHED, head=header(version=2)), [(1, "version")]),
        (text(STARTED, FINISHED, head=header(cpu_cores=0)), [(1, "resources")]),
        (text(STARTED, FINISHED, head=header(memory_gib=-1)), [(1, "resources")]),
        (text(STARTED, FINISHED, head=header(prompt="secret")), [(1, "schema")]),
        (text(STARTED, {**FINISHED, "t_ms": 5}, head={**STARTED}), [(1, "header")]),
        (text(STARTED, header(), FINISHED), [(3, "header")]),
        (text(STARTED, {"type": "nap", "t_ms": 1}, FINISHED), [(3, "schema")]),
        (text(STARTED, {**wait(1), "args": {"a": "b"}}, FINISHED), [(3, "schema")]),
        (
            text({**STARTED, "t_ms": 50}, wait(20), wait(60, edge="finished"), FINISHED),
            [(3, "order"), (4, "transition")],  # the refused line is skipped
        ),
        (text(wait(1), STARTED, FINISHED), [(2, "transition")]),
        (text(STARTED, STARTED, FINISHED), [(3, "transition")]),
        (text(STARTED, FINISHED, wait(100)), [(4, "transition")]),
        (text(STARTED, wait(1, edge="finished"), FINISHED), [(3, "transition")]),
        (
            text(STARTED, wait(1), wait(2, "tool", "finished"), wait(3, edge="finished"), FINISHED),
            [(4, "transition")],
        ),
        (
            text(STARTED, wait(1), wait(2, "tool"), wait(3, edge="finished"), FINISHED),
            [(4, "overlap")],
        ),
        (
            text(STARTED, {"type": "busy_started", "t_ms": 1}, wait(2), FINISHED),
            [(4, "overlap"), (5, "unfinished")],
        ),
        (text(STARTED, wait(1), FINISHED), [(4, "unfinished")]),
        (text(STARTED, wait(1)), [(4, "unfinished")]),
        (text(STARTED), [(3, "unfinished")]),
    ],
)
def test_each_rule_is_named_with_its_line(source: str, expected: list[tuple[int, str]]) -> None:
    assert issues(source) == expected


def test_the_stored_v1_trace_still_reads_byte_for_byte() -> None:
    """A trace written by version 1 must read back as it is, for as long as v1 exists."""
    stored = (SCHEMAS.parent / "tests" / "fixtures" / "fleet" / "trace.v1.jsonl").read_text()
    trace = parse_trace(stored, "trace.v1.jsonl")
    assert [(w.kind.value, w.duration_ms) for w in trace.waits()] == [
        ("model", 40_000),
        ("tool", 3_000),
        ("human", 600_000),
    ]
    assert trace.to_jsonl() == stored
