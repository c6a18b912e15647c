"""The Kafka transport (DESIGN §3, §5), on FastStream's `KafkaBroker` (aiokafka underneath).

`KafkaTransport` is what a relay publishes through: aiokafka's producer (FastStream's
`KafkaBroker.publish` under its in-memory test broker; see `KafkaTransport.publish`
for why not always), acknowledged by every in-sync replica (`acks="all"`), no idempotent producer
(not every Kafka-protocol broker has one; the consumer's inbox makes a
re-publish a no-op), keys hashed by the client's default murmur2 partitioner —
the same partition numbers as `assay.bus.partitioner` and the embedded bus.

`KafkaSource` is a FastStream batch subscriber in the stage's consumer group
whose records `PartitionWorkers` takes from its consumer into per-partition
queues; the same object is its rebalance listener: every assigned partition is
sought to the position the stage stored in its own commit (§5: "position in the
same transaction"). Kafka's committed group offsets are written after handling,
as a hint for lag tooling only; nothing here reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError, for_code
from faststream.kafka import KafkaBroker
from faststream.middlewares import AckPolicy

from assay.bus.headers import as_text
from assay.bus.partitions import HIGH_WATER, RETRY_MAX_S, PartitionWorkers
from assay.bus.transport import Handle, Positions
from assay.kernel.errors import AssayError
from assay.kernel.waiting import sleep_or
from assay.store.ports import OutboxEntry

log = logging.getLogger(__name__)

_TOPIC_EXISTS = 36  # Kafka error code TOPIC_ALREADY_EXISTS


class TopicMismatch(AssayError):
    """An existing topic has another partition count than the one configured."""


class PublishFailed(AssayError):
    """Some records of a batch were not acknowledged; the batch must be published again."""


async def ensure_topics(
    bootstrap: str,
    names: Iterable[str],
    partitions: int | Mapping[str, int] = 12,
    replication: int = 1,
    retention_ms: int | None = None,
) -> list[str]:
    """Create the missing topics with their partition counts; check the existing ones.

    `partitions` is one count for every topic, or each topic's count by name
    (`assay.bus.topics.partition_counts`). Topics are always created here, never by a
    broker's auto-creation (which picks its own partition count, and with it other
    partitions for every key). With `retention_ms`, a topic created here keeps records
    that long (its `retention.ms`); an existing topic keeps the retention it has.

    Returns:
        The topics this call created.

    Raises:
        TopicMismatch: an existing topic has a different partition count.
        KeyError: `partitions` is a mapping without one of `names`.
        KafkaError: the broker refused to create or describe a topic.
    """
    wanted = list(dict.fromkeys(names))
    counts_wanted = {
        n: partitions if isinstance(partitions, int) else partitions[n] for n in wanted
    }
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="assay-admin")
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [n for n in wanted if n not in existing]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):  # another process won the race
                configs = None if retention_ms is None else {"retention.ms": str(retention_ms)}
                response = await admin.create_topics(
                    [
                        NewTopic(n, counts_wanted[n], replication, topic_configs=configs)
                        for n in missing
                    ]
                )
                for entry in response.topic_errors:
                    topic, code = entry[0], entry[1]
                    if code not in (0, _TOPIC_EXISTS):
                        raise for_code(code)(f"creating topic {topic}: {entry[2:]}")
        counts = await _partition_counts(admin, wanted)
    finally:
        await admin.close()
    wrong = {n: (c, counts_wanted[n]) for n, c in counts.items() if c != counts_wanted[n]}
    if wrong:
        raise TopicMismatch(
            "topics with a partition count other than the configured one "
            f"(topic: (has, configured)): {wrong}; a deployment keeps the counts its topics "
            "were created with: set ASSAY_PARTITIONS (run-keyed topics) and "
            "ASSAY_CONTROL_PARTITIONS (control and dead-letter topics; before it existed "
            "they had ASSAY_PARTITIONS) to them"
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


def _headers(entry: OutboxEntry) -> dict[str, str]:
    """An entry's headers as FastStream publishes them: one text value per name.

    `KafkaBroker.publish` takes `dict[str, str]`, and always adds a `content-type`
    header (empty for bytes: faststream/kafka/publisher/producer.py,
    `AioKafkaFastProducerImpl.publish`). Assay's headers are ASCII, one per name;
    a dead letter copies a foreign record's headers, which may repeat a name or
    hold bytes that are not UTF-8: then the whole list also travels in
    `assay-dlq-original-headers` (`assay.bus.headers`).
    """
    return as_text(entry.headers)


_CONTENT_TYPE = ("content-type", b"")
"""What FastStream's publish writes first for a bytes body; written here too, so that a
record's headers are the same whichever way it was published."""


