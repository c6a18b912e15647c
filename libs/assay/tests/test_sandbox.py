"""The sandbox port and the local provider (DESIGN §9): workspaces, limits, network, snapshots.

Every test runs real commands through the provider. Tests of what the machine
may not allow (a network namespace, a PID namespace, a separate uid) are
skipped with the reason when the provider reports it cannot enforce it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from assay.kernel import BranchId, RunId, TenantId, new_run_id
from assay.sandbox import (
    LimitExceeded,
    Limits,
    LocalSandbox,
    NetworkPolicy,
    PathRefused,
    SandboxError,
    SandboxProvider,
    SnapshotMissing,
    Workspace,
)
from assay.store import FsBlobStore

TENANT_A = TenantId(uuid.UUID(int=21))
TENANT_B = TenantId(uuid.UUID(int=22))
BASH = shutil.which("bash", path="/usr/local/bin:/usr/bin:/bin")
PYTHON3 = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")

MakeSandbox = Callable[..., LocalSandbox]


@pytest.fixture
def make_sandbox(tmp_path: Path) -> MakeSandbox:
    """A local sandbox under `tmp_path`, its snapshots in a blob store beside it."""

    def make(**kwargs: Any) -> LocalSandbox:
        blobs = FsBlobStore(tmp_path / "blobs")
        return LocalSandbox(tmp_path / "workspaces", blobs, **kwargs)

    return make


@pytest.fixture
def sandbox(make_sandbox: MakeSandbox) -> LocalSandbox:
    return make_sandbox()


@pytest.fixture
async def ws(sandbox: LocalSandbox) -> AsyncIterator[Workspace]:
    workspace = await sandbox.open(TENANT_A, new_run_id(), BranchId(0))
    yield workspace
    _kill_left_in(workspace.root)
    await sandbox.discard(workspace)


def _left_in(root: str) -> list[int]:
    """Pids of processes whose working directory is inside `root`."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cwd = os.readlink(f"/proc/{name}/cwd")
            except OSError:
                continue
            if cwd == root or cwd.startswith(root + "/"):
                found.append(int(name))
    return found


def _exists(path: str) -> bool:
    return os.path.lexists(path)


