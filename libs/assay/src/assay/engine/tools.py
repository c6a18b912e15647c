"""Tools steps call. This issue's tools are built-in and pure (no effects)."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from assay.kernel.errors import AssayError


class ToolError(AssayError):
    """The tool ran and reported a failure (the attempt fails)."""


ToolFn = Callable[[Mapping[str, str]], Awaitable[str]]


@dataclass(frozen=True)
class Tool:
    """A registered tool. `pure` tools have no effects and need no intent."""

    name: str
    fn: ToolFn
    pure: bool
    description: str


async def _extract_number(args: Mapping[str, str]) -> str:
    found = re.findall(r"-?\d+(?:\.\d+)?", args.get("text", ""))
    if not found:
        raise ToolError("no number in the text")
    return str(found[-1])


async def _strip(args: Mapping[str, str]) -> str:
    return args.get("text", "").strip()


async def _json_field(args: Mapping[str, str]) -> str:
    try:
        doc = json.loads(args.get("text", ""))
    except json.JSONDecodeError as exc:
        raise ToolError(f"not JSON: {exc}") from exc
    field = args.get("field", "")
    if not isinstance(doc, dict) or field not in doc:
        raise ToolError(f"no field {field!r}")
    value = doc[field]
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


BUILTIN_TOOLS: dict[str, Tool] = {
    t.name: t
    for t in [
        Tool("extract_number", _extract_number, True, "The last number in `text`."),
        Tool("strip", _strip, True, "`text` without surrounding whitespace."),
        Tool("json_field", _json_field, True, "Field `field` of the JSON object in `text`."),
    ]
}
