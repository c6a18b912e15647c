"""Stored history must keep decoding and folding (§8.7).

Every event type of every stage, at every version that still decodes, and every
message type has a stored fixture. A new version without one fails here; add it
with `tests/fixtures/capture.py` or by hand — never by editing an old one.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from assay.engine import StubModel
from assay.engine.tools import BUILTIN_TOOLS
from assay.grading import StubJudge
from assay.kernel import BranchId, Lsn, TenantId
from assay.messages import MESSAGES
from assay.record import BranchKey, LogRecord
from assay.runtime import STAGES, StageDeps, StageSpec, discover_stages
from assay.store import FsBlobStore

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _specs(tmp: Path) -> dict[str, StageSpec]:
    deps = StageDeps(
        blobs=FsBlobStore(tmp), model=StubModel(), judge=StubJudge(), tools=dict(BUILTIN_TOOLS)
    )
    factories = discover_stages()
    return {name: factories[name](deps) for name in STAGES}


def _event_cases() -> list[tuple[str, str, int]]:
    specs = _specs(Path("/nonexistent"))
    return [
        (stage, type_, version)
        for stage, spec in specs.items()
        for type_ in sorted(spec.events.types())
        for version in spec.events.versions(type_)
    ]


@pytest.mark.parametrize(("stage", "type_", "version"), _event_cases())
def test_every_event_version_has_a_fixture_that_decodes_and_folds(
    stage: str, type_: str, version: int, tmp_path: Path
) -> None:
    path = FIXTURES / "events" / stage / f"{type_}.v{version}.json"
    assert path.exists(), f"no golden fixture for {stage} event {type_} v{version}: {path}"
    spec = _specs(tmp_path)[stage]
    event = spec.events.decode(type_, version, json.loads(path.read_text()))
    key = BranchKey(TenantId(uuid.UUID(int=1)), "fixture", BranchId(0))
    deltas = spec.fold(LogRecord(key, Lsn(0), version, 0, event))
    assert all(d.at.tenant == key.tenant for d in deltas), "a fold wrote outside the tenant"


@pytest.mark.parametrize(
    ("type_", "version"),
    [(t, v) for t in sorted(MESSAGES.types()) for v in MESSAGES.versions(t)],
)
def test_every_message_version_has_a_fixture_that_decodes(type_: str, version: int) -> None:
    path = FIXTURES / "messages" / f"{type_}.v{version}.json"
    assert path.exists(), f"no golden fixture for message {type_} v{version}: {path}"
    msg = MESSAGES.decode(type_, version, json.loads(path.read_text()))
    assert msg.type == type_


def test_no_fixture_is_orphaned() -> None:
    """A fixture whose type vanished means a variant was removed — never allowed."""
    specs = _specs(Path("/nonexistent"))
    for path in (FIXTURES / "events").glob("*/*.json"):
        stage, (type_, _) = path.parent.name, path.stem.rsplit(".v", 1)
        assert type_ in specs[stage].events.types(), f"{path}: type {type_} no longer decodes"
    for path in (FIXTURES / "messages").glob("*.json"):
        type_ = path.stem.rsplit(".v", 1)[0]
        assert type_ in MESSAGES.types(), f"{path}: message type {type_} no longer decodes"
