"""Sandboxed tool execution: the `SandboxProvider` port and its providers (DESIGN §9)."""

from assay.sandbox.port import CommandResult, Workspace

__all__ = ["CommandResult", "Workspace"]
