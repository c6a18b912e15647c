"""Chaos for consumers: a `Source` that hands records over more than once.

Kafka delivers at least once. A consumer that loses its partitions in a
rebalance, or restarts before its broker-side offset moved, reads again
records it already handled. A stage is exactly-once at the fold (DESIGN §5)
because its inbox remembers every handled message id in the handler's own
commit; `RedeliveringSource` makes redelivery happen on purpose, so a test can
check that a workload leaves the same state with it as without it.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field

from assay.bus.transport import BusMessage, Handle, Positions, Source


@dataclass
class _Held:
    """A record to hand over again once `after` more records of its partition were."""

    after: int
    message: BusMessage


@dataclass
class _Partition:
    rng: random.Random
    held: list[_Held] = field(default_factory=list)
    newest: BusMessage | None = None
    behind: bool = False
    """A late redelivery was the last record handled: the stored position is behind."""


class RedeliveringSource:
    """`Source` decorator that hands a share of records to the handler a second time.

    Every record the wrapped source delivers is, with probability `rate`, handed
    to the same handler again: right after itself, or — for a `late_share` of
    them — only after 1 to `max_delay` later records of its partition, the way
    a consumer that rewound after a rebalance reads it again. The second
    delivery is the same `BusMessage` (same offset), so the handler stores the
    position after it, behind records already handled. When the wrapped source
    returns, records still held back are handed over, and then the newest
    record of every partition left behind that way once more, so the stored
    position ends where it would have without redelivery (a real rewind re-reads
    everything up to the head; this sends only the chosen records and the last).

    Draws come from one `random.Random` per (topic, partition), seeded from
    `seed`, so which records come twice does not depend on how partitions
    interleave; give each stage's source its own seed.

    Attributes:
        delivered: records the wrapped source delivered.
        chosen: of those, records picked to be delivered twice.
        late: of those, records held back until later records were delivered.
        redelivered: extra deliveries per record, by (topic, partition, offset),
            the restoring deliveries of the newest records included.
    """

    def __init__(
        self,
        inner: Source,
        *,
        seed: int | str,
        rate: float = 0.3,
        late_share: float = 0.5,
        max_delay: int = 5,
    ) -> None:
        """Wrap `inner`.

        Raises:
            ValueError: `rate` or `late_share` is outside [0, 1], or `max_delay` < 1.
        """
        if not (0.0 <= rate <= 1.0 and 0.0 <= late_share <= 1.0):
            raise ValueError("rate and late_share must be in [0, 1]")
        if max_delay < 1:
            raise ValueError("max_delay must be at least 1")
        self.inner = inner
        self.seed = seed
        self.rate = rate
        self.late_share = late_share
        self.max_delay = max_delay
        self.delivered = 0
        self.chosen = 0
        self.late = 0
        self.redelivered: Counter[tuple[str, int, int]] = Counter()
        self._partitions: dict[tuple[str, int], _Partition] = {}

    @property
    def redeliveries(self) -> int:
        """Extra deliveries made so far."""
        return sum(self.redelivered.values())

    def lag(self) -> dict[tuple[str, int], int]:
        """The wrapped source's lag per partition, if it reports one (read by metrics)."""
        lag_of = getattr(self.inner, "lag", None)
        return dict(lag_of()) if callable(lag_of) else {}

    async def consume(
        self, topics: list[str], handle: Handle, positions: Positions, stop: asyncio.Event
    ) -> None:
        """Consume through the wrapped source until it returns, redelivering as described."""

        async def again(m: BusMessage) -> None:
            self.redelivered[(m.topic, m.partition, m.offset)] += 1
            await handle(m)

        async def each(m: BusMessage) -> None:
            part = self._partition(m.topic, m.partition)
            await handle(m)
            self.delivered += 1
            part.newest, part.behind = m, False
            due = [h for h in part.held if h.after <= 1]
            part.held = [_Held(h.after - 1, h.message) for h in part.held if h.after > 1]
            if part.rng.random() < self.rate:
                self.chosen += 1
                if part.rng.random() < self.late_share:
                    self.late += 1
                    part.held.append(_Held(part.rng.randint(1, self.max_delay), m))
                else:
                    await again(m)
            for h in due:
                await again(h.message)
                part.behind = True

        await self.inner.consume(topics, each, positions, stop)
        for part in self._partitions.values():
            held, part.held = part.held, []
            for h in sorted(held, key=lambda h: h.message.offset):
                await again(h.message)
                part.behind = True
            if part.behind and part.newest is not None:
                await again(part.newest)
                part.behind = False

    def _partition(self, topic: str, partition: int) -> _Partition:
        part = self._partitions.get((topic, partition))
        if part is None:
            rng = random.Random(f"{self.seed}\x1f{topic}\x1f{partition}")
            part = self._partitions[(topic, partition)] = _Partition(rng)
        return part
