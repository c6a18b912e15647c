"""Routing a task by the latest allocation, and the held-out split (§12.1, §12.5).

Every decision is a uniform draw in [0, 1) derived from the task's `TaskId` and
what the draw is for, so it is the same wherever and whenever the task is routed:

- `serve`: the challenger serves the task when the draw is below its
  `challenger_share`; the current version otherwise.
- `shadow`: when the draw is below `shadow_rate`, the task is also run under the
  other version, for comparison only — the challenger's replay of a task the
  current version serves, or the current version's reference run of a task the
  challenger serves (so its live episodes are compared too).
- `held-out`: the task is in the held-out set when the draw is below the held-out
  fraction. Routing ignores it; grading reports it apart; no gate reads it.

A task's draws do not depend on its tenant or on the allocation, so raising a
challenger's share keeps serving the tasks it served before, and more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from assay.kernel import TaskId, TenantId, WorkflowId, WorkflowVersion, digest
from assay.messages import Ladder, Purpose, Role, Rung
from assay.record import ReadModel


class Allocation(ReadModel):
    """The allocation ingest routes a workflow's tasks by: the `AllocationChanged` payload
    it applied last (the newest generation). Keyed by workflow id.

    An allocation applied before `AllocationChanged` v2 has no `rung` and no `ladder`
    stored: it reads as having none, and the default ladder.
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
    challenger = allocation.challenger
    if not challenger:
        return Route(
            Role.CURRENT, (PlannedRun(Role.CURRENT, Purpose.WORK, current),), serve, shadow
        )
    replay = shadow < allocation.shadow_rate
    if serve < allocation.challenger_share:
        served = PlannedRun(Role.CHALLENGER, Purpose.WORK, challenger)
        reference = PlannedRun(Role.CURRENT, Purpose.SHADOW, current)
        return Route(Role.CHALLENGER, (served, reference) if replay else (served,), serve, shadow)
    served = PlannedRun(Role.CURRENT, Purpose.WORK, current)
    replayed = PlannedRun(Role.CHALLENGER, Purpose.SHADOW, challenger)
    return Route(Role.CURRENT, (served, replayed) if replay else (served,), serve, shadow)
