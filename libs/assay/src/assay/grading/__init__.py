"""Grading (§11): the judge port, the stub and chat judges, pairwise comparison, the
SPRT, and judge calibration.

The tournament's statistics live in their own modules: `assay.grading.bt`
(Bradley–Terry–Davidson with a prior) and `assay.grading.swiss` (pairing); one
group's tournament is `assay.grading.tournament`, resource profiles are
`assay.grading.strategies`.
"""

from assay.grading.calibration import (
    CalibrationFailure,
    CalibrationPair,
    CalibrationReport,
    PairCalibration,
    calibrate,
)
from assay.grading.chat_judge import ChatJudge, JudgeCompletion, JudgeModel
from assay.grading.judge_answers import parse_verdict, parse_violations
from assay.grading.judge_prompts import JudgePrompt, JudgePrompts, render_episode
from assay.grading.judges import Judge, JudgeFailed, JudgeUsage, StubJudge, UsageCallback
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
    "CalibrationFailure",
    "CalibrationPair",
    "CalibrationReport",
    "ChatJudge",
    "Judge",
    "JudgeCompletion",
    "JudgeFailed",
    "JudgeModel",
    "JudgePrompt",
    "JudgePrompts",
    "JudgeUsage",
    "Oc",
    "PairCalibration",
    "SprtDecision",
    "SprtPolicy",
    "SprtState",
    "StubJudge",
    "UsageCallback",
    "calibrate",
    "challenger_position",
    "compare_with_reference",
    "evaluate",
    "fixed_n",
    "llr",
    "operating_characteristics",
    "parse_verdict",
    "parse_violations",
    "render_episode",
    "simulate",
]
