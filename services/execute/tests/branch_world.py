"""A small world for branch-command tests: a workflow, its tools, a stage, a run.

The workflow fetches (a tool), plans and solves (the stub model), audits the
answer (a tool) and strips it (a built-in tool):

    fetch -> plan -> solve -> check -> answer

so a boundary "after plan" leaves a tool call and a model call in the snapshot,
and a model step and two tool steps after it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from assay.bus import RUN_COMMANDS, RUNS
from assay.engine import BUILTIN_TOOLS, Pure, StubModel, Tool, ToolCall, ToolError
from assay.engine.events import BranchTreeRecorded, Forked, commands_stream
from assay.grading import StubJudge
from assay.kernel import BranchId, StepId, TaskId, TenantId, content_hash, new_run_id
from assay.kernel.schema import Versioned
from assay.messages import BranchChild, BranchRun, Purpose, Role, RunRef, RunSpawned
from assay.messages.branching import AnyDelta
from assay.record import BranchKey, LogRecord
from assay.runtime import StageDeps, StageHarness
from assay.store import FsBlobStore
from assay.store.ports import EventLog
from assay.workflow import WorkflowDef, validate
from assay_execute import create_stage

TENANT = TenantId(uuid.UUID(int=61))
OTHER = TenantId(uuid.UUID(int=62))
TTL_S = 0.6
SOLVE_PROMPT = "Compute {{ task.question }}. Answer with only the number."


@dataclass
class Tools:
    """The world's tools; `audit` fails for a task whose mode is `fail`, and blocks on
    `block_branch` until `release` is set."""

    calls: list[tuple[str, int]] = field(default_factory=list)
    block_branch: int | None = None
    blocked: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def registry(self) -> dict[str, Tool]:
        async def lookup(call: ToolCall) -> str:
            self.calls.append(("lookup", call.branch))
            return f"notes on {call.args['q']}"

        async def audit(call: ToolCall) -> str:
            self.calls.append(("audit", call.branch))
            if call.branch == self.block_branch:
                self.blocked.set()
                await self.release.wait()
            if call.args["mode"] == "fail":
                raise ToolError("the audit failed")
            return f"audited {call.args['x']}"

        return dict(
            BUILTIN_TOOLS,
            lookup=Tool("lookup", lookup, Pure(), "reads notes"),
            audit=Tool("audit", audit, Pure(), "audits an answer"),
        )


def workflow(tools: dict[str, Tool]) -> WorkflowDef:
    return validate(
        WorkflowDef.model_validate(
            {
                "id": "branchy",
                "steps": [
                    {
                        "id": "fetch",
                        "kind": "tool",
                        "tool": "lookup",
                        "args": {"q": "{{ task.question }}"},
                    },
                    {
                        "id": "plan",
                        "kind": "model",
                        "prompt": "Say how you would compute {{ task.question }}.",
                    },
                    {"id": "solve", "kind": "model", "prompt": SOLVE_PROMPT},
                    {
                        "id": "check",
                        "kind": "tool",
                        "tool": "audit",
                        "args": {"x": "{{ steps.solve.output }}", "mode": "{{ task.mode }}"},
                    },
                    {
                        "id": "answer",
                        "kind": "tool",
                        "tool": "strip",
                        "args": {"text": "{{ steps.solve.output }}"},
                    },
                ],
            }
        ),
        frozenset(tools),
    )


def spawned(tools: dict[str, Tool], mode: str = "ok") -> RunSpawned:
    wf = workflow(tools)
    task = {"question": "(5 + 12) * 9", "mode": mode}
    ref = RunRef(
        tenant=TENANT,
        run_id=new_run_id(),
        task_id=TaskId(content_hash(task)),
        idempotency_key="branch-1",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpawned(run=ref, definition=wf.model_dump(mode="json", by_alias=True), input=task)


def stage_for(
    tools: Tools, store: EventLog, where: Path, blobs: FsBlobStore, worker: str = "w"
) -> StageHarness:
    deps = StageDeps(
        blobs=blobs,
        model=StubModel(),
        judge=StubJudge(),
        tools=tools.registry(),
        worker=worker,
        lease_ttl_s=TTL_S,
    )
    return StageHarness(create_stage(deps), blobs, where, log=store)


def branch_of(
    msg: RunSpawned,
    at: str,
    *children: Sequence[AnyDelta],
    branch: int | None = None,
) -> BranchRun:
    return BranchRun(
        tenant=TENANT,
        run_id=msg.run.run_id,
        at_step=StepId(at),
        branch=branch,
        children=[BranchChild(deltas=list(c)) for c in children],
        reason="ablation",
    )


def key_of(msg: RunSpawned, branch: int) -> BranchKey:
    return BranchKey.for_run(TENANT, msg.run.run_id, BranchId(branch))


async def trees(store: EventLog, msg: RunSpawned) -> list[BranchTreeRecorded]:
    records = await store.read(BranchKey.main(TENANT, commands_stream(msg.run.run_id)))
    return [r.event for r in records if isinstance(r.event, BranchTreeRecorded)]


def own_fork(records: list[LogRecord]) -> Forked:
    """A branch's own `Forked`: its last (a fork of a fork copies its parent's first)."""
    return [r.event for r in records if isinstance(r.event, Forked)][-1]


async def run_to_end(stage: StageHarness, msg: RunSpawned) -> None:
    await stage.deliver(RUNS, msg, TENANT)


async def command(stage: StageHarness, msg: Versioned, idem: str | None = None) -> None:
    await stage.deliver(RUN_COMMANDS, msg, TENANT, idem=idem)
