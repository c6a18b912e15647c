"""One handler's view of a workflow in decide: its stream, read and written under a
compare-and-swap."""

from __future__ import annotations

from typing import Any

from assay.bus.topics import DECISIONS
from assay.grading.ladder import Standing
from assay.kernel import Lsn, WorkflowId
from assay.messages import AllocationChanged, Ladder, Rung
from assay.record import Event
from assay.runtime import UnitOfWork
from assay_decide.events import AllocationSet, stream_of


class Workflow:
    """One handler's view of a workflow: what it read, and its writes, compare-and-swapped.

    Open it before reading anything else of the workflow: the stream's end read here
    is what the commit expects, so whatever the handler reads after it is covered.
    """

    def __init__(self, uow: UnitOfWork[Any], workflow: WorkflowId, head: Lsn) -> None:
        self.uow = uow
        self.id = workflow
        self._head = head
        self._expecting = False

    @classmethod
    async def open(cls, uow: UnitOfWork[Any], workflow: WorkflowId) -> Workflow:
        """Read the stream's end (first), for the compare-and-swap."""
        head = await uow.get_document("head", workflow)
        return cls(uow, workflow, Lsn(int(head["next"]) if head else 0))

    def record(self, event: Event) -> None:
        """Append to the workflow's stream; the commit lands only if no one else did."""
        key = stream_of(self.uow.tenant, self.id)
        if not self._expecting:
            self.uow.expect(key, self._head)
            self._expecting = True
        self.uow.record(key, event)

    async def allocation(self) -> dict[str, Any] | None:
        """The workflow's allocation (an `AllocationChanged` payload)."""
        return await self.uow.get_document("allocation", self.id)

    async def standing(self, alloc: dict[str, Any]) -> Standing:
        """Where the challenger stands (rebuilt from the rung for an allocation of v1)."""
        doc = await self.uow.get_document("ladder", self.id) or {}
        share = float(alloc["challenger_share"])
        base = {
            "ladder": alloc.get("ladder") or Ladder.DEFAULT.value,
            "rung": alloc.get("rung") or (Rung.TRIAL if share > 0 else Rung.SHADOW).value,
            "share": share,
        }
        return Standing.model_validate({**base, **doc})

    def allocate(
        self,
        read: dict[str, Any] | None,
        cause: str,
        standing: Standing | None = None,
        **fields: Any,
    ) -> AllocationChanged:
        """Record and publish the next generation of the allocation."""
        gen = int((read or {}).get("generation", 0))
        if standing is not None:
            fields.update(
                challenger_share=standing.share, rung=standing.rung, ladder=standing.ladder
            )
        alloc = AllocationChanged(
            tenant=self.uow.tenant, workflow_id=self.id, generation=gen + 1, **fields
        )
        self.record(
            AllocationSet(allocation=alloc, expected_generation=gen, cause=cause, standing=standing)
        )
        self.uow.emit(DECISIONS, alloc)
        return alloc
