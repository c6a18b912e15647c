"""The sandbox port: a run's workspace, where tools and command verifiers run (DESIGN §9).

A `SandboxProvider` hands out one writable `Workspace` per (tenant, run,
branch), copies it into the `BlobStore` as a content-addressed snapshot, and
restores a snapshot into a new workspace so a fork gets its own copy. What a
provider really isolates is stated in its `capabilities`, never assumed.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from assay.kernel.errors import AssayError
from assay.kernel.ids import BranchId, RunId, TenantId


class SandboxError(AssayError):
    """The sandbox could not do what was asked; nothing is assumed to have happened."""


class PathRefused(SandboxError):
    """A path is absolute, escapes the workspace, or goes through a symbolic link."""


class SnapshotMissing(SandboxError):
    """The tenant's blob store holds no such snapshot (or it is another tenant's)."""


class SandboxUnavailable(SandboxError):
    """The provider cannot run commands on this machine (the reason is in the message)."""


class LimitExceeded(SandboxError):
    """A file or snapshot is larger than the provider's limits allow."""


class NetworkPolicy(enum.Enum):
    """Whether commands and tools may use the network. `DENY` is the default."""

    DENY = "deny"
    ALLOW = "allow"


@dataclass(frozen=True)
class SandboxCapabilities:
    """What a provider actually enforces on this machine, as detected at start.

    Attributes:
        network: the configured policy.
        network_isolated: commands run in an empty network namespace (no route
            to the host's interfaces, loopback included). False under `DENY`
            means the namespace could not be made: commands could reach the
            network, and only tools that declare `needs_network` are refused.
        processes_contained: every process a command starts dies with it (a
            PID namespace); False means only its process group is killed.
        separate_user: commands run as a dedicated unprivileged uid, not as
            the Assay process's user (only possible when Assay runs as root).
    """

    network: NetworkPolicy
    network_isolated: bool
    processes_contained: bool
    separate_user: bool

    @property
    def network_allowed(self) -> bool:
        """Whether the configuration allows network access."""
        return self.network is NetworkPolicy.ALLOW


