"""The fleet lifecycle trace: one run's waits and busy periods, content-free (DESIGN §16).

A trace is JSON lines. The first line is a `TraceHeader` (the run's workload
class — workflow id and version — and its sandbox's declared CPU cores and
memory); every other line is one `TraceEvent` with a monotonic timestamp in
milliseconds since the trace's origin. The format holds no prompt, output,
argument or environment value, and has no field where one could go: every
model forbids extra fields.

A well-formed trace reads

    header, run_started, (wait_started wait_finished | busy_started busy_finished)*,
    run_finished

with timestamps that never go back; `assay.fleet.validate` enforces it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

TRACE_FORMAT = "assay.fleet.trace"
"""The `format` every trace header names."""
TRACE_VERSION = 1
"""The trace format version this code writes and reads."""


class WaitKind(enum.Enum):
    """What a run waits on while its sandbox is idle."""

    MODEL = "model"
    TOOL = "tool"
    HUMAN = "human"


class _Line(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TraceHeader(_Line):
    """The first line of a trace: what ran, and what its sandbox held."""

    type: Literal["header"] = Field(description="Line kind.")
    format: Literal["assay.fleet.trace"] = Field(description="Always `assay.fleet.trace`.")
    version: Literal[1] = Field(description="Trace format version.")
    workflow_id: str = Field(
        min_length=1, max_length=200, description="Workload class: the workflow id (or a name)."
    )
    workflow_version: str = Field(
        min_length=1, max_length=200, description="Workload class: the workflow version."
    )
    run: str = Field(
        min_length=1, max_length=200, description="An opaque name of the run (its run id)."
    )
    cpu_cores: float = Field(gt=0, le=1024, description="CPU cores the sandbox declares.")
    memory_gib: float = Field(gt=0, le=65536, description="Memory the sandbox declares, GiB.")
    source: Literal["export", "record", "generate", "hand"] = Field(
        description="Where the trace came from: an Assay log, the recorder, the generator."
    )

    @property
    def workload_class(self) -> str:
        """`workflow_id@workflow_version`: what analysis groups by."""
        return f"{self.workflow_id}@{self.workflow_version}"


class _Event(_Line):
    t_ms: int = Field(ge=0, description="Milliseconds since the trace's origin (monotonic).")


class RunStartedEvent(_Event):
    """The run began: its sandbox is held from here."""

    type: Literal["run_started"] = Field(description="Line kind.")


class RunFinishedEvent(_Event):
    """The run ended: its sandbox is released."""

    type: Literal["run_finished"] = Field(description="Line kind.")
    outcome: Literal["succeeded", "failed", "cancelled", "exited"] = Field(
        description="How it ended (`exited`: a recorded process, whatever its exit status)."
    )


class WaitStartedEvent(_Event):
    """The run began waiting on something outside its sandbox, which is idle meanwhile."""

    type: Literal["wait_started"] = Field(description="Line kind.")
    kind: WaitKind = Field(description="What it waits on: model, tool or human.")


class WaitFinishedEvent(_Event):
    """The wait that is open ended."""

    type: Literal["wait_finished"] = Field(description="Line kind.")
    kind: WaitKind = Field(description="The open wait's kind.")


class BusyStartedEvent(_Event):
    """Work began inside the sandbox (a sandboxed tool, a command): it is not idle."""

    type: Literal["busy_started"] = Field(description="Line kind.")


class BusyFinishedEvent(_Event):
    """The busy period that is open ended."""

    type: Literal["busy_finished"] = Field(description="Line kind.")


TraceEvent = Annotated[
    RunStartedEvent
    | RunFinishedEvent
    | WaitStartedEvent
    | WaitFinishedEvent
    | BusyStartedEvent
    | BusyFinishedEvent,
    Field(discriminator="type"),
]
"""One event line of a trace."""
EVENT: TypeAdapter[TraceEvent] = TypeAdapter(TraceEvent)


@dataclass(frozen=True)
class Wait:
    """One wait of a run: `[start_ms, end_ms)` on the trace's clock."""

    kind: WaitKind
    start_ms: int
    end_ms: int

    @property
    def duration_ms(self) -> int:
        """How long it lasted."""
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class Trace:
    """A validated trace: its header and events, well-formed (see the module doc)."""

    header: TraceHeader
    events: tuple[TraceEvent, ...]

    @property
    def start_ms(self) -> int:
        """When the run started."""
        return self.events[0].t_ms

    @property
    def end_ms(self) -> int:
        """When the run finished."""
        return self.events[-1].t_ms

    @property
    def duration_ms(self) -> int:
        """How long the sandbox is held when it is never suspended."""
        return self.end_ms - self.start_ms

    def waits(self) -> list[Wait]:
        """Every wait, in order."""
        out: list[Wait] = []
        opened: WaitStartedEvent | None = None
        for e in self.events:
            if isinstance(e, WaitStartedEvent):
                opened = e
            elif isinstance(e, WaitFinishedEvent) and opened is not None:
                out.append(Wait(opened.kind, opened.t_ms, e.t_ms))
                opened = None
        return out

    def to_jsonl(self) -> str:
        """The trace as JSON lines, keys sorted: the same trace gives the same bytes."""
        lines = [self.header.model_dump(mode="json")]
        lines.extend(EVENT.dump_python(e, mode="json") for e in self.events)
        return "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines)
