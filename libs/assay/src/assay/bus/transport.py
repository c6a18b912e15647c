"""The transport port: what a stage's consumer and relay need from a broker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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


class Transport(Protocol):
    """Kafka semantics: topics, partitions, murmur2 keys, per-partition order."""

    partitions: int

    async def publish(self, entries: list[OutboxEntry]) -> None:
        """Append entries, in order per key; returns once they are durable (acks=all)."""
        ...

    async def fetch(
        self, topic: str, partition: int, offset: int, limit: int, timeout_s: float
    ) -> list[BusMessage]:
        """Up to `limit` records from `offset`, waiting up to `timeout_s` for the first."""
        ...

    async def end_offsets(self, topic: str) -> dict[int, int]:
        """Next offset to be written, per partition (lag = end - position)."""
        ...

    async def close(self) -> None:
        """Release the transport."""
        ...
