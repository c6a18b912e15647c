"""`assay grade calibrate`: how often a judge agrees with the verifier (§11).

The calibration set is a JSON-lines file; each line is one task with a
verified-pass and a verified-fail episode:

    {"task": "...", "passed": <Episode>, "failed": <Episode>, "rubric": [<RubricItem>, ...]}

`rubric` is optional: without it the pair is judged by the rubric of the
workflow definition the passed episode pins. The report is printed as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from assay.grading.calibration import CalibrationPair, calibrate
from assay.grading.judges import StubJudge
from assay.kernel.errors import AssayError
from assay.kernel.schema import one_line
from assay.messages.episode import Episode
from assay.runtime.settings import AssaySettings
from assay.workflow.ir import RubricItem, WorkflowDef


class CalibrationLine(BaseModel):
    """One line of a calibration set."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task: str = Field(min_length=1, description="Names the task in the report.")
    passed: Episode = Field(description="An episode of the task the verifiers passed.")
    failed: Episode = Field(description="An episode of the task the verifiers failed.")
    rubric: list[RubricItem] | None = Field(
        None, description="The rubric to judge by (default: the passed episode's workflow's)."
    )


def read_calibration_set(path: Path) -> list[CalibrationPair]:
    """Every pair of a calibration-set file, each with its rubric resolved.

    Raises:
        AssayError: an unreadable or empty file, or a line (named `path:n`) that is
            not a calibration line or whose passed episode pins no valid workflow.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise AssayError(f"{path}: {exc.strerror}") from exc
    pairs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AssayError(f"{path}:{n}: not a calibration line (not JSON: {exc})") from exc
        if not isinstance(doc, dict):
            raise AssayError(f"{path}:{n}: not a calibration line (not a JSON object)")
        try:
            entry = CalibrationLine.model_validate(doc)
        except ValidationError as exc:
            raise AssayError(f"{path}:{n}: not a calibration line ({one_line(exc)})") from exc
        rubric = entry.rubric
        if rubric is None:
            try:
                rubric = list(WorkflowDef.model_validate(entry.passed.definition).rubric)
            except ValidationError as exc:
                raise AssayError(
                    f"{path}:{n}: the passed episode's definition is not a workflow "
                    f"({one_line(exc)}); give the line a rubric"
                ) from exc
        pairs.append(CalibrationPair(entry.task, entry.passed, entry.failed, rubric))
    if not pairs:
        raise AssayError(f"{path}: no calibration pairs")
    return pairs


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
