"""A run with intents and a branch tree, made by a real embedded pipeline: its first step
writes a file (an idempotent tool: its intent goes pending, dispatched, committed), then
the run is branched after that step into two children with hostile labels — one whose
last tool is taken away (it fails there: its first divergence) and one with a shorter
model reply."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from assay.bus.embedded import DeadLetterWatch
from assay.bus.topics import RUN_COMMANDS, TASKS, WORKFLOWS, dlq, producer_entry
from assay.engine import BUILTIN_TOOLS
from assay.engine.events import BranchTreeRecorded, commands_stream
from assay.engine.sandbox_tools import sandbox_tools
from assay.kernel.ids import RunId, StepId, TenantId
from assay.messages import BranchChild, BranchRun, TaskSubmitted, WorkflowRegistered
from assay.messages.envelope import open_envelope
from assay.record.events import BranchKey
from assay.runtime.embedded import Embedded
from assay.workflow import WorkflowDef, validate
from assay_console.reads import ConsoleReads, RunFilters
from assay_ingest.routing import Allocation

WORKFLOW = "write-solve"
WRITE_SOLVE = {
    "id": WORKFLOW,
    "steps": [
        {
            "id": "write",
            "kind": "tool",
            "tool": "write_file",
            "args": {"path": "question.txt", "content": "{{ task.question }}"},
        },
        {"id": "solve", "kind": "model", "prompt": "What is {{ task.question }}?"},
        {
            "id": "tidy",
            "kind": "tool",
            "tool": "strip",
            "args": {"text": "{{ steps.solve.output }}"},
        },
    ],
    "transitions": [{"from": "write", "to": "solve"}, {"from": "solve", "to": "tidy"}],
    "verifiers": [{"id": "tidied", "kind": "regex", "step": "tidy", "pattern": ".+"}],
}
CHILDREN = [
    {"label": "no-strip {hostile}", "deltas": [{"kind": "tool_unavailable", "tool": "strip"}]},
    {
        "label": "short {hostile}",
        "deltas": [{"kind": "model_params", "step": "solve", "max_tokens": 8}],
    },
]


async def _until(found: Any, what: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while (value := await found()) is None:
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout_s:g} s"
        await asyncio.sleep(0.05)  # the bus offers no wake-up for "a stage folded this"
    return value


async def seed_branched_run(
    rt: Embedded, reads: ConsoleReads, tenant: TenantId, key: str, hostile: str
) -> str:
    """Register the workflow for `tenant`, run one task (idempotency key `key`), wait for
    its result, branch it after `write`, and return the run id once the console folded
    the children's results (`rt` runs every stage and the console)."""
    tools = frozenset({*BUILTIN_TOOLS, *sandbox_tools()})
    wf = validate(WorkflowDef.model_validate(WRITE_SOLVE), tools)
    definition = wf.model_dump(mode="json", by_alias=True)
    registered = WorkflowRegistered(tenant=tenant, definition=definition)
    await rt.publish(WORKFLOWS, registered, tenant, idem=f"{tenant}:{wf.version}")
    allocation = Allocation.at(tenant, WORKFLOW)
    await _until(lambda: rt.logs["ingest"].get(allocation), "the allocation", 60)
    task = TaskSubmitted.model_validate(
        {
            "tenant": tenant,
            "workflow_id": WORKFLOW,
            "idempotency_key": key,
            "input": {"question": "(5 + 12) * 9"},
        }
    )
    await rt.publish(TASKS, task, tenant, idem=key)

    async def finished() -> str | None:
        page = await reads.runs(tenant, RunFilters(key=key), None, 1)
        if not page.runs:
            return None
        detail = await reads.run(tenant, page.runs[0].run_id)
        return page.runs[0].run_id if detail is not None and detail.termination else None

    run = str(await _until(finished, "the run's result", 60))
    children = [
        BranchChild.model_validate({**c, "label": str(c["label"]).format(hostile=hostile)})
        for c in CHILDREN
    ]
    command = BranchRun(
        tenant=tenant, run_id=RunId(run), at_step=StepId("write"), children=children
    )
    entry = producer_entry(RUN_COMMANDS, command, tenant, f"branch:{run}:{uuid.uuid4()}")
    sent = open_envelope(entry.value).id
    log = rt.logs["execute"]

    async def tree() -> BranchTreeRecorded | None:
        for r in await log.read(BranchKey.main(tenant, commands_stream(run))):
            if isinstance(r.event, BranchTreeRecorded) and r.event.tree.command == sent:
                return r.event
        return None

    # `rt` is running already (`Embedded.command` would start it again): publish, and
    # watch execute's dead letters for a refusal.
    watch = await DeadLetterWatch.opened(rt.bus, dlq("execute"), sent)
    await rt.bus.publish([entry])

    async def recorded() -> BranchTreeRecorded | None:
        refused = await watch.refused()
        assert refused is None, f"the branch command was refused: {refused}"
        return await tree()

    await _until(recorded, "the branch tree", 120)
    return run
