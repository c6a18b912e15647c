"""Verify's retention rules on its own fold: a cancelled run's stop (`stop:<run>`) goes,
with its `stopped` document, once the records period has passed; a verdict younger
than that stays; `rebuild` still folds identically."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from assay.engine.retention import RetentionPolicy
from assay.kernel import RunId, tenant_id
from assay.record import BranchKey, StateKey
from assay.record.compaction import with_compaction
from assay.runtime.retention import StageRetention
from assay.store import CommitBatch, SqliteEventLog
from assay_verify.stage import VERIFY_EVENTS, VerificationStopped, fold_verify

DAY_S = 86_400


async def test_a_cancelled_runs_stop_goes_after_the_records_period(tmp_path: Path) -> None:
    fold = with_compaction(fold_verify)
    log = await SqliteEventLog(tmp_path / "verify.sqlite", VERIFY_EVENTS, fold).open()
    try:
        t = tenant_id(uuid.uuid4())
        run = RunId("01HZX3V8Q6M9T2K4R7W1Y5N001")
        stop = VerificationStopped(run_id=run, branch=0, reason="cancelled by an operator")
        await log.commit(CommitBatch(records=[(BranchKey.main(t, f"stop:{run}"), stop)]))
        assert await log.get(StateKey(t, "stopped", run)) == {"reason": stop.reason}
        policy = RetentionPolicy(topic_retention_s=60, inbox_keep_s=120, records_keep_s=DAY_S)
        soon = StageRetention("verify", fold, policy, clock=lambda: time.time() + 60)
        assert (await soon.sweep(log)).records == 0  # a minute on: kept
        later = StageRetention("verify", fold, policy, clock=lambda: time.time() + 2 * DAY_S)
        assert (await later.sweep(log)).records == 1
        assert await log.read(BranchKey.main(t, f"stop:{run}")) == []
        assert await log.get(StateKey(t, "stopped", run)) is None
        assert (await log.rebuild(keep=False)).identical
    finally:
        await log.close()
