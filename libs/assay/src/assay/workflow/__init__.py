"""Workflows are data (§4): the IR, formats, templates and load-time checks."""

from assay.workflow.formats import (
    JsonFormat,
    WorkflowFormat,
    YamlFormat,
    formats,
    from_document,
    load_workflow,
)
from assay.workflow.ir import (
    BUILTIN_VERIFIER_KINDS,
    BudgetSpec,
    GradingSpec,
    ModelStep,
    RetryPolicy,
    RubricItem,
    Step,
    ToolStep,
    Transition,
    VerifierSpec,
    WorkflowDef,
)
from assay.workflow.templates import TemplateError, placeholders, render
from assay.workflow.validate import StepIdDiff, WorkflowInvalid, check_version_bump, validate

__all__ = [
    "BUILTIN_VERIFIER_KINDS",
    "BudgetSpec",
    "GradingSpec",
    "JsonFormat",
    "ModelStep",
    "RetryPolicy",
    "RubricItem",
    "Step",
    "StepIdDiff",
    "TemplateError",
    "ToolStep",
    "Transition",
    "VerifierSpec",
    "WorkflowDef",
    "WorkflowFormat",
    "WorkflowInvalid",
    "YamlFormat",
    "check_version_bump",
    "formats",
    "from_document",
    "load_workflow",
    "placeholders",
    "render",
    "validate",
]
