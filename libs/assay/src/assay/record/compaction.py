"""Retention's compaction record: what a stage's dropped records had folded to.

When retention drops a branch's oldest records (`assay.runtime.retention`), the
documents they folded to that must outlive them are restated in one `Compacted`
record appended to the branch in the same commit, so that re-folding the log that
is left is still byte-identical (`assay rebuild --check`, DESIGN §2.4). A stage that
declares compaction registers `Compacted` with its events and folds it with
`with_compaction`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from assay.record.events import Event, LogRecord
from assay.record.state import Delete, Fold, Put, StateDelta, StateKey


class RestatedDocument(BaseModel):
    """One document as it stood when the records that folded to it were dropped."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = Field(description="Document kind.")
    key: str = Field(description="Document key.")
    value: dict[str, Any] | None = Field(
        description="The document; null: it was deleted, and stays so."
    )


class Compacted(Event):
    """A branch's oldest records were dropped by retention (§8.6); `documents` restates
    what they had folded to, so the branch's fold from here on is unchanged."""

    type: ClassVar[str] = "Compacted"
    version: ClassVar[int] = 1
    dropped: int = Field(ge=1, description="Records of the branch dropped with this one's commit.")
    below_ms: int = Field(description="They were committed before this (ms since the epoch).")
    documents: list[RestatedDocument] = Field(
        default_factory=list, description="The documents they folded to, as they stood."
    )


def fold_compacted(record: LogRecord) -> list[StateDelta]:
    """Each restated document put back (or kept deleted); nothing for other records."""
    if not isinstance(record.event, Compacted):
        return []
    out: list[StateDelta] = []
    for doc in record.event.documents:
        at = StateKey(record.key.tenant, doc.kind, doc.key)
        out.append(Delete(at) if doc.value is None else Put(at, dict(doc.value)))
    return out


def with_compaction(fold: Fold) -> Fold:
    """`fold`, which also folds `Compacted` records."""

    def folded(record: LogRecord) -> list[StateDelta]:
        if isinstance(record.event, Compacted):
            return fold_compacted(record)
        return fold(record)

    folded.__doc__ = fold.__doc__
    return folded
