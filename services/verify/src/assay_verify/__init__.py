"""The verify stage: fail-closed verifiers on frozen episodes."""

from assay_verify.stage import VERIFY_EVENTS, create_stage, fold_verify

__all__ = ["VERIFY_EVENTS", "create_stage", "fold_verify"]
