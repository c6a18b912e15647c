"""Calibration sets as files: one task a line, with a verified-pass and a verified-fail
episode (§11). `assay grade calibrate` reads them, and so does scheduled calibration
when `ASSAY_CALIBRATION_FILE` names one.

    {"task": "...", "passed": <Episode>, "failed": <Episode>, "rubric": [<RubricItem>, ...]}

`rubric` is optional: without it the pair is judged by the rubric of the workflow
definition the passed episode pins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from assay.grading.calibration import CalibrationPair
from assay.kernel.errors import AssayError
from assay.kernel.schema import one_line
from assay.messages.episode import Episode
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
            not a calibration line, whose two episodes belong to different tenants, or
            whose passed episode pins no valid workflow.
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
        if entry.passed.run.tenant != entry.failed.run.tenant:
            raise AssayError(
                f"{path}:{n}: the passed and the failed episode belong to different tenants"
            )
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
