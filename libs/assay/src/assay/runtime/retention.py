"""Bounded storage: what every store keeps, for how long, and what replaces it — in one table.

`RETENTION` is the declaration; `docs/retention.md` holds the same table, rendered by
`retention_table` and checked against it by a test. The sweeps here enforce the rows
that name a stream pattern (`Kept.streams`): every `prune_interval_s` each stage

- forgets inbox entries older than `inbox_keep_s` (which must exceed the bus's topic
  retention, so no copy of the message can still arrive: a copy published later by a
  relay that crashed between publishing and acknowledging lands within seconds);
- compacts each branch whose oldest records are older than `records_keep_s` (or the
  rule's own `Kept.period`, the console's model calls' `usage_keep_s`): those
  records leave the log, the documents they folded to that a row declares
  finished (`Kept.forget`) go with them, and every other document they folded to is
  restated in one `Compacted` record written at the branch's LSN 0 in the same commit
  (the previous one, if any, goes with the dropped records) — so `assay rebuild
  --check` is still identical (from the checkpoints forward). A branch left with
  nothing to restate is deleted whole.

Then the store gives back the space (`EventLog.reclaim_space`): SQLite's write-ahead
log is checkpointed and truncated, so it holds only what was written since the last
sweep; Postgres's tombstones of deleted documents go.

Shipped outbox rows are deleted as the relay acknowledges them, and the embedded bus
truncates each partition below what every stage reading it has handled (`truncate_bus`),
then truncates its own write-ahead log the same way.
A document a compacted branch deletes (or forgets) must be written by that branch only;
the rows below keep to that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from assay.engine.retention import RetentionPolicy
from assay.kernel.ids import Lsn
from assay.kernel.waiting import sleep_or
from assay.record.compaction import Compacted, RestatedDocument
from assay.record.events import LogRecord
from assay.record.state import Fold, StateKey
from assay.store.ports import (
    BranchTruncation,
    CommitBatch,
    EventLog,
    StaleBranch,
    StreamChanged,
)

if TYPE_CHECKING:
    from assay.bus.embedded import EmbeddedBus

log = logging.getLogger(__name__)

ALL_STAGES = "every stage"
_PAGE = 10_000


@dataclass(frozen=True)
class Kept:
    """One row of the retention table: what a stage keeps, how long, what replaces it."""

    stage: str
    """The stage (or `ALL_STAGES`, or `bus`)."""
    what: str
    """The records or documents, as an operator would look for them."""
    kept: str
    """How long: a `RetentionPolicy` field's variable, or a condition."""
    replaced_by: str
    """What is left once they go."""
    streams: str | None = None
    """The branches the records sweep compacts (`*` matches anything); None: not this sweep."""
    forget: frozenset[str] = frozenset()
    """Document kinds that go with their records instead of being restated."""
    forget_all: bool = False
    """Every document the records folded to goes with them."""
    period: str = "records_keep_s"
    """The `RetentionPolicy` field saying how long the records sweep keeps them."""


def _var(name: str) -> str:
    return f"`ASSAY_RETENTION_{name.upper()}`"


RECORDS = _var("records_keep_s")
"""Finished records' period."""

