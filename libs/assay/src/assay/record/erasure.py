"""A deleted tenant's tombstone in a stage's log (`assay tenant delete`).

When a stage deletes what it holds of a tenant (`CommitBatch.erase`), the same commit
appends one `TenantErased` record to the tenant's `tenant` stream; it folds to the
`tenant_erased` document. The tombstone is all that is left of the tenant in the
stage: it makes deleting again a no-op, makes the stage refuse the tenant's later
messages, and tells `assay tenant status` that this stage is done. Retention never
prunes it. Every stage registers the event and folds it (`StageSpec` adds both).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from assay.kernel.ids import TenantId
from assay.record.events import BranchKey, Event, LogRecord
from assay.record.state import Fold, Put, ReadModel, StateDelta, StateKey

TOMBSTONE_STREAM = "tenant"
"""The stream of a deleted tenant's tombstone."""
ERASED_KIND = "tenant_erased"
"""The kind of the tombstone's document."""
ERASED_KEY = "tombstone"


class TenantErased(Event):
    """Everything the stage held of the tenant was deleted in this record's commit."""

    type: ClassVar[str] = "TenantErased"
    version: ClassVar[int] = 1
    command: str = Field(description="Message id of the `TenantDeleted` carried out.")
    reason: str = Field("", max_length=2000, description="Why, as the command said.")


class Tombstone(ReadModel):
    """A deleted tenant, as one stage records it."""

    kind: ClassVar[str] = ERASED_KIND
    command: str = Field(description="Message id of the `TenantDeleted` carried out.")
    reason: str = Field("", description="Why, as the command said.")
    at_ms: int = Field(description="When the stage deleted it (ms since the epoch).")


def tombstone_key(tenant: TenantId) -> BranchKey:
    """The stream of `tenant`'s tombstone."""
    return BranchKey.main(tenant, TOMBSTONE_STREAM)


def tombstone_at(tenant: TenantId) -> StateKey:
    """Where `tenant`'s tombstone document is."""
    return StateKey(tenant, ERASED_KIND, ERASED_KEY)


def with_erasure(fold: Fold) -> Fold:
    """`fold`, which also folds `TenantErased` records into the tombstone document."""

    def folded(record: LogRecord) -> list[StateDelta]:
        if isinstance(record.event, TenantErased):
            stone = Tombstone(
                command=record.event.command, reason=record.event.reason, at_ms=record.at_ms
            )
            return [Put(tombstone_at(record.key.tenant), stone.model_dump(mode="json"))]
        return fold(record)

    folded.__doc__ = fold.__doc__
    return folded
