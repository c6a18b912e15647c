"""The decide stage: one current version and at most one challenger per workflow."""

from assay_decide.events import DECIDE_EVENTS, fold_decide
from assay_decide.stage import create_stage

__all__ = ["DECIDE_EVENTS", "create_stage", "fold_decide"]
