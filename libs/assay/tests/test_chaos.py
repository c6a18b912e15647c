"""`RedeliveringSource`: which records come twice, when, and where positions end up."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from assay.bus import BusMessage
from assay.bus.transport import Handle, Positions
from assay.runtime import RedeliveringSource

RECORDS = [BusMessage("t", p, o, "k", b"", ()) for o in range(300) for p in (0, 1)]
"""Two partitions, interleaved the way a source running them concurrently might."""


class ListSource:
    """Hands over a fixed list of records once, then returns."""

    def __init__(self, records: list[BusMessage]) -> None:
        self.records = records

    async def consume(
        self, topics: list[str], handle: Handle, positions: Positions, stop: asyncio.Event
    ) -> None:
        for m in self.records:
            await handle(m)


async def deliveries(source: RedeliveringSource) -> list[BusMessage]:
    seen: list[BusMessage] = []

    async def handle(m: BusMessage) -> None:
        seen.append(m)

    async def positions() -> dict[tuple[str, int], int]:
        return {}

    await source.consume(["t"], handle, positions, asyncio.Event())
    return seen


def key(m: BusMessage) -> tuple[str, int, int]:
    return (m.topic, m.partition, m.offset)


async def test_a_share_of_records_comes_twice_and_the_rest_once_in_order() -> None:
    source = RedeliveringSource(ListSource(RECORDS), seed="s", rate=0.3)
    seen = await deliveries(source)
    firsts = list(dict.fromkeys(key(m) for m in seen))
    assert firsts == [key(m) for m in RECORDS]  # the wrapped source's order is kept
    assert source.delivered == len(RECORDS)
    assert 0.25 < source.chosen / len(RECORDS) < 0.35
    assert 0 < source.late < source.chosen
    extra = Counter(key(m) for m in seen) - Counter(key(m) for m in RECORDS)
    assert extra == source.redelivered
    assert len(seen) == len(RECORDS) + source.redeliveries


async def test_some_come_again_at_once_and_some_after_later_records() -> None:
    seen = await deliveries(RedeliveringSource(ListSource(RECORDS), seed="s", rate=0.3))
    at_once = late = 0
    newest: dict[int, int] = {}
    for prev, m in zip([None, *seen], seen, strict=False):
        if m.offset < newest.get(m.partition, -1):
            late += 1  # handed over after a later record of its partition
        elif prev == m:
            at_once += 1
        newest[m.partition] = max(m.offset, newest.get(m.partition, -1))
    assert at_once > 10
    assert late > 10


async def test_each_partition_ends_on_its_newest_record() -> None:
    """So the position a handler stores after the last delivery is the clean run's."""
    seen = await deliveries(RedeliveringSource(ListSource(RECORDS), seed="s", rate=0.5))
    for p in (0, 1):
        mine = [m for m in seen if m.partition == p]
        assert mine[-1].offset == max(m.offset for m in mine)


async def test_draws_are_reproducible_per_seed() -> None:
    one = [key(m) for m in await deliveries(RedeliveringSource(ListSource(RECORDS), seed="a"))]
    again = [key(m) for m in await deliveries(RedeliveringSource(ListSource(RECORDS), seed="a"))]
    other = [key(m) for m in await deliveries(RedeliveringSource(ListSource(RECORDS), seed="b"))]
    assert one == again
    assert one != other


async def test_rate_zero_is_transparent() -> None:
    source = RedeliveringSource(ListSource(RECORDS), seed="s", rate=0.0)
    assert await deliveries(source) == RECORDS
    assert source.redeliveries == 0


@pytest.mark.parametrize(
    "kwargs", [{"rate": 1.5}, {"rate": -0.1}, {"late_share": 2.0}, {"max_delay": 0}]
)
def test_settings_out_of_range_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must"):
        RedeliveringSource(ListSource([]), seed="s", **kwargs)
