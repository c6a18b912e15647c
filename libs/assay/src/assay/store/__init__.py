"""Storage ports and their adapters (SQLite event log, filesystem blobs).

Each name is imported on first use: embedded mode never loads asyncpg, nor a process
without an S3 bucket botocore.
"""

from typing import TYPE_CHECKING

from assay.kernel.lazy import lazy_exports

if TYPE_CHECKING:
    from assay.store.fs_blobs import BadBlobRef, FsBlobStore, check_ref
    from assay.store.pg_provision import provision_stage
    from assay.store.pg_relay import OutboxListener, PgAdvisoryLeader, listen_for_outbox
    from assay.store.ports import (
        BlobStore,
        BranchDeletion,
        BranchTruncation,
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
        StaleBranch,
        StaleFence,
        StreamChanged,
    )
    from assay.store.postgres import PostgresEventLog
    from assay.store.s3_blobs import S3BlobStore
    from assay.store.sqlite import SqliteEventLog, connect
else:
    __getattr__ = lazy_exports(
        __name__,
        {
            "assay.store.fs_blobs": ["BadBlobRef", "FsBlobStore", "check_ref"],
            "assay.store.ports": [
                "BlobStore",
                "BranchDeletion",
                "BranchTruncation",
                "Checkpoint",
                "CommitBatch",
                "ConsumerPosition",
                "DuplicateMessage",
                "EventLog",
                "Lease",
                "LeaseLost",
                "OutboxEntry",
                "PendingOutbox",
                "RebuildReport",
                "StaleBranch",
                "StaleFence",
                "StreamChanged",
            ],
            "assay.store.s3_blobs": ["S3BlobStore"],
            "assay.store.sqlite": ["SqliteEventLog", "connect"],
            "assay.store.pg_provision": ["provision_stage"],
            "assay.store.pg_relay": ["OutboxListener", "PgAdvisoryLeader", "listen_for_outbox"],
            "assay.store.postgres": ["PostgresEventLog"],
        },
    )

__all__ = [
    "BadBlobRef",
    "BlobStore",
    "BranchDeletion",
    "BranchTruncation",
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
    "StaleBranch",
    "StaleFence",
    "StreamChanged",
    "check_ref",
    "connect",
    "listen_for_outbox",
    "provision_stage",
]
