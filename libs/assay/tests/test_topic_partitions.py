"""Partition counts per topic (DESIGN §4): the control topics have fewer, in both transports."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from assay.bus import (
    AGGREGATES,
    DECISIONS,
    EPISODES,
    GRADED,
    RESULTS,
    RUN_COMMANDS,
    RUN_STATUS,
    RUNS,
    TASKS,
    TENANTS,
    TOPICS,
    USAGE,
    VERIFIED,
    WORKFLOWS,
    EmbeddedBus,
    all_topics,
    dlq,
    partition_for,
)
from assay.bus.embedded import EmbeddedSource
from assay.bus.topics import partition_count, partition_counts
from assay.runtime.sections import SettingsInvalid
from assay.runtime.settings import AssaySettings
from assay.store import OutboxEntry

CONTROL = {TENANTS, WORKFLOWS, DECISIONS}
"""A few records per tenant and workflow, not one or more per run."""


def test_control_and_dead_letter_topics_get_the_control_count() -> None:
    per_run = {TASKS, RUNS, RUN_STATUS, RUN_COMMANDS, EPISODES, VERIFIED, GRADED, RESULTS}
    assert per_run | {AGGREGATES, USAGE} | CONTROL == set(TOPICS)
    counts = partition_counts(all_topics(["ingest", "decide"]), 12, 1)
    assert counts == {
        **dict.fromkeys(set(TOPICS) - CONTROL, 12),
        **dict.fromkeys(CONTROL, 1),
        dlq("ingest"): 1,
        dlq("decide"): 1,
    }
    assert partition_count("test.anything", 5, 2) == 5  # a topic of no registry: per run


def test_settings_default_to_one_partition_per_control_topic() -> None:
    settings = AssaySettings.from_env({})
    assert (settings.partitions, settings.control_partitions) == (12, 1)
    given = AssaySettings.from_env({"ASSAY_CONTROL_PARTITIONS": "3"})
    assert given.control_partitions == 3
    with pytest.raises(SettingsInvalid, match="ASSAY_CONTROL_PARTITIONS"):
        AssaySettings.from_env({"ASSAY_CONTROL_PARTITIONS": "0"})


async def test_embedded_bus_places_keys_by_each_topics_count(tmp_path: Path) -> None:
    bus = await EmbeddedBus(tmp_path / "bus.sqlite", partitions=6, control_partitions=2).open()
    try:
        keys = [f"tenant-{i}:x" for i in range(20)]
        await bus.publish([OutboxEntry(t, k, b"v") for t in (TENANTS, RUNS) for k in keys])
        assert (await bus.end_offsets(TENANTS)).keys() == {0, 1}
        assert (await bus.end_offsets(RUNS)).keys() == set(range(6))
        for topic, n in ((TENANTS, 2), (RUNS, 6)):
            for p in range(n):
                for m in await bus.fetch(topic, p, 0, 100, 0):
                    assert m.partition == partition_for(m.key.encode(), n)
        assert (await EmbeddedSource(bus).end_offsets([TENANTS])).keys() == {
            (TENANTS, 0),
            (TENANTS, 1),
        }
    finally:
        await bus.close()


async def test_a_topic_keeps_the_count_it_was_created_with(tmp_path: Path) -> None:
    """As on Kafka: a topic's records stay where their keys put them when the counts
    configured later differ, and a file written before counts were recorded keeps the
    bus's count for the topics it holds."""
    path = tmp_path / "bus.sqlite"
    bus = await EmbeddedBus(path, partitions=4, control_partitions=4).open()
    await bus.publish([OutboxEntry(WORKFLOWS, f"t:wf-{i}", b"v") for i in range(12)])
    await bus.close()
    # a file of before: no counts recorded
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM topics")
    reopened = await EmbeddedBus(path, partitions=4, control_partitions=1).open()
    try:
        assert reopened.partitions_of(WORKFLOWS) == 4
        assert reopened.partitions_of(DECISIONS) == 1  # no record yet: made with the new count
        await reopened.publish([OutboxEntry(WORKFLOWS, "t:wf-0", b"later")])
        home = partition_for(b"t:wf-0", 4)
        values = [m.value for m in await reopened.fetch(WORKFLOWS, home, 0, 100, 0)]
        assert values[-1] == b"later"
    finally:
        await reopened.close()
    again = await EmbeddedBus(path, partitions=8, control_partitions=2).open()
    try:
        assert again.partitions_of(WORKFLOWS) == 4  # recorded now
        assert sum((await again.end_offsets(WORKFLOWS)).values()) == 13
    finally:
        await again.close()
