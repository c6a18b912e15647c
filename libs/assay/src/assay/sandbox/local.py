"""The local sandbox provider: workspaces in a directory, commands under rlimits (DESIGN §9).

A workspace is `<root>/<tenant>/<run>/<branch>`. Each command runs through
`_launcher.py` in its own process group (inside the workspace's resident sandbox
when one is up: see `resident`), with the workspace as cwd, a minimal
environment, `setrlimit` limits, an empty network namespace unless the network
is allowed, a PID namespace when one can be made, and — when Assay runs as
root — as an unprivileged uid. At its wall-clock timeout the whole process
group is killed. What could actually be enforced is probed once, at
construction, and stated in `capabilities`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from assay.kernel.ids import BranchId, RunId, TenantId
from assay.sandbox.archive import pack, unpack
from assay.sandbox.confined import Owner, read, write
from assay.sandbox.port import (
    CommandResult,
    NetworkPolicy,
    SandboxCapabilities,
    SandboxError,
    SandboxUnavailable,
    SnapshotMissing,
    Workspace,
)
from assay.store.ports import BlobStore

if TYPE_CHECKING:
    from assay.sandbox.resident import LocalResident

log = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("_launcher.py")
NOBODY = 65534
"""The uid and gid commands run as when Assay runs as root (`nobody`/`nogroup`)."""
SEARCH_PATH = "/usr/local/bin:/usr/bin:/bin"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_SCOPE = re.compile(r"[a-z0-9_-]{0,64}")
_REF = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Limits:
    """Resource limits of one command, set with `setrlimit` in the child.

    Attributes:
        cpu_s: CPU seconds (SIGXCPU, then SIGKILL a second later).
        address_space_bytes: virtual memory (allocations past it fail).
        processes: processes the command may start (counted for its uid,
            on top of what that uid already runs).
        file_size_bytes: largest file a command may write (SIGXFSZ past it);
            also the largest file Assay writes or reads in a workspace.
        open_files: open file descriptors.
        output_bytes: stdout and stderr kept, each; the rest is dropped.
        snapshot_bytes: largest snapshot archive.
    """

    cpu_s: int = 60
    address_space_bytes: int = 2 << 30
    processes: int = 64
    file_size_bytes: int = 256 << 20
    open_files: int = 256
    output_bytes: int = 1 << 20
    snapshot_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"sandbox limit {name} must be positive, not {value}")


@dataclass(frozen=True)
class LocalWorkspace:
    """A workspace directory of a `LocalSandbox` (see the `Workspace` port)."""

    sandbox: LocalSandbox = field(repr=False)
    tenant: TenantId
    run_id: RunId
    branch: BranchId
    path: Path

    @property
    def root(self) -> str:
        """The workspace's directory."""
        return str(self.path)

    async def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run a command in the workspace (see `Workspace.run`)."""
        return await self.sandbox.run_in(self, argv, timeout_s=timeout_s, stdin=stdin, env=env)

    async def write_file(self, path: str, content: bytes) -> None:
        """Write a file in the workspace; links are never followed."""
        s = self.sandbox
        await asyncio.to_thread(
            write, self.root, path, content, limit=s.limits.file_size_bytes, owner=s.owner
        )

    async def read_file(self, path: str) -> bytes:
        """Read a regular file of the workspace; links are never followed."""
        s = self.sandbox
        return await asyncio.to_thread(
            read, self.root, path, limit=s.limits.file_size_bytes, owner=s.owner
        )


@dataclass(frozen=True)
class _Mode:
    net: bool
    pid: bool


class LocalSandbox:
    """Workspaces under `root`, snapshots in `blobs` (see `SandboxProvider`).

    Args:
        root: directory of every workspace (created if missing).
        blobs: where snapshots go, under each workspace's tenant.
        limits: resource limits of each command.
        network: `DENY` (default) runs commands in an empty network namespace
            and refuses network tools; `ALLOW` gives commands the host's network.
        uid, gid: who commands run as when Assay runs as root (default `nobody`).
        python: interpreter that runs the launcher (default: this one).

    Raises:
        SandboxUnavailable: not even a plain command could be run here.
    """

    def __init__(
        self,
        root: str | Path,
        blobs: BlobStore,
        *,
        limits: Limits | None = None,
        network: NetworkPolicy = NetworkPolicy.DENY,
        uid: int | None = None,
        gid: int | None = None,
        python: str | None = None,
    ) -> None:
        self.base = Path(root).absolute()
        self.blobs = blobs
        self.limits = limits or Limits()
        self.network = network
        self._python = python or sys.executable
        if not self._python:
            raise SandboxUnavailable("no Python interpreter to run the sandbox launcher")
        self._userns = os.geteuid() != 0
        self._uid = None if self._userns else (NOBODY if uid is None else uid)
        self._gid = None if self._userns else (NOBODY if gid is None else gid)
        self.owner = Owner(self._uid, self._gid)
        self._dirs = threading.Lock()
        self._residents: dict[Path, LocalResident] = {}
        """The resident sandbox up in each workspace: its commands run inside it."""
        self.base.mkdir(mode=0o711, parents=True, exist_ok=True)
        self._mode = self._detect()
        self.capabilities = SandboxCapabilities(
            network=network,
            network_isolated=self._mode.net,
            processes_contained=self._mode.pid,
            separate_user=self._uid is not None,
        )

    # -- what this machine allows -------------------------------------------------------

    def _detect(self) -> _Mode:
        isolate = self.network is NetworkPolicy.DENY
        modes = [
            _Mode(isolate, True),
            _Mode(isolate, False),
            _Mode(False, True),
            _Mode(False, False),
        ]
        failures: list[str] = []
        for mode in dict.fromkeys(modes):
            ok, why = self._probe(mode)
            if ok:
                if isolate and not mode.net:
                    log.warning(
                        "no network namespace can be made here: sandboxed commands can reach "
                        "the network; only tools that declare needs_network are refused (%s)",
                        "; ".join(failures),
                    )
                return mode
            failures.append(why)
        raise SandboxUnavailable(f"the local sandbox cannot run commands here: {failures[-1]}")

    def _probe(self, mode: _Mode) -> tuple[bool, str]:
        with tempfile.TemporaryFile() as spec:
            spec.write(json.dumps(self._spec(["true"], {}, mode, probe=True)).encode())
            spec.flush()
            spec.seek(0)
            try:
                done = subprocess.run(
                    [self._python, "-I", "-S", str(LAUNCHER), str(spec.fileno())],
                    cwd=self.base,
                    env=_launch_env(),
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    pass_fds=(spec.fileno(),),
                    start_new_session=True,
                    timeout=30,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                return False, str(exc)
        return done.returncode == 0, done.stderr.decode(errors="replace").strip()

    def _spec(
        self, argv: list[str], env: dict[str, str], mode: _Mode, *, probe: bool = False
    ) -> dict[str, Any]:
        lim = self.limits
        return {
            "argv": argv,
            "env": env,
            "net": mode.net,
            "pid": mode.pid,
            "userns": self._userns and (mode.net or mode.pid),
            "uid": self._uid,
            "gid": self._gid,
            "probe": probe,
            "parent": os.getpid(),
            "limits": {
                "cpu": lim.cpu_s,
                "as": lim.address_space_bytes,
                "nproc": lim.processes + _processes_of(self._uid or os.getuid()),
                "fsize": lim.file_size_bytes,
                "nofile": lim.open_files,
                "core": 0,
            },
        }

    # -- workspaces -----------------------------------------------------------------------

    def _path(self, tenant: TenantId, run_id: RunId, branch: BranchId, scope: str) -> Path:
        try:
            tenant_dir = str(uuid.UUID(str(tenant)))
        except ValueError as exc:
            raise SandboxError(f"tenant {str(tenant)[:80]!r} is not a tenant id") from exc
        if not _NAME.fullmatch(str(run_id)):
            raise SandboxError(f"run id {str(run_id)[:80]!r} cannot name a workspace")
        if not isinstance(branch, int) or branch < 0:
            raise SandboxError(f"branch {branch!r} cannot name a workspace")
        if not _SCOPE.fullmatch(scope):
            raise SandboxError(f"scope {scope[:80]!r} is not [a-z0-9_-]{{0,64}}")
        leaf = f"{int(branch)}-{scope}" if scope else str(int(branch))
        return self.base / tenant_dir / str(run_id) / leaf

    def _fresh(self, path: Path) -> None:
        with self._dirs:
            for parent in (path.parent.parent, path.parent):
                parent.mkdir(mode=0o711, exist_ok=True)
            if path.exists() or path.is_symlink():
                _remove(path)
            path.mkdir(mode=0o700)
            if self._uid is not None:
                os.chown(path, self._uid, -1 if self._gid is None else self._gid)

    async def open(
        self,
        tenant: TenantId,
        run_id: RunId,
        branch: BranchId,
        base: str | None = None,
        *,
        scope: str = "",
    ) -> LocalWorkspace:
        """A fresh workspace, empty or a copy of the snapshot `base` (see the port)."""
        path = self._path(tenant, run_id, branch, scope)
        data = None if base is None else await self._fetch(tenant, base)
        await asyncio.to_thread(self._fresh, path)
        ws = LocalWorkspace(self, tenant, run_id, branch, path)
        if data is not None:
            try:
                await asyncio.to_thread(
                    unpack, data, ws.root, file_limit=self.limits.file_size_bytes, owner=self.owner
                )
            except BaseException:
                await self.discard(ws)
                raise
        return ws

    async def restore(
        self,
        tenant: TenantId,
        run_id: RunId,
        branch: BranchId,
        snapshot_ref: str,
        *,
        scope: str = "",
    ) -> LocalWorkspace:
        """A new workspace holding its own copy of a snapshot (see the port)."""
        return await self.open(tenant, run_id, branch, snapshot_ref, scope=scope)

    async def _fetch(self, tenant: TenantId, ref: str) -> bytes:
        if not _REF.fullmatch(ref):
            raise SnapshotMissing(f"not a snapshot ref: {ref[:80]!r}")
        data = await self.blobs.get(tenant, ref)
        if data is None:
            raise SnapshotMissing(f"tenant {tenant} has no snapshot {ref}")
        return data

    async def snapshot(self, workspace: Workspace) -> str:
        """Archive the workspace into its tenant's blobs; return the ref."""
        ws = self._own(workspace)
        data = await asyncio.to_thread(
            pack, ws.root, limit=self.limits.snapshot_bytes, owner=self.owner
        )
        return await self.blobs.put(ws.tenant, data)

    async def discard(self, workspace: Workspace) -> None:
        """Remove the workspace directory, and its run's directories once empty."""
        ws = self._own(workspace)
        await asyncio.to_thread(self._remove_tree, ws.path)

    async def discard_tenant(self, tenant: TenantId) -> int:
        """Remove the tenant's directory of workspaces; how many runs had one."""
        try:
            path = self.base / str(uuid.UUID(str(tenant)))
        except ValueError as exc:
            raise SandboxError(f"tenant {str(tenant)[:80]!r} is not a tenant id") from exc
        return await asyncio.to_thread(self._remove_tenant, path)

    def _remove_tenant(self, path: Path) -> int:
        with self._dirs:
            if not path.is_dir():
                return 0
            runs = sum(1 for _ in path.iterdir())
            _remove(path)
            return runs

    def _remove_tree(self, path: Path) -> None:
        with self._dirs:
            _remove(path)
            for parent in (path.parent, path.parent.parent):
                try:
                    parent.rmdir()
                except OSError:
                    break

    def _own(self, workspace: Workspace) -> LocalWorkspace:
        if not isinstance(workspace, LocalWorkspace) or workspace.sandbox is not self:
            raise SandboxError("the workspace does not belong to this sandbox")
        return workspace

    # -- the resident sandbox (`resident`) ------------------------------------------------

    @property
    def python(self) -> str:
        """The interpreter that runs the launcher (and the resident sandbox)."""
        return self._python

    def launch_spec(self, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
        """The launcher's spec for `argv` under this sandbox's limits and namespaces."""
        return self._spec(argv, env, self._mode)

    def launcher_argv(self, spec_fd: int) -> list[str]:
        """How the launcher is started with its spec on `spec_fd`."""
        return [self._python, "-I", "-S", str(LAUNCHER), str(spec_fd)]

    @property
    def launcher_source(self) -> str:
        """The launcher's text: a resident sandbox runs it (as `-c`) for each command,
        since the sandbox's uid may not be able to read Assay's files."""
        return LAUNCHER.read_text()

    async def start_resident(
        self, workspace: Workspace, *, generation: int, identity: str, memory_bytes: int
    ) -> LocalResident:
        """Start a resident sandbox generation in `workspace` (see `ResidentSandboxes`).

        Until it is stopped, the workspace's commands run inside it (see `run_in`).
        """
        from assay.sandbox.resident import start_resident

        ws = self._own(workspace)
        if (old := self._residents.get(ws.path)) is not None and old.up:
            raise SandboxError(f"workspace {ws.root} already has a resident sandbox")
        resident = await start_resident(
            self, ws, generation=generation, identity=identity, memory_bytes=memory_bytes
        )
        resident.on_stop = self._forget
        self._residents[ws.path] = resident
        return resident

    def _forget(self, resident: LocalResident) -> None:
        for path, known in list(self._residents.items()):
            if known is resident:
                del self._residents[path]

    def resident_of(self, workspace: Workspace) -> LocalResident | None:
        """The resident sandbox up in `workspace`, if any."""
        resident = self._residents.get(self._own(workspace).path)
        return resident if resident is not None and resident.up else None

    # -- commands -------------------------------------------------------------------------

    async def run_in(
        self,
        ws: LocalWorkspace,
        argv: Sequence[str],
        *,
        timeout_s: float,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run `argv` in `ws` (see `Workspace.run`)."""
        args = [str(a) for a in argv]
        if not args or not args[0]:
            raise SandboxError("an empty command")
        if timeout_s <= 0:
            raise SandboxError(f"timeout must be positive, not {timeout_s}")
        full_env = {"PATH": SEARCH_PATH, "HOME": ws.root, "LANG": "C.UTF-8", **(env or {})}
        resident = self.resident_of(ws)
        if resident is not None:  # inside it: already isolated, limited and unprivileged
            inner = _Mode(net=False, pid=False)
            inside = await asyncio.to_thread(self._spec, args, full_env, inner)
            inside["uid"] = inside["gid"] = None
            return await resident.run(
                inside, stdin=stdin, timeout_s=timeout_s, output_bytes=self.limits.output_bytes
            )
        # Off the loop: the process count reads /proc.
        encoded = await asyncio.to_thread(
            lambda: json.dumps(self._spec(args, full_env, self._mode)).encode()
        )
        with tempfile.TemporaryFile() as spec:
            spec.write(encoded)
            spec.flush()
            spec.seek(0)
            try:
                proc = await asyncio.create_subprocess_exec(
                    self._python,
                    "-I",
                    "-S",
                    str(LAUNCHER),
                    str(spec.fileno()),
                    cwd=ws.path,
                    env=_launch_env(),
                    stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    pass_fds=(spec.fileno(),),
                    start_new_session=True,
                )
            except OSError as exc:
                raise SandboxError(f"cannot start the sandbox launcher: {exc}") from exc
        return await _supervise(proc, stdin, timeout_s, self.limits.output_bytes)


async def _supervise(
    proc: asyncio.subprocess.Process, stdin: bytes | None, timeout_s: float, cap: int
) -> CommandResult:
    """Feed, drain and wait for a launched command; kill its group at the end, always."""
    assert proc.stdout is not None
    assert proc.stderr is not None
    readers = asyncio.gather(_drain(proc.stdout, cap), _drain(proc.stderr, cap))
    feeder = None if stdin is None else asyncio.ensure_future(_feed(proc, stdin))
    timed_out = False
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            timed_out = True
        _kill_group(proc.pid)  # what the command left behind dies with it
        code = await proc.wait()
        try:
            (out, cut_out), (err, cut_err) = await asyncio.wait_for(readers, 5.0)
        except TimeoutError:  # a process left the group and still holds the pipes
            out, cut_out, err, cut_err = b"", True, b"(output lost: a process escaped)", True
    finally:
        if proc.returncode is None:  # cancelled: nothing may outlive the call
            _kill_group(proc.pid)
            await proc.wait()
        for task in (readers, feeder):
            if task is not None and not task.done():
                task.cancel()
    return CommandResult(
        exit_code=code,
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        timed_out=timed_out,
        truncated=cut_out or cut_err,
    )


async def _drain(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    buf = bytearray()
    cut = False
    while chunk := await stream.read(1 << 16):
        room = cap - len(buf)
        if room > 0:
            buf += chunk[:room]
        cut = cut or len(chunk) > room
    return bytes(buf), cut


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command did not read all of it


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _launch_env() -> dict[str, str]:
    """The launcher's own environment: nothing inherited from Assay's."""
    return {"PATH": SEARCH_PATH, "LANG": "C.UTF-8"}


def _processes_of(uid: int) -> int:
    """How many processes `uid` runs now (RLIMIT_NPROC counts them all)."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                count += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                continue
    return count


def _remove(path: Path) -> None:
    """Remove a tree even where a command took its own permissions away."""

    def retry(func: Any, target: str, _exc: Any) -> None:
        os.chmod(os.path.dirname(target), 0o700)
        if os.path.isdir(target) and not os.path.islink(target):
            os.chmod(target, 0o700)
        func(target)

    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, onerror=retry)
