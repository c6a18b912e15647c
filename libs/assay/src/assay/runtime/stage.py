"""What a stage is, and the unit of work its handlers receive (DESIGN §3).

A handler is written once: it gets a decoded message and a unit of work,
records events (the stage's fold derives its state from them) and emits
messages into the outbox — committed together with the consumer position and
the inbox entry. Nothing in a handler knows which mode it runs in.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import enum
import re
import typing
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from assay.bus.topics import TENANTS, TOPICS, topic_for
from assay.crash import crash_point, crash_points_armed
from assay.engine.models import Model
from assay.engine.retention import RetentionPolicy
from assay.engine.tools import Tool
from assay.grading.calibration_policy import CalibrationPolicy
from assay.grading.judges import Judge
from assay.grading.ladder import LadderPolicy
from assay.grading.proposers import CatalogProposer, ProposalPolicy, Proposer
from assay.grading.replay import ReplayPolicy
from assay.grading.sprt import SprtPolicy
from assay.grading.strategies import GradingPolicy, GradingStrategy, builtin_strategies
from assay.kernel.canonical import canonical_bytes, digest
from assay.kernel.errors import Refused
from assay.kernel.ids import Lsn, TenantId
from assay.kernel.schema import Versioned
from assay.messages.envelope import Envelope, message_id, seal
from assay.messages.tenants import TenantDeleted
from assay.record.erasure import TenantErased, with_erasure
from assay.record.events import BranchKey, Event, EventRegistry, LogRecord
from assay.record.state import DocumentTable, Fold, ReadModel
from assay.runtime.admission import Admission
from assay.runtime.leases import DEFAULT_LEASE_TTL_S, new_worker_id
from assay.runtime.tenant_deletion import tenant_deletion
from assay.runtime.tracing import current_traceparent
from assay.sandbox.port import SandboxProvider, SuspendPolicy
from assay.store.inline_blobs import DEFAULT_INLINE_MAX_BYTES
from assay.store.ports import BlobStore, Checkpoint, CommitBatch, EventLog, Lease, OutboxEntry
from assay.verification.verifiers import Verifier
from assay.workflow.ir import BUILTIN_VERIFIER_KINDS

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from assay.runtime.signals import Signals

Handler = Callable[[Any, "UnitOfWork[Any]"], Awaitable[None]]
Background = Callable[[EventLog, asyncio.Event], Coroutine[Any, Any, None]]
"""A stage's background task: gets the stage's store and the stop event."""


@dataclass(frozen=True)
class Gauge:
    """One gauge a stage derives from its state for `/metrics`: name, help, label
    names, and a value per label tuple."""

    name: str
    help: str
    labels: tuple[str, ...]
    samples: tuple[tuple[tuple[str, ...], float], ...]


Gauges = Callable[[EventLog], Awaitable[Sequence[Gauge]]]
"""Reads a stage's committed state (every tenant's) into gauges, when `/metrics` is read."""


@dataclass(frozen=True)
class StageQuery:
    """A read-only query a stage answers over its own store: `GET` paths that match
    `pattern` are answered by `answer(log, match)` with a status and a JSON document."""

    pattern: re.Pattern[str]
    answer: Callable[[EventLog, re.Match[str]], Awaitable[tuple[int, object]]]


@dataclass(frozen=True)
class StageSpec:
    """A stage: its name, its log's event types and fold, and its handlers.

    `handlers` maps topic -> message type -> handler.
    """

    name: str
    events: EventRegistry
    fold: Fold
    handlers: dict[str, dict[str, Handler]]
    deps: Any = None
    """What the stage's handlers share, handed to each unit of work as `uow.deps`."""
    background: tuple[Background, ...] = ()
    """Housekeeping that runs beside the consumers while the stage runs (timers)."""
    gauges: Gauges | None = None
    """Gauges derived from the stage's state, exported on `/metrics` (read when scraped)."""
    tables: tuple[DocumentTable, ...] = ()
    """Tables its store keeps in step with some kinds of its documents, for the stage's
    own filtered, paged queries."""
    metrics: tuple[CollectorRegistry, ...] = ()
    """Metrics the stage keeps itself (beside the §15 signals), exported on `/metrics`."""
    queries: tuple[StageQuery, ...] = ()
    """Read-only queries the stage answers on its HTTP port, for what only it holds (the
    console asks execute for a run's log)."""
    sandbox: SandboxProvider | None = None
    """Where the stage's workspaces are (execute's tools, verify's commands): a tenant's
    deletion removes the tenant's."""

    def __post_init__(self) -> None:
        """Every stage takes part in a tenant's deletion (`assay.runtime.tenant_deletion`):
        its log registers and folds the tombstone, and it handles `TenantDeleted`."""
        self.events.register(TenantErased)
        object.__setattr__(self, "fold", with_erasure(self.fold))
        handlers = {topic: dict(by_type) for topic, by_type in self.handlers.items()}
        own = handlers.setdefault(TENANTS, {})
        own.setdefault(TenantDeleted.type, tenant_deletion(self.name, self.sandbox))
        object.__setattr__(self, "handlers", handlers)

    @property
    def topics(self) -> list[str]:
        """Topics the stage consumes."""
        return sorted(self.handlers)


