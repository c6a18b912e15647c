"""The execute stage: runs workflows durably, one commit per event, and freezes episodes."""

from assay_execute.stage import create_stage

__all__ = ["create_stage"]
