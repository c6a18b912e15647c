"""The record: versioned log events, upcasters, and derived state as a fold."""

from assay.kernel.schema import UnknownSchema, Upcaster
from assay.record.events import BranchKey, Event, EventRegistry, LogRecord
from assay.record.state import (
    Delete,
    Fold,
    Patch,
    Put,
    ReadModel,
    StateDelta,
    StateKey,
    apply_delta,
)

__all__ = [
    "BranchKey",
    "Delete",
    "Event",
    "EventRegistry",
    "Fold",
    "LogRecord",
    "Patch",
    "Put",
    "ReadModel",
    "StateDelta",
    "StateKey",
    "UnknownSchema",
    "Upcaster",
    "apply_delta",
]
