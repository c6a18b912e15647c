"""The tournament stage: PairwiseSequential grading against the current version's reference."""

from assay_tournament.stage import TOURNAMENT_EVENTS, create_stage, fold_tournament

__all__ = ["TOURNAMENT_EVENTS", "create_stage", "fold_tournament"]
