"""The built-in sandboxed tools (`command`, `write_file`, `http_request`) through real calls."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest

from assay.engine import Idempotent, Tool, ToolCall, ToolError, ToolRefused, Unsafe
from assay.engine.sandbox_tools import guarded, sandbox_tools
from assay.engine.tools import idempotency_key
from assay.kernel import AttemptNo, BranchId, StepId, TenantId, new_run_id
from assay.sandbox import LocalSandbox, NetworkPolicy, Workspace
from assay.store import FsBlobStore

TENANT = TenantId(uuid.UUID(int=31))
TOOLS = sandbox_tools()


@pytest.fixture
async def ws(tmp_path: Path) -> AsyncIterator[Workspace]:
    sandbox = LocalSandbox(tmp_path / "workspaces", FsBlobStore(tmp_path / "blobs"))
    workspace = await sandbox.open(TENANT, new_run_id(), BranchId(0))
    yield workspace
    await sandbox.discard(workspace)


def call_of(
    tool: Tool, args: Mapping[str, str], workspace: Workspace | None = None, *, keyed: bool = True
) -> ToolCall:
    """A call as the driver makes it: the kernel's key for idempotent tools."""
    run_id = new_run_id()
    key = idempotency_key(tool, TENANT, run_id, StepId("s"), 0, args) if keyed else None
    return ToolCall(
        tenant=TENANT,
        run_id=run_id,
        branch=BranchId(0),
        step=StepId("s"),
        attempt=AttemptNo(1),
        args=args,
        request_id=f"{run_id}/0/s/1",
        idempotency_key=key,
        workspace=workspace,
    )


async def call(
    name: str,
    args: Mapping[str, str],
    workspace: Workspace | None = None,
    *,
    tools: dict[str, Tool] = TOOLS,
    keyed: bool = True,
) -> str:
    tool = tools[name]
    return await tool.fn(call_of(tool, args, workspace, keyed=keyed))


def test_the_tools_declare_their_effects_and_needs() -> None:
    assert isinstance(TOOLS["command"].effects, Unsafe)
    assert TOOLS["command"].needs_sandbox
    assert TOOLS["write_file"].effects == Idempotent(key=("path", "content"))
    assert TOOLS["write_file"].needs_sandbox
    assert isinstance(TOOLS["http_request"].effects, Unsafe)
    assert TOOLS["http_request"].needs_network


# -- command -------------------------------------------------------------------------------


async def test_command_returns_stdout(ws: Workspace) -> None:
    argv = json.dumps(["sh", "-c", "echo hello; echo ignored >&2"])
    assert await call("command", {"argv": argv}, ws) == "hello\n"


async def test_command_runs_where_write_file_wrote(ws: Workspace) -> None:
    assert await call("write_file", {"path": "n.txt", "content": "20"}, ws) == "n.txt"
    argv = json.dumps(["sh", "-c", "echo $(( $(cat n.txt) * 2 ))"])
    assert await call("command", {"argv": argv}, ws) == "40\n"


async def test_a_failing_command_is_a_tool_error_with_code_and_stderr(ws: Workspace) -> None:
    argv = json.dumps(["sh", "-c", "echo 'no such thing' >&2; exit 4"])
    with pytest.raises(ToolError) as err:
        await call("command", {"argv": argv}, ws)
    assert not isinstance(err.value, ToolRefused)
    assert "exited with 4" in str(err.value)
    assert "no such thing" in str(err.value)


async def test_a_command_past_its_timeout_is_a_tool_error(ws: Workspace) -> None:
    with pytest.raises(ToolError, match=r"timed out after 0\.5s"):
        await call("command", {"argv": json.dumps(["sleep", "30"]), "timeout_s": "0.5"}, ws)


@pytest.mark.parametrize(
    "args",
    [
        {"argv": "echo hi"},
        {"argv": "[]"},
        {"argv": '["sh", 3]'},
        {"argv": '{"a": 1}'},
        {"argv": '[""]'},
        {},
        {"argv": '["true"]', "timeout_s": "forever"},
        {"argv": '["true"]', "timeout_s": "-1"},
    ],
)
async def test_bad_command_arguments_are_refused(ws: Workspace, args: dict[str, str]) -> None:
    with pytest.raises(ToolRefused):
        await call("command", args, ws)


async def test_command_without_a_workspace_is_refused() -> None:
    with pytest.raises(ToolRefused, match="sandbox"):
        await call("command", {"argv": '["true"]'})


