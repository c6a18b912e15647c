"""A tiny, safe template language: `{{ task.field }}` and `{{ steps.ID.output }}`.

Substitution only — no expressions, no attribute access on objects, never `eval`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from typing import Any

from assay.kernel.errors import AssayError

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_\-]*(?:\.[A-Za-z0-9_\-]+)*)\s*\}\}")


class TemplateError(AssayError):
    """A placeholder names something the context does not hold."""


def placeholders(template: str) -> list[tuple[str, ...]]:
    """The dotted paths a template refers to, in order of appearance."""
    return [tuple(m.group(1).split(".")) for m in _PLACEHOLDER.finditer(template)]


def malformed(template: str) -> list[str]:
    """Text that opens a placeholder with `{{` but is not a well-formed one."""
    rest = _PLACEHOLDER.sub("", template)
    return re.findall(r"\{\{[^}]*\}?\}?", rest)


def render(template: str, context: Mapping[str, Any], omit: Collection[str] = ()) -> str:
    """Substitute every placeholder. Strings go in verbatim, anything else as JSON; a
    placeholder whose dotted path is in `omit` renders empty (dropped to fit a budget).

    Raises:
        TemplateError: a path does not resolve in `context`.
    """

    def lookup(match: re.Match[str]) -> str:
        value: Any = context
        path = match.group(1)
        if path in omit:
            return ""
        for part in path.split("."):
            if isinstance(value, Mapping) and part in value:
                value = value[part]
            else:
                raise TemplateError(f"template refers to {path!r}, which the input does not hold")
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    return _PLACEHOLDER.sub(lookup, template)


def drop_order(template: str) -> list[str]:
    """The references a context budget drops, first to last: `steps.*` ones in the order
    the template first names them, then `task.*` ones, the last-named first."""
    refs = list(dict.fromkeys(".".join(p) for p in placeholders(template)))
    earlier = [r for r in refs if not r.startswith("task.")]
    task = [r for r in refs if r.startswith("task.")]
    return earlier + task[::-1]


def fixed_chars(template: str) -> int:
    """The characters of the template's own text, every placeholder rendered empty: what
    no context budget can drop."""
    return len(render(template, {}, omit=drop_order(template)))
