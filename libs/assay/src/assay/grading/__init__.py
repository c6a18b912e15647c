"""Grading (§11): the judge port, the stub judge, pairwise comparison, the SPRT."""

from assay.grading.judges import Judge, StubJudge
from assay.grading.pairwise import challenger_position, compare_with_reference
from assay.grading.sprt import SprtDecision, SprtPolicy, SprtState, evaluate, llr

__all__ = [
    "Judge",
    "SprtDecision",
    "SprtPolicy",
    "SprtState",
    "StubJudge",
    "challenger_position",
    "compare_with_reference",
    "evaluate",
    "llr",
]
