"""What each model call of a run had in its context (§10.1), for the episode.

The built-in engine gives a model step one prompt: its template rendered over the task
input and the outputs of steps that ran before it (and a branch's injected plan). So a
call's context is derived from the pinned definition and the attempts in the order they
ran, never copied: each reference the template names is **packed** with its rendered
size; every task field and earlier step output it does not name is **available** and
not packed. The engine renders a template whole and so never **drops** anything to fit
a budget, and its model port takes a prompt without tools, so **tools offered** is
empty: a context packer or a tool-calling model would fill both through the same view.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from assay.kernel.attempts import AttemptState
from assay.messages.episode import AttemptView, ContextRef, ModelContext
from assay.workflow.ir import ModelStep, WorkflowDef
from assay.workflow.templates import TemplateError, placeholders, render

PLAN = "plan"
"""The reference of a branch's injected plan (appended to every model prompt)."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(json.dumps(value, sort_keys=True))


def context_of(
    step: ModelStep,
    task_input: Mapping[str, Any],
    outputs: Mapping[str, str],
    plan: str | None,
) -> ModelContext:
    """One model call's context, given the outputs of the steps that ran before it."""
    scope: dict[str, Any] = {
        "task": dict(task_input),
        "steps": {k: {"output": v, "succeeded": True} for k, v in outputs.items()},
    }
    packed: list[ContextRef] = []
    for path in dict.fromkeys(placeholders(step.prompt)):
        ref = ".".join(path)
        try:
            chars = len(render("{{ " + ref + " }}", scope))
        except TemplateError:
            chars = 0  # named, not there (the attempt failed on it)
        packed.append(ContextRef(ref=ref, chars=chars))
    if plan:
        packed.append(ContextRef(ref=PLAN, chars=len(plan)))
    named = {r.ref for r in packed}

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
    return ModelContext(packed=packed, available=available, dropped=[], tools_offered=[])


def with_contexts(
    wf: WorkflowDef,
    task_input: Mapping[str, Any],
    attempts: Sequence[AttemptView],
    plan: str | None = None,
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
            view = view.model_copy(update={"context": context_of(step, task_input, outputs, plan)})
        out.append(view)
        if view.state is AttemptState.SUCCEEDED and view.output is not None:
            outputs[str(view.step)] = view.output
    return out
