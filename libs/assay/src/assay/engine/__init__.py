"""Durable execution: the run driver, work events, the model port, built-in tools."""

from assay.engine.driver import Driver, Journal, RunSpec
from assay.engine.events import (
    WORK_EVENTS,
    AttemptFinished,
    AttemptStarted,
    RunFinished,
    RunStarted,
    fold_work,
)
from assay.engine.models import Completion, Model, ModelError, StubModel, solve
from assay.engine.tools import BUILTIN_TOOLS, Tool, ToolError

__all__ = [
    "BUILTIN_TOOLS",
    "WORK_EVENTS",
    "AttemptFinished",
    "AttemptStarted",
    "Completion",
    "Driver",
    "Journal",
    "Model",
    "ModelError",
    "RunFinished",
    "RunSpec",
    "RunStarted",
    "StubModel",
    "Tool",
    "ToolError",
    "fold_work",
    "solve",
]
