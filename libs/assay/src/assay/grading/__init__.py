"""Grading (§11): the judge port, the stub and chat judges, pairwise comparison, the
SPRT, and judge calibration.

The tournament"s statistics live in their own modules: `assay.grading.bt`
(Bradley–Terry–Davidson with a prior) and `assay.grading.swiss` (pairing); one
group"s tournament is `assay.grading.tournament`, resource profiles are
`assay.grading.strategies`.
"""

from typing import TYPE_CHECKING

from assay.kernel.lazy import lazy_exports

if TYPE_CHECKING:
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
else:
    __getattr__ = lazy_exports(
        __name__,
        {
            "assay.grading.calibration": [
                "CalibrationFailure",
                "CalibrationPair",
                "CalibrationReport",
                "PairCalibration",
                "calibrate",
            ],
            "assay.grading.chat_judge": ["ChatJudge", "JudgeCompletion", "JudgeModel"],
            "assay.grading.judge_answers": ["parse_verdict", "parse_violations"],
            "assay.grading.judge_prompts": ["JudgePrompt", "JudgePrompts", "render_episode"],
            "assay.grading.judges": [
                "Judge",
                "JudgeFailed",
                "JudgeUsage",
                "StubJudge",
                "UsageCallback",
            ],
            "assay.grading.pairwise": ["challenger_position", "compare_with_reference"],
            "assay.grading.sprt": [
                "Oc",
                "SprtDecision",
                "SprtPolicy",
                "SprtState",
                "evaluate",
                "fixed_n",
                "llr",
                "operating_characteristics",
                "simulate",
            ],
        },
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
