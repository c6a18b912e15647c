"""Tournament's calibration stream is bounded: once the records period has passed, its
rounds compact into one checkpoint of what they folded to — the schedule and each
judge's last agreement stay as they were — and `rebuild` still folds identically."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from assay.engine.retention import RetentionPolicy
from assay.kernel import tenant_id
from assay.record import BranchKey
from assay.record.compaction import Compacted, with_compaction
from assay.runtime.retention import StageRetention
from assay.store import CommitBatch, SqliteEventLog
from assay_tournament import TOURNAMENT_EVENTS, fold_tournament
from assay_tournament.events import CALIBRATION_STREAM, CalibrationRan

DAY_S = 86_400


def found(judged: int, agreed: int) -> dict[str, object]:
    return {
        "tenant": "6a1b2c3d-4e5f-4a60-8b7c-9d0e1f2a3b4c",
        "judge": "judge-model",
        "due_ms": 1,
        "source": "verified_runs",
        "pairs": judged // 2,
        "judged": judged,
        "agreed": agreed,
        "draws": judged - agreed,
        "failures": 0,
        "checked": judged // 2,
        "inconsistent": 0,
        "agreement": agreed / judged,
        "order_inconsistency_rate": 0.0,
        "model_calls": judged,
        "cost_usd": 0.0,
    }


async def test_calibration_rounds_compact_into_their_documents(tmp_path: Path) -> None:
    fold = with_compaction(fold_tournament)
    log = await SqliteEventLog(tmp_path / "tournament.sqlite", TOURNAMENT_EVENTS, fold).open()
    try:
        t = tenant_id(uuid.uuid4())
        key = BranchKey.main(t, CALIBRATION_STREAM)
        for day, (judged, agreed) in enumerate([(4, 2), (4, 3), (6, 6)], start=1):
            ran = CalibrationRan(
                found=found(judged, agreed),
                day=f"2026-12-0{day}",
                calls_today=judged,
                next_due_ms=day * 1000,
            )
            await log.commit(CommitBatch(records=[(key, ran)]))
        before = await log.scan_kind("calibration_round"), await log.scan_kind("judge_agreement")
        policy = RetentionPolicy(topic_retention_s=60, inbox_keep_s=120, records_keep_s=DAY_S)
        later = StageRetention("tournament", fold, policy, clock=lambda: time.time() + 2 * DAY_S)
        swept = await later.sweep(log)
        assert swept.records == 3
        (checkpoint,) = await log.read(key)
        assert isinstance(checkpoint.event, Compacted)
        after = await log.scan_kind("calibration_round"), await log.scan_kind("judge_agreement")
        assert after == before
        assert (await log.rebuild(keep=False)).identical
    finally:
        await log.close()