def _wire_headers(entry: OutboxEntry) -> list[tuple[str, bytes]]:
    """The header list `KafkaBroker.publish` would have written for `entry`.

    Headers that fit a dict of text exactly (every name once, every value ASCII,
    as Assay's own are) go as they are: the dict would give back the same bytes.
    """
    headers = entry.headers
    names: set[str] = set()
    for name, value in headers:  # one pass, no generator: this runs for every record shipped
        if name in names or not value.isascii():
            return [_CONTENT_TYPE, *((n, text.encode()) for n, text in _headers(entry).items())]
        names.add(name)
    return [_CONTENT_TYPE, *headers]


@dataclass
class KafkaTransport:
    """`Transport` over aiokafka's producer. Use `open()` first (or `async with`).

    Attributes:
        request_timeout_ms: how long a record may wait for its acknowledgement;
            after that `publish` fails and the relay keeps the rows.
        linger_ms: how long the producer waits to fill a batch.
        broker: a FastStream broker to publish through instead (a test passes one
            under FastStream's `TestKafkaBroker`, which has no aiokafka producer).
    """

    bootstrap: str
    _: KW_ONLY
    client_id: str
    request_timeout_ms: int = 30_000
    linger_ms: int = 0
    broker: KafkaBroker | None = None
    _producer: AIOKafkaProducer | None = field(default=None, init=False, repr=False)

    async def open(self) -> KafkaTransport:
        """Connect the producer.

        Raises:
            KafkaError: the cluster could not be reached.
        """
        if self.broker is not None:
            await self.broker.connect()
            return self
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            client_id=self.client_id,
            acks="all",
            enable_idempotence=False,  # Tansu has no idempotent producer; the inbox dedupes
            linger_ms=self.linger_ms,
            request_timeout_ms=self.request_timeout_ms,
        )
        try:
            await producer.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await producer.stop()
            raise
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

        Outbox rows go to aiokafka's `send` directly, not through FastStream's
        `KafkaBroker.publish`: that builds a `KafkaPublishCommand`, runs the publish
        middleware chain and the codec for every record (faststream/kafka/broker/
        broker.py, `KafkaBroker.publish` -> `_basic_publish`), which halved the
        relay's rate against a raw producer, and its `publish_batch` sends one
        batch to one partition with one set of headers (faststream/kafka/publisher/
        producer.py, `AioKafkaFastProducerImpl.publish_batch`: `send_batch(batch,
        destination, partition=cmd.partition)`), so it cannot carry per-record
        keys and headers. The records are the ones `KafkaBroker.publish` writes,
        headers included (`_wire_headers`).

        Raises:
            PublishFailed: at least one record was not acknowledged (some others
                may have been: publishing the batch again is at-least-once).
            RuntimeError: the transport is not open.
        """
        deliveries: list[asyncio.Future[Any]] = []
        error: BaseException | None = None
        try:
            await self._send(entries, deliveries)
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

    async def _send(
        self, entries: list[OutboxEntry], deliveries: list[asyncio.Future[Any]]
    ) -> None:
        """Hand every entry to the producer, collecting the futures of their acks."""
        producer, broker = self._producer, self.broker
        if producer is not None:
            for e in entries:
                deliveries.append(
                    await producer.send(
                        e.topic, e.value, key=e.key.encode(), headers=_wire_headers(e)
                    )
                )
            return
        if broker is None:
            raise RuntimeError(f"Kafka transport {self.client_id} is not open")
        for e in entries:
            sent = await broker.publish(
                e.value, e.topic, key=e.key.encode(), headers=_headers(e), no_confirm=True
            )
            if isinstance(sent, asyncio.Future):  # an in-memory test broker returns None
                deliveries.append(sent)

    async def close(self) -> None:
        """Flush what is pending and disconnect."""
        producer, self._producer = self._producer, None
        broker, self.broker = self.broker, None
        if producer is not None:
            await producer.stop()
        if broker is not None:
            await broker.stop()


def log_end(consumer: Any, tp: Any, listed: int) -> int:
    """A partition's end offset: what ListOffsets answered, or the high watermark the
    consumer's last fetch of it saw, whichever is further. Tansu 0.6 answers ListOffsets
    with the first offset of the partition's last batch plus one (three single records
    and then a batch of four: 4, not 7), while its fetches carry the true high watermark;
    on Kafka the two agree."""
    high = consumer.highwater(tp)
    return max(int(listed), int(high or 0))


def stage_subscriber(
    broker: KafkaBroker,
    topics: list[str],
    workers: PartitionWorkers,
    *,
    group_id: str,
    member_timeout_ms: int,
    heartbeat_interval_ms: int,
    fetch_max_wait_ms: int,
) -> Any:
    """Declare a stage's subscriber on `broker`: its topics, in its consumer group.

    The subscriber has no handler: FastStream builds, subscribes, starts and stops
    its aiokafka consumer, and `PartitionWorkers.fetch` takes the records from it.
    FastStream's handler loop would call `BatchSubscriber.get_msg`, which sleeps
    `batch_timeout_ms` after every `getmany` that found nothing
    (faststream/kafka/subscriber/usecase.py): a record arriving then waits the
    sleep out, so its wait had to be a few milliseconds, and an idle stage woke
    hundreds of times a second. The workers' loop waits in `getmany` alone, which
    returns as soon as a fetch brings records. Without a handler FastStream's
    parser is not used either: it decodes every header value as UTF-8
    (faststream/kafka/parser.py, `AioKafkaBatchParser.parse_batch`), and one record
    whose header held other bytes would fail its whole batch.

    Nothing is committed by FastStream (`AckPolicy.MANUAL`, no auto-commit) and
    nothing is read from the group's offsets: `workers` seeks on every assignment.

    Returns:
        The subscriber (its `consumer` is aiokafka's, once the broker started).
    """
    sub = broker.subscriber(
        *topics,
        group_id=group_id,
        batch=True,
        listener=workers,
        ack_policy=AckPolicy.MANUAL,
        auto_offset_reset="earliest",
        session_timeout_ms=member_timeout_ms,
        heartbeat_interval_ms=heartbeat_interval_ms,
        fetch_max_wait_ms=fetch_max_wait_ms,
        include_in_schema=False,  # the stage applications in `assay.bus.asyncapi` document it
    )
    workers.subscriber = sub
    return sub


@dataclass
class KafkaSource:
    """`Source` over a Kafka consumer group; positions come from the stage's own store.

    Each assigned partition is handled strictly in offset order, one record at
    a time; partitions run concurrently. A partition whose handler raises (a
    handler should not: bad input is dead-lettered by the runner) retries the
    failed record after a backoff, so nothing is skipped.

    Attributes:
        member_timeout_ms: how long the group waits for a silent member before
            giving its partitions to the others.
        heartbeat_interval_ms: how often a member tells the group it is alive.
        wait_ms: how long the fetch loop waits in aiokafka's `getmany` before it
            looks again; `getmany` returns as soon as a fetch brings records, so a
            long wait costs no latency and an idle stage wakes rarely. Requests to
            the broker are paced by `fetch_max_wait_ms` (aiokafka's fetcher
            long-polls on its own).
        paused_wait_ms: the wait while a partition is paused (being positioned, or
            its queue at `high_water`): short, see `PartitionWorkers.fetch`.
        high_water: records queued for one partition past which its fetching pauses
            until its worker has handled half of them.
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
    wait_ms: int = 500
    paused_wait_ms: int = 5
    high_water: int = HIGH_WATER
    fetch_max_wait_ms: int = 20
    retry_backoff_s: float = 0.5
    _workers: PartitionWorkers | None = field(default=None, init=False, repr=False)

    async def consume(
        self, topics: list[str], handle: Handle, positions: Positions, stop: asyncio.Event
    ) -> None:
        """Join the group, consume `topics` until `stop` is set, then leave the group.

        While the cluster cannot be reached, joining is retried until `stop` is set.
        """
        workers = PartitionWorkers(
            handle, positions, stop, self.retry_backoff_s, high_water=self.high_water
        )
        broker = await self._start(topics, workers, stop)
        if broker is None:
            return
        self._workers = workers
        retrying = asyncio.create_task(workers.retry_positions(), name="consume-positions")
        fetching = asyncio.create_task(
            workers.fetch(self.wait_ms, self.paused_wait_ms), name="consume-fetch"
        )
        try:
            await stop.wait()
        finally:
            try:
                fetching.cancel()  # a wait in `getmany`: nothing is lost, nothing was taken
                with contextlib.suppress(asyncio.CancelledError):
                    await fetching
                await workers.shutdown()
            finally:
                retrying.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await retrying
                await broker.stop()

    def status(self, stalled_after_s: float) -> dict[str, object]:
        """For readiness: whether the consumer has joined its group, its partitions (how
        many, and which: `topic/partition`, so an operator sees how a group's replicas
        share them — Tansu's DescribeGroups answers no member assignments), and those
        with records waiting (by the last fetched high watermark) that have made
        no progress for `stalled_after_s`."""
        workers = self._workers
        if workers is None:
            return {"joined": False, "partitions": 0, "held": [], "lag": 0, "stalled": []}
        return workers.status(time.monotonic(), stalled_after_s)

    async def end_offsets(self, topics: list[str]) -> dict[tuple[str, int], int]:
        """The broker's end offset of each partition of `topics` this member holds (a
        ListOffsets request through the subscriber's aiokafka consumer: the log end, not
        the high watermark last seen in a fetch)."""
        workers = self._workers
        consumer = None if workers is None else workers.consumer
        if workers is None or consumer is None:
            return {}
        held = sorted(tp for tp in workers.ready | workers.unpositioned if tp.topic in topics)
        if not held:
            return {}
        ends = await consumer.end_offsets(held)
        return {(tp.topic, tp.partition): log_end(consumer, tp, end) for tp, end in ends.items()}

    async def _start(
        self, topics: list[str], workers: PartitionWorkers, stop: asyncio.Event
    ) -> KafkaBroker | None:
        backoff = self.retry_backoff_s
        while not stop.is_set():
            broker = KafkaBroker(
                self.bootstrap,
                client_id=self.client_id or self.group_id,
                allow_auto_create_topics=False,
                logger=None,
            )
            stage_subscriber(
                broker,
                topics,
                workers,
                group_id=self.group_id,
                member_timeout_ms=self.member_timeout_ms,
                heartbeat_interval_ms=self.heartbeat_interval_ms,
                fetch_max_wait_ms=self.fetch_max_wait_ms,
            )
            try:
                await broker.start()
                return broker
            except KafkaError as exc:
                log.warning("Kafka at %s unreachable (%r); retrying", self.bootstrap, exc)
                with contextlib.suppress(Exception):
                    await broker.stop()
            await sleep_or(stop, backoff)
            backoff = min(backoff * 2, RETRY_MAX_S)
        return None
