"""Grading (§11): the judge port, the stub judge, pairwise comparison, the SPRT."""

from assay.grading.judges import Judge, JudgeFailed, JudgeUsage, StubJudge, UsageCallback
from assay.grading.pairwise import challenger_position, compare_with_reference
from assay.grading.sprt import SprtDecision, SprtPolicy, SprtState, evaluate, llr

__all__ = [
    "Judge",
    "JudgeFailed",
    "JudgeUsage",
    "SprtDecision",
    "SprtPolicy",
    "SprtState",
    "StubJudge",
    "UsageCallback",
    "challenger_position",
    "compare_with_reference",
    "evaluate",
    "llr",
]
