"""Task-mix drift on the wire (§12.5): ingest's findings and an operator's acknowledgement.

Ingest watches each workflow's incoming tasks (`assay.grading.task_mix`) and says on
`assay.workflows`, keyed like the workflow, when a window has drifted from the
reference mix (`TaskMixDrifted`) and when it takes a new reference
(`TaskMixRebased`: the first full window, the mix at a promotion, or the mix an
operator acknowledged). Decide holds promotion from the first until the second. An
operator acknowledges a drift with `AcknowledgeDrift` (`assay ladder ack-drift`):
ingest then takes the drifted mix as the new reference, and says so.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from assay.kernel.ids import TenantId, WorkflowId, WorkflowVersion
from assay.kernel.schema import Versioned

RebaseCause = Literal["first_window", "promoted", "acknowledged"]


class TaskMixDrifted(Versioned):
    """A full window of a workflow's tasks drifted from the reference mix: some feature's
    population stability index is above the workflow's threshold."""

    type: ClassVar[str] = "TaskMixDrifted"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    current: WorkflowVersion = Field(description="The current version, whose mix it left.")
    psi: dict[str, float] = Field(description="Each watched feature's PSI over the window.")
    threshold: float = Field(gt=0, description="The workflow's PSI threshold.")
    window: int = Field(ge=1, description="Tasks in the window.")
    sampled: int = Field(ge=1, description="Tasks of the workflow watched so far.")
    reference_tasks: int = Field(ge=1, description="Tasks the reference mix was taken from.")

    def worst(self) -> tuple[str, float]:
        """The feature that moved most, and its PSI."""
        feature = max(sorted(self.psi), key=lambda f: self.psi[f])
        return feature, self.psi[feature]


class TaskMixRebased(Versioned):
    """Ingest took a new reference mix for a workflow: what later windows are compared
    with. A drift noted before it no longer holds promotion."""

    type: ClassVar[str] = "TaskMixRebased"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant.")
    workflow_id: WorkflowId = Field(description="Workflow.")
    current: WorkflowVersion = Field(description="The current version then.")
    cause: RebaseCause = Field(
        description="The first full window, a promotion, or an operator's acknowledgement."
    )
    reference_tasks: int = Field(ge=1, description="Tasks the reference was taken from.")
    sampled: int = Field(ge=0, description="Tasks of the workflow watched so far.")
    reason: str = Field("", max_length=2000, description="The operator's reason, if any.")


class AcknowledgeDrift(Versioned):
    """An operator accepts a workflow's drifted task mix as the new normal: ingest takes
    its last full window as the reference, and the promotion decide held goes ahead on
    the challenger's next evidence."""

    type: ClassVar[str] = "AcknowledgeDrift"
    version: ClassVar[int] = 1
    tenant: TenantId = Field(description="Tenant.")
    workflow_id: WorkflowId = Field(min_length=1, description="Workflow whose drift it accepts.")
    reason: str = Field("", max_length=2000, description="Why, for the record.")
