"""Load-time checks on the IR (§4.3, DESIGN §8). A new format inherits all of them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from assay.kernel.errors import AssayError
from assay.kernel.ids import StepId
from assay.workflow.ir import BUILTIN_VERIFIER_KINDS, ModelStep, ToolStep, Transition, WorkflowDef
from assay.workflow.templates import malformed, placeholders


class WorkflowInvalid(AssayError):
    """A workflow definition failed a load-time check. The message names the check."""


@dataclass(frozen=True)
class StepIdDiff:
    """Step ids added, removed and retained by a version bump."""

    added: frozenset[StepId]
    removed: frozenset[StepId]
    retained: frozenset[StepId]


def validate(
    wf: WorkflowDef,
    known_tools: frozenset[str] | None = None,
    known_verifiers: frozenset[str] | None = None,
) -> WorkflowDef:
    """Run every load-time check; return `wf` unchanged or raise `WorkflowInvalid`.

    Checks: unique step ids; transitions between declared steps; the graph of
    unbounded edges is a DAG (every loop carries `max_iterations`); at most one
    unbounded and one bounded edge leave a step; every step is reachable from
    the entry; templates refer only to `task.*` or declared steps; verifiers
    and rubric ids are unique and point at declared steps; tools are known;
    verifier kinds are built-in or among `known_verifiers` (the kinds installed
    packages register; None: built-in kinds only).
    """
    ids = [s.id for s in wf.steps]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise WorkflowInvalid(f"workflow {wf.id!r}: duplicate step ids {dupes}")
    declared = set(ids)
    edges = wf.edges()
    for e in edges:
        for end in (e.source, e.target):
            if end not in declared:
                raise WorkflowInvalid(f"workflow {wf.id!r}: transition names unknown step {end!r}")
    _check_out_degree(wf, edges)
    _check_acyclic(
        wf,
        {s: [e.target for e in edges if e.source == s and e.max_iterations is None] for s in ids},
    )
    _check_reachable(wf, edges)
    for step in wf.steps:
        _check_templates(wf, step, declared)
        if known_tools is not None and isinstance(step, ToolStep) and step.tool not in known_tools:
            raise WorkflowInvalid(
                f"workflow {wf.id!r}: step {step.id!r} uses unknown tool "
                f"{step.tool!r} (known: {sorted(known_tools)})"
            )
    if wf.output is not None and wf.output not in declared:
        raise WorkflowInvalid(f"workflow {wf.id!r}: output names unknown step {wf.output!r}")
    _check_verifiers(wf, declared, BUILTIN_VERIFIER_KINDS | (known_verifiers or frozenset()))
    rubric_ids = [r.id for r in wf.rubric]
    if len(set(rubric_ids)) != len(rubric_ids):
        raise WorkflowInvalid(f"workflow {wf.id!r}: duplicate rubric ids")
    return wf


def _check_out_degree(wf: WorkflowDef, edges: list[Transition]) -> None:
    for step in wf.steps:
        out = [e for e in edges if e.source == step.id]
        plain = [e for e in out if e.max_iterations is None]
        loops = [e for e in out if e.max_iterations is not None]
        if len(plain) > 1 or len(loops) > 1:
            raise WorkflowInvalid(
                f"workflow {wf.id!r}: step {step.id!r} has {len(out)} outgoing transitions; "
                "at most one forward edge and one bounded loop edge may leave a step"
            )


def _check_acyclic(wf: WorkflowDef, graph: dict[StepId, list[StepId]]) -> None:
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)

    def visit(node: StepId, path: list[StepId]) -> None:
        colour[node] = grey
        for nxt in graph[node]:
            if colour[nxt] == grey:
                cycle = [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
                raise WorkflowInvalid(
                    f"workflow {wf.id!r}: cycle {' -> '.join(cycle)} has no loop bound; "
                    "give one of its transitions max_iterations"
                )
            if colour[nxt] == white:
                visit(nxt, [*path, nxt])
        colour[node] = black

    for node in graph:
        if colour[node] == white:
            visit(node, [node])


def _check_reachable(wf: WorkflowDef, edges: list[Transition]) -> None:
    seen = {wf.steps[0].id}
    frontier = [wf.steps[0].id]
    while frontier:
        node = frontier.pop()
        for e in edges:
            if e.source == node and e.target not in seen:
                seen.add(e.target)
                frontier.append(e.target)
    unreachable = [s.id for s in wf.steps if s.id not in seen]
    if unreachable:
        raise WorkflowInvalid(
            f"workflow {wf.id!r}: steps {unreachable} are unreachable from entry {wf.steps[0].id!r}"
        )


def _check_templates(wf: WorkflowDef, step: ModelStep | ToolStep, declared: set[StepId]) -> None:
    texts = [step.prompt] if isinstance(step, ModelStep) else list(step.args.values())
    for text in texts:
        bad = malformed(text)
        if bad:
            raise WorkflowInvalid(
                f"workflow {wf.id!r}: step {step.id!r} has a malformed placeholder {bad[0]!r}; "
                "write {{ task.<field> }} or {{ steps.<id>.output }}"
            )
        for path in placeholders(text):
            _check_path(wf, f"step {step.id!r}", path, declared)


def _check_template(wf: WorkflowDef, where: str, text: str, declared: set[StepId]) -> None:
    bad = malformed(text)
    if bad:
        raise WorkflowInvalid(
            f"workflow {wf.id!r}: {where} has a malformed placeholder {bad[0]!r}; "
            "write {{ task.<field> }} or {{ steps.<id>.output }}"
        )
    for path in placeholders(text):
        _check_path(wf, where, path, declared)


def _check_path(wf: WorkflowDef, where: str, path: tuple[str, ...], declared: set[StepId]) -> None:
    if path[0] == "task":
        return
    if path[0] == "steps" and len(path) == 3 and path[2] == "output" and path[1] in declared:
        return
    raise WorkflowInvalid(
        f"workflow {wf.id!r}: {where} refers to {'.'.join(path)!r}; templates may use "
        "task.<field> or steps.<declared step>.output"
    )


def _check_verifiers(wf: WorkflowDef, declared: set[StepId], kinds: frozenset[str]) -> None:
    ids = [v.id for v in wf.verifiers]
    if len(set(ids)) != len(ids):
        raise WorkflowInvalid(f"workflow {wf.id!r}: duplicate verifier ids")
    for v in wf.verifiers:
        where = f"verifier {v.id!r}"
        if v.kind not in kinds:
            raise WorkflowInvalid(
                f"workflow {wf.id!r}: {where} has unknown kind {v.kind!r} (known: {sorted(kinds)})"
            )
        if v.step is not None and v.step not in declared:
            raise WorkflowInvalid(f"workflow {wf.id!r}: {where} checks unknown step {v.step!r}")
        if v.kind == "exact":
            if v.expected is None:
                raise WorkflowInvalid(f"workflow {wf.id!r}: {where} (exact) needs `expected`")
            for path in placeholders(v.expected):
                _check_path(wf, where, path, declared)
        elif v.kind == "regex":
            if v.pattern is None:
                raise WorkflowInvalid(f"workflow {wf.id!r}: {where} (regex) needs `pattern`")
            try:
                re.compile(v.pattern)
            except re.error as exc:
                raise WorkflowInvalid(f"workflow {wf.id!r}: {where} pattern: {exc}") from exc
        elif v.kind == "json_schema" and v.json_schema is None:
            raise WorkflowInvalid(f"workflow {wf.id!r}: {where} (json_schema) needs `json_schema`")
        elif v.kind == "command":
            if not v.argv or not v.argv[0].strip():
                raise WorkflowInvalid(
                    f"workflow {wf.id!r}: {where} (command) needs a non-empty `argv`"
                )
            for arg in v.argv:
                _check_template(wf, where, arg, declared)


def check_version_bump(parent: WorkflowDef, child: WorkflowDef, *, rewrite: bool) -> StepIdDiff:
    """Report step ids added, removed and retained from `parent` to `child` (§4.3).

    Raises:
        WorkflowInvalid: the workflow ids differ, or no id is retained and the
            child is not explicitly marked as a rewrite (almost always a
            renumbering accident that would orphan every attributed result).
    """
    if parent.id != child.id:
        raise WorkflowInvalid(f"version bump changes workflow id {parent.id!r} -> {child.id!r}")
    before = frozenset(s.id for s in parent.steps)
    after = frozenset(s.id for s in child.steps)
    diff = StepIdDiff(added=after - before, removed=before - after, retained=before & after)
    if not diff.retained and not rewrite:
        raise WorkflowInvalid(
            f"workflow {child.id!r}: the new version retains none of its parent's step ids "
            f"{sorted(before)}; mark it as a rewrite if that is intended"
        )
    return diff
