"""A `Journal` straight onto an event log: no bus, no outbox (`assay run`, tests)."""

from __future__ import annotations

from collections.abc import Sequence

from assay.kernel.ids import Lsn
from assay.kernel.schema import Versioned
from assay.record.events import BranchKey, Event, LogRecord
from assay.store.ports import Checkpoint, CommitBatch, EventLog


class LogJournal:
    """One commit per append on an `EventLog`; messages to emit are kept, not sent.

    With `defers`, records the driver defers (a Pure attempt's) ride with the next
    `record_and_commit` — the caller's own, for the run's end, included; without, the
    journal knows no later commit and the driver commits them at once.
    """

    def __init__(self, log: EventLog, *, defers: bool = False) -> None:
        self.log = log
        self.defers = defers
        self.emitted: list[tuple[str, Versioned]] = []
        self._held: list[tuple[BranchKey, Event]] = []
        self._held_emits: list[tuple[str, Versioned]] = []

    async def history(self, key: BranchKey) -> list[LogRecord]:
        """Every record of the branch."""
        return await self.log.read(key)

    async def history_after(self, key: BranchKey, upto: Lsn) -> list[LogRecord]:
        """The branch's records after `upto`."""
        return await self.log.read(key, Lsn(upto + 1))

    async def latest_checkpoint(self, key: BranchKey) -> Checkpoint | None:
        """The branch's newest checkpoint."""
        return await self.log.latest_checkpoint(key)

    async def put_checkpoint(self, key: BranchKey, upto: Lsn, state: bytes) -> None:
        """Store a checkpoint of the branch."""
        await self.log.put_checkpoint(key, upto, state)

    async def record_and_commit(
        self, key: BranchKey, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        """Commit what is held and `events` together; remember the messages to emit."""
        records = [*self._held, *((key, e) for e in events)]
        await self.log.commit(CommitBatch(records=records))
        self.emitted.extend([*self._held_emits, *emits])
        self._held, self._held_emits = [], []

    async def defer(
        self, key: BranchKey, *events: Event, emits: Sequence[tuple[str, Versioned]] = ()
    ) -> None:
        """Hold `events` for the next `record_and_commit`."""
        self._held.extend((key, e) for e in events)
        self._held_emits.extend(emits)
