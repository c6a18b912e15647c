"""A rollout sibling stages its unsafe external writes instead of making them (DESIGN §13),
on SQLite and on Postgres: the staged record, what the agent sees, and recovery."""

from __future__ import annotations

import json

from assay.engine import Driver, LogJournal, RunSpec, StubModel, Tool, ToolCall, Unsafe
from assay.engine.events import AttemptFinished, AttemptStarted, Intent
from assay.engine.staging import EffectStaged, args_hash, effect_key, stageable, staged_output
from assay.kernel import AttemptState, BranchId, StepId
from assay.messages import RolloutRef
from assay.record import StateKey
from assay.store.ports import EventLog
from libs.assay.tests.test_intents import (
    TENANT,
    Behaviour,
    EffectSink,
    ProcessKilled,
    WorkLogs,
    crash_then_recover,
    one_tool_workflow,
    spec_for,
    toolset,
)


def sibling(tool: str, index: int = 0, *, max_attempts: int = 1) -> RunSpec:
    spec = spec_for(one_tool_workflow(tool, max_attempts=max_attempts))
    ref = spec.ref.model_copy(
        update={"rollout": RolloutRef(group="g", index=index, size=2, mode="best_of_n")}
    )
    return RunSpec(ref=ref, definition=spec.definition, input=spec.input, branch=spec.branch)


async def test_a_siblings_unsafe_external_call_is_staged_not_made(work_log: EventLog) -> None:
    sink = EffectSink()
    spec = sibling("charge")
    episode = await Driver(StubModel(), toolset(sink, Behaviour())).drive(
        spec, LogJournal(work_log)
    )
    assert sink.calls == []  # nothing left the sandbox
    (attempt,) = episode.attempts
    assert attempt.state is AttemptState.SUCCEEDED
    key = effect_key(spec, StepId("act"), 0, "charge")
    assert attempt.output == staged_output("charge", key)
    assert json.loads(attempt.output) == {"effect_key": key, "staged": "charge"}
    events = [r.event for r in await work_log.read(spec.key)]
    assert [e.type for e in events] == [
        "RunStarted",
        "AttemptStarted",
        "EffectStaged",
        "AttemptFinished",
    ]
    assert not any(isinstance(e, Intent) for e in events)  # no intent: nothing dispatched
    started = next(e for e in events if isinstance(e, AttemptStarted))
    staged = next(e for e in events if isinstance(e, EffectStaged))
    assert staged.tool == "charge"
    assert staged.effect_key == key
    assert started.args is not None
    assert staged.args_hash == args_hash(started.args) == args_hash({"item": "widget"})
    doc = await work_log.get(StateKey(TENANT, "staged-effect", f"{spec.ref.run_id}/0/{key}"))
    assert doc is not None
    assert doc["state"] == "staged"


async def test_the_effect_key_is_per_run_step_and_iteration() -> None:
    a, b = sibling("charge", 0), sibling("charge", 1)
    assert effect_key(a, StepId("act"), 0, "charge") == effect_key(a, StepId("act"), 0, "charge")
    assert effect_key(a, StepId("act"), 0, "charge") != effect_key(b, StepId("act"), 0, "charge")
    assert effect_key(a, StepId("act"), 0, "charge") != effect_key(a, StepId("act"), 1, "charge")


async def test_a_crash_at_the_staging_commit_stages_once_after_recovery(
    work_logs: WorkLogs,
) -> None:
    """Dying at the commit of the staged record leaves the attempt started and nothing
    staged; recovery closes it as interrupted and the next attempt stages the same key."""
    sink = EffectSink()
    spec = sibling("charge", max_attempts=2)
    episode, _, events = await crash_then_recover(
        work_logs, toolset(sink, Behaviour()), spec, survive=2
    )
    assert sink.calls == []
    staged = [e for e in events if isinstance(e, EffectStaged)]
    assert len(staged) == 1
    assert staged[0].attempt == 2
    ends = [(e.attempt, e.state) for e in events if isinstance(e, AttemptFinished)]
    assert ends == [(1, AttemptState.FAILED), (2, AttemptState.SUCCEEDED)]
    assert episode.succeeded


async def test_a_redrive_after_staging_replays_it_and_stages_nothing_more(
    work_log: EventLog,
) -> None:
    sink = EffectSink()
    spec = sibling("charge")
    tools = toolset(sink, Behaviour())
    first = await Driver(StubModel(), tools).drive(spec, LogJournal(work_log))
    before = [r.event for r in await work_log.read(spec.key)]
    again = await Driver(StubModel(), tools).drive(spec, LogJournal(work_log))
    assert [r.event for r in await work_log.read(spec.key)] == before
    assert again.attempts == first.attempts
    assert sink.calls == []


def test_what_is_staged_and_what_still_fails() -> None:
    async def call(c: ToolCall) -> str:
        raise ProcessKilled("never called")

    external = Tool("post", call, Unsafe(), "posts", needs_network=True)
    workspace = Tool("run", call, Unsafe(), "runs here", needs_sandbox=True, needs_network=True)
    spec = sibling("charge")
    assert stageable(spec, external)
    assert not stageable(spec, workspace)  # its publication would run outside the workspace
    plain = spec_for(one_tool_workflow("charge"))
    assert not stageable(plain, external)  # not a sibling: the call is made
    fork = RunSpec(ref=spec.ref, definition=spec.definition, input=spec.input, branch=BranchId(1))
    assert not stageable(fork, external)  # a fork of a sibling is never selected
    child = RunSpec(
        ref=spec.ref,
        definition=spec.definition,
        input=spec.input,
        branch=spec.branch,
        stream=f"{spec.ref.run_id}/sub/x",
    )
    assert not stageable(child, external)


async def test_a_siblings_unsafe_call_that_needs_its_workspace_still_fails(
    work_log: EventLog,
) -> None:
    sink = EffectSink()
    tools = toolset(sink, Behaviour())
    inner = tools["charge"]
    tools["charge"] = Tool(
        "charge", inner.fn, Unsafe(), "charges", needs_sandbox=True, needs_network=True
    )
    spec = sibling("charge")
    (attempt,) = (await Driver(StubModel(), tools).drive(spec, LogJournal(work_log))).attempts
    assert attempt.state is AttemptState.FAILED
    assert attempt.error is not None
    assert "has unsafe effects outside the sandbox" in attempt.error
    assert sink.calls == []
