"""Load-time checks on the IR (§4.3, DESIGN §8). A new format inherits all of them."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

from assay.kernel.errors import AssayError
from assay.kernel.ids import StepId
from assay.workflow.expr import ExprSyntaxError, StepRef, parse
from assay.workflow.graph import ControlGraph
from assay.workflow.ir import (
    BUILTIN_VERIFIER_KINDS,
    LATEST,
    AwaitStep,
    ConditionalStep,
    ModelStep,
    ParallelStep,
    SubworkflowStep,
    ToolStep,
    Transition,
    VerifierSpec,
    WorkflowDef,
)
from assay.workflow.templates import fixed_chars, malformed, placeholders

MIN_AWAIT_TIMEOUT_S: Final = 1.0
"""Shortest wait an await step may declare, in seconds."""

MAX_AWAIT_TIMEOUT_S: Final = 30 * 24 * 3600.0
"""Longest wait an await step may declare: thirty days."""

BRANCH_KINDS: Final = ("model", "tool", "subworkflow")
"""Kinds a parallel branch may have: steps that do one self-contained piece of work."""


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

    For the control kinds: a conditional's targets exist, and each condition
    parses and refers only to steps that can have run before it; a parallel
    step's branches exist, are model, tool or subworkflow steps, belong to it
    alone, are entered from nowhere else and lead nowhere, and its quorum fits;
    templates of branches and sub-workflow inputs refer only to steps that can
    have run before them; a sub-workflow does not call its own `latest`; an
    await step's timeout lies within bounds. Cycles across workflows are
    `check_subworkflows`'s to find.
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
    _check_control_kinds(wf, declared, edges)
    _check_out_degree(wf, edges)
    graph = ControlGraph.of(wf)
    _check_acyclic(wf, {s: list(t) for s, t in graph.unbounded.items()})
    _check_reachable(wf, graph)
    for step in wf.steps:
        before = graph.ancestors(step.id)
        if isinstance(step, ModelStep | ToolStep):
            texts = [step.prompt] if isinstance(step, ModelStep) else list(step.args.values())
            # A branch runs beside its siblings: it may use only what ran before the fan-out.
            scope = before if step.id in graph.owners else None
            _check_templates(wf, step.id, texts, declared, scope)
        elif isinstance(step, SubworkflowStep):
            _check_templates(wf, step.id, list(step.input.values()), declared, before)
        elif isinstance(step, ConditionalStep):
            _check_conditions(wf, step, declared, before)
        if known_tools is not None and isinstance(step, ToolStep) and step.tool not in known_tools:
            raise WorkflowInvalid(
                f"workflow {wf.id!r}: step {step.id!r} uses unknown tool "
                f"{step.tool!r} (known: {sorted(known_tools)})"
            )
        if isinstance(step, ModelStep):
            _check_model_step(wf, step, known_tools)
    if wf.output is not None and wf.output not in declared:
        raise WorkflowInvalid(f"workflow {wf.id!r}: output names unknown step {wf.output!r}")
    _check_verifiers(wf, declared, BUILTIN_VERIFIER_KINDS | (known_verifiers or frozenset()))
    rubric_ids = [r.id for r in wf.rubric]
    if len(set(rubric_ids)) != len(rubric_ids):
        raise WorkflowInvalid(f"workflow {wf.id!r}: duplicate rubric ids")
    return wf


def _check_model_step(wf: WorkflowDef, step: ModelStep, known_tools: frozenset[str] | None) -> None:
    """The tools a model step offers are registered, once each; its context budget holds
    at least its template's own text (which no budget can drop)."""
    where = f"workflow {wf.id!r}: step {step.id!r}"
    offered = step.tools or []
    twice = sorted({t for t in offered if offered.count(t) > 1})
    if twice:
        raise WorkflowInvalid(f"{where} offers tool(s) {twice} more than once")
    for tool in offered:
        if known_tools is not None and tool not in known_tools:
            raise WorkflowInvalid(
                f"{where} offers unknown tool {tool!r} to the model (known: {sorted(known_tools)})"
            )
    budget = step.context_budget_chars
    if budget is not None and (fixed := fixed_chars(step.prompt)) > budget:
        raise WorkflowInvalid(
            f"{where}: context_budget_chars {budget} is less than the {fixed} characters of "
            "its prompt's own text, which no budget can drop"
        )


