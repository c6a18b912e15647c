"""Branching a run with deltas (DESIGN §13), on SQLite and on Postgres.

A finished run is branched after its `plan` step into children, each with its
deltas; every child is driven to its end, and the lineage — a tree blob, each
child's result blob with its provenance, and `BranchTreeRecorded` in the log —
attributes each child's difference from the parent to a stage.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from assay.cli.runs import find_run, render_text
from assay.engine import AttemptFinished, AttemptStarted, RunFinished
from assay.engine.events import Forked
from assay.messages import (
    BranchChildResult,
    BranchTree,
    CancelRun,
    InjectPlanDelta,
    ModelParamsDelta,
    PromptDelta,
    RewindRun,
    RunBranch,
    RunExecuted,
    ToolUnavailableDelta,
)
from assay.messages.branching import AnyDelta
from assay.store import FsBlobStore
from assay.store.ports import EventLog
from services.execute.tests.branch_world import (
    OTHER,
    TENANT,
    Tools,
    branch_of,
    command,
    key_of,
    own_fork,
    run_to_end,
    spawned,
    stage_for,
    trees,
)


def three_children() -> list[list[AnyDelta]]:
    return [
        [PromptDelta(kind="prompt", step="solve", prompt="Compute {{ task.question }}.")],
        [ToolUnavailableDelta(kind="tool_unavailable", tool="audit")],
        [ModelParamsDelta(kind="model_params", step="solve", max_tokens=64)],
    ]


async def test_three_children_from_one_checkpoint_are_attributed_per_stage(
    work_log: EventLog, tmp_path: Path
) -> None:
    tools, blobs = Tools(), FsBlobStore(tmp_path / "blobs")
    msg = spawned(tools.registry())
    async with stage_for(tools, work_log, tmp_path / "w", blobs) as stage:
        await run_to_end(stage, msg)
        parent = await work_log.read(key_of(msg, 0))
        executed = len([m for m in await stage.emitted() if isinstance(m, RunExecuted)])
        await command(stage, branch_of(msg, "plan", *three_children()))
        assert await stage.dead_letters() == []

        assert await work_log.read(key_of(msg, 0)) == parent  # the parent is kept, unchanged
        (recorded,) = await trees(work_log, msg)
        tree = recorded.tree
        at = tree.boundary.at
        plan_end = max(r.lsn for r in parent if getattr(r.event, "step", None) == "plan")
        assert (tree.boundary.step, tree.boundary.branch, at) == ("plan", 0, plan_end + 1)
        assert [c.branch for c in tree.children] == [1, 2, 3]
        for c in tree.children:
            child = await work_log.read(key_of(msg, c.branch))
            assert [r.event for r in child[:at]] == [r.event for r in parent[:at]]  # one checkpoint
            forked = own_fork(child)
            assert (forked.from_branch, forked.at, forked.child) == (0, at, c.child)
            assert isinstance(child[-1].event, RunFinished)
            # What ran before the boundary is not run again: no new fetch or plan attempt.
            assert not [
                r
                for r in child[at:]
                if isinstance(r.event, AttemptStarted) and r.event.step in ("fetch", "plan")
            ]

        one, two, three = tree.children
        assert one.outcome.status == "succeeded"
        assert (one.diverged_at and one.diverged_at.step) == "solve"
        assert two.outcome.status == "failed"
        assert two.outcome.failed_step == "check"
        assert two.diverged_at is not None
        assert two.diverged_at.step == "check"
        assert two.diverged_at.why == "it failed here and succeeded in the parent"
        assert three.outcome.status == "succeeded"
        assert three.diverged_at is None
        assert [(a.step, a.children) for a in tree.attribution] == [
            ("solve", [1]),
            ("check", [2]),
            (None, [3]),
        ]
        assert tree.parent.status == "succeeded"
        assert one.outcome.output != tree.parent.output
        assert three.outcome.output == tree.parent.output

        # The unavailable tool's attempt failed, saying why; the parent's audit ran.
        failed = [
            r.event
            for r in await work_log.read(key_of(msg, 2))
            if isinstance(r.event, AttemptFinished) and r.event.step == "check"
        ]
        assert failed
        assert all("unavailable on this branch" in (f.error or "") for f in failed)
        assert ("audit", 2) not in tools.calls

        # Each child goes on to verification like any run, marked with its branch,
        # parent and child number.
        emitted = [m for m in await stage.emitted() if isinstance(m, RunExecuted)]
        children = emitted[executed:]
        assert [(m.run.branch, m.episode) for m in children] == [
            (RunBranch(branch=c.branch, parent=0, child=c.child), c.outcome.episode)
            for c in tree.children
        ]
        assert all(m.run.run_id == msg.run.run_id for m in children)

        # The tree and each child's result are blobs of the tenant, with provenance.
        raw = await blobs.get(TENANT, recorded.tree_ref)
        assert raw is not None
        assert BranchTree.model_validate_json(raw) == tree
        for c in tree.children:
            result_raw = await blobs.get(TENANT, c.result)
            assert result_raw is not None
            result = BranchChildResult.model_validate_json(result_raw)
            p = result.provenance
            assert (p.kind, p.run_id, p.branch, p.child) == (
                "assay-branch",
                msg.run.run_id,
                c.branch,
                c.child,
            )
            assert p.workflow_version == msg.run.workflow_version
            assert (p.effective_version == p.workflow_version) == (c.child == 2)
            assert p.deltas == c.deltas
            assert result.outcome == c.outcome
        doc = await stage.state(TENANT, "branching", f"{msg.run.run_id}/{tree.command}")
        assert doc is not None
        assert (doc["tree"], doc["branches"]) == (recorded.tree_ref, [1, 2, 3])


async def test_the_tree_is_the_tenants_alone(work_log: EventLog, tmp_path: Path) -> None:
    tools, blobs = Tools(), FsBlobStore(tmp_path / "blobs")
    msg = spawned(tools.registry())
    async with stage_for(tools, work_log, tmp_path / "w", blobs) as stage:
        await run_to_end(stage, msg)
        await command(stage, branch_of(msg, "plan", three_children()[0]))
        (recorded,) = await trees(work_log, msg)
    assert await blobs.get(TENANT, recorded.tree_ref) is not None
    assert await blobs.get(OTHER, recorded.tree_ref) is None
    assert await blobs.get(OTHER, recorded.tree.children[0].result) is None
    path = tmp_path / "blobs" / str(TENANT) / recorded.tree_ref[:2] / recorded.tree_ref
    assert path.is_file()  # the blob's path carries its tenant
    assert json.loads(path.read_bytes())["tenant"] == str(TENANT)


async def test_an_injected_plan_reaches_every_later_model_prompt(
    work_log: EventLog, tmp_path: Path
) -> None:
    tools, blobs = Tools(), FsBlobStore(tmp_path / "blobs")
    msg = spawned(tools.registry())
    plan = InjectPlanDelta(kind="inject_plan", plan="Work it out step by step.")
    async with stage_for(tools, work_log, tmp_path / "w", blobs) as stage:
        await run_to_end(stage, msg)
        await command(stage, branch_of(msg, "fetch", [plan]))
        child = await work_log.read(key_of(msg, 1))
    at = own_fork(child).at
    prompts: dict[str, str] = {
        r.event.step: r.event.prompt
        for r in child[at:]
        if isinstance(r.event, AttemptStarted) and r.event.prompt is not None
    }
    assert set(prompts) == {"plan", "solve"}
    for prompt in prompts.values():
        assert prompt.startswith("Plan:\nWork it out step by step.\n\n")
    assert prompts["solve"].endswith("Answer with only the number.")


async def test_a_redelivered_command_forks_no_child_twice(
    work_log: EventLog, tmp_path: Path
) -> None:
    """The worker dies while driving child 3; the command comes again to another one."""
    tools, blobs = Tools(block_branch=3), FsBlobStore(tmp_path / "blobs")
    msg = spawned(tools.registry())
    branch = branch_of(msg, "plan", *three_children())
    async with stage_for(tools, work_log, tmp_path / "a", blobs, "worker-a") as a:
        await run_to_end(a, msg)
        dying = asyncio.create_task(command(a, branch, idem="b-1"))
        await tools.blocked.wait()
        dying.cancel()  # SIGKILL: the handler stops where it is
        await asyncio.gather(dying, return_exceptions=True)
        before = [await work_log.read(key_of(msg, n)) for n in (1, 2)]
        assert all(isinstance(b[-1].event, RunFinished) for b in before)  # 1 and 2 had ended
        assert await trees(work_log, msg) == []
    tools.block_branch = None
    async with stage_for(tools, work_log, tmp_path / "b", blobs, "worker-b") as b:
        await asyncio.wait_for(command(b, branch, idem="b-1"), 20)
        await command(b, branch, idem="b-1")  # and once more, after it was handled
        assert await b.dead_letters() == []
    branches = sorted(k.branch for k in await work_log.branches(msg.run.run_id, TENANT))
    assert branches == [0, 1, 2, 3]
    assert [await work_log.read(key_of(msg, n)) for n in (1, 2)] == before  # not driven again
    for n in (1, 2, 3):
        records = await work_log.read(key_of(msg, n))
        forks = [r.event for r in records if isinstance(r.event, Forked)]
        assert len(forks) == 1
        assert forks[0].child == n
        assert sum(isinstance(r.event, RunFinished) for r in records) == 1
    (recorded,) = await trees(work_log, msg)
    assert [c.branch for c in recorded.tree.children] == [1, 2, 3]
    assert recorded.tree.children[1].outcome.failed_step == "check"


async def test_a_rewind_of_a_child_keeps_its_deltas(work_log: EventLog, tmp_path: Path) -> None:
    tools, blobs = Tools(), FsBlobStore(tmp_path / "blobs")
    msg = spawned(tools.registry())
    outage = ToolUnavailableDelta(kind="tool_unavailable", tool="audit")
    async with stage_for(tools, work_log, tmp_path / "w", blobs) as stage:
        await run_to_end(stage, msg)
        await command(stage, branch_of(msg, "plan", [outage]))
        child = await work_log.read(key_of(msg, 1))
        at = own_fork(child).at
        rewind = RewindRun(tenant=TENANT, run_id=msg.run.run_id, at=at + 1, branch=1)
        await command(stage, rewind)
        assert await stage.dead_letters() == []
        again = await work_log.read(key_of(msg, 2))
    end = again[-1].event
    assert isinstance(end, RunFinished)
    assert end.failed_step == "check"  # the audit is still unavailable on the rewound branch
    assert ("audit", 2) not in tools.calls


async def test_runs_show_lists_the_children_and_their_attribution(
    work_log: EventLog, tmp_path: Path
) -> None:
    tools, blobs = Tools(), FsBlobStore(tmp_path / "blobs")
    msg = spawned(tools.registry())
    async with stage_for(tools, work_log, tmp_path / "w", blobs) as stage:
        await run_to_end(stage, msg)
        await command(stage, branch_of(msg, "plan", *three_children()))
    view = await find_run(work_log, msg.run.run_id, TENANT)
    assert view is not None
    (branching,) = view.branchings
    assert [c.branch for c in branching.children] == [1, 2, 3]
    text = render_text(view)
    assert "\n  branched after step plan (branch 0, lsn " in text
    assert "    child 2  branch 2  tool_unavailable:audit  failed at step check" in text
    assert "diverged at check: it failed here and succeeded in the parent" in text
    assert "    child 3  branch 3  model_params:solve(max_tokens=64)  succeeded" in text
    assert "  diverged nowhere" in text
    assert "delta tool_unavailable:audit" in text  # on the child's own branch line


async def test_a_cancel_stops_the_child_being_driven_and_the_ones_after_it(
    work_log: EventLog, tmp_path: Path
) -> None:
    tools, blobs = Tools(block_branch=1), FsBlobStore(tmp_path / "blobs")
    msg = spawned(tools.registry())
    async with stage_for(tools, work_log, tmp_path / "w", blobs) as stage:
        await run_to_end(stage, msg)
        branching = asyncio.create_task(command(stage, branch_of(msg, "plan", *three_children())))
        await tools.blocked.wait()
        await command(stage, CancelRun(tenant=TENANT, run_id=msg.run.run_id, reason="enough"))
        await asyncio.wait_for(branching, 10)
        assert await stage.dead_letters() == []
    (recorded,) = await trees(work_log, msg)
    assert [c.outcome.status for c in recorded.tree.children] == ["cancelled"] * 3
    assert ("audit", 3) not in tools.calls
