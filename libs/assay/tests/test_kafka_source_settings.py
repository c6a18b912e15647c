"""A stage's consumer-group source is built from the `kafka` settings: its group, its
member timeout and heartbeat, and the fetch's long poll (`ASSAY_KAFKA_FETCH_MAX_WAIT_MS`)."""

from __future__ import annotations

from assay.runtime.distributed import kafka_source
from assay.runtime.settings import AssaySettings


def test_the_source_takes_its_group_timeouts_and_fetch_wait_from_the_settings() -> None:
    settings = AssaySettings.from_env(
        {
            "ASSAY_KAFKA_BOOTSTRAP": "broker:9092",
            "ASSAY_KAFKA_MEMBER_TIMEOUT_MS": "6000",
            "ASSAY_KAFKA_FETCH_MAX_WAIT_MS": "500",
        }
    )
    source = kafka_source(settings, "verify")
    assert (source.bootstrap, source.group_id) == ("broker:9092", "assay-verify")
    assert (source.member_timeout_ms, source.heartbeat_interval_ms) == (6000, 2000)
    assert source.fetch_max_wait_ms == 500


def test_the_fetch_wait_is_short_by_default() -> None:
    source = kafka_source(AssaySettings.from_env({"ASSAY_KAFKA_BOOTSTRAP": "b:1"}), "ingest")
    assert source.fetch_max_wait_ms == 20
    assert source.heartbeat_interval_ms == 3000