def _check_control_kinds(wf: WorkflowDef, declared: set[StepId], edges: list[Transition]) -> None:
    owners: dict[StepId, StepId] = {}
    for step in wf.steps:
        where = f"workflow {wf.id!r}: step {step.id!r}"
        if isinstance(step, ConditionalStep):
            targets = [(f"branch {i}", b.to) for i, b in enumerate(step.branches, 1)]
            if step.otherwise is not None:
                targets.append(("otherwise", step.otherwise))
            for label, target in targets:
                if target not in declared:
                    raise WorkflowInvalid(f"{where}: {label} goes to unknown step {target!r}")
        elif isinstance(step, ParallelStep):
            _check_parallel(wf, step, declared, owners)
        elif isinstance(step, SubworkflowStep):
            if step.workflow == wf.id and step.version == LATEST:
                raise WorkflowInvalid(
                    f"{where} calls its own workflow at latest, a cycle; pin an exact version"
                )
        elif isinstance(step, AwaitStep) and not (
            MIN_AWAIT_TIMEOUT_S <= step.timeout_s <= MAX_AWAIT_TIMEOUT_S
        ):
            raise WorkflowInvalid(
                f"{where}: timeout_s {step.timeout_s:g} is outside "
                f"{MIN_AWAIT_TIMEOUT_S:.0f}..{MAX_AWAIT_TIMEOUT_S:.0f} seconds"
            )
    entry = wf.steps[0].id
    for branch, parallel in owners.items():
        where = f"workflow {wf.id!r}: parallel step {parallel!r} branch {branch!r}"
        if branch == entry:
            raise WorkflowInvalid(f"{where} is the workflow's entry; a branch starts only there")
        for e in edges:
            if branch in (e.source, e.target):
                raise WorkflowInvalid(
                    f"{where} has the transition {e.source} -> {e.target}; a branch is entered "
                    "only from its parallel step and leads nowhere (the parallel step's "
                    "transitions continue after the join)"
                )
        for step in wf.steps:
            if isinstance(step, ConditionalStep) and (
                branch == step.otherwise or any(b.to == branch for b in step.branches)
            ):
                raise WorkflowInvalid(
                    f"{where} is a target of conditional step {step.id!r}; a branch is "
                    "entered only from its parallel step"
                )


def _check_parallel(
    wf: WorkflowDef, step: ParallelStep, declared: set[StepId], owners: dict[StepId, StepId]
) -> None:
    where = f"workflow {wf.id!r}: parallel step {step.id!r}"
    for b in step.branches:
        if b not in declared:
            raise WorkflowInvalid(f"{where} has unknown branch step {b!r}")
        if b == step.id:
            raise WorkflowInvalid(f"{where} lists itself as a branch")
        if b in owners:
            other = owners[b]
            again = "twice" if other == step.id else f"and also in parallel step {other!r}"
            raise WorkflowInvalid(f"{where} lists branch {b!r} {again}")
        kind = wf.node(b).kind
        if kind not in BRANCH_KINDS:
            raise WorkflowInvalid(
                f"{where}: branch {b!r} has kind {kind!r}; a branch is a "
                f"{', '.join(BRANCH_KINDS[:-1])} or {BRANCH_KINDS[-1]} step"
            )
        owners[b] = step.id
    n = len(step.branches)
    if step.join == "quorum":
        if step.quorum is None:
            raise WorkflowInvalid(f"{where}: join quorum needs `quorum` (1..{n})")
        if not 1 <= step.quorum <= n:
            raise WorkflowInvalid(
                f"{where}: quorum {step.quorum} is outside 1..{n} (it has {n} branches)"
            )
    elif step.quorum is not None:
        raise WorkflowInvalid(f"{where}: `quorum` is set but join is {step.join!r}")


