"""The control-flow graph of a workflow: which step can follow which, across every step kind."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from assay.kernel.ids import StepId
from assay.workflow.ir import ConditionalStep, ParallelStep, WorkflowDef


@dataclass(frozen=True)
class ControlGraph:
    """Every way control can pass from one step to the next.

    Edges: the workflow's transitions (`WorkflowDef.edges`); a conditional step to
    each branch target and to `otherwise`; a parallel step to each branch, and each
    branch on to wherever the parallel step's transitions lead (the join).
    """

    successors: Mapping[StepId, tuple[StepId, ...]]
    """Step -> the steps that can follow it."""
    unbounded: Mapping[StepId, tuple[StepId, ...]]
    """The same, without edges that carry `max_iterations` (these must form a DAG)."""
    predecessors: Mapping[StepId, tuple[StepId, ...]]
    """Step -> the steps it can follow."""
    owners: Mapping[StepId, StepId]
    """Parallel branch step -> the parallel step it belongs to."""

    @classmethod
    def of(cls, wf: WorkflowDef) -> ControlGraph:
        """Build the graph. Every id the workflow names must be declared (checked first)."""
        succ: dict[StepId, list[StepId]] = {s.id: [] for s in wf.steps}
        unbounded: dict[StepId, list[StepId]] = {s.id: [] for s in wf.steps}

        def add(source: StepId, target: StepId, bounded: bool) -> None:
            if target not in succ[source]:
                succ[source].append(target)
            if not bounded and target not in unbounded[source]:
                unbounded[source].append(target)

        edges = wf.edges()
        for e in edges:
            add(e.source, e.target, e.max_iterations is not None)
        for step in wf.steps:
            if isinstance(step, ConditionalStep):
                for branch in step.branches:
                    add(step.id, branch.to, False)
                if step.otherwise is not None:
                    add(step.id, step.otherwise, False)
            elif isinstance(step, ParallelStep):
                leaving = [e for e in edges if e.source == step.id]
                for b in step.branches:
                    add(step.id, b, False)
                    for e in leaving:
                        add(b, e.target, e.max_iterations is not None)
        pred: dict[StepId, list[StepId]] = {s: [] for s in succ}
        for source, targets in succ.items():
            for target in targets:
                pred[target].append(source)
        return cls(
            successors={k: tuple(v) for k, v in succ.items()},
            unbounded={k: tuple(v) for k, v in unbounded.items()},
            predecessors={k: tuple(v) for k, v in pred.items()},
            owners=wf.parallel_branches(),
        )

    def reachable(self, start: StepId) -> frozenset[StepId]:
        """`start` and every step a path from it reaches."""
        return self._closure(start, self.successors) | {start}

    def ancestors(self, step: StepId) -> frozenset[StepId]:
        """The steps that can have run before `step` starts: those with a path to it.

        A parallel branch starts with its parallel step, so it sees what that step
        sees. A step is its own ancestor only on a loop.
        """
        return self._closure(self.owners.get(step, step), self.predecessors)

    @staticmethod
    def _closure(start: StepId, graph: Mapping[StepId, tuple[StepId, ...]]) -> frozenset[StepId]:
        seen: set[StepId] = set()
        frontier = [start]
        while frontier:
            for nxt in graph[frontier.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        return frozenset(seen)
