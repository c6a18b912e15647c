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
from assay.bus.embedded import DeadLetterWatch, EmbeddedBus
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
    """The stage's refusal of one command, from its dead-letter topic."""

    def __init__(self, watch: DeadLetterWatch) -> None:
        self._watch = watch

    async def refused(self) -> str | None:
        reason = await self._watch.refused()
        return None if reason is None else reason or "refused"


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
