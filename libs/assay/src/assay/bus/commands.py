"""Operator commands and intake as an outside producer sends them: the one place the CLI
and the console build `CancelRun`, `SignalRun`, `RewindRun`, `CancelRollout`,
`ReviewProposal`, `AcknowledgeDrift`, `TenantDeleted`, `TaskSubmitted` and
`WorkflowRegistered` entries.

Each function validates what it is given and returns the entry for its topic, keyed and
with a message id derived from what it asks (asking the same thing twice is one message
to every consumer's inbox). None publishes: the caller hands the entry to Kafka or to
the embedded bus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from assay.bus.topics import RUN_COMMANDS, TASKS, TENANTS, WORKFLOWS, producer_entry
from assay.kernel.errors import AssayError
from assay.kernel.ids import RunId, TenantId, WorkflowId, is_run_id
from assay.kernel.schema import one_line
from assay.messages import (
    AcknowledgeDrift,
    CancelRollout,
    CancelRun,
    ReviewProposal,
    RewindRun,
    SignalRun,
    TaskSubmitted,
    TenantDeleted,
    WorkflowRegistered,
)
from assay.store.ports import OutboxEntry

APPROVAL = "approval"
"""The signal an await step for a human approval waits for (`assay approve`)."""


class CommandInvalid(AssayError):
    """A command or a submission does not parse; the message names what is wrong."""


@dataclass(frozen=True)
class Command:
    """An entry to produce, and the stage whose dead letters say it was refused."""

    entry: OutboxEntry
    stage: str


def _run(run: str) -> RunId:
    if not is_run_id(run):
        raise CommandInvalid(f"not a run id: {run!r}")
    return RunId(run)


def cancel_run(tenant: TenantId, run: str, reason: str) -> Command:
    """A `CancelRun` onto `assay.run-commands`.

    Raises:
        CommandInvalid: `run` is not a run id, or the reason is too long.
    """
    try:
        msg = CancelRun(tenant=tenant, run_id=_run(run), reason=reason)
    except ValidationError as exc:
        raise CommandInvalid(f"invalid cancel: {one_line(exc)}") from exc
    return Command(producer_entry(RUN_COMMANDS, msg, tenant, f"cancel:{run}:{reason}"), "execute")


def signal_run(tenant: TenantId, run: str, name: str, payload: str) -> Command:
    """A `SignalRun` onto `assay.run-commands` (`approval` approves a waiting run).

    Raises:
        CommandInvalid: `run` is not a run id, or the signal's name or payload is invalid.
    """
    try:
        msg = SignalRun(tenant=tenant, run_id=_run(run), signal=name, payload=payload)
    except ValidationError as exc:
        raise CommandInvalid(f"invalid signal: {one_line(exc)}") from exc
    idem = f"signal:{run}:{name}:{payload}"
    return Command(producer_entry(RUN_COMMANDS, msg, tenant, idem), "execute")


def rewind_run(tenant: TenantId, run: str, at: int, branch: int | None, reason: str) -> Command:
    """A `RewindRun` onto `assay.run-commands`.

    Raises:
        CommandInvalid: `run` is not a run id, or the LSN or branch is negative.
    """
    if at < 0 or (branch is not None and branch < 0):
        raise CommandInvalid("--at and --branch are LSNs and branch numbers: 0 or more")
    try:
        msg = RewindRun(tenant=tenant, run_id=_run(run), at=at, branch=branch, reason=reason)
    except ValidationError as exc:
        raise CommandInvalid(f"invalid rewind: {one_line(exc)}") from exc
    idem = f"rewind:{run}:{branch}:{at}:{reason}"
    return Command(producer_entry(RUN_COMMANDS, msg, tenant, idem), "execute")


def cancel_rollout(tenant: TenantId, group: str, reason: str) -> Command:
    """A `CancelRollout` onto `assay.tasks`, keyed like the group's task.

    Raises:
        CommandInvalid: the group key or the reason does not parse.
    """
    try:
        msg = CancelRollout(tenant=tenant, idempotency_key=group, reason=reason or "cancelled")
    except ValidationError as exc:
        raise CommandInvalid(f"invalid rollout cancel: {one_line(exc)}") from exc
    return Command(producer_entry(TASKS, msg, tenant, f"cancel-rollout:{group}:{reason}"), "ingest")


def review_proposal(
    tenant: TenantId, workflow: str, proposal: str, approve: bool, reason: str
) -> Command:
    """A `ReviewProposal` onto `assay.workflows`.

    Raises:
        CommandInvalid: the proposal id, the workflow id or the reason does not parse.
    """
    try:
        msg = ReviewProposal(
            tenant=tenant,
            workflow_id=WorkflowId(workflow),
            proposal_id=proposal,
            approve=approve,
            reason=reason,
        )
    except ValidationError as exc:
        raise CommandInvalid(f"invalid review: {one_line(exc)}") from exc
    verb = "approve" if approve else "reject"
    return Command(producer_entry(WORKFLOWS, msg, tenant, f"review:{proposal}:{verb}"), "decide")


def acknowledge_drift(tenant: TenantId, workflow: str, drift: int, reason: str) -> Command:
    """An `AcknowledgeDrift` onto `assay.workflows`: ingest takes the drifted task mix as
    the new reference, which releases the promotion decide held for it. `drift` names
    the drift acknowledged (the tasks watched when it was found): acknowledging it twice
    is one message, a later drift's acknowledgement another.

    Raises:
        CommandInvalid: the workflow id or the reason does not parse.
    """
    try:
        msg = AcknowledgeDrift(tenant=tenant, workflow_id=WorkflowId(workflow), reason=reason)
    except ValidationError as exc:
        raise CommandInvalid(f"invalid drift acknowledgement: {one_line(exc)}") from exc
    return Command(
        producer_entry(WORKFLOWS, msg, tenant, f"ack-drift:{workflow}:{drift}"), "ingest"
    )


def delete_tenant(tenant: TenantId, reason: str) -> Command:
    """A `TenantDeleted` onto `assay.tenants`, keyed by the tenant: every stage deletes what
    it holds of it. One message id per tenant, whatever the reason: asking twice is one
    deletion.

    Raises:
        CommandInvalid: the reason is too long.
    """
    try:
        msg = TenantDeleted(tenant=tenant, reason=reason)
    except ValidationError as exc:
        raise CommandInvalid(f"invalid tenant deletion: {one_line(exc)}") from exc
    return Command(producer_entry(TENANTS, msg, tenant, f"delete-tenant:{tenant}"), "ingest")


def submit_task(task: TaskSubmitted) -> Command:
    """A `TaskSubmitted` onto `assay.tasks`, identified by its idempotency key."""
    return Command(producer_entry(TASKS, task, task.tenant, task.idempotency_key), "ingest")


def register_workflow(
    tenant: TenantId,
    definition: dict[str, Any],
    version: str,
    *,
    rewrite: bool = False,
    parents: list[str] | None = None,
) -> Command:
    """A `WorkflowRegistered` onto `assay.workflows` (`definition` already validated, of
    version `version`).

    Raises:
        CommandInvalid: a parent is not a version hash.
    """
    try:
        msg = WorkflowRegistered(
            tenant=tenant, definition=definition, rewrite=rewrite, parents=parents
        )
    except ValidationError as exc:
        raise CommandInvalid(f"--parent: {one_line(exc)}") from exc
    return Command(producer_entry(WORKFLOWS, msg, tenant, version), "decide")
