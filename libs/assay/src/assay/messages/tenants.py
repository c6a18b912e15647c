"""The messages of a tenant's deletion (`assay tenant delete`).

`TenantDeleted` is a command on `assay.tenants`, keyed by the tenant: every stage
consumes that topic, so each stage's one consumer of the tenant's partition deletes
what the stage holds of the tenant (its records, documents, inbox and outbox rows,
blobs and sandbox workspaces) and answers with a `TenantStageDeleted` on the same
topic. `assay tenant status` reads each stage's tombstone of the tenant.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from assay.kernel.ids import TenantId
from assay.kernel.schema import Versioned


class TenantDeleted(Versioned):
    """Delete everything Assay holds of a tenant; its later tasks are refused."""

    type: ClassVar[str] = "TenantDeleted"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="The tenant to delete.")
    reason: str = Field("", max_length=2000, description="Why, for people.")


class TenantStageDeleted(Versioned):
    """One stage deleted what it held of a tenant (an answer to `TenantDeleted`)."""

    type: ClassVar[str] = "TenantStageDeleted"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="The deleted tenant.")
    stage: str = Field(description="The stage that deleted its own part.")
    command: str = Field(description="Message id of the `TenantDeleted` it answers.")
    blobs: int = Field(ge=0, description="Blobs deleted (0 where another stage went first).")
    workspaces: int = Field(ge=0, description="Sandbox workspaces deleted.")
