"""Ingest's verdict on tasks `assay submit` produced, read from the broker as any client could.

On a Kafka-fronted deployment a task is produced and the producer moves on; ingest
decides later. A task ingest refuses (a candidate matrix that cannot be admitted whole,
an unknown workflow…) goes to `assay.dlq.ingest` with the reason in the
`assay-dlq-reason` header; a task it admits spawns its first runs on `assay.runs`, each
caused by the task's envelope. The command line waits for one or the other, so that its
user learns of a refusal at submission, as in embedded mode.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from assay.bus.headers import DLQ_REASON as REASON
from assay.bus.topics import RUNS, dlq
from assay.messages import open_envelope

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer, TopicPartition

DLQ = dlq("ingest")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What ingest made of one task: admitted, or refused with its reason."""

    admitted: bool
    reason: str = ""


async def produce_and_await(
    bootstrap: str,
    tasks: list[bytes],
    produce: Callable[[], Awaitable[None]],
    timeout_s: float,
) -> dict[str, Verdict]:
    """Call `produce`, then read ingest's verdict on each task until all are in or
    `timeout_s` has passed.

    Args:
        tasks: the encoded envelope of every task `produce` sends.

    Returns:
        Each decided task's verdict, by envelope id; a task missing was decided neither
        way in time (ingest is behind or down, or the task repeats one already accepted,
        which spawns nothing new).
    """
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, client_id="assay-cli-verdicts"
    )
    await consumer.start()
    try:
        parts = await _from_the_end(consumer, (DLQ, RUNS))
        await produce()
        return await _read(consumer, parts, tasks, timeout_s)
    finally:
        await consumer.stop()


async def _from_the_end(
    consumer: AIOKafkaConsumer, topics: tuple[str, ...]
) -> list[TopicPartition]:
    """Assign every partition of `topics`, positioned where the broker says they end now.

    Only a start: which record answers which submission is decided by `_read`, never by
    position (a broker may place the end early — Tansu counts a batch of records as
    one — and a task submitted again has the same envelope id)."""
    from aiokafka import TopicPartition

    await consumer.topics()  # fetches the cluster's metadata
    parts = [
        TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or ())
    ]
    consumer.assign(parts)
    for tp, offset in (await consumer.end_offsets(parts)).items():
        consumer.seek(tp, offset)
    return parts


async def _read(
    consumer: AIOKafkaConsumer, parts: list[TopicPartition], tasks: list[bytes], timeout_s: float
) -> dict[str, Verdict]:
    """A dead letter answers a task when it holds the very bytes produced; a spawned run,
    when it was caused by the task's envelope id at the envelope's time (a stage's message
    carries its cause's `occurred_at`), so an earlier submission of the same task answers
    nothing here."""
    sent = {open_envelope(t).id: t for t in tasks}
    at = {i: open_envelope(t).occurred_at for i, t in sent.items()}
    found: dict[str, Verdict] = {}
    deadline = time.monotonic() + timeout_s
    while len(found) < len(sent) and time.monotonic() < deadline:
        for tp, records in (await consumer.getmany(*parts, timeout_ms=300)).items():
            for r in records:
                try:
                    env = open_envelope(r.value)
                except Exception:  # another producer's poison: not ours to judge
                    continue
                if tp.topic == DLQ and sent.get(env.id) == r.value:
                    reason = dict(r.headers).get(REASON, b"").decode()
                    found.setdefault(env.id, Verdict(admitted=False, reason=reason))
                cause = env.causation_id
                if tp.topic == RUNS and cause in at and at[cause] == env.occurred_at:
                    found.setdefault(cause, Verdict(admitted=True))
    return found
