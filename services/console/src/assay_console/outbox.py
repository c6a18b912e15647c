"""How the console publishes an operator's command: onto the embedded bus of the process
it runs in, or to the Kafka cluster `ASSAY_KAFKA_BOOTSTRAP` names.

Either way it is the command the CLI produces (`assay.bus.commands`). Embedded, the
console also sees the owning stage's dead letters, so a refused command answers with
the stage's reason; over Kafka a refusal is not watched (the effect, or its absence,
shows on the run).
"""

from __future__ import annotations

from typing import Protocol

from assay.bus.commands import Command
from assay.bus.embedded import EmbeddedBus
from assay.bus.kafka import KafkaTransport
from assay.bus.topics import dlq
from assay.messages.envelope import open_envelope


class Sent(Protocol):
    """A command produced: whether its stage refused it so far."""

    async def refused(self) -> str | None:
        """The stage's reason, once it dead-lettered the command; None: not (yet)."""
        ...


class Outbox(Protocol):
    """Where the console's commands go."""

    async def send(self, command: Command) -> Sent:
        """Produce `command` durably; what is returned watches for its refusal."""
        ...

    async def close(self) -> None:
        """Release the producer."""
        ...


class _Unwatched:
    async def refused(self) -> str | None:
        return None


class _DeadLetters:
    """Watches a stage's dead-letter topic, from where it ended at sending, for one id."""

    def __init__(self, bus: EmbeddedBus, topic: str, since: dict[int, int], message: str) -> None:
        self._bus, self._topic, self._since, self._message = bus, topic, since, message

    async def refused(self) -> str | None:
        for p, offset in self._since.items():
            for m in await self._bus.fetch(self._topic, p, offset, 1000, 0.0):
                self._since[p] = m.offset + 1
                if open_envelope(m.value).id == self._message:
                    return dict(m.headers).get("assay-dlq-reason", b"").decode() or "refused"
        return None


class EmbeddedOutbox:
    """The embedded bus of the process the console runs in (its owner closes it)."""

    def __init__(self, bus: EmbeddedBus) -> None:
        self._bus = bus

    async def send(self, command: Command) -> Sent:
        topic = dlq(command.stage)
        since = await self._bus.end_offsets(topic)
        await self._bus.publish([command.entry])
        return _DeadLetters(self._bus, topic, since, open_envelope(command.entry.value).id)

    async def close(self) -> None:
        return None


class KafkaOutbox:
    """A Kafka producer of the console's own (opened by `open`)."""

    def __init__(self, bootstrap: str) -> None:
        self._transport = KafkaTransport(bootstrap, client_id="assay-console")

    async def open(self) -> KafkaOutbox:
        """Connect the producer."""
        await self._transport.open()
        return self

    async def send(self, command: Command) -> Sent:
        await self._transport.publish([command.entry])
        return _Unwatched()

    async def close(self) -> None:
        await self._transport.close()
