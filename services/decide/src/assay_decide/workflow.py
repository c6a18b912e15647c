"""One handler's view of a workflow in decide: its stream, read and written under a
compare-and-swap."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from assay.bus.topics import DECISIONS
from assay.grading.ladder import Standing, split_shares
from assay.kernel import Lsn, WorkflowId, WorkflowVersion
from assay.messages import AllocationChanged, LiveChallenger
from assay.record import Event
from assay_decide.deciding import DecideUnitOfWork
from assay_decide.events import AllocationSet, stream_of
from assay_decide.state import Allocation, Climb, Head, climb_key


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

    async def standings(self, alloc: Allocation) -> dict[WorkflowVersion, Standing]:
        """Where each live challenger stands, in the order admitted (rebuilt from its rung
        for an allocation of v1)."""
        out: dict[WorkflowVersion, Standing] = {}
        for live in alloc.challengers:
            doc = await self.uow.get(Climb, climb_key(self.id, live.version))
            out[live.version] = (doc or Climb()).standing(alloc, live)
        return out

    def allocate(
        self,
        read: Allocation | None,
        cause: str,
        *,
        current: WorkflowVersion,
        definitions: dict[str, dict[str, Any]],
        live: Mapping[WorkflowVersion, Standing] | None = None,
        moved: WorkflowVersion | None = None,
    ) -> AllocationChanged:
        """Record and publish the next generation of the allocation: `live` are the
        challengers that stay (in the order admitted) and where they stand, `moved` the
        one this change admitted or moved. Their rung shares split live traffic with the
        current version (`split_shares`)."""
        live = live or {}
        deps = self.uow.deps
        gen = read.generation if read else 0
        alloc = AllocationChanged(
            tenant=self.uow.tenant,
            workflow_id=self.id,
            generation=gen + 1,
            current=current,
            challengers=[
                LiveChallenger(version=v, rung=s.rung, ladder=s.ladder) for v, s in live.items()
            ],
            shares=split_shares(
                current, [(v, s.share) for v, s in live.items()], deps.ladder.challengers_ceiling
            ),
            shadow_rate=deps.shadow_rate if live else 0.0,
            definitions=definitions,
        )
        self.record(
            AllocationSet(
                allocation=alloc,
                expected_generation=gen,
                cause=cause,
                standing=live.get(moved) if moved else None,
                moved=moved,
            )
        )
        self.uow.emit(DECISIONS, alloc)
        return alloc
