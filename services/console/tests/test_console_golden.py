"""The console's stored history must keep decoding and folding (§8.7): every event type
at every version has a stored fixture (`fixtures/capture.py` writes missing ones; an
existing one is never edited) that decodes and folds within its tenant."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from assay.kernel import BranchId, Lsn, TenantId
from assay.record import BranchKey, LogRecord
from assay.record.compaction import with_compaction
from assay.record.erasure import with_erasure
from assay_console.ladder import LADDER_EVENTS
from assay_console.stage import CONSOLE_EVENTS, fold_console

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "events"
CASES = [
    (type_, version)
    for type_ in sorted(CONSOLE_EVENTS.types())
    for version in CONSOLE_EVENTS.versions(type_)
]


@pytest.mark.parametrize(("type_", "version"), CASES)
def test_every_event_version_has_a_fixture_that_decodes_and_folds(type_: str, version: int) -> None:
    path = FIXTURES / f"{type_}.v{version}.json"
    assert path.exists(), f"no golden fixture for console event {type_} v{version}: {path}"
    event = CONSOLE_EVENTS.decode(type_, version, json.loads(path.read_text()))
    stream = "workflow:arith" if isinstance(event, LADDER_EVENTS) else "run:fixture"
    key = BranchKey(TenantId(uuid.UUID(int=1)), stream, BranchId(0))
    # as the stage folds: retention's checkpoint and a deleted tenant's tombstone too
    fold = with_erasure(with_compaction(fold_console))
    deltas = fold(LogRecord(key, Lsn(0), version, 0, event))
    assert deltas, "a stored fact that folds into nothing"
    assert all(d.at.tenant == key.tenant for d in deltas), "a fold wrote outside the tenant"
