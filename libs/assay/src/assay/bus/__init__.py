"""The bus: topics, Kafka's partitioner, the transport port, the embedded and Kafka
transports, the relay.

The Kafka names are imported on first use, so embedded mode never loads aiokafka.
"""

from typing import TYPE_CHECKING, Any

from assay.bus.embedded import EmbeddedBus, EmbeddedSource
from assay.bus.headers import ORIGINAL_HEADERS, BadOriginalHeaders, original_headers
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
    producer_entry,
    topic_for,
)
from assay.bus.transport import BusMessage, Handle, Positions, Source, Transport

if TYPE_CHECKING:
    from assay.bus.kafka import (
        KafkaSource,
        KafkaTransport,
        PublishFailed,
        TopicMismatch,
        ensure_topics,
    )

_KAFKA = ("KafkaSource", "KafkaTransport", "PublishFailed", "TopicMismatch", "ensure_topics")


def __getattr__(name: str) -> Any:
    if name in _KAFKA:
        from assay.bus import kafka

        return getattr(kafka, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AGGREGATES",
    "DECISIONS",
    "EPISODES",
    "GRADED",
    "ORIGINAL_HEADERS",
    "RESULTS",
    "RUNS",
    "RUN_COMMANDS",
    "RUN_STATUS",
    "TASKS",
    "TOPICS",
    "USAGE",
    "VERIFIED",
    "WORKFLOWS",
    "BadOriginalHeaders",
    "BusMessage",
    "EmbeddedBus",
    "EmbeddedSource",
    "FileLock",
    "Handle",
    "KafkaSource",
    "KafkaTransport",
    "OutboxRelay",
    "Positions",
    "PublishFailed",
    "Source",
    "Topic",
    "TopicMismatch",
    "Transport",
    "UnknownTopic",
    "all_topics",
    "dlq",
    "ensure_topics",
    "murmur2",
    "original_headers",
    "partition_for",
    "producer_entry",
    "topic_for",
]
