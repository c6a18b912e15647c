"""Storage ports and their adapters (SQLite event log, filesystem blobs)."""

from assay.store.fs_blobs import BadBlobRef, FsBlobStore, check_ref
from assay.store.ports import (
    BlobStore,
    Checkpoint,
    CommitBatch,
    ConsumerPosition,
    DuplicateMessage,
    EventLog,
    OutboxEntry,
    PendingOutbox,
    RebuildReport,
)
from assay.store.sqlite import SqliteEventLog, connect

__all__ = [
    "BadBlobRef",
    "BlobStore",
    "Checkpoint",
    "CommitBatch",
    "ConsumerPosition",
    "DuplicateMessage",
    "EventLog",
    "FsBlobStore",
    "OutboxEntry",
    "PendingOutbox",
    "RebuildReport",
    "SqliteEventLog",
    "check_ref",
    "connect",
]
