"""Log records, versioned event types and upcasters (§8.2, §8.7).

Every record carries its schema version, written always. Decoding dispatches on
`(type, version)`; older versions are upcast one step at a time on read, never
rewritten in storage. Variants are never removed.
"""

from __future__ import annotations

from dataclasses import dataclass

from assay.kernel.ids import BranchId, Lsn, RunId, TenantId
from assay.kernel.schema import SchemaRegistry, Versioned


class Event(Versioned):
    """Base of every logged event. Subclasses set `type` and `version`."""


@dataclass(frozen=True, order=True)
class BranchKey:
    """The key of one log stream: `(tenant, stream, branch)` (§8.2).

    For the execute stage the stream is the run id and the branch its rewind
    fork; other stages key their streams by what they fold over (a task, a
    workflow, a variant) on branch 0.
    """

    tenant: TenantId
    stream: str
    branch: BranchId

    @classmethod
    def for_run(cls, tenant: TenantId, run: RunId, branch: BranchId) -> BranchKey:
        """The key of one branch of one run."""
        return cls(tenant, run, branch)

    @classmethod
    def main(cls, tenant: TenantId, stream: str) -> BranchKey:
        """Branch 0 of a stream."""
        return cls(tenant, stream, BranchId(0))


@dataclass(frozen=True)
class LogRecord:
    """One committed record. `event` is decoded at the current version."""

    key: BranchKey
    lsn: Lsn
    schema_version: int
    at_ms: int
    event: Event


class EventRegistry(SchemaRegistry[Event]):
    """Maps `(type, version)` to one stage's event models and upcasters."""