@dataclass
class StageDeps:
    """What stage factories may use. Ports, with working defaults chosen by the runtime.

    `sandbox` is where tools and command verifiers run (None: nowhere — they
    are refused and fail closed); `verifiers` are the verifier kinds installed
    packages register, beside the built-in ones; `retention` says when finished
    runs are reduced and tiered.
    """

    blobs: BlobStore
    model: Model
    judge: Judge
    tools: dict[str, Tool]
    sprt: SprtPolicy = field(default_factory=SprtPolicy)
    shadow_rate: float = 1.0
    ladder: LadderPolicy = field(default_factory=LadderPolicy)
    """The promotion ladder's policy and the held-out fraction (§12.3, §12.5)."""
    worker: str = field(default_factory=new_worker_id)
    """This process's identity as a lease holder."""
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    """How long a run's lease lasts without a heartbeat."""
    episode_inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES
    """Execute carries an episode of at most this many bytes inline in `RunExecuted`."""
    checkpoint_every: int = 64
    """Execute checkpoints a run's drive every this many records (0: never)."""
    sandbox: SandboxProvider | None = None
    verifiers: dict[str, Verifier] = field(default_factory=dict)
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    """When finished runs are reduced and tiered (§8.6)."""
    grading: GradingPolicy = field(default_factory=GradingPolicy)
    """Grading's capacity, per-tenant judge-call ceilings and order-check sampling."""
    calibration: CalibrationPolicy = field(default_factory=CalibrationPolicy)
    """When each tenant's judge is calibrated against the verifier, and what holds promotion."""
    replay: ReplayPolicy = field(default_factory=ReplayPolicy)
    """Per-tenant ceilings on the model calls shadow runs reserve (§12.4, §14.1)."""
    proposer: Proposer = field(default_factory=CatalogProposer)
    """The slow loop's generator: drafts a new version when a challenger's time ends."""
    proposals: ProposalPolicy = field(default_factory=ProposalPolicy)
    """Which tenants' proposals skip the operator's approval."""
    admission: Admission = field(default_factory=lambda: Admission(None))
    """Capacity checks at registration and admission (§14.2); none without a declaration."""
    suspend: SuspendPolicy | None = None
    """Resident sandboxes, released while runs wait (DESIGN §16); None: off."""
    strategies: Mapping[str, GradingStrategy] = field(default_factory=builtin_strategies)
    """Grading strategies a workflow may name, by name: built-in and installed ones."""

    @property
    def verifier_kinds(self) -> frozenset[str]:
        """Verifier kinds a workflow may use here: built-in ones and installed ones."""
        return BUILTIN_VERIFIER_KINDS | frozenset(self.verifiers)


StageFactory = Callable[[StageDeps], StageSpec]


class HandlerInvalid(TypeError):
    """A handler whose message type cannot be routed (unannotated, or on no topic)."""


def routes(*handlers: Handler) -> dict[str, dict[str, Handler]]:
    """`StageSpec.handlers` from handlers' annotations: each handler's first parameter
    names its message type, and the one topic carrying that type is its route.

    Raises:
        HandlerInvalid: a handler's message parameter is unannotated or its type rides no
            topic, or two handlers take the same type.
    """
    table: dict[str, dict[str, Handler]] = {}
    for handler in handlers:
        msg_type = _message_type(handler)
        topic = next((t.name for t in TOPICS.values() if msg_type in t.carries), None)
        if topic is None:
            raise HandlerInvalid(f"{handler.__qualname__}: no topic carries {msg_type.__name__}")
        by_type = table.setdefault(topic, {})
        if msg_type.type in by_type:
            raise HandlerInvalid(f"two handlers take {msg_type.__name__}")
        by_type[msg_type.type] = handler
    return table


