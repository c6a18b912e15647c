"""The transport ports: what a relay needs to publish, and what a stage needs to consume."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from assay.store.ports import OutboxEntry


@dataclass(frozen=True)
class BusMessage:
    """One record read from a partition."""

    topic: str
    partition: int
    offset: int
    key: str
    value: bytes
    headers: tuple[tuple[str, bytes], ...]


Handle = Callable[[BusMessage], Awaitable[None]]
"""Handle one record completely (its commit included) before the next of its partition."""

Positions = Callable[[], Awaitable[dict[tuple[str, int], int]]]
"""The stage's stored positions: (topic, partition) -> next offset to read."""


class Transport(Protocol):
    """The producing side, Kafka semantics: murmur2 keys, per-partition order."""

    async def publish(self, entries: list[OutboxEntry]) -> None:
        """Append entries, in order per key; return once they are durable (acks=all)."""
        ...

    async def close(self) -> None:
        """Release the transport."""
        ...


class Source(Protocol):
    """The consuming side of one stage.

    Delivers each assigned partition's records in offset order, one at a time,
    starting from the stage's stored position (never from broker-side offsets,
    which are a hint at most); partitions run concurrently.
    """

    async def consume(
        self, topics: list[str], handle: Handle, positions: Positions, stop: asyncio.Event
    ) -> None:
        """Consume until `stop` is set."""
        ...


@runtime_checkable
class Measured(Protocol):
    """A source that can say how far its partitions reach (for the stage's lag)."""

    async def end_offsets(self, topics: list[str]) -> dict[tuple[str, int], int]:
        """The end offset of each partition of `topics` this consumer holds now, as the
        broker (or the embedded bus) has it: the offset the next record there will get."""
        ...


@runtime_checkable
class Sparse(Protocol):
    """A source whose partitions may have holes: offsets whose records were deleted
    (the embedded bus, after a tenant's deletion). A stage's stored position can sit
    before a hole it will never read anything from."""

    async def next_present(
        self, positions: dict[tuple[str, int], int]
    ) -> dict[tuple[str, int], int]:
        """Each position moved to the offset of the first record at or after it (the
        partition's end offset when there is none): what a consumer there reads next."""
        ...
