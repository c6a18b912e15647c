"""Storage ports (§7). Every adapter passes the same contract suite."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from assay.kernel.errors import AssayError
from assay.kernel.ids import Lsn, MessageId, TenantId
from assay.kernel.spend import Reservation, Spend, SpendDay, SpendLimit
from assay.record.events import BranchKey, Event, LogRecord
from assay.record.state import StateKey


class DuplicateMessage(AssayError):
    """The batch's inbox id was already committed: the message was handled before."""


class StaleFence(AssayError):
    """The batch was written under a fence that is no longer the stream's lease:
    another worker took the run over. Nothing of the batch was written (§9.4)."""


class LeaseLost(AssayError):
    """A renewal found the lease held under another fence: stop working on the run."""


class StreamChanged(AssayError):
    """A branch does not end where the caller read it: one to be deleted (a record was
    appended since, or the branch was already deleted), or one the batch expected to
    end at a given LSN (`CommitBatch.expect`: another writer appended first). Nothing
    of the batch was written."""


@dataclass(frozen=True)
class Lease:
    """A claim on one stream (a run), granted by the store under its own clock.

    `fence` grows by one with every grant, whoever the holder; a commit carrying
    a lease is accepted only while its fence is the stream's current one.
    """

    tenant: TenantId
    stream: str
    holder: str
    fence: int
    expires_at_ms: int
    """When it lapses, in the database clock's milliseconds since the epoch."""


@dataclass(frozen=True)
class OutboxEntry:
    """One message to publish after the commit: topic, key, bytes, headers."""

    topic: str
    key: str
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True)
class PendingOutbox:
    """A committed, unshipped outbox row, in commit order."""

    seq: int
    entry: OutboxEntry


@dataclass(frozen=True)
class ConsumerPosition:
    """Where a stage resumes reading one partition: the next offset to read."""

    topic: str
    partition: int
    next_offset: int


@dataclass(frozen=True)
class Checkpoint:
    """A materialised snapshot of one stream, valid up to and including `upto`."""

    key: BranchKey
    upto: Lsn
    state: bytes


@dataclass(frozen=True)
class BranchDeletion:
    """Delete every record of one branch — which must hold exactly LSNs `0 .. end - 1`,
    the records the caller read (and, for tiering, archived) — and its checkpoints. A
    stream the commit leaves with no record loses its lease row too (one per run
    otherwise stayed forever): the fence of a stream that holds nothing guards nothing,
    and a writer still holding an old fence finds no lease and is refused (`StaleFence`)."""

    key: BranchKey
    end: Lsn
    """The branch's next LSN as the caller saw it: how many records it holds."""


@dataclass(frozen=True)
class BranchTruncation:
    """Delete the records of one branch below LSN `below` (and its checkpoints), keeping
    the rest — which must end at `end`: nothing may have been appended since the caller
    read the branch — and write `head`, if given, at LSN 0 in their place (folded like
    any record). Retention's compaction (`assay.runtime.retention`) puts its checkpoint
    there, so LSN 0 stays taken: a writer that takes an unknown branch to be new (next
    LSN 0) is refused and learns where it ends. A branch truncated whole without a
    head starts over at LSN 0, like a deleted one."""

    key: BranchKey
    below: Lsn
    end: Lsn
    """The branch's next LSN as the caller saw it."""
    head: Event | None = None


@dataclass(frozen=True)
class StaleBranch:
    """A branch whose oldest record was committed before a cut-off (`EventLog.stale_branches`)."""

    key: BranchKey
    first: Lsn
    """Its lowest LSN still in the log."""
    end: Lsn
    """Its next LSN."""


