"""Workflow formats are plugins (§4.2). YAML and JSON ship."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from assay.kernel.schema import one_line
from assay.workflow.ir import WorkflowDef
from assay.workflow.validate import WorkflowInvalid, validate


class WorkflowFormat(Protocol):
    """Parses source bytes of one format into the IR. Validation happens after."""

    extensions: tuple[str, ...]

    def parse(self, src: bytes) -> WorkflowDef:
        """Parse or raise `WorkflowInvalid`."""
        ...


def from_document(doc: Any, origin: str = "workflow") -> WorkflowDef:
    """Build the IR from a decoded document, turning pydantic errors into one line."""
    if not isinstance(doc, dict):
        raise WorkflowInvalid(f"{origin}: expected a mapping at the top level")
    try:
        return WorkflowDef.model_validate(doc)
    except ValidationError as exc:
        raise WorkflowInvalid(f"{origin}: {one_line(exc)}") from exc


class YamlFormat:
    """YAML workflows (safe loader only)."""

    extensions: tuple[str, ...] = (".yaml", ".yml")

    def parse(self, src: bytes) -> WorkflowDef:
        import yaml  # here: a process that reads no YAML workflow does not load it

        try:
            doc = yaml.safe_load(src)
        except yaml.YAMLError as exc:
            raise WorkflowInvalid(f"not valid YAML: {str(exc).splitlines()[0]}") from exc
        return from_document(doc)


class JsonFormat:
    """JSON workflows."""

    extensions: tuple[str, ...] = (".json",)

    def parse(self, src: bytes) -> WorkflowDef:
        try:
            doc = json.loads(src)
        except json.JSONDecodeError as exc:
            raise WorkflowInvalid(f"not valid JSON: {exc}") from exc
        return from_document(doc)


def formats() -> list[WorkflowFormat]:
    """Built-in formats plus any registered under the `assay.workflow_formats` group."""
    found: list[WorkflowFormat] = [YamlFormat(), JsonFormat()]
    for ep in entry_points(group="assay.workflow_formats"):
        found.append(ep.load()())
    return found


def load_workflow(
    path: str | Path,
    known_tools: frozenset[str] | None = None,
    known_verifiers: frozenset[str] | None = None,
) -> WorkflowDef:
    """Read, parse and validate a workflow file, choosing the format by extension.

    `known_tools` and `known_verifiers` are passed to `validate`.

    Raises:
        WorkflowInvalid: unreadable file, unknown extension, parse or check failure.
    """
    p = Path(path)
    fmt = next((f for f in formats() if p.suffix.lower() in f.extensions), None)
    if fmt is None:
        raise WorkflowInvalid(f"{p}: no workflow format handles {p.suffix!r} files")
    try:
        src = p.read_bytes()
    except OSError as exc:
        raise WorkflowInvalid(f"{p}: {exc.strerror}") from exc
    try:
        return validate(fmt.parse(src), known_tools, known_verifiers)
    except WorkflowInvalid as exc:
        raise WorkflowInvalid(f"{p}: {exc}") from exc
