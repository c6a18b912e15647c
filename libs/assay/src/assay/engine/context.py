"""What the driver keeps while it drives one run: its replay, totals, cancel scope.

Replay is per step: a step's records (attempt starts, intents, attempt ends,
routing decisions) are consumed in the order they were committed, whatever
other steps committed in between — parallel branches interleave in the log,
each branch's own records never do.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from assay.kernel.ids import BranchId, Lsn, StepId
from assay.kernel.schema import Versioned
from assay.messages.episode import AttemptView
from assay.messages.models import Purpose, RunRef, Usage
from assay.record.events import BranchKey, Event, LogRecord
from assay.sandbox.port import Workspace
from assay.store.ports import Checkpoint
from assay.workflow.ir import WorkflowDef

E = TypeVar("E", bound=Event)
T = TypeVar("T")


class Journal(Protocol):
    """Where the driver reads history and durably appends (one commit per call)."""

    async def history(self, key: BranchKey) -> list[LogRecord]:
        """Every record of the branch, in LSN order."""
        ...

    async def record_and_commit(
        self, key: BranchKey, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        """Commit `events` (and messages to emit with them) in one durable commit."""
        ...


@runtime_checkable
class DeferringJournal(Journal, Protocol):
    """A journal that can hold records for its next commit, whatever makes it (§8.4)."""

    defers: bool
    """Whether `defer` holds records (False: the journal has no later commit it knows
    of, and the driver commits them at once)."""

    async def defer(
        self, key: BranchKey, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        """Hold `events` (and messages to emit with them) to ride with the next commit."""
        ...


@runtime_checkable
class CheckpointingJournal(Journal, Protocol):
    """A journal that also keeps checkpoints of a branch (an optimisation only)."""

    async def history_after(self, key: BranchKey, upto: Lsn) -> list[LogRecord]:
        """The branch's records after LSN `upto`, in LSN order."""
        ...

    async def latest_checkpoint(self, key: BranchKey) -> Checkpoint | None:
        """The newest checkpoint of the branch, if any."""
        ...

    async def put_checkpoint(self, key: BranchKey, upto: Lsn, state: bytes) -> None:
        """Store a checkpoint of the branch valid up to and including `upto`."""
        ...


@dataclass
class Tally:
    """How many records this drive appended (shared by a run and its branches)."""

    n: int = 0
    deferred: int = 0
    """Records handed to the journal to ride with its next commit, not yet counted in
    `n`: a checkpoint waits until this drive's next own commit has counted them."""


@dataclass(frozen=True)
class RunSpec:
    """What to run: the run, its pinned definition, its input, its branch."""

    ref: RunRef
    definition: WorkflowDef
    input: Mapping[str, Any]
    branch: BranchId
    children: Mapping[str, WorkflowDef] = field(default_factory=dict)
    """The sub-workflows the run calls, pinned when it was spawned (`child_key`)."""
    stream: str | None = None
    """The stream driven; None: the run's own (a sub-workflow has one inside the run)."""
    unavailable_tools: frozenset[str] = frozenset()
    """Tools this branch may not call (a branch delta): an attempt calling one fails."""
    plan: str | None = None
    """Text prepended to every model prompt this branch renders (a branch delta)."""

    @property
    def key(self) -> BranchKey:
        """The log key of this run's branch."""
        return BranchKey(self.ref.tenant, self.stream or self.ref.run_id, self.branch)

    @property
    def max_model_calls(self) -> int:
        """The run's model-call ceiling: the workflow's, or a rollout sibling's lower cap."""
        ceiling = self.definition.budget.max_model_calls
        rollout = self.ref.rollout
        if rollout is not None and rollout.max_model_calls is not None:
            return min(ceiling, rollout.max_model_calls)
        return ceiling

    @property
    def max_tokens(self) -> int | None:
        """A rollout sibling's token ceiling (None: the run has none)."""
        return self.ref.rollout.max_tokens if self.ref.rollout is not None else None

    @property
    def max_cost_usd(self) -> float | None:
        """A rollout sibling's cost ceiling in US dollars (None: the run has none)."""
        return self.ref.rollout.max_cost_usd if self.ref.rollout is not None else None

    @property
    def speculative(self) -> bool:
        """A rollout sibling or a shadow run: it makes no unsafe call that reaches outside its
        own sandbox workspace — N siblings would repeat the effect N times (§13; a sibling
        stages it, `assay.engine.staging`), and a shadow run re-executes a task the current
        version already served (§12.4)."""
        return self.ref.rollout is not None or self.ref.purpose is Purpose.SHADOW


class Cancelled(Exception):
    """Work stopped because its cancel scope was cancelled."""


