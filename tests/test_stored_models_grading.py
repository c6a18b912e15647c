"""Every document tournament, aggregate and decide stored before their state was typed
reads as its read model, and its read model writes it back unchanged.

`test_stored_state` re-folds the fixture's logs; this reads what is stored, so a read
model that would refuse (or reshape) a document an existing deployment holds fails here.
"""

from __future__ import annotations

import contextlib
import sqlite3
import tarfile
from pathlib import Path

import pytest

from assay.engine import BUILTIN_TOOLS, StubModel
from assay.grading.judges import StubJudge
from assay.record import ReadModel
from assay.runtime import StageDeps
from assay.runtime.embedded import discover_stages, stage_log
from assay.store import FsBlobStore
from assay_aggregate.tallies import AGGREGATE_STATE
from assay_decide.state import DECIDE_STATE
from assay_tournament.state import TOURNAMENT_STATE

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "demo-data-v1.tar.xz"

MODELS: dict[str, tuple[type[ReadModel], ...]] = {
    "aggregate": AGGREGATE_STATE,
    "decide": DECIDE_STATE,
    "tournament": TOURNAMENT_STATE,
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stored")
    with tarfile.open(FIXTURE) as archive:
        archive.extractall(root, filter="data")
    return root / "fx"


@pytest.mark.parametrize("stage", sorted(MODELS))
async def test_every_stored_document_reads_as_its_model(data_dir: Path, stage: str) -> None:
    deps = StageDeps(
        blobs=FsBlobStore(data_dir / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
    )
    spec = discover_stages()[stage](deps)
    by_kind = {model.kind: model for model in MODELS[stage]}
    log = await stage_log(data_dir, spec).open()
    try:
        read = 0
        for kind, model in by_kind.items():
            for tenant, key, doc in await log.scan_kind(kind):
                assert model.model_validate(doc).model_dump(mode="json") == doc, (tenant, key)
                read += 1
    finally:
        await log.close()
    with contextlib.closing(sqlite3.connect(data_dir / f"{stage}.sqlite")) as db:
        kinds = {kind for (kind,) in db.execute("SELECT DISTINCT kind FROM state")}
    assert kinds <= set(by_kind), (
        f"{stage} keeps documents no read model reads: {kinds - set(by_kind)}"
    )
    assert read > 0
