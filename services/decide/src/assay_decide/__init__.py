"""The decide stage: one current version and at most one challenger per workflow."""

from assay_decide.events import DECIDE_EVENTS
from assay_decide.stage import create_stage
from assay_decide.state import fold_decide

__all__ = ["DECIDE_EVENTS", "create_stage", "fold_decide"]