@dataclass
class CommitBatch:
    """Everything one commit writes, all or nothing (§8.3).

    Records are appended to their streams (LSNs assigned by the adapter, per
    branch), the stage's fold turns them into derived-state deltas, the
    consumer position advances, the inbox remembers the message id, and the
    outbox rows are enqueued — in one transaction.
    """

    records: list[tuple[BranchKey, Event]] = field(default_factory=list)
    position: ConsumerPosition | None = None
    inbox: tuple[TenantId, MessageId] | None = None
    outbox: list[OutboxEntry] = field(default_factory=list)
    fence: Lease | None = None
    """When set, the commit is refused (`StaleFence`) unless this is still the
    stream's current lease — checked in the same transaction."""
    deletions: list[BranchDeletion] = field(default_factory=list)
    """Branches whose records leave the log in this commit (tiering, §8.6), before
    `records` are appended. The fold is not run backwards: the documents the deleted
    records folded to stay as they are, so a caller that wants `rebuild` to stay
    identical appends a record here that folds to them. A deleted branch is not meant
    to be written again: if it is, its writer starts it over at LSN 0 (a replica that
    still caches where it ended may go on from there). Rare: an adapter may take a
    slower path for such a batch."""
    truncations: list[BranchTruncation] = field(default_factory=list)
    """Branches whose oldest records leave the log in this commit (retention's
    compaction), before `records` are appended; like `deletions`, the fold is not run
    backwards. A branch that moved on since it was read refuses the batch
    (`StreamChanged`). Rare: an adapter may take a slower path for such a batch."""
    forget: list[StateKey] = field(default_factory=list)
    """Documents removed outright (not through the fold), after the deletions and
    truncations and before `records`: the documents of records this batch deletes that
    no record left in the log folds to, so that `rebuild` stays identical."""
    erase: TenantId | None = None
    """A tenant of whom every row of the store goes first, before anything else of the
    batch: its records, documents, checkpoints, leases and inbox entries, and the outbox
    rows keyed by it (`tenant` or `tenant:...`, as every topic keys). The fold is not run
    backwards; the batch's own records (a tombstone) are written after. Rare: an adapter
    may take a slower path for such a batch."""
    expect: list[tuple[BranchKey, Lsn]] = field(default_factory=list)
    """Compare-and-swap: each branch must end at this LSN (hold exactly that many
    records) when the batch commits, else `StreamChanged` and nothing is written. The
    batch must append to each such branch, and its first record there lands at exactly
    that LSN, so of two writers that read the same end and race, one fails. For state
    that must have one writer at a time (decide's allocation of a workflow)."""

    def __bool__(self) -> bool:
        return bool(
            self.records
            or self.position
            or self.inbox
            or self.outbox
            or self.deletions
            or self.truncations
            or self.forget
            or self.erase
        )

    @property
    def removes(self) -> bool:
        """Whether the batch deletes records or documents outside the fold (a slow path)."""
        return bool(self.deletions or self.truncations or self.forget or self.erase)

    def check_expect(self) -> None:
        """Raise `ValueError` unless the batch appends to every branch it `expect`s."""
        written = {key for key, _ in self.records}
        for key, _ in self.expect:
            if key not in written:
                raise ValueError(f"a batch that expects {key.stream} to end somewhere must append")


@dataclass(frozen=True)
class RebuildReport:
    """What re-folding the log produced against the state that was there."""

    records: int
    documents_before: int
    documents_after: int
    differences: list[str]

    @property
    def identical(self) -> bool:
        """True when the rebuilt state is byte-identical to the stored one."""
        return not self.differences


