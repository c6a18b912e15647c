"""Retention on both event-log adapters (§8.6): truncation, forgetting, the inbox, the sweep.

Pruned rows are gone, the fold of what is left is identical to the state
(`rebuild`), and a message whose inbox entry was pruned is still not handled again
where the stored position says it was.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import ClassVar

import asyncpg
import pytest

from assay.devstack import Service
from assay.devstack.postgres import scratch_database
from assay.engine.retention import RetentionPolicy
from assay.kernel.ids import Lsn, MessageId, TenantId, tenant_id
from assay.record import (
    BranchKey,
    Delete,
    Event,
    EventRegistry,
    LogRecord,
    Put,
    StateDelta,
    StateKey,
)
from assay.record.compaction import Compacted, RestatedDocument, with_compaction
from assay.runtime.retention import Kept, StageRetention, rules_for, with_retention_table
from assay.runtime.settings import AssaySettings, SettingsInvalid
from assay.store import (
    BranchTruncation,
    CommitBatch,
    ConsumerPosition,
    EventLog,
    SqliteEventLog,
    StreamChanged,
)
from assay.store.postgres import PostgresEventLog

ADAPTERS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
DAY_MS = 86_400_000


class Noted(Event):
    """A per-run fact (`note`, forgettable) and a per-task tally (`tally`, restated)."""

    type: ClassVar[str] = "retention.Noted"
    version: ClassVar[int] = 1
    run: str
    total: int
    drop_note: str | None = None


def _fold(record: LogRecord) -> list[StateDelta]:
    e = record.event
    t = record.key.tenant
    if not isinstance(e, Noted):
        return []
    out: list[StateDelta] = [
        Put(StateKey(t, "scored", e.run), {"run": e.run}),
        Put(StateKey(t, "tally", record.key.stream), {"total": e.total}),
    ]
    if e.drop_note is not None:
        out.append(Delete(StateKey(t, "scored", e.drop_note)))
    return out


FOLD = with_compaction(_fold)
REGISTRY = EventRegistry([Noted, Compacted])


@pytest.fixture(scope="module")
def retention_database(postgres: Service) -> Iterator[str]:
    with scratch_database(postgres, "assay_retention") as dsn:
        yield dsn


@pytest.fixture(params=ADAPTERS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[EventLog]:
    log: EventLog
    if request.param == "postgres":
        dsn = str(request.getfixturevalue("retention_database"))
        schema = f"retention_{uuid.uuid4().hex[:12]}"
        log = await PostgresEventLog(dsn, schema, REGISTRY, FOLD).open()
    else:
        log = await SqliteEventLog(tmp_path / "stage.sqlite", REGISTRY, FOLD).open()
    yield log
    await log.close()


def _tenant() -> TenantId:
    return tenant_id(uuid.uuid4())


async def _notes(store: EventLog, key: BranchKey, runs: list[str]) -> None:
    for i, run in enumerate(runs):
        await store.commit(CommitBatch(records=[(key, Noted(run=run, total=i + 1))]))


async def test_a_truncation_drops_the_records_below_and_keeps_the_rest(store: EventLog) -> None:
    t = _tenant()
    key = BranchKey.main(t, "task:a")
    await _notes(store, key, ["r0", "r1", "r2", "r3"])
    head = Compacted(dropped=2, below_ms=0, documents=[])
    await store.commit(CommitBatch(truncations=[BranchTruncation(key, Lsn(2), Lsn(4), head)]))
    assert [(r.lsn, r.event.type) for r in await store.read(key)] == [
        (0, "Compacted"),
        (2, Noted.type),
        (3, Noted.type),
    ]
    (lsn,) = await store.commit(CommitBatch(records=[(key, Noted(run="r4", total=5))]))
    assert lsn == 4  # the branch goes on where it ended


async def test_a_branch_truncated_whole_without_a_head_starts_over(store: EventLog) -> None:
    t = _tenant()
    key = BranchKey.main(t, "task:a")
    await _notes(store, key, ["r0", "r1"])
    await store.commit(CommitBatch(truncations=[BranchTruncation(key, Lsn(2), Lsn(2))]))
    assert await store.read(key) == []
    (lsn,) = await store.commit(CommitBatch(records=[(key, Noted(run="r2", total=1))]))
    assert lsn == 0


async def test_a_truncation_of_a_branch_that_moved_on_writes_nothing(store: EventLog) -> None:
    t = _tenant()
    key = BranchKey.main(t, "task:a")
    await _notes(store, key, ["r0", "r1", "r2"])
    at = StateKey(t, "scored", "r0")
    with pytest.raises(StreamChanged):
        await store.commit(
            CommitBatch(truncations=[BranchTruncation(key, Lsn(2), Lsn(2))], forget=[at])
        )
    assert len(await store.read(key)) == 3
    assert await store.get(at) is not None


async def test_forgotten_documents_are_gone_and_rebuild_stays_identical(store: EventLog) -> None:
    t = _tenant()
    key = BranchKey.main(t, "task:a")
    await _notes(store, key, ["r0", "r1"])
    head = Compacted(dropped=2, below_ms=0, documents=[_restated("tally", "task:a")])
    await store.commit(
        CommitBatch(
            truncations=[BranchTruncation(key, Lsn(2), Lsn(2), head)],
            forget=[StateKey(t, "scored", "r0"), StateKey(t, "scored", "r1")],
        )
    )
    (lsn,) = await store.commit(CommitBatch(records=[(key, Noted(run="r2", total=3))]))
    assert lsn == 1
    assert await store.get(StateKey(t, "scored", "r0")) is None
    assert await store.get(StateKey(t, "tally", "task:a")) == {"total": 3}
    assert [r.lsn for r in await store.read(key)] == [0, 1]
    assert (await store.rebuild(keep=False)).identical


def _restated(kind: str, key: str) -> RestatedDocument:
    return RestatedDocument(kind=kind, key=key, value={"total": 2})


async def test_inbox_entries_older_than_the_cut_off_are_pruned(store: EventLog) -> None:
    t = _tenant()
    await store.commit(CommitBatch(inbox=(t, MessageId("m1"))))
    assert await store.prune_inbox(0) == 0  # nothing is that old
    assert await store.seen(t, MessageId("m1"))
    assert await store.prune_inbox(2**62) == 1
    assert not await store.seen(t, MessageId("m1"))


async def test_stale_branches_match_the_pattern_literally_but_for_the_star(
    store: EventLog,
) -> None:
    t = _tenant()
    for stream in ("task:a", "task:b", "xtask:c", "task_d", "rollout:e"):
        await _notes(store, BranchKey.main(t, stream), ["r"])
    found = await store.stale_branches("task:*", 2**62, 100)
    assert sorted(b.key.stream for b in found if b.key.tenant == t) == ["task:a", "task:b"]
    assert await store.stale_branches("task:*", 0, 100) == []  # none that old
    underscore = await store.stale_branches("task_*", 2**62, 100)
    assert [b.key.stream for b in underscore if b.key.tenant == t] == ["task_d"]


async def test_the_sweep_compacts_old_records_forgets_finished_runs_and_rebuild_is_identical(
    store: EventLog,
) -> None:
    t = _tenant()
    key = BranchKey.main(t, "task:a")
    other = BranchKey.main(t, "task:b")
    await _notes(store, key, ["r0", "r1", "r2"])
    await store.commit(CommitBatch(records=[(other, Noted(run="r9", total=1))]))
    before = await store.get(StateKey(t, "tally", "task:a"))
    sweep = _sweep(now_ms=_newest_ms() + 2 * DAY_MS)
    swept = await sweep.sweep(store)
    assert swept.records == 4
    assert swept.compacted == 2
    (compacted,) = await store.read(key)
    assert isinstance(compacted.event, Compacted)
    assert compacted.event.dropped == 3
    assert await store.get(StateKey(t, "tally", "task:a")) == before
    for run in ("r0", "r1", "r2", "r9"):
        assert await store.get(StateKey(t, "scored", run)) is None
    assert (await store.rebuild(keep=False)).identical
    assert (await sweep.sweep(store)).compacted == 0  # a lone checkpoint stays as it is


async def test_each_rule_keeps_its_records_for_its_own_period(store: EventLog) -> None:
    """A rule naming another period (the console's model calls: `usage_keep_s`) is swept
    by that one, not by `records_keep_s`."""
    t = _tenant()
    usage, run = BranchKey.main(t, "usage:2026-12-01"), BranchKey.main(t, "run:r1")
    await store.commit(CommitBatch(records=[(usage, Noted(run="u0", total=1))]))
    await store.commit(CommitBatch(records=[(run, Noted(run="r1", total=1))]))
    policy = RetentionPolicy(
        topic_retention_s=60, inbox_keep_s=120, records_keep_s=DAY_MS / 1000, usage_keep_s=600
    )
    sweep = StageRetention("test", FOLD, policy, clock=lambda: (_newest_ms() + 3_600_000) / 1000)
    sweep.rules = (
        Kept("test", "runs", "", "", streams="run:*", forget=frozenset({"scored"})),
        Kept("test", "calls", "", "", streams="usage:*", forget_all=True, period="usage_keep_s"),
    )
    swept = await sweep.sweep(store)  # an hour on: past the calls' 10 minutes, not a day
    assert swept.records == 1
    assert await store.read(usage) == []
    assert await store.get(StateKey(t, "scored", "u0")) is None
    assert [r.event.type for r in await store.read(run)] == [Noted.type]
    assert (await store.rebuild(keep=False)).identical


def test_the_console_keeps_model_calls_for_the_spend_pages_range() -> None:
    (calls,) = [k for k in rules_for("console") if k.streams == "usage:*"]
    assert calls.period == "usage_keep_s"
    assert RetentionPolicy().usage_keep_s >= 90 * DAY_MS / 1000
    with pytest.raises(ValueError, match="USAGE_KEEP_S"):
        RetentionPolicy(topic_retention_s=60, usage_keep_s=60)


async def test_the_sweep_keeps_what_later_records_still_fold_to(store: EventLog) -> None:
    t = _tenant()
    key = BranchKey.main(t, "task:a")
    await _notes(store, key, ["r0", "r1"])
    last = (await store.read(key))[-1].at_ms
    while int(time.time() * 1000) <= last:  # noqa: ASYNC110  (a millisecond on, no event)
        await asyncio.sleep(0.001)
    await store.commit(CommitBatch(records=[(key, Noted(run="r0", total=3))]))  # r0 again
    swept = await _sweep(now_ms=last + 1 + DAY_MS).sweep(store)  # the first two are old
    assert swept.records == 2
    assert await store.get(StateKey(t, "scored", "r1")) is None  # only the dropped records'
    assert await store.get(StateKey(t, "scored", "r0")) == {"run": "r0"}  # a kept record's
    assert [(r.lsn, r.event.type) for r in await store.read(key)] == [
        (0, Compacted.type),
        (2, Noted.type),
    ]
    assert (await store.rebuild(keep=False)).identical


async def test_a_pruned_inbox_entry_whose_position_was_stored_is_not_handled_again(
    store: EventLog,
) -> None:
    """The sources start at the stored position: the message below it is never fetched
    again, whatever the inbox remembers."""
    t = _tenant()
    await store.commit(
        CommitBatch(
            inbox=(t, MessageId("m1")),
            position=ConsumerPosition("assay.test", 0, 8),
            records=[(BranchKey.main(t, "task:a"), Noted(run="r0", total=1))],
        )
    )
    await store.prune_inbox(2**62)
    assert not await store.seen(t, MessageId("m1"))
    assert (await store.positions())[("assay.test", 0)] == 8


async def test_reclaiming_space_leaves_what_the_store_holds_as_it_was(store: EventLog) -> None:
    t = _tenant()
    key = BranchKey.main(t, "task:a")
    await _notes(store, key, ["r0", "r1"])
    await store.commit(CommitBatch(records=[(key, Noted(run="r2", total=3, drop_note="r0"))]))
    assert await store.reclaim_space() > 0  # SQLite: its WAL; Postgres: r0's tombstone
    assert await store.get(StateKey(t, "scored", "r0")) is None
    assert await store.get(StateKey(t, "scored", "r1")) == {"run": "r1"}
    assert (await store.rebuild(keep=False)).identical
    (lsn,) = await store.commit(CommitBatch(records=[(key, Noted(run="r0", total=4))]))
    assert lsn == 3
    assert await store.get(StateKey(t, "scored", "r0")) == {"run": "r0"}


async def test_sqlite_truncates_its_wal_unless_another_connection_reads(tmp_path: Path) -> None:
    path = tmp_path / "stage.sqlite"
    log = await SqliteEventLog(path, REGISTRY, FOLD).open()
    wal = tmp_path / "stage.sqlite-wal"
    try:
        await _notes(log, BranchKey.main(_tenant(), "task:a"), [f"r{i}" for i in range(50)])
        reader = sqlite3.connect(path)
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM log").fetchone()  # holds a read snapshot
        assert await log.reclaim_space() == 0  # does not wait for the reader
        assert wal.stat().st_size > 0
        reader.close()
        assert await log.reclaim_space() > 0
        assert wal.stat().st_size == 0
    finally:
        await log.close()


@pytest.mark.postgres
async def test_postgres_tombstones_go_when_space_is_reclaimed(retention_database: str) -> None:
    schema = f"retention_{uuid.uuid4().hex[:12]}"
    log = await PostgresEventLog(retention_database, schema, REGISTRY, FOLD).open()
    conn = await asyncpg.connect(retention_database)
    try:
        t = _tenant()
        key = BranchKey.main(t, "task:a")
        await _notes(log, key, ["r0", "r1", "r2"])
        await log.commit(CommitBatch(records=[(key, Noted(run="r3", total=4, drop_note="r0"))]))
        await log.commit(CommitBatch(records=[(key, Noted(run="r4", total=5, drop_note="r1"))]))
        tombstones = f'SELECT count(*) FROM "{schema}".state WHERE value IS NULL'
        assert await conn.fetchval(tombstones) == 2
        assert await log.reclaim_space() == 2
        assert await conn.fetchval(tombstones) == 0
        assert (await log.rebuild(keep=False)).identical
    finally:
        await conn.close()
        await log.close()


# -- helpers ------------------------------------------------------------------------


def _policy() -> RetentionPolicy:
    return RetentionPolicy(topic_retention_s=60, inbox_keep_s=120, records_keep_s=DAY_MS / 1000)


def _sweep(now_ms: int) -> StageRetention:
    retention = StageRetention("test", FOLD, _policy(), clock=lambda: now_ms / 1000)
    retention.rules = _test_rules()
    return retention


def _test_rules() -> tuple[Kept, ...]:
    return (Kept("test", "notes", "", "", streams="task:*", forget=frozenset({"scored"})),)


def _newest_ms() -> int:
    return int(time.time() * 1000) + 1000


def test_every_stage_declares_its_rules() -> None:
    for stage in ("verify", "tournament", "aggregate"):
        assert rules_for(stage)


def test_the_docs_table_is_the_declared_one() -> None:
    page = (Path(__file__).parents[3] / "docs/retention.md").read_text()
    assert with_retention_table(page) == page, "run `make config-docs`"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"ASSAY_RETENTION_INBOX_KEEP_S": "0"}, "ASSAY_RETENTION_INBOX_KEEP_S"),
        ({"ASSAY_RETENTION_RECORDS_KEEP_S": "0"}, "ASSAY_RETENTION_RECORDS_KEEP_S"),
        ({"ASSAY_RETENTION_TOPIC_RETENTION_S": "0"}, "ASSAY_RETENTION_TOPIC_RETENTION_S"),
        ({"ASSAY_RETENTION_INBOX_KEEP_S": "3600"}, "ASSAY_RETENTION_INBOX_KEEP_S"),
        (
            {"ASSAY_RETENTION_TOPIC_RETENTION_S": "100", "ASSAY_RETENTION_RECORDS_KEEP_S": "50"},
            "ASSAY_RETENTION_RECORDS_KEEP_S",
        ),
    ],
)
def test_a_retention_of_zero_or_below_the_topic_retention_stops_start_up(
    env: dict[str, str], named: str
) -> None:
    with pytest.raises(SettingsInvalid, match=named):
        AssaySettings.from_env(env)


def test_retention_periods_above_the_topic_retention_start() -> None:
    env = {
        "ASSAY_RETENTION_TOPIC_RETENTION_S": "5",
        "ASSAY_RETENTION_INBOX_KEEP_S": "6",
        "ASSAY_RETENTION_RECORDS_KEEP_S": "7",
    }
    assert AssaySettings.from_env(env).retention.records_keep_s == 7