def _check_conditions(
    wf: WorkflowDef, step: ConditionalStep, declared: set[StepId], before: frozenset[StepId]
) -> None:
    for i, branch in enumerate(step.branches, 1):
        where = f"workflow {wf.id!r}: step {step.id!r} branch {i}"
        try:
            expr = parse(branch.when)
        except ExprSyntaxError as exc:
            shown = branch.when if len(branch.when) <= 60 else branch.when[:57] + "..."
            raise WorkflowInvalid(f"{where}: condition {shown!r} does not parse: {exc}") from exc
        refs = sorted((r for r in expr.references() if isinstance(r, StepRef)), key=str)
        for ref in refs:
            if ref.step not in declared:
                raise WorkflowInvalid(f"{where}: condition refers to unknown step {ref.step!r}")
            if ref.step not in before:
                raise WorkflowInvalid(
                    f"{where}: condition refers to '{ref}', but step {ref.step!r} cannot "
                    "have run before it"
                )


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
        if out and isinstance(step, ConditionalStep) and step.otherwise is not None:
            raise WorkflowInvalid(
                f"workflow {wf.id!r}: conditional step {step.id!r} has `otherwise` and the "
                f"transition {step.id} -> {out[0].target}, which would never be taken; a "
                "conditional's transitions apply only when `otherwise` is null"
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


def _check_reachable(wf: WorkflowDef, graph: ControlGraph) -> None:
    seen = graph.reachable(wf.steps[0].id)
    unreachable = [s.id for s in wf.steps if s.id not in seen]
    if unreachable:
        raise WorkflowInvalid(
            f"workflow {wf.id!r}: steps {unreachable} are unreachable from entry {wf.steps[0].id!r}"
        )


def _check_templates(
    wf: WorkflowDef,
    step_id: StepId,
    texts: list[str],
    declared: set[StepId],
    before: Collection[StepId] | None,
) -> None:
    for text in texts:
        bad = malformed(text)
        if bad:
            raise WorkflowInvalid(
                f"workflow {wf.id!r}: step {step_id!r} has a malformed placeholder {bad[0]!r}; "
                "write {{ task.<field> }} or {{ steps.<id>.output }}"
            )
        for path in placeholders(text):
            _check_path(wf, f"step {step_id!r}", path, declared, before)


def _check_template(wf: WorkflowDef, where: str, text: str, declared: set[StepId]) -> None:
    bad = malformed(text)
    if bad:
        raise WorkflowInvalid(
            f"workflow {wf.id!r}: {where} has a malformed placeholder {bad[0]!r}; "
            "write {{ task.<field> }} or {{ steps.<id>.output }}"
        )
    for path in placeholders(text):
        _check_path(wf, where, path, declared)


def _check_path(
    wf: WorkflowDef,
    where: str,
    path: tuple[str, ...],
    declared: set[StepId],
    before: Collection[StepId] | None = None,
) -> None:
    """`before`, when given, holds the steps that can have run before the template is used."""
    if path[0] == "task":
        return
    if path[0] == "steps" and len(path) == 3 and path[2] == "output" and path[1] in declared:
        if before is None or path[1] in before:
            return
        raise WorkflowInvalid(
            f"workflow {wf.id!r}: {where} refers to {'.'.join(path)!r}, but step {path[1]!r} "
            "cannot have run before it"
        )
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
        elif v.kind == "context":
            _check_context(wf, where, v, declared)
        elif v.kind == "command":
            if not v.argv or not v.argv[0].strip():
                raise WorkflowInvalid(
                    f"workflow {wf.id!r}: {where} (command) needs a non-empty `argv`"
                )
            for arg in v.argv:
                _check_template(wf, where, arg, declared)


def _check_context(wf: WorkflowDef, where: str, v: VerifierSpec, declared: set[StepId]) -> None:
    """A context verifier names what it expects, of a model step, in references a model
    call can have."""
    e = v.expect
    if e is None or not (e.packed or e.tools_offered or e.dropped or e.max_dropped is not None):
        raise WorkflowInvalid(
            f"workflow {wf.id!r}: {where} (context) needs `expect` with `packed`, "
            "`tools_offered`, `dropped` or `max_dropped`"
        )
    checked = wf.node(v.step) if v.step is not None else None
    if v.step is not None and not isinstance(checked, ModelStep):
        raise WorkflowInvalid(f"workflow {wf.id!r}: {where} (context) checks a model step")
    for ref in [*e.packed, *(e.dropped or [])]:
        if ref == "plan":
            continue
        _check_path(wf, where, tuple(ref.split(".")), declared)
    if e.dropped:
        if "plan" in e.dropped:
            raise WorkflowInvalid(
                f"workflow {wf.id!r}: {where} (context) expects the plan dropped; no budget "
                "drops it"
            )
        steps = [checked] if isinstance(checked, ModelStep) else wf.steps
        if not any(isinstance(s, ModelStep) and s.context_budget_chars for s in steps):
            raise WorkflowInvalid(
                f"workflow {wf.id!r}: {where} (context) expects references dropped, and "
                f"{'its step declares no' if checked is not None else 'no model step declares'}"
                " context_budget_chars"
            )


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
