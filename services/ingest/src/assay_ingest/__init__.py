"""The ingest stage: validates tasks and workflows, routes tasks to versions, spawns runs."""

from assay_ingest.stage import create_stage
from assay_ingest.state import INGEST_EVENTS, fold_ingest

__all__ = ["INGEST_EVENTS", "create_stage", "fold_ingest"]
