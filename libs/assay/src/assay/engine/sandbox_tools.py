"""Built-in tools that act on a run's sandbox workspace or the network (DESIGN §9, §13).

They live in the engine, beside `Tool`, because the layers put the engine
above the sandbox: a tool may use a workspace, a workspace knows nothing of
tools. `sandbox_tools()` returns them ready to merge with `BUILTIN_TOOLS`;
`guarded()` is the gate every tool passes before registration, the built-in
ones included: a tool that declares `needs_network` is refused unless the
network is allowed by configuration, and one that declares `needs_sandbox`
is refused when the call carries no workspace.
"""

from __future__ import annotations

import dataclasses
import json
import math

from assay.engine.tools import Idempotent, Tool, ToolCall, ToolError, ToolRefused, Unsafe
from assay.sandbox.port import NetworkPolicy, SandboxError

DEFAULT_COMMAND_TIMEOUT_S = 60.0
"""Wall-clock limit of a `command` call that names no `timeout_s`."""
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _excerpt(text: str, n: int = 400) -> str:
    """The last `n` characters of `text` (where errors usually are), on one line."""
    text = text.strip()
    cut = text if len(text) <= n else "…" + text[-n:]
    return cut.replace("\n", " | ")


def guarded(tool: Tool, network: NetworkPolicy) -> Tool:
    """`tool` with its declared needs enforced on every call.

    The returned tool raises `ToolRefused` — before its own code runs — when
    it declares `needs_network` and `network` is not `ALLOW`, or declares
    `needs_sandbox` and the call has no workspace. Never silently allowed.
    """
    if not tool.needs_network and not tool.needs_sandbox:
        return tool
    inner = tool.fn

    async def fn(call: ToolCall) -> str:
        if tool.needs_network and network is not NetworkPolicy.ALLOW:
            raise ToolRefused(
                f"tool {tool.name!r} needs the network, which the sandbox denies "
                "(set ASSAY_SANDBOX_NETWORK=allow to permit it)"
            )
        if tool.needs_sandbox:
            call.require_workspace()
        return await inner(call)

    return dataclasses.replace(tool, fn=fn)


def _argv(raw: str) -> list[str]:
    try:
        argv = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ToolRefused(f"command: `argv` is not a JSON array: {exc}") from exc
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ToolRefused("command: `argv` must be a non-empty JSON array of strings")
    if not argv[0]:
        raise ToolRefused("command: `argv[0]` is empty")
    return argv


def _timeout(raw: str | None, default: float) -> float:
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= 3600:
        raise ToolRefused(f"`timeout_s` must be a number of seconds in (0, 3600], not {raw!r}")
    return value


async def _command(call: ToolCall) -> str:
    ws = call.require_workspace()
    argv = _argv(call.args.get("argv", ""))
    timeout_s = _timeout(call.args.get("timeout_s"), DEFAULT_COMMAND_TIMEOUT_S)
    try:
        result = await ws.run(argv, timeout_s=timeout_s)
    except SandboxError as exc:
        raise ToolRefused(f"command: the sandbox could not start it: {exc}") from exc
    if result.timed_out:
        raise ToolError(f"command {argv[0]!r} timed out after {timeout_s}s")
    if not result.ok:
        raise ToolError(f"command {argv[0]!r} {result.describe(400)}")
    return result.stdout


async def _write_file(call: ToolCall) -> str:
    call.require_key()  # §13.2: a write without the kernel's key is refused
    ws = call.require_workspace()
    path = call.args.get("path", "")
    try:
        await ws.write_file(path, call.args.get("content", "").encode())
    except SandboxError as exc:
        raise ToolRefused(f"write_file: {exc}") from exc
    return path


async def _http_request(call: ToolCall) -> str:
    method = call.args.get("method", "GET").upper()
    url = call.args.get("url", "")
    if method not in HTTP_METHODS:
        raise ToolRefused(f"http_request: unknown method {method!r}")
    if not url.startswith(("http://", "https://")):
        raise ToolRefused(f"http_request: `url` must be http:// or https://, not {url[:80]!r}")
    body = call.args.get("body")
    timeout_s = _timeout(call.args.get("timeout_s"), 30.0)
    import httpx  # here: a stage whose tools make no HTTP request does not load it

    try:
        async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client:
            response = await client.request(
                method, url, content=body.encode() if body is not None else None
            )
    except httpx.HTTPError as exc:
        raise ToolError(f"http_request: {type(exc).__name__}: {exc}") from exc
    if response.status_code >= 400:
        raise ToolError(f"http_request: HTTP {response.status_code}: {_excerpt(response.text)}")
    return response.text


def sandbox_tools(network: NetworkPolicy = NetworkPolicy.DENY) -> dict[str, Tool]:
    """The built-in sandboxed tools, gated by `guarded` under `network`.

    - `command`: `argv` (a JSON array of strings), optional `timeout_s`; runs in
      the run's workspace; its output is stdout; a non-zero exit, a signal or
      a timeout is a `ToolError` naming the exit code and the end of stderr.
    - `write_file`: `path`, `content`; writes inside the workspace under the
      kernel's idempotency key.
    - `http_request`: `method`, `url`, optional `body` and `timeout_s`; the
      response body; refused unless the network is allowed.
    """
    tools = [
        Tool(
            "command",
            _command,
            Unsafe(),
            "Run `argv` (a JSON array) in the run's sandbox workspace; output is stdout.",
            needs_sandbox=True,
        ),
        Tool(
            "write_file",
            _write_file,
            Idempotent(key=("path", "content")),
            "Write `content` to `path` inside the run's sandbox workspace.",
            needs_sandbox=True,
        ),
        Tool(
            "http_request",
            _http_request,
            Unsafe(),
            "An HTTP request (`method`, `url`, optional `body`); output is the response body.",
            needs_network=True,
        ),
    ]
    return {t.name: guarded(t, network) for t in tools}
