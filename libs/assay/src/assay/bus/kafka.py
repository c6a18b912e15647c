"""The Kafka transport (DESIGN §3, §5), on aiokafka.

`KafkaTransport` is what a relay publishes through: acknowledged by every
in-sync replica (`acks="all"`), no idempotent producer (not every
Kafka-protocol broker has one; the consumer's inbox makes a re-publish a
no-op), keys hashed by the client's default murmur2 partitioner — the same
partition numbers as `assay.bus.partitioner` and the embedded bus.

`KafkaSource` consumes in a consumer group and seeks every assigned partition
to the position the stage stored in its own commit (§5: "position in the same
transaction"). Kafka's committed group offsets are written after handling, as
a hint for lag tooling only; nothing here reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import IllegalStateError, KafkaError, TopicAlreadyExistsError, for_code

from assay.bus.transport import BusMessage, Handle, Positions
from assay.kernel.errors import AssayError
from assay.kernel.waiting import sleep_or
from assay.store.faults import Outage
from assay.store.ports import OutboxEntry

log = logging.getLogger(__name__)

_TOPIC_EXISTS = 36  # Kafka error code TOPIC_ALREADY_EXISTS
_RETRY_MAX_S = 5.0


class TopicMismatch(AssayError):
    """An existing topic has another partition count than the one configured."""


class PublishFailed(AssayError):
    """Some records of a batch were not acknowledged; the batch must be published again."""


async def ensure_topics(
    bootstrap: str, names: Iterable[str], partitions: int = 12, replication: int = 1
) -> list[str]:
    """Create the missing topics with `partitions` partitions; check the existing ones.

    Topics are always created here, never by a broker's auto-creation (which
    picks its own partition count, and with it other partitions for every key).

    Returns:
        The topics this call created.

    Raises:
        TopicMismatch: an existing topic has a different partition count.
        KafkaError: the broker refused to create or describe a topic.
    """
    wanted = list(dict.fromkeys(names))
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="assay-admin")
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [n for n in wanted if n not in existing]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):  # another process won the race
                response = await admin.create_topics(
                    [NewTopic(n, partitions, replication) for n in missing]
                )
                for entry in response.topic_errors:
                    topic, code = entry[0], entry[1]
                    if code not in (0, _TOPIC_EXISTS):
                        raise for_code(code)(f"creating topic {topic}: {entry[2:]}")
        counts = await _partition_counts(admin, wanted)
    finally:
        await admin.close()
    wrong = {n: c for n, c in counts.items() if c != partitions}
    if wrong:
        raise TopicMismatch(
            f"topics with a partition count other than the configured {partitions}: {wrong}"
        )
    return missing


async def _partition_counts(admin: Any, names: list[str]) -> dict[str, int]:
    """Partition counts, waiting out metadata that lags a fresh creation (up to ~5 s)."""
    for _ in range(50):
        described = await admin.describe_topics(names)
        errors = {d["topic"]: d["error_code"] for d in described if d["error_code"]}
        if not errors:
            return {d["topic"]: len(d["partitions"]) for d in described}
        await asyncio.sleep(0.1)
    raise for_code(next(iter(errors.values())))(f"describing topics: {errors}")


@dataclass
class KafkaTransport:
    """`Transport` over one aiokafka producer. Use `open()` first (or `async with`).

    Attributes:
        request_timeout_ms: how long a record may wait for its acknowledgement;
            after that `publish` fails and the relay keeps the rows.
        linger_ms: how long the producer waits to fill a batch.
    """

    bootstrap: str
    _: KW_ONLY
    client_id: str
    request_timeout_ms: int = 30_000
    linger_ms: int = 0
    _producer: Any = field(default=None, init=False, repr=False)

    async def open(self) -> KafkaTransport:
        """Connect the producer.

        Raises:
            KafkaError: the cluster could not be reached.
        """
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            client_id=self.client_id,
            acks="all",
            enable_idempotence=False,  # Tansu has no idempotent producer; the inbox dedupes
            linger_ms=self.linger_ms,
            request_timeout_ms=self.request_timeout_ms,
        )
        await producer.start()
        self._producer = producer
        return self

    async def __aenter__(self) -> KafkaTransport:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def publish(self, entries: list[OutboxEntry]) -> None:
        """Send every entry, then wait until each is acknowledged by all in-sync replicas.

        Records of one key keep their order: they land on one partition, and
        the producer has at most one request in flight per broker.

        Raises:
            PublishFailed: at least one record was not acknowledged (some others
                may have been: publishing the batch again is at-least-once).
            RuntimeError: the transport is not open.
        """
        producer = self._producer
        if producer is None:
            raise RuntimeError(f"Kafka transport {self.client_id} is not open")
        deliveries: list[asyncio.Future[Any]] = []
        error: BaseException | None = None
        try:
            for e in entries:
                deliveries.append(
                    await producer.send(
                        e.topic, value=e.value, key=e.key.encode(), headers=list(e.headers)
                    )
                )
        except KafkaError as exc:  # e.g. no metadata, or the buffer stayed full: a timeout
            error = exc
        results = await asyncio.gather(*deliveries, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        error = error or (failed[0] if failed else None)
        if error is not None:
            acked = len(deliveries) - len(failed)
            raise PublishFailed(
                f"{len(entries) - acked} of {len(entries)} records not acknowledged: {error!r}"
            ) from error

    async def close(self) -> None:
        """Flush what is pending and disconnect."""
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()


@dataclass
class KafkaSource:
    """`Source` over a Kafka consumer group; positions come from the stage's own store.

    Each assigned partition is handled strictly in offset order, one record at
    a time; partitions run concurrently. A partition whose handler raises (a
    handler should not: bad input is dead-lettered by the runner) is rewound to
    the failed record and retried after a backoff, so nothing is skipped.

    Attributes:
        member_timeout_ms: how long the group waits for a silent member before
            giving its partitions to the others.
        heartbeat_interval_ms: how often a member tells the group it is alive.
        poll_ms: the longest a fetch waits for records.
        fetch_max_wait_ms: the longest the broker holds a fetch waiting for data; short,
            because every stage is a hop on the task-to-result path.
        retry_backoff_s: the first wait before a failed record is retried (doubling).
    """

    bootstrap: str
    _: KW_ONLY
    group_id: str
    member_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    client_id: str | None = None
    poll_ms: int = 500
    fetch_max_wait_ms: int = 20
    retry_backoff_s: float = 0.5
    _member: _Member | None = field(default=None, init=False, repr=False)

    async def consume(
        self, topics: list[str], handle: Handle, positions: Positions, stop: asyncio.Event
    ) -> None:
        """Join the group, consume `topics` until `stop` is set, then leave the group.

        While the cluster cannot be reached, joining is retried until `stop` is set.
        """
        consumer = await self._connect(stop)
        if consumer is None:
            return
        member = _Member(consumer, handle, positions, stop, self.retry_backoff_s)
        self._member = member
        try:
            consumer.subscribe(topics, listener=member)
            await member.run(self.poll_ms)
        finally:
            try:
                await member.shutdown()
            finally:
                await consumer.stop()

    def status(self, stalled_after_s: float) -> dict[str, object]:
        """For readiness: whether the consumer has joined its group, its partitions, and
        those with records waiting (by the last fetched high watermark) that have made
        no progress for `stalled_after_s`."""
        member = self._member
        if member is None:
            return {"joined": False, "partitions": 0, "lag": 0, "stalled": []}
        return member.status(time.monotonic(), stalled_after_s)

    async def end_offsets(self, topics: list[str]) -> dict[tuple[str, int], int]:
        """The broker's end offset of each partition of `topics` this member holds (a
        ListOffsets request: the log end, not the high watermark last seen in a fetch)."""
        member = self._member
        held = (
            sorted(tp for tp in member.ready | member.unpositioned if tp.topic in topics)
            if member is not None
            else []
        )
        if member is None or not held:
            return {}
        ends = await member.consumer.end_offsets(held)
        return {(tp.topic, tp.partition): int(end) for tp, end in ends.items()}

    async def _connect(self, stop: asyncio.Event) -> Any:
        backoff = self.retry_backoff_s
        while not stop.is_set():
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap,
                group_id=self.group_id,
                client_id=self.client_id or self.group_id,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                session_timeout_ms=self.member_timeout_ms,
                heartbeat_interval_ms=self.heartbeat_interval_ms,
                fetch_max_wait_ms=self.fetch_max_wait_ms,
            )
            try:
                await consumer.start()
                return consumer
            except KafkaError as exc:
                log.warning("Kafka at %s unreachable (%r); retrying", self.bootstrap, exc)
                with contextlib.suppress(Exception):
                    await consumer.stop()
            await sleep_or(stop, backoff)
            backoff = min(backoff * 2, _RETRY_MAX_S)
        return None


def _message(record: Any) -> BusMessage:
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
class _Member(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    """One `consume` call's group membership: assignment, positions, partition workers.

    A partition is paused while a worker handles a fetched batch of it, while
    it backs off after a failure, and until it is positioned; `generation`
    changes on every rebalance, and a batch fetched under another generation is
    never handled.
    """

    consumer: Any
    handle: Handle
    positions: Positions
    stop: asyncio.Event
    retry_backoff_s: float
    generation: int = 0
    ready: set[TopicPartition] = field(default_factory=set)  # positioned in this generation
    unpositioned: set[TopicPartition] = field(default_factory=set)  # waiting for the store
    next: dict[TopicPartition, int | None] = field(default_factory=dict)  # None: beginning
    busy: dict[TopicPartition, asyncio.Task[None]] = field(default_factory=dict)
    failures: dict[TopicPartition, int] = field(default_factory=dict)
    backing_off: dict[TopicPartition, asyncio.TimerHandle] = field(default_factory=dict)
    hints: dict[TopicPartition, int] = field(default_factory=dict)  # handled, not committed
    committing: asyncio.Task[None] | None = None
    positioning: asyncio.Lock = field(default_factory=asyncio.Lock)
    closing: bool = False
    joined: bool = False
    """An assignment has been received (possibly empty: more members than partitions)."""
    progressed: dict[TopicPartition, float] = field(default_factory=dict)
    """When each assigned partition was positioned or last handled a record (monotonic)."""

    def status(self, now: float, stalled_after_s: float) -> dict[str, object]:
        """See `KafkaSource.status`."""
        lag = 0
        stalled = []
        for tp in sorted(self.ready | self.unpositioned):
            high = self.consumer.highwater(tp) if tp in self.ready else None
            behind = 0 if high is None else max(0, high - (self.next.get(tp) or 0))
            lag += behind
            waiting = behind > 0 or tp in self.unpositioned
            if waiting and now - self.progressed.get(tp, now) > stalled_after_s:
                stalled.append(f"{tp.topic}/{tp.partition}")
        return {
            "joined": self.joined,
            "partitions": len(self.ready | self.unpositioned),
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
            await self._position(self.generation)

    async def _position(self, generation: int) -> None:
        """Seek the unpositioned partitions to the stored positions, then release them."""
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

    # -- the fetch loop -------------------------------------------------------------------

    async def run(self, poll_ms: int) -> None:
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            while not self.stop.is_set():
                if self.unpositioned and not self.positioning.locked():
                    await self._position(self.generation)
                generation = self.generation
                fetch = asyncio.ensure_future(self.consumer.getmany(timeout_ms=poll_ms))
                await asyncio.wait({fetch, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if not fetch.done():
                    fetch.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await fetch
                    return
                try:
                    batches: dict[TopicPartition, list[Any]] = fetch.result()
                except KafkaError:
                    log.warning("fetch failed; retrying", exc_info=True)
                    await sleep_or(self.stop, 1.0)
                    continue
                for tp, records in batches.items():
                    await self._dispatch(tp, records, generation)
                self._commit_hints()
        finally:
            stopped.cancel()

    async def _dispatch(self, tp: TopicPartition, records: list[Any], generation: int) -> None:
        if not records or tp not in self.ready or tp in self.busy:
            return  # not (yet) ours: the assignment's seek decides where it starts
        if generation != self.generation:
            # fetched across a rebalance: read it again from where this generation starts
            await self._seek([tp])
            return
        self.consumer.pause(tp)
        self.busy[tp] = asyncio.create_task(
            self._work(tp, records, generation), name=f"consume-{tp.topic}-{tp.partition}"
        )

    async def _work(self, tp: TopicPartition, records: list[Any], generation: int) -> None:
        try:
            for record in records:
                if self.closing or self.stop.is_set() or generation != self.generation:
                    return
                try:
                    await self.handle(_message(record))
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
        delay = min(self.retry_backoff_s * 2 ** (n - 1), _RETRY_MAX_S)

        def done() -> None:
            self.backing_off.pop(tp, None)
            self._release(tp)

        self.backing_off[tp] = asyncio.get_running_loop().call_later(delay, done)

    def _release(self, tp: TopicPartition) -> None:
        """Let the fetcher read `tp` again, unless something still holds it."""
        if tp in self.ready and tp not in self.busy and tp not in self.backing_off:
            with contextlib.suppress(KafkaError):  # unassigned meanwhile: nothing to resume
                self.consumer.resume(tp)

    def _commit_hints(self) -> None:
        """Commit handled positions to the group, in the background, best effort."""
        if self.hints and (self.committing is None or self.committing.done()):
            offsets, self.hints = self.hints, {}
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
        if self.hints:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._commit(self.hints), 2.0)
