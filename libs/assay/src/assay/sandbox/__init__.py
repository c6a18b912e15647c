"""Sandboxed execution: the `SandboxProvider` port and the local provider (DESIGN §9)."""

from typing import TYPE_CHECKING

from assay.kernel.lazy import lazy_exports

if TYPE_CHECKING:
    from assay.sandbox.local import Limits, LocalSandbox, LocalWorkspace
    from assay.sandbox.port import (
        CommandResult,
        LimitExceeded,
        NetworkPolicy,
        PathRefused,
        ResidentSandbox,
        ResidentSandboxes,
        SandboxCapabilities,
        SandboxError,
        SandboxProvider,
        SandboxUnavailable,
        SnapshotMissing,
        SuspendPolicy,
        Workspace,
    )
else:
    __getattr__ = lazy_exports(
        __name__,
        {
            "assay.sandbox.local": ["Limits", "LocalSandbox", "LocalWorkspace"],
            "assay.sandbox.port": [
                "CommandResult",
                "LimitExceeded",
                "NetworkPolicy",
                "PathRefused",
                "ResidentSandbox",
                "ResidentSandboxes",
                "SandboxCapabilities",
                "SandboxError",
                "SandboxProvider",
                "SandboxUnavailable",
                "SnapshotMissing",
                "SuspendPolicy",
                "Workspace",
            ],
        },
    )

__all__ = [
    "CommandResult",
    "LimitExceeded",
    "Limits",
    "LocalSandbox",
    "LocalWorkspace",
    "NetworkPolicy",
    "PathRefused",
    "ResidentSandbox",
    "ResidentSandboxes",
    "SandboxCapabilities",
    "SandboxError",
    "SandboxProvider",
    "SandboxUnavailable",
    "SnapshotMissing",
    "SuspendPolicy",
    "Workspace",
]
