"""The bus: topics, Kafka's partitioner, the transport port, the embedded and Kafka
transports, the relay.

Each name is imported on first use: embedded mode never loads aiokafka, and a process
that needs the topics alone loads no transport.
"""

from typing import TYPE_CHECKING

from assay.kernel.lazy import lazy_exports

if TYPE_CHECKING:
    from assay.bus.embedded import EmbeddedBus, EmbeddedSource
    from assay.bus.headers import ORIGINAL_HEADERS, BadOriginalHeaders, original_headers
    from assay.bus.kafka import (
        KafkaSource,
        KafkaTransport,
        PublishFailed,
        TopicMismatch,
        ensure_topics,
    )
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
        TENANTS,
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
else:
    __getattr__ = lazy_exports(
        __name__,
        {
            "assay.bus.embedded": ["EmbeddedBus", "EmbeddedSource"],
            "assay.bus.headers": ["ORIGINAL_HEADERS", "BadOriginalHeaders", "original_headers"],
            "assay.bus.partitioner": ["murmur2", "partition_for"],
            "assay.bus.relay": ["FileLock", "OutboxRelay"],
            "assay.bus.topics": [
                "AGGREGATES",
                "DECISIONS",
                "EPISODES",
                "GRADED",
                "RESULTS",
                "RUN_COMMANDS",
                "RUN_STATUS",
                "RUNS",
                "TASKS",
                "TENANTS",
                "TOPICS",
                "USAGE",
                "VERIFIED",
                "WORKFLOWS",
                "Topic",
                "UnknownTopic",
                "all_topics",
                "dlq",
                "producer_entry",
                "topic_for",
            ],
            "assay.bus.transport": ["BusMessage", "Handle", "Positions", "Source", "Transport"],
            "assay.bus.kafka": [
                "KafkaSource",
                "KafkaTransport",
                "PublishFailed",
                "TopicMismatch",
                "ensure_topics",
            ],
        },
    )

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
    "TENANTS",
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
