"""Per-partition queues and workers under a FastStream Kafka subscriber (DESIGN §5).

FastStream hands a subscriber's records to one handler call at a time: one
partition's slow record would hold every other partition of the stage, and a
failure could only be retried by holding them all. So each assigned partition
gets a queue and a worker that handles its records strictly in offset order,
one at a time, while other partitions run concurrently (FastStream's own
`max_workers` mode instead opens one consumer per worker and takes a single
topic: ag2ai/faststream#2017). The fetch loop only *enqueues*: it never waits
for handling, and a partition is never paused while its records are handled,
so the loop can wait long for the next fetch and still take records the moment
one brings them. The same object is the subscriber's rebalance listener, so
every assignment seeks to the positions the stage stored in its own commits;
Kafka's group offsets are a hint only.

This is the narrowest piece FastStream cannot carry; it drives the aiokafka
consumer FastStream built (`getmany`, `pause`, `resume`, `seek`, `highwater`,
`commit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import ConsumerStoppedError, IllegalStateError, KafkaError

from assay.bus.transport import BusMessage, Handle, Positions
from assay.kernel.waiting import sleep_or
from assay.store.faults import Outage

log = logging.getLogger(__name__)

RETRY_MAX_S = 5.0
HINT_EVERY_S = 1.0
"""How often handled positions are committed to the group, as a hint for lag tools."""
HIGH_WATER = 1_000
"""Records queued for one partition past which its fetching pauses (backpressure)."""


def bus_message(record: Any) -> BusMessage:
    """An aiokafka `ConsumerRecord` as the `BusMessage` a stage handles."""
    key: bytes | None = record.key
    return BusMessage(
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=key.decode("utf-8", errors="replace") if key is not None else "",
        value=record.value if record.value is not None else b"",
        headers=tuple((k, v if v is not None else b"") for k, v in record.headers or ()),
    )


@dataclass(eq=False)
class PartitionWorkers(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    """One `consume` call's group membership: assignment, positions, queues and workers.

    Fetched records go to their partition's queue; the partition's worker
    handles them in offset order. A partition is paused only until it is
    positioned, and while its queue holds `high_water` records or more (its
    worker is that far behind). `generation` changes on every rebalance; a
    worker started under another generation stops, and a revoked partition's
    queue is dropped. A record is handled only at or past the partition's next
    position, so records fetched before a rebalance or a seek never move a
    position back.
    """

    handle: Handle
    positions: Positions
    stop: asyncio.Event
    retry_backoff_s: float
    high_water: int = HIGH_WATER
    subscriber: Any = None
    """The FastStream subscriber whose aiokafka consumer this drives (it builds the
    consumer before joining the group, so the listener always finds it there)."""
    generation: int = 0
    ready: set[TopicPartition] = field(default_factory=set)  # positioned in this generation
    unpositioned: set[TopicPartition] = field(default_factory=set)  # waiting for the store
    next: dict[TopicPartition, int | None] = field(default_factory=dict)  # None: beginning
    queues: dict[TopicPartition, deque[Any]] = field(default_factory=dict)
    """Each ready partition's fetched records not yet handled, in offset order."""
    wakeups: dict[TopicPartition, asyncio.Event] = field(default_factory=dict)
    workers: dict[TopicPartition, asyncio.Task[None]] = field(default_factory=dict)
    full: set[TopicPartition] = field(default_factory=set)
    """Partitions paused because their queue reached `high_water`."""
    failures: dict[TopicPartition, int] = field(default_factory=dict)
    hints: dict[TopicPartition, int] = field(default_factory=dict)  # handled, not committed
    committing: asyncio.Task[None] | None = None
    hinted_at: float = float("-inf")
    """When handled positions were last committed to the group (monotonic)."""
    positioning: asyncio.Lock = field(default_factory=asyncio.Lock)
    closing: bool = False
    joined: bool = False
    """An assignment has been received (possibly empty: more members than partitions)."""
    progressed: dict[TopicPartition, float] = field(default_factory=dict)
    """When each assigned partition was positioned or last handled a record (monotonic)."""

    @property
    def consumer(self) -> Any:
        """The aiokafka consumer of the subscriber (None before it starts)."""
        return None if self.subscriber is None else self.subscriber.consumer

    def status(self, now: float, stalled_after_s: float) -> dict[str, object]:
        """See `KafkaSource.status`."""
        lag = 0
        stalled = []
        for tp in sorted(self.ready | self.unpositioned):
            high = self.consumer.highwater(tp) if tp in self.ready and self.consumer else None
            behind = 0 if high is None else max(0, high - (self.next.get(tp) or 0))
            lag += behind
            waiting = behind > 0 or tp in self.unpositioned
            if waiting and now - self.progressed.get(tp, now) > stalled_after_s:
                stalled.append(f"{tp.topic}/{tp.partition}")
        held = sorted(self.ready | self.unpositioned)
        return {
            "joined": self.joined,
            "partitions": len(held),
            "held": [f"{tp.topic}/{tp.partition}" for tp in held],
            "lag": lag,
            "stalled": stalled,
        }

    # -- the rebalance listener (called by the group coordinator) ------------------------

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Drop the revoked partitions' queues; return once their in-flight record is done.

        No record of a revoked partition is handled by this member after this returns
        (the group gives the partition to another member only then).
        """
        self.generation += 1
        self.ready.difference_update(revoked)
        self.unpositioned.difference_update(revoked)
        pending = []
        for tp in revoked:
            queue = self.queues.pop(tp, None)
            if queue is not None:
                queue.clear()
            self._wake(tp)
            if (task := self.workers.get(tp)) is not None:
                pending.append(task)
        if pending:
            await asyncio.wait(pending)
        for tp in revoked:
            self.failures.pop(tp, None)
            self.hints.pop(tp, None)
            self.full.discard(tp)
            self.wakeups.pop(tp, None)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Seek each assigned partition to the stage's stored position (or the beginning)."""
        self.generation += 1
        self.joined = True
        self.ready.clear()
        self.unpositioned = set(assigned)
        now = time.monotonic()
        self.progressed = {tp: self.progressed.get(tp, now) for tp in assigned}
        if assigned:
            # before any await: nothing of these partitions may be fetched until positioned
            self.consumer.pause(*assigned)
            await self.position(self.generation)

    async def position(self, generation: int) -> None:
        """Seek the unpositioned partitions to the stored positions, then release them.

        While the store cannot be read the partitions stay paused; `retry_positions`
        tries again.
        """
        async with self.positioning:
            if generation != self.generation or not self.unpositioned:
                return
            try:
                stored = await self.positions()
            except Exception:  # the store is down: the partitions stay paused, retried later
                log.warning("consumer positions unavailable; partitions wait", exc_info=True)
                return
            if generation != self.generation:
                return
            todo = sorted(self.unpositioned)
            for tp in todo:
                self.next[tp] = stored.get((tp.topic, tp.partition))
            await self._seek(todo)
            if generation != self.generation:
                return
            self.unpositioned.difference_update(todo)
            self.ready.update(todo)
            for tp in todo:
                self.queues[tp] = deque()
                self._resume(tp)

    async def retry_positions(self) -> None:
        """Position what an assignment left unpositioned (the store was down), until stopped."""
        backoff = self.retry_backoff_s
        while not self.stop.is_set():
            if self.unpositioned and not self.positioning.locked():
                await self.position(self.generation)
                backoff = min(backoff * 2, RETRY_MAX_S) if self.unpositioned else 0.1
            else:
                backoff = 0.1
            await sleep_or(self.stop, backoff)

    async def _seek(self, tps: list[TopicPartition]) -> None:
        beginning = [tp for tp in tps if self.next.get(tp) is None]
        try:
            for tp in tps:
                if (offset := self.next.get(tp)) is not None:
                    self.consumer.seek(tp, offset)
            if beginning:
                await self.consumer.seek_to_beginning(*beginning)
        except IllegalStateError:  # unassigned meanwhile: the next assignment seeks again
            log.debug("seek skipped: %s no longer assigned", tps)

    # -- the fetch loop ---------------------------------------------------------------------

    async def fetch(self, wait_ms: int, paused_wait_ms: int) -> None:
        """Take fetched records into the partitions' queues until stopped.

        `getmany` returns as soon as a fetch brings records, so the loop waits up to
        `wait_ms` for them at no cost in latency. While a partition is paused the wait
        is `paused_wait_ms`: aiokafka's fetcher wakes a waiting `getmany` only when a
        fetch brings new data, not on `resume`. aiokafka 0.14 drops what it fetched
        for a paused partition and fetches it again once resumed (which wakes the
        wait), but records it kept buffered across a `resume` would wait out the
        whole wait; that state is rare, so it is bounded by a short one.
        """
        backoff = self.retry_backoff_s
        while not self.stop.is_set() and not self.closing:
            paused = bool(self.full or self.unpositioned)
            try:
                fetched = await self.consumer.getmany(
                    timeout_ms=paused_wait_ms if paused else wait_ms
                )
            except ConsumerStoppedError:
                return
            except Exception as exc:  # e.g. the group coordinator is away: never stop reading
                log.warning(
                    "fetching failed (%r); retrying", exc, exc_info=not isinstance(exc, KafkaError)
                )
                await sleep_or(self.stop, backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            backoff = self.retry_backoff_s
            for tp, records in fetched.items():
                self.take(tp, records)
            self._commit_hints()

    def take(self, tp: TopicPartition, records: list[Any]) -> None:
        """Queue `tp`'s fetched records for its worker; never waits for handling."""
        queue = self.queues.get(tp)
        if self.closing or queue is None or tp not in self.ready:
            return  # not (yet) ours: the assignment's seek decides where it starts
        queue.extend(records)
        if len(queue) >= self.high_water and tp not in self.full:
            self.full.add(tp)
            with contextlib.suppress(KafkaError, IllegalStateError):  # unassigned meanwhile
                self.consumer.pause(tp)
        if tp not in self.workers:
            self.wakeups[tp] = asyncio.Event()
            self.workers[tp] = asyncio.create_task(
                self._work(tp, queue, self.generation),
                name=f"consume-{tp.topic}-{tp.partition}",
            )
        self._wake(tp)

    # -- a partition's worker ---------------------------------------------------------------

    def _owns(self, tp: TopicPartition, generation: int) -> bool:
        return not self.closing and not self.stop.is_set() and generation == self.generation

    def _wake(self, tp: TopicPartition) -> None:
        if (wakeup := self.wakeups.get(tp)) is not None:
            wakeup.set()

    async def _work(self, tp: TopicPartition, queue: deque[Any], generation: int) -> None:
        wakeup = self.wakeups[tp]
        try:
            while self._owns(tp, generation):
                if not queue:
                    wakeup.clear()
                    await wakeup.wait()
                    continue
                record = queue[0]
                expected = self.next.get(tp)
                if expected is None or record.offset >= expected:
                    if not await self._handled(tp, record, generation, wakeup):
                        continue  # retried after a backoff, from this record
                    self.next[tp] = self.hints[tp] = record.offset + 1
                    self.progressed[tp] = time.monotonic()
                    self.failures.pop(tp, None)
                # else fetched before a seek or a rebalance: handled already
                if queue and queue[0] is record:  # a revocation may have dropped the queue
                    queue.popleft()
                if tp in self.full and len(queue) <= self.high_water // 2:
                    self.full.discard(tp)
                    self._resume(tp)
        finally:
            if self.workers.get(tp) is asyncio.current_task():
                del self.workers[tp]

    async def _handled(
        self, tp: TopicPartition, record: Any, generation: int, wakeup: asyncio.Event
    ) -> bool:
        """Handle `record`; on failure wait out a backoff (cut short by a revocation or a
        stop) and answer False: the record stays at the head of its queue."""
        try:
            await self.handle(bus_message(record))
            return True
        except Outage as exc:  # a service is away: no traceback for each retry
            log.warning("%s; retrying from there", exc)
        except Exception:
            log.exception(
                "handler raised on %s/%d@%d; retrying from there",
                tp.topic,
                tp.partition,
                record.offset,
            )
        n = self.failures[tp] = self.failures.get(tp, 0) + 1
        delay = min(self.retry_backoff_s * 2 ** (n - 1), RETRY_MAX_S)
        deadline = time.monotonic() + delay
        while self._owns(tp, generation) and (left := deadline - time.monotonic()) > 0:
            wakeup.clear()  # set by records arriving (they wait) and by a revocation
            await sleep_or(wakeup, left)
        return False

    def _resume(self, tp: TopicPartition) -> None:
        """Let the fetcher read `tp` again, unless its queue still holds it."""
        if tp in self.ready and tp not in self.full:
            with contextlib.suppress(KafkaError, IllegalStateError):  # unassigned meanwhile
                self.consumer.resume(tp)

    # -- group offsets (a hint) and shutdown -------------------------------------------------

    def _commit_hints(self) -> None:
        """Commit handled positions to the group, in the background, best effort, at
        most every `HINT_EVERY_S` (each commit is a request the broker serves; the
        positions that count are the stage's own)."""
        now = time.monotonic()
        if now - self.hinted_at < HINT_EVERY_S:
            return
        if self.hints and (self.committing is None or self.committing.done()):
            offsets, self.hints, self.hinted_at = self.hints, {}, now
            self.committing = asyncio.create_task(self._commit(offsets))

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        try:
            await self.consumer.commit(offsets)
        except Exception as exc:  # only a hint: the stored positions are authoritative
            log.debug("committing group offsets failed: %r", exc)

    async def shutdown(self) -> None:
        """Wait for in-flight records, then leave the group's offsets as handled (hint)."""
        self.closing = True
        for tp in list(self.wakeups):
            self._wake(tp)
        if self.workers:
            await asyncio.wait(list(self.workers.values()))
        for queue in self.queues.values():
            queue.clear()
        if self.committing is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self.committing, 2.0)
        if self.hints and self.consumer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._commit(self.hints), 2.0)
