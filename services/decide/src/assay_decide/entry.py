"""Shadow's entry criteria (§12.3): registered, validated, sandbox-clean, profile fits.

Shadow is not free (§12.4): a challenger in shadow re-executes live tasks, tools
included. So a version is admitted only when every tool it calls either has no
effect outside the call or is confined to the sandbox without the network — a
tool that could act on the world (charge a card, push a commit, call an API)
would act again on every replay. Its grading strategy must fit the declared
capacity (§14.2), as ingest checks at registration; decide checks again because
the allocation it publishes carries the definitions ingest runs.

Sub-workflows a version calls are resolved by ingest at spawn and are not seen
here; their own registration was checked the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

from assay.engine import Pure, Tool
from assay.grading.strategies import StrategyRefused, check_fits, profile
from assay.workflow import ToolStep, WorkflowDef
from assay_decide.deciding import Deciding


def replay_unsafe(wf: WorkflowDef, tools: Mapping[str, Tool]) -> list[str]:
    """The tool steps a shadow replay could not keep inside the sandbox."""
    unsafe = []
    for step in wf.steps:
        if not isinstance(step, ToolStep):
            continue
        tool = tools.get(step.tool)
        if tool is None or isinstance(tool.effects, Pure):
            continue  # an unknown tool was refused by validation already
        if tool.needs_network or not tool.needs_sandbox:
            unsafe.append(f"{step.id} ({tool.name})")
    return unsafe


def shadow_refusal(wf: WorkflowDef, deps: Deciding) -> str | None:
    """Why the version cannot enter shadow, or None when it can."""
    unsafe = replay_unsafe(wf, deps.tools)
    if unsafe:
        return (
            "not sandbox-clean: shadow replays would repeat the effects of "
            f"{', '.join(unsafe)} outside the sandbox"
        )
    try:
        check_fits(
            profile(
                wf.grading,
                deps.judge,
                list(wf.rubric),
                order_check=deps.grading.order_check,
                strategies=deps.strategies,
            ),
            deps.grading,
        )
    except StrategyRefused as exc:
        return f"its grading does not fit: {exc}"
    return None
