"""`assay rebuild`: drop derived state, re-fold it from each stage's log, compare."""

from __future__ import annotations

from pathlib import Path

from assay.engine.models import StubModel
from assay.engine.tools import BUILTIN_TOOLS
from assay.grading.judges import StubJudge
from assay.kernel.errors import AssayError
from assay.runtime.embedded import STAGES, discover_stages, stage_log
from assay.runtime.stage import StageDeps
from assay.store.fs_blobs import FsBlobStore


async def rebuild(data_dir: Path, *, check: bool) -> int:
    """Rebuild (or, with `check`, verify) every stage store in `data_dir`; 1 on a difference."""
    found = [s for s in STAGES if (data_dir / f"{s}.sqlite").exists()]
    if not found:
        raise AssayError(f"no stage stores in {data_dir}")
    factories = discover_stages()
    deps = StageDeps(
        blobs=FsBlobStore(data_dir / "blobs"),
        model=StubModel(),
        judge=StubJudge(),
        tools=dict(BUILTIN_TOOLS),
    )
    bad = 0
    for name in found:
        log = await stage_log(data_dir, factories[name](deps)).open()
        try:
            report = await log.rebuild(keep=not check)
        finally:
            await log.close()
        verdict = "identical" if report.identical else f"{len(report.differences)} difference(s)"
        print(
            f"{name:<11} {report.records:>7} records  {report.documents_after:>6} documents  "
            f"{verdict}"
        )
        for line in report.differences[:10]:
            print(f"    {line}")
        bad += not report.identical
    return 1 if bad else 0
