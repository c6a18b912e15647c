"""Tools steps call, and the effect class each one must declare (§8.4, §13.1).

A tool registers with an `EffectClass` and there is no default: its author is
the only party who knows whether it is safe to retry. The class decides what
the driver writes around the call and how a crash is recovered:

- `Pure` — no effect outside the call; no intent is written, an interrupted
  attempt is simply retried.
- `Idempotent(key=...)` — the kernel derives an idempotency key from the named
  arguments and passes it on every call; a call whose key cannot be derived is
  refused before anything is dispatched. Recovery retries under the same key.
- `Queryable(lookup=...)` — the tool can be asked whether a request (tagged with
  the intent's request id) landed. Recovery asks, then completes or retries.
- `Unsafe` — never retried once dispatched: an unresolved dispatch makes the
  attempt `Indeterminate` and raises an operator alert.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from assay.kernel.canonical import content_hash
from assay.kernel.errors import AssayError
from assay.kernel.ids import AttemptNo, BranchId, RunId, StepId, TenantId

if TYPE_CHECKING:
    from assay.sandbox.port import Workspace


class ToolError(AssayError):
    """The tool ran and reported a failure (the attempt fails)."""


class ToolRefused(ToolError):
    """The call was refused before anything was dispatched (no effect happened)."""


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool, with the identity the kernel vouches for.

    `idempotency_key` is set for `Idempotent` tools only (derived by the
    kernel, identical on every retry of the same logical call); `request_id`
    names this attempt's intent, for `Queryable` tools to tag their request.
    """

    tenant: TenantId
    run_id: RunId
    branch: BranchId
    step: StepId
    attempt: AttemptNo
    args: Mapping[str, str]
    request_id: str
    idempotency_key: str | None = None
    workspace: Workspace | None = None

    def require_key(self) -> str:
        """The idempotency key; a write issued without one is refused (§13.2)."""
        if not self.idempotency_key:
            raise ToolRefused("an idempotent write needs the kernel's idempotency key")
        return self.idempotency_key

    def require_workspace(self) -> Workspace:
        """The run's sandbox workspace; refused when no sandbox is configured."""
        if self.workspace is None:
            raise ToolRefused("this tool runs in a sandbox and none is configured")
        return self.workspace


ToolFn = Callable[[ToolCall], Awaitable[str]]
Lookup = Callable[[ToolCall], Awaitable[str | None]]
"""Asks the provider whether `call.request_id` landed: its output, or None."""


@dataclass(frozen=True)
class Pure:
    """No effect outside the call: nothing to be unsure about after a crash."""


@dataclass(frozen=True)
class Idempotent:
    """Safe to retry under the same key: the key derives from these arguments."""

    key: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("Idempotent needs the argument names its key derives from")


@dataclass(frozen=True)
class Queryable:
    """The provider answers whether a request id landed."""

    lookup: Lookup


@dataclass(frozen=True)
class Unsafe:
    """Neither idempotent nor queryable: a dispatched call is never retried."""


EffectClass = Pure | Idempotent | Queryable | Unsafe


def effect_name(effect: EffectClass) -> str:
    """The class's name as recorded in intents ("idempotent", ...)."""
    return type(effect).__name__.lower()


@dataclass(frozen=True)
class Tool:
    """A registered tool. `effects` is required: there is no default (§13.1).

    `args` optionally declares the tool's arguments as a pydantic model of string
    fields: a model step offering the tool sends its JSON schema as the function's
    parameters (without it, any string arguments).
    """

    name: str
    fn: ToolFn
    effects: EffectClass
    description: str
    needs_network: bool = False
    needs_sandbox: bool = False
    tags: frozenset[str] = field(default_factory=frozenset)
    args: type[BaseModel] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.effects, Pure | Idempotent | Queryable | Unsafe):
            raise TypeError(f"tool {self.name!r}: effects must be an EffectClass")
        if self.args is not None and not (
            isinstance(self.args, type) and issubclass(self.args, BaseModel)
        ):
            raise TypeError(f"tool {self.name!r}: args must be a pydantic model class")

    @property
    def has_effect(self) -> bool:
        """Whether calls need write-ahead intents."""
        return not isinstance(self.effects, Pure)


ANY_STRING_ARGS: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}
"""The parameters of a tool that declares no argument model: any string arguments."""


def offered(tool: Tool) -> dict[str, Any]:
    """The tool as a chat-completions request offers it (OpenAI-style `tools` item):
    its name, description and its arguments' JSON schema."""
    params = tool.args.model_json_schema() if tool.args is not None else ANY_STRING_ARGS
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": params},
    }


def idempotency_key(
    tool: Tool,
    tenant: TenantId,
    run_id: RunId,
    step: StepId,
    iteration: int,
    args: Mapping[str, str],
) -> str | None:
    """The key of one logical call: the same on every attempt and every recovery.

    It leaves out the attempt number (a retry is the same logical call) and the
    branch (a rewind that repeats a call with the same arguments must not repeat
    its effect). None for tools that are not `Idempotent`.

    Raises:
        ToolRefused: an argument the key derives from is missing or empty.
    """
    if not isinstance(tool.effects, Idempotent):
        return None
    missing = [name for name in tool.effects.key if not args.get(name)]
    if missing:
        raise ToolRefused(
            f"tool {tool.name!r}: cannot derive the idempotency key: "
            f"argument(s) {', '.join(missing)} missing"
        )
    picked = {name: args[name] for name in tool.effects.key}
    return content_hash(
        {
            "tenant": str(tenant),
            "run": str(run_id),
            "step": step,
            "iteration": iteration,
            "tool": tool.name,
            "args": picked,
        }
    )


async def _extract_number(call: ToolCall) -> str:
    found = re.findall(r"-?\d+(?:\.\d+)?", call.args.get("text", ""))
    if not found:
        raise ToolError("no number in the text")
    return str(found[-1])


async def _strip(call: ToolCall) -> str:
    return call.args.get("text", "").strip()


async def _json_field(call: ToolCall) -> str:
    try:
        doc = json.loads(call.args.get("text", ""))
    except json.JSONDecodeError as exc:
        raise ToolError(f"not JSON: {exc}") from exc
    name = call.args.get("field", "")
    if not isinstance(doc, dict) or name not in doc:
        raise ToolError(f"no field {name!r}")
    value = doc[name]
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


class TextArgs(BaseModel):
    """A built-in tool's one argument."""

    text: str = Field(description="The text the tool reads.")


class JsonFieldArgs(TextArgs):
    """`json_field`'s arguments."""

    field: str = Field(description="The key of the field to return.")


BUILTIN_TOOLS: dict[str, Tool] = {
    t.name: t
    for t in [
        Tool(
            "extract_number", _extract_number, Pure(), "The last number in `text`.", args=TextArgs
        ),
        Tool("strip", _strip, Pure(), "`text` without surrounding whitespace.", args=TextArgs),
        Tool(
            "json_field",
            _json_field,
            Pure(),
            "Field `field` of the JSON object in `text`.",
            args=JsonFieldArgs,
        ),
    ]
}
