"""Per-partition workers under a FastStream Kafka subscriber (DESIGN §5).

FastStream hands a subscriber's records to one handler call at a time: one
partition's slow record would hold every other partition of the stage, and a
failure could only be retried by holding them all. So the subscriber's handler
only *dispatches*: each assigned partition gets a worker that handles its
records strictly in offset order, one at a time, while other partitions run
concurrently (FastStream's own `max_workers` mode instead opens one consumer
per worker and takes a single topic: ag2ai/faststream#2017). The same object is
the subscriber's rebalance listener, so every assignment seeks to the positions
the stage stored in its own commits; Kafka's group offsets are a hint only.

This is the narrowest piece FastStream cannot carry; it drives the aiokafka
consumer FastStream built (`pause`, `resume`, `seek`, `highwater`, `commit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import IllegalStateError, KafkaError

from assay.bus.transport import BusMessage, Handle, Positions
from assay.store.faults import Outage

log = logging.getLogger(__name__)

RETRY_MAX_S = 5.0
HINT_EVERY_S = 1.0
"""How often handled positions are committed to the group, as a hint for lag tools."""


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
    """One `consume` call's group membership: assignment, positions, partition workers.

    A partition is paused while a worker handles a fetched batch of it, while
    it backs off after a failure, and until it is positioned. `generation`
    changes on every rebalance; a worker started under another generation stops.
    A fetched record is handled only at or past the partition's next position,
    so a batch fetched before a rebalance or a seek never moves a position back.
    """

    handle: Handle
    positions: Positions
    stop: asyncio.Event
    retry_backoff_s: float
    subscriber: Any = None
    """The FastStream subscriber whose aiokafka consumer this drives (it builds the
    consumer before joining the group, so the listener always finds it there)."""
    generation: int = 0
    ready: set[TopicPartition] = field(default_factory=set)  # positioned in this generation
    unpositioned: set[TopicPartition] = field(default_factory=set)  # waiting for the store
    next: dict[TopicPartition, int | None] = field(default_factory=dict)  # None: beginning
    busy: dict[TopicPartition, asyncio.Task[None]] = field(default_factory=dict)
    failures: dict[TopicPartition, int] = field(default_factory=dict)
    backing_off: dict[TopicPartition, asyncio.TimerHandle] = field(default_factory=dict)
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
        """Stop handling the revoked partitions; return once their in-flight record is done."""
        self.generation += 1
        self.ready.difference_update(revoked)
        self.unpositioned.difference_update(revoked)
        pending = [task for tp, task in self.busy.items() if tp in revoked]
        if pending:
            await asyncio.wait(pending)
        for tp in revoked:
            self.failures.pop(tp, None)
            self.hints.pop(tp, None)
            timer = self.backing_off.pop(tp, None)
            if timer is not None:
                timer.cancel()

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
                self._release(tp)

    async def retry_positions(self) -> None:
        """Position what an assignment left unpositioned (the store was down), until stopped."""
        backoff = self.retry_backoff_s
        while not self.stop.is_set():
            if self.unpositioned and not self.positioning.locked():
                await self.position(self.generation)
                backoff = min(backoff * 2, RETRY_MAX_S) if self.unpositioned else 0.1
            else:
                backoff = 0.1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), backoff)

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

    # -- dispatch (called by the FastStream subscriber with each fetched batch) -----------

    def dispatch(self, records: Iterable[Any]) -> None:
        """Give each partition's records to its worker; never waits for handling."""
        by_tp: dict[TopicPartition, list[Any]] = defaultdict(list)
        for record in records:  # FastStream chains the partitions' lists: order is kept
            by_tp[TopicPartition(record.topic, record.partition)].append(record)
        for tp, batch in by_tp.items():
            if self.closing or tp not in self.ready or tp in self.busy or tp in self.backing_off:
                continue  # not (yet) ours: the assignment's seek decides where it starts
            self.consumer.pause(tp)
            self.busy[tp] = asyncio.create_task(
                self._work(tp, batch, self.generation), name=f"consume-{tp.topic}-{tp.partition}"
            )
        self._commit_hints()

    async def _work(self, tp: TopicPartition, records: list[Any], generation: int) -> None:
        try:
            for record in records:
                if self.closing or self.stop.is_set() or generation != self.generation:
                    return
                expected = self.next.get(tp)
                if expected is not None and record.offset < expected:
                    continue  # fetched before a seek or a rebalance: handled already
                try:
                    await self.handle(bus_message(record))
                except Outage as exc:  # a service is away: no traceback for each retry
                    log.warning("%s; retrying from there", exc)
                    await self._rewind(tp, record.offset, generation)
                    return
                except Exception:
                    log.exception(
                        "handler raised on %s/%d@%d; retrying from there",
                        tp.topic,
                        tp.partition,
                        record.offset,
                    )
                    await self._rewind(tp, record.offset, generation)
                    return
                self.next[tp] = self.hints[tp] = record.offset + 1
                self.progressed[tp] = time.monotonic()
                self.failures.pop(tp, None)
        finally:
            del self.busy[tp]
            if generation == self.generation:
                self._release(tp)

    async def _rewind(self, tp: TopicPartition, offset: int, generation: int) -> None:
        """Read `tp` again from `offset`, after a backoff."""
        if generation == self.generation:
            self.next[tp] = offset
            await self._seek([tp])
            self._back_off(tp)

    def _back_off(self, tp: TopicPartition) -> None:
        n = self.failures[tp] = self.failures.get(tp, 0) + 1
        delay = min(self.retry_backoff_s * 2 ** (n - 1), RETRY_MAX_S)

        def done() -> None:
            self.backing_off.pop(tp, None)
            self._release(tp)

        self.backing_off[tp] = asyncio.get_running_loop().call_later(delay, done)

    def _release(self, tp: TopicPartition) -> None:
        """Let the fetcher read `tp` again, unless something still holds it."""
        if tp in self.ready and tp not in self.busy and tp not in self.backing_off:
            with contextlib.suppress(KafkaError, IllegalStateError):  # unassigned meanwhile
                self.consumer.resume(tp)

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
        if self.busy:
            await asyncio.wait(list(self.busy.values()))
        for timer in self.backing_off.values():
            timer.cancel()
        self.backing_off.clear()
        if self.committing is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self.committing, 2.0)
        if self.hints and self.consumer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._commit(self.hints), 2.0)
