"""Runs one stage: a consumer loop per assigned partition, plus the outbox relay.

Positions live in the stage's own store and advance in the handler's commit,
so a restart resumes exactly after the last committed message. Poison input —
undecodable, of an unknown schema, refused by the handler, or failing every
retry — goes to `assay.dlq.<stage>` with the reason, and the position moves on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter

from pydantic import ValidationError

from assay.bus.headers import DLQ_REASON
from assay.bus.relay import OutboxRelay
from assay.bus.topics import TENANTS, dlq
from assay.bus.transport import BusMessage, Measured, Source, Sparse
from assay.crash import crash_point
from assay.kernel.errors import Refused
from assay.kernel.ids import TenantId
from assay.kernel.schema import UnknownSchema, one_line
from assay.kernel.waiting import sleep_or
from assay.messages import MAX_MESSAGE_BYTES, MESSAGES, TaskSubmitted
from assay.messages.envelope import Envelope, message_id, open_envelope, seal
from assay.messages.tenants import TenantDeleted
from assay.record.erasure import ERASED_KIND
from assay.runtime.retention import StageRetention
from assay.runtime.signals import Signals
from assay.runtime.stage import Background, Handler, StageSpec, UnitOfWork
from assay.runtime.tracing import handling
from assay.runtime.vitals import Vitals
from assay.store.faults import Outage, is_outage
from assay.store.ports import (
    BlobStore,
    CommitBatch,
    ConsumerPosition,
    DuplicateMessage,
    EventLog,
    LeaseLost,
    OutboxEntry,
    StaleFence,
    StreamChanged,
)

log = logging.getLogger(__name__)

RETRIES = 3
CONFLICTS = 20
"""Times a handler runs again because another writer changed what it read
(`StreamChanged`: a compare-and-swap that lost); these do not count as failures."""
ERASED_REFRESH_S = 5.0
"""How often a stage re-reads which tenants were deleted: another replica of the stage may
have carried a deletion out (its own it learns at once)."""


def decode(m: BusMessage) -> tuple[Envelope, object]:
    """Envelope and payload of a record.

    A bare `TaskSubmitted` JSON object on `assay.tasks` (what a producer with
    any Kafka client writes) is accepted and wrapped in an envelope; the size
    limit applies to it too.

    Raises:
        Refused: the bytes are not a message this code can read, or the
            payload's tenant is not the envelope's.
    """
    try:
        env = open_envelope(m.value)
    except Refused:
        if m.topic != "assay.tasks" or len(m.value) > MAX_MESSAGE_BYTES:
            raise
        env = _wrap_bare_task(m)
    try:
        msg = MESSAGES.decode(env.type, env.schema_version, env.payload)
    except UnknownSchema as exc:
        raise Refused(str(exc)) from exc
    run = getattr(msg, "run", None)
    tenant = getattr(msg, "tenant", None) or getattr(run, "tenant", None)
    if tenant is not None and tenant != env.tenant:
        raise Refused(f"{env.type} tenant {tenant} differs from the envelope's tenant {env.tenant}")
    return env, msg


def _wrap_bare_task(m: BusMessage) -> Envelope:
    try:
        doc = json.loads(m.value)
    except (ValueError, RecursionError) as exc:
        raise Refused(f"not JSON: {exc}") from exc
    try:
        task = TaskSubmitted.model_validate(doc)
    except ValidationError as exc:
        raise Refused(f"neither an envelope nor a TaskSubmitted: {one_line(exc)}") from exc
    return seal(
        task,
        tenant=task.tenant,
        key=m.key,
        id=message_id("producer", str(task.tenant), task.idempotency_key),
        causation=None,
        traceparent=_header(m, "traceparent"),  # the producer's trace, continued if valid
    )


def _header(m: BusMessage, name: str) -> str | None:
    value = next((v for k, v in m.headers if k == name), None)
    return value.decode("ascii", "replace") if value is not None else None


class StageRunner:
    """Consumes a stage's topics from a `Source` and relays its outbox."""

    def __init__(
        self,
        spec: StageSpec,
        log_: EventLog,
        blobs: BlobStore,
        relay: OutboxRelay,
        source: Source | None = None,
        vitals: Vitals | None = None,
        signals: Signals | None = None,
        retention: StageRetention | None = None,
    ) -> None:
        self.spec = spec
        self.retention = retention
        """The stage's retention sweep (inbox, records), run beside the consumers."""
        self.signals = signals if signals is not None else Signals()
        """The process's §15 signals (shared by every runner of an embedded process)."""
        self.vitals = vitals or Vitals(unready_after_s=15.0, exit_after_s=0.0)
        self.log = log_
        self.blobs = blobs
        self.relay = relay
        self.source = source
        self.handled = 0
        self.duplicates = 0
        """Messages skipped because the inbox had them: redeliveries, re-publishes."""
        self.dead_lettered = 0
        self.abandoned = 0
        """Messages given up because another worker took their run over."""
        self.emitted: Counter[str] = Counter()
        """Messages committed to the outbox, by type (alerts are counted from it)."""
        self._started = f"{spec.name}.started"
        """Crash point as the stage starts consuming and relaying (traced: when it came up)."""
        self._before_final = f"{spec.name}.before_final_commit"
        self._after_final = f"{spec.name}.after_final_commit"
        """Crash points around a handler's last commit (position, inbox, outbox)."""
        self.erased: set[TenantId] | None = None
        """Tenants deleted here (their tombstones), whose messages the stage refuses;
        read from the store on first use."""

    async def run(self, stop: asyncio.Event) -> None:
        """Consume and relay until `stop` is set."""
        if self.source is None:
            raise RuntimeError(f"stage {self.spec.name} has no source to consume from")
        crash_point(self._started)
        relay = asyncio.create_task(self.relay.run(stop), name=f"{self.spec.name}-relay")
        background = [*self.spec.background, self._watch_erased]
        if self.retention is not None:
            background.append(self.retention.run)
        chores = [
            asyncio.create_task(self._keep(task, stop), name=f"{self.spec.name}-background")
            for task in background
        ]
        try:
            await self.source.consume(self.spec.topics, self.handle, self.log.positions, stop)
        finally:
            stop.set()
            await relay
            await asyncio.gather(*chores, return_exceptions=True)

    async def lag(self) -> dict[tuple[str, int], int]:
        """Records not yet handled, per partition the source holds: its end offset minus
        the position stored in this stage's own commits, moved past the offsets a deleted
        tenant's records left empty (empty if the source cannot say)."""
        source: object = self.source  # a Source may also be Measured
        if not isinstance(source, Measured):
            return {}
        ends = await source.end_offsets(self.spec.topics)
        stored = await self.log.positions()
        if isinstance(source, Sparse):  # a hole after the position is nothing to handle
            stored = await source.next_present({tp: stored.get(tp, 0) for tp in ends})
        return {tp: max(0, end - stored.get(tp, 0)) for tp, end in ends.items()}

    async def _read_erased(self) -> set[TenantId]:
        self.erased = {tenant for tenant, _, _ in await self.log.scan_kind(ERASED_KIND)}
        return self.erased

    async def _watch_erased(self, _log: EventLog, stop: asyncio.Event) -> None:
        """Re-read the deleted tenants every `ERASED_REFRESH_S` until `stop`."""
        while not stop.is_set():
            await self._read_erased()
            await sleep_or(stop, ERASED_REFRESH_S)

    async def _keep(self, task: Background, stop: asyncio.Event) -> None:
        """Run a background task until `stop`; if a service it needs is away, run it
        again after a backoff (a timer that died would never fire again)."""
        backoff = 0.5
        while not stop.is_set():
            try:
                await task(self.log, stop)
                return
            except Exception as exc:
                log.warning("stage %s: background task failed (%r); again", self.spec.name, exc)
            await sleep_or(stop, backoff)
            backoff = min(backoff * 2, 10.0)

    async def handle(self, m: BusMessage) -> None:
        """Handle one record exactly once at the fold; never raises for bad input.

        Raises:
            Outage: a service the stage needs could not be reached; the record was not
                handled and goes again (the consumer rewinds to it and backs off).
        """
        try:
            await self._handle(m)
        except Exception as exc:
            if not is_outage(exc):
                raise
            what = f"{type(exc).__name__}: {exc}"
            self.vitals.handling.failed(what, self.vitals.clock())
            raise Outage(
                f"stage {self.spec.name}: {m.topic}/{m.partition}@{m.offset}: {what}"
            ) from exc
        self.vitals.handling.ok()

    async def _handle(self, m: BusMessage) -> None:
        position = ConsumerPosition(m.topic, m.partition, m.offset + 1)
        try:
            env, msg = decode(m)
        except Refused as exc:
            await self._dead_letter(m, position, exc.reason)
            return
        handler = self.spec.handlers.get(m.topic, {}).get(env.type)
        if handler is None:  # a type this stage does not act on (e.g. Promoted for ingest)
            await self._commit(CommitBatch(position=position))
            return
        erased = self.erased if self.erased is not None else await self._read_erased()
        if env.tenant in erased and m.topic != TENANTS:
            reason = f"tenant {env.tenant} was deleted: its messages are refused"
            await self._dead_letter(m, position, reason)
            return
        if await self.log.seen(env.tenant, env.id):
            await self._commit(CommitBatch(position=position))
            self.duplicates += 1
            return
        with handling(self.spec.name, env, m.topic, m.partition):
            await self._attempts(m, env, msg, handler, position)
        if isinstance(msg, TenantDeleted) and self.erased is not None:
            self.erased.add(env.tenant)

    async def _attempts(
        self,
        m: BusMessage,
        env: Envelope,
        msg: object,
        handler: Handler,
        position: ConsumerPosition,
    ) -> None:
        """Run the handler until it commits, is refused, or fails every retry."""
        attempt = conflicts = 0
        started = time.perf_counter()
        while attempt < RETRIES:
            attempt += 1
            uow = UnitOfWork(
                self.spec.name,
                self.log,
                self.blobs,
                env,
                self.relay.wake.set,
                self.emitted,
                partition=m.partition,
                deps=self.spec.deps,
                signals=self.signals,
            )
            try:
                await handler(msg, uow)
                final = uow.take(position=position, inbox=(env.tenant, env.id))
                crash_point(self._before_final)
                await self._commit(final)
                crash_point(self._after_final)
                uow.landed()
                self.handled += 1
                self.signals.handled(self.spec.name, env.type, time.perf_counter() - started)
                return
            except DuplicateMessage:
                await self._commit(CommitBatch(position=position))
                self.duplicates += 1
                return
            except (StaleFence, LeaseLost) as exc:
                # Another worker took the run over and owns its outcome; this one
                # writes nothing more for it (not even the position).
                uow.discard()
                self.abandoned += 1
                log.warning(
                    "stage %s: abandoned %s/%d@%d: %s",
                    self.spec.name,
                    m.topic,
                    m.partition,
                    m.offset,
                    exc,
                )
                return
            except Refused as exc:
                uow.discard()
                await self._dead_letter(m, position, exc.reason)
                return
            except StreamChanged as exc:
                # Another writer moved what the handler read (a lost compare-and-swap):
                # it runs again on what is there now. Someone made progress, so this
                # is bounded by contention, not by failure.
                uow.discard()
                conflicts += 1
                if conflicts > CONFLICTS:
                    await self._dead_letter(
                        m, position, f"lost {CONFLICTS} compare-and-swaps in a row: {exc}"
                    )
                    return
                attempt -= 1
                log.info("stage %s: %s; handling %s again", self.spec.name, exc, env.type)
            except Exception as exc:
                uow.discard()
                if is_outage(exc):  # not the message's fault: it goes again, uncounted
                    raise
                log.warning(
                    "stage %s: handler failed on %s/%d@%d (attempt %d/%d)",
                    self.spec.name,
                    m.topic,
                    m.partition,
                    m.offset,
                    attempt,
                    RETRIES,
                    exc_info=True,
                )
                if attempt == RETRIES:
                    await self._dead_letter(
                        m, position, f"handler failed {RETRIES} times: {type(exc).__name__}: {exc}"
                    )
                    return
                await asyncio.sleep(0.05 * 2**attempt)

    async def _dead_letter(self, m: BusMessage, position: ConsumerPosition, reason: str) -> None:
        log.warning(
            "stage %s: dead-lettering %s/%d@%d: %s",
            self.spec.name,
            m.topic,
            m.partition,
            m.offset,
            reason,
        )
        headers = (
            *m.headers,
            (DLQ_REASON, reason.encode()),
            ("assay-dlq-stage", self.spec.name.encode()),
            ("assay-dlq-source", f"{m.topic}/{m.partition}/{m.offset}".encode()),
        )
        entry = OutboxEntry(dlq(self.spec.name), m.key, m.value, headers)
        await self._commit(CommitBatch(position=position, outbox=[entry]))
        self.dead_lettered += 1

    async def _commit(self, batch: CommitBatch) -> None:
        await self.log.commit(batch)
        if batch.outbox:
            self.relay.wake.set()
