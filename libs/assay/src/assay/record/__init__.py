"""The record: versioned log events, upcasters, and derived state as a fold."""

from assay.kernel.schema import UnknownSchema, Upcaster
from assay.record.events import BranchKey, Event, EventRegistry, LogRecord
from assay.record.state import (
    Delete,
    DocumentTable,
    Fold,
    Patch,
    Put,
    ReadModel,
    StateDelta,
    StateKey,
    TableColumn,
    apply_delta,
)

__all__ = [
    "BranchKey",
    "Delete",
    "DocumentTable",
    "Event",
    "EventRegistry",
    "Fold",
    "LogRecord",
    "Patch",
    "Put",
    "ReadModel",
    "StateDelta",
    "StateKey",
    "TableColumn",
    "UnknownSchema",
    "Upcaster",
    "apply_delta",
]
