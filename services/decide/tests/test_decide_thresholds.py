"""Decide exports the ladder settings an alert compares a signal against (§15)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from assay.grading.ladder import LadderPolicy
from assay.runtime.metrics import StageCollector, stage_registry
from services.decide.tests.decide_harness import open_stage


async def test_the_ladders_order_inconsistency_threshold_is_on_metrics(tmp_path: Path) -> None:
    ladder = LadderPolicy(max_order_inconsistency=0.25)
    async with open_stage(tmp_path, ladder=ladder) as stage:
        collector = StageCollector(stage.runner)
        await collector.refresh()
        text = generate_latest(stage_registry(stage.runner, collector)).decode()
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }
    assert samples["assay_ladder_max_order_inconsistency"] == 0.25, "the setting, not a default"
