"""Durable execution (§5, §8.3): the driver, its records and their fold, the stub model."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from assay.engine import (
    BUILTIN_TOOLS,
    WORK_EVENTS,
    AttemptFinished,
    AttemptStarted,
    Completion,
    Driver,
    Model,
    ModelError,
    RunSpec,
    RunStarted,
    StubModel,
    fold_work,
    solve,
)
from assay.engine.driver import MAX_INTERRUPTED
from assay.engine.journal import LogJournal as StoreJournal
from assay.kernel import (
    AttemptNo,
    AttemptState,
    BranchId,
    Lsn,
    StepId,
    TaskId,
    content_hash,
    new_run_id,
    tenant_id,
)
from assay.kernel.schema import Versioned
from assay.messages import Episode, Purpose, Role, RunRef, Usage, UsageRecorded
from assay.record import BranchKey, Event, LogRecord, StateKey, apply_delta
from assay.store import CommitBatch, SqliteEventLog
from assay.store.ports import Checkpoint
from assay.workflow import WorkflowDef, validate

# -- a real journal over the SQLite event log ---------------------------------------------


class LogJournal:
    """The driver's journal on a real event log: one commit per append."""

    def __init__(self, log: SqliteEventLog) -> None:
        self.log = log
        self.appended: list[tuple[Event, list[Lsn]]] = []
        self.commits: list[list[Lsn]] = []
        self.emitted: list[tuple[str, Versioned]] = []

    async def history(self, key: BranchKey) -> list[LogRecord]:
        return await self.log.read(key)

    async def record_and_commit(
        self, key: BranchKey, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        lsns = await self.log.commit(CommitBatch(records=[(key, e) for e in events]))
        self.appended.extend(zip(events, [[lsn] for lsn in lsns], strict=True))
        self.commits.append(lsns)
        self.emitted.extend(emits)


class WorkerDied(Exception):
    """The process stopped: nothing after this point was committed."""


class CrashingJournal(LogJournal):
    """Commits `survive` appends, then dies before committing the next one."""

    def __init__(self, log: SqliteEventLog, survive: int) -> None:
        super().__init__(log)
        self.survive = survive

    async def record_and_commit(
        self, key: BranchKey, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        if len(self.commits) >= self.survive:
            raise WorkerDied(f"died before committing {events[0].type}")
        await super().record_and_commit(key, *events, emits=emits)


async def open_log(path: Path) -> SqliteEventLog:
    return await SqliteEventLog(path, WORK_EVENTS, fold_work).open()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "execute.sqlite"


@pytest.fixture
async def log(db_path: Path) -> AsyncIterator[SqliteEventLog]:
    opened = await open_log(db_path)
    try:
        yield opened
    finally:
        await opened.close()


# -- model doubles (the model is a port) ---------------------------------------------------


class CountingModel:
    """Delegates to another model and counts the calls."""

    name = "counting"

    def __init__(self, inner: Model | None = None) -> None:
        self.inner: Model = inner if inner is not None else StubModel()
        self.prompts: list[str] = []

    @property
    def calls(self) -> int:
        return len(self.prompts)

    async def complete(self, prompt: str, *, max_tokens: int, seed: str) -> Completion:
        self.prompts.append(prompt)
        return await self.inner.complete(prompt, max_tokens=max_tokens, seed=seed)


class FlakyModel:
    """Raises `ModelError` on its first `failures` calls, then answers exactly."""

    name = "flaky"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    async def complete(self, prompt: str, *, max_tokens: int, seed: str) -> Completion:
        self.calls += 1
        if self.calls <= self.failures:
            raise ModelError(f"upstream unavailable (call {self.calls})")
        return Completion(f"The answer is {solve(prompt)}.", self.name, 10, 5)


class SleepyModel:
    """Never answers within any sensible step deadline."""

    name = "sleepy"

    async def complete(self, prompt: str, *, max_tokens: int, seed: str) -> Completion:
        await asyncio.sleep(30)
        return Completion("too late", self.name, 1, 1)


# -- runs ----------------------------------------------------------------------------------

TENANT = tenant_id(uuid.UUID("6f1c2a52-0d7e-4a35-9a3f-6c2b1e1d0a01"))


def workflow(doc: dict[str, Any]) -> WorkflowDef:
    return validate(
        WorkflowDef.model_validate({"id": "wf", **doc}), frozenset(BUILTIN_TOOLS.keys())
    )


def spec_for(wf: WorkflowDef, task: dict[str, Any]) -> RunSpec:
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


def arith(
    *, max_attempts: int = 1, timeout_s: float = 10.0, prompt: str | None = None
) -> WorkflowDef:
    return workflow(
        {
            "steps": [
                {
                    "id": "solve",
                    "kind": "model",
                    "prompt": prompt or "What is {{ task.question }}?",
                    "retry": {"max_attempts": max_attempts},
                    "timeout_s": timeout_s,
                },
                {
                    "id": "answer",
                    "kind": "tool",
                    "tool": "extract_number",
                    "args": {"text": "{{ steps.solve.output }}"},
                },
            ]
        }
    )


TASK = {"question": "(5 + 12) * 9", "answer": "153"}


async def events_of(log: SqliteEventLog, spec: RunSpec) -> list[Event]:
    return [r.event for r in await log.read(spec.key)]


def attempts_of(episode: Episode) -> list[tuple[str, int, AttemptState]]:
    return [(a.step, a.attempt, a.state) for a in episode.attempts]


S, F = AttemptState.SUCCEEDED, AttemptState.FAILED


# -- the happy path ------------------------------------------------------------------------


async def test_two_step_run_succeeds_and_commits_its_pure_step_once(
    log: SqliteEventLog,
) -> None:
    spec = spec_for(arith(), TASK)
    journal = LogJournal(log)
    model = CountingModel()
    episode = await Driver(model, BUILTIN_TOOLS).drive(spec, journal)

    assert episode.succeeded
    assert episode.failed_step is None
    assert attempts_of(episode) == [("solve", 1, S), ("answer", 1, S)]
    solved = episode.outputs["solve"]
    assert re.fullmatch(r"Let me see\. The answer is -?\d+\.", solved)
    assert episode.output == episode.outputs["answer"] == re.findall(r"-?\d+", solved)[-1]
    assert episode.usage.model_calls == model.calls == 1
    assert episode.run == spec.ref
    assert episode.input == TASK

    records = await log.read(spec.key)
    assert [r.lsn for r in records] == list(range(5))
    kinds = [(type(r.event), getattr(r.event, "step", None)) for r in records]
    assert kinds == [
        (RunStarted, None),
        (AttemptStarted, "solve"),
        (AttemptFinished, "solve"),
        (AttemptStarted, "answer"),
        (AttemptFinished, "answer"),
    ]
    # The model step's start is committed before the call (write-ahead); the Pure tool
    # step's start and end are one commit (§8.4: a crash mid-call only runs it again).
    assert journal.commits == [[Lsn(0)], [Lsn(1)], [Lsn(2)], [Lsn(3), Lsn(4)]]
    assert [lsns for _, lsns in journal.appended] == [[Lsn(i)] for i in range(5)]
    assert [e for e, _ in journal.appended] == [r.event for r in records]
    started = records[1].event
    assert isinstance(started, AttemptStarted)
    assert started.prompt == "What is (5 + 12) * 9?"
    assert started.iteration == 0
    tool_started = records[3].event
    assert isinstance(tool_started, AttemptStarted)
    assert tool_started.args == {"text": solved}
    # The model call is metered in the same commit as its AttemptFinished.
    assert len(journal.emitted) == 1
    topic, usage = journal.emitted[0]
    assert topic == "assay.usage"
    assert isinstance(usage, UsageRecorded)
    assert (usage.tenant, usage.run_id, usage.purpose) == (TENANT, spec.ref.run_id, Purpose.WORK)


async def test_derived_documents_are_the_fold_of_the_log(log: SqliteEventLog) -> None:
    spec = spec_for(arith(), TASK)
    await Driver(StubModel(), BUILTIN_TOOLS).drive(spec, LogJournal(log))
    records = await log.read(spec.key)
    run_id = spec.ref.run_id

    run_doc = await log.get(StateKey(TENANT, "run", run_id))
    assert run_doc == {
        "status": "running",
        "branch": 0,
        "workflow_id": "wf",
        "workflow_version": spec.definition.version,
        "role": "current",
        "purpose": "work",
        "task_id": spec.ref.task_id,
        "attempts": 0,
        "started_ms": records[0].at_ms,
        "current_step": "answer",
        "last_lsn": 4,
    }
    attempts = dict(await log.scan(TENANT, "attempt", f"{run_id}/"))
    assert attempts == {
        f"{run_id}/0/solve/1": {"state": "succeeded", "iteration": 0, "error": None},
        f"{run_id}/0/answer/1": {"state": "succeeded", "iteration": 0, "error": None},
    }
    # Folding the records in memory reproduces the stored documents exactly.
    docs: dict[StateKey, dict[str, Any] | None] = {}
    for record in records:
        for delta in fold_work(record):
            docs[delta.at] = apply_delta(docs.get(delta.at), delta)
    for at, doc in docs.items():
        assert await log.get(at) == doc
    assert (await log.rebuild(keep=False)).identical


# -- retries -------------------------------------------------------------------------------


async def test_retry_creates_attempt_two_and_never_rewrites_attempt_one(
    log: SqliteEventLog,
) -> None:
    spec = spec_for(arith(max_attempts=3), TASK)
    model = FlakyModel(failures=1)
    episode = await Driver(model, BUILTIN_TOOLS).drive(spec, LogJournal(log))

    assert episode.succeeded
    assert episode.output == "153"
    assert attempts_of(episode) == [("solve", 1, F), ("solve", 2, S), ("answer", 1, S)]
    assert episode.attempts[0].error == "upstream unavailable (call 1)"
    assert episode.attempts[0].output is None
    assert model.calls == 2

    events = await events_of(log, spec)
    finished = [e for e in events if isinstance(e, AttemptFinished) and e.step == "solve"]
    assert [(e.attempt, e.state) for e in finished] == [(1, F), (2, S)]
    starts = [(e.step, e.attempt) for e in events if isinstance(e, AttemptStarted)]
    assert starts == [("solve", 1), ("solve", 2), ("answer", 1)]
    doc = await log.get(StateKey(TENANT, "attempt", f"{spec.ref.run_id}/0/solve/1"))
    assert doc == {"state": "failed", "iteration": 0, "error": "upstream unavailable (call 1)"}

    # Resuming the finished run leaves attempt 1's record exactly as it was written.
    before = await log.read(spec.key)
    again = await Driver(FlakyModel(failures=0), BUILTIN_TOOLS).drive(spec, LogJournal(log))
    assert await log.read(spec.key) == before
    assert again == episode


async def test_exhausting_attempts_fails_the_run(log: SqliteEventLog) -> None:
    spec = spec_for(arith(max_attempts=3), TASK)
    model = FlakyModel(failures=100)
    episode = await Driver(model, BUILTIN_TOOLS).drive(spec, LogJournal(log))

    assert not episode.succeeded
    assert episode.failed_step == "solve"
    assert episode.output is None
    assert episode.outputs == {}
    assert attempts_of(episode) == [("solve", 1, F), ("solve", 2, F), ("solve", 3, F)]
    assert model.calls == 3
    events = await events_of(log, spec)
    assert not any(getattr(e, "step", None) == "answer" for e in events)


async def test_step_deadline_gives_timed_out(log: SqliteEventLog) -> None:
    spec = spec_for(arith(timeout_s=0.05), TASK)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    episode = await Driver(SleepyModel(), BUILTIN_TOOLS).drive(spec, LogJournal(log))
    assert loop.time() - t0 < 5
    assert attempts_of(episode) == [("solve", 1, AttemptState.TIMED_OUT)]
    assert episode.attempts[0].error == "timed out after 0.05s"
    assert not episode.succeeded
    assert episode.failed_step == "solve"
    assert episode.output is None
    doc = await log.get(StateKey(TENANT, "attempt", f"{spec.ref.run_id}/0/solve/1"))
    assert doc is not None
    assert doc["state"] == "timed_out"


# -- resumption ----------------------------------------------------------------------------


async def test_driving_a_finished_run_again_appends_nothing(log: SqliteEventLog) -> None:
    spec = spec_for(arith(max_attempts=2), TASK)
    first = await Driver(StubModel(), BUILTIN_TOOLS).drive(spec, LogJournal(log))
    before = await log.read(spec.key)

    journal = LogJournal(log)
    model = CountingModel()
    second = await Driver(model, BUILTIN_TOOLS).drive(spec, journal)
    assert journal.appended == []
    assert journal.emitted == []
    assert model.calls == 0
    assert await log.read(spec.key) == before
    assert second == first
    assert second.encode() == first.encode()


class ReadCountingJournal(StoreJournal):
    """The store's checkpointing journal, counting what a drive reads back of its branch."""

    reads = 0

    async def history(self, key: BranchKey) -> list[LogRecord]:
        self.reads += 1
        return await super().history(key)

    async def latest_checkpoint(self, key: BranchKey) -> Checkpoint | None:
        self.reads += 1
        return await super().latest_checkpoint(key)


async def test_a_fresh_drive_reads_nothing_back_and_records_what_a_full_one_does(
    tmp_path: Path,
) -> None:
    spec = spec_for(arith(max_attempts=2), TASK)
    episodes, events = [], []
    for fresh in (False, True):
        log = await open_log(tmp_path / f"fresh-{fresh}.sqlite")
        try:
            journal = ReadCountingJournal(log)
            driver = Driver(StubModel(), BUILTIN_TOOLS, checkpoint_every=2)
            episodes.append(await driver.drive(spec, journal, fresh=fresh))
            events.append(await events_of(log, spec))
            assert journal.reads == (0 if fresh else 2)  # a checkpoint, then the branch
        finally:
            await log.close()
    assert _timeless(episodes[0]) == _timeless(episodes[1])
    assert [_timeless(e) for e in events[0]] == [_timeless(e) for e in events[1]]


def _timeless(record: Any) -> Any:
    """`record` without wall-clock durations, the one thing two drives may differ in."""
    if isinstance(record, Episode):
        attempts = [a.model_copy(update={"duration_ms": 0}) for a in record.attempts]
        return record.model_copy(update={"attempts": attempts})
    if hasattr(record, "duration_ms"):
        return record.model_copy(update={"duration_ms": 0})
    return record


async def test_crash_mid_attempt_closes_it_as_interrupted(
    log: SqliteEventLog,
) -> None:
    spec = spec_for(arith(max_attempts=2), TASK)
    await log.commit(
        CommitBatch(
            records=[
                (spec.key, RunStarted(run=spec.ref)),
                (
                    spec.key,
                    AttemptStarted(
                        step=StepId("solve"),
                        attempt=AttemptNo(1),
                        iteration=0,
                        prompt="What is (5 + 12) * 9?",
                    ),
                ),
            ]
        )
    )
    model = FlakyModel(failures=100)
    episode = await Driver(model, BUILTIN_TOOLS).drive(spec, LogJournal(log))

    # The interrupted attempt is closed, and both real attempts still run.
    assert attempts_of(episode) == [("solve", 1, F), ("solve", 2, F), ("solve", 3, F)]
    assert model.calls == 2
    assert episode.failed_step == "solve"
    assert episode.output is None
    records = await log.read(spec.key)
    assert [r.lsn for r in records] == list(range(len(records)))
    closed = records[2].event
    assert isinstance(closed, AttemptFinished)
    assert (closed.step, closed.attempt, closed.state) == ("solve", 1, F)
    assert closed.interrupted
    assert closed.error is not None
    assert "interrupted" in closed.error
    later = [r.event for r in records[3:] if isinstance(r.event, AttemptFinished)]
    assert [(e.attempt, e.interrupted) for e in later] == [(2, False), (3, False)]
    doc = await log.get(StateKey(TENANT, "attempt", f"{spec.ref.run_id}/0/solve/1"))
    assert doc is not None
    assert doc["state"] == "failed"


async def test_a_step_that_keeps_killing_its_worker_stops_being_retried(
    log: SqliteEventLog,
) -> None:
    spec = spec_for(arith(max_attempts=5), TASK)
    step = StepId("solve")
    history: list[Event] = [RunStarted(run=spec.ref)]
    for n in range(1, MAX_INTERRUPTED):
        history.append(AttemptStarted(step=step, attempt=AttemptNo(n), iteration=0))
        history.append(
            AttemptFinished(
                step=step,
                attempt=AttemptNo(n),
                state=F,
                error="interrupted",
                usage=Usage(),
                duration_ms=0,
                interrupted=True,
            )
        )
    history.append(AttemptStarted(step=step, attempt=AttemptNo(MAX_INTERRUPTED), iteration=0))
    await log.commit(CommitBatch(records=[(spec.key, e) for e in history]))
    model = CountingModel(StubModel())
    episode = await Driver(model, BUILTIN_TOOLS).drive(spec, LogJournal(log))

    assert model.calls == 0
    assert episode.failed_step == "solve"
    assert [a.attempt for a in episode.attempts] == list(range(1, MAX_INTERRUPTED + 1))


async def test_a_pure_start_recorded_alone_is_closed_as_interrupted_and_never_edited(
    log: SqliteEventLog,
) -> None:
    """A log written when every start was its own commit may hold a Pure step's start
    without its end: it is closed as interrupted and retried, its records left as they are."""
    spec = spec_for(arith(), TASK)
    journal = LogJournal(log)
    await Driver(CountingModel(), BUILTIN_TOOLS).drive(spec, journal)
    done = await log.read(spec.key)
    legacy = spec_for(arith(), TASK)
    first = done[0].event
    assert isinstance(first, RunStarted)
    legacy_records = [first.model_copy(update={"run": legacy.ref}), *(r.event for r in done[1:4])]
    assert isinstance(legacy_records[3], AttemptStarted)  # the Pure step's start, alone
    await log.commit(CommitBatch(records=[(legacy.key, e) for e in legacy_records]))
    before = await log.read(legacy.key)

    model = CountingModel()
    episode = await Driver(model, BUILTIN_TOOLS).drive(legacy, LogJournal(log))
    records = await log.read(legacy.key)
    assert model.calls == 0
    assert episode.succeeded
    assert attempts_of(episode) == [("solve", 1, S), ("answer", 1, F), ("answer", 2, S)]
    assert [(r.lsn, r.event) for r in records[:4]] == [(r.lsn, r.event) for r in before]
    closed = records[4].event
    assert isinstance(closed, AttemptFinished)
    assert (closed.step, closed.attempt, closed.interrupted) == ("answer", 1, True)


async def test_crash_mid_attempt_then_the_next_attempt_succeeds(log: SqliteEventLog) -> None:
    spec = spec_for(arith(max_attempts=1), TASK)
    started = AttemptStarted(step=StepId("solve"), attempt=AttemptNo(1), iteration=0)
    await log.commit(
        CommitBatch(records=[(spec.key, RunStarted(run=spec.ref)), (spec.key, started)])
    )
    episode = await Driver(FlakyModel(failures=0), BUILTIN_TOOLS).drive(spec, LogJournal(log))
    # max_attempts=1: the interrupted attempt did not use up the only real attempt.
    assert episode.succeeded
    assert episode.output == "153"
    assert attempts_of(episode) == [("solve", 1, F), ("solve", 2, S), ("answer", 1, S)]


async def test_restart_after_step_one_does_not_run_it_again(db_path: Path) -> None:
    """Dying at step 2's only commit (a Pure step: start and end together) leaves no trace
    of step 2: the restart runs it again as attempt 1, and never step 1."""
    survive, answer_attempts = 3, [("answer", 1, S)]
    spec = spec_for(arith(), TASK)
    first_model = CountingModel()
    log = await open_log(db_path)
    try:
        with pytest.raises(WorkerDied):
            await Driver(first_model, BUILTIN_TOOLS).drive(spec, CrashingJournal(log, survive))
        assert first_model.calls == 1
        assert len(await log.read(spec.key)) == survive
    finally:
        await log.close()

    log = await open_log(db_path)  # a new process, from the file alone
    try:
        model = CountingModel()
        episode = await Driver(model, BUILTIN_TOOLS).drive(spec, LogJournal(log))
        records = await log.read(spec.key)
    finally:
        await log.close()
    assert model.calls == 0
    assert episode.succeeded
    assert attempts_of(episode) == [("solve", 1, S), *answer_attempts]
    step_one = records[2].event
    assert isinstance(step_one, AttemptFinished)
    assert step_one.step == "solve"
    assert episode.outputs["solve"] == step_one.output
    assert episode.usage.model_calls == 1  # the recorded call, not a new one
    assert [r.lsn for r in records] == list(range(len(records)))


# -- loops and budgets ---------------------------------------------------------------------


def loop_workflow(**budget: int) -> WorkflowDef:
    return workflow(
        {
            "steps": [
                {"id": "a", "kind": "model", "prompt": "What is {{ task.x }} + 1?"},
                {
                    "id": "b",
                    "kind": "tool",
                    "tool": "extract_number",
                    "args": {"text": "{{ steps.a.output }}"},
                },
            ],
            "transitions": [
                {"from": "a", "to": "b"},
                {"from": "b", "to": "a", "max_iterations": 2},
            ],
            "budget": budget,
        }
    )


async def test_bounded_loop_runs_its_iterations_and_stops(log: SqliteEventLog) -> None:
    spec = spec_for(loop_workflow(), {"x": "4"})
    episode = await Driver(FlakyModel(failures=0), BUILTIN_TOOLS).drive(spec, LogJournal(log))
    assert episode.succeeded
    assert episode.output == "5"
    executions = [(a.step, a.iteration) for a in episode.attempts]
    assert executions == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    # Attempt numbers are per step on the branch, so no record is ever reused.
    assert [a.attempt for a in episode.attempts] == [1, 1, 2, 2, 3, 3]
    assert all(a.state is S for a in episode.attempts)
    docs = await log.scan(TENANT, "attempt", f"{spec.ref.run_id}/")
    assert len(docs) == 6

    journal = LogJournal(log)
    again = await Driver(FlakyModel(failures=0), BUILTIN_TOOLS).drive(spec, journal)
    assert journal.appended == []
    assert again == episode


async def test_step_execution_budget_fails_a_loop(log: SqliteEventLog) -> None:
    spec = spec_for(loop_workflow(max_step_executions=4), {"x": "4"})
    episode = await Driver(FlakyModel(failures=0), BUILTIN_TOOLS).drive(spec, LogJournal(log))
    assert not episode.succeeded
    assert episode.output is None
    assert episode.failed_step == "a"
    assert [a.step for a in episode.attempts] == ["a", "b", "a", "b"]


async def test_model_call_budget_fails_the_run(log: SqliteEventLog) -> None:
    spec = spec_for(loop_workflow(max_model_calls=2), {"x": "4"})
    model = CountingModel(FlakyModel(failures=0))
    episode = await Driver(model, BUILTIN_TOOLS).drive(spec, LogJournal(log))
    assert model.calls == 2
    assert not episode.succeeded
    assert episode.failed_step == "a"
    assert episode.output is None
    assert attempts_of(episode) == [("a", 1, S), ("b", 1, S), ("a", 2, S), ("b", 2, S), ("a", 3, F)]
    assert episode.attempts[-1].error == "the run's model-call budget is spent"
    assert episode.usage.model_calls == 2


# -- failures inside a step ----------------------------------------------------------------


async def test_template_error_fails_the_attempt_without_a_model_call(
    log: SqliteEventLog,
) -> None:
    spec = spec_for(arith(prompt="What is {{ task.missing }}?"), TASK)
    model = CountingModel()
    episode = await Driver(model, BUILTIN_TOOLS).drive(spec, LogJournal(log))
    assert model.calls == 0
    assert attempts_of(episode) == [("solve", 1, F)]
    error = episode.attempts[0].error
    assert error == "template refers to 'task.missing', which the input does not hold"
    assert episode.failed_step == "solve"
    assert episode.usage.model_calls == 0
    events = await events_of(log, spec)
    started = events[1]
    assert isinstance(started, AttemptStarted)
    assert started.prompt is None


async def test_tool_error_fails_the_step_with_its_message(log: SqliteEventLog) -> None:
    spec = spec_for(arith(prompt="Please greet the user politely."), TASK)
    episode = await Driver(StubModel(), BUILTIN_TOOLS).drive(spec, LogJournal(log))
    assert episode.outputs["solve"] == "I could not find a problem to solve."
    assert attempts_of(episode) == [("solve", 1, S), ("answer", 1, F)]
    assert episode.attempts[1].error == "no number in the text"
    assert episode.failed_step == "answer"
    assert episode.output is None


async def test_unregistered_tool_fails_the_step(log: SqliteEventLog) -> None:
    spec = spec_for(arith(), TASK)
    episode = await Driver(StubModel(), {}).drive(spec, LogJournal(log))
    assert episode.attempts[-1].error == "no tool 'extract_number' is registered"
    assert episode.failed_step == "answer"


# -- the stub model ------------------------------------------------------------------------


async def test_stub_model_is_deterministic_per_seed_and_prompt() -> None:
    model = StubModel()
    prompt = "What is 37 * 3 - 8?"
    answers = [await model.complete(prompt, max_tokens=64, seed=f"s{i}") for i in range(50)]
    again = [await model.complete(prompt, max_tokens=64, seed=f"s{i}") for i in range(50)]
    assert answers == again
    assert len({a.text for a in answers}) > 1  # the seed matters
    other = await model.complete(prompt + " ", max_tokens=64, seed="s0")
    assert other == await model.complete(prompt + " ", max_tokens=64, seed="s0")
    assert all(a.model == "stub-arith-1" and a.prompt_tokens >= 1 for a in answers)


async def test_stub_model_style_follows_the_prompt() -> None:
    model = StubModel()
    for i in range(30):
        bare = await model.complete(
            "Reply with only the number. What is 12 * 12?", max_tokens=64, seed=str(i)
        )
        assert re.fullmatch(r"-?\d+", bare.text)
        assert bare.completion_tokens == 1
        chatty = await model.complete("What is 12 * 12?", max_tokens=64, seed=str(i))
        assert re.fullmatch(r"Let me see\. The answer is -?\d+\.", chatty.text)
    clipped = await model.complete("What is 1 + 1?", max_tokens=3, seed="x")
    assert clipped.text == "Let me see."
    assert clipped.completion_tokens == 3


async def test_working_step_by_step_makes_fewer_mistakes() -> None:
    model = StubModel()
    question = "What is (17 + 4) * 3 - 9?"
    expected = 54

    async def correct(prompt: str) -> float:
        hits = 0
        for i in range(400):
            done = await model.complete(prompt, max_tokens=64, seed=f"seed-{i}")
            hits += re.findall(r"-?\d+", done.text)[-1] == str(expected)
        return hits / 400

    plain = await correct(question)
    careful = await correct(f"Think step by step. {question}")
    assert careful >= 0.85
    assert plain <= 0.75
    assert plain >= 0.5  # it is wrong sometimes, not always


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2 + 3 * 4", 14),
        ("2 * 3 + 4", 10),
        ("(2 + 3) * 4", 20),
        ("What is 8 - 8 * 10?", -72),
        ("What is 7 - 10?", -3),
        ("-3 * -2", 6),
        ("10 - -2", 12),
        ("-(3 + 4) * 2", -14),
        ("10 - 2 - 3", 5),
        ("2 * (3 + (4 - 1))", 12),
        ("((1 + 2) * (3 + 4))", 21),
        ("Step 1: what is (12 - 4) * 3 + 2?", 26),
        ("(the sum is 3 + 4)", 7),
        ("((2 + 3))", 5),
    ],
)
def test_solve_handles_precedence_parentheses_and_negatives(text: str, value: int) -> None:
    assert solve(text) == value


@pytest.mark.parametrize("text", ["Say hello.", "", "no maths here (none at all)"])
async def test_no_arithmetic_gets_a_polite_non_answer(text: str) -> None:
    assert solve(text) is None
    done = await StubModel().complete(text, max_tokens=64, seed="s")
    assert done.text == "I could not find a problem to solve."
    bare = await StubModel().complete(f"{text} Only the number.", max_tokens=64, seed="s")
    assert bare.text == "I could not find a problem to solve."
