"""Sandboxed execution: the `SandboxProvider` port and the local provider (DESIGN §9)."""

from assay.sandbox.local import Limits, LocalSandbox, LocalWorkspace
from assay.sandbox.port import (
    CommandResult,
    LimitExceeded,
    NetworkPolicy,
    PathRefused,
    SandboxCapabilities,
    SandboxError,
    SandboxProvider,
    SandboxUnavailable,
    SnapshotMissing,
    Workspace,
)

__all__ = [
    "CommandResult",
    "LimitExceeded",
    "Limits",
    "LocalSandbox",
    "LocalWorkspace",
    "NetworkPolicy",
    "PathRefused",
    "SandboxCapabilities",
    "SandboxError",
    "SandboxProvider",
    "SandboxUnavailable",
    "SnapshotMissing",
    "Workspace",
]