RETENTION: tuple[Kept, ...] = (
    Kept(ALL_STAGES, "inbox entries (handled message ids)", _var("inbox_keep_s"), "nothing"),
    Kept(ALL_STAGES, "outbox rows", "until the relay has shipped them", "nothing"),
    Kept(ALL_STAGES, "consumer positions", "always (one per partition)", "overwritten"),
    Kept(
        ALL_STAGES,
        "a deleted tenant's tombstone (`tenant` stream, `tenant_erased` document)",
        "always: never pruned (the stage refuses the tenant's messages while it is there)",
        "-",
    ),
    Kept(
        "bus",
        "embedded bus records (`bus.sqlite`)",
        f"until every stage reading the topic has handled them and {_var('topic_retention_s')}"
        " has passed (topics no stage reads: that period alone); the last of each partition "
        "stays",
        "nothing",
    ),
    Kept(
        "bus",
        "Kafka topics (distributed mode)",
        f"the topics' `retention.ms`, created as {_var('topic_retention_s')}",
        "nothing (Kafka deletes old segments)",
    ),
    Kept(
        "bus",
        "a deleted tenant's embedded bus records (but `assay.tenants`)",
        "until every stage of the process holds the tenant's tombstone (one published after"
        " that: 30 s, so its stage refuses it and its sender reads the dead letter)",
        "a hole in the partition's offsets",
    ),
    Kept(
        "bus",
        "a deleted tenant's messages on Kafka (distributed mode)",
        "the topics' `retention.ms`: Kafka cannot delete records by key",
        "nothing (Kafka deletes old segments)",
    ),
    Kept(
        "ingest",
        "a task's admission (`task:<idempotency key>`, `task` documents)",
        RECORDS,
        "nothing: the same key is admitted again after that",
        streams="task:*",
        forget=frozenset({"task"}),
    ),
    Kept("ingest", "workflows, versions, allocations, meters", "always (one per workflow)", "-"),
    Kept(
        "ingest",
        "rollout groups (`rollout:<key>`)",
        RECORDS,
        "a `Compacted` checkpoint of their documents",
        streams="rollout:*",
    ),
    Kept(
        "execute",
        "a run's records (each branch, its commands)",
        "until grading ended and `ASSAY_RETENTION_TIER_AFTER_S` later (after the "
        "reduction, for a run over the token ceiling)",
        "an archive blob and a `Tiered` tombstone (`<run>/tiered`); the episode blob (or "
        "its summary) stays",
    ),
    Kept(
        "execute",
        "a tiered run's tombstone and its documents",
        RECORDS,
        "nothing: the archive blob stays",
        streams="*/tiered",
        forget_all=True,
    ),
    Kept(
        "verify",
        "a run's verdict (`run:<run>`, `verdict` documents)",
        RECORDS,
        "nothing",
        streams="run:*",
        forget=frozenset({"verdict"}),
    ),
    Kept(
        "verify",
        "a cancelled run's stop (`stop:<run>`, `stopped` documents)",
        RECORDS,
        "nothing: a run's episode does not come back that late",
        streams="stop:*",
        forget=frozenset({"stopped"}),
    ),
    Kept(
        "tournament",
        "a task's grading records (`task:<task>`)",
        RECORDS,
        "a `Compacted` checkpoint of the task's references, groups and parked runs; "
        "each run's score and judge answers go",
        streams="task:*",
        forget=frozenset({"scored", "verdict", "replay"}),
    ),
    Kept(
        "tournament",
        "rollout selections (`rollout:<group>`)",
        RECORDS,
        "a `Compacted` checkpoint; judge answers go",
        streams="rollout:*",
        forget=frozenset({"verdict"}),
    ),
    Kept(
        "tournament",
        "grading meters (`grading-meter*`)",
        RECORDS,
        "a `Compacted` checkpoint of the meter",
        streams="grading-meter*",
    ),
    Kept(
        "tournament",
        "calibration rounds (`calibration`)",
        RECORDS,
        "a `Compacted` checkpoint of the schedule and each judge's last agreement",
        streams="calibration",
    ),
    Kept(
        "aggregate",
        "a version's tallies (`version:<version>`)",
        RECORDS,
        "a `Compacted` checkpoint of its tally and latest failures",
        streams="version:*",
    ),
    Kept("decide", "a workflow's ladder and decisions", "always (one per workflow)", "-"),
    Kept(
        "console",
        "a run's row (`run:<run>`, `console_run` documents)",
        RECORDS,
        "nothing: the run leaves the console's lists",
        streams="run:*",
        forget=frozenset({"console_run"}),
    ),
    Kept(
        "console",
        "a tenant's model calls (`usage:<day>`, `console_call` documents, `console_usage` rows)",
        _var("usage_keep_s"),
        "nothing: the spend page reads 90 days at most",
        streams="usage:*",
        forget=frozenset({"console_call"}),
        period="usage_keep_s",
    ),
)
"""The retention table: every store of every stage, in pipeline order."""


def rules_for(stage: str) -> tuple[Kept, ...]:
    """The rows the records sweep enforces in `stage`."""
    return tuple(k for k in RETENTION if k.stage == stage and k.streams is not None)


def retention_table() -> str:
    """`RETENTION` as the Markdown table `docs/retention.md` holds."""
    lines = [
        "| stage | what | kept | then replaced by |",
        "|---|---|---|---|",
        *(f"| {k.stage} | {k.what} | {k.kept} | {k.replaced_by} |" for k in RETENTION),
    ]
    return "\n".join(lines) + "\n"


TABLE_START = "<!-- retention table: generated from assay.runtime.retention.RETENTION -->"
TABLE_END = "<!-- end of the retention table -->"


def with_retention_table(page: str) -> str:
    """`page` (Markdown) with the text between the table's markers replaced by the table.

    Raises:
        ValueError: the page lacks the markers.
    """
    head, start, rest = page.partition(TABLE_START)
    _, end, tail = rest.partition(TABLE_END)
    if not start or not end:
        raise ValueError(f"the page has no {TABLE_START!r} ... {TABLE_END!r}")
    return f"{head}{TABLE_START}\n\n{retention_table()}\n{TABLE_END}{tail}"


# -- the records sweep ------------------------------------------------------------------


@dataclass
class Swept:
    """What one sweep of a stage removed."""

    inbox: int = 0
    compacted: int = 0
    records: int = 0
    forgotten: int = 0
    reclaimed: int = 0
    """What the store gave back after (`EventLog.reclaim_space`)."""


