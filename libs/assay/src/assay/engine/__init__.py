"""Durable execution: the run driver, work events, the model port, built-in tools."""

from typing import TYPE_CHECKING

from assay.kernel.lazy import lazy_exports

if TYPE_CHECKING:
    from assay.engine.chat_model import (
        ChatCompletionsModel,
        ModelRequestRefused,
        ModelResponseInvalid,
        ModelUnavailable,
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
    from assay.engine.models import (
        FREE,
        Completion,
        Model,
        ModelError,
        Priced,
        Prices,
        StubModel,
        prices_of,
        solve,
    )
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
else:
    __getattr__ = lazy_exports(
        __name__,
        {
            "assay.engine.chat_model": [
                "ChatCompletionsModel",
                "ModelRequestRefused",
                "ModelResponseInvalid",
                "ModelUnavailable",
                "RetryPolicy",
                "request_seed",
            ],
            "assay.engine.context": ["CancelScope"],
            "assay.engine.driver": [
                "Driver",
                "Journal",
                "RunSpec",
                "RunSuspended",
                "StepNotExecutable",
                "check_executable",
                "child_key",
            ],
            "assay.engine.events": [
                "WORK_EVENTS",
                "AttemptFinished",
                "AttemptStarted",
                "RunFinished",
                "RunStarted",
                "fold_work",
            ],
            "assay.engine.journal": ["LogJournal"],
            "assay.engine.models": [
                "FREE",
                "Completion",
                "Model",
                "ModelError",
                "Priced",
                "Prices",
                "StubModel",
                "prices_of",
                "solve",
            ],
            "assay.engine.tools": [
                "BUILTIN_TOOLS",
                "EffectClass",
                "Idempotent",
                "Pure",
                "Queryable",
                "Tool",
                "ToolCall",
                "ToolError",
                "ToolRefused",
                "Unsafe",
            ],
        },
    )

__all__ = [
    "BUILTIN_TOOLS",
    "FREE",
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
    "Priced",
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
    "prices_of",
    "request_seed",
    "solve",
]
