"""Write-ahead intents (§8.4): Pending → Dispatched → Committed, and crash recovery
by effect class — on SQLite and on Postgres.

A crash is a `ProcessKilled` raised either at a commit (nothing of that commit
lands) or inside the tool (the call did or did not land first). Recovery is a
new driver on a freshly opened store, as after a restart.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest

from assay.bus.topics import RUN_STATUS
from assay.engine import (
    AttemptFinished,
    AttemptStarted,
    Driver,
    Idempotent,
    LogJournal,
    Pure,
    Queryable,
    RunSpec,
    StubModel,
    Tool,
    ToolCall,
    ToolError,
    Unsafe,
)
from assay.engine.driver import MAX_INTERRUPTED
from assay.engine.events import Intent
from assay.engine.tools import EffectClass, idempotency_key
from assay.kernel import (
    AttemptNo,
    AttemptState,
    BranchId,
    IntentState,
    StepId,
    TaskId,
    content_hash,
    new_run_id,
    tenant_id,
)
from assay.kernel.schema import Versioned
from assay.messages import AttemptIndeterminate, Purpose, Role, RolloutRef, RunRef
from assay.record import BranchKey, Event, StateKey
from assay.store.ports import EventLog
from assay.workflow import WorkflowDef

TENANT = tenant_id(uuid.UUID("8b0e7f0c-3a5d-4d55-9c1e-2f7a9b6c4d01"))


class WorkLogs(Protocol):
    """The `work_logs` fixture: reopens the same store, as a restarted worker does."""

    async def open(self) -> EventLog: ...


class ProcessKilled(BaseException):
    """The worker process died here: nothing after this point happened."""


@dataclass
class EffectSink:
    """The outside world: every call that reached it, with its key and request id."""

    calls: list[ToolCall] = field(default_factory=list)

    def effects_by_key(self) -> dict[str | None, int]:
        out: dict[str | None, int] = {}
        for c in self.calls:
            out[c.idempotency_key] = out.get(c.idempotency_key, 0) + 1
        return out

    def landed(self, request_id: str) -> ToolCall | None:
        return next((c for c in self.calls if c.request_id == request_id), None)


@dataclass
class Behaviour:
    """What the tool does on its next calls (consumed in order, then `ok`)."""

    script: list[str] = field(default_factory=list)

    def next(self) -> str:
        return self.script.pop(0) if self.script else "ok"


def effect_tool(name: str, effects: EffectClass, sink: EffectSink, how: Behaviour) -> Tool:
    async def fn(call: ToolCall) -> str:
        step = how.next()
        if step == "die-before":  # the worker dies before the request leaves
            raise ProcessKilled(name)
        if isinstance(effects, Idempotent):
            call.require_key()
        if step == "hang":
            await asyncio.sleep(30)
        if step == "fail":
            raise ToolError("the provider said no")
        sink.calls.append(call)
        if step == "die-after":  # the request landed; the worker died before the answer
            raise ProcessKilled(name)
        if step == "timeout-after":
            await asyncio.sleep(30)
        return f"done:{call.args['item']}"

    return Tool(name, fn, effects, f"test tool ({name})")


def toolset(sink: EffectSink, how: Behaviour) -> dict[str, Tool]:
    async def lookup(call: ToolCall) -> str | None:
        landed = sink.landed(call.request_id)
        return None if landed is None else f"done:{landed.args['item']}"

    return {
        "charge": effect_tool("charge", Unsafe(), sink, how),
        "put": effect_tool("put", Idempotent(key=("item",)), sink, how),
        "order": effect_tool("order", Queryable(lookup=lookup), sink, how),
    }


def one_tool_workflow(tool: str, *, max_attempts: int = 1, timeout_s: float = 5.0) -> WorkflowDef:
    return WorkflowDef.model_validate(
        {
            "id": f"wf-{tool}",
            "steps": [
                {
                    "id": "act",
                    "kind": "tool",
                    "tool": tool,
                    "args": {"item": "{{ task.item }}"},
                    "retry": {"max_attempts": max_attempts},
                    "timeout_s": timeout_s,
                }
            ],
        }
    )


def spec_for(wf: WorkflowDef) -> RunSpec:
    task = {"item": "widget"}
    run_id = new_run_id()
    ref = RunRef(
        tenant=TENANT,
        run_id=run_id,
        task_id=TaskId(content_hash(task)),
        idempotency_key=f"key-{run_id}",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpec(ref=ref, definition=wf, input=task, branch=BranchId(0))


class DyingJournal(LogJournal):
    """Commits `survive` commits, then the process dies at the next one."""

    def __init__(self, log: EventLog, survive: int) -> None:
        super().__init__(log)
        self.survive = survive
        self.commits = 0

    async def record_and_commit(
        self, key: BranchKey, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        if self.commits >= self.survive:
            raise ProcessKilled(f"died before committing {[e.type for e in events]}")
        await super().record_and_commit(key, *events, emits=emits)
        self.commits += 1


async def crash_then_recover(
    logs: WorkLogs, tools: dict[str, Tool], spec: RunSpec, *, survive: int = 10_000
) -> tuple[Any, LogJournal, list[Event]]:
    """Drive until the process dies, then drive again on a reopened store."""
    first = await logs.open()
    with pytest.raises(ProcessKilled):
        await Driver(StubModel(), tools).drive(spec, DyingJournal(first, survive))
    second = await logs.open()
    journal = LogJournal(second)
    episode = await Driver(StubModel(), tools).drive(spec, journal)
    return episode, journal, [r.event for r in await second.read(spec.key)]


def intents(events: list[Event]) -> list[tuple[int, IntentState]]:
    return [(e.attempt, e.state) for e in events if isinstance(e, Intent)]


def finished(events: list[Event]) -> list[tuple[int, AttemptState]]:
    return [(e.attempt, e.state) for e in events if isinstance(e, AttemptFinished)]


P, D, C = IntentState.PENDING, IntentState.DISPATCHED, IntentState.COMMITTED
S, F, X = AttemptState.SUCCEEDED, AttemptState.FAILED, AttemptState.INDETERMINATE


# -- the protocol, live --------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["charge", "put", "order"])
async def test_each_intent_state_is_its_own_commit_before_the_next(
    work_log: EventLog, tool: str
) -> None:
    sink = EffectSink()
    spec = spec_for(one_tool_workflow(tool))
    journal = DyingJournal(work_log, survive=10_000)
    episode = await Driver(StubModel(), toolset(sink, Behaviour())).drive(spec, journal)

    assert episode.succeeded
    assert episode.outputs == {"act": "done:widget"}
    events = [r.event for r in await work_log.read(spec.key)]
    assert [e.type for e in events] == [
        "RunStarted",
        "AttemptStarted",
        "Intent",
        "Intent",
        "Intent",
        "AttemptFinished",
    ]
    assert intents(events) == [(1, P), (1, D), (1, C)]
    # Pending and Dispatched commit alone; Committed rides with the attempt's end.
    assert journal.commits == 5
    assert len(sink.calls) == 1
    doc = await work_log.get(StateKey(TENANT, "intent", f"{spec.ref.run_id}/0/act/1"))
    assert doc == {"state": "committed", "tool": tool, "effect": effect_name_of(tool)}


def effect_name_of(tool: str) -> str:
    return {"charge": "unsafe", "put": "idempotent", "order": "queryable"}[tool]


async def test_pure_tools_write_no_intent(work_log: EventLog) -> None:
    sink = EffectSink()

    async def fn(call: ToolCall) -> str:
        return call.args["item"].upper()

    tools = {"upper": Tool("upper", fn, Pure(), "pure")}
    spec = spec_for(one_tool_workflow("upper"))
    episode = await Driver(StubModel(), tools).drive(spec, LogJournal(work_log))
    assert episode.outputs == {"act": "WIDGET"}
    assert intents([r.event for r in await work_log.read(spec.key)]) == []
    assert sink.calls == []


async def test_idempotent_calls_carry_one_key_across_attempts(work_log: EventLog) -> None:
    sink = EffectSink()
    how = Behaviour(["timeout-after", "ok"])
    spec = spec_for(one_tool_workflow("put", max_attempts=2, timeout_s=0.2))
    episode = await Driver(StubModel(), toolset(sink, how)).drive(spec, LogJournal(work_log))

    assert episode.succeeded
    keys = {c.idempotency_key for c in sink.calls}
    assert len(sink.calls) == 2
    assert len(keys) == 1
    assert None not in keys
    # The timed-out attempt stays Dispatched: the retry under the same key resolved it.
    events = [r.event for r in await work_log.read(spec.key)]
    assert finished(events) == [(1, AttemptState.TIMED_OUT), (2, S)]
    assert intents(events) == [(1, P), (1, D), (2, P), (2, D), (2, C)]


async def test_an_idempotent_call_without_a_derivable_key_is_refused_before_any_intent(
    work_log: EventLog,
) -> None:
    sink = EffectSink()
    wf = WorkflowDef.model_validate(
        {"id": "wf", "steps": [{"id": "act", "kind": "tool", "tool": "put", "args": {}}]}
    )
    spec = spec_for(wf)
    episode = await Driver(StubModel(), toolset(sink, Behaviour())).drive(
        spec, LogJournal(work_log)
    )
    assert not episode.succeeded
    assert "cannot derive the idempotency key" in (episode.attempts[0].error or "")
    assert intents([r.event for r in await work_log.read(spec.key)]) == []
    assert sink.calls == []


def test_the_key_derives_from_the_declared_arguments_only() -> None:
    tool = toolset(EffectSink(), Behaviour())["put"]
    run = new_run_id()
    a = idempotency_key(tool, TENANT, run, StepId("act"), 0, {"item": "x", "note": "1"})
    b = idempotency_key(tool, TENANT, run, StepId("act"), 0, {"item": "x", "note": "2"})
    c = idempotency_key(tool, TENANT, run, StepId("act"), 0, {"item": "y"})
    d = idempotency_key(tool, TENANT, run, StepId("act"), 1, {"item": "x"})
    assert a == b
    assert len({a, c, d}) == 3


def test_an_idempotent_declaration_needs_its_key_derivation() -> None:
    with pytest.raises(ValueError, match="argument names"):
        Idempotent(key=())


async def test_a_tool_that_answers_with_a_failure_commits_the_intent_and_may_retry(
    work_log: EventLog,
) -> None:
    sink = EffectSink()
    spec = spec_for(one_tool_workflow("charge", max_attempts=2))
    episode = await Driver(StubModel(), toolset(sink, Behaviour(["fail"]))).drive(
        spec, LogJournal(work_log)
    )
    assert episode.succeeded
    events = [r.event for r in await work_log.read(spec.key)]
    assert finished(events) == [(1, F), (2, S)]
    assert intents(events) == [(1, P), (1, D), (1, C), (2, P), (2, D), (2, C)]
    assert len(sink.calls) == 1


async def test_an_unsafe_call_without_an_answer_is_indeterminate_live(work_log: EventLog) -> None:
    sink = EffectSink()
    spec = spec_for(one_tool_workflow("charge", max_attempts=3, timeout_s=0.2))
    journal = LogJournal(work_log)
    episode = await Driver(StubModel(), toolset(sink, Behaviour(["timeout-after"]))).drive(
        spec, journal
    )
    assert not episode.succeeded
    assert [a.state for a in episode.attempts] == [X]  # never retried, whatever the policy
    alerts = [m for topic, m in journal.emitted if isinstance(m, AttemptIndeterminate)]
    assert [(a.step, a.attempt, a.tool) for a in alerts] == [("act", 1, "charge")]
    assert all(topic == RUN_STATUS for topic, m in journal.emitted if m in alerts)
    run_doc = await work_log.get(StateKey(TENANT, "run", spec.ref.run_id))
    assert run_doc is not None
    assert run_doc["indeterminate"] is True


# -- recovery after a crash, by the last committed intent state ---------------------------


@pytest.mark.parametrize("tool", ["charge", "put", "order"])
async def test_a_crash_before_pending_or_dispatched_is_retried_freely(
    work_logs: WorkLogs, tool: str
) -> None:
    for survive in (2, 3):  # dies committing Pending / committing Dispatched
        sink = EffectSink()
        spec = spec_for(one_tool_workflow(tool))
        episode, _, events = await crash_then_recover(
            work_logs, toolset(sink, Behaviour()), spec, survive=survive
        )
        assert episode.succeeded, survive
        assert len(sink.calls) == 1  # the first attempt never reached the outside world
        assert finished(events) == [(1, F), (2, S)]
        assert episode.attempts[0].error is not None


async def test_idempotent_dispatched_is_retried_under_the_same_key(work_logs: WorkLogs) -> None:
    sink = EffectSink()
    spec = spec_for(one_tool_workflow("put"))
    episode, _, events = await crash_then_recover(
        work_logs, toolset(sink, Behaviour(["die-after"])), spec
    )
    assert episode.succeeded
    assert len(sink.calls) == 2
    assert list(sink.effects_by_key().values()) == [2]  # one key: the provider dedupes
    assert sink.calls[0].request_id == sink.calls[1].request_id
    assert finished(events) == [(1, S)]  # the same attempt, resumed
    committed = [e for e in events if isinstance(e, Intent) and e.state is C]
    assert committed[0].resolved_by == "retried under the same idempotency key"


async def test_queryable_dispatched_that_landed_is_completed_by_lookup(
    work_logs: WorkLogs,
) -> None:
    sink = EffectSink()
    spec = spec_for(one_tool_workflow("order"))
    episode, _, events = await crash_then_recover(
        work_logs, toolset(sink, Behaviour(["die-after"])), spec
    )
    assert episode.succeeded
    assert episode.outputs == {"act": "done:widget"}
    assert len(sink.calls) == 1  # asked, not called again
    committed = [e for e in events if isinstance(e, Intent) and e.state is C]
    assert committed[0].resolved_by == "lookup"


async def test_queryable_dispatched_that_never_landed_is_dispatched_again(
    work_logs: WorkLogs,
) -> None:
    sink = EffectSink()
    spec = spec_for(one_tool_workflow("order"))
    episode, _, events = await crash_then_recover(
        work_logs, toolset(sink, Behaviour(["die-before"])), spec
    )
    assert episode.succeeded
    assert len(sink.calls) == 1
    committed = [e for e in events if isinstance(e, Intent) and e.state is C]
    assert committed[0].resolved_by == "lookup: not landed, dispatched again"


@pytest.mark.parametrize("how", ["die-before", "die-after"])
async def test_unsafe_dispatched_is_indeterminate_and_never_retried(
    work_logs: WorkLogs, how: str
) -> None:
    sink = EffectSink()
    spec = spec_for(one_tool_workflow("charge", max_attempts=3))
    episode, journal, events = await crash_then_recover(
        work_logs, toolset(sink, Behaviour([how])), spec
    )
    assert not episode.succeeded
    assert episode.failed_step == "act"
    assert finished(events) == [(1, X)]
    assert intents(events) == [(1, P), (1, D)]  # nobody knows: it stays Dispatched
    assert len(sink.calls) == (1 if how == "die-after" else 0)
    alerts = [m for _, m in journal.emitted if isinstance(m, AttemptIndeterminate)]
    assert len(alerts) == 1
    assert "never resolved" in alerts[0].reason
    # Driving it again changes nothing: the unknown stays recorded, nothing is retried.
    log = await work_logs.open()
    again = LogJournal(log)
    await Driver(StubModel(), toolset(sink, Behaviour())).drive(spec, again)
    assert [r.event for r in await log.read(spec.key)] == events
    assert again.emitted == []


async def test_a_finished_attempt_is_never_recovered_again(work_logs: WorkLogs) -> None:
    sink = EffectSink()
    spec = spec_for(one_tool_workflow("charge"))
    log = await work_logs.open()
    await Driver(StubModel(), toolset(sink, Behaviour())).drive(spec, LogJournal(log))
    before = [r.event for r in await log.read(spec.key)]
    reopened = await work_logs.open()
    await Driver(StubModel(), toolset(sink, Behaviour())).drive(spec, LogJournal(reopened))
    assert [r.event for r in await reopened.read(spec.key)] == before
    assert len(sink.calls) == 1


async def test_a_pure_call_that_kills_every_worker_ends_failed_as_interrupted(
    work_logs: WorkLogs,
) -> None:
    """A Pure step's first death leaves nothing on record; every restart after it writes
    the step's start ahead, so each later death is on record and closed as interrupted
    (appended, never edited): after MAX_INTERRUPTED of them the step fails and the run
    ends, as an Unsafe step's would."""
    calls = 0

    async def poison(call: ToolCall) -> str:
        nonlocal calls
        calls += 1
        raise ProcessKilled("the call killed the worker")

    tools = {"poison": Tool("poison", poison, Pure(), "kills its worker")}
    spec = spec_for(one_tool_workflow("poison", max_attempts=10))
    written: list[list[Event]] = []
    for _ in range(MAX_INTERRUPTED + 1):
        log = await work_logs.open()
        with pytest.raises(ProcessKilled):
            await Driver(StubModel(), tools).drive(spec, LogJournal(log))
        events = [r.event for r in await log.read(spec.key)]
        assert events[: len(written[-1]) if written else 0] == (written[-1] if written else [])
        written.append(events)
    assert [e.type for e in written[0]] == ["RunStarted"]  # the first death: no trace
    log = await work_logs.open()
    episode = await Driver(StubModel(), tools).drive(spec, LogJournal(log))

    assert not episode.succeeded
    assert episode.failed_step == "act"
    assert calls == MAX_INTERRUPTED + 1
    events = [r.event for r in await log.read(spec.key)]
    assert finished(events) == [(n, F) for n in range(1, MAX_INTERRUPTED + 1)]
    assert all(e.interrupted for e in events if isinstance(e, AttemptFinished))
    assert all(events[: len(w)] == w for w in written)  # nothing recorded was edited


