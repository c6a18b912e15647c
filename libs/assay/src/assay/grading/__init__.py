"""Grading (§11): the judge port, the stub judge, pairwise comparison, the SPRT.

The tournament's statistics live in their own modules: `assay.grading.bt`
(Bradley–Terry–Davidson with a prior) and `assay.grading.swiss` (pairing).
"""

from assay.grading.judges import Judge, StubJudge
from assay.grading.pairwise import challenger_position, compare_with_reference
from assay.grading.sprt import (
    Oc,
    SprtDecision,
    SprtPolicy,
    SprtState,
    evaluate,
    fixed_n,
    llr,
    operating_characteristics,
    simulate,
)

__all__ = [
    "Judge",
    "Oc",
    "SprtDecision",
    "SprtPolicy",
    "SprtState",
    "StubJudge",
    "challenger_position",
    "compare_with_reference",
    "evaluate",
    "fixed_n",
    "llr",
    "operating_characteristics",
    "simulate",
]
