"""Tools and verifier kinds that installed packages register (entry points, §13.1).

A package adds tools under the `assay.tools` entry-point group and verifier
kinds under `assay.verifiers`. An entry point resolves to the object itself,
or to a callable (taking no arguments) that returns one or an iterable of
them. Anything else — an object of the wrong type, a tool without a valid
effect class, a name registered twice, an entry point that does not import —
stops the load with `PluginInvalid` naming the entry point: a tool that cannot
state its effect class does not register (§13.1).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, cast

from assay.engine.sandbox_tools import guarded, sandbox_tools
from assay.engine.tools import BUILTIN_TOOLS, Idempotent, Pure, Queryable, Tool, Unsafe
from assay.kernel.errors import AssayError
from assay.sandbox.port import NetworkPolicy
from assay.verification.verifiers import Verifier
from assay.workflow.ir import BUILTIN_VERIFIER_KINDS

TOOLS_GROUP = "assay.tools"
VERIFIERS_GROUP = "assay.verifiers"
_KIND = re.compile(r"[a-z][a-z0-9_.-]{0,63}")


class PluginInvalid(AssayError):
    """An entry point does not resolve to what its group requires. The message names it."""


def describe(ep: EntryPoint) -> str:
    """`group:name = module:attr (from dist)`, how errors name an entry point."""
    dist = getattr(ep, "dist", None)
    origin = f" (from {dist.name})" if dist is not None else ""
    return f"{ep.group}:{ep.name} = {ep.value}{origin}"


def _resolve(ep: EntryPoint, accept: Callable[[object], bool], what: str) -> list[object]:
    """The objects an entry point gives: itself, or what calling it returns."""
    label = describe(ep)
    try:
        obj: Any = ep.load()
    except Exception as exc:
        raise PluginInvalid(
            f"entry point {label} does not load: {type(exc).__name__}: {exc}"
        ) from exc
    if accept(obj):
        return [obj]
    if not callable(obj):
        raise PluginInvalid(
            f"entry point {label} is a {type(obj).__name__}, not a {what} "
            f"or a callable returning {what}s"
        )
    try:
        produced: Any = obj()
    except Exception as exc:
        raise PluginInvalid(f"entry point {label} raised {type(exc).__name__}: {exc}") from exc
    if accept(produced):
        return [produced]
    if isinstance(produced, str | bytes) or not isinstance(produced, Iterable):
        raise PluginInvalid(
            f"entry point {label} returned a {type(produced).__name__}, not {what}s"
        )
    items = list(produced)
    for item in items:
        if not accept(item):
            raise PluginInvalid(f"entry point {label} gave a {type(item).__name__}, not a {what}")
    return items


def check_tool(tool: Tool, label: str) -> Tool:
    """`tool`, if it carries a name, a function and a usable effect class.

    Raises:
        PluginInvalid: naming `label` and what is wrong.
    """
    if not isinstance(tool.name, str) or not tool.name:
        raise PluginInvalid(f"{label}: a tool has no name")
    where = f"{label}: tool {tool.name!r}"
    effects: object = tool.effects
    if not isinstance(effects, Pure | Idempotent | Queryable | Unsafe):
        raise PluginInvalid(
            f"{where} declares effects {effects!r}; it must be Pure, Idempotent, Queryable or "
            "Unsafe (there is no default)"
        )
    if isinstance(effects, Idempotent) and (
        not effects.key or not all(isinstance(k, str) and k for k in effects.key)
    ):
        raise PluginInvalid(f"{where} is Idempotent but names no arguments its key derives from")
    if isinstance(effects, Queryable) and not callable(effects.lookup):
        raise PluginInvalid(f"{where} is Queryable but its lookup is not callable")
    if not callable(tool.fn):
        raise PluginInvalid(f"{where} has no callable `fn`")
    return tool


def load_tools(*, network: NetworkPolicy = NetworkPolicy.DENY) -> dict[str, Tool]:
    """The built-in tools, the sandboxed ones, and every tool of the `assay.tools` group.

    Every tool is gated by `guarded` under `network`: one that declares
    `needs_network` is refused at call time unless `network` is `ALLOW`.

    Raises:
        PluginInvalid: an entry point does not load or gives something that is
            not a valid `Tool`, or a tool name is registered twice.
    """
    tools: dict[str, Tool] = {}
    origin: dict[str, str] = {}

    def add(tool: Tool, label: str) -> None:
        if tool.name in tools:
            raise PluginInvalid(
                f"{label}: tool {tool.name!r} is already registered by {origin[tool.name]}"
            )
        tools[tool.name] = tool
        origin[tool.name] = label

    for tool in BUILTIN_TOOLS.values():
        add(guarded(tool, network), "Assay (built in)")
    for tool in sandbox_tools(network).values():  # already guarded
        add(tool, "Assay (built in)")
    for ep in entry_points(group=TOOLS_GROUP):
        label = f"entry point {describe(ep)}"
        for obj in _resolve(ep, lambda o: isinstance(o, Tool), "Tool"):
            assert isinstance(obj, Tool)
            add(guarded(check_tool(obj, label), network), label)
    return tools


def _looks_like_verifier(obj: object) -> bool:
    return not isinstance(obj, type) and all(
        hasattr(obj, name) for name in ("kind", "version", "check")
    )


def check_verifier(verifier: object, label: str) -> Verifier:
    """`verifier`, if its kind can be named in a workflow and `check` is a coroutine.

    Raises:
        PluginInvalid: naming `label` and what is wrong.
    """
    if not _looks_like_verifier(verifier):
        raise PluginInvalid(f"{label}: a {type(verifier).__name__} is not a verifier")
    kind: object = getattr(verifier, "kind", None)
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise PluginInvalid(f"{label}: verifier kind {kind!r} is not [a-z][a-z0-9_.-]{{0,63}}")
    version: object = getattr(verifier, "version", None)
    if not isinstance(version, str) or not version:
        raise PluginInvalid(f"{label}: verifier {kind!r} has no version string")
    if not inspect.iscoroutinefunction(getattr(verifier, "check", None)):
        raise PluginInvalid(f"{label}: verifier {kind!r} has no `async def check`")
    return cast(Verifier, verifier)


def load_verifiers() -> dict[str, Verifier]:
    """Verifier kinds of the `assay.verifiers` group (the built-in ones are not included).

    Raises:
        PluginInvalid: an entry point does not load or gives something that is
            not a verifier, a kind is built in, or a kind is registered twice.
    """
    found: dict[str, Verifier] = {}
    origin: dict[str, str] = {}
    for ep in entry_points(group=VERIFIERS_GROUP):
        label = f"entry point {describe(ep)}"
        for obj in _resolve(ep, _looks_like_verifier, "Verifier"):
            verifier = check_verifier(obj, label)
            if verifier.kind in BUILTIN_VERIFIER_KINDS:
                raise PluginInvalid(f"{label}: verifier kind {verifier.kind!r} is built in")
            if verifier.kind in found:
                raise PluginInvalid(
                    f"{label}: verifier kind {verifier.kind!r} is already registered by "
                    f"{origin[verifier.kind]}"
                )
            found[verifier.kind] = verifier
            origin[verifier.kind] = label
    return found
