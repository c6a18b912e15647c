"""The aggregate stage: win records per challenger, pass rates per version."""

from assay_aggregate.stage import AGGREGATE_EVENTS, create_stage, fold_aggregate

__all__ = ["AGGREGATE_EVENTS", "create_stage", "fold_aggregate"]
