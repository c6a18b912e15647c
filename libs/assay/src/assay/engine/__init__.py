"""Durable execution: the run driver, work events, the model port, built-in tools."""

from assay.engine.chat_model import (
    ChatCompletionsModel,
    ModelRequestRefused,
    ModelResponseInvalid,
    ModelUnavailable,
    Prices,
    RetryPolicy,
    request_seed,
)
from assay.engine.context import CancelScope
from assay.engine.driver import (
    Driver,
    Journal,
    RunSpec,
    RunSuspended,
    StepNotExecutable,
    check_executable,
    child_key,
)
from assay.engine.events import (
    WORK_EVENTS,
    AttemptFinished,
    AttemptStarted,
    RunFinished,
    RunStarted,
    fold_work,
)
from assay.engine.journal import LogJournal
from assay.engine.models import Completion, Model, ModelError, StubModel, solve
from assay.engine.tools import (
    BUILTIN_TOOLS,
    EffectClass,
    Idempotent,
    Pure,
    Queryable,
    Tool,
    ToolCall,
    ToolError,
    ToolRefused,
    Unsafe,
)

__all__ = [
    "BUILTIN_TOOLS",
    "WORK_EVENTS",
    "AttemptFinished",
    "AttemptStarted",
    "CancelScope",
    "ChatCompletionsModel",
    "Completion",
    "Driver",
    "EffectClass",
    "Idempotent",
    "Journal",
    "LogJournal",
    "Model",
    "ModelError",
    "ModelRequestRefused",
    "ModelResponseInvalid",
    "ModelUnavailable",
    "Prices",
    "Pure",
    "Queryable",
    "RetryPolicy",
    "RunFinished",
    "RunSpec",
    "RunStarted",
    "RunSuspended",
    "StepNotExecutable",
    "StubModel",
    "Tool",
    "ToolCall",
    "ToolError",
    "ToolRefused",
    "Unsafe",
    "check_executable",
    "child_key",
    "fold_work",
    "request_seed",
    "solve",
]
