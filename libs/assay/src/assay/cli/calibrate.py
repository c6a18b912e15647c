"""`assay grade calibrate`: how often a judge agrees with the verifier (§11).

The calibration set is a JSON-lines file; each line is one task with a
verified-pass and a verified-fail episode:

    {"task": "...", "passed": <Episode>, "failed": <Episode>, "rubric": [<RubricItem>, ...]}

`rubric` is optional: without it the pair is judged by the rubric of the
workflow definition the passed episode pins. The report is printed as JSON.
"""

from __future__ import annotations

from pathlib import Path

from assay.grading.calibration import calibrate
from assay.grading.calibration_set import CalibrationLine, read_calibration_set
from assay.grading.judges import StubJudge
from assay.runtime.settings import AssaySettings

__all__ = ["CalibrationLine", "calibrate_command", "read_calibration_set"]


async def calibrate_command(path: Path, *, judge_from_env: bool) -> int:
    """Judge the set in both orderings and print the report as JSON.

    The judge is the stub unless `judge_from_env`, which builds the judge the
    `ASSAY_JUDGE_*` (or `ASSAY_MODEL_*`) variables describe.

    Raises:
        AssayError: bad input (see `read_calibration_set`) or invalid settings.
    """
    pairs = read_calibration_set(path)
    judge = AssaySettings.from_env().judge.build() if judge_from_env else StubJudge()
    try:
        report = await calibrate(judge, pairs, None)
    finally:
        await judge.aclose()
    print(report.model_dump_json(indent=2))
    return 0
