"""Stateful properties of cancel and rewind over the run lifecycle (§5.1, §5.2, §8.4,
§8.5), on SQLite and on Postgres.

A Hypothesis state machine drives the execute stage through two runs of one small
workflow — a pure tool step, a conditional on its output, an unsafe tool step, an
await step, then another pure tool step — whose every tool call waits until a rule
lets it answer or fail. Rules interleave spawns, answers, cancels, signals, rewinds
at any LSN of any branch, redeliveries of any earlier message, and crashes of the
stage's process (the next one gets what was unfinished). Messages for one run on one
topic are handled one after another, as a partition's consumer would; different
topics at once. After every rule the stage is left to settle (each handler has ended
or waits in a tool call) and the record is checked from the store alone — its log
and its derived documents — and from what the stage emitted.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from assay.bus import RUN_COMMANDS, RUNS
from assay.bus.topics import producer_entry
from assay.devstack.base import Service
from assay.devstack.postgres import scratch_database
from assay.engine import (
    BUILTIN_TOOLS,
    AttemptFinished,
    AttemptStarted,
    EffectClass,
    Pure,
    RunFinished,
    RunStarted,
    StubModel,
    Tool,
    ToolCall,
    ToolError,
    Unsafe,
)
from assay.engine.events import Forked, Intent, RunCancelled
from assay.grading import StubJudge
from assay.kernel import (
    AttemptState,
    BranchId,
    IntentState,
    RunState,
    TaskId,
    TenantId,
    attempt_transition,
    content_hash,
    intent_transition,
    new_run_id,
    run_transition,
)
from assay.kernel.canonical import digest
from assay.kernel.schema import Versioned
from assay.messages import (
    CancelRun,
    Purpose,
    RewindRun,
    Role,
    RunExecuted,
    RunRef,
    RunResult,
    RunSpawned,
    RunStatusChanged,
    SignalRun,
    open_envelope,
)
from assay.record import BranchKey, LogRecord
from assay.runtime import StageDeps, StageHarness, StageSpec
from assay.store import SqliteEventLog
from assay.store.ports import EventLog
from assay.store.postgres import PostgresEventLog
from assay.workflow import WorkflowDef, validate
from assay_execute import create_stage

TENANT = TenantId(uuid.UUID(int=93))
RUNS_PER_EXAMPLE = 2
SETTLE_S = 15.0
TTL_S = 0.15
"""Short, so that a restarted stage takes its dead predecessor's runs over soon."""
MAX_CRASHES = 2
YIELDS = 50
"""Turns of the event loop a settled stage must stay settled for."""
FAIL = "fail"
"""A release outcome: the tool reports a failure (`ToolError`)."""

TOOLS: dict[str, EffectClass] = {"probe": Pure(), "charge": Unsafe(), "tidy": Pure()}
"""The workflow's tools, each call answering only when the test releases it."""

WORKFLOW: dict[str, Any] = {
    "id": "lifecycle",
    "steps": [
        {
            "id": "probe",
            "kind": "tool",
            "tool": "probe",
            "args": {"n": "{{ task.n }}"},
            "retry": {"max_attempts": 2},
        },
        {
            "id": "route",
            "kind": "conditional",
            "branches": [{"when": "steps.probe.output == 'charge'", "to": "charge"}],
            "otherwise": "ask",
        },
        {"id": "charge", "kind": "tool", "tool": "charge", "args": {"n": "{{ task.n }}"}},
        {"id": "ask", "kind": "await", "signal": "approval", "timeout_s": 3600},
        {"id": "tidy", "kind": "tool", "tool": "tidy", "args": {"text": "{{ steps.ask.output }}"}},
    ],
    "transitions": [
        {"from": "probe", "to": "route"},
        {"from": "charge", "to": "ask"},
        {"from": "ask", "to": "tidy"},
    ],
}


