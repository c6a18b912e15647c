"""The workflow version DAG as ingest stores it (§12.2), and pinning what a run calls.

A stored version (`StoredDefinition`) names the versions it derives from; the
latest version per workflow (`LatestVersion`) is what `latest` means now.
"""

from __future__ import annotations

from typing import Any, ClassVar

from assay.engine import child_key
from assay.kernel import Refused, WorkflowId, WorkflowVersion
from assay.messages import WorkflowRegistered
from assay.record import ReadModel
from assay.runtime import UnitOfWork
from assay.workflow import (
    LATEST,
    MAX_SUBWORKFLOW_DEPTH,
    SubworkflowStep,
    WorkflowDef,
    WorkflowInvalid,
    check_subworkflows,
)


class StoredDefinition(ReadModel):
    """A registered version: its workflow, the versions it derives from, its IR. Keyed
    by version."""

    kind: ClassVar[str] = "definition"
    workflow_id: WorkflowId
    parent: WorkflowVersion | None
    """The first of `parents` (what a version named before merges were possible)."""
    parents: list[WorkflowVersion]
    definition: dict[str, Any]

    @property
    def workflow(self) -> WorkflowDef:
        """The IR, decoded."""
        return WorkflowDef.model_validate(self.definition)


class LatestVersion(ReadModel):
    """The version of a workflow registered last. Keyed by workflow id."""

    kind: ClassVar[str] = "workflow"
    latest: WorkflowVersion


async def check_calls(uow: UnitOfWork[Any], wf: WorkflowDef) -> None:
    """Refuse, at load, sub-workflow calls that cycle (through `latest` too) or nest too
    deep, counting `wf` as registered.

    Raises:
        Refused: they do.
    """
    known = {
        (d.workflow_id, WorkflowVersion(v)): d.workflow for v, d in await uow.scan(StoredDefinition)
    }
    known[(wf.id, wf.version)] = wf
    try:
        check_subworkflows(known)
    except WorkflowInvalid as exc:
        raise Refused(f"invalid workflow: {exc}") from exc


async def parents_of(
    uow: UnitOfWork[Any], wf: WorkflowDef, msg: WorkflowRegistered
) -> list[WorkflowVersion]:
    """The versions a new version derives from: those the registration names, else the
    version registered last (none for the first).

    Raises:
        Refused: a named parent is not a stored version of this workflow, or a later
            version names none without `rewrite: true`.
    """
    latest = await uow.get(LatestVersion, wf.id)
    if msg.parents is None:
        return [] if latest is None else [latest.latest]
    parents = list(dict.fromkeys(msg.parents))
    for parent in parents:
        doc = await uow.get(StoredDefinition, parent)
        if doc is None or doc.workflow_id != wf.id:
            raise Refused(f"workflow {wf.id!r}: parent {parent} is not a registered version of it")
    if not parents and latest is not None and not msg.rewrite:
        raise Refused(
            f"workflow {wf.id!r}: a version with no parent beside registered ones is a new "
            "root; register it with rewrite: true"
        )
    return parents


async def resolve(
    uow: UnitOfWork[Any],
    wf: WorkflowDef,
    out: dict[str, dict[str, Any]] | None = None,
    depth: int = 0,
) -> dict[str, dict[str, Any]]:
    """Pin every sub-workflow `wf` can call, now, once (§4.4): `latest` is the version
    registered last at this moment. Nested calls are pinned too.

    Raises:
        Refused: a called workflow or version is not registered, or calls nest too deep.
    """
    out = {} if out is None else out
    if depth > MAX_SUBWORKFLOW_DEPTH:
        raise Refused(f"workflow {wf.id!r}: sub-workflows nest deeper than {MAX_SUBWORKFLOW_DEPTH}")
    for step in wf.steps:
        if not isinstance(step, SubworkflowStep) or child_key(step) in out:
            continue
        version: str | None = step.version
        if version == LATEST:
            latest = await uow.get(LatestVersion, step.workflow)
            version = None if latest is None else latest.latest
        doc = None if version is None else await uow.get(StoredDefinition, version)
        if doc is None or doc.workflow_id != step.workflow:
            raise Refused(
                f"workflow {wf.id!r}: step {step.id!r} calls {child_key(step)}, "
                "which is not registered"
            )
        out[child_key(step)] = doc.definition
        await resolve(uow, doc.workflow, out, depth + 1)
    return out