def test_attempt_started_records_the_arguments_recovery_needs() -> None:
    started = AttemptStarted(
        step=StepId("act"), attempt=AttemptNo(1), iteration=0, args={"item": "x"}
    )
    assert started.args == {"item": "x"}


async def test_a_rollout_siblings_model_calls_stop_at_its_cap(work_log: EventLog) -> None:
    wf = WorkflowDef.model_validate(
        {
            "id": "wf-model",
            "steps": [
                {"id": "ask", "kind": "model", "prompt": "first"},
                {"id": "again", "kind": "model", "prompt": "second"},
            ],
        }
    )
    spec = spec_for(wf)
    capped = spec.ref.model_copy(
        update={
            "rollout": RolloutRef(group="g", index=0, size=2, mode="evaluation", max_model_calls=1)
        }
    )
    spec = RunSpec(ref=capped, definition=wf, input=spec.input, branch=spec.branch)
    episode = await Driver(StubModel(), {}).drive(spec, LogJournal(work_log))
    assert [(a.step, a.state) for a in episode.attempts] == [
        ("ask", AttemptState.SUCCEEDED),
        ("again", AttemptState.FAILED),
    ]
    assert episode.attempts[1].error == "the run's model-call budget is spent"
    assert episode.usage.model_calls == 1


