"""The tournament stage: PairwiseSequential grading against the current version's reference."""

from assay_tournament.events import TOURNAMENT_EVENTS
from assay_tournament.stage import create_stage
from assay_tournament.state import fold_tournament

__all__ = ["TOURNAMENT_EVENTS", "create_stage", "fold_tournament"]