class EventLog(Protocol):
    """A stage's log, derived state, positions, inbox and outbox, in one store."""

    async def commit(self, batch: CommitBatch) -> list[Lsn]:
        """Apply a batch atomically; return the LSNs given to its records, in order.

        Raises:
            DuplicateMessage: the inbox id was committed before; nothing was written.
            StaleFence: the batch's lease was taken over; nothing was written.
            StreamChanged: a branch of `batch.deletions` does not end at its `end`;
                nothing was written.
        """
        ...

    async def read(
        self, key: BranchKey, from_lsn: Lsn = Lsn(0), limit: int = 10_000
    ) -> list[LogRecord]:
        """Records of one branch from `from_lsn`, ascending, decoded at current versions."""
        ...

    async def branches(self, stream: str, tenant: TenantId | None = None) -> list[BranchKey]:
        """Every branch of `stream` that holds a record, ordered by tenant then branch.

        With `tenant`, that tenant's branches only (another tenant's stream of the
        same name is not there); without it, every tenant's — which finds whose a
        stream is, at the cost of a scan of the log. Empty when no record exists.
        """
        ...

    async def stale_branches(self, pattern: str, before_ms: int, limit: int) -> list[StaleBranch]:
        """Branches of every tenant whose stream matches `pattern` (`*` matches any
        characters, nothing else is special) holding a record committed before
        `before_ms` (milliseconds since the epoch) that is not of type `Compacted`; at
        most `limit`, oldest first. For retention's sweep, never for a tenant's query."""
        ...

    async def prune_inbox(self, before_ms: int) -> int:
        """Forget inbox entries committed before `before_ms`; how many went. A message
        handled before then and delivered again is handled again: the caller keeps
        entries longer than any redelivery can come (`assay.runtime.retention`)."""
        ...

    async def reclaim_space(self) -> int:
        """Give back the space of what retention deleted, where the store needs telling;
        how much went. SQLite checkpoints and truncates its write-ahead log (else it
        keeps its largest size): the WAL's bytes, 0 while another connection reads
        the file. Postgres deletes the tombstones of deleted documents (`state`
        rows whose value is null; autovacuum reuses the freed pages): how many."""
        ...

    async def put_checkpoint(self, key: BranchKey, upto: Lsn, state: bytes) -> None:
        """Store a snapshot of `key` valid up to `upto`."""
        ...

    async def latest_checkpoint(self, key: BranchKey, upto: Lsn | None = None) -> Checkpoint | None:
        """Newest checkpoint at or below `upto` (any if None); None: fold from LSN 0."""
        ...

    async def delete_checkpoints(self, key: BranchKey) -> None:
        """Drop every checkpoint of `key` (they are an optimisation only)."""
        ...

    async def get(self, at: StateKey) -> dict[str, Any] | None:
        """One derived document, or None."""
        ...

    async def scan(
        self, tenant: TenantId, kind: str, prefix: str = ""
    ) -> list[tuple[str, dict[str, Any]]]:
        """Derived documents of a kind for one tenant whose key starts with `prefix`."""
        ...

    async def scan_kind(self, kind: str) -> list[tuple[TenantId, str, dict[str, Any]]]:
        """Derived documents of a kind across every tenant, as (tenant, key, document).

        For the stage's own housekeeping (timers, sweeps) — never for answering a
        tenant's query, which `scan` scopes to that tenant.
        """
        ...

    async def positions(self) -> dict[tuple[str, int], int]:
        """Stored consumer positions: (topic, partition) -> next offset."""
        ...

    async def seen(self, tenant: TenantId, message_id: MessageId) -> bool:
        """Whether a message id was committed to the inbox."""
        ...

    async def drain_outbox(self, limit: int) -> list[PendingOutbox]:
        """Committed-but-unshipped rows in commit order. Read by the relay only."""
        ...

    async def ack_outbox(self, seqs: list[int]) -> None:
        """Mark rows shipped (they are removed)."""
        ...

    async def claim(self, tenant: TenantId, stream: str, holder: str, ttl_ms: int) -> Lease | None:
        """Grant `holder` the stream's lease for `ttl_ms` (database clock) with the next
        fence, if it is free, lapsed, or already `holder`'s; else None."""
        ...

    async def renew(self, lease: Lease, ttl_ms: int) -> Lease:
        """Extend a lease from now (database clock).

        Raises:
            LeaseLost: the stream's lease has another fence (it was taken over).
        """
        ...

    async def release(self, lease: Lease) -> None:
        """Give the lease up (a suspended run holds none). No-op if it was taken over."""
        ...

    async def reserve(
        self, tenant: TenantId, purpose: str, day: str, amount: Spend, limit: SpendLimit
    ) -> Reservation | None:
        """Hold `amount` against the tenant's `limit` for `purpose` on `day` (UTC), if
        what is spent and held that day plus `amount` stays within every ceiling; else
        None, and nothing is held. One atomic conditional update of the day's row in
        this store: concurrent callers (any partition, any replica) never overshoot."""
        ...

    async def settle(self, reservation: Reservation, actual: Spend) -> None:
        """Replace the held amount by what was really spent (`Spend()`: a release, no
        call was billed). Call it once per reservation."""
        ...

    async def spend_of(self, tenant: TenantId, purpose: str, day: str) -> SpendDay:
        """The tenant's ledger row for `purpose` on `day`: spent and held."""
        ...

    async def rebuild(self, *, keep: bool) -> RebuildReport:
        """Drop derived state, re-fold it from the log and compare byte for byte.

        Args:
            keep: commit the rebuilt state; otherwise leave the store untouched.
        """
        ...

    async def close(self) -> None:
        """Release the store."""
        ...


class BlobStore(Protocol):
    """Content-addressed blobs, namespaced per tenant (§3, §7)."""

    async def put(self, tenant: TenantId, content: bytes) -> str:
        """Store content durably; return its ref (blake3 hex). Idempotent."""
        ...

    async def get(self, tenant: TenantId, ref: str) -> bytes | None:
        """The content, or None if this tenant has no such blob."""
        ...

    async def delete(self, tenant: TenantId, ref: str) -> None:
        """Remove a blob of this tenant (no-op if absent)."""
        ...

    async def delete_tenant(self, tenant: TenantId) -> int:
        """Remove every blob of this tenant (its whole prefix); how many went. Deleting
        a tenant that has none is a no-op (0)."""
        ...
