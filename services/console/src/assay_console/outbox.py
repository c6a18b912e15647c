"""How the console publishes an operator's command: onto the embedded bus of the process
it runs in, or to the Kafka cluster `ASSAY_KAFKA_BOOTSTRAP` names.

Either way it is the command the CLI produces (`assay.bus.commands`), and the console
watches the owning stage's dead letters (`assay.dlq.<stage>`) from where they ended
before the command was sent, so a refused command answers with the stage's reason in
both modes: embedded, on the bus of its process; over Kafka, with a consumer of its
own that belongs to no group (it is assigned every partition of the dead-letter topic
and commits nothing), open while the action waits for its outcome.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition

from assay.bus.commands import Command
from assay.bus.embedded import DeadLetterWatch, EmbeddedBus
from assay.bus.headers import DLQ_REASON
from assay.bus.kafka import KafkaTransport
from assay.bus.topics import dlq
from assay.messages.envelope import open_envelope


class Sent(Protocol):
    """A command produced: whether its stage refused it so far."""

    async def refused(self) -> str | None:
        """The stage's reason, once it dead-lettered the command; None: not (yet)."""
        ...

    async def close(self) -> None:
        """Stop watching."""
        ...


class Outbox(Protocol):
    """Where the console's commands go."""

    async def send(self, command: Command) -> Sent:
        """Produce `command` durably; what is returned watches for its refusal."""
        ...

    async def close(self) -> None:
        """Release the producer."""
        ...


class _DeadLetters:
    """The stage's refusal of one command, from its dead-letter topic."""

    def __init__(self, watch: DeadLetterWatch) -> None:
        self._watch = watch

    async def refused(self) -> str | None:
        reason = await self._watch.refused()
        return None if reason is None else reason or "refused"

    async def close(self) -> None:
        return None


class EmbeddedOutbox:
    """The embedded bus of the process the console runs in (its owner closes it)."""

    def __init__(self, bus: EmbeddedBus) -> None:
        self._bus = bus

    async def send(self, command: Command) -> Sent:
        message = open_envelope(command.entry.value).id
        watch = await DeadLetterWatch.opened(self._bus, dlq(command.stage), message)
        await self._bus.publish([command.entry])
        return _DeadLetters(watch)

    async def close(self) -> None:
        return None


class KafkaOutbox:
    """A Kafka producer of the console's own (opened by `open`)."""

    def __init__(self, bootstrap: str) -> None:
        self._bootstrap = bootstrap
        self._transport = KafkaTransport(bootstrap, client_id="assay-console")

    async def open(self) -> KafkaOutbox:
        """Connect the producer."""
        await self._transport.open()
        return self

    async def send(self, command: Command) -> Sent:
        message = open_envelope(command.entry.value).id
        watch = await KafkaDeadLetters.opened(self._bootstrap, dlq(command.stage), message)
        try:
            await self._transport.publish([command.entry])
        except BaseException:
            await watch.close()
            raise
        return watch

    async def close(self) -> None:
        await self._transport.close()


class KafkaDeadLetters:
    """The stage's refusal of one command, from its dead-letter topic on the cluster: a
    consumer in no group, assigned every partition from where each ended before the
    command was sent (`opened` is called before publishing)."""

    def __init__(self, consumer: AIOKafkaConsumer, message: str) -> None:
        self._consumer = consumer
        self._message = message

    @classmethod
    async def opened(cls, bootstrap: str, topic: str, message: str) -> KafkaDeadLetters:
        """Watch `topic` for `message` (an envelope id) from its end now.

        Raises:
            KafkaError: the cluster could not be reached.
        """
        consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            client_id="assay-console-dlq",
            enable_auto_commit=False,
            group_id=None,
        )
        await consumer.start()
        try:
            await consumer.topics()  # the cluster's metadata: the topic's partitions
            parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
            consumer.assign(parts)
            for tp, end in (await consumer.end_offsets(parts)).items():
                consumer.seek(tp, end)
        except BaseException:
            await consumer.stop()
            raise
        return cls(consumer, message)

    async def refused(self) -> str | None:
        batches: dict[Any, list[Any]] = await self._consumer.getmany(timeout_ms=50)
        for records in batches.values():
            for m in records:
                if open_envelope(m.value).id == self._message:
                    reason = dict(m.headers or ()).get(DLQ_REASON, b"").decode()
                    return reason or "refused"
        return None

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._consumer.stop()
