"""The configuration reference, generated from the settings tree's field descriptions.

`render()` is the Markdown of `docs/reference/configuration.md`: one table per
section (variable, default, description); `assay settings reference` (or
`make config-docs`) writes it. A test keeps the committed page equal to `render()`.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from assay.runtime.settings import AssaySettings, variable

REFERENCE_PATH = Path("docs") / "reference" / "configuration.md"
"""Where the page lives, from the repository's root."""


@dataclass(frozen=True)
class Entry:
    """One setting: its section (None: the top level), field, variable, and field info."""

    section: str | None
    field: str
    variable: str
    info: FieldInfo


def entries() -> Iterator[Entry]:
    """Every setting of `AssaySettings`: the top-level fields first, then each section's."""
    sections: list[tuple[str, type[BaseModel]]] = []
    for name, info in AssaySettings.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            sections.append((name, kind))
        else:
            yield Entry(None, name, variable(None, name), info)
    for section, model in sections:
        for name, info in model.model_fields.items():
            yield Entry(section, name, variable(section, name), info)


def _default(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=True)
    match value:
        case None:
            return "unset"
        case bool():
            return "true" if value else "false"
        case enum.Enum():
            return str(value.value)
        case float():
            return f"{value:g}"
        case tuple() | frozenset() | dict() | list() if not value:
            return "empty"
        case tuple():
            return ",".join(str(v) for v in value)
        case _:
            return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The Markdown reference page."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the settings' field descriptions by `assay settings reference`",
        "     (`make config-docs`); do not edit by hand. -->",
        "",
        "Assay reads its settings from `ASSAY_*` environment variables, once, at start-up",
        "(`assay.runtime.settings.AssaySettings.from_env`). An unset or empty variable takes",
        "its default; an invalid one stops start-up with an error naming the variable.",
        "Per-tenant maps are written `<tenant-uuid>=<n>,...`. Without a URL of their own,",
        "the judge and the proposer use each `ASSAY_MODEL_*` setting they do not set.",
        "",
    ]
    about = _section_descriptions()
    for section, group in itertools.groupby(entries(), key=lambda e: e.section):
        lines += [f"## {'General' if section is None else f'`{section}`'}", ""]
        if section is not None:
            lines += [about[section], ""]
        lines += ["| Variable | Default | Description |", "| --- | --- | --- |"]
        lines += [
            f"| `{e.variable}` | `{_cell(_default(e.info))}` | {_cell(e.info.description or '')} |"
            for e in group
        ]
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _section_descriptions() -> dict[str, str]:
    return {
        name: info.description or ""
        for name, info in AssaySettings.model_fields.items()
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
    }


def write(path: Path = REFERENCE_PATH) -> Path:
    """Write the page to `path` (its folder created if absent); return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    return path


__all__ = ["REFERENCE_PATH", "Entry", "entries", "render", "write"]
