"""The topic registry of DESIGN §4: each topic, what it carries, how it is keyed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from assay.kernel.errors import AssayError
from assay.kernel.ids import TenantId
from assay.kernel.schema import Versioned
from assay.messages import (
    AcknowledgeDrift,
    AllocationChanged,
    AttemptIndeterminate,
    BranchRun,
    CalibrationDue,
    CancelGrading,
    CancelRollout,
    CancelRun,
    ChallengerRejected,
    EpisodeReduced,
    GradingCancelled,
    GroupDue,
    JudgeCalibrated,
    Promoted,
    ProposalRequested,
    ReviewProposal,
    RewindRun,
    RolledBack,
    RolloutClosed,
    RolloutProgress,
    RolloutResult,
    RunExecuted,
    RunGraded,
    RunResult,
    RunSpawned,
    RunStatusChanged,
    RunVerified,
    SignalRun,
    TaskMixDrifted,
    TaskMixRebased,
    TaskSubmitted,
    TenantDeleted,
    TenantStageDeleted,
    UsageRecorded,
    VariantAggregate,
    WorkflowRegistered,
)
from assay.messages.envelope import message_id, seal
from assay.store.ports import OutboxEntry

TASKS = "assay.tasks"
WORKFLOWS = "assay.workflows"
RUNS = "assay.runs"
RUN_COMMANDS = "assay.run-commands"
RUN_STATUS = "assay.run-status"
EPISODES = "assay.episodes"
VERIFIED = "assay.verified"
GRADED = "assay.graded"
RESULTS = "assay.results"
AGGREGATES = "assay.aggregates"
DECISIONS = "assay.decisions"
USAGE = "assay.usage"
TENANTS = "assay.tenants"
"""A tenant's deletion and each stage's answer, keyed by the tenant alone: every stage
consumes it, and one partition of it holds all of a tenant's."""


_DLQ_PREFIX = "assay.dlq."


def dlq(stage: str) -> str:
    """The dead-letter topic of a stage."""
    return f"{_DLQ_PREFIX}{stage}"


class UnknownTopic(AssayError):
    """A message was sent to a topic that does not carry its type."""


@dataclass(frozen=True)
class Topic:
    """A topic: its name, the message types it carries, its key, and whether it is a
    control topic (see `partition_count`)."""

    name: str
    carries: tuple[type[Versioned], ...]
    key: Callable[[Versioned], str]
    key_doc: str
    control: bool = False
    """A few records a day per tenant (registrations, decisions, deletions), not one or
    more per run: created with the control partition count."""


def _k(*fields: str) -> Callable[[Versioned], str]:
    def key(msg: Versioned) -> str:
        parts = []
        for path in fields:
            value: object = msg
            for attr in path.split("."):
                value = getattr(value, attr)
            parts.append(str(value))
        return ":".join(parts)

    return key


def _workflow_key(msg: Versioned) -> str:
    if isinstance(msg, ReviewProposal | TaskMixDrifted | TaskMixRebased | AcknowledgeDrift):
        return f"{msg.tenant}:{msg.workflow_id}"
    assert isinstance(msg, WorkflowRegistered)
    return f"{msg.tenant}:{msg.definition.get('id', '')}"


def _task_key(msg: Versioned) -> str:
    """Episodes of a task and its groups' timers share a partition (§11.4); a tenant's
    calibration rounds share one."""
    if isinstance(msg, CalibrationDue):
        return f"{msg.tenant}:calibration"
    if isinstance(msg, GroupDue | RolloutClosed | EpisodeReduced):
        return f"{msg.tenant}:{msg.task_id}"
    assert isinstance(msg, RunVerified | GradingCancelled)
    return f"{msg.run.tenant}:{msg.run.task_id}"


def _aggregate_key(msg: Versioned) -> str:
    """A variant's evidence keys on its workflow; a tenant's judge calibrations share one
    key (one partition orders a tenant's rounds)."""
    if isinstance(msg, JudgeCalibrated):
        return f"{msg.tenant}:calibration"
    assert isinstance(msg, VariantAggregate)
    return f"{msg.tenant}:{msg.workflow_id}"


def _command_key(msg: Versioned) -> str:
    if isinstance(msg, CancelGrading):
        return f"{msg.run.tenant}:{msg.run.run_id}"
    assert isinstance(msg, CancelRun | RewindRun | BranchRun | SignalRun)
    return f"{msg.tenant}:{msg.run_id}"


def _result_key(msg: Versioned) -> str:
    if isinstance(msg, RolloutResult):
        return f"{msg.tenant}:{msg.idempotency_key}"
    assert isinstance(msg, RunResult)
    return f"{msg.tenant}:{msg.run_id}"


