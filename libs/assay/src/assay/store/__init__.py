"""Storage ports and their adapters (SQLite event log, filesystem blobs).

The Postgres names are imported on first use, so embedded mode never loads asyncpg.
"""

from typing import TYPE_CHECKING, Any

from assay.store.fs_blobs import BadBlobRef, FsBlobStore, check_ref
from assay.store.ports import (
    BlobStore,
    BranchDeletion,
    Checkpoint,
    CommitBatch,
    ConsumerPosition,
    DuplicateMessage,
    EventLog,
    Lease,
    LeaseLost,
    OutboxEntry,
    PendingOutbox,
    RebuildReport,
    StaleFence,
    StreamChanged,
)
from assay.store.s3_blobs import S3BlobStore
from assay.store.sqlite import SqliteEventLog, connect

if TYPE_CHECKING:
    from assay.store.pg_provision import provision_stage
    from assay.store.pg_relay import OutboxListener, PgAdvisoryLeader, listen_for_outbox
    from assay.store.postgres import PostgresEventLog

_POSTGRES = {
    "OutboxListener": "assay.store.pg_relay",
    "PgAdvisoryLeader": "assay.store.pg_relay",
    "PostgresEventLog": "assay.store.postgres",
    "listen_for_outbox": "assay.store.pg_relay",
    "provision_stage": "assay.store.pg_provision",
}


def __getattr__(name: str) -> Any:
    if name in _POSTGRES:
        import importlib

        return getattr(importlib.import_module(_POSTGRES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BadBlobRef",
    "BlobStore",
    "BranchDeletion",
    "Checkpoint",
    "CommitBatch",
    "ConsumerPosition",
    "DuplicateMessage",
    "EventLog",
    "FsBlobStore",
    "Lease",
    "LeaseLost",
    "OutboxEntry",
    "OutboxListener",
    "PendingOutbox",
    "PgAdvisoryLeader",
    "PostgresEventLog",
    "RebuildReport",
    "S3BlobStore",
    "SqliteEventLog",
    "StaleFence",
    "StreamChanged",
    "check_ref",
    "connect",
    "listen_for_outbox",
    "provision_stage",
]
