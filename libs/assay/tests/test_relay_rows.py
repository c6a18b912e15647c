"""What the relay reads from an outbox and hands the producer, record by record.

The relay's per-record work is kept short (a batch's header arrays parsed in one
go, a one-pass check of whether headers go to the wire as they are); these tests
hold each shortcut to the long way it replaces.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from assay.bus.headers import as_text
from assay.bus.kafka import _wire_headers
from assay.record import EventRegistry, LogRecord, StateDelta
from assay.store import CommitBatch, OutboxEntry, SqliteEventLog
from assay.store.sqlite import decode_headers, decode_headers_of, encode_headers

names = st.sampled_from(["id", "type", "assay-dlq-original-headers", "ü", ""]) | st.text()
values = st.binary(max_size=40) | st.sampled_from([b"", b"abc", b"\x80", "✓".encode()])
header_lists = st.lists(st.tuples(names, values), max_size=6).map(tuple)


@settings(max_examples=300)
@given(st.lists(header_lists, max_size=8))
def test_a_batch_of_stored_headers_decodes_as_each_row_alone(
    rows: list[tuple[tuple[str, bytes], ...]],
) -> None:
    raws = [encode_headers(h) for h in rows]
    assert decode_headers_of(raws) == [decode_headers(r) for r in raws] == rows


def test_a_stored_value_holding_two_arrays_fails_rather_than_shifting_its_neighbours() -> None:
    one = encode_headers((("a", b"1"),))
    with pytest.raises(json.JSONDecodeError):  # what decoding it alone raises
        decode_headers_of([one + b"," + one, one])


@settings(max_examples=300)
@given(header_lists)
def test_wire_headers_are_what_the_text_dict_publish_would_write(
    headers: tuple[tuple[str, bytes], ...],
) -> None:
    entry = OutboxEntry("t", "k", b"v", headers)
    dict_publish = [("content-type", b""), *((n, t.encode()) for n, t in as_text(headers).items())]
    assert _wire_headers(entry) == dict_publish


def _no_fold(record: LogRecord) -> list[StateDelta]:
    return []


async def test_marking_rows_shipped_leaves_the_stage_s_commits_fully_synchronous(
    tmp_path: Path,
) -> None:
    log = await SqliteEventLog(tmp_path / "s.sqlite", EventRegistry([]), _no_fold).open()
    try:
        await log.commit(CommitBatch(outbox=[OutboxEntry("t", "k", b"v")]))
        (row,) = await log.drain_outbox(10)
        await log.ack_outbox([row.seq])
        assert await log.drain_outbox(10) == []
        (synchronous,) = log._db.execute("PRAGMA synchronous").fetchone()
        assert synchronous == 2  # FULL
    finally:
        await log.close()


async def test_rows_marked_shipped_are_fsynced_once_the_relay_finds_the_outbox_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr("assay.store.sqlite.os.fsync", recording_fsync)
    path = tmp_path / "s.sqlite"
    log = await SqliteEventLog(path, EventRegistry([]), _no_fold).open()
    try:
        await log.commit(CommitBatch(outbox=[OutboxEntry("t", f"k{i}", b"v") for i in range(3)]))
        first, *rest = await log.drain_outbox(10)
        await log.ack_outbox([first.seq])
        assert await log.drain_outbox(10) == rest  # rows left: nothing is synced yet
        assert synced == []
        await log.ack_outbox([r.seq for r in rest])
        assert await log.drain_outbox(10) == []
        assert synced == [f"{path}-wal"]
        assert await log.drain_outbox(10) == []  # once, not on every empty read
        assert synced == [f"{path}-wal"]
    finally:
        await log.close()
