"""Hand-written fleet traces for the fleet tests."""

from __future__ import annotations

import json
from typing import Any

from assay.fleet import Trace, parse_trace


def header(**over: Any) -> dict[str, Any]:
    """A valid trace header, with `over` replacing fields."""
    doc: dict[str, Any] = {
        "type": "header",
        "format": "assay.fleet.trace",
        "version": 1,
        "workflow_id": "coder",
        "workflow_version": "v1",
        "run": "run-1",
        "cpu_cores": 2.0,
        "memory_gib": 4.0,
        "source": "hand",
    }
    doc.update(over)
    return doc


def text(*lines: dict[str, Any], head: dict[str, Any] | None = None) -> str:
    """JSON lines: the header (default `header()`), then `lines`."""
    docs = [head if head is not None else header(), *lines]
    return "".join(json.dumps(d) + "\n" for d in docs)


def run(duration_ms: int, *waits: tuple[str, int, int], **head: Any) -> Trace:
    """A run of `duration_ms` with waits `(kind, start_ms, end_ms)`, validated."""
    events: list[dict[str, Any]] = [{"type": "run_started", "t_ms": 0}]
    for kind, start, end in waits:
        events.append({"type": "wait_started", "t_ms": start, "kind": kind})
        events.append({"type": "wait_finished", "t_ms": end, "kind": kind})
    events.append({"type": "run_finished", "t_ms": duration_ms, "outcome": "succeeded"})
    return parse_trace(text(*events, head=header(**head)), "hand.jsonl")