def _kill_left_in(root: str) -> None:
    for pid in _left_in(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# -- the port ------------------------------------------------------------------------------


async def test_the_local_provider_fits_the_port(sandbox: LocalSandbox) -> None:
    provider: SandboxProvider = sandbox
    workspace: Workspace = await provider.open(TENANT_A, new_run_id(), BranchId(0))
    assert workspace.tenant == TENANT_A
    caps = provider.capabilities
    assert caps.network is NetworkPolicy.DENY
    assert not caps.network_allowed
    assert isinstance(caps.network_isolated, bool)
    await provider.discard(workspace)


async def test_a_workspace_path_carries_tenant_run_and_branch(sandbox: LocalSandbox) -> None:
    run = new_run_id()
    workspace = await sandbox.open(TENANT_A, run, BranchId(3))
    assert Path(workspace.root) == sandbox.base / str(TENANT_A) / run / "3"
    other = await sandbox.open(TENANT_A, run, BranchId(3), scope="verify-x")
    assert other.root != workspace.root
    for bad in (RunId("../escape"), RunId("a/b"), RunId("")):
        with pytest.raises(SandboxError):
            await sandbox.open(TENANT_A, bad, BranchId(0))
    with pytest.raises(SandboxError):
        await sandbox.open(TENANT_A, run, BranchId(0), scope="../up")
    with pytest.raises(SandboxError):
        await sandbox.open(TenantId("../../elsewhere"), run, BranchId(0))  # type: ignore[arg-type]
    await sandbox.discard(workspace)
    await sandbox.discard(other)


async def test_open_replaces_a_leftover_workspace(sandbox: LocalSandbox) -> None:
    run = new_run_id()
    first = await sandbox.open(TENANT_A, run, BranchId(0))
    await first.write_file("left.txt", b"from before a crash")
    again = await sandbox.open(TENANT_A, run, BranchId(0))
    with pytest.raises(FileNotFoundError):
        await again.read_file("left.txt")
    await sandbox.discard(again)
    await sandbox.discard(again)  # twice is harmless
    assert not _exists(again.root)
    assert not _exists(os.path.dirname(again.root)), "the run's emptied directory is removed"


# -- commands ------------------------------------------------------------------------------


async def test_a_command_runs_in_its_workspace_with_a_minimal_environment(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASSAY_TEST_SECRET", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter3")
    result = await ws.run(["sh", "-c", "pwd; env"], timeout_s=10, env={"GREETING": "hi"})
    assert result.ok, result
    lines = result.stdout.splitlines()
    assert lines[0] == ws.root
    env = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    assert "hunter2" not in result.stdout
    assert "hunter3" not in result.stdout
    assert env["GREETING"] == "hi"
    assert env["HOME"] == ws.root
    assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    echoed = await ws.run(["cat"], timeout_s=10, stdin=b"piped in")
    assert echoed.stdout == "piped in"


async def test_exit_codes_and_missing_commands(ws: Workspace) -> None:
    failed = await ws.run(["sh", "-c", "echo oops >&2; exit 3"], timeout_s=10)
    assert failed.exit_code == 3
    assert not failed.ok
    assert failed.describe() == "exited with 3: oops"
    missing = await ws.run(["no-such-command-here"], timeout_s=10)
    assert missing.exit_code == 127
    assert "command not found" in missing.stderr
    with pytest.raises(SandboxError):
        await ws.run([], timeout_s=10)
    with pytest.raises(SandboxError):
        await ws.run(["true"], timeout_s=0)


async def test_output_past_the_cap_is_dropped(make_sandbox: MakeSandbox) -> None:
    sandbox = make_sandbox(limits=Limits(output_bytes=1000))
    workspace = await sandbox.open(TENANT_A, new_run_id(), BranchId(0))
    result = await workspace.run(["head", "-c", "100000", "/dev/zero"], timeout_s=10)
    assert result.ok
    assert len(result.stdout) == 1000
    assert result.truncated
    await sandbox.discard(workspace)


async def test_files_written_by_assay_and_by_commands_are_shared(ws: Workspace) -> None:
    await ws.write_file("in/data.txt", b"41")
    result = await ws.run(
        ["sh", "-c", "echo $(( $(cat in/data.txt) + 1 )) > out.txt"], timeout_s=10
    )
    assert result.ok, result
    assert await ws.read_file("out.txt") == b"42\n"
    await ws.write_file("in/data.txt", b"1")  # Assay can overwrite a file
    assert await ws.read_file("in/data.txt") == b"1"


# -- network -------------------------------------------------------------------------------


async def _loopback_server() -> tuple[asyncio.Server, int, list[int]]:
    accepted: list[int] = []

    async def on_connect(_r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, port, accepted


@pytest.mark.skipif(BASH is None, reason="bash (for /dev/tcp) is not installed")
async def test_a_command_cannot_reach_a_loopback_server(make_sandbox: MakeSandbox) -> None:
    denied = make_sandbox()
    if not denied.capabilities.network_isolated:
        pytest.skip("no network namespace can be made here; network tools are refused instead")
    allowed = make_sandbox(network=NetworkPolicy.ALLOW)
    assert allowed.capabilities.network_allowed
    assert not allowed.capabilities.network_isolated
    server, port, accepted = await _loopback_server()
    probe = [str(BASH), "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected"]
    try:
        inside = await denied.open(TENANT_A, new_run_id(), BranchId(0))
        blocked = await inside.run(probe, timeout_s=10)
        assert blocked.exit_code != 0
        assert "connected" not in blocked.stdout
        assert accepted == []
        # The same command with the network allowed does connect: the test can tell.
        outside = await allowed.open(TENANT_A, new_run_id(), BranchId(0))
        reached = await outside.run(probe, timeout_s=10)
        assert reached.ok, reached
        assert reached.stdout.strip() == "connected"
        for _ in range(100):
            if accepted:
                break
            await asyncio.sleep(0.01)
        assert accepted == [1]
    finally:
        server.close()
        await server.wait_closed()


# -- limits --------------------------------------------------------------------------------


async def test_a_cpu_burning_command_is_killed_by_its_cpu_limit(
    make_sandbox: MakeSandbox,
) -> None:
    sandbox = make_sandbox(limits=Limits(cpu_s=1))
    workspace = await sandbox.open(TENANT_A, new_run_id(), BranchId(0))
    t0 = time.monotonic()
    result = await workspace.run(["sh", "-c", "while :; do :; done"], timeout_s=60)
    assert not result.timed_out
    assert result.exit_code in (-signal.SIGXCPU, -signal.SIGKILL)
    assert time.monotonic() - t0 < 30
    await sandbox.discard(workspace)


async def test_a_file_larger_than_the_limit_cannot_be_written(make_sandbox: MakeSandbox) -> None:
    limit = 64 * 1024
    sandbox = make_sandbox(limits=Limits(file_size_bytes=limit))
    workspace = await sandbox.open(TENANT_A, new_run_id(), BranchId(0))
    result = await workspace.run(["sh", "-c", "head -c 200000 /dev/zero > big"], timeout_s=10)
    assert result.exit_code != 0
    assert (Path(workspace.root) / "big").stat().st_size <= limit
    with pytest.raises(LimitExceeded):
        await workspace.write_file("big2", b"x" * (limit + 1))
    await sandbox.discard(workspace)


async def test_a_fork_bomb_is_bounded_by_the_process_limit(make_sandbox: MakeSandbox) -> None:
    sandbox = make_sandbox(limits=Limits(processes=8))
    workspace = await sandbox.open(TENANT_A, new_run_id(), BranchId(0))
    bomb = "i=0; while [ $i -lt 40 ]; do sleep 5 & i=$((i+1)); echo started; done; wait"
    try:
        result = await workspace.run(["sh", "-c", bomb], timeout_s=30)
        started = result.stdout.count("started")
        assert started <= 8, result
        assert result.exit_code != 0
        assert "fork" in result.stderr.lower()
    finally:
        _kill_left_in(workspace.root)
        await sandbox.discard(workspace)


@pytest.mark.skipif(PYTHON3 is None, reason="no system python3 to allocate memory with")
async def test_an_allocation_past_the_memory_limit_fails(make_sandbox: MakeSandbox) -> None:
    sandbox = make_sandbox(limits=Limits(address_space_bytes=256 << 20))
    workspace = await sandbox.open(TENANT_A, new_run_id(), BranchId(0))
    small = await workspace.run([str(PYTHON3), "-c", "b = bytearray(8 << 20)"], timeout_s=30)
    assert small.ok, small
    big = await workspace.run([str(PYTHON3), "-c", "b = bytearray(1 << 30)"], timeout_s=30)
    assert big.exit_code != 0
    assert "MemoryError" in big.stderr
    await sandbox.discard(workspace)


async def test_a_timeout_kills_the_command_and_its_children(ws: Workspace) -> None:
    t0 = time.monotonic()
    result = await ws.run(["sh", "-c", "sleep 60 & sleep 60 & wait"], timeout_s=1)
    assert result.timed_out
    assert result.exit_code == -signal.SIGKILL
    assert time.monotonic() - t0 < 10
    await asyncio.sleep(0.2)
    assert _left_in(ws.root) == []


async def test_cancelling_a_run_kills_the_command(ws: Workspace) -> None:
    task = asyncio.ensure_future(ws.run(["sh", "-c", "sleep 60 & sleep 60"], timeout_s=120))
    for _ in range(200):
        if len(_left_in(ws.root)) >= 2:
            break
        await asyncio.sleep(0.02)
    assert _left_in(ws.root), "the command did not start"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.2)
    assert _left_in(ws.root) == []


async def test_a_process_that_leaves_the_group_still_dies_with_the_command(
    sandbox: LocalSandbox, ws: Workspace
) -> None:
    if not sandbox.capabilities.processes_contained:
        pytest.skip("no PID namespace here: only the process group is killed")
    result = await ws.run(
        ["sh", "-c", "setsid sleep 60 >/dev/null 2>&1 </dev/null & echo started"], timeout_s=10
    )
    assert result.ok
    await asyncio.sleep(0.2)
    assert _left_in(ws.root) == []


async def test_commands_run_as_a_separate_user_when_assay_is_root(
    sandbox: LocalSandbox, ws: Workspace
) -> None:
    if os.geteuid() != 0:
        pytest.skip("Assay is not root here: commands run as its own user")
    assert sandbox.capabilities.separate_user
    result = await ws.run(["id", "-u"], timeout_s=10)
    assert result.stdout.strip() == "65534"
    cannot = await ws.run(["sh", "-c", "cat /root/.profile || ls /root"], timeout_s=10)
    assert cannot.exit_code != 0


# -- paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../x", "", ".", "a/..", "x\x00y"])
async def test_paths_leaving_the_workspace_are_refused(ws: Workspace, path: str) -> None:
    with pytest.raises(PathRefused):
        await ws.write_file(path, b"no")
    with pytest.raises(PathRefused):
        await ws.read_file(path)


async def test_symbolic_links_are_never_followed(ws: Workspace, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("do not read")
    made = await ws.run(
        ["sh", "-c", f"ln -s {outside} dir && ln -s {outside}/secret.txt file && ln -s . self"],
        timeout_s=10,
    )
    assert made.ok, made
    for path in ("dir/secret.txt", "file", "self/file"):
        with pytest.raises(PathRefused):
            await ws.read_file(path)
    with pytest.raises(PathRefused):
        await ws.write_file("dir/planted.txt", b"no")
    with pytest.raises(PathRefused):
        await ws.write_file("file", b"no")
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "do not read"


async def test_a_planted_hard_link_is_refused_when_running_as_root(
    sandbox: LocalSandbox, ws: Workspace, tmp_path: Path
) -> None:
    if not sandbox.capabilities.separate_user:
        pytest.skip("commands run as Assay's own user: ownership tells nothing")
    secret = tmp_path / "root-only.txt"
    secret.write_text("root's")
    os.link(secret, Path(ws.root) / "linked.txt")  # as if a command had made it
    with pytest.raises(PathRefused):
        await ws.read_file("linked.txt")
    with pytest.raises(PathRefused):
        await ws.write_file("linked.txt", b"overwritten")
    assert secret.read_text() == "root's"
    with pytest.raises(PathRefused):
        await sandbox.snapshot(ws)


# -- snapshots, forks and tenants ----------------------------------------------------------


SCRIPT = b"#!/bin/sh\necho from the snapshot\n"


async def _populate(workspace: Workspace) -> None:
    await workspace.write_file("src/main.sh", SCRIPT)
    made = await workspace.run(
        ["sh", "-c", "chmod +x src/main.sh && ln -s src/main.sh run && ln -s /usr/bin abs"],
        timeout_s=10,
    )
    assert made.ok, made


async def test_a_snapshot_restores_into_a_separate_copy(sandbox: LocalSandbox) -> None:
    run = new_run_id()
    parent = await sandbox.open(TENANT_A, run, BranchId(0))
    await _populate(parent)
    ref = await sandbox.snapshot(parent)
    fork = await sandbox.restore(TENANT_A, run, BranchId(1), ref)
    assert fork.root != parent.root
    assert await fork.read_file("src/main.sh") == SCRIPT
    ran = await fork.run(["./run"], timeout_s=10)
    assert ran.stdout == "from the snapshot\n", ran
    assert os.readlink(Path(fork.root) / "abs") == "/usr/bin"
    await fork.write_file("src/main.sh", b"echo changed in the fork\n")
    assert await parent.read_file("src/main.sh") == SCRIPT
    # Same contents, same ref: content-addressed and deterministic.
    twin = await sandbox.open(TENANT_A, new_run_id(), BranchId(0))
    await _populate(twin)
    assert await sandbox.snapshot(twin) == ref
    # A snapshot can also be the base of a new run's workspace.
    based = await sandbox.open(TENANT_A, new_run_id(), BranchId(0), base=ref)
    assert await based.read_file("src/main.sh") == SCRIPT
    for workspace in (parent, fork, twin, based):
        await sandbox.discard(workspace)


async def test_pipes_are_left_out_of_a_snapshot(sandbox: LocalSandbox, ws: Workspace) -> None:
    made = await ws.run(["sh", "-c", "mkfifo pipe && echo kept > file"], timeout_s=10)
    assert made.ok, made
    ref = await sandbox.snapshot(ws)
    restored = await sandbox.restore(TENANT_A, new_run_id(), BranchId(0), ref)
    assert sorted(os.listdir(restored.root)) == ["file"]
    await sandbox.discard(restored)


async def test_a_tenant_cannot_open_or_restore_another_tenants_snapshot(
    sandbox: LocalSandbox,
) -> None:
    mine = await sandbox.open(TENANT_A, new_run_id(), BranchId(0))
    await mine.write_file("a.txt", b"tenant A's")
    ref = await sandbox.snapshot(mine)
    assert str(TENANT_A) in mine.root
    with pytest.raises(SnapshotMissing):
        await sandbox.restore(TENANT_B, new_run_id(), BranchId(0), ref)
    with pytest.raises(SnapshotMissing):
        await sandbox.open(TENANT_B, new_run_id(), BranchId(0), base=ref)
    with pytest.raises(SnapshotMissing):
        await sandbox.restore(TENANT_A, new_run_id(), BranchId(0), "../../" + ref[:58])
    await sandbox.discard(mine)


async def test_a_damaged_snapshot_is_refused(sandbox: LocalSandbox) -> None:
    ref = await sandbox.blobs.put(TENANT_A, b"not a tar archive at all" * 40)
    run = new_run_id()
    with pytest.raises(SandboxError):
        await sandbox.restore(TENANT_A, run, BranchId(0), ref)
    assert not (sandbox.base / str(TENANT_A) / run / "0").exists()


async def test_a_workspace_of_another_provider_is_refused(
    sandbox: LocalSandbox, make_sandbox: MakeSandbox, ws: Workspace
) -> None:
    other = make_sandbox()
    with pytest.raises(SandboxError):
        await other.snapshot(ws)
    with pytest.raises(SandboxError):
        await other.discard(ws)