TOPICS: dict[str, Topic] = {
    t.name: t
    for t in [
        Topic(
            TASKS,
            (TaskSubmitted, RolloutProgress, CancelRollout),
            _k("tenant", "idempotency_key"),
            "tenant:idempotency_key",
        ),
        Topic(
            WORKFLOWS,
            (WorkflowRegistered, ReviewProposal, TaskMixDrifted, TaskMixRebased, AcknowledgeDrift),
            _workflow_key,
            "tenant:workflow_id",
            control=True,
        ),
        Topic(RUNS, (RunSpawned,), _k("run.tenant", "run.run_id"), "tenant:run_id"),
        Topic(
            RUN_STATUS,
            (RunStatusChanged, AttemptIndeterminate),
            _k("run.tenant", "run.run_id"),
            "tenant:run_id",
        ),
        Topic(EPISODES, (RunExecuted,), _k("run.tenant", "run.run_id"), "tenant:run_id"),
        Topic(
            VERIFIED,
            (
                RunVerified,
                GroupDue,
                RolloutClosed,
                CalibrationDue,
                GradingCancelled,
                EpisodeReduced,
            ),
            _task_key,
            "tenant:task_id (CalibrationDue: tenant:calibration)",
        ),
        Topic(
            GRADED,
            (RunGraded,),
            _k("run.tenant", "run.workflow_version"),
            "tenant:workflow_version",
        ),
        Topic(
            RESULTS,
            (RunResult, RolloutResult),
            _result_key,
            "tenant:run_id (a rollout's: tenant:idempotency_key)",
        ),
        Topic(
            RUN_COMMANDS,
            (CancelRun, RewindRun, BranchRun, SignalRun, CancelGrading),
            _command_key,
            "tenant:run_id",
        ),
        Topic(
            AGGREGATES,
            (VariantAggregate, JudgeCalibrated),
            _aggregate_key,
            "tenant:workflow_id (JudgeCalibrated: tenant:calibration)",
        ),
        Topic(
            DECISIONS,
            (AllocationChanged, Promoted, ChallengerRejected, RolledBack, ProposalRequested),
            _k("tenant", "workflow_id"),
            "tenant:workflow_id",
            control=True,
        ),
        Topic(USAGE, (UsageRecorded,), _k("tenant"), "tenant"),
        Topic(TENANTS, (TenantDeleted, TenantStageDeleted), _k("tenant"), "tenant", control=True),
    ]
}


def topic_for(name: str, msg: Versioned) -> Topic:
    """The topic `name`, checked to carry `msg`'s type."""
    topic = TOPICS.get(name)
    if topic is None:
        raise UnknownTopic(f"no topic {name!r}")
    if not isinstance(msg, topic.carries):
        raise UnknownTopic(f"topic {name!r} does not carry {msg.type}")
    return topic


def producer_entry(
    topic: str,
    msg: Versioned,
    tenant: TenantId,
    idem: str,
    *,
    occurred_at: datetime | None = None,
    traceparent: str | None = None,
) -> OutboxEntry:
    """`msg` sealed as an outside producer would send it: keyed as `topic` defines, with a
    message id derived from the tenant, the topic and the producer's idempotency key, so
    producing the same thing twice is one message to every consumer's inbox.

    `occurred_at` (now if omitted) is the envelope's time; every message the fact causes
    inherits it, and ingest derives run ids from it. `traceparent` (W3C) makes every
    message the fact causes part of the producer's trace.
    """
    spec = topic_for(topic, msg)
    env = seal(
        msg,
        tenant=tenant,
        key=spec.key(msg),
        id=message_id("producer", str(tenant), topic, idem),
        causation=None,
        occurred_at=occurred_at,
        traceparent=traceparent,
    )
    return OutboxEntry(topic, env.key, env.encode(), tuple(env.headers()))


def all_topics(stages: list[str]) -> list[str]:
    """Every topic name, the stages' dead-letter topics included."""
    return [*TOPICS, *(dlq(s) for s in stages)]


def partition_count(name: str, partitions: int, control_partitions: int) -> int:
    """How many partitions topic `name` is created with, in both transports.

    A control topic (`Topic.control`) and a dead-letter topic get `control_partitions`;
    every other topic, those with a record or more per run, gets `partitions`. Both
    transports place a key with `partition_for(key, partition_count(...))`, so a key
    lands on the same partition number in either.

    Why two counts (DESIGN §4): a consumer fetches every partition it holds on each
    fetch, and a broker's cost of an idle fetch grows with the partitions in it; a
    control topic that every stage reads (`assay.tenants`) at the count of the hot
    topics made most of an idle deployment's broker work. A control topic's records
    are few, so one partition (and one replica reading it) keeps up.
    """
    topic = TOPICS.get(name)
    control = name.startswith(_DLQ_PREFIX) if topic is None else topic.control
    return control_partitions if control else partitions


def partition_counts(names: list[str], partitions: int, control_partitions: int) -> dict[str, int]:
    """`partition_count` of each of `names`."""
    return {n: partition_count(n, partitions, control_partitions) for n in names}