def _message_type(handler: Handler) -> type[Versioned]:
    target = getattr(handler, "__func__", handler)  # a bound method's function
    hints = typing.get_type_hints(target)
    params = [p for p in target.__code__.co_varnames[: target.__code__.co_argcount] if p != "self"]
    msg_type = hints.get(params[0]) if params else None
    if not (isinstance(msg_type, type) and issubclass(msg_type, Versioned)):
        raise HandlerInvalid(f"{handler.__qualname__}: its first parameter names no message type")
    return msg_type


D = TypeVar("D")
M = TypeVar("M", bound=ReadModel)


@dataclass
class _Pending:
    """What a unit of work (and every fenced view of it) will write at its next commit."""

    records: list[tuple[BranchKey, Event]] = field(default_factory=list)
    outbox: list[OutboxEntry] = field(default_factory=list)
    messages: list[Versioned] = field(default_factory=list)
    expect: list[tuple[BranchKey, Lsn]] = field(default_factory=list)
    fence: Lease | None = None
    erase: TenantId | None = None
    taken: list[Versioned] = field(default_factory=list)
    committed: int = 0
    undo: list[Callable[[], None]] = field(default_factory=list)
    """What to undo if the pending writes are dropped (`UnitOfWork.on_discard`)."""
    then: list[Callable[[], None]] = field(default_factory=list)
    """What to do once the pending writes are committed (`UnitOfWork.on_landed`)."""
    taken_then: list[Callable[[], None]] = field(default_factory=list)


