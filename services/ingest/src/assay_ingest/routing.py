"""Routing a task by the latest allocation, and the held-out split (§12.1, §12.5).

Every decision is a uniform draw in [0, 1) derived from the task's `TaskId` and
what the draw is for, so it is the same wherever and whenever the task is routed:

- `serve`: the live challengers' shares, in the order they were admitted, cut
  [0, 1) into consecutive intervals from 0; the challenger whose interval holds
  the draw serves the task, the current version any draw past them all.
- `shadow`: when the draw is below `shadow_rate`, the task is also run under the
  other versions, for comparison only — every challenger's replay of a task the
  current version serves, or the current version's reference run of a task a
  challenger serves (so its live episodes are compared too).
- `held-out`: the task is in the held-out set when the draw is below the held-out
  fraction. Routing ignores it; grading reports it apart; no gate reads it.

A task's draws do not depend on its tenant or on the allocation, so raising the
first challenger's share keeps serving the tasks it served before, and more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, model_validator

from assay.kernel import TaskId, TenantId, WorkflowId, WorkflowVersion, digest
from assay.messages import Ladder, LiveChallenger, Purpose, Role, Rung
from assay.messages.loop import complete_allocation
from assay.record import ReadModel


class Allocation(ReadModel):
    """The allocation ingest routes a workflow's tasks by: the `AllocationChanged` payload
    it applied last (the newest generation). Keyed by workflow id.

    An allocation applied before `AllocationChanged` v2 has no `rung` and no `ladder`
    stored: it reads as having none, and the default ladder. One applied before v3 has
    no `challengers` and no `shares`: they are read from its one challenger.
    """

    kind: ClassVar[str] = "allocation"
    tenant: TenantId
    workflow_id: WorkflowId
    generation: int
    current: WorkflowVersion
    challenger: WorkflowVersion | None = None
    challenger_share: float
    shadow_rate: float
    definitions: dict[str, dict[str, Any]]
    """The IR of every version named here, by version."""
    rung: Rung | None = None
    ladder: Ladder = Ladder.DEFAULT
    challengers: list[LiveChallenger] = Field(default_factory=list)
    shares: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _complete(cls, data: Any) -> Any:
        if isinstance(data, dict) and "current" in data and "challengers" not in data:
            keep_rung = data.get("rung")
            completed = complete_allocation(data)
            return {**completed, "rung": keep_rung}  # as stored: None before v2
        return data

    def serving(self, serve: float) -> WorkflowVersion | None:
        """The challenger whose interval of [0, 1) holds the serve draw (None: current)."""
        edge = 0.0
        for live in self.challengers:
            edge += self.shares.get(live.version, 0.0)
            if serve < edge:
                return live.version
        return None

    def rung_of(self, version: WorkflowVersion) -> Rung | None:
        """A live challenger's rung."""
        return next((c.rung for c in self.challengers if c.version == version), None)


def draw(task_id: TaskId, purpose: str) -> float:
    """A deterministic uniform draw in [0, 1) for one routing decision of a task."""
    return int(digest(f"{task_id}\x1f{purpose}".encode())[:13], 16) / float(1 << 52)


def held_out(task_id: TaskId, fraction: float) -> tuple[bool, float]:
    """Whether the task is in the held-out set, and the draw that decided it."""
    d = draw(task_id, "held-out")
    return d < fraction, d


@dataclass(frozen=True)
class PlannedRun:
    """One run to spawn for a task."""

    role: Role
    purpose: Purpose
    version: WorkflowVersion


@dataclass(frozen=True)
class Route:
    """Where a task goes: the arm that serves it, every run to spawn, and the draws."""

    arm: Role
    runs: tuple[PlannedRun, ...]
    serve_draw: float
    shadow_draw: float

    def reference_expected(self, run: PlannedRun) -> bool:
        """A challenger run whose baseline also runs on the task waits for that run."""
        return run.role is Role.CHALLENGER and any(r.role is Role.CURRENT for r in self.runs)


def route(allocation: Allocation, task_id: TaskId) -> Route:
    """The runs a task gets under an allocation."""
    serve, shadow = draw(task_id, "serve"), draw(task_id, "shadow")
    current = allocation.current
    if not allocation.challengers:
        return Route(
            Role.CURRENT, (PlannedRun(Role.CURRENT, Purpose.WORK, current),), serve, shadow
        )
    replay = shadow < allocation.shadow_rate
    challenger = allocation.serving(serve)
    if challenger is not None:
        served = PlannedRun(Role.CHALLENGER, Purpose.WORK, challenger)
        reference = PlannedRun(Role.CURRENT, Purpose.SHADOW, current)
        return Route(Role.CHALLENGER, (served, reference) if replay else (served,), serve, shadow)
    served = PlannedRun(Role.CURRENT, Purpose.WORK, current)
    replayed = tuple(
        PlannedRun(Role.CHALLENGER, Purpose.SHADOW, c.version) for c in allocation.challengers
    )
    return Route(Role.CURRENT, (served, *replayed) if replay else (served,), serve, shadow)