@dataclass
class StageRetention:
    """Retention of one stage's store: its rules, its fold, the policy. `run` sweeps
    every `prune_interval_s` until stopped; `sweep` once."""

    stage: str
    fold: Fold
    policy: RetentionPolicy
    clock: Callable[[], float] = time.time
    rules: tuple[Kept, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.rules = rules_for(self.stage)

    async def sweep(self, store: EventLog) -> Swept:
        """Prune the inbox, compact every rule's stale branches and reclaim the space, once."""
        now_ms = int(self.clock() * 1000)
        swept = Swept(inbox=await store.prune_inbox(now_ms - int(self.policy.inbox_keep_s * 1000)))
        for rule in self.rules:
            assert rule.streams is not None
            cutoff = now_ms - int(getattr(self.policy, rule.period) * 1000)
            for stale in await store.stale_branches(rule.streams, cutoff, self.policy.prune_limit):
                try:
                    await compact_branch(store, self.fold, rule, stale, cutoff, swept)
                except StreamChanged as exc:  # written meanwhile: the next sweep again
                    log.info("retention: %s not compacted now: %s", stale.key.stream, exc)
        swept.reclaimed = await store.reclaim_space()
        return swept

    async def run(self, store: EventLog, stop: asyncio.Event) -> None:
        """Sweep every `prune_interval_s` until `stop` is set."""
        while not stop.is_set():
            swept = await self.sweep(store)
            if swept.records or swept.inbox:
                log.info("retention of %s: %s", self.stage, swept)
            await sleep_or(stop, self.policy.prune_interval_s)


async def compact_branch(
    store: EventLog, fold: Fold, rule: Kept, stale: StaleBranch, cutoff_ms: int, swept: Swept
) -> None:
    """Drop the branch's records committed before `cutoff_ms`, with its checkpoint at LSN
    0 if it has one (see the module docstring); the new checkpoint takes LSN 0.

    Raises:
        StreamChanged: a record was appended to the branch meanwhile; nothing changed.
    """
    records = await _read_from(store, stale)
    dropped = list(_prefix(records, cutoff_ms))
    if not any(not isinstance(r.event, Compacted) for r in dropped):
        return
    kept = records[len(dropped) :]
    later = {d.at for r in kept for d in fold(r)}
    touched = list(dict.fromkeys(d.at for r in dropped for d in fold(r)))
    forget = [
        at for at in touched if at not in later and (rule.forget_all or at.kind in rule.forget)
    ]
    restated = await _restate(store, [at for at in touched if at not in forget])
    head = None
    if kept or restated:
        head = Compacted(dropped=len(dropped), below_ms=cutoff_ms, documents=restated)
    below = Lsn(kept[0].lsn if kept else stale.end)
    cut = BranchTruncation(stale.key, below, stale.end, head)
    await store.commit(CommitBatch(truncations=[cut], forget=forget))
    swept.compacted += 1
    swept.records += len(dropped)
    swept.forgotten += len(forget)


def _prefix(records: Iterable[LogRecord], cutoff_ms: int) -> Iterable[LogRecord]:
    """The leading records committed before `cutoff_ms`, and the checkpoint at LSN 0
    whenever it was committed (it is restated in the next one)."""
    for r in records:
        if r.at_ms >= cutoff_ms and not (r.lsn == 0 and isinstance(r.event, Compacted)):
            return
        yield r


async def _restate(store: EventLog, keys: list[StateKey]) -> list[RestatedDocument]:
    """The documents at `keys` as they stand; a deleted one is left out (no record left
    in the log writes it again)."""
    out = []
    for at in keys:
        value = await store.get(at)
        if value is not None:
            out.append(RestatedDocument(kind=at.kind, key=at.key, value=value))
    return out


async def _read_from(store: EventLog, stale: StaleBranch) -> list[LogRecord]:
    records: list[LogRecord] = []
    while True:
        start = Lsn(records[-1].lsn + 1 if records else 0)
        page = await store.read(stale.key, start, _PAGE)
        records.extend(page)
        if len(page) < _PAGE:
            return records


# -- the embedded bus --------------------------------------------------------------------


async def truncate_bus(
    bus: EmbeddedBus,
    readers: dict[str, list[EventLog]],
    topics: Iterable[str],
    older_than_ms: int,
) -> int:
    """Delete each partition's records below the lowest position of every stage reading
    its topic (`readers`, by topic) that were published before `older_than_ms`; the
    records deleted. A topic no stage reads loses what is older than that alone; a
    partition's last record always stays (it holds the partition's end offset)."""
    floors: dict[tuple[str, int], int] = {}
    for topic in topics:
        ends = await bus.end_offsets(topic)
        for p, end in ends.items():
            floor = end
            for reader in readers.get(topic, []):
                floor = min(floor, (await reader.positions()).get((topic, p), 0))
            floors[(topic, p)] = floor
    return await bus.truncate(floors, older_than_ms)