class CancelScope:
    """A cancellation that reaches every child scope (a run, then its parallel branches)."""

    def __init__(self, parent: CancelScope | None = None) -> None:
        self._event = asyncio.Event()
        self.reason = ""
        self._children: list[CancelScope] = []
        self._racing: set[asyncio.Future[Any]] = set()
        if parent is not None:
            parent._children.append(self)
            if parent.cancelled:
                self.cancel(parent.reason)

    @property
    def cancelled(self) -> bool:
        """Whether this scope (or an ancestor) was cancelled."""
        return self._event.is_set()

    def cancel(self, reason: str) -> None:
        """Cancel this scope and its children (idempotent: the first reason stays)."""
        if self._event.is_set():
            return
        self.reason = reason
        self._event.set()
        for work in self._racing:
            work.cancel()
        for child in self._children:
            child.cancel(reason)

    def child(self) -> CancelScope:
        """A scope cancelled with this one, or on its own."""
        return CancelScope(self)

    async def race(self, work: Awaitable[T]) -> T:
        """Await `work`, or cancel it and raise `Cancelled` if the scope is cancelled first.

        The work runs as one task that `cancel` stops; whoever awaits the race being
        cancelled stops the work with it (awaiting a task passes the cancellation on).
        """
        task = asyncio.ensure_future(work)
        if self.cancelled:
            task.cancel()
        self._racing.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.cancelled and task.cancelled() and not (current and current.cancelling()):
                raise Cancelled(self.reason) from None
            raise  # whoever awaited the race was cancelled, not the scope
        finally:
            self._racing.discard(task)


class Replay:
    """The branch's committed records, consumed step by step as the driver re-walks them."""

    def __init__(self, events: list[Event]) -> None:
        self._by_step: dict[str, collections.deque[Event]] = collections.defaultdict(
            collections.deque
        )
        self._run: collections.deque[Event] = collections.deque()
        for ev in events:
            step = getattr(ev, "step", None)
            (self._by_step[step] if isinstance(step, str) else self._run).append(ev)

    def take(self, kind: type[E], step: StepId | None = None, **match: Any) -> E | None:
        """The next record of `step` (or of the run) if it is a `kind` matching `match`."""
        queue = self._run if step is None else self._by_step.get(step)
        if queue:
            ev = queue[0]
            if isinstance(ev, kind) and all(getattr(ev, k) == v for k, v in match.items()):
                queue.popleft()
                return ev
        return None

    def has(self, kind: type[Event]) -> bool:
        """Whether an unconsumed run-level record of `kind` remains."""
        return any(isinstance(ev, kind) for ev in self._run)


@dataclass
class Totals:
    """Usage and attempts of the run so far."""

    model_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attempts: list[AttemptView] = field(default_factory=list)

    def add(self, u: Usage) -> None:
        """Count an attempt's usage."""
        self.model_calls += u.model_calls
        self.prompt_tokens += u.prompt_tokens
        self.completion_tokens += u.completion_tokens

    def usage(self) -> Usage:
        """The run's usage."""
        return Usage(
            model_calls=self.model_calls,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
        )


@dataclass
class RunContext:
    """One drive of one run."""

    spec: RunSpec
    journal: Journal
    replay: Replay
    cancel: CancelScope
    totals: Totals = field(default_factory=Totals)
    outputs: dict[str, str] = field(default_factory=dict)
    succeeded: dict[str, bool] = field(default_factory=dict)
    timed_out: set[str] = field(default_factory=set)
    """Await steps whose wait ran out and that the run went past (`on_timeout: continue`)."""
    workspace: Workspace | None = None
    workspace_ref: str | None = None
    """The latest recorded snapshot of the run's workspace."""
    appended: Tally = field(default_factory=Tally)
    unwritten: dict[StepId, Event] = field(default_factory=dict)
    """Starts of Pure attempts in flight, by step: each rides with its attempt's end
    (shared by the run's parallel branches, which run different steps)."""
    resumed: bool = False
    """This drive found the stream's records on the log (it was stopped before): until
    one of its live attempts ends, a Pure attempt's start is committed ahead of the call,
    so a call that keeps killing the worker is on record and bounded (`MAX_INTERRUPTED`)."""
    recovered: bool = False
    """This drive found the stream's records on the log: it defers nothing, so a
    recovery makes progress commit by commit (see `record_later`)."""
    depth: int = 0
    """How deep in sub-workflows this stream is (the run itself: 0)."""
    root: RunContext | None = None
    """A sub-workflow's: the run's own stream's context (its sandbox's records go there)."""

    def template_context(self) -> dict[str, Any]:
        """What templates and conditions read: the task and the steps' outputs."""
        steps: dict[str, dict[str, Any]] = {
            k: {"output": v, "succeeded": True} for k, v in self.outputs.items()
        }
        for k, ok in self.succeeded.items():  # a step that did not succeed has no output
            steps.setdefault(k, {})["succeeded"] = ok
        return {"task": dict(self.spec.input), "steps": steps}

    async def record_and_commit(
        self, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        """Commit events to the run's branch."""
        await self.journal.record_and_commit(self.spec.key, *events, emits=emits)
        self.appended.n += len(events) + self.appended.deferred
        self.appended.deferred = 0

    async def record_later(
        self, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        """Append `events` with the journal's next commit, whatever makes it: the next
        write-ahead record, the run's end, its suspension. Only for what a crash may lose
        because recovery does it again — a Pure attempt (§8.4): consecutive Pure steps
        then cost one commit between them, not one each. A drive that recovered a
        stopped run, or a journal that cannot hold records, commits them now, so a step
        that keeps killing its worker is on record and bounded (`MAX_INTERRUPTED`)."""
        journal = self.journal
        if self.recovered or not (isinstance(journal, DeferringJournal) and journal.defers):
            await self.record_and_commit(*events, emits=emits)
            return
        await journal.defer(self.spec.key, *events, emits=emits)
        self.appended.deferred += len(events)
