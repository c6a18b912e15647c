"""The decide stage: one current version and at most one challenger per workflow."""

from assay_decide.stage import DECIDE_EVENTS, create_stage, fold_decide

__all__ = ["DECIDE_EVENTS", "create_stage", "fold_decide"]
