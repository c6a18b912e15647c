"""Grading (§11): the judge port, the stub and chat judges, pairwise comparison, the
SPRT, and judge calibration."""

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
from assay.grading.sprt import SprtDecision, SprtPolicy, SprtState, evaluate, llr

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
    "llr",
    "parse_verdict",
    "parse_violations",
    "render_episode",
]
