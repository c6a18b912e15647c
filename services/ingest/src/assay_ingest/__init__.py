"""The ingest stage: validates tasks and workflows, routes tasks to versions, spawns runs."""

from assay_ingest.stage import INGEST_EVENTS, create_stage, fold_ingest

__all__ = ["INGEST_EVENTS", "create_stage", "fold_ingest"]
