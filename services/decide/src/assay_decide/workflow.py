"""One handler's view of a workflow in decide: its stream, read and written under a
compare-and-swap."""

from __future__ import annotations

from typing import Any

from assay.bus.topics import DECISIONS
from assay.grading.ladder import Standing
from assay.kernel import Lsn, WorkflowId
from assay.messages import AllocationChanged
from assay.record import Event
from assay_decide.deciding import DecideUnitOfWork
from assay_decide.events import AllocationSet, stream_of
from assay_decide.state import Allocation, Climb, Head


class Workflow:
    """One handler's view of a workflow: what it read, and its writes, compare-and-swapped.

    Open it before reading anything else of the workflow: the stream's end read here
    is what the commit expects, so whatever the handler reads after it is covered.
    """

    def __init__(self, uow: DecideUnitOfWork, workflow: WorkflowId, head: Lsn) -> None:
        self.uow = uow
        self.id = workflow
        self._head = head
        self._expecting = False

    @classmethod
    async def open(cls, uow: DecideUnitOfWork, workflow: WorkflowId) -> Workflow:
        """Read the stream's end (first), for the compare-and-swap."""
        head = await uow.get(Head, workflow)
        return cls(uow, workflow, Lsn(head.next if head else 0))

    def record(self, event: Event) -> None:
        """Append to the workflow's stream; the commit lands only if no one else did."""
        key = stream_of(self.uow.tenant, self.id)
        if not self._expecting:
            self.uow.expect(key, self._head)
            self._expecting = True
        self.uow.record(key, event)

    async def allocation(self) -> Allocation | None:
        """The workflow's allocation."""
        return await self.uow.get(Allocation, self.id)

    async def standing(self, alloc: Allocation) -> Standing:
        """Where the challenger stands (rebuilt from the rung for an allocation of v1)."""
        return (await self.uow.get(Climb, self.id) or Climb()).standing(alloc)

    def allocate(
        self,
        read: Allocation | None,
        cause: str,
        standing: Standing | None = None,
        **fields: Any,
    ) -> AllocationChanged:
        """Record and publish the next generation of the allocation."""
        gen = read.generation if read else 0
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