class UnitOfWork(Generic[D]):
    """One message's transaction: records, outbox, position and inbox, all or none.

    `deps` is what the stage's handlers share (the stage declares its type:
    `VerifyUnitOfWork = UnitOfWork[Verifying]`). Part-way commits are explicit:
    `async with uow.step(): ...` makes what the block records and emits durable
    at its end; the consumer position and inbox entry ride only on the message's
    final commit, so a crash redelivers the message and the handler resumes from
    what it committed. Writes made through `uow.fenced(lease)` are checked against
    that lease in whichever commit carries them.
    """

    def __init__(
        self,
        stage: str,
        log: EventLog,
        blobs: BlobStore,
        envelope: Envelope,
        on_commit: Callable[[], None] | None = None,
        emitted: Counter[str] | None = None,
        *,
        partition: int = 0,
        deps: D = None,  # type: ignore[assignment]  # a stage without shared deps has None
        signals: Signals | None = None,
    ) -> None:
        self.stage = stage
        self.partition = partition
        """The partition of the topic the message came from: one consumer handles it at a
        time, so state kept per partition has one writer."""
        self.deps: D = deps
        self._on_commit = on_commit
        self.log = log
        self.blobs = blobs
        self.envelope = envelope
        self._pending = _Pending()
        self._fence: Lease | None = None
        self.emitted = emitted if emitted is not None else Counter()
        self._signals = signals

    @property
    def tenant(self) -> TenantId:
        """Tenant of the message being handled."""
        return self.envelope.tenant

    @property
    def signals(self) -> Signals | None:
        """The process's §15 signals, for a count that no committed message carries (call
        it from `on_landed`, so a redelivered message counts once); None where nothing
        keeps them."""
        return self._signals

    def landed(self) -> None:
        """The batch the last `take()` handed over is committed: count what it emitted
        (the §15 signals derive from committed messages only)."""
        taken, then = self._pending.taken, self._pending.taken_then
        self._pending.taken_then = []
        self.emitted.update(m.type for m in taken)
        if self._signals is not None and taken:
            now = datetime.now(UTC)
            self._signals.landed(self.stage, taken, self.envelope.occurred_at, now)
        for step in then:
            step()

    @property
    def committed(self) -> int:
        """Part-way commits made so far."""
        return self._pending.committed

    def fenced(self, lease: Lease) -> UnitOfWork[D]:
        """This unit of work, writing under `lease`: whatever it records or emits is
        committed only while `lease` is still the stream's (a view; pending writes are
        shared with `self`)."""
        view = copy.copy(self)
        view._fence = lease
        return view

    def released(self) -> UnitOfWork[D]:
        """This unit of work once its lease is given up: nothing pending or written through
        the view is checked against a lease any more (a suspended run's bookkeeping)."""
        view = copy.copy(self)
        view._fence = None
        self._pending.fence = None
        return view

    def _touch(self) -> None:
        if self._fence is not None:
            self._pending.fence = self._fence

    def record(self, key: BranchKey, event: Event) -> None:
        """Append `event` to a stream at the next commit. Tenant must match the message's."""
        if key.tenant != self.tenant:
            raise Refused(
                f"stage {self.stage}: a {self.tenant} message cannot write to tenant {key.tenant}"
            )
        self._touch()
        self._pending.records.append((key, event))

    def erase(self) -> None:
        """Delete every row the stage holds of this tenant at the next commit, before what
        the commit writes (`CommitBatch.erase`): a tenant's deletion."""
        self._pending.erase = self.tenant

    def expect(self, key: BranchKey, end: Lsn) -> None:
        """Compare-and-swap: the next commit lands only if stream `key` still ends at
        `end` (it must append there too); otherwise it raises `StreamChanged`, writes
        nothing, and the consumer runs the handler again on what is there now."""
        self._own(key)
        self._pending.expect.append((key, end))

    def emit(self, topic: str, msg: Versioned, *, occurrence: int = 0) -> None:
        """Enqueue `msg` on `topic` at the next commit, keyed as the topic defines.

        Its id derives from the handled message and its content, so a handler run again
        emits it under the same id. `occurrence` tells apart equal messages that are
        distinct facts — two model calls that cost the same — the first being 0 (whose
        id is the same as without it).
        """
        entry = self.sealed(topic, msg, occurrence=occurrence)
        self._touch()
        self._pending.outbox.append(entry)
        self._pending.messages.append(msg)

    def sealed(self, topic: str, msg: Versioned, *, occurrence: int = 0) -> OutboxEntry:
        """`msg` as `emit` would enqueue it, for a commit the handler makes itself with
        `EventLog.commit` (one that must carry it atomically with what it writes)."""
        spec = topic_for(topic, msg)
        # The payload is dumped and encoded once: its canonical bytes give the hash
        # that names the message and are the payload of the wire body.
        payload = msg.model_dump(mode="json")
        body = canonical_bytes(payload)
        parts = (self.stage, self.envelope.id, msg.type, digest(body))
        env = seal(
            msg,
            tenant=self.tenant,
            key=spec.key(msg),
            id=message_id(*parts, *((str(occurrence),) if occurrence else ())),
            causation=self.envelope,
            traceparent=current_traceparent(),
            payload=payload,
        )
        return OutboxEntry(topic, env.key, env.encode(payload=body), tuple(env.headers()))

    def on_discard(self, undo: Callable[[], None]) -> None:
        """Call `undo` if the pending writes are dropped instead of committed (the handler
        failed): what the handler did outside the transaction, such as holding capacity
        for runs it was about to spawn, is undone with them."""
        self._pending.undo.append(undo)

    def on_landed(self, then: Callable[[], None]) -> None:
        """Call `then` once the pending writes are committed, and never if they are
        dropped: a count kept outside the transaction (a refusal, say) then counts a
        redelivered message once."""
        self._pending.then.append(then)

    def emit_raw(self, entry: OutboxEntry) -> None:
        """Enqueue an already-encoded entry (dead letters)."""
        self._pending.outbox.append(entry)

    async def get(self, model: type[M], key: str) -> M | None:
        """A committed derived document of this tenant, as its read model."""
        doc = await self.log.get(model.at(self.tenant, key))
        return None if doc is None else model.model_validate(doc)

    async def scan(self, model: type[M], prefix: str = "") -> list[tuple[str, M]]:
        """Committed derived documents of this tenant, by key prefix, as read models."""
        found = await self.log.scan(self.tenant, model.kind, prefix)
        return [(key, model.model_validate(doc)) for key, doc in found]

    async def history(self, key: BranchKey) -> list[LogRecord]:
        """Every committed record of one stream of this tenant."""
        self._own(key)
        return await self.log.read(key)

    async def history_after(self, key: BranchKey, upto: Lsn) -> list[LogRecord]:
        """The records of one stream of this tenant after LSN `upto`."""
        self._own(key)
        return await self.log.read(key, Lsn(upto + 1))

    async def latest_checkpoint(self, key: BranchKey) -> Checkpoint | None:
        """The newest checkpoint of one stream of this tenant."""
        self._own(key)
        return await self.log.latest_checkpoint(key)

    async def put_checkpoint(self, key: BranchKey, upto: Lsn, state: bytes) -> None:
        """Store a checkpoint of one stream of this tenant (outside the message's commit)."""
        self._own(key)
        await self.log.put_checkpoint(key, upto, state)

    def _own(self, key: BranchKey) -> None:
        if key.tenant != self.tenant:
            raise Refused(f"stage {self.stage}: a {self.tenant} message cannot read {key.tenant}")

    defers = True
    """As the engine's `Journal`: what it defers rides with this unit's next commit."""

    async def defer(
        self, key: BranchKey, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        """Record and emit at the next commit, whatever makes it (the engine's deferred
        Pure attempts): at the latest, the handler's own final commit."""
        for event in events:
            self.record(key, event)
        for topic, msg in emits:
            self.emit(topic, msg)

    async def record_and_commit(
        self, key: BranchKey, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        """Record, emit and commit now, in one commit (the engine's `Journal`)."""
        for event in events:
            self.record(key, event)
        for topic, msg in emits:
            self.emit(topic, msg)
        await self.commit()

    @contextlib.asynccontextmanager
    async def step(self) -> AsyncIterator[None]:
        """A part-way commit: what is pending when the block ends — what it recorded and
        emitted, and anything pending before it — is committed then, before the handler
        goes on. Nothing is committed if the block raises."""
        yield
        await self.commit()

    async def commit(self) -> list[Lsn]:
        """Commit what is pending (without position or inbox).

        Crash points `<stage>.before_commit.<label>` and `<stage>.after_commit.<label>`
        surround the commit, `<label>` naming what it writes (`commit_label`).
        """
        batch = self.take()
        label = commit_label(batch.records) if crash_points_armed() else None
        if label is not None:
            crash_point(f"{self.stage}.before_commit.{label}")
        lsns = await self.log.commit(batch)
        if label is not None:
            crash_point(f"{self.stage}.after_commit.{label}")
        self.landed()
        self._pending.committed += 1
        if batch.outbox and self._on_commit is not None:
            self._on_commit()
        return lsns

    def take(self, **final: Any) -> CommitBatch:
        """Hand the pending writes over as a batch (the runner adds position and inbox)."""
        p = self._pending
        batch = CommitBatch(
            records=p.records,
            outbox=p.outbox,
            fence=p.fence,
            expect=p.expect,
            erase=p.erase,
            **final,
        )
        p.taken, p.taken_then = p.messages, p.then
        p.records, p.outbox, p.messages, p.expect, p.fence = [], [], [], [], None
        p.erase = None
        p.undo, p.then = [], []
        return batch

    def discard(self) -> None:
        """Drop pending writes (a refused message writes only its dead letter), undoing
        what was registered with `on_discard` since the last commit."""
        p = self._pending
        p.records, p.outbox, p.messages, p.expect, p.fence = [], [], [], [], None
        p.erase = None
        undo, p.undo, p.then = p.undo, [], []
        for step in reversed(undo):
            step()


def commit_label(records: Sequence[tuple[BranchKey, Event]]) -> str:
    """What a commit writes, as the last part of its crash points' names.

    Each record is named by its event type, qualified by the event's `state`
    when that is an enum and by its `effect` when that is a string — so an
    intent reads `Intent.dispatched.unsafe` and an attempt's end
    `AttemptFinished.succeeded`. A commit of several records joins their
    names, in order and without repeats, with `+`
    (`Intent.committed.idempotent+AttemptFinished.succeeded`); a commit of
    outbox rows alone is `outbox`.
    """
    names: list[str] = []
    for _, event in records:
        name = event.type
        state = getattr(event, "state", None)
        if isinstance(state, enum.Enum):
            name += f".{state.value}"
        effect = getattr(event, "effect", None)
        if isinstance(effect, str):
            name += f".{effect}"
        if name not in names:
            names.append(name)
    return "+".join(names) or "outbox"
