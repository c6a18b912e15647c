"""What each model call of a run had in its context (§10.1), for the episode.

The built-in engine gives a model step one prompt: its template rendered over the task
input and the outputs of steps that ran before it (and a branch's injected plan). So a
call's context is derived from the pinned definition and the attempts in the order they
ran, never copied: each reference the template names is **packed** with its rendered
size; every task field and earlier step output it does not name is **available** and
not packed.

A step with a `context_budget_chars` gets a prompt of at most that many characters:
when the whole rendering is longer, whole references are **dropped** — rendered empty —
until it fits, earlier-step references first, in the order the template first names
them (so a template naming outputs in the order the steps ran keeps the latest one
longest), then task fields, the last-named first (the field a prompt leads with is kept
longest). The plan and the template's own text are never dropped; a prompt they alone
make too long is not sent (`Packing.fits`). One function (`pack`) trims for the engine
and for this view, so the episode says exactly what the model was sent.

The tools a step declares are **offered** with the prompt (a branch that made a tool
unavailable offers it no longer); a model port that cannot carry tools (the stub)
receives the prompt alone.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from assay.kernel.attempts import AttemptState
from assay.messages.episode import AttemptView, ContextRef, ModelContext
from assay.workflow.ir import ModelStep, WorkflowDef
from assay.workflow.templates import TemplateError, drop_order, placeholders, render

PLAN = "plan"
"""The reference of a branch's injected plan (appended to every model prompt)."""

PLAN_HEADING = "Plan:"
"""The line a branch's injected plan follows, above the prompt (`with_plan`)."""


def with_plan(prompt: str, plan: str | None) -> str:
    """The prompt a model step sends: the branch's plan (if any) above the rendered prompt.

    The plan is not a template: it is added after rendering, verbatim.
    """
    return prompt if plan is None else f"{PLAN_HEADING}\n{plan}\n\n{prompt}"


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(json.dumps(value, sort_keys=True))


def _ref_chars(ref: str, scope: Mapping[str, Any]) -> int:
    try:
        return len(render("{{ " + ref + " }}", scope))
    except TemplateError:
        return 0  # named, not there (the attempt failed on it)


@dataclass(frozen=True)
class Packing:
    """A model step's prompt as sent, and the references a budget dropped from it.

    `fits` is False when the prompt is still over the step's budget with every
    reference dropped (its own text and the plan are too long): it is not sent.
    """

    prompt: str
    dropped: tuple[ContextRef, ...] = ()
    fits: bool = True


def pack(step: ModelStep, scope: Mapping[str, Any], plan: str | None) -> Packing:
    """The prompt `step` sends over `scope` (the task and earlier outputs) and `plan`,
    within its `context_budget_chars`: whole references dropped in `drop_order`, each
    only while the prompt is still too long. Pure: the same inputs, the same prompt.

    Raises:
        TemplateError: the template names something `scope` does not hold.
    """
    prompt = with_plan(render(step.prompt, scope), plan)
    budget = step.context_budget_chars
    if budget is None or len(prompt) <= budget:
        return Packing(prompt)
    dropped: list[ContextRef] = []
    for ref in drop_order(step.prompt):
        chars = _ref_chars(ref, scope)
        if chars == 0:
            continue  # rendering it empty frees nothing
        dropped.append(ContextRef(ref=ref, chars=chars))
        prompt = with_plan(render(step.prompt, scope, omit={d.ref for d in dropped}), plan)
        if len(prompt) <= budget:
            return Packing(prompt, tuple(dropped))
    return Packing(prompt, tuple(dropped), fits=False)


def context_of(
    step: ModelStep,
    task_input: Mapping[str, Any],
    outputs: Mapping[str, str],
    plan: str | None,
    unavailable_tools: Collection[str] = (),
) -> ModelContext:
    """One model call's context, given the outputs of the steps that ran before it (and
    the tools its branch made unavailable)."""
    scope: dict[str, Any] = {
        "task": dict(task_input),
        "steps": {k: {"output": v, "succeeded": True} for k, v in outputs.items()},
    }
    try:
        dropped = list(pack(step, scope, plan).dropped)
    except TemplateError:
        dropped = []  # the attempt failed on its template: nothing was sent
    gone = {d.ref for d in dropped}
    packed: list[ContextRef] = [
        ContextRef(ref=ref, chars=_ref_chars(ref, scope))
        for ref in dict.fromkeys(".".join(p) for p in placeholders(step.prompt))
        if ref not in gone
    ]
    if plan:
        packed.append(ContextRef(ref=PLAN, chars=len(plan)))
    named = {r.ref for r in packed} | gone

    def used(ref: str) -> bool:
        return any(n == ref or n.startswith(ref + ".") for n in named)

    available = [
        ContextRef(ref=ref, chars=_size(value))
        for ref, value in [
            *((f"task.{k}", v) for k, v in sorted(task_input.items())),
            *((f"steps.{k}.output", v) for k, v in sorted(outputs.items())),
        ]
        if not used(ref)
    ]
    offered = [t for t in step.tools or () if t not in unavailable_tools]
    return ModelContext(packed=packed, available=available, dropped=dropped, tools_offered=offered)


def with_contexts(
    wf: WorkflowDef,
    task_input: Mapping[str, Any],
    attempts: Sequence[AttemptView],
    plan: str | None = None,
    unavailable_tools: Collection[str] = (),
) -> list[AttemptView]:
    """The attempts, each model attempt with its context (outputs of earlier attempts in
    the order they ran are what it could have read)."""
    outputs: dict[str, str] = {}
    out: list[AttemptView] = []
    for view in attempts:
        try:
            step = wf.node(view.step)
        except KeyError:
            step = None  # a step of another version's definition: no context to derive
        if isinstance(step, ModelStep) and view.context is None:
            view = view.model_copy(
                update={"context": context_of(step, task_input, outputs, plan, unavailable_tools)}
            )
        out.append(view)
        if view.state is AttemptState.SUCCEEDED and view.output is not None:
            outputs[str(view.step)] = view.output
    return out
