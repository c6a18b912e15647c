"""Every stage's part of a tenant's deletion (`assay tenant delete`, DESIGN §7).

A `TenantDeleted` on `assay.tenants` reaches every stage: the topic is keyed by the
tenant, so one partition of it — one consumer of each stage — carries it. Each stage
deletes the tenant's blob prefix and sandbox workspaces (idempotent: a second pass
finds none), then, in one commit, every row it holds of the tenant (`CommitBatch.erase`:
records, documents, checkpoints, leases, inbox and outbox rows), its tombstone
(`assay.record.erasure`) and a `TenantStageDeleted` answer. A crash before that commit
leaves the message unacknowledged: it is delivered again and the deletion finishes. A
stage that already holds the tombstone does nothing: deleting twice is a no-op.

From then on the stage refuses the tenant's messages (`StageRunner`): a task arriving
at ingest is dead-lettered with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from assay.bus.topics import TENANTS
from assay.crash import crash_point
from assay.messages.tenants import TenantDeleted, TenantStageDeleted
from assay.record.erasure import TenantErased, tombstone_at, tombstone_key

if TYPE_CHECKING:
    from assay.runtime.stage import Handler, UnitOfWork
    from assay.sandbox.port import SandboxProvider


def erasing_point(stage: str) -> str:
    """The crash point after a stage deleted the tenant's blobs and workspaces, before
    the commit that deletes its rows."""
    return f"{stage}.tenant.before_erase"


def tenant_deletion(stage: str, sandbox: SandboxProvider | None) -> Handler:
    """The handler of `TenantDeleted` for `stage` (whose workspaces `sandbox` holds)."""

    async def on_tenant_deleted(msg: TenantDeleted, uow: UnitOfWork[Any]) -> None:
        """Delete what the stage holds of the tenant, once; answer `TenantStageDeleted`."""
        if await uow.log.get(tombstone_at(uow.tenant)) is not None:
            return  # deleted here before: a second command is a no-op
        blobs = await uow.blobs.delete_tenant(uow.tenant)
        workspaces = 0 if sandbox is None else await sandbox.discard_tenant(uow.tenant)
        crash_point(erasing_point(stage))
        uow.erase()
        uow.record(
            tombstone_key(uow.tenant), TenantErased(command=uow.envelope.id, reason=msg.reason)
        )
        answer = TenantStageDeleted(
            tenant=uow.tenant,
            stage=stage,
            command=uow.envelope.id,
            blobs=blobs,
            workspaces=workspaces,
        )
        uow.emit(TENANTS, answer)

    return on_tenant_deleted