# -- write_file ----------------------------------------------------------------------------


async def test_write_file_needs_the_kernels_key(ws: Workspace) -> None:
    with pytest.raises(ToolRefused, match="idempotency key"):
        await call("write_file", {"path": "a.txt", "content": "x"}, ws, keyed=False)
    with pytest.raises(FileNotFoundError):
        await ws.read_file("a.txt")


async def test_write_file_writes_inside_and_refuses_escapes(ws: Workspace) -> None:
    await call("write_file", {"path": "deep/er/a.txt", "content": "héllo"}, ws)
    assert await ws.read_file("deep/er/a.txt") == "héllo".encode()
    # Retried under the same key, the write lands the same way.
    await call("write_file", {"path": "deep/er/a.txt", "content": "héllo"}, ws)
    assert await ws.read_file("deep/er/a.txt") == "héllo".encode()
    for path in ("../out.txt", "/tmp/out.txt"):
        with pytest.raises(ToolRefused):
            await call("write_file", {"path": path, "content": "x"}, ws)


async def test_write_file_without_a_workspace_is_refused() -> None:
    with pytest.raises(ToolRefused, match="sandbox"):
        await call("write_file", {"path": "a.txt", "content": "x"})


# -- http_request and the network gate -----------------------------------------------------


async def _http_server() -> tuple[asyncio.Server, str, list[str]]:
    """A loopback HTTP/1.1 server answering with the method and body it got."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        method, target, _ = lines[0].split(" ")
        length = 0
        for line in lines[1:]:
            if line.lower().startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        body = await reader.readexactly(length) if length else b""
        seen.append(f"{method} {target}")
        status = "404 Not Found" if target == "/missing" else "200 OK"
        payload = f"{method} {body.decode()}".encode()
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", seen


async def test_http_request_is_refused_while_the_network_is_denied() -> None:
    server, base, seen = await _http_server()
    try:
        with pytest.raises(ToolRefused, match="needs the network"):
            await call("http_request", {"method": "GET", "url": f"{base}/x"})
        assert seen == []
    finally:
        server.close()
        await server.wait_closed()


async def test_http_request_works_when_the_network_is_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    allowed = sandbox_tools(NetworkPolicy.ALLOW)
    server, base, seen = await _http_server()
    try:
        got = await call("http_request", {"method": "GET", "url": f"{base}/a"}, tools=allowed)
        assert got == "GET "
        posted = await call(
            "http_request",
            {"method": "post", "url": f"{base}/b", "body": "payload"},
            tools=allowed,
        )
        assert posted == "POST payload"
        with pytest.raises(ToolError, match="HTTP 404"):
            await call("http_request", {"method": "GET", "url": f"{base}/missing"}, tools=allowed)
        assert seen == ["GET /a", "POST /b", "GET /missing"]
        for bad in ({"method": "BREW", "url": base}, {"method": "GET", "url": "file:///etc"}):
            with pytest.raises(ToolRefused):
                await call("http_request", bad, tools=allowed)
    finally:
        server.close()
        await server.wait_closed()


async def test_any_tool_declaring_network_is_refused_unless_allowed() -> None:
    ran: list[str] = []

    async def fetch(call: ToolCall) -> str:
        ran.append(call.args["url"])
        return "fetched"

    tool = Tool("fetch", fetch, Unsafe(), "Fetches.", needs_network=True)
    denied = guarded(tool, NetworkPolicy.DENY)
    with pytest.raises(ToolRefused):
        await denied.fn(call_of(denied, {"url": "http://example.invalid"}))
    assert ran == []
    allowed = guarded(tool, NetworkPolicy.ALLOW)
    assert await allowed.fn(call_of(allowed, {"url": "http://example.invalid"})) == "fetched"
    assert denied.effects is tool.effects
    assert denied.name == tool.name


def test_the_write_key_derives_from_path_and_content_only() -> None:
    tool = TOOLS["write_file"]
    run_id = new_run_id()

    def key(args: dict[str, str]) -> str | None:
        return idempotency_key(tool, TENANT, run_id, StepId("s"), 0, args)

    same = key({"path": "a", "content": "x"})
    assert same is not None
    assert key({"path": "a", "content": "x", "note": "ignored"}) == same
    assert key({"path": "a", "content": "y"}) != same
    with pytest.raises(ToolRefused):
        key({"path": "a"})
