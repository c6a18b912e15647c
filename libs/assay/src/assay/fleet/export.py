"""A run's lifecycle trace, derived from its execute log records alone (DESIGN §16).

What becomes what:

- a `model` step's attempt (AttemptStarted → AttemptFinished) is a `model` wait;
- a `tool` step's attempt is a `tool` wait when the tool runs outside the sandbox, and
  busy time when it runs in it (`sandboxed_tools`: the built-in `command` and
  `write_file` by default) — the seed's reclaimability rule: a tool wait counts only
  while the sandbox itself is idle;
- an `await` step's suspension (Suspended → Signalled, or the run's cancellation) is a
  `human` wait;
- `RunStarted` and `RunFinished` / `RunCancelled` bound the run;
- a resident sandbox's resume (a `SandboxStarted` of generation 2 or later: restore,
  start and verification, its `start_ms`) is the suspension policy's cost, not the
  workload's, so it is taken out of the trace's clock: the trace of a run that was
  really suspended describes the same workload as an always-on run of it, and
  simulating a policy on it charges resume cost once, not twice. Checkpoint and
  release happen inside the wait they were made for and change nothing.

Parallel branches can overlap. Busy time wins over any wait it overlaps (the sandbox
is not idle), and where waits overlap each other the one that began first names the
stretch. Time in neither — the driver's own work, a sub-workflow's steps (recorded on
their own streams), a retry's backoff — is active time: never suspended in a
simulation (execute does release a sandbox across a sub-workflow that does not use
it, so there the simulated saving is a lower bound). Record
timestamps are wall-clock; a timestamp that goes back is held at the previous one so
the trace's clock stays monotonic. Stretches shorter than a millisecond are dropped.
Nothing of a record's content (prompt, arguments, output, error) is read.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from assay.engine.events import (
    AttemptFinished,
    AttemptStarted,
    RunCancelled,
    RunFinished,
    RunStarted,
    SandboxStarted,
    Signalled,
    Suspended,
)
from assay.fleet.trace import (
    TRACE_FORMAT,
    TRACE_VERSION,
    BusyFinishedEvent,
    BusyStartedEvent,
    RunFinishedEvent,
    RunStartedEvent,
    Trace,
    TraceEvent,
    TraceHeader,
    WaitFinishedEvent,
    WaitKind,
    WaitStartedEvent,
)
from assay.record.events import LogRecord

SANDBOXED_TOOLS = frozenset({"command", "write_file"})
"""The built-in tools that run inside the run's sandbox: their time is busy time."""

Label = WaitKind | Literal["busy"]


@dataclass(frozen=True)
class _Span:
    start: int
    end: int
    label: Label


@dataclass(frozen=True)
class Resources:
    """What a sandbox declares: CPU cores and memory in GiB."""

    cpu_cores: float
    memory_gib: float


def trace_of_run(
    records: Sequence[LogRecord],
    resources: Resources,
    sandboxed_tools: frozenset[str] = SANDBOXED_TOOLS,
) -> Trace | None:
    """The trace of one branch of one run, from its records in LSN order.

    Returns None when the records hold no `RunStarted` or the run has not ended.
    """
    if not records or not isinstance(records[0].event, RunStarted):
        return None
    started = records[0].event
    origin = records[0].at_ms
    kinds = _step_kinds(started.definition or {}, sandboxed_tools)
    spans: list[_Span] = []
    open_attempts: dict[tuple[str, int], tuple[int, Label, int]] = {}
    suspended_at: int | None = None
    now = 0
    resumed_ms = 0  # resume time so far: taken out of the clock (see the module's text)
    finished: RunFinishedEvent | None = None
    for record in records[1:]:
        before, now = now, max(now, record.at_ms - origin - resumed_ms)
        match record.event:
            case SandboxStarted(generation=g, start_ms=took) if g > 1:
                resumed_ms += took
                now = max(before, now - took)
            case AttemptStarted(step=step, attempt=n):
                open_attempts[(step, n)] = (now, kinds.get(step, "busy"), before)
            case AttemptFinished(step=step, attempt=n, duration_ms=took):
                if (opened := open_attempts.pop((step, n), None)) is not None:
                    start, label, earlier = opened
                    if start == now:  # a Pure attempt: its start committed with its end
                        start = max(earlier, now - took)
                    spans.append(_Span(start, now, label))
            case Suspended():
                suspended_at = now
            case Signalled():
                if suspended_at is not None:
                    spans.append(_Span(suspended_at, now, WaitKind.HUMAN))
                suspended_at = None
            case RunFinished(succeeded=ok):
                finished = RunFinishedEvent(
                    type="run_finished", t_ms=now, outcome="succeeded" if ok else "failed"
                )
            case RunCancelled():
                if suspended_at is not None:
                    spans.append(_Span(suspended_at, now, WaitKind.HUMAN))
                finished = RunFinishedEvent(type="run_finished", t_ms=now, outcome="cancelled")
            case _:
                pass
        if finished is not None:
            break
    if finished is None:
        return None
    header = TraceHeader(
        type="header",
        format=TRACE_FORMAT,
        version=TRACE_VERSION,
        workflow_id=started.run.workflow_id,
        workflow_version=started.run.workflow_version,
        run=started.run.run_id,
        cpu_cores=resources.cpu_cores,
        memory_gib=resources.memory_gib,
        source="export",
    )
    events: list[TraceEvent] = [RunStartedEvent(type="run_started", t_ms=0)]
    for span in _flatten(spans):
        events.extend(_edges(span))
    events.append(finished)
    return Trace(header, tuple(events))


def _step_kinds(definition: dict[str, Any], sandboxed: frozenset[str]) -> dict[str, Label]:
    """Each model and tool step's label, from the pinned definition."""
    out: dict[str, Label] = {}
    for step in definition.get("steps", []):
        if not isinstance(step, dict) or not isinstance(step.get("id"), str):
            continue
        if step.get("kind") == "model":
            out[step["id"]] = WaitKind.MODEL
        elif step.get("kind") == "tool":
            out[step["id"]] = "busy" if step.get("tool") in sandboxed else WaitKind.TOOL
    return out


def _flatten(spans: list[_Span]) -> list[_Span]:
    """Non-overlapping stretches: busy over any wait, else the earliest-begun wait."""
    cuts = sorted({s.start for s in spans} | {s.end for s in spans})
    out: list[_Span] = []
    for a, b in itertools.pairwise(cuts):
        covering = [s for s in spans if s.start <= a and s.end >= b]
        if not covering:
            continue
        if any(s.label == "busy" for s in covering):
            label: Label = "busy"
        else:
            label = min(covering, key=lambda s: (s.start, _order(s.label))).label
        if out and out[-1].end == a and out[-1].label == label:
            out[-1] = _Span(out[-1].start, b, label)
        else:
            out.append(_Span(a, b, label))
    return out


def _order(label: Label) -> int:
    return -1 if label == "busy" else list(WaitKind).index(label)


def _edges(span: _Span) -> list[TraceEvent]:
    if span.label == "busy":
        return [
            BusyStartedEvent(type="busy_started", t_ms=span.start),
            BusyFinishedEvent(type="busy_finished", t_ms=span.end),
        ]
    return [
        WaitStartedEvent(type="wait_started", t_ms=span.start, kind=span.label),
        WaitFinishedEvent(type="wait_finished", t_ms=span.end, kind=span.label),
    ]