def spawned(n: int) -> RunSpawned:
    wf = validate(WorkflowDef.model_validate(WORKFLOW), frozenset([*BUILTIN_TOOLS, *TOOLS]))
    task = {"n": str(n)}
    ref = RunRef(
        tenant=TENANT,
        run_id=new_run_id(),
        task_id=TaskId(content_hash(task)),
        idempotency_key=f"lifecycle-{n}",
        workflow_id=wf.id,
        workflow_version=wf.version,
        role=Role.CURRENT,
        purpose=Purpose.WORK,
    )
    return RunSpawned(run=ref, definition=wf.model_dump(mode="json", by_alias=True), input=task)


# -- tools the test controls ------------------------------------------------------------------


@dataclass
class Call:
    """A tool call waiting for the test to say how it ends."""

    tool: str
    call: ToolCall
    outcome: asyncio.Future[str]


@dataclass
class Tools:
    """Every call blocks until released; unsafe calls are counted per request id."""

    blocked: dict[int, Call] = field(default_factory=dict)
    unsafe_calls: Counter[str] = field(default_factory=Counter)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    def tool(self, name: str, effects: EffectClass) -> Tool:
        async def call(c: ToolCall) -> str:
            if isinstance(effects, Unsafe):
                self.unsafe_calls[c.request_id] += 1
            n = next(self._ids)
            waiting = Call(name, c, asyncio.get_running_loop().create_future())
            self.blocked[n] = waiting
            try:
                outcome = await waiting.outcome
            finally:
                del self.blocked[n]
            if outcome == FAIL:
                raise ToolError(f"{name} failed, as the test said")
            return outcome

        return Tool(name, call, effects, f"{name}: ends when the test releases it")


class MemoryBlobs:
    """Blobs in memory: no thread hops, so every example replays the same way."""

    def __init__(self) -> None:
        self.blobs: dict[tuple[TenantId, str], bytes] = {}

    async def put(self, tenant: TenantId, content: bytes) -> str:
        ref = digest(content)
        self.blobs[(tenant, ref)] = content
        return ref

    async def get(self, tenant: TenantId, ref: str) -> bytes | None:
        return self.blobs.get((tenant, ref))

    async def delete(self, tenant: TenantId, ref: str) -> None:
        self.blobs.pop((tenant, ref), None)

    async def delete_tenant(self, tenant: TenantId) -> int:
        mine = [k for k in self.blobs if k[0] == tenant]
        for k in mine:
            del self.blobs[k]
        return len(mine)


# -- what the record must say -----------------------------------------------------------------


def ended(records: list[LogRecord]) -> bool:
    return any(isinstance(r.event, RunFinished | RunCancelled) for r in records)


def last_event(records: list[LogRecord]) -> object:
    return records[-1].event if records else None


@dataclass
class _Attempt:
    intents: dict[str, IntentState] = field(default_factory=dict)
    effect: str | None = None
    finished: bool = False


def attempt_problems(key: BranchKey, records: list[LogRecord]) -> list[str]:
    """Where the branch's attempts or intents leave §5.1 / §8.4 (empty: nowhere)."""
    problems: list[str] = []
    attempts: dict[tuple[str, int], _Attempt] = {}
    for r in records:
        ev = r.event
        where = f"{key.stream}/{key.branch}@{r.lsn}"
        if isinstance(ev, AttemptStarted):
            if (ev.step, ev.attempt) in attempts:
                problems.append(f"{where}: attempt {ev.step}/{ev.attempt} started twice")
            attempts[(ev.step, ev.attempt)] = _Attempt()
            continue
        if not isinstance(ev, Intent | AttemptFinished):
            continue
        a = attempts.get((ev.step, ev.attempt))
        if a is None:
            problems.append(f"{where}: {ev.type} of attempt {ev.step}/{ev.attempt} never started")
            continue
        if a.finished:
            problems.append(f"{where}: {ev.type} after attempt {ev.step}/{ev.attempt} was terminal")
        if isinstance(ev, Intent):
            try:
                a.intents[ev.request_id] = intent_transition(a.intents.get(ev.request_id), ev.state)
            except Exception as exc:
                problems.append(f"{where}: {exc}")
            a.effect = ev.effect
            continue
        unresolved = IntentState.DISPATCHED in a.intents.values()
        try:
            attempt_transition(AttemptState.RUNNING, ev.state, intent_dispatched=unresolved)
        except Exception as exc:
            problems.append(f"{where}: {exc}")
        answered = ev.state in (AttemptState.SUCCEEDED, AttemptState.FAILED)
        if answered and a.effect == "unsafe" and unresolved:  # §8.4: only its answer ends it
            problems.append(f"{where}: unsafe attempt {ev.state.value} while dispatched")
        a.finished = True
    return problems


