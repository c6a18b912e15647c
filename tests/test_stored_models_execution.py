"""Every document execute and ingest stored before their state was typed reads as its
read model (`fixtures/demo-data-v1.tar.xz`, as `test_stored_state` extracts it).

A model that would refuse existing data — a field renamed, a type narrowed, a
field the old documents lack given no default — fails here. Documents written
whole from a model must also be that model's dump, byte for byte.
"""

from __future__ import annotations

import contextlib
import sqlite3
import tarfile
from pathlib import Path

import pytest

from assay.engine import BUILTIN_TOOLS, StubModel
from assay.engine.run_state import WORK_STATE, Waiting
from assay.grading import StubJudge
from assay.record import ReadModel
from assay.runtime.embedded import stage_log
from assay.runtime.stage import StageDeps, StageSpec
from assay.store import FsBlobStore
from assay_execute import create_stage as create_execute
from assay_ingest import create_stage as create_ingest
from assay_ingest.replay import ReplayMeter
from assay_ingest.rollouts import RolloutInput
from assay_ingest.state import INGEST_STATE, AcceptedTask
from assay_ingest.versions import LatestVersion, StoredDefinition

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "demo-data-v1.tar.xz"

MODELS: dict[str, tuple[type[ReadModel], ...]] = {
    "execute": WORK_STATE,
    "ingest": INGEST_STATE,
}
WHOLE = {StoredDefinition, LatestVersion, AcceptedTask, ReplayMeter, RolloutInput, Waiting}
"""Models whose documents the fold writes as the model's dump (no patches, no raw payload)."""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("earlier")
    with tarfile.open(FIXTURE) as archive:
        archive.extractall(root, filter="data")
    return root / "fx"


def stage(name: str, blobs: Path) -> StageSpec:
    deps = StageDeps(
        blobs=FsBlobStore(blobs), model=StubModel(), judge=StubJudge(), tools=dict(BUILTIN_TOOLS)
    )
    return (create_execute if name == "execute" else create_ingest)(deps)


@pytest.mark.parametrize("name", sorted(MODELS))
async def test_every_stored_document_reads_as_its_read_model(
    name: str, data_dir: Path, tmp_path: Path
) -> None:
    with contextlib.closing(sqlite3.connect(data_dir / f"{name}.sqlite")) as db:
        kinds = {kind for (kind,) in db.execute("SELECT DISTINCT kind FROM state")}
    models = {m.kind: m for m in MODELS[name]}
    assert kinds <= set(models), f"{name} stores kinds no read model reads: {kinds - set(models)}"
    log = stage_log(data_dir, stage(name, tmp_path))
    await log.open()
    try:
        read = 0
        for kind in sorted(kinds):
            model = models[kind]
            for _, _, doc in await log.scan_kind(kind):
                typed = model.model_validate(doc)
                if model in WHOLE:
                    assert typed.model_dump(mode="json") == doc
                read += 1
    finally:
        await log.close()
    assert read > 0