async def test_a_rollout_siblings_token_cap_refuses_a_call_it_cannot_cover(
    work_log: EventLog,
) -> None:
    wf = WorkflowDef.model_validate(
        {
            "id": "wf-tokens",
            "steps": [{"id": "ask", "kind": "model", "prompt": "hello", "max_tokens": 8}],
        }
    )
    spec = spec_for(wf)
    capped = spec.ref.model_copy(
        update={"rollout": RolloutRef(group="g", index=0, size=2, mode="evaluation", max_tokens=12)}
    )
    spec = RunSpec(ref=capped, definition=wf, input=spec.input, branch=spec.branch)
    episode = await Driver(StubModel(), {}).drive(spec, LogJournal(work_log))
    (attempt,) = episode.attempts  # 5 prompt bytes + 8 completion tokens > 12
    assert attempt.state is AttemptState.FAILED
    assert attempt.error is not None
    assert "token budget (12) cannot cover this call" in attempt.error
    assert episode.usage.model_calls == 0


async def test_a_shadow_run_calls_no_unsafe_tool_outside_its_sandbox(work_log: EventLog) -> None:
    """Shadow replay re-executes a task the current version served: its effects would repeat."""
    sink = EffectSink()
    spec = spec_for(one_tool_workflow("charge"))
    shadow = spec.ref.model_copy(update={"purpose": Purpose.SHADOW, "role": Role.CHALLENGER})
    spec = RunSpec(ref=shadow, definition=spec.definition, input=spec.input, branch=spec.branch)
    driver = Driver(StubModel(), toolset(sink, Behaviour()))
    (attempt,) = (await driver.drive(spec, LogJournal(work_log))).attempts
    assert attempt.state is AttemptState.FAILED
    assert sink.calls == []
    idempotent = spec_for(one_tool_workflow("put"))  # an idempotent effect is not refused
    idempotent = RunSpec(
        ref=idempotent.ref.model_copy(update={"purpose": Purpose.SHADOW}),
        definition=idempotent.definition,
        input=idempotent.input,
        branch=idempotent.branch,
    )
    (put,) = (await driver.drive(idempotent, LogJournal(work_log))).attempts
    assert put.state is AttemptState.SUCCEEDED