def discarded(parent: list[LogRecord], at: int) -> list[str]:
    """§8.5: the committed effects that are not idempotent, at or after the fork point."""
    return [
        r.event.request_id
        for r in parent
        if r.lsn >= at
        and isinstance(r.event, Intent)
        and r.event.state is IntentState.COMMITTED
        and r.event.effect != "idempotent"
    ]


def own_fork(records: list[LogRecord]) -> LogRecord | None:
    """The branch's own `Forked`: the last one (a fork of a fork copies its parent's)."""
    return next((r for r in reversed(records) if isinstance(r.event, Forked)), None)


def fork_problems(branches: dict[int, list[LogRecord]]) -> list[str]:
    """Where a forked branch is not a copy of its parent's prefix, then `Forked`."""
    problems: list[str] = []
    for b, records in sorted(branches.items()):
        own = own_fork(records)
        if b == 0 or own is None:
            if b != 0 or own is not None:
                problems.append(f"branch {b} records {'a' if own else 'no'} fork")
            continue
        f = own.event
        assert isinstance(f, Forked)
        parent = branches.get(f.from_branch)
        if parent is None or f.from_branch >= b:
            problems.append(f"branch {b} forked from branch {f.from_branch}, which is not older")
            continue
        if own.lsn != f.at:
            problems.append(f"branch {b}: Forked at LSN {own.lsn}, not at {f.at}")
        if [r.event for r in records[: f.at]] != [r.event for r in parent[: f.at]]:
            problems.append(f"branch {b}: records below {f.at} differ from branch {f.from_branch}")
        if f.discarded_effects != discarded(parent, f.at):
            problems.append(
                f"branch {b}: discarded effects {f.discarded_effects}, "
                f"not {discarded(parent, f.at)}"
            )
    return problems


def refusals(branches: dict[int, list[LogRecord]], msg: RewindRun) -> set[str]:
    """Why the stage must refuse `msg` (each a part of its reason); empty: it must fork."""
    if not branches:
        return {"no run"}
    why: set[str] = set()
    live = max(branches)
    if not ended(branches[live]):  # driven, or waiting at an await step: cancel it first
        why.add("cancel it before rewinding it")
    source = live if msg.branch is None else msg.branch
    if source not in branches:
        return why | {f"no branch {source}"}
    records = branches[source]
    end = next((r.lsn for r in records if isinstance(r.event, RunFinished | RunCancelled)), None)
    if msg.at > (len(records) if end is None else end):
        why.add("past the end")
    if msg.at < 1:  # a branch starts with the run's RunStarted: a fork keeps it
        why.add("keeps the run's start")
    return why


# -- the machine ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """A message as it was put on its topic (redelivered byte for byte)."""

    slot: int
    topic: str
    msg: Versioned
    raw: bytes
    key: str

    @property
    def id(self) -> str:
        return str(open_envelope(self.raw).id)


SLOT = st.integers(0, RUNS_PER_EXAMPLE - 1)