@dataclass(frozen=True)
class CommandResult:
    """What a command did in the workspace.

    `exit_code` is negative when the command was killed by a signal (-9 for
    SIGKILL, as `subprocess` reports it); 125 means the sandbox could not set
    itself up, 126 the command could not be executed, 127 it was not found.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False

    @property
    def ok(self) -> bool:
        """Exited 0 within its time."""
        return self.exit_code == 0 and not self.timed_out

    def describe(self, tail: int = 300) -> str:
        """How the command ended, on one line, with the end of stderr (or stdout).

        For example `exited with 2: grep: x: No such file`, `was killed by
        signal 24`, `timed out`.
        """
        if self.timed_out:
            how = "timed out"
        elif self.exit_code < 0:
            how = f"was killed by signal {-self.exit_code}"
        else:
            how = f"exited with {self.exit_code}"
        text = (self.stderr.strip() or self.stdout.strip()).replace("\n", " | ")
        if len(text) > tail:
            text = "…" + text[-tail:]
        return f"{how}: {text}" if text and not self.timed_out else how


class Workspace(Protocol):
    """One run's writable workspace inside a sandbox."""

    @property
    def tenant(self) -> TenantId:
        """The tenant that owns the workspace (its snapshots go to this tenant's blobs)."""
        ...

    @property
    def root(self) -> str:
        """Identity of the workspace for logs and evidence (a path for the local provider)."""
        ...

    async def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run a command in the workspace under the sandbox's limits.

        The command starts in the workspace with a minimal environment (plus
        `env`); at `timeout_s` it and every process it started are killed and
        the result says `timed_out`. Cancelling the call kills them too.

        Raises:
            SandboxError: the command could not be started at all.
        """
        ...

    async def write_file(self, path: str, content: bytes) -> None:
        """Write a file inside the workspace, creating its directories.

        Raises:
            PathRefused: `path` is absolute, escapes the workspace or passes a symlink.
            LimitExceeded: `content` is larger than the file size limit.
        """
        ...

    async def read_file(self, path: str) -> bytes:
        """Read a file inside the workspace.

        Raises:
            PathRefused: as for `write_file`, or the path is not a regular file.
            FileNotFoundError: there is no such file.
        """
        ...


class SandboxProvider(Protocol):
    """Where workspaces come from. Every workspace belongs to exactly one tenant."""

    @property
    def capabilities(self) -> SandboxCapabilities:
        """What this provider enforces here (detected, not configured)."""
        ...

    async def open(
        self,
        tenant: TenantId,
        run_id: RunId,
        branch: BranchId,
        base: str | None = None,
        *,
        scope: str = "",
    ) -> Workspace:
        """A fresh writable workspace for (tenant, run, branch).

        It starts as a copy of `base` — the blob ref of a snapshot in the
        tenant's blobs — or empty. A leftover workspace at the same identity
        (from a crash) is replaced, never reused. `scope` names a second,
        separate workspace of the same branch (a verifier's).

        Raises:
            SnapshotMissing: `base` is not one of this tenant's blobs.
        """
        ...

    async def snapshot(self, workspace: Workspace) -> str:
        """Archive the workspace into the tenant's blobs; return its content-addressed ref.

        The same contents give the same ref. Symbolic links are kept as links;
        sockets, pipes and devices are left out.
        """
        ...

    async def restore(
        self,
        tenant: TenantId,
        run_id: RunId,
        branch: BranchId,
        snapshot_ref: str,
        *,
        scope: str = "",
    ) -> Workspace:
        """A new workspace for (tenant, run, branch) holding its own copy of a snapshot.

        Raises:
            SnapshotMissing: the ref is not one of this tenant's blobs.
        """
        ...

    async def discard(self, workspace: Workspace) -> None:
        """Remove the workspace and everything in it. Discarding twice is harmless."""
        ...

    async def discard_tenant(self, tenant: TenantId) -> int:
        """Remove every workspace of `tenant` (a tenant's deletion); how many runs had
        one. A tenant with none is a no-op (0)."""
        ...


@dataclass(frozen=True)
class SuspendPolicy:
    """When a resident sandbox is released, and what it holds.

    Attributes:
        idle_after_s: a model call that lasts this long releases the sandbox; an
            `await` step releases it at once.
        resident_memory_bytes: memory the resident process holds (an agent's
            interpreter or shell, in the local provider).
    """

    idle_after_s: float
    resident_memory_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not self.idle_after_s >= 0 or self.resident_memory_bytes < 0:
            raise ValueError("idle_after_s and resident_memory_bytes must be >= 0")


class ResidentSandbox(Protocol):
    """One generation of a run's resident sandbox: a long-lived process in the run's
    workspace that holds memory between steps, as an agent keeps a shell or an
    interpreter. A new generation is a new process; nothing of an old one survives."""

    @property
    def generation(self) -> int:
        """Which generation of the run's resident sandbox this is (1, 2, …)."""
        ...

    @property
    def identity(self) -> str:
        """Names this generation and nothing else: (tenant, run, branch, generation, nonce)."""
        ...

    async def ping(self) -> str:
        """Ask the process who it is; its answer, one line.

        Raises:
            SandboxError: it did not answer in time, or it is gone.
        """
        ...

    def memory_bytes(self) -> int:
        """Resident memory of its process tree now (RSS, from `/proc`); 0 once stopped."""
        ...

    async def stop(self) -> None:
        """Stop it and return only once every process of it is gone. Twice is harmless."""
        ...


@runtime_checkable
class ResidentSandboxes(SandboxProvider, Protocol):
    """A provider that can keep a resident sandbox beside a run's workspace."""

    async def start_resident(
        self, workspace: Workspace, *, generation: int, identity: str, memory_bytes: int
    ) -> ResidentSandbox:
        """Start a generation in `workspace` holding `memory_bytes`, once it says it is ready.

        Raises:
            SandboxError: it could not start, or did not announce itself in time.
        """
        ...
