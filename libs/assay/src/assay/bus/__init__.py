"""The bus: topics, Kafka's partitioner, the transport port, the embedded transport, the relay."""

from assay.bus.embedded import EmbeddedBus, EmbeddedSource
from assay.bus.partitioner import murmur2, partition_for
from assay.bus.relay import FileLock, OutboxRelay
from assay.bus.topics import (
    AGGREGATES,
    DECISIONS,
    EPISODES,
    GRADED,
    RESULTS,
    RUN_COMMANDS,
    RUN_STATUS,
    RUNS,
    TASKS,
    TOPICS,
    USAGE,
    VERIFIED,
    WORKFLOWS,
    Topic,
    UnknownTopic,
    all_topics,
    dlq,
    topic_for,
)
from assay.bus.transport import BusMessage, Handle, Positions, Source, Transport

__all__ = [
    "AGGREGATES",
    "DECISIONS",
    "EPISODES",
    "GRADED",
    "RESULTS",
    "RUNS",
    "RUN_COMMANDS",
    "RUN_STATUS",
    "TASKS",
    "TOPICS",
    "USAGE",
    "VERIFIED",
    "WORKFLOWS",
    "BusMessage",
    "EmbeddedBus",
    "EmbeddedSource",
    "FileLock",
    "Handle",
    "OutboxRelay",
    "Positions",
    "Source",
    "Topic",
    "Transport",
    "UnknownTopic",
    "all_topics",
    "dlq",
    "murmur2",
    "partition_for",
    "topic_for",
]