class RunLifecycle(RuleBasedStateMachine):
    """A few runs of the workflow above, driven through the execute stage."""

    backend: ClassVar[str] = "sqlite"
    dsn: ClassVar[str | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.aio = asyncio.Runner()
        self.dir = Path(tempfile.mkdtemp(prefix="assay-lifecycle-"))
        self.tools = Tools()
        self.runs = [spawned(n) for n in range(RUNS_PER_EXAMPLE)]
        self.sent: list[Sent] = []
        self.lanes: dict[tuple[str, int], list[tuple[asyncio.Task[None], Sent]]] = {}
        """Handlers still running or queued, per topic and run (one partition's order)."""
        self.problems: list[str] = []
        self.snapshot: dict[tuple[int, int], list[LogRecord]] = {}
        self.ticks = itertools.count()
        self.cancel_ticks: dict[int, list[int]] = {n: [] for n in range(RUNS_PER_EXAMPLE)}
        self.fork_ticks: dict[tuple[int, int], int] = {}
        self.cancel_due: set[int] = set()
        """Runs a cancel found not ended: they must end `Cancelled` once driven."""
        self.commands = itertools.count()
        self.blobs = MemoryBlobs()
        self.incarnation = 0
        self.abandoned = 0
        """Messages the stages before the last crash gave up (lost their run's lease)."""
        self.harness: StageHarness | None = None
        self.log_: EventLog | None = None
        self.aio.run(self._open())

    # -- wiring ---------------------------------------------------------------------------

    async def _open(self) -> None:
        spec = self._spec()
        if self.backend == "sqlite":
            path = self.dir / "execute.sqlite"
            self.log_ = await SqliteEventLog(path, spec.events, spec.fold).open()
        else:
            assert self.dsn is not None
            schema = f"lifecycle_{uuid.uuid4().hex[:10]}"
            self.log_ = await PostgresEventLog(self.dsn, schema, spec.events, spec.fold).open()
        await self._start()

    def _spec(self) -> StageSpec:
        tools = dict(
            BUILTIN_TOOLS,
            **{name: self.tools.tool(name, effects) for name, effects in TOOLS.items()},
        )
        deps = StageDeps(
            blobs=self.blobs,
            model=StubModel(),
            judge=StubJudge(),
            tools=tools,
            worker=f"worker-{self.incarnation}",  # a new process is a new lease holder
            lease_ttl_s=TTL_S,
            checkpoint_every=3,  # resumptions and forks go through checkpoints too
        )
        return create_stage(deps)

    async def _start(self) -> None:
        """Start the stage: at first, and again after each crash."""
        self.incarnation += 1
        where = self.dir / f"stage-{self.incarnation}"
        self.harness = await StageHarness(
            self._spec(), self.blobs, where, log=self.log
        ).__aenter__()

    async def _kill(self) -> list[Sent]:
        """Stop the stage as SIGKILL would: every handler and every call ends where it is.
        Returns what it was handling or had queued, in each lane's order."""
        lost = [sent for lane in self.lanes.values() for _, sent in lane]
        tasks = [task for lane in self.lanes.values() for task, _ in lane]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # a cancelled call ends a turn of the loop after its handler
        self.lanes.clear()
        assert not self.tools.blocked, "a tool call outlived the stage that made it"
        if self.harness is not None:
            assert self.harness.runner is not None
            self.abandoned += self.harness.runner.abandoned
            await self.harness.__aexit__(None, None, None)
            self.harness = None
        return lost

    @property
    def stage(self) -> StageHarness:
        assert self.harness is not None
        return self.harness

    @property
    def log(self) -> EventLog:
        assert self.log_ is not None
        return self.log_

    def teardown(self) -> None:
        try:
            if self.log_ is not None:
                self.aio.run(self._close())
        finally:
            self.aio.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    async def _close(self) -> None:
        try:
            await self._kill()
            report = await self.log.rebuild(keep=False)
            assert report.identical, f"re-folding the log changes the state: {report}"
        finally:
            await self.log.close()

    # -- delivering -----------------------------------------------------------------------

    def _put(self, slot: int, topic: str, msg: Versioned, idem: str) -> Sent:
        entry = producer_entry(topic, msg, TENANT, idem)
        sent = Sent(slot, topic, msg, entry.value, entry.key)
        self.sent.append(sent)
        return sent

    def _enqueue(self, sent: Sent) -> None:
        lane = self.lanes.setdefault((sent.topic, sent.slot), [])
        before = lane[-1][0] if lane else None
        lane.append((asyncio.get_running_loop().create_task(self._handle(before, sent)), sent))

    def _deliver(self, sent: Sent) -> None:
        async def go() -> None:
            self._enqueue(sent)
            await self._settle()

        self.aio.run(go())

    async def _settle(self) -> None:
        """Until each handler has ended or waits in a tool call the test controls."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            if self._quiet():
                # A call whose drive was just cancelled still looks blocked until the
                # cancellation reaches it, a few turns of the loop later (no I/O between).
                for _ in range(YIELDS):
                    await asyncio.sleep(0)
                if self._quiet():
                    return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the stage did not settle: {len(self.tools.blocked)} tool calls waiting, "
                    f"handlers running in lanes {[k for k, lane in self.lanes.items() if lane]}"
                )
            await asyncio.sleep(0.002)

    def _quiet(self) -> bool:
        """Whether every handler still running waits in a tool call."""
        for lane in self.lanes.values():
            while lane and lane[0][0].done():
                done, _ = lane.pop(0)
                if not done.cancelled() and done.exception() is not None:
                    self.problems.append(f"a handler raised {done.exception()!r}")
        return sum(1 for lane in self.lanes.values() if lane) == len(self.tools.blocked)

    def _where(self, c: Call) -> tuple[int, int, str, int]:
        """A call by what it is, not by when it came (so that examples replay)."""
        slot = next(n for n, r in enumerate(self.runs) if r.run.run_id == c.call.run_id)
        return slot, c.call.branch, c.call.step, c.call.attempt

    def _idle(self, slot: int) -> bool:
        return not any(lane for (_, s), lane in self.lanes.items() if s == slot)

    async def _handle(self, before: asyncio.Task[None] | None, sent: Sent) -> None:
        """Hand `sent` to the stage after the message before it in its lane, and check
        what handling it did to the run (cancels and rewinds)."""
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)
        tick = next(self.ticks)
        fresh = not await self.log.seen(TENANT, open_envelope(sent.raw).id)
        branches = await self._branches(sent.slot)
        outcome = await self._outcome(sent.slot)
        refused = await self._dead(sent)
        await self.stage.deliver_raw(sent.topic, sent.raw, sent.key)
        if not fresh:
            event("redelivered after it was handled")
            return
        if isinstance(sent.msg, CancelRun):
            self.cancel_ticks[sent.slot].append(tick)
            live = branches.get(max(branches), []) if branches else []
            if not ended(branches.get(0, [])):
                self.cancel_due.add(sent.slot)
            elif ended(live) and await self._outcome(sent.slot) != outcome:
                # its live branch had ended: nothing changes (a fork still driven is
                # stopped, and says so with its own statuses and result)
                self.problems.append(f"a cancel after run {sent.slot} ended changed its outcome")
        elif isinstance(sent.msg, RewindRun):
            await self._check_rewind(sent, tick, branches, refused)

    @staticmethod
    def _forked_by(sent: Sent, records: list[LogRecord]) -> bool:
        own = own_fork(records)
        return own is not None and isinstance(own.event, Forked) and own.event.command == sent.id

    async def _check_rewind(
        self, sent: Sent, tick: int, before: dict[int, list[LogRecord]], refused: int
    ) -> None:
        assert isinstance(sent.msg, RewindRun)
        after = await self._branches(sent.slot)
        new = sorted(set(after) - set(before))
        reasons = [r for raw, r in await self.stage.dead_letters() if raw == sent.raw]
        mine = [b for b, records in before.items() if self._forked_by(sent, records)]
        if mine:  # forked before a crash: the command finishes driving its fork
            event("a rewind forked before a crash is finished")
            if new or len(reasons) != refused:
                self.problems.append(f"redelivered rewind of run {sent.slot} made {new}")
            return
        why = refusals(before, sent.msg)
        if why:
            event(f"rewind refused: {sorted(why)[0]}")
            if new or len(reasons) != refused + 1 or not any(w in reasons[-1] for w in why):
                self.problems.append(
                    f"rewind {sent.msg.at}@{sent.msg.branch} of run {sent.slot} should have "
                    f"been refused ({why}); it made branches {new}, refusals {reasons}"
                )
            return
        if new != [max(before) + 1]:
            self.problems.append(f"rewind of run {sent.slot} made branches {new}")
            return
        head = after[new[0]]
        forked = head[sent.msg.at].event if len(head) > sent.msg.at else None
        source = max(before) if sent.msg.branch is None else sent.msg.branch
        if (
            not isinstance(forked, Forked)
            or forked.command != sent.id
            or (forked.from_branch, forked.at) != (source, sent.msg.at)
        ):
            self.problems.append(f"branch {new[0]} of run {sent.slot} records {forked!r}")
        self.fork_ticks[(sent.slot, new[0])] = tick
        event(f"rewind forked branch {min(new[0], 3)}" + ("+" if new[0] >= 3 else ""))

    # -- reading the store ----------------------------------------------------------------

    async def _branches(self, slot: int) -> dict[int, list[LogRecord]]:
        run = self.runs[slot].run.run_id
        return {k.branch: await self.log.read(k) for k in await self.log.branches(run, TENANT)}

    async def _outcome(self, slot: int) -> list[object]:
        """What the stage said of the run's lifecycle: statuses, results, hand-overs."""
        run = self.runs[slot].run.run_id
        said = await self.stage.emitted()
        return [
            m
            for m in said
            if (isinstance(m, RunStatusChanged | RunExecuted) and m.run.run_id == run)
            or (isinstance(m, RunResult) and m.run_id == run)
        ]

    async def _dead(self, sent: Sent) -> int:
        return sum(1 for raw, _ in await self.stage.dead_letters() if raw == sent.raw)

    # -- rules ----------------------------------------------------------------------------

    @initialize(early=st.lists(st.booleans(), min_size=RUNS_PER_EXAMPLE, max_size=RUNS_PER_EXAMPLE))
    def spawn_some(self, early: list[bool]) -> None:
        """Most runs start at once; the others may get commands before their spawn."""
        for slot, now in enumerate(early):
            if now:
                self.spawn(slot)

    @rule(slot=SLOT)
    def spawn(self, slot: int) -> None:
        """Spawn a run (again: the same message, a redelivery)."""
        self._deliver(self._put(slot, RUNS, self.runs[slot], f"spawn-{slot}"))

    @precondition(lambda self: bool(self.tools.blocked))
    @rule(data=st.data(), outcome=st.sampled_from(["charge", "charge", "skip", FAIL]))
    def release(self, data: st.DataObject, outcome: str) -> None:
        """A blocked tool call answers: an output (the conditional reads it) or a failure."""
        calls = sorted(self.tools.blocked.values(), key=self._where)
        data.draw(st.sampled_from(calls), label="call").outcome.set_result(outcome)
        self.aio.run(self._settle())

    @rule(slot=SLOT)
    def cancel(self, slot: int) -> None:
        msg = CancelRun(tenant=TENANT, run_id=self.runs[slot].run.run_id, reason="stop")
        self._deliver(self._put(slot, RUN_COMMANDS, msg, f"cmd-{next(self.commands)}"))

    @rule(
        slot=SLOT,
        signal=st.sampled_from(["approval", "approval", "deploy"]),
        timed_out=st.sampled_from([False, False, True]),
    )
    def signal(self, slot: int, signal: str, timed_out: bool) -> None:
        run = self.runs[slot].run.run_id
        msg = SignalRun(
            tenant=TENANT, run_id=run, signal=signal, payload=" yes ", timed_out=timed_out
        )
        self._deliver(self._put(slot, RUN_COMMANDS, msg, f"cmd-{next(self.commands)}"))

    @rule(slot=SLOT, data=st.data())
    def rewind(self, slot: int, data: st.DataObject) -> None:
        """Fork at any LSN of any branch: one that exists or not, up to one past its end."""
        lengths = {b: len(r) for b, r in self.aio.run(self._branches(slot)).items()}
        branch = data.draw(st.none() | st.sampled_from([*lengths, len(lengths)]), label="branch")
        size = lengths.get(max(lengths) if branch is None and lengths else branch or 0, 0)
        at = data.draw(st.integers(0, size + 1), label="at")
        run = self.runs[slot].run.run_id
        msg = RewindRun(tenant=TENANT, run_id=run, at=at, branch=branch, reason="again")
        self._deliver(self._put(slot, RUN_COMMANDS, msg, f"cmd-{next(self.commands)}"))

    @rule(slot=SLOT, outcomes=st.lists(st.sampled_from(["charge", "skip", FAIL]), max_size=4))
    def finish(self, slot: int, outcomes: list[str]) -> None:
        """Let a run go on to its end: its calls answer in turn, its waits are approved."""
        for outcome in outcomes:
            calls = sorted(
                (c for c in self.tools.blocked.values() if self._where(c)[0] == slot),
                key=self._where,
            )
            if calls:
                calls[0].outcome.set_result(outcome)
                self.aio.run(self._settle())
            elif self.aio.run(self.stage.state(TENANT, "await", self.runs[slot].run.run_id)):
                self.signal(slot, "approval", False)
            else:
                return

    @precondition(lambda self: self.incarnation <= MAX_CRASHES)
    @rule()
    def crash(self) -> None:
        """The stage's process dies and a new one starts: the messages it had not
        finished come again, in order, to the new worker."""

        async def restart() -> None:
            lost = await self._kill()
            await self._start()
            for sent in lost:
                self._enqueue(sent)
            await self._settle()

        self.aio.run(restart())

    @precondition(lambda self: bool(self.sent))
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        """Deliver an earlier message again: once it was handled, nothing changes."""
        sent = data.draw(st.sampled_from(self.sent), label="message")
        self.aio.run(self._redeliver(sent))

    async def _redeliver(self, sent: Sent) -> None:
        if not self._idle(sent.slot) or not await self.log.seen(TENANT, open_envelope(sent.raw).id):
            self._enqueue(sent)  # not handled yet (or queued): an ordinary delivery
            await self._settle()
            return
        records = await self._all_records()
        outcome = await self._outcome(sent.slot)
        self._enqueue(sent)
        await self._settle()
        now = await self._all_records()
        changed = {k: v[len(records.get(k, [])) :] for k, v in now.items() if v != records.get(k)}
        assert not changed, f"redelivered {sent.msg.type} changed the log: {changed}"
        assert await self._outcome(sent.slot) == outcome, "a redelivered message emitted"

    async def _all_records(self) -> dict[tuple[int, int], list[LogRecord]]:
        out: dict[tuple[int, int], list[LogRecord]] = {}
        for slot in range(RUNS_PER_EXAMPLE):
            for b, records in (await self._branches(slot)).items():
                out[(slot, b)] = records
        return out

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def record_holds(self) -> None:
        self.aio.run(self._check())

    async def _check(self) -> None:
        assert not self.problems, self.problems
        assert all(n == 1 for n in self.tools.unsafe_calls.values()), (
            f"an unsafe call was made twice: {self.tools.unsafe_calls}"
        )
        assert self.stage.runner is not None
        abandoned = self.abandoned + self.stage.runner.abandoned
        assert abandoned == 0, "the stage lost a run's lease to itself"
        crashed = [r for _, r in await self.stage.dead_letters() if r.startswith("handler failed")]
        assert not crashed, crashed
        records = await self._all_records()
        for key, before in self.snapshot.items():  # the log is append-only, every branch
            assert records.get(key, [])[: len(before)] == before, f"branch {key} was rewritten"
        self.snapshot = records
        in_flight: set[tuple[str, int, str, int]] = {
            (c.call.run_id, c.call.branch, c.call.step, c.call.attempt)
            for c in self.tools.blocked.values()
        }
        for slot in range(RUNS_PER_EXAMPLE):
            await self._check_run(slot, in_flight)

    async def _check_run(self, slot: int, in_flight: set[tuple[str, int, str, int]]) -> None:
        ref = self.runs[slot].run
        branches = await self._branches(slot)
        for b, records in branches.items():
            key = BranchKey.for_run(TENANT, ref.run_id, BranchId(b))
            assert [r.lsn for r in records] == list(range(len(records))), f"LSNs of {key}"
            assert isinstance(last_event(records[:1]), RunStarted), f"{key} starts {records[0]}"
            assert not attempt_problems(key, records), attempt_problems(key, records)
            for r in records:  # an attempt is closed only by the drive whose call it awaits
                if isinstance(r.event, AttemptFinished):
                    closing = (ref.run_id, b, r.event.step, r.event.attempt)
                    assert closing not in in_flight, f"{key}@{r.lsn} closed a call in flight"
        assert not fork_problems(branches), fork_problems(branches)
        assert sorted(branches) == list(range(len(branches))), "branch numbers have a gap"
        doc = await self.stage.state(TENANT, "run", ref.run_id)
        if branches:
            assert doc is not None
            assert doc["branch"] == max(branches), "the live branch is not the newest"
            for b in range(max(branches)):  # §8.5: a fork departs from a run that ended
                assert ended(branches[b]), f"branch {b} of run {slot} was left while unended"
        for b, records in branches.items():
            if b and isinstance(last_event(records), RunCancelled):  # a later cancel stopped it
                forked = self.fork_ticks.get((slot, b), -1)
                assert any(t > forked for t in self.cancel_ticks[slot]), (
                    f"branch {b} of run {slot} ended cancelled, yet no cancel came after its fork"
                )

        outcome = await self._outcome(slot)
        states: dict[int, RunState] = {}
        for b, records in branches.items():  # every branch has its own §5.2 lifecycle
            said = [m for m in outcome if _branch_of(m) == b]
            state = RunState.SCHEDULED
            for m in said:  # with the kernel's table as the oracle
                if isinstance(m, RunStatusChanged):
                    state = run_transition(state, m.state)
            results = [m for m in said if isinstance(m, RunResult)]
            executed = [m for m in said if isinstance(m, RunExecuted)]
            end = next(
                (r.event for r in records if isinstance(r.event, RunFinished | RunCancelled)), None
            )
            assert len(results) == isinstance(end, RunCancelled), (b, results)
            assert all(r.status == "cancelled" and r.score is None for r in results)
            assert len(executed) == isinstance(end, RunFinished), (b, executed)
            if end is not None:
                assert state is (RunState.CANCELLED if results else RunState.VERIFYING), state
            states[b] = state
        main = branches.get(0, [])
        end = next((r.event for r in main if isinstance(r.event, RunFinished | RunCancelled)), None)
        state = states.get(0, RunState.SCHEDULED)
        if not self._idle(slot) or not branches:
            return
        # Nothing in flight for the run: its live branch ended, or it waits for a signal.
        waiting = await self.stage.state(TENANT, "await", ref.run_id)
        live = max(branches)
        for b, records in branches.items():
            if waiting is not None and waiting["branch"] == b == live:
                assert not ended(records)
                assert states.get(b) is RunState.SUSPENDED, (b, states)
            else:
                assert ended(records), f"branch {b} of run {slot} neither ended nor waits"
        if slot in self.cancel_due:  # §5.2: cancel reaches every non-terminal state
            assert isinstance(end, RunCancelled), f"run {slot} was cancelled yet ended {end!r}"


def _branch_of(m: object) -> int:
    """The branch a message about a run is about."""
    if isinstance(m, RunResult):
        return m.branch
    assert isinstance(m, RunStatusChanged | RunExecuted)
    return m.run.branch_id


@pytest.fixture(scope="module")
def lifecycle_database(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_lifecycle") as dsn:
        yield dsn


@pytest.mark.parametrize(
    ("backend", "examples"),
    [("sqlite", 60), pytest.param("postgres", 40, marks=pytest.mark.postgres)],
)
def test_cancel_and_rewind_keep_the_run_lifecycle(
    request: pytest.FixtureRequest, backend: str, examples: int
) -> None:
    dsn = str(request.getfixturevalue("lifecycle_database")) if backend == "postgres" else None

    class OnStore(RunLifecycle):
        pass

    OnStore.backend, OnStore.dsn = backend, dsn
    run_state_machine_as_test(
        OnStore,
        settings=settings(max_examples=examples, stateful_step_count=30, deadline=None),
    )
