"""Load-time checks across workflows (§4.4): sub-workflow calls form no cycle and nest boundedly.

A `latest` selector resolves once, at run spawn, to whichever version is newest
then. At load time any known version may be the one it resolves to, so a call at
`latest` is checked against every known version of the callee.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Final, TypeAlias

from assay.kernel.ids import StepId, WorkflowId, WorkflowVersion
from assay.workflow.ir import LATEST, SubworkflowStep, WorkflowDef
from assay.workflow.validate import WorkflowInvalid

MAX_SUBWORKFLOW_DEPTH: Final = 8
"""How many sub-workflow calls may nest below a top-level run."""

WorkflowKey: TypeAlias = tuple[WorkflowId, WorkflowVersion]
"""One registered workflow version."""


@dataclass(frozen=True)
class SubworkflowCall:
    """An edge between workflow versions: `step` of `caller` runs `callee`."""

    caller: WorkflowKey
    step: StepId
    selector: str
    """The step's version selector: an exact version, or `latest`."""
    callee: WorkflowKey


def label(key: WorkflowKey) -> str:
    """`id@version`, the version shortened to 12 hex digits."""
    return f"{key[0]}@{key[1][:12]}"


def _chain(calls: tuple[SubworkflowCall, ...]) -> str:
    parts = [label(calls[0].caller)]
    for c in calls:
        via = "latest=" if c.selector == LATEST else ""
        parts.append(f"(step {c.step!r}) -> {via}{label(c.callee)}")
    return " ".join(parts)


class SubworkflowCycle(WorkflowInvalid):
    """Sub-workflow calls lead from a workflow version back to itself."""

    def __init__(self, calls: tuple[SubworkflowCall, ...]) -> None:
        super().__init__(f"sub-workflow cycle: {_chain(calls)}")
        self.calls = calls
        self.cycle: tuple[WorkflowKey, ...] = (calls[0].caller, *(c.callee for c in calls))
        """The workflow versions on the cycle, the first repeated at the end."""


class SubworkflowTooDeep(WorkflowInvalid):
    """A chain of sub-workflow calls nests deeper than the bound."""

    def __init__(self, calls: tuple[SubworkflowCall, ...], limit: int) -> None:
        super().__init__(
            f"sub-workflows nest {len(calls)} deep, more than the limit of {limit}: {_chain(calls)}"
        )
        self.calls = calls
        self.limit = limit


def calls_of(defs: Mapping[WorkflowKey, WorkflowDef]) -> dict[WorkflowKey, list[SubworkflowCall]]:
    """Every sub-workflow call each version can make; `latest` fans out to every known version.

    Raises:
        WorkflowInvalid: a key does not match its definition's id and version, or a
            call names a workflow or an exact version that is not in `defs`.
    """
    versions: dict[WorkflowId, list[WorkflowVersion]] = {}
    for key, wf in defs.items():
        actual = (wf.id, wf.version)
        if key != actual:
            raise WorkflowInvalid(f"definition listed as {label(key)} is {label(actual)}")
        versions.setdefault(wf.id, []).append(wf.version)
    out: dict[WorkflowKey, list[SubworkflowCall]] = {}
    for key, wf in defs.items():
        found: list[SubworkflowCall] = []
        for step in wf.steps:
            if not isinstance(step, SubworkflowStep):
                continue
            where = f"{label(key)}: step {step.id!r}"
            if step.version == LATEST:
                known = sorted(versions.get(step.workflow, []))
                if not known:
                    raise WorkflowInvalid(
                        f"{where} calls workflow {step.workflow!r}, which has no known version"
                    )
                targets = [(step.workflow, v) for v in known]
            else:
                target = (step.workflow, WorkflowVersion(step.version))
                if target not in defs:
                    raise WorkflowInvalid(f"{where} calls {label(target)}, which is not known")
                targets = [target]
            found.extend(SubworkflowCall(key, step.id, step.version, t) for t in targets)
        out[key] = found
    return out


def check_subworkflows(
    defs: Mapping[WorkflowKey, WorkflowDef], *, max_depth: int = MAX_SUBWORKFLOW_DEPTH
) -> None:
    """Refuse sub-workflow cycles and nesting deeper than `max_depth`, at load (§4.4).

    `defs` holds every known workflow version, keyed by `(id, version)`; each should
    already have passed `validate`. A call at `latest` counts as a call of every
    known version of its workflow.

    Raises:
        SubworkflowCycle: calls lead back to a version already on the path (A -> B -> A,
            through pinned versions or `latest`); the message names the cycle.
        SubworkflowTooDeep: a chain of calls is longer than `max_depth`.
        WorkflowInvalid: a call names an unknown workflow or version, or a key does not
            match its definition.
    """
    calls = calls_of(defs)
    grey, black = 1, 2
    colour: dict[WorkflowKey, int] = {}
    longest: dict[WorkflowKey, tuple[SubworkflowCall, ...]] = {}
    for root in sorted(defs):
        if root in colour:
            continue
        # Iterative depth-first search: stack entries are (version, its calls, the call in).
        colour[root] = grey
        stack: list[tuple[WorkflowKey, Iterator[SubworkflowCall], SubworkflowCall | None]] = [
            (root, iter(calls[root]), None)
        ]
        while stack:
            node, pending, _ = stack[-1]
            call = next(pending, None)
            if call is None:
                stack.pop()
                colour[node] = black
                best: tuple[SubworkflowCall, ...] = ()
                for c in calls[node]:
                    if 1 + len(longest[c.callee]) > len(best):
                        best = (c, *longest[c.callee])
                if len(best) > max_depth:
                    raise SubworkflowTooDeep(best, max_depth)
                longest[node] = best
                continue
            state = colour.get(call.callee)
            if state == grey:
                start = next(i for i, entry in enumerate(stack) if entry[0] == call.callee)
                path = tuple(entry[2] for entry in stack[start + 1 :] if entry[2] is not None)
                raise SubworkflowCycle((*path, call))
            if state is None:
                colour[call.callee] = grey
                stack.append((call.callee, iter(calls[call.callee]), call))
